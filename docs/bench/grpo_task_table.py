#!/usr/bin/env python3
"""The tables of docs/grpo.md "The arithmetic task" from docs/bench/grpo_task.sh's files.

--metrics: every GRPO run's metrics.jsonl rows, each tagged with `variant` and `seed` (grpo_metrics.jsonl). Held-out
accuracy is `eval_reward_numeric` (greedy, 200 held-out prompts): step 0 is the pretrained model ("before"), the
last eval is at the run's stop ("after"): the token budget (grpo.max_generated_tokens), or where the time ran out.
Runs are compared at an equal budget of generated tokens: when every run reached the budget, at its stop (each
overshoots the budget by less than one step's tokens); otherwise at the tokens that every run reached (each run's
last eval at or below them). The curve: mean held-out accuracy over seeds against generated tokens (each run's
last eval at or below each point). The tree goal: the generated tokens at which a variant's mean curve first
reaches plain GRPO's mean final accuracy, against plain GRPO's tokens at its final eval.

    python docs/bench/grpo_task_table.py --metrics docs/bench/s8/grpo_metrics.jsonl --pretrain docs/bench/s8/pretrain_evals.jsonl
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

KEY = "eval_reward_numeric"
RECIPE = {"plain": "grpo_arith.yaml", "curriculum": "grpo_arith_curriculum.yaml", "tree": "grpo_arith_tree.yaml",
          "tree_curriculum": "grpo_arith_tree_curriculum.yaml", "r3": "grpo_arith_r3.yaml",
          "r3_tis": "grpo_arith_r3_tis.yaml"}
NAME = {"plain": "plain GRPO", "curriculum": "curriculum", "tree": "tree rollouts", "tree_curriculum": "tree + curriculum",
        "r3": "routing replay (r3)", "r3_tis": "r3 + tis"}
MISMATCH = ("rollout_logp_diff_mean", "rollout_logp_diff_max", "rollout_kl_k3", "routing_agree_choice",
            "routing_agree_token", "routing_live_agree_choice", "routing_live_agree_token", "rollout_corrected_frac")


def load_runs(path: Path) -> dict:
    runs = defaultdict(list)
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            runs[(r["variant"], r["seed"])].append(r)
    out = {}
    for k, rows in runs.items():
        rows.sort(key=lambda r: r["step"])
        evals = [(r.get("generated_tokens_total", 0.0) if r["step"] else 0.0, r[KEY], r["step"]) for r in rows if KEY in r]
        steps = [r for r in rows if r["step"] > 0]
        out[k] = {"evals": evals, "steps": steps}
    return out


def acc_at(run: dict, tokens: float) -> float | None:
    """Held-out accuracy of the run's last eval at or below `tokens` generated tokens."""
    got = [a for t, a, _ in run["evals"] if t <= tokens + 1e-6]
    return got[-1] if got else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def sd(xs):
    xs = [x for x in xs if x is not None]
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def pct(x, signed=False):
    return "-" if x is None else (f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--pretrain")
    ap.add_argument("--selected")
    ap.add_argument("--budget", type=float, help="grpo.max_generated_tokens of the runs (default: the recipe's)")
    ap.add_argument("--grid", type=int, default=8, help="points of the curve table")
    ap.add_argument("--ds_config", default="ds_configs/zero2_grpo.json", help="DeepSpeed config named in the command column")
    ap.add_argument("--init_from", default="runs/arith_small", help="--init_from named in the command column")
    ap.add_argument("--lr", help="train.lr of the runs, when not the recipe's (named in the command column)")
    args = ap.parse_args(argv)

    if args.pretrain and Path(args.pretrain).is_file():
        sel = json.loads(Path(args.selected).read_text()) if args.selected and Path(args.selected).is_file() else {}
        print("### Pretraining (arith_small.yaml): greedy accuracy by checkpoint\n")
        print("| step | dev accuracy % (200 train prompts: selects) | held-out accuracy % (200 prompts: reported only) |")
        print("|---|---|---|")
        for line in Path(args.pretrain).read_text().splitlines():
            r = json.loads(line)
            mark = " (selected)" if sel.get("step") == r["step"] else ""
            print(f"| {r['step']}{mark} | {pct(r['dev_acc'])} | {pct(r['heldout_acc'])} |")
        print()
    if not Path(args.metrics).is_file():
        print(f"no GRPO metrics ({args.metrics})")
        return 1
    runs = load_runs(Path(args.metrics))
    if not runs:
        print("no GRPO runs")
        return 1
    budget = args.budget
    if budget is None:
        import yaml

        root = Path(__file__).resolve().parents[2]
        budget = yaml.safe_load((root / "engine" / "recipes" / "grpo_arith.yaml").read_text())["grpo"]["max_generated_tokens"]
    finals = {k: (r["evals"][-1] if r["evals"] else (0.0, None, 0)) for k, r in runs.items()}
    complete = {k: f[0] >= budget for k, f in finals.items()}
    if all(complete.values()):
        common, how = None, f"at each run's stop (budget {budget:.0f} generated tokens, overshoot < 1 step)"
    else:
        common = min(f[0] for f in finals.values())
        how = (f"at {common:.0f} generated tokens, the most every run reached (runs cut by time: "
               f"{', '.join(f'{v} s{s}' for (v, s), c in sorted(complete.items()) if not c)}; budget {budget:.0f})")
    variants = [v for v in RECIPE if any(k[0] == v for k in runs)]

    def after(k):
        return finals[k][1] if common is None else acc_at(runs[k], common)

    def tokens_after(k):
        return finals[k][0] if common is None else max(t for t, _, _ in runs[k]["evals"] if t <= common + 1e-6)

    print(f"### GRPO on the arithmetic task, per run: held-out accuracy (%) before and after, {how}\n")
    print("| variant | seed | before | after | gain | steps | generated tokens at 'after' | tokens / step | "
          "wall s / step (median) | rollout s / step | command |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        for (vv, s) in sorted(k for k in runs if k[0] == v):
            k = (vv, s)
            r = runs[k]
            b, a = r["evals"][0][1] if r["evals"] else None, after(k)
            st = r["steps"]
            n = len(st)
            tps = mean([x["generated_tokens"] for x in st])
            cmd = (f"`bin/grpo.py --deepspeed_config {args.ds_config} --config engine/recipes/{RECIPE[v]}` "
                   f"(train.seed {s}{', train.lr ' + args.lr if args.lr else ''}) `--init_from {args.init_from}`")
            print(f"| {NAME[v]} | {s} | {pct(b)} | {pct(a)} | {pct(None if a is None or b is None else a - b, True)} | "
                  f"{n}{'' if complete[k] else ' (cut)'} | {tokens_after(k):.0f} | {tps:.1f} | "
                  f"{statistics.median([x['step_s'] for x in st]):.3f} | {statistics.median([x['rollout_s'] for x in st]):.3f} | {cmd} |")
    print()

    summ = {}
    for v in variants:
        ks = sorted(k for k in runs if k[0] == v)
        bs = [runs[k]["evals"][0][1] for k in ks if runs[k]["evals"]]
        as_ = [after(k) for k in ks]
        gains = [a - b for a, b in zip(as_, bs) if a is not None]
        summ[v] = {"before": bs, "after": as_, "gain": gains, "n": len(ks),
                   "tokens_step": mean([mean([x["generated_tokens"] for x in runs[k]["steps"]]) for k in ks]),
                   "step_s": mean([statistics.median([x["step_s"] for x in runs[k]["steps"]]) for k in ks]),
                   "steps": mean([len(runs[k]["steps"]) for k in ks])}
    p = summ.get("plain")
    print("### Per variant (mean ± sd over seeds)\n")
    print("| variant | seeds | before | after | gain (points) | after - plain's after | vs plain GRPO | steps | "
          "tokens / step | wall s / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        x = summ[v]
        if v == "plain" or p is None:
            verdict, diff = "-", "-"
        else:
            d = mean(x["after"]) - mean(p["after"])
            se = math.sqrt(sd(x["after"]) ** 2 / max(x["n"], 1) + sd(p["after"]) ** 2 / max(p["n"], 1))
            # a held-out accuracy on 200 prompts has a binomial sd of ~3 points; the seeds' spread includes it
            se = max(se, math.sqrt(2 * 0.25 / 200 / 3))
            verdict = ("beats plain GRPO" if d > 2 * se else "worse than plain GRPO" if d < -2 * se
                       else "does not beat plain GRPO (within noise)")
            diff = f"{100 * d:+.1f} (2 se {200 * se:.1f})"
        print(f"| {NAME[v]} | {x['n']} | {pct(mean(x['before']))} ± {100 * sd(x['before']):.1f} | "
              f"{pct(mean(x['after']))} ± {100 * sd(x['after']):.1f} | {pct(mean(x['gain']), True)} ± {100 * sd(x['gain']):.1f} | "
              f"{diff} | {verdict} | {x['steps']:.0f} | {x['tokens_step']:.1f} | {x['step_s']:.3f} |")
    print()

    have = [m for m in MISMATCH if any(m in x for k in runs for x in runs[k]["steps"])]
    if have:  # the rollout/train mismatch each variant trained with: mean over its steps, then over seeds
        print("### Rollout/train mismatch (mean over steps, mean ± sd over seeds)\n")
        print("| variant | " + " | ".join(have) + " |")
        print("|---|" + "---|" * len(have))
        for v in variants:
            cells = []
            for m in have:
                per = [mean([x[m] for x in runs[k]["steps"] if m in x]) for k in runs if k[0] == v
                       and any(m in x for x in runs[k]["steps"])]
                cells.append(f"{mean(per):.4g} ± {sd(per):.2g}" if per else "-")
            print(f"| {NAME[v]} | " + " | ".join(cells) + " |")
        print()

    top = common if common is not None else min(f[0] for f in finals.values())
    grid = [top * i / args.grid for i in range(args.grid + 1)]
    print("### Curve: mean held-out accuracy (%) over seeds against generated tokens\n")
    print("| generated tokens | " + " | ".join(NAME[v] for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for t in grid:
        cells = [pct(mean([acc_at(runs[k], t) for k in runs if k[0] == v])) for v in variants]
        print(f"| {t:.0f} | " + " | ".join(cells) + " |")
    print()

    below = p is not None and mean(p["after"]) <= mean(p["before"])
    if below:
        print(f"Tokens to reach plain GRPO's final accuracy: not applicable, plain GRPO ended at {pct(mean(p['after']))}%, "
              f"below the pretrained model's {pct(mean(p['before']))}% (every run starts above it).\n")
    if p is not None:
        target = mean(p["after"])
        plain_tokens = mean([tokens_after(k) for k in runs if k[0] == "plain"])
        points = sorted({t for r in runs.values() for t, _, _ in r["evals"]})
    if p is not None and not below:
        print(f"### Tokens to reach plain GRPO's final mean accuracy ({pct(target)}%, at {plain_tokens:.0f} tokens)\n")
        print("| variant | first point of the mean curve at or above it (tokens) | share of plain's tokens | "
              "per seed (tokens of the first eval at or above it) |")
        print("|---|---|---|---|")
        for v in variants:
            ks = sorted(k for k in runs if k[0] == v)
            hit = next((t for t in points if t <= top + 1e-6 and
                        (m := mean([acc_at(runs[k], t) for k in ks])) is not None and m >= target - 1e-9), None)
            per = []
            for k in ks:
                h = next((t for t, a, _ in runs[k]["evals"] if a >= target - 1e-9), None)
                per.append("never" if h is None else f"{h:.0f}")
            share = "not reached" if hit is None else f"{hit / plain_tokens:.0%}"
            print(f"| {NAME[v]} | {'-' if hit is None else f'{hit:.0f}'} | {share} | {', '.join(per)} |")
        print()
    if p is not None:
        gain = mean(p["gain"])
        print(f"Goal 1 (plain GRPO raises held-out accuracy by >= 10 points): mean gain {pct(gain, True)} points -> "
              f"{'met' if gain is not None and gain >= 0.10 else 'NOT met'}")
        if "tree" in summ:
            ks = sorted(k for k in runs if k[0] == "tree")
            hit = next((t for t in points if t <= top + 1e-6 and
                        (m := mean([acc_at(runs[k], t) for k in ks])) is not None and m >= target - 1e-9), None)
            ok = hit is not None and hit <= 0.7 * plain_tokens
            if target <= mean(p["before"]):
                print("Goal 2 (tree rollouts reach plain GRPO's final accuracy with <= 70% of its generated tokens): "
                      "NOT met (not applicable: plain GRPO's final accuracy is below the starting point, which every "
                      "run 'reaches' at 0 tokens)")
            else:
                print(f"Goal 2 (tree rollouts reach plain GRPO's final accuracy with <= 70% of its generated tokens): "
                      f"{'at ' + format(hit / plain_tokens, '.0%') if hit is not None else 'not reached'} -> "
                      f"{'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

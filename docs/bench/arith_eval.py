#!/usr/bin/env python3
"""Greedy arithmetic accuracy of a pretraining run's checkpoints, as they appear (docs/bench/grpo_task.sh).

Each checkpoint (RUN_DIR/checkpoints/step_*) is exported to Hugging Face format (engine/export/write.py, fp32), loaded
in the GRPO policy's dtype (bf16 on CUDA, fp32 on CPU) and decoded greedily by the GRPO rollout decoder
(engine/decoder.py, eager) for `max_new_tokens` (the GRPO recipe's), then scored with the `numeric` reward
(`which: first`), as bin/grpo.py scores its held-out prompts (grpo.eval_path). Two prompt sets:
  dev:      the first --dev prompts of the GRPO train prompts (engine/assets/arith_train.jsonl); the checkpoint
            is SELECTED on these
  held-out: engine/assets/arith_eval.jsonl, reported only (never used to choose anything)
The first checkpoint whose dev accuracy is >= --target is selected: its export is copied to --select and the
script exits (the caller stops pretraining). Without a hit, when --watch_pid has exited and every checkpoint is
scored, the one with the best dev accuracy is selected. One JSON row per checkpoint in --out.

    python docs/bench/arith_eval.py --run_dir runs/arith_small --target 0.3 --out evals.jsonl --select /tmp/init_hf
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def tags(run_dir: Path) -> list[Path]:
    """Complete checkpoints (their manifest written last), oldest first."""
    ck = run_dir / "checkpoints"
    return sorted(p for p in ck.glob("step_*") if p.is_dir() and (p / "manifest.json").is_file()) if ck.is_dir() else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--grpo_config", default=str(ROOT / "engine" / "recipes" / "grpo_arith.yaml"))
    ap.add_argument("--dev", type=int, default=200, help="how many train prompts to select on")
    ap.add_argument("--target", type=float, help="select the first checkpoint with dev accuracy >= this")
    ap.add_argument("--watch_pid", type=int, help="keep waiting for checkpoints while this process runs")
    ap.add_argument("--select", help="copy the selected checkpoint's Hugging Face export here")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/arith_eval_hf")
    ap.add_argument("--max_wait", type=float, help="seconds: then stop and select the best checkpoint scored so far")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from engine.checkpoint import MANIFEST  # noqa: F401  (the file tags() waits for)
    from engine.config import load_recipe
    from engine.data import load_tokenizer
    from engine.decoder import Decoder
    from engine.export.write import export
    from engine.grpo import left_pad, load_prompts
    from engine.rewards import build_rewards

    g = load_recipe(args.grpo_config).grpo
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = load_tokenizer(load_recipe(args.grpo_config).data.tokenizer)
    sets = {"dev": load_prompts(str(ROOT / "engine" / "assets" / "arith_train.jsonl"))[: args.dev],
            "heldout": load_prompts(str(ROOT / "engine" / "assets" / "arith_eval.jsonl"), "grpo.eval_path")}
    numeric = build_rewards([{"name": "numeric", "which": "first"}], where="numeric")
    rows = [r for rs in sets.values() for r in rs]
    req = left_pad([r["prompt"] for r in rows], tok, device)
    cache_len = -(-(req.prompt_ids.shape[1] + g.max_new_tokens) // 16) * 16

    def score(hf: Path) -> dict:
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).to(device).eval()
        dec = Decoder(model, device, len(rows), cache_len, g.decode_experts, compile=False)
        out = dec.generate(req.prompt_ids, req.prompt_attention_mask, g.max_new_tokens, eos_id=tok.eos_token_id,
                           pad_id=tok.pad_token_id, temperature=0.0)
        texts = tok.batch_decode(out[:, req.prompt_ids.shape[1]:], skip_special_tokens=True)
        res, i = {}, 0
        for name, rs in sets.items():
            s = numeric.score([r["prompt"] for r in rs], texts[i:i + len(rs)], [r["answer"] for r in rs])
            res[f"{name}_acc"] = float(s.total.mean())
            i += len(rs)
        del dec, model
        return res

    done, results, selected = set(), [], None
    work = Path(args.work)
    t_start = time.time()
    with open(args.out, "a") as f:
        while True:
            if args.max_wait is not None and time.time() - t_start > args.max_wait and results:
                print(f"--max_wait {args.max_wait:.0f} s reached", flush=True)
                break
            new = [t for t in tags(Path(args.run_dir)) if t.name not in done]
            if not new:
                if alive(args.watch_pid):
                    time.sleep(1.0)
                    continue
                break
            tag = new[0]
            done.add(tag.name)
            t0 = time.time()
            hf = work / tag.name
            try:
                export(tag, hf, dtype="fp32", force=True, log=lambda *a, **k: None)
            except Exception as e:  # a checkpoint pruned or cut while being read: skip it
                print(f"{tag.name}: export failed ({e}); skipped", flush=True)
                continue
            row = {"step": int(tag.name.split("_")[1]), **score(hf), "eval_s": round(time.time() - t0, 2)}
            results.append((row, hf))
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
            if args.target is not None and row["dev_acc"] >= args.target:
                selected = (row, hf)
                break
    if selected is None and results:
        selected = max(results, key=lambda x: x[0]["dev_acc"])
        print(f"no checkpoint scored reached dev accuracy {args.target}; the best one is selected", flush=True)
    if selected is None:
        print("no checkpoint was scored", flush=True)
        return 1
    row, hf = selected
    print("selected " + json.dumps(row), flush=True)
    if args.select:
        shutil.rmtree(args.select, ignore_errors=True)
        shutil.copytree(hf, args.select)
        (Path(args.select) / "selected.json").write_text(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where ZeRO-3's slow second GRPO step goes, on a CPU: host time of DeepSpeed's parameter coordinator per step.

A proxy of grpo_2b6.yaml with its layer, head-group, expert and top-k counts and tiny widths (hidden 64, vocabulary
512, 8 new tokens; fp32, random init), one rank, zero3_grpo.json with the one-rank "auto" gather values a GPU gets
(1e10, 1e10, 5e8) and a written 64 x 1 batch. bin/grpo.py runs under cProfile, one profile per step; printed per step:
the policy pass (metrics.jsonl) and the calls and cumulative host seconds of the coordinator's functions.
    python docs/bench/zero3_step2_cpu.py [--steps 5] [--out /tmp/zero3_step2] [--plain] [--ds FILE] [--zero JSON]
--zero '{"leaf_module": null}' runs DeepSpeed's hook on every module instead of the file's decoder-layer leaves
(engine/ds_config.py resolve_leaf_modules); --ds ds_configs/zero2_grpo.json the ZeRO-2 floor.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
WATCH = ("__params_to_release", "release_sub_module", "fetch_sub_module")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="/tmp/zero3_step2")
    ap.add_argument("--zero", default="{}", help="JSON merged into zero_optimization; a null value drops the key "
                    "(\'{\"leaf_module\": null}\': DeepSpeed's hooks on every module)")
    ap.add_argument("--ds", default="ds_configs/zero3_grpo.json")
    ap.add_argument("--plain", action="store_true", help="no cProfile (its own host cost grows with the hooks'): "
                    "the passes' seconds only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    r = yaml.safe_load(open(os.path.join(ROOT, "engine/recipes/grpo_2b6.yaml")))
    r["model"].update(hidden_size=64, num_heads=4, intermediate_size=128, moe_intermediate_size=32, vocab_size=512,
                      kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                      max_position_embeddings=512)
    r["grpo"].update(max_new_tokens=8, allow_random_init=True, beta=0.04, kl="k3")
    r["train"]["max_steps"] = args.steps
    r["checkpoint"] = {"every_steps": 0, "every_minutes": 0, "at_end": False}
    r["run_dir"] = os.path.join(args.out, "run")
    yaml.safe_dump(r, open(os.path.join(args.out, "recipe.yaml"), "w"), sort_keys=False)
    d = json.load(open(os.path.join(ROOT, args.ds)))
    if d["zero_optimization"]["stage"] == 3:
        d["zero_optimization"].update(stage3_max_live_parameters=10**10, stage3_max_reuse_distance=10**10,
                                      stage3_prefetch_bucket_size=5 * 10**8)
    d["zero_optimization"].update(json.loads(args.zero))
    d["zero_optimization"] = {k: v for k, v in d["zero_optimization"].items() if v is not None}
    d.update(train_micro_batch_size_per_gpu=64, gradient_accumulation_steps=1, train_batch_size=64,
             bf16={"enabled": False})
    json.dump(d, open(os.path.join(args.out, "ds.json"), "w"), indent=1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29719"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")

    import engine.grpo as g

    step, profiles = g.grpo_step, []

    def profiled(*a, **k):
        p = cProfile.Profile()
        p.enable()
        try:
            return step(*a, **k)
        finally:
            p.disable()
            profiles.append(p)

    if not args.plain:
        g.grpo_step = profiled
    rc = g.main(["--deepspeed_config", os.path.join(args.out, "ds.json"), "--config",
                 os.path.join(args.out, "recipe.yaml"), "--run_dir", r["run_dir"]])
    rows = [x for x in map(json.loads, open(os.path.join(r["run_dir"], "metrics.jsonl"))) if "policy_s" in x]
    if args.plain:
        print("step  reference_s  policy_s")
        for row in rows:
            print(f"{row['step']:4d}  {row.get('ref_s', float('nan')):11.3f}  {row['policy_s']:8.3f}")
        sys.exit(rc)
    print("step  policy_s  " + "  ".join(f"{w} (calls, host s)" for w in WATCH))
    for i, (p, row) in enumerate(zip(profiles, rows), 1):
        stats = pstats.Stats(p).stats
        cells = []
        for w in WATCH:
            hit = [v for k, v in stats.items() if k[2] == w]
            cells.append(f"{sum(v[1] for v in hit):6d} {sum(v[3] for v in hit):7.3f}")
        print(f"{i:4d}  {row['policy_s']:8.3f}  " + "  ".join(cells))
    sys.exit(rc)


if __name__ == "__main__":
    main()

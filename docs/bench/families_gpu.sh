#!/usr/bin/env bash
# Issue 31's one-GPU figures for the families beyond DeepSeek-V3, in one device call: for each recipe (a published
# shape truncated in depth: engine/recipes/mixtral_8x7b_l3.yaml, deepseek_v2_lite_l8.yaml), bin/pretrain.py for
# PT_STEPS (20) steps with ds_configs/zero2.json ("auto" batch), then bin/grpo.py for GRPO_STEPS (4) steps from that
# run with ds_configs/zero3_grpo.json (grpo_2b6.yaml's grpo section, beta 0.04; the rollout path is what "auto"
# picks for the family: the local decoder for mixtral, the engine for deepseek_v2), and a table of tokens/s, MFU,
# peak memory, loss at the first and last step, the GRPO step and decode ms per step. MFU: flops_per_token below.
#   bash docs/bench/families_gpu.sh     (on the GPU machine, from the checkout, with .whl/ carried)
# Files: $OUT/<recipe>_pretrain.jsonl, $OUT/<recipe>_grpo.jsonl (metrics rows), $OUT/families.md (table), logs.tgz.
# CPU smoke test: RECIPES="tiny_mixtral tiny_deepseek_v2" PT_STEPS=4 GRPO_STEPS=1 MAX_NEW=8 bash docs/bench/families_gpu.sh
set -u
OUT=${OUT:-/tmp/families}; W=/tmp/fam; mkdir -p "$OUT" $W/logs
export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if ! python3 -c "import deepspeed" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
DS="python3 -m deepspeed.launcher.runner"
port=29800
for rec in ${RECIPES:-mixtral_8x7b_l3 deepseek_v2_lite_l8}; do
  python3 - engine/recipes/grpo_2b6.yaml $W/grpo_$rec.yaml "${MAX_NEW:-}" <<'PY'
import sys, yaml
r = yaml.safe_load(open(sys.argv[1]))
r.pop("model")  # the model is the pretraining run's (its config.json picks the family)
r["grpo"].update(beta=0.04, kl="k3")
if sys.argv[3]:
    r["grpo"]["max_new_tokens"] = int(sys.argv[3])
r["checkpoint"] = {"every_steps": 0, "every_minutes": 0, "at_end": False}
yaml.safe_dump(r, open(sys.argv[2], "w"), sort_keys=False)
PY
  t=$SECONDS; port=$((port + 1)); rm -rf $W/run_$rec $W/grpo_run_$rec
  timeout -k 15 ${T_PT:-240} $DS --master_port $port --num_gpus ${GPUS:-1} bin/pretrain.py --deepspeed_config ds_configs/zero2.json \
    --config engine/recipes/$rec.yaml --max_steps ${PT_STEPS:-20} --run_dir $W/run_$rec > $W/logs/pretrain_$rec.log 2>&1
  echo "$rec pretrain: exit $? in $((SECONDS - t))s $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,160}|error: .{0,200}' $W/logs/pretrain_$rec.log)"
  cp $W/run_$rec/metrics.jsonl "$OUT/${rec}_pretrain.jsonl" 2>/dev/null
  t=$SECONDS; port=$((port + 1))
  timeout -k 15 ${T_GRPO:-240} $DS --master_port $port --num_gpus ${GPUS:-1} bin/grpo.py --deepspeed_config ds_configs/zero3_grpo.json \
    --config $W/grpo_$rec.yaml --init_from $W/run_$rec --max_steps ${GRPO_STEPS:-4} --run_dir $W/grpo_run_$rec \
    > $W/logs/grpo_$rec.log 2>&1
  echo "$rec grpo: exit $? in $((SECONDS - t))s $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,160}|error: .{0,200}|auto picks engine' $W/logs/grpo_$rec.log)"
  cp $W/grpo_run_$rec/metrics.jsonl "$OUT/${rec}_grpo.jsonl" 2>/dev/null
done
python3 - "$OUT" ${RECIPES:-mixtral_8x7b_l3 deepseek_v2_lite_l8} <<'PY' | tee "$OUT/families.md"
import json, statistics, sys
out = sys.argv[1]
def flops_per_token(rec):
    """6 x active parameters (embedding excluded, routed experts at k/E) + causal attention's 3 x 2 x seq x heads x
    (qk + v) per layer: the formula of docs/bench/vocab_pretrain.sh, at H200 bf16 dense peak 989 TFLOP/s."""
    from engine.auto_batch import param_counts
    from engine.config import load_recipe
    r = load_recipe(f"engine/recipes/{rec}.yaml")
    m = r.model
    total, experts = param_counts(m)
    active = total - m.vocab_size * m.hidden_size - experts + experts * m.experts_per_token / m.num_experts
    if m.arch.startswith("deepseek"):
        qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    else:
        qk = v = m.hidden_size // m.num_heads
    return 6 * active + 3 * m.num_layers * 2 * r.data.seq_len * m.num_heads * (qk + v)


def rows(path):
    try:
        return [json.loads(l) for l in open(path)]
    except OSError:
        return []
print("| recipe | pretrain steps | tokens/s (median, steps 2..) | MFU | peak GiB | loss first -> last | GRPO steps | step s | decode ms/step | rollout |")
print("|---|---|---|---|---|---|---|---|---|---|")
for rec in sys.argv[2:]:
    pt = [r for r in rows(f"{out}/{rec}_pretrain.jsonl") if "loss" in r]
    g = [r for r in rows(f"{out}/{rec}_grpo.jsonl") if "step_s" in r]
    med = lambda xs: statistics.median(xs[1:] if len(xs) > 1 else xs) if xs else float("nan")
    mfu = med([r["tokens_per_s_per_rank"] for r in pt]) * flops_per_token(rec) / 989e12 if pt else None
    dec = [r["decode_ms_per_step"] for r in g if "decode_ms_per_step" in r]
    print(f"| {rec} | {len(pt)} | {med([r['tokens_per_s'] for r in pt]):.0f} | "
          f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {max((r.get('peak_mem_gib') or 0) for r in pt) if pt else '-'} | "
          f"{pt[0]['loss']:.3f} -> {pt[-1]['loss']:.3f} | {len(g)} | {med([r['step_s'] for r in g]):.2f} | "
          f"{med(dec):.2f} | {'local' if dec else 'engine'} |" if pt else f"| {rec} | 0 | - | - | - | - | {len(g)} | - | - | - |")
PY
tar czf "$OUT/logs.tgz" -C $W logs

#!/usr/bin/env bash
# Through bin/pretrain.py itself: the shipped zero2.json / zero3.json ("auto" micro-batch and
# accumulation) on one H200, uncapped and capped at 80 GB (--memory_fraction 0.5596), deepseek_2b6 and deepseek_5b3.
# Each run: STEPS optimizer steps (default 20), a metrics row every 5; tokens/s is the mean of the rows after the
# first (the first row holds the compile and warm-up steps). The recipes are the shipped ones with only the end-of-run
# checkpoint turned off (a 2.6B ZeRO checkpoint is ~36 GB of disk and minutes of writing; it is not what is measured).
# MFU uses the FLOPs per token that bin/bench.py counts from the live model (docs/bench/s7/auto_batch.jsonl: mfu /
# tokens_per_s x 989 TFLOP/s): 4.663e9 for deepseek_2b6 and 9.246e9 for deepseek_5b3 at seq_len 2048.
#   bash docs/bench/auto_batch_pretrain.sh [LABEL...]    # on the GPU machine, after the .whl install lines
# z3bf16_5b3_80g (only when named): zero3_bf16_states.json, which the 80 GB refusal of deepseek_5b3 points to.
# Rows: $OUT/auto_batch_pretrain.jsonl; logs: $OUT/auto_batch_pretrain_logs.txt.
set -u
OUT=${OUT:-/tmp/auto_batch_pretrain}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
STEPS=${STEPS:-20}; LOG=$OUT/auto_batch_pretrain_logs.txt; PORT=29800
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > /dev/null 2>&1
mkdir -p /tmp/abp_recipes
for r in deepseek_2b6 deepseek_5b3; do  # the shipped recipe, end-of-run checkpoint off
  python3 - "$r" <<'PY'
import sys, yaml
name = sys.argv[1]
raw = yaml.safe_load(open(f"engine/recipes/{name}.yaml"))
raw["checkpoint"] = {"at_end": False, "every_minutes": 0}
yaml.safe_dump(raw, open(f"/tmp/abp_recipes/{name}.yaml", "w"))
PY
done
run() {  # run LABEL DS RECIPE LIMIT [ARGS...]: one bin/pretrain.py run
  local label=$1 ds=$2 recipe=$3 lim=$4; shift 4; PORT=$((PORT + 1)); local t=$SECONDS
  rm -rf "/tmp/abp_runs/$label"
  timeout -k 10 "$lim" python3 -m deepspeed.launcher.runner --master_port $PORT --num_gpus 1 bin/pretrain.py \
    --deepspeed_config "ds_configs/$ds" --config "/tmp/abp_recipes/$recipe.yaml" --max_steps "$STEPS" \
    --run_dir "/tmp/abp_runs/$label" "$@" > /tmp/abp_run.log 2>&1
  local rc=$?
  { echo "== $label: bin/pretrain.py --deepspeed_config ds_configs/$ds --config $recipe --max_steps $STEPS $* (exit $rc)"
    cat /tmp/abp_run.log; } >> "$LOG"
  python3 - "$label" "$ds" "$recipe" "$rc" "$((SECONDS - t))" "$*" "/tmp/abp_runs/$label/metrics.jsonl" \
    /tmp/abp_run.log "$OUT/auto_batch_pretrain.jsonl" <<'PY'
import json, os, re, sys
label, ds, recipe, rc, wall, extra, metrics, log, out = sys.argv[1:]
flops = {"deepseek_2b6": 4.663e9, "deepseek_5b3": 9.246e9}[recipe]
text = open(log, errors="replace").read()
batch = re.search(r"batch: micro-batch (\d+) x (\d+)[^\n]*", text)
err = re.search(r"(error: [^\n]{0,300}|OutOfMemoryError[^\n]{0,200})", text)
rows = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
rows = [r for r in rows if "tokens_per_s_per_rank" in r]
timed = rows[1:]
tps = sum(r["tokens_per_s_per_rank"] for r in timed) / len(timed) if timed else None
row = {"label": label, "ds_config": ds, "recipe": recipe, "args": extra, "exit": int(rc), "wall_s": int(wall),
       "batch_line": batch.group(0) if batch else None, "micro": int(batch.group(1)) if batch else None,
       "accum": int(batch.group(2)) if batch else None, "steps_timed": [r["step"] for r in timed],
       "tokens_per_s_per_gpu": round(tps) if tps else None,
       "mfu": round(tps * flops / 989e12, 4) if tps else None,
       "peak_gib": max((r["peak_mem_gib"] for r in rows), default=None),
       "losses": [round(r["loss"], 4) for r in rows], "error": err.group(0) if err else None}
open(out, "a").write(json.dumps(row) + "\n")
print({k: row[k] for k in ("label", "exit", "wall_s", "micro", "accum", "tokens_per_s_per_gpu", "mfu", "peak_gib",
                           "error")})
PY
}
ALL="$*"
CAP="--memory_fraction 0.5596"
for spec in "z3_2b6 zero3.json deepseek_2b6 200" "z2_2b6 zero2.json deepseek_2b6 200" \
            "z3_2b6_80g zero3.json deepseek_2b6 200 $CAP" "z2_2b6_80g zero2.json deepseek_2b6 200 $CAP" \
            "z3_5b3 zero3.json deepseek_5b3 260" "z2_5b3 zero2.json deepseek_5b3 260" \
            "z3_5b3_80g zero3.json deepseek_5b3 90 $CAP" "z2_5b3_80g zero2.json deepseek_5b3 90 $CAP" \
            "z3bf16_5b3_80g zero3_bf16_states.json deepseek_5b3 200 $CAP"; do
  set -- $spec
  if { [ -z "$ALL" ] && [ "$1" != z3bf16_5b3_80g ]; } || [[ " $ALL " == *" $1 "* ]]; then run "$@"; fi
done

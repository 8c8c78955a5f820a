#!/usr/bin/env bash
# The shipped zero2.json / zero3.json ("auto" micro-batch and accumulation) on one H200, uncapped and
# capped at 80 GB (--memory_fraction 0.5596), deepseek_2b6 with bin/bench.py (10 timed steps after 3), and
# deepseek_5b3's refusal under the cap. Rows: $OUT/auto_batch.jsonl; logs: $OUT/auto_batch_logs.txt.
#   bash docs/bench/auto_batch.sh        # on the GPU machine, after the .whl install lines
set -u
OUT=${OUT:-/tmp/auto_batch}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
DS="python3 -m deepspeed.launcher.runner"
LOG=$OUT/auto_batch_logs.txt; PORT=29700
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > /dev/null 2>&1
run() {  # run LABEL LIMIT ARGS...: one bench run
  local label=$1 lim=$2; shift 2; PORT=$((PORT + 1)); local t=$SECONDS
  timeout -k 10 "$lim" $DS --master_port $PORT --num_gpus 1 bin/bench.py --steps 10 --warmup 3 --label "$label" \
    --out "$OUT/auto_batch.jsonl" "$@" > /tmp/auto_batch_run.log 2>&1
  local rc=$?
  { echo "== $label: bin/bench.py $*"; cat /tmp/auto_batch_run.log; } >> "$LOG"
  echo "$label: exit $rc in $((SECONDS - t))s | $(grep -m1 -oE 'batch: micro-batch [0-9]+ x [0-9]+|error: .{0,200}|OutOfMemoryError' /tmp/auto_batch_run.log)"
}
R2=engine/recipes/deepseek_2b6.yaml; R5=engine/recipes/deepseek_5b3.yaml
if [ -n "${ONLY_5B3:-}" ]; then  # deepseek_5b3 uncapped ("auto" predicts micro 32 x 2 there; never measured before)
  run z3_5b3 200 --deepspeed_config ds_configs/zero3.json --config $R5
  run z2_5b3 200 --deepspeed_config ds_configs/zero2.json --config $R5
  exit 0
fi
run z2_2b6 150 --deepspeed_config ds_configs/zero2.json --config $R2
run z3_2b6 150 --deepspeed_config ds_configs/zero3.json --config $R2
run z2_2b6_80g 150 --deepspeed_config ds_configs/zero2.json --config $R2 --memory_fraction 0.5596
run z3_2b6_80g 150 --deepspeed_config ds_configs/zero3.json --config $R2 --memory_fraction 0.5596
run z3_5b3_80g 60 --deepspeed_config ds_configs/zero3.json --config $R5 --memory_fraction 0.5596
grep -E "^batch:|error:" "$LOG" | sort | uniq
python3 - "$OUT/auto_batch.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print({k: r.get(k) for k in ("label", "micro", "accum", "tokens_per_s_per_gpu", "mfu", "peak_gib")})
PY

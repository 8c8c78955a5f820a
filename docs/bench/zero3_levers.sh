#!/usr/bin/env bash
# ZeRO-3 + AutoEP levers on one H200 (deepseek_2b6, zero3.json as shipped: "auto" = 16 x 4),
# the DeepCompile reproduction, and the 50-step loss of "auto" against a written batch. One bin/bench.py run per row
# ($OUT/levers.jsonl), a timeout per run, every run cut so the call ends inside BUDGET_S; the table at the end.
#   bash docs/bench/zero3_levers.sh levers   # repro (3 cases, side by side), then the levers, then loss_auto_16x4
#   bash docs/bench/zero3_levers.sh leaves   # decoder-layer leaves (as shipped) against a hook per module, and
#     train.compile=true (each layer compiled, possible with the leaves); FusedAdam is built first
#   bash docs/bench/zero3_levers.sh loss     # the 50-step loss runs: a written 16 x 4 and "auto"; CAPPED=1 adds "auto"
#     under an 80 GB cap, DC=1 the whole model under DeepCompile with the scheduler fix, REPRO=1 the AutoEP repro case
# RECIPE=engine/recipes/tiny.yaml STEPS=2 WARMUP=1 LOSS_STEPS=3 runs the same logic on the CPU in minutes.
set -u
PHASE=${1:-levers}
OUT=${OUT:-/tmp/zero3_levers}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
DS="python3 -m deepspeed.launcher.runner"
R=${RECIPE:-engine/recipes/deepseek_2b6.yaml}
STEPS=${STEPS:-6}; WARMUP=${WARMUP:-2}; LOSS_STEPS=${LOSS_STEPS:-50}
END=$((SECONDS + ${BUDGET_S:-570})); LOG=$OUT/logs.txt; PORT=29800
. docs/bench/gpu_env.sh deepspeed  # DeepSpeed from .whl/ where the machine has none (its time counts in BUDGET_S)
Z3="--deepspeed_config ds_configs/zero3.json --config $R"
run() {  # run LABEL LIMIT ARGS...: one bin/bench.py run, a row in $OUT/levers.jsonl (or $ROWS)
  local label=$1 lim=$2; shift 2; PORT=$((PORT + 1))
  local left=$((END - SECONDS)); [ "$left" -lt "$lim" ] && lim=$left
  if [ "$lim" -lt 40 ]; then echo "$label: skipped, ${left}s left"; return; fi
  local t=$SECONDS
  timeout -k 10 "$lim" $DS --master_port $PORT --num_gpus 1 ${BENCH:-bin/bench.py} --label "$label" \
    --out "${ROWS:-$OUT/levers.jsonl}" "$@" > "/tmp/z3l_$label.log" 2>&1
  local rc=$?
  { echo "== $label: exit $rc in $((SECONDS - t))s: bin/bench.py $*"
    grep -E "^batch:|^compile:|OutOfMemoryError|Error|error:" "/tmp/z3l_$label.log" | head -8; } >> "$LOG"
  [ -f "${ROWS:-$OUT/levers.jsonl}.profile.txt" ] && mv "${ROWS:-$OUT/levers.jsonl}.profile.txt" "$OUT/profile_$label.txt"
  echo "$label: exit $rc in $((SECONDS - t))s $(grep -m1 -oE 'OutOfMemoryError|[A-Za-z]*Error: .{0,160}' "/tmp/z3l_$label.log")"
}
faster() {  # faster A B: "yes" when row A ran at least 3% more tokens/s than row B
  python3 - "$OUT/levers.jsonl" "$1" "$2" <<'PY'
import json, sys
rows = {r["label"]: r for r in map(json.loads, open(sys.argv[1]))}
a, b = rows.get(sys.argv[2]), rows.get(sys.argv[3])
print("yes" if a and b and a["tokens_per_s_per_gpu"] >= 1.03 * b["tokens_per_s_per_gpu"] else "no")
PY
}
table() {
  python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for r in map(json.loads, open(path)):
        print(" | ".join(str(r.get(k)) for k in ("label", "micro", "accum", "tokens_per_s_per_gpu", "mfu", "fwd_ms",
                                                  "bwd_ms", "step_ms", "peak_gib")), "|", r.get("sets"), r.get("ds_sets"))
PY
}
if [ "$PHASE" = leaves ]; then
  python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > /dev/null 2>&1
  run z3_leaves 150 $Z3 --steps $STEPS --warmup $WARMUP
  run z3_per_module 150 $Z3 --steps $STEPS --warmup $WARMUP --ds_set zero_optimization.leaf_module=null
  run z3_layers_compiled 200 $Z3 --steps $STEPS --warmup $WARMUP --set train.compile=true
  table "$OUT/levers.jsonl" | tee -a "$LOG"
  exit 0
fi
if [ "$PHASE" = levers ]; then
  # DeepSpeed JIT-builds FusedAdam on first use: once, outside the runs' timeouts, beside the reproduction (no FusedAdam)
  python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > /dev/null 2>&1 &
  if [ "$(python3 -c 'import torch; print(torch.cuda.is_available())')" = True ]; then
    i=0; for c in "triton" "autoep" "autoep --fix"; do
      i=$((i + 1)); MASTER_PORT=$((29650 + i)) timeout -k 5 150 python3 docs/repro/deepcompile_scatter_add.py --case $c \
        > "/tmp/repro_${c// /_}.log" 2>&1 &
    done
  fi
  wait
  for f in /tmp/repro_*.log; do echo "== $f"; cat "$f"; done > "$OUT/repro_deepcompile.txt" 2>/dev/null
  grep -hE "^(REPRODUCED|OK|OTHER):" /tmp/repro_*.log 2>/dev/null
  K=zero_optimization
  run z3_base 130 $Z3 --steps $STEPS --warmup $WARMUP --set train.compile=false --profile 2
  run z3_fn 150 $Z3 --steps $STEPS --warmup $WARMUP --profile 2
  FN=""; [ "$(faster z3_fn z3_base)" = yes ] || FN="--set train.compile=false"
  echo "parameter-free compile $([ -z "$FN" ] && echo on || echo off) for the runs below" | tee -a "$LOG"
  run z3_persist_all 110 $Z3 --steps $STEPS --warmup $WARMUP $FN --ds_set $K.stage3_param_persistence_threshold=10000000000
  run z3_gather 110 $Z3 --steps $STEPS --warmup $WARMUP $FN --ds_set $K.stage3_prefetch_bucket_size=500000000 \
    --ds_set $K.stage3_max_live_parameters=10000000000 --ds_set $K.stage3_max_reuse_distance=10000000000
  run z3_reduce_bucket 110 $Z3 --steps $STEPS --warmup $WARMUP $FN --ds_set $K.reduce_bucket_size=2000000000
  run z3_no_overlap 110 $Z3 --steps $STEPS --warmup $WARMUP $FN --ds_set $K.overlap_comm=false
  ROWS=$OUT/loss.jsonl run loss_auto_16x4 220 $Z3 --steps $((LOSS_STEPS - 4)) --warmup 4 $FN
else
  [ -n "${REPRO:-}" ] && MASTER_PORT=29661 timeout -k 5 150 python3 docs/repro/deepcompile_scatter_add.py --case autoep \
    > /tmp/repro_autoep.log 2>&1 &
  python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > /dev/null 2>&1
  # A written 16 x 4 against "auto" (uncapped: 32 x 2 at seq 512, 16 x 4 at 2048), the same seed and global batch.
  # EXTRA adds arguments to both (e.g. EXTRA="--set data.seq_len=512"); CAPPED=1 adds "auto" under an 80 GB cap.
  X="--steps $((LOSS_STEPS - 4)) --warmup 4 ${FN:-} ${EXTRA:-}"
  # PARALLEL=1: both runs at once on the one GPU (their peaks must fit together; their timings mean nothing then)
  if [ -n "${PARALLEL:-}" ]; then
    PORT=29900 ROWS=$OUT/loss.jsonl run loss_fixed_16x4 200 $Z3 $X --micro_batch 16 --ds_set gradient_accumulation_steps=4 &
  else
    ROWS=$OUT/loss.jsonl run loss_fixed_16x4 200 $Z3 $X --micro_batch 16 --ds_set gradient_accumulation_steps=4
  fi
  ROWS=$OUT/loss.jsonl run loss_auto 200 $Z3 $X
  wait
  [ -n "${CAPPED:-}" ] && ROWS=$OUT/loss.jsonl run loss_auto_80g 260 $Z3 $X --memory_fraction 0.5596
  # COMBO=1: the two ZeRO-3 lever runs that helped, together (levers phase: z3_persist_all, z3_gather)
  K=zero_optimization
  [ -n "${COMBO:-}" ] && run z3_gather_persist 100 $Z3 --steps $STEPS --warmup $WARMUP \
    --ds_set $K.stage3_param_persistence_threshold=10000000000 --ds_set $K.stage3_prefetch_bucket_size=500000000 \
    --ds_set $K.stage3_max_live_parameters=10000000000 --ds_set $K.stage3_max_reuse_distance=10000000000
  # DC=1: the whole model under DeepCompile with the scheduler fix (docs/repro/deepcompile_bench.py), if time is left
  [ -n "${DC:-}" ] && BENCH=docs/repro/deepcompile_bench.py run z3_deepcompile_fixed 240 $Z3 --steps 4 --warmup 8 \
    --ds_set compile.deepcompile=true
  [ -n "${REPRO:-}" ] && cat /tmp/repro_autoep.log > "$OUT/repro_autoep.txt"
fi
grep -hE "^batch:" /tmp/z3l_*.log | sort | uniq
table "$OUT"/*.jsonl

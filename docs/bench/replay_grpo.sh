#!/usr/bin/env bash
# grpo.routing_replay on one H200, one device call: docs/bench/grpo_vs_trl.sh's engine runs
# (8 prompts x G 8 x 256 new tokens forced, beta 0.04 k3, grpo_2b6 random init, bf16) with routing replay off and r3,
# ZeRO-3 then ZeRO-2, from one saved init; and bin/decode_bench.py with and without the decoder recording expert ids
# (the recording's cost per decode step; GRPO's local rollouts always record).
#   bash docs/bench/replay_grpo.sh      (on the GPU machine, from the checkout, with .whl/ carried)
# Files: $OUT/off/, $OUT/r3/ (grpo_vs_trl.sh's), $OUT/decode_record.jsonl.
# Switches: OUT=/tmp/replay_grpo CONFIGS='zero3_grpo zero2_grpo' RECIPE=engine/recipes/grpo_2b6.yaml SKIP_DECODE=1
set -u
OUT=${OUT:-/tmp/replay_grpo}; W=/tmp/rg; mkdir -p "$OUT" $W
export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if ! python3 -c "import deepspeed, trl" 2>/dev/null; then  # the wheels once, for every run
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
RECIPE=${RECIPE:-engine/recipes/grpo_2b6.yaml}
for mode in off r3; do
  python3 - "$RECIPE" "$mode" "$W/grpo_$mode.yaml" <<'PY'
import sys, yaml
src, mode, dst = sys.argv[1:4]
r = yaml.safe_load(open(src))
r.setdefault("grpo", {})["routing_replay"] = mode
yaml.safe_dump(r, open(dst, "w"), sort_keys=False)
PY
done
if [ "${SKIP_DECODE:-0}" != 1 ]; then
  for rec in "" --record_routes; do  # the recording's cost per decode step, same model and batch, one process each
    timeout 150 python3 bin/decode_bench.py --config "$RECIPE" --calls 2 $rec --out "$OUT/decode_record.jsonl" 2>&1 \
      | grep -E "^call|built" | cut -c1-220
  done
fi
OUT=$OUT/off RECIPE=$W/grpo_off.yaml INIT=$W/init SKIP_TRL=1 BUDGET_S=${BUDGET_OFF_S:-230} MASTER_PORT=29610 \
  bash docs/bench/grpo_vs_trl.sh
OUT=$OUT/r3 RECIPE=$W/grpo_r3.yaml INIT=$W/init REUSE_INIT=1 SKIP_TRL=1 BUDGET_S=${BUDGET_R3_S:-200} MASTER_PORT=29650 \
  bash docs/bench/grpo_vs_trl.sh

#!/usr/bin/env bash
# GRPO speed in one device call, one H200: the rollout decoder alone with and without grpo.min_new_tokens' forcing
# (bin/decode_bench.py, the recipe's model, batch 64 x 256 new tokens, recording expert choices as GRPO does), then
# docs/bench/grpo_vs_trl.sh with CONFIGS (default: the pretraining files zero3.json and zero2.json, "auto" batch) and
# its other switches (SKIP_TRL=1 by default here: TRL's step is measured by grpo_vs_trl.sh itself).
#   bash docs/bench/grpo_speed.sh      (on the GPU machine, from the checkout, .whl/ carried)
# Files: $OUT/decode_free.jsonl, $OUT/decode_forced.jsonl, $OUT/decode.txt, and grpo_vs_trl.sh's files in $OUT.
set -u
OUT=${OUT:-/tmp/grpo_speed}; mkdir -p "$OUT"
. docs/bench/gpu_env.sh deepspeed
RECIPE=${RECIPE:-engine/recipes/grpo_2b6.yaml}
if [ "${SKIP_DECODE:-0}" != 1 ]; then
  for mode in free forced; do
    flag=""; [ "$mode" = forced ] && flag=--min_new_tokens
    timeout "${T_DECODE:-120}" python3 bin/decode_bench.py --config "$RECIPE" --batch 64 --new_tokens 256 --calls 3 \
      --record_routes $flag --out "$OUT/decode_$mode.jsonl" 2>&1 | grep -E "^call|^decoder|Error" | sed "s/^/$mode: /" \
      | tee -a "$OUT/decode.txt"
  done
fi
OUT=$OUT RECIPE=$RECIPE CONFIGS=${CONFIGS:-zero3 zero2} SKIP_TRL=${SKIP_TRL:-1} BUDGET_S=${BUDGET_S:-420} \
  bash docs/bench/grpo_vs_trl.sh

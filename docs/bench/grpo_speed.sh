#!/usr/bin/env bash
# GRPO speed in one device call, one H200: the rollout decoder alone with and without grpo.min_new_tokens' forcing
# (bin/decode_bench.py, the recipe's model, batch 64 x 256 new tokens, recording expert choices as GRPO does), and
# docs/bench/grpo_vs_trl.sh with CONFIGS (default: the pretraining files zero3.json and zero2.json, "auto" batch) and
# its other switches (SKIP_TRL=1 by default here).
#   bash docs/bench/grpo_speed.sh      (on the GPU machine, from the checkout, .whl/ carried)
# Switches: DECODE_MODES ("free forced"; "" skips the decoder), DECODE_ARGS (more decode_bench arguments, e.g.
#   --profile: the device kernels of one call, by time), DECODE_LAST=1 (the decoder after GRPO), T_DECODE (s per run).
# Files: $OUT/decode_<mode>.jsonl, $OUT/decode.txt, and grpo_vs_trl.sh's files in $OUT.
set -u
OUT=${OUT:-/tmp/grpo_speed}; mkdir -p "$OUT"
. docs/bench/gpu_env.sh deepspeed
RECIPE=${RECIPE:-engine/recipes/grpo_2b6.yaml}
decoder() {
  for mode in ${DECODE_MODES-free forced}; do
    flag=""; [ "$mode" = forced ] && flag=--min_new_tokens
    timeout "${T_DECODE:-120}" python3 bin/decode_bench.py --config "$RECIPE" --batch 64 --new_tokens 256 --calls 3 \
      --record_routes $flag ${DECODE_ARGS:-} --out "$OUT/decode_$mode.jsonl" 2>&1 \
      | grep -vE "Warning|warn|^W[0-9]" | sed "s/^/$mode: /" >> "$OUT/decode.txt"
    grep -E "^$mode: (call|decoder)" "$OUT/decode.txt"
  done
}
[ "${DECODE_LAST:-0}" = 1 ] || decoder
OUT=$OUT RECIPE=$RECIPE CONFIGS=${CONFIGS:-zero3 zero2} SKIP_TRL=${SKIP_TRL:-1} BUDGET_S=${BUDGET_S:-420} \
  bash docs/bench/grpo_vs_trl.sh
[ "${DECODE_LAST:-0}" = 1 ] && decoder
exit 0

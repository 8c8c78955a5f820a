#!/usr/bin/env bash
# The rollout decoder alone (bin/decode_bench.py: the recipe's model, batch 64 x 256 new tokens forced as GRPO's
# grpo.min_new_tokens does, recording expert choices) in several variants, one device call, one H200:
#   bash docs/bench/decode_variants.sh      (on the GPU machine, from the checkout, .whl/ carried)
# VARIANTS: space-separated label=args pairs, args with commas for spaces (default: the shared experts unfolded and
# folded, the default; e.g. autotune=--compile_mode,max-autotune adds a variant, whose compile took over 130 s). PROFILE=label profiles that variant's last call. T_DECODE: s per run.
# Files: $OUT/decode_variants.jsonl (the rows, with a "variant" key), $OUT/decode_variants.txt (all output).
set -u
OUT=${OUT:-/tmp/decode_variants}; mkdir -p "$OUT"
. docs/bench/gpu_env.sh deepspeed
RECIPE=${RECIPE:-engine/recipes/grpo_2b6.yaml}
for v in ${VARIANTS:-unfolded=--no_fold_shared folded=}; do
  label=${v%%=*}; args=${v#*=}; args=${args//,/ }
  [ "${PROFILE:-}" = "$label" ] && args="$args --profile"
  timeout -k 10 "${T_DECODE:-150}" python3 bin/decode_bench.py --config "$RECIPE" --batch 64 --new_tokens 256 --calls 3 \
    --record_routes --min_new_tokens $args --out "$OUT/rows_$label.jsonl" 2>&1 \
    | grep -vE "Warning|warn|^W[0-9]" | sed "s/^/$label: /" >> "$OUT/decode_variants.txt"
  grep -E "^$label: (call|decoder)" "$OUT/decode_variants.txt"
  python3 -c "import json,sys; [print(json.dumps({'variant': sys.argv[1], **json.loads(l)})) for l in open(sys.argv[2])]" \
    "$label" "$OUT/rows_$label.jsonl" >> "$OUT/decode_variants.jsonl" 2>/dev/null && rm -f "$OUT/rows_$label.jsonl"
done
exit 0

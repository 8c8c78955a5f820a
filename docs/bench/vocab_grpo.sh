#!/usr/bin/env bash
# GRPO at vocabulary 512 and 129,280 on equal work, one H200, one device call: docs/bench/grpo_vs_trl.sh's engine
# runs (zero3_grpo.json, zero2_grpo.json) on engine/recipes/grpo_2b6.yaml with only vocab_size changed, every
# completion forced to max_new_tokens (grpo.min_new_tokens), each vocabulary from its own random init.
# TRL runs separately (SKIP_TRL=1 here: its step does not depend on the vocabulary, and one TRL run takes 4 of the
# call's 10 minutes): the ratio at each vocabulary is TRL's step / the engine's.
#   bash docs/bench/vocab_grpo.sh      (on the GPU machine, from the checkout, with .whl/ carried)
# Rows: $OUT/v512/, $OUT/v129k/ (grpo_vs_trl.sh's files for each).
set -u
OUT=${OUT:-/tmp/vocab_grpo}; mkdir -p /tmp/vg
if ! python3 -c "import deepspeed, trl" 2>/dev/null; then  # the wheels once, for both runs
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
for v in 512 129280; do
  python3 - "$v" <<'PY'
import sys, yaml
v = int(sys.argv[1])
r = yaml.safe_load(open("engine/recipes/grpo_2b6.yaml"))
r["model"]["vocab_size"] = v
yaml.safe_dump(r, open(f"/tmp/vg/grpo_2b6_v{v}.yaml", "w"), sort_keys=False)
PY
done
OUT=$OUT/v512 RECIPE=/tmp/vg/grpo_2b6_v512.yaml INIT=/tmp/vg/init_v512 SKIP_TRL=1 BUDGET_S=${BUDGET_512_S:-280} \
  MASTER_PORT=29610 bash docs/bench/grpo_vs_trl.sh
OUT=$OUT/v129k RECIPE=/tmp/vg/grpo_2b6_v129280.yaml INIT=/tmp/vg/init_v129k SKIP_TRL=${SKIP_TRL:-1} \
  BUDGET_S=${BUDGET_129K_S:-280} MASTER_PORT=29650 bash docs/bench/grpo_vs_trl.sh

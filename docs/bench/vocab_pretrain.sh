#!/usr/bin/env bash
# Pretraining at a real vocabulary on one H200, in one device call (engine/head.py's chunked output layer):
#   1. bin/pretrain.py on engine/recipes/deepseek_2b6.yaml at vocabulary 512 and 129,280 (the recipe's), the shipped
#      zero2.json and zero3.json ("auto" batch): tokens/s (metrics rows after the first: the first holds compile and
#      warm-up), MFU, peak memory, the micro-batch "auto" chose and the peak it predicted
#   2. bin/bench.py at 129,280, zero3.json, micro-batch 8: the chunked output layer against transformers' plain one
#      (--plain_head: the micro-batch's whole logits, fp32 for the loss): peak memory at the same micro-batch
# MFU = tokens/s x FLOPs per token / 989 TFLOP/s, FLOPs per token = 6 x active parameters except the input
# embedding (the output layer counted in full; routed experts at top-k / experts) + attention 3 x layers x 2 x seq x
# heads x (qk + v head dims): bin/bench.py's formula, computed here from engine.auto_batch.param_counts.
#   bash docs/bench/vocab_pretrain.sh      (on the GPU machine, from the checkout, with .whl/ carried)
#   VOCABS="32768" BENCH=0 bash docs/bench/vocab_pretrain.sh     (other vocabularies, pretraining rows only)
#   VOCABS=129280 BENCH=0 DSS=zero3 TRAIN_SET="activation_checkpointing=true compile=true" TAG=_ac_c bash ...
#     (DSS: the shipped files run, default "zero2 zero3"; TRAIN_SET: recipe train.* values; TAG: a label suffix)
# Rows: $OUT/vocab_pretrain.jsonl; logs: $OUT/vocab_pretrain_logs.txt; bench table: $OUT/vocab_bench.jsonl.
set -u
OUT=${OUT:-/tmp/vocab_pretrain}; mkdir -p "$OUT"
. docs/bench/gpu_env.sh deepspeed
STEPS=${STEPS:-10}; LOG=$OUT/vocab_pretrain_logs.txt; PORT=29700; END=$((SECONDS + ${BUDGET_S:-560}))
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > /dev/null 2>&1
mkdir -p /tmp/vp
VOCABS=${VOCABS:-512 129280}
for v in $VOCABS; do  # the shipped recipe at vocabulary v, end-of-run checkpoint off
  python3 - "$v" "${TRAIN_SET:-}" <<'PY'
import sys, yaml
v = int(sys.argv[1])
raw = yaml.safe_load(open("engine/recipes/deepseek_2b6.yaml"))
raw["model"]["vocab_size"] = v
for kv in sys.argv[2].split():
    k, _, val = kv.partition("=")
    raw["train"][k] = yaml.safe_load(val)
raw["checkpoint"] = {"at_end": False, "every_minutes": 0}
yaml.safe_dump(raw, open(f"/tmp/vp/deepseek_2b6_v{v}.yaml", "w"))
PY
done
lim() { local room=$((END - SECONDS)); [ "$room" -lt "$1" ] && echo "$room" || echo "$1"; }
pretrain() {  # pretrain LABEL DS VOCAB LIMIT: one bin/pretrain.py run and its row
  local label=$1 ds=$2 v=$3 t=$SECONDS; PORT=$((PORT + 1)); rm -rf "/tmp/vp/runs/$label"
  timeout -k 10 "$(lim "$4")" python3 -m deepspeed.launcher.runner --master_port $PORT --num_gpus 1 bin/pretrain.py \
    --deepspeed_config "ds_configs/$ds" --config "/tmp/vp/deepseek_2b6_v$v.yaml" --max_steps "$STEPS" \
    --run_dir "/tmp/vp/runs/$label" > /tmp/vp/run.log 2>&1
  local rc=$?
  gpu_settle "--run_dir /tmp/vp/runs/$label"
  { echo "== $label (exit $rc)"; cat /tmp/vp/run.log; } >> "$LOG"
  python3 - "$label" "$ds" "$v" "$rc" "$((SECONDS - t))" "/tmp/vp/runs/$label/metrics.jsonl" /tmp/vp/run.log \
    "$OUT/vocab_pretrain.jsonl" <<'PY'
import json, os, re, sys
from engine.auto_batch import param_counts
from engine.config import load_recipe
label, ds, v, rc, wall, metrics, log, out = sys.argv[1:]
m = load_recipe(f"/tmp/vp/deepseek_2b6_v{v}.yaml").model
total, experts = param_counts(m)
active = total - m.vocab_size * m.hidden_size - experts + experts * m.experts_per_token / m.num_experts
flops = 6 * active + 3 * m.num_layers * 2 * 2048 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
text = open(log, errors="replace").read()
batch = re.search(r"batch: micro-batch (\d+) x (\d+)[^\n]*?predicted peak ([\d.]+) GiB", text)
err = re.search(r"(error: [^\n]{0,300}|OutOfMemoryError[^\n]{0,200})", text)
rows = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
timed = rows[1:]
tps = sum(r["tokens_per_s_per_rank"] for r in timed) / len(timed) if timed else None
row = {"label": label, "ds_config": ds, "vocab": int(v), "exit": int(rc), "wall_s": int(wall),
       "micro": int(batch.group(1)) if batch else None, "accum": int(batch.group(2)) if batch else None,
       "predicted_peak_gib": float(batch.group(3)) if batch else None, "flops_per_token": flops,
       "tokens_per_s_per_gpu": round(tps) if tps else None, "mfu": round(tps * flops / 989e12, 4) if tps else None,
       "peak_gib": max((r["peak_mem_gib"] for r in rows), default=None), "losses": [round(r["loss"], 4) for r in rows],
       "steps_timed": [r["step"] for r in timed], "error": err.group(0) if err else None}
open(out, "a").write(json.dumps(row) + "\n")
print(row)
PY
}
bench() {  # bench LABEL VOCAB LIMIT [ARGS...]: bin/bench.py, zero3.json, micro-batch 8
  local label=$1 v=$2 l=$3; shift 3; PORT=$((PORT + 1))
  timeout -k 10 "$(lim "$l")" python3 -m deepspeed.launcher.runner --master_port $PORT --num_gpus 1 bin/bench.py \
    --deepspeed_config ds_configs/zero3.json --config "/tmp/vp/deepseek_2b6_v$v.yaml" --micro_batch 8 --steps 3 \
    --warmup 2 --label "$label" --out "$OUT/vocab_bench.jsonl" "$@" > /tmp/vp/bench.log 2>&1
  echo "== bench $label (exit $?)" >> "$LOG"; cat /tmp/vp/bench.log >> "$LOG"; tail -4 /tmp/vp/bench.log
}
name() { [ "$1" -lt 1000 ] && echo "$1" || echo "$(($1 / 1000))k"; }  # 129280 -> 129k
for ds in ${DSS:-zero2 zero3}; do for v in $VOCABS; do
  pretrain "${ds/zero/z}_v$(name "$v")${TAG:-}" "$ds.json" "$v" "${T_RUN:-150}"
done; done
if [ "${BENCH:-1}" = 1 ]; then
  bench z3_m8_v129k_chunked 129280 90
  bench z3_m8_v129k_plain 129280 90 --plain_head
fi
echo "done in ${SECONDS}s"

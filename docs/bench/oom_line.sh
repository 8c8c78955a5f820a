#!/usr/bin/env bash
# What a user sees when a written micro-batch does not fit: bin/pretrain.py on engine/recipes/deepseek_2b6.yaml with
# train_micro_batch_size_per_gpu MICRO (default 64 rows of 2048 tokens, far over 80 GB) under each shipped file of
# DSS (default "zero2 zero3"). Expected: exit 1 and, last, one "error: out of device memory while training at
# micro-batch 64 x accumulation 1 ..." line, no traceback.
#   OUT=$OUT/oom bash docs/bench/oom_line.sh      (on the GPU machine, from the checkout, with .whl/ carried)
# Output: $OUT/oom_line.txt (each run's exit code, its last 3 lines, and whether a Traceback was printed).
set -u
OUT=${OUT:-/tmp/oom_line}; mkdir -p "$OUT" /tmp/oom
. docs/bench/gpu_env.sh deepspeed
PORT=29750
for ds in ${DSS:-zero2 zero3}; do
  python3 -c "import json, sys; c = json.load(open('ds_configs/$ds.json'))
c.update(train_micro_batch_size_per_gpu=${MICRO:-64}, gradient_accumulation_steps=1); c.pop('train_batch_size', None)
json.dump(c, open('/tmp/oom/$ds.json', 'w'))"
  PORT=$((PORT + 1)); rm -rf "/tmp/oom/run_$ds"
  timeout -k 10 "${T_RUN:-150}" python3 -m deepspeed.launcher.runner --master_port $PORT --num_gpus 1 bin/pretrain.py \
    --deepspeed_config "/tmp/oom/$ds.json" --config engine/recipes/deepseek_2b6.yaml --max_steps 2 \
    --run_dir "/tmp/oom/run_$ds" > /tmp/oom/out.txt 2> /tmp/oom/err.txt
  rc=$?
  gpu_settle "--run_dir /tmp/oom/run_$ds"
  tracebacks=$(cat /tmp/oom/err.txt /tmp/oom/out.txt | grep -c Traceback)
  { echo "== $ds, micro ${MICRO:-64} x 1: exit $rc; tracebacks printed: $tracebacks"; tail -3 /tmp/oom/err.txt; } \
    | tee -a "$OUT/oom_line.txt"
done

#!/usr/bin/env bash
# The seed scale on an 80 GB GPU (an H200 capped with --memory_fraction 0.5596): deepseek_5b3 (vocabulary 129,280)
# through bin/bench.py with each way DeepSpeed 0.19.8 offers to keep the fp32 Adam states off the GPU, one row each:
#   bf16_states   zero3_bf16_states.json (bf16 master weights and moments on the GPU under ZeRO-3)
#   ratio05       zero3_offload.json as shipped (half the optimizer on the CPU)
#   ratio03/07    the same with offload_optimizer.ratio 0.3 / 0.7
#   superoffload  ZeRO-3 with offload_optimizer.super_offload (DeepSpeed's SuperOffload)
#   z2_bf16_states  zero2.json (compiled AutoEP) with bf16 master weights, gradients and Adam moments on the GPU
#                 (= ds_configs/zero2_bf16_states.json: what the 80 GB refusal names first)
#   z2_offload    zero2.json with the whole fp32 optimizer on the CPU (ZeRO-2 ignores offload_optimizer.ratio)
#   z2_offload_nockpt  the same without activation checkpointing (the GPU holds only bf16 weights and gradients)
#   zenflow       (refused by the engine's config check since 2026-12-03, kept to show the refusal: DeepSpeed 0.19.8's
#                 ZenFlow returns the model with its matrices' values reordered, NaN at step 2 on CPU ranks, and failed
#                 on a GPU in step 1 with AutoEP's experts) ZeRO-2, optimizer on the CPU, zero_optimization.zenflow (the top 5% of gradient columns updated on the
#                 GPU every step, the rest on the CPU every 4 steps, overlapped with the next steps)
# "auto" micro-batch where the file has it (chosen for the capped memory); STEPS (6) steps after WARMUP (2).
#   bash docs/bench/offload_80gb.sh      (on the GPU machine, from the checkout, .whl/ carried; ~3 min a row:
#   split RUNS over two 10-minute calls, e.g. RUNS="bf16_states ratio05 superoffload" and "ratio03 ratio07")
# RECIPE and MEMORY_FRACTION change the model and the cap (a CPU smoke test: RECIPE=engine/recipes/tiny.yaml STEPS=2
# WARMUP=1 RUNS="superoffload").
# Files: $OUT/offload.jsonl (bench rows), $OUT/logs.tgz.
set -u
OUT=${OUT:-/tmp/offload}; W=/tmp/off; mkdir -p "$OUT" $W/logs
. docs/bench/gpu_env.sh deepspeed
args() {  # one argument per line
  local auto="--ds_set
train_micro_batch_size_per_gpu=auto
--ds_set
gradient_accumulation_steps=auto"
  case $1 in
    bf16_states) printf '%s\n' --deepspeed_config ds_configs/zero3_bf16_states.json ;;
    ratio05) printf '%s\n' --deepspeed_config ds_configs/zero3_offload.json "$auto" ;;
    ratio03|ratio07) printf '%s\n' --deepspeed_config ds_configs/zero3_offload.json "$auto" --ds_set \
      "zero_optimization.offload_optimizer.ratio=0.${1#ratio0}" ;;
    superoffload) printf '%s\n' --deepspeed_config ds_configs/zero3.json --ds_set \
      "zero_optimization.offload_optimizer={device: cpu, pin_memory: true, super_offload: true}" ;;
    z2_bf16_states) printf '%s\n' --deepspeed_config ds_configs/zero2.json --ds_set \
      "bf16={enabled: true, bf16_master_weights_and_grads: true, bf16_optimizer_states: true}" ;;
    z2_offload) printf '%s\n' --deepspeed_config ds_configs/zero2.json --ds_set \
      "zero_optimization.offload_optimizer={device: cpu, pin_memory: true}" ;;
    z2_offload_nockpt) printf '%s\n' --deepspeed_config ds_configs/zero2.json --ds_set \
      "zero_optimization.offload_optimizer={device: cpu, pin_memory: true}" --set train.activation_checkpointing=false ;;
    zenflow) printf '%s\n' --deepspeed_config ds_configs/zero2.json --ds_set \
      "zero_optimization.offload_optimizer={device: cpu, pin_memory: true}" --ds_set \
      "zero_optimization.zenflow={topk_ratio: 0.05, select_strategy: auto, select_interval: auto, update_interval: 4, overlap_step: true}" ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}
port=29600
for run in ${RUNS:-bf16_states ratio05 ratio03 ratio07 superoffload}; do
  port=$((port + 1)); t=$SECONDS
  mapfile -t extra < <(args $run)
  timeout -k 15 ${T_RUN:-270} python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 bin/bench.py \
    --config ${RECIPE:-engine/recipes/deepseek_5b3.yaml} --memory_fraction ${MEMORY_FRACTION:-0.5596} --steps ${STEPS:-6} --warmup ${WARMUP:-2} \
    --label $run --out "$OUT/offload.jsonl" "${extra[@]}" > $W/logs/$run.log 2>&1
  rc=$?; gpu_settle "--label $run "
  echo "$run: exit $rc in $((SECONDS - t))s $(grep -m1 -oE 'batch: .{0,90}' $W/logs/$run.log) $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,200}|error: .{0,200}' $W/logs/$run.log)"
done
python3 -c "import sys, json; sys.path.insert(0, 'bin'); from bench import print_table
print_table([json.loads(l) for l in open(sys.argv[1])])" "$OUT/offload.jsonl"
tar czf "$OUT/logs.tgz" -C $W logs

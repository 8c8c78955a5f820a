#!/usr/bin/env bash
# The GPU measurements behind docs/benchmarks.md, in phases that each fit one 10-minute device call.
# On the H200 machine (no registry access), from the checkout, with .whl/ built by ../shared/tools/offline-wheels.sh:
#   bash docs/bench/h200_sweep.sh A        # 1 GPU: engine configs vs the plain ZeRO-3 baseline (2.6B recipe)
#   bash docs/bench/h200_sweep.sh A2       # 1 GPU: GRPO with grouped_mm decoding, ZeRO-2 micro 16 (profiled), compile
#   bash docs/bench/h200_sweep.sh A3       # 1 GPU: the compiled ZeRO-2 config accumulating 2 micro-batches, and the baseline
#   bash docs/bench/h200_sweep.sh E        # 1 GPU: AutoEP's fused top-k combine and fused gate/up, 4-step accumulation
#   bash docs/bench/h200_sweep.sh D        # 1 GPU: the shipped tuned config vs untuned from one saved init, baseline
#   bash docs/bench/h200_sweep.sh F        # 1 GPU: the noise floor for D (tuned vs itself), ZeRO-3 with the fused combine
#   bash docs/bench/h200_sweep.sh G        # 1 GPU: ZeRO-3 + AutoEP with the fused vs DeepSpeed's combine, baseline
#   bash docs/bench/h200_sweep.sh H        # 1-2 GPUs: bin/pretrain.py as shipped, tiny default and 2.6B, 20 steps
#   bash docs/bench/h200_sweep.sh I        # 1 GPU: the headline pair again (shipped tuned vs plain ZeRO-3 baseline), twice
#   bash docs/bench/h200_sweep.sh K        # 1 GPU: ZeRO-3 + AutoEP at micro 16 x 4 (the multi-GPU issue's config), ZeRO-3 knobs
#   bash docs/bench/h200_sweep.sh L        # 1 GPU: the headline pair once more (baseline first), GRPO with the fused combine
#   bash docs/bench/h200_sweep.sh M        # 1 GPU: the headline pair over the longer window (40 steps after 10) for both
#   bash docs/bench/h200_sweep.sh N1       # 1 GPU: does a loaded initial model run faster (phase D's 93.7k)? ZeRO-1 in a pair
#   bash docs/bench/h200_sweep.sh N2       # 1 GPU: 8 accumulation steps for both (global batch 128 x 2048)
#   bash docs/bench/h200_sweep.sh B        # 1 GPU: GRPO on the 2.6B recipe, seed-scale 5.3B under an 80 GB cap
#   bash docs/bench/h200_sweep.sh C        # 2 GPUs: ZeRO-3 + EP 2 next to the plain ZeRO-3 baseline, pipeline (multi-GPU issue)
#   bash docs/bench/h200_sweep.sh CN       # 2, 4 or 8 GPUs: weak scaling 1 -> all GPUs, the tuned config and ZeRO-3
#   bash docs/bench/h200_sweep.sh J        # 8 GPUs: the ~16B recipe with expert parallel 8, GRPO on the 2.6B recipe
# Phases A to N1 ran before bench.py stopped synchronizing inside its timed window (37b3631): run I first next time.
# Results: $OUT/bench_<phase>.jsonl (one JSON row per run, the table bin/bench.py prints), logs beside them.
set -u
OUT=${OUT:-/tmp/bench_out}
LOGS=$OUT/logs  # one log per run, packed into $OUT/logs_<phase>.tgz at the end (the device returns 8 files)
mkdir -p "$LOGS"
. docs/bench/gpu_env.sh deepspeed
DS="python3 $(command -v deepspeed)"
REF=engine/recipes/deepseek_2b6.yaml

END=$((SECONDS + ${BUDGET_S:-560}))  # every run is cut so the phase ends inside one 10-minute device call
bench() {  # bench LABEL GPUS TIMEOUT ARGS...: one bin/bench.py run, a row in $OUT/bench_$PHASE.jsonl
  local label=$1 gpus=$2 limit=$3; shift 3
  local left=$((END - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 40 ]; then echo "$label: skipped, ${left}s left"; return; fi
  local t0=$SECONDS
  timeout "$limit" $DS --num_gpus "$gpus" bin/bench.py --out "$OUT/bench_$PHASE.jsonl" --label "$label" "$@" \
    > "$LOGS/$label.log" 2>&1
  echo "$label: exit $? in $((SECONDS - t0))s $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,120}' "$LOGS/$label.log")"
}
grpo() {  # grpo LABEL TIMEOUT ARGS...: 5 GRPO steps of grpo_2b6 on $GRPO_GPUS (1) GPUs, metrics as $OUT/LABEL_metrics.jsonl
  local label=$1 limit=$2 t0=$SECONDS; shift 2
  sed 's/every_minutes: 60/every_minutes: 0\n  at_end: false/' engine/recipes/grpo_2b6.yaml > /tmp/grpo_2b6.yaml
  timeout "$limit" $DS --num_gpus "${GRPO_GPUS:-1}" bin/grpo.py --deepspeed_config ds_configs/zero3_grpo.json \
    --config /tmp/grpo_2b6.yaml --run_dir "/tmp/$label" --max_steps 5 "$@" > "$LOGS/$label.log" 2>&1
  echo "$label: exit $? in $((SECONDS - t0))s"; cp "/tmp/$label/metrics.jsonl" "$OUT/${label}_metrics.jsonl" 2>/dev/null
}
prebuild() {  # prebuild [BUILDER]: DeepSpeed JIT-builds its ops on first use; build once, outside any run's timeout
  local op=${1:-FusedAdamBuilder} t0=$SECONDS
  python3 -c "from deepspeed.ops.op_builder import $op; $op().load()" > "$LOGS/prebuild_$op.log" 2>&1
  echo "$op build: exit $? in $((SECONDS - t0))s"
}

save_init() {  # one random initial 2.6B model in /tmp/init_2b6, so runs under different ZeRO stages start alike
  python3 -c "
import sys; sys.path.insert(0, '.')
import torch
from transformers import AutoModelForCausalLM
from engine.config import load_recipe
from engine.data import load_tokenizer
from engine.model import make_hf_config
r = load_recipe('$REF'); tok = load_tokenizer(r.data.tokenizer); torch.manual_seed(0)
with torch.device('cuda'):
    m = AutoModelForCausalLM.from_config(make_hf_config(r.model, tok), dtype=torch.bfloat16)
m.save_pretrained('/tmp/init_2b6'); tok.save_pretrained('/tmp/init_2b6')" > "$LOGS/init.log" 2>&1
  echo "init: exit $?"
}

PHASE=${1:?phase A, A2, A3, B, C, CN, D, E, F, G, H, I, J, K, L, M, N1 or N2}
case "$PHASE" in
A)
  # global batch 16 x 2048 tokens everywhere (micro 8 runs accumulate 2), 50 steps: rows carry every step's loss,
  # so the untuned and tuned rows are also the loss comparison; micro 8 x 2 vs 16 x 1 is the bf16 noise floor
  prebuild
  S="--config $REF --steps 40 --warmup 10"
  bench untuned_z3_ep_m8x2 1 120 $S --deepspeed_config ds_configs/zero3.json --ds_set gradient_accumulation_steps=2
  bench z2_ep_m16 1 110 $S --deepspeed_config ds_configs/zero2.json --micro_batch 16 --profile 2
  bench base_z3_plain_m8x2 1 120 $S --deepspeed_config ds_configs/zero3.json --no_autoep \
    --ds_set gradient_accumulation_steps=2
  bench z2_ep_m16_fusedgu 1 100 $S --deepspeed_config ds_configs/zero2.json --micro_batch 16 \
    --ds_set expert_parallel.gate_up_impl=fused
  bench z2_ep_m16_flex 1 120 $S --deepspeed_config ds_configs/zero2.json --micro_batch 16 \
    --set model.attn_implementation=flex_attention
  bench base_z3_plain_m16 1 100 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16
  bench z3_ep_m16 1 100 $S --deepspeed_config ds_configs/zero3.json --micro_batch 16
  bench z2_ep_m16_compile 1 150 $S --deepspeed_config ds_configs/zero2.json --micro_batch 16 \
    --set train.compile=true --ds_set compile.autoep_non_moe=true
  ;;
A2)
  # the second round on 1 GPU: phase A's micro-16 runs timed out while ZeRO-2 still built the model on the CPU
  prebuild
  grpo grpo_2b6_gmm 150  # grpo.decode_experts: grouped_mm (the default since d1a6354)
  S="--config $REF --steps 40 --warmup 10"
  bench z2_ep_m16 1 90 $S --deepspeed_config ds_configs/zero2.json --micro_batch 16 --profile 2
  bench base_z3_plain_m16 1 80 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16
  bench z2_ep_m8x2 1 75 $S --deepspeed_config ds_configs/zero2.json --ds_set gradient_accumulation_steps=2
  bench z2_ep_m16_compile 1 150 $S --deepspeed_config ds_configs/zero2.json --micro_batch 16 \
    --set train.compile=true --ds_set compile.autoep_non_moe=true
  ;;
A3)
  # the optimizer step (~97 ms) is a sixth of a compiled micro-16 step: accumulate 2 micro-batches (global batch
  # 32 x 2048 = 65k tokens), the baseline at the same global batch
  prebuild
  S="--config $REF --steps 20 --warmup 5"
  bench z2_ep_m16x2_compile 1 80 $S --deepspeed_config ds_configs/zero2.json --micro_batch 16 \
    --ds_set gradient_accumulation_steps=2 --set train.compile=true --ds_set compile.autoep_non_moe=true
  bench base_z3_plain_m16x2 1 75 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16 \
    --ds_set gradient_accumulation_steps=2
  ;;
D)
  # after phase E: the tuned config as shipped (zero2.json: micro 16 x 4, fused top-k combine, compiled outside the
  # AutoEP blocks) against the untuned one (zero3.json with DeepSpeed's own combine) from one saved initial model
  # (ZeRO-2 and ZeRO-3 draw different random weights), global batch 64 x 2048 for both, 50 steps; then the
  # plain ZeRO-3 baseline at its best micro-batch and the same global batch
  prebuild
  save_init
  S="--config $REF --steps 40 --warmup 10 --set model.init_from=/tmp/init_2b6"
  bench same_init_tuned 1 140 $S --deepspeed_config ds_configs/zero2.json
  bench same_init_untuned 1 230 $S --deepspeed_config ds_configs/zero3.json --ds_set gradient_accumulation_steps=8 \
    --ds_set expert_parallel.combine_impl=weighted_sum
  bench base_z3_plain_m16x4 1 110 --config $REF --steps 16 --warmup 4 --deepspeed_config ds_configs/zero3.json \
    --no_autoep --micro_batch 16 --ds_set gradient_accumulation_steps=4
  ;;
E)
  # the MoE block's element-wise half (profile_z2_ep_m16.txt): the top-k combine materialises [tokens x k x hidden]
  # in fp32 (zeros, index_put, mul, sum); AutoEP's Triton kernel (combine_impl=fused_weighted_sum) does it in one
  # pass. Then one grouped GEMM for gate+up, and 4 accumulated micro-batches (the optimizer step is ~100 ms)
  prebuild
  S="--config $REF --steps 16 --warmup 4"
  FWS="--ds_set expert_parallel.combine_impl=fused_weighted_sum"
  FGU="--ds_set expert_parallel.gate_up_impl=fused"
  bench tuned 1 80 $S --deepspeed_config ds_configs/zero2.json
  bench tuned_fws 1 80 $S --deepspeed_config ds_configs/zero2.json $FWS
  bench tuned_fws_fgu_x4 1 95 $S --deepspeed_config ds_configs/zero2.json $FWS $FGU \
    --ds_set gradient_accumulation_steps=4
  bench base_z3_plain_m16x4 1 120 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16 \
    --ds_set gradient_accumulation_steps=4
  bench tuned_fws_fgu 1 80 $S --deepspeed_config ds_configs/zero2.json $FWS $FGU --profile 2
  bench tuned_fws_fgu_x4_z1 1 95 $S --deepspeed_config ds_configs/zero2.json $FWS $FGU \
    --ds_set gradient_accumulation_steps=4 --ds_set zero_optimization.stage=1
  ;;
F)
  # the bf16 noise floor for phase D's comparison: the shipped tuned config against itself at micro 8 x 8 (the
  # same sums in another order) and with DeepSpeed's own combine, from the same saved init; then ZeRO-3 with the
  # fused combine the engine now picks on CUDA (phase D's untuned run had DeepSpeed's combine written in)
  prebuild
  save_init
  S="--config $REF --steps 40 --warmup 10 --set model.init_from=/tmp/init_2b6"
  bench same_init_tuned_m8x8 1 150 $S --deepspeed_config ds_configs/zero2.json --micro_batch 8 \
    --ds_set gradient_accumulation_steps=8
  bench same_init_tuned_weighted_sum 1 140 $S --deepspeed_config ds_configs/zero2.json \
    --ds_set expert_parallel.combine_impl=weighted_sum
  bench z3_ep_m8x2 1 90 --config $REF --steps 10 --warmup 3 --deepspeed_config ds_configs/zero3.json \
    --ds_set gradient_accumulation_steps=2
  ;;
G)
  # ZeRO-3 + AutoEP at micro 8 x 2 ran 38.3k in phase F against 46.1k in phase A: the fused combine against
  # DeepSpeed's own on one machine, and the plain baseline at the same micro-batch (is this host slower?)
  prebuild
  S="--config $REF --steps 10 --warmup 3 --deepspeed_config ds_configs/zero3.json --ds_set gradient_accumulation_steps=2"
  bench z3_ep_m8x2_fused 1 70 $S
  bench z3_ep_m8x2_weighted_sum 1 70 $S --ds_set expert_parallel.combine_impl=weighted_sum
  bench base_z3_plain_m8x2 1 70 $S --no_autoep
  ;;
H)
  # the engine issue's GPU check with the README's own command: the tiny default and the 2.6B recipe for 20 steps
  # through bin/pretrain.py (not bench), as shipped (zero3.json), on every GPU of the machine
  prebuild
  N=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for r in tiny deepseek_2b6; do
    t0=$SECONDS
    timeout 200 $DS --num_gpus "$N" bin/pretrain.py --deepspeed_config ds_configs/zero3.json \
      --config engine/recipes/$r.yaml --max_steps 20 --run_dir "/tmp/run_$r" > "$LOGS/pretrain_$r.log" 2>&1
    echo "pretrain $r on $N GPU(s): exit $? in $((SECONDS - t0))s"; cp "/tmp/run_$r/metrics.jsonl" "$OUT/pretrain_${r}_${N}gpu.jsonl"
  done
  ;;
I)
  # the 1.72x headline (phase E/D) came from one run pair: the shipped tuned config and the plain ZeRO-3 baseline
  # at the same global batch (64 x 2048), alternated twice on one machine
  prebuild
  S="--config $REF --steps 16 --warmup 4"
  for k in $(seq 1 "${REPS:-2}"); do  # REPS=1: one pair
    bench tuned_r$k 1 80 $S --deepspeed_config ds_configs/zero2.json
    bench base_z3_plain_m16x4_r$k 1 110 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16 \
      --ds_set gradient_accumulation_steps=4
  done
  ;;
K)
  # the multi-GPU issue asks 35% MFU from ZeRO-3 + expert parallel, where DeepSpeed cannot compile around AutoEP:
  # zero3.json at the tuned config's micro-batch and global batch, then two ZeRO-3 knobs against its per-module
  # hook overhead: fold small modules (attention, shared experts) into one fetch, and leave <1e5-element
  # parameters (the routers) unpartitioned (DeepSpeed's default; zero3.json says 1e4)
  prebuild
  S="--config $REF --steps 16 --warmup 4 --deepspeed_config ds_configs/zero3.json --micro_batch 16"
  S="$S --ds_set gradient_accumulation_steps=4"
  bench z3_ep_m16x4 1 100 $S
  bench z3_ep_m16x4_gran3e6 1 100 $S --ds_set zero_optimization.stage3_module_granularity_threshold=3000000
  bench z3_ep_m16x4_persist1e5 1 100 $S --ds_set zero_optimization.stage3_param_persistence_threshold=100000
  ;;
L)
  # phase I's same-call pair came out at 1.68x against phase D's 1.72x: one more pair, the baseline first this time;
  # then GRPO on the 2.6B recipe with the engine's current defaults (fused top-k combine on CUDA), last run at 1972d1a
  prebuild
  S="--config $REF --steps 16 --warmup 4"
  bench base_z3_plain_m16x4_r3 1 110 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16 \
    --ds_set gradient_accumulation_steps=4
  bench tuned_r3 1 80 $S --deepspeed_config ds_configs/zero2.json
  grpo grpo_2b6_fused 190
  ;;
M)
  # phase D timed the tuned config over 40 steps after 10 but the baseline over 16 after 4; I and L (16 after 4 for
  # both) gave 1.68x. Both over the longer window, from the random init (no init_from), in one call
  prebuild
  S="--config $REF --steps 40 --warmup 10"
  bench tuned_w40 1 120 $S --deepspeed_config ds_configs/zero2.json
  bench base_z3_plain_m16x4_w40 1 190 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16 \
    --ds_set gradient_accumulation_steps=4
  ;;
N1)
  # phase D's tuned row (93.7k) loaded a saved random model; every later tuned run from the engine's own random
  # init ran 90.2-91.0k. The same config from both inits, then ZeRO-1 against its baseline (all 16 steps after 4)
  prebuild
  save_init
  S="--config $REF --steps 16 --warmup 4"
  bench tuned_loaded_init 1 90 $S --deepspeed_config ds_configs/zero2.json --set model.init_from=/tmp/init_2b6
  bench tuned_r4 1 80 $S --deepspeed_config ds_configs/zero2.json
  bench tuned_z1 1 80 $S --deepspeed_config ds_configs/zero2.json --ds_set zero_optimization.stage=1
  bench base_z3_plain_m16x4_r4 1 110 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16 \
    --ds_set gradient_accumulation_steps=4
  ;;
N2)
  # 8 accumulated micro-batches for both: the optimizer step (~95 ms tuned, ~70 ms baseline) counts half as much
  prebuild
  S="--config $REF --steps 12 --warmup 3"
  bench tuned_x8 1 110 $S --deepspeed_config ds_configs/zero2.json --ds_set gradient_accumulation_steps=8
  bench base_z3_plain_m16x8 1 150 $S --deepspeed_config ds_configs/zero3.json --no_autoep --micro_batch 16 \
    --ds_set gradient_accumulation_steps=8
  ;;
B)
  prebuild
  grpo grpo_2b6 200  # ran at 1972d1a, before grouped_mm decoding
  S="--config engine/recipes/deepseek_5b3.yaml --steps 6 --warmup 2 --memory_fraction 0.5596"  # 80 GB of 143 GB
  bench seed_bf16_states 1 150 $S --deepspeed_config ds_configs/zero3.json --micro_batch 4 \
    --ds_set bf16.bf16_master_weights_and_grads=true --ds_set bf16.bf16_optimizer_states=true \
    --set train.activation_checkpointing=true
  prebuild CPUAdamBuilder
  bench seed_offload_r05 1 150 $S --deepspeed_config ds_configs/zero3.json --micro_batch 4 \
    --ds_set gradient_accumulation_steps=4 --ds_set zero_optimization.offload_optimizer.device=cpu \
    --ds_set zero_optimization.offload_optimizer.ratio=0.5 --set train.activation_checkpointing=true
  ;;
C)
  # multi-GPU issue on 2 GPUs: ZeRO-3 + expert parallel 2 at micro 16 x 4 (phase K: 31% MFU on one GPU) next to the
  # plain ZeRO-3 baseline at the same global batch, the pipeline config, then ZeRO-3 at micro 24 if time is left
  prebuild
  S="--config $REF --steps 16 --warmup 4"
  Z3="--deepspeed_config ds_configs/zero3.json --ds_set gradient_accumulation_steps=4"
  bench z3_ep_m16x4_2gpu 2 110 $S $Z3 --micro_batch 16
  bench base_z3_plain_m16x4_2gpu 2 120 $S $Z3 --no_autoep --micro_batch 16
  bench pipe_2gpu 2 100 $S --deepspeed_config ds_configs/pipe.json
  bench z3_ep_m24x4_2gpu 2 120 $S $Z3 --micro_batch 24
  ;;
CN)
  # weak scaling 1 -> N GPUs (every GPU of the machine: 2, 4 or 8) at the same per-GPU micro-batch and
  # accumulation, expert parallel N (32 experts, 32/N per GPU): the tuned config and ZeRO-3 + AutoEP
  prebuild
  N=$(python3 -c "import torch; print(torch.cuda.device_count())")
  S="--config $REF --steps 16 --warmup 4"
  Z3="--deepspeed_config ds_configs/zero3.json --ds_set gradient_accumulation_steps=4 --micro_batch 16"
  bench tuned_1gpu 1 80 $S --deepspeed_config ds_configs/zero2.json
  bench tuned_${N}gpu "$N" 110 $S --deepspeed_config ds_configs/zero2.json
  bench z3_ep_m16x4_1gpu 1 100 $S $Z3
  bench z3_ep_m16x4_${N}gpu "$N" 110 $S $Z3
  ;;
J)
  # 8 GPUs: the DeepSeek-V2-Lite-shaped recipe (15.3B total) under ZeRO-3 with expert parallel 8, then GRPO on the
  # 2.6B recipe over all 8 GPUs (rollout and train tokens/s are in its metrics rows)
  prebuild
  N=$(python3 -c "import torch; print(torch.cuda.device_count())")
  bench ds16b_z3_ep${N} "$N" 300 --config engine/recipes/deepseek_16b.yaml --steps 10 --warmup 3 \
    --deepspeed_config ds_configs/zero3.json
  GRPO_GPUS=$N grpo grpo_2b6_${N}gpu 240
  ;;
esac
python3 -c "import sys; sys.argv=['x']; sys.path.insert(0,'bin'); import json, bench; \
bench.print_table([json.loads(l) for l in open('$OUT/bench_$PHASE.jsonl')])" 2>/dev/null
tar czf "$OUT/logs_$PHASE.tgz" -C "$LOGS" . && rm -rf "$LOGS"

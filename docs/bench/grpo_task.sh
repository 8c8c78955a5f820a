#!/usr/bin/env bash
# The comparison of docs/bench/arith_task.md in ONE device call on one H200: pretrain engine/recipes/arith_small.yaml until the arithmetic
# task is partly learned, then plain GRPO, curriculum, tree rollouts and both (engine/recipes/grpo_arith*.yaml),
# 3 seeds each, all at one budget of generated tokens (grpo.max_generated_tokens), and the tree-rollout agreement
# check of bin/decode_bench.py (bf16 and fp32) on the side.
#   bash docs/bench/grpo_task.sh            (on the GPU machine, DeepSpeed importable; OUT=... for the results)
# Steps:
#   1. (background, CUDA only) bin/decode_bench.py --calls 1 --tree, in bf16 then fp32 -> $OUT/decode_tree.jsonl
#   2. pretraining: arith_small.yaml with a checkpoint every PT_EVERY (25) steps, up to PT_MAX_STEPS (800); its
#      LR is constant after warmup, so the step-N checkpoint is what `--max_steps N` gives. docs/bench/arith_eval.py
#      scores each checkpoint as it lands (greedy, `numeric`) on 200 train prompts (dev) and on the held-out
#      prompts, and selects the first with dev accuracy >= TARGET (0.30); pretraining is then stopped.
#   3. GRPO: the 4 variants x SEEDS (1 2 3) from the selected checkpoint's export, all at once on the one GPU
#      (zero2_grpo.json, its own --master_port each), seed = train.seed of a copy of the variant's recipe; each
#      stops at grpo.max_generated_tokens (TOKENS, default the recipe's) or at the time left (then the table
#      compares at the tokens every run reached).
#   4. docs/bench/grpo_task_table.py: the tables (before/after at equal tokens, curves, tokens and wall per step).
# Files back in $OUT (8 at most): summary.md, grpo_metrics.jsonl (every run's metrics rows, tagged), pretrain_evals.jsonl,
# pretrain_selected.json, decode_tree.jsonl, logs.tgz (with pretrain_metrics.jsonl), init_hf.tgz.00, .01 (the selected
# model, when pretrained here).
# Switches (environment): OUT=/tmp/grpo_task_out BUDGET_S=540 TARGET=0.30 PT_MAX_STEPS=800 PT_EVERY=25 SEEDS="1 2 3"
#   VARIANTS="plain curriculum tree tree_curriculum" TOKENS=<recipe's> GRPO_MAX_STEPS=<recipe's> SKIP_DECODE_BENCH=1
#   PT_RECIPE=engine/recipes/arith_small.yaml PT_DS=ds_configs/zero3.json GRPO_DS=ds_configs/zero2_grpo.json
#   SUMMARY_ONLY=1 (re-read $OUT)  INIT_FROM=<HF dir: skip pretraining>  LR=<train.lr of the GRPO runs instead of the recipe's>
#   PARALLEL=<at most this many GRPO runs at once (each still cut BUDGET_S - 45 s after its own start); default all>
#   PORT=<first --master_port of the GRPO runs (29510)>  LRS="1e-5 3e-4" (every run at each; one table per rate)
#   VARIANTS may also name r3 and r3_tis (grpo_arith_r3*.yaml: routing replay, and replay + tis)
# CPU smoke test (tiny model, a few steps, one seed):
#   OUT=/tmp/gt PT_RECIPE=engine/recipes/tiny.yaml PT_MAX_STEPS=4 PT_EVERY=2 TARGET=2 SEEDS=1 TOKENS=300 \
#   GRPO_MAX_STEPS=2 GRPO_DS=/tmp/gt_ds.json bash docs/bench/grpo_task.sh   (/tmp/gt_ds.json: zero2_grpo at 8 x 1)
set -u
OUT=${OUT:-/tmp/grpo_task_out}
W=${WORK:-/tmp/grpo_task}
LOGS=$W/logs
SEEDS=${SEEDS:-1 2 3}
VARIANTS=${VARIANTS:-plain curriculum tree tree_curriculum}
PT_RECIPE=${PT_RECIPE:-engine/recipes/arith_small.yaml}
PT_DS=${PT_DS:-ds_configs/zero3.json}
GRPO_DS=${GRPO_DS:-ds_configs/zero2_grpo.json}
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
T0=$SECONDS
END=$((SECONDS + ${BUDGET_S:-540}))
left() { echo $((END - SECONDS)); }
DS="python3 -m deepspeed.launcher.runner"
CUDA=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
variant_recipe() { [ "$1" = plain ] && echo engine/recipes/grpo_arith.yaml || echo "engine/recipes/grpo_arith_$1.yaml"; }
LR_LIST=${LRS:-${LR:-_}}  # LRS="1e-5 3e-4": every variant x seed at each (one table per rate); _: the recipe's
run_name() { [ "$3" = _ ] && echo "${1}_s$2" || echo "${1}_lr$3_s$2"; }
metrics_name() { [ "$1" = _ ] && echo grpo_metrics.jsonl || echo "grpo_metrics_lr$1.jsonl"; }

if [ "${SUMMARY_ONLY:-0}" != 1 ]; then
  rm -f "$OUT/decode_tree.jsonl" "$OUT/pretrain_evals.jsonl"
  python3 -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  # 1. the tree-rollout agreement check, beside the pretraining (2.6B random weights; GPU only)
  DB_PID=""
  if [ "$CUDA" = 1 ] && [ "${SKIP_DECODE_BENCH:-0}" != 1 ]; then
    ( for dt in bf16 fp32; do
        t=$SECONDS
        TORCHINDUCTOR_COMPILE_THREADS=4 timeout 240 python3 bin/decode_bench.py --calls 1 --tree --dtype $dt \
          --out "$OUT/decode_tree.jsonl" > "$LOGS/decode_bench_$dt.log" 2>&1
        echo "decode_bench $dt: exit $? in $((SECONDS - t))s (started at $((t - T0))s)" >> "$LOGS/decode_bench_status.txt"
      done ) &
    DB_PID=$!
  fi

  # 2. pretraining, its checkpoints scored as they land (INIT_FROM=HF_DIR: skip it and start GRPO from that model)
  if [ -n "${INIT_FROM:-}" ]; then
    rm -rf "$W/init_hf"; cp -r "$INIT_FROM" "$W/init_hf"; echo "init: $INIT_FROM (no pretraining)"
  else
  python3 - "$PT_RECIPE" "$W/pretrain.yaml" "${PT_MAX_STEPS:-800}" "${PT_EVERY:-25}" "$W/pretrain" <<'EOF'
import sys, yaml
src, dst, steps, every, run_dir = sys.argv[1:6]
r = yaml.safe_load(open(src))
r["train"]["max_steps"] = int(steps)
r["checkpoint"] = {"every_steps": int(every), "keep_last": 1000, "at_end": True}
r["run_dir"] = run_dir
yaml.safe_dump(r, open(dst, "w"), sort_keys=False)
EOF
  rm -rf "$W/pretrain" "$W/init_hf"
  t=$SECONDS
  setsid $DS --master_port 29500 --num_gpus 1 bin/pretrain.py --deepspeed_config "$PT_DS" --config "$W/pretrain.yaml" \
    > "$LOGS/pretrain.log" 2>&1 &
  PT_PID=$!
  timeout $(( $(left) - 170 )) python3 docs/bench/arith_eval.py --run_dir "$W/pretrain" --watch_pid $PT_PID \
    --max_wait $(( $(left) - 230 )) --target "${TARGET:-0.30}" --out "$OUT/pretrain_evals.jsonl" --select "$W/init_hf" > "$LOGS/arith_eval.log" 2>&1
  echo "checkpoint scoring: exit $? at $((SECONDS - T0))s: $(tail -1 "$LOGS/arith_eval.log")"
  if kill -0 $PT_PID 2>/dev/null; then  # the selection is made: stop pretraining (its own process group)
    kill -TERM -- -$PT_PID 2>/dev/null
    for _ in $(seq 30); do kill -0 $PT_PID 2>/dev/null || break; sleep 1; done
    kill -KILL -- -$PT_PID 2>/dev/null
  fi
  wait $PT_PID 2>/dev/null
  echo "pretraining: ended at $((SECONDS - T0))s ($((SECONDS - t))s), last row: $(tail -1 "$W/pretrain/metrics.jsonl" 2>/dev/null | cut -c1-160)"
  cp "$W/pretrain/metrics.jsonl" "$OUT/pretrain_metrics.jsonl" 2>/dev/null
  if [ ! -f "$W/init_hf/config.json" ]; then echo "no checkpoint selected; see $LOGS/arith_eval.log"; tail -20 "$LOGS/pretrain.log"; fi
  fi

  # 3. GRPO: every variant x seed at once
  mkdir -p "$W/recipes"
  port=${PORT:-29510}
  PIDS=""
  limit=$(( $(left) - 45 ))
  echo "GRPO: $(echo $VARIANTS | wc -w) variants x $(echo $SEEDS | wc -w) seeds at $((SECONDS - T0))s, each cut at ${limit}s"
  for lr in $LR_LIST; do
  for v in $VARIANTS; do
    for s in $SEEDS; do
      name=$(run_name "$v" "$s" "$lr")
      python3 - "$(variant_recipe $v)" "$W/recipes/$name.yaml" "$s" "${TOKENS:-}" "${GRPO_MAX_STEPS:-}" "${lr#_}" <<'EOF'
import sys, yaml
src, dst, seed, tokens, steps, lr = sys.argv[1:7]
r = yaml.safe_load(open(src))
r["train"]["seed"] = int(seed)
if lr:
    r["train"]["lr"] = float(lr)
if tokens:
    r["grpo"]["max_generated_tokens"] = int(tokens)
if steps:
    r["train"]["max_steps"] = int(steps)
r["checkpoint"] = {"every_steps": 0, "at_end": False}
yaml.safe_dump(r, open(dst, "w"), sort_keys=False)
EOF
      rm -rf "$W/runs/$name"
      # PARALLEL=N: at most N GRPO runs at once (a CPU machine); default all at once
      while [ -n "${PARALLEL:-}" ] && [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
      timeout -k 15 "$limit" $DS --master_port $port --num_gpus 1 bin/grpo.py --deepspeed_config "$GRPO_DS" \
        --config "$W/recipes/$name.yaml" --init_from "$W/init_hf" --run_dir "$W/runs/$name" > "$LOGS/grpo_$name.log" 2>&1 &
      PIDS="$PIDS $!:$name"
      port=$((port + 1))
    done
  done
  done
  for p in $PIDS; do
    wait "${p%%:*}"
    echo "grpo ${p#*:}: exit $? at $((SECONDS - T0))s $(grep -m1 -oE 'Error: .{0,160}|error: .{0,160}' "$LOGS/grpo_${p#*:}.log")"
  done
  rm -f "$OUT"/grpo_metrics*.jsonl
  for lr in $LR_LIST; do
  for v in $VARIANTS; do
    for s in $SEEDS; do
      f="$W/runs/$(run_name "$v" "$s" "$lr")/metrics.jsonl"
      [ -f "$f" ] && python3 -c "import json, sys
for line in open(sys.argv[1]):
    print(json.dumps({'variant': sys.argv[2], 'seed': int(sys.argv[3]), **json.loads(line)}))" "$f" "$v" "$s" \
        >> "$OUT/$(metrics_name "$lr")"
    done
  done
  done
  if [ -n "$DB_PID" ]; then
    if kill -0 "$DB_PID" 2>/dev/null; then echo "decode_bench still running at $((SECONDS - T0))s: waiting up to 30s"; fi
    for _ in $(seq 30); do kill -0 "$DB_PID" 2>/dev/null || break; sleep 1; done
    cat "$LOGS/decode_bench_status.txt" 2>/dev/null
    grep -h "call tree" "$LOGS"/decode_bench_*.log 2>/dev/null | cut -c1-600
  fi
fi

# 4. the tables
[ "${SUMMARY_ONLY:-0}" != 1 ] && cp "$W/init_hf/selected.json" "$OUT/pretrain_selected.json" 2>/dev/null
rm -f "$OUT/summary.md"
for lr in $LR_LIST; do
  [ "$lr" != _ ] && echo "## GRPO at train.lr $lr" | tee -a "$OUT/summary.md"
  python3 docs/bench/grpo_task_table.py --metrics "$OUT/$(metrics_name "$lr")" --pretrain "$OUT/pretrain_evals.jsonl" \
    --selected "$OUT/pretrain_selected.json" ${TOKENS:+--budget $TOKENS} 2>&1 | tee -a "$OUT/summary.md"
done
echo "total: $((SECONDS - T0))s"
[ "${SUMMARY_ONLY:-0}" != 1 ] && mv "$OUT/pretrain_metrics.jsonl" "$LOGS/" 2>/dev/null  # in logs.tgz: 8 files come back
[ "${SUMMARY_ONLY:-0}" != 1 ] && tar czf "$OUT/logs.tgz" -C "$LOGS" . "$W/recipes" 2>/dev/null
# the starting model (fp32, ~17 MiB: in 15 MB pieces, since a device call returns files of at most 16 MiB), so a
# later call can skip pretraining: cat init_hf.tgz.* | tar xz; INIT_FROM=init_hf
if [ "${SUMMARY_ONLY:-0}" != 1 ] && [ -z "${INIT_FROM:-}" ] && [ -f "$W/init_hf/config.json" ]; then
  tar czf - -C "$W" init_hf | split -b 15000000 -d - "$OUT/init_hf.tgz."
fi
exit 0

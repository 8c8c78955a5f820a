#!/usr/bin/env bash
# This engine against torchtitan on one GPU, in one call: RECIPE (deepseek_2b6)'s architecture and size, the same global
# batch of tokens per step, bf16, each system's best single-GPU settings, alternating (ORDER, default "z2 titan z3
# titan": bin/bench.py with ds_configs/zero2.json, torchtitan, zero3.json, torchtitan). The engine: bin/bench.py as
# shipped ("auto" micro-batch x accumulation; 16 x 4 on an H200). torchtitan: docs/bench/torchtitan_pair.py, its
# DeepSeek-V3 with the model config written from the recipe (shape differences printed: "shape:" lines), compile on,
# its grouped-GEMM MoE, FlexAttention (0.3.0: CUDA graphs, FSDP2 on the one GPU; 0.2.2 below), global batch = the
# engine's micro x accum, micro TITAN_MICRO (16); activation checkpointing only if needed to fit (TITAN_TRIES, entries
# micro:AC:CUDA-graphs; an out-of-memory run moves to the next entry, another failure retries once without CUDA graphs;
# the first that runs is kept for later torchtitan runs). TITAN_ATTN (0.3: flex, 0.2: sdpa), TITAN_RESHARD (default:
# parallelism.fsdp_reshard_after_forward).
# One FLOP formula for both (bin/bench.py's): FLOPs per token = 6 x active non-embedding parameters (output layer
# included, routed experts at top-k / experts) + 3 x layers x 2 x seq x heads x (qk_head_dim + v_head_dim);
# MFU = tokens/s x that / 989 TFLOP/s; 6.25 G per token for deepseek_2b6 at seq 2048.
# MODE=loss: LOSS_STEPS (100) steps of each from its own random init on the same data (the recipe's data section, the
# engine's order), the engine with LOSS_CONFIGS (zero2.json), the recipe's LR schedule over LOSS_STEPS in both.
# torchtitan: the version installed (from .whl/: keep one torchtitan wheel there) picks the driver's path. 0.3.0 (pins a
# torch nightly newer than 2.11; stand-ins on 2.11): compile, FSDP2 on the one GPU, ChunkedLossWrapper, CUDA graphs.
# 0.2.2 (released when nightlies were torch 2.11.0.dev): compile, no FSDP on one GPU (bf16 autocast over fp32
# parameters), full-logit loss, no CUDA graphs (TITAN_TRIES' default then has them off), TITAN_RESHARD meaningless.
# Wheels, in .whl/ (besides what offline-wheels.sh always puts there), from ../shared/tools/offline-wheels.sh with
#   0.3.0: torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 spmd-types==0.2.3 torchdata==0.11.0
#   0.2.2: torchtitan==0.2.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 torchdata==0.11.0
# To switch, move the other torchtitan wheel out of the .whl/*.whl glob (e.g. mkdir -p .whl/off; mv
# .whl/torchtitan-0.3.0-*.whl .whl/off/): with two, the install of .whl/*.whl fails as a whole (this script stops
# first).
# (torchtitan's other Requires-Dist are not imported on this path: 0.3.0's tensorboard/wandb/pillow/einops/
# torch_checkpointing, 0.2.2's tensorboard/einops/pillow/tomli; datasets/tokenizers/safetensors/fsspec are there
# already; torchtitan_pair.py stands in for tensorboard where it is missing).
#   bash docs/bench/torchtitan_pair.sh            (on the GPU machine, from the checkout, .whl/ carried; ~9 min)
#   MODE=loss bash docs/bench/torchtitan_pair.sh  (a second call; ~8 min)
# PROFILE=N: every speed run then profiles N more steps (bin/bench.py's profile in both systems): the full tables in
# logs.tgz (profile_<label>.txt), the time shares by operator and by kernel name, and how busy the GPU was, in the notes.
# STEPS (20) timed steps after WARMUP (5) in every run. BUDGET (570 s): a run that would start with under 60 s left is
# skipped; each run's timeout is the smaller of T_RUN/T_TITAN and what is left. The table is rewritten after each run.
# RECIPE_PATH (engine/recipes/$RECIPE.yaml), ENGINE_ARGS / TITAN_ARGS (more bin/bench.py / torchtitan_pair.py flags)
# serve small tests, e.g. on a CPU: TITAN_ARGS="--device cpu --compile 0 --cuda_graphs 0" TITAN_TRIES=2:none:0
# ENGINE_ARGS="--micro_batch 2 --ds_set gradient_accumulation_steps=2" RECIPE_PATH=engine/recipes/tiny.yaml
# STEPS=3 WARMUP=1.
# Files: $OUT/pair.jsonl (bench.py rows and torchtitan rows), $OUT/pair.md (table), $OUT/logs.tgz.
set -u
OUT=${OUT:-/tmp/titan_pair}; W=/tmp/titan_pairw; mkdir -p "$OUT" $W/logs
tw=$(ls .whl/torchtitan-*.whl 2>/dev/null | wc -l)
if [ "$tw" -gt 1 ] && ! python3 -c "import torchtitan" 2>/dev/null; then
  echo "more than one torchtitan wheel in .whl/ ($(ls .whl/torchtitan-*.whl | xargs -n1 basename | tr '\n' ' ')):" \
    "the install of .whl/*.whl would fail; move all but one out (e.g. to .whl/off/)"; exit 1
fi
. docs/bench/gpu_env.sh deepspeed torchtitan
# torchtitan's version from its metadata: importing 0.2.2 needs triton, which a CPU box lacks (the driver stands in)
TITAN_VERSION=$(python3 -c "from importlib.metadata import version; print(version('torchtitan'))") || exit 1
python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', \
deepspeed.__version__, 'torchtitan $TITAN_VERSION', 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" || exit 1
# torchtitan 0.2 has no CUDA graphs; its measured runs used sdpa (FlexAttention untried with it), 0.3.0's default is flex
CG=1; ATTN=flex; case $TITAN_VERSION in 0.2.*) CG=0; ATTN=sdpa ;; esac
RECIPE=${RECIPE:-deepseek_2b6}; RECIPE_PATH=${RECIPE_PATH:-engine/recipes/$RECIPE.yaml}; MODE=${MODE:-speed}; BUDGET=${BUDGET:-570}
STEPS=${STEPS:-20}; WARMUP=${WARMUP:-5}; LOSS_STEPS=${LOSS_STEPS:-100}
J=$OUT/pair.jsonl; port=29930

left() { echo $((BUDGET - SECONDS)); }
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
note() { echo "$*" | tee -a $W/notes.txt; }

table() {
python3 - "$J" "$MODE" "$W/notes.txt" <<'PY' > "$OUT/pair.md"
import json, statistics, sys
path, mode, notes = sys.argv[1:4]
try:
    rows = [json.loads(l) for l in open(path) if l.strip()]
except OSError:
    rows = []
def system(r):
    return "torchtitan" if r.get("system") == "torchtitan" else "engine " + r.get("ds_config", "?").removesuffix(".json")
def fpt(r):  # FLOPs per token each row's MFU was computed with
    return r.get("flops_per_token") or (r["mfu"] * 989e12 / r["tokens_per_s_per_gpu"] if r.get("tokens_per_s_per_gpu") else 0)
if mode == "loss":
    print("| step | " + " | ".join(f"{r['label']} ({system(r)})" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    n = max((len(r.get("losses", [])) for r in rows), default=0)
    for s in sorted({1, 2, 5, *range(10, n + 1, 10), n} - {0}):
        print(f"| {s} | " + " | ".join(f"{r['losses'][s - 1]:.3f}" if len(r.get('losses', [])) >= s else "-" for r in rows) + " |")
else:
    print("| run | system | micro x accum | tokens/step | tokens/s per GPU | MFU | s/step | peak GiB | settings | loss (last) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sets = (f"torchtitan {r.get('torchtitan')}, compile {'on' if r.get('compile') else 'off'}, AC {r.get('ac')}, CUDA graphs "
                f"{'on' if r.get('cuda_graphs') else 'off'}, {r.get('attn')}, reshard {r.get('reshard')}" if r.get("system") == "torchtitan"
                else f"autoep {r.get('autoep')}, ep {r.get('ep')}, head {r.get('head')}")
        step = r.get("step_s") or round(r["micro"] * r["accum"] * r["seq"] / r["tokens_per_s_per_gpu"], 3)
        print(f"| {r['label']} | {system(r)} | {r['micro']} x {r['accum']} | {r['micro'] * r['accum'] * r['seq']:,} | "
              f"{r['tokens_per_s_per_gpu']:,} | {100 * r['mfu']:.1f}% | {step} | {r.get('peak_gib')} | {sets} | {r.get('loss')} |")
    by = {}
    for r in rows:
        by.setdefault(system(r), []).append(r["tokens_per_s_per_gpu"])
    if rows:
        print("\nFLOPs per token used for MFU: " + ", ".join(sorted({f"{system(r)} {fpt(r) / 1e9:.3f} G" for r in rows}))
              + " (6 x active non-embedding params incl. output layer + 3 x layers x 2 x seq x heads x (qk+v head dim); "
              "peak 989 TFLOP/s)")
    t = by.get("torchtitan")
    for s, v in by.items():
        if s != "torchtitan":
            ratio = f", {statistics.mean(v) / statistics.mean(t):.3f}x torchtitan's" if t else ""
            print(f"- {s}: mean {statistics.mean(v):,.0f} tokens/s over {len(v)} run(s){ratio}")
    if t:
        print(f"- torchtitan: mean {statistics.mean(t):,.0f} tokens/s over {len(t)} run(s)")
try:
    extra = open(notes).read().strip()
except OSError:
    extra = ""
if extra:
    print("\n```\n" + extra + "\n```")
PY
cat "$OUT/pair.md"
}

shares() {  # PROFILE: the run's profile to logs/, its time shares (by operator, by kernel) into the notes
  [ -n "${PROFILE:-}" ] && [ -f "$J.profile.txt" ] || return 0
  mv "$J.profile.txt" "$W/logs/profile_$1.txt"
  { echo "$1, $PROFILE profiled steps:"; sed -n '/^time shares/,$p' "$W/logs/profile_$1.txt"; } >> $W/notes.txt
}

engine() {  # engine CONFIG LABEL [bench.py args...]
  local cfg=$1 label=$2; shift 2
  local l; l=$(limit ${T_RUN:-200})
  if [ "$l" -lt 60 ]; then note "$label: skipped ($l s of BUDGET left)"; return 1; fi
  port=$((port + 1)); local t=$SECONDS
  timeout -k 15 "$l" python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 bin/bench.py \
    --deepspeed_config ds_configs/$cfg --config "$RECIPE_PATH" --out "$J" --label "$label" "$@" ${ENGINE_ARGS:-} \
    > $W/logs/$label.log 2>&1
  local rc=$?
  note "$label: exit $rc in $((SECONDS - t))s $(grep -m1 -oE 'batch: micro-batch.{0,80}' $W/logs/$label.log) $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,160}|error: .{0,200}' $W/logs/$label.log)"
  shares "$label"
  return $rc
}

TITAN_OK=""   # the first TITAN_TRIES entry that ran (micro:ac:cuda_graphs), kept for later titan runs
titan() {  # titan LABEL [driver args...]
  local label=$1; shift
  local G; G=$(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]; \
r=[x for x in r if x.get('system') != 'torchtitan']; print(r[-1]['micro'] * r[-1]['accum'] if r else 64)" "$J" 2>/dev/null || echo 64)
  local tries=${TITAN_OK:-${TITAN_TRIES:-${TITAN_MICRO:-16}:none:$CG 8:none:$CG ${TITAN_MICRO:-16}:selective:$CG 8:selective:0}}
  local queue=($tries)
  while [ ${#queue[@]} -gt 0 ]; do
    local try=${queue[0]}; queue=("${queue[@]:1}")
    IFS=: read -r m ac cg <<< "$try"
    local l; l=$(limit ${T_TITAN:-300})
    if [ "$l" -lt 60 ]; then note "$label: skipped ($l s of BUDGET left)"; return 1; fi
    port=$((port + 1)); local t=$SECONDS log=$W/logs/${label}_m${m}_${ac}_cg$cg.log
    MASTER_PORT=$port timeout -k 15 "$l" python3 docs/bench/torchtitan_pair.py --config "$RECIPE_PATH" \
      --global_batch "$G" --micro_batch "$m" --ac "$ac" --cuda_graphs "$cg" --attn "${TITAN_ATTN:-$ATTN}" \
      --reshard "${TITAN_RESHARD:-default}" \
      --out "$J" --label "$label" "$@" ${TITAN_ARGS:-} > "$log" 2>&1
    local rc=$?
    note "$label (micro $m x accum $((G / m)), AC $ac, CUDA graphs $cg): exit $rc in $((SECONDS - t))s \
$(grep -m1 -oE 'OutOfMemoryError|CUDA out of memory|[A-Za-z]*Error: .{0,200}' "$log")"
    if [ $rc -eq 0 ]; then
      shares "$label"
      TITAN_OK=$try
      [ -f $W/shape.txt ] || grep -E '^(shape|params|FLOPs|built|torch )' "$log" > $W/shape.txt
      return 0
    fi
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then return $rc; fi  # out of time: another setting would not fit either
    if ! grep -qiE 'out of memory' "$log"; then
      # not memory: once more without CUDA graphs (the capture is the likeliest casualty), else give up
      [ "$cg" = 1 ] && { queue=("$m:$ac:0"); continue; }
      return $rc
    fi
  done
  return 1
}

rm -f $W/notes.txt $W/shape.txt
if [ "$MODE" = loss ]; then
  for cfg in ${LOSS_CONFIGS:-zero2.json}; do
    T_RUN=${T_RUN:-300} engine $cfg engine_${cfg%.json}_loss --steps "$LOSS_STEPS" --warmup 0; table > /dev/null
  done
  T_TITAN=${T_TITAN:-330} titan titan_loss --losses "$LOSS_STEPS"
else
  i=0
  for what in ${ORDER:-z2 titan z3 titan}; do
    i=$((i + 1))
    case $what in
      z2|z3) engine zero${what#z}.json engine_${what}_$i --steps "$STEPS" --warmup "$WARMUP" ${PROFILE:+--profile $PROFILE} ;;
      titan) titan titan_$i --steps "$STEPS" --warmup "$WARMUP" ${PROFILE:+--profile $PROFILE} ;;
      *) note "ORDER: unknown entry $what (z2, z3, titan)" ;;
    esac
    table > /dev/null
  done
fi
[ -f $W/shape.txt ] && { echo; cat $W/shape.txt; } >> $W/notes.txt
table
tar czf "$OUT/logs.tgz" -C $W logs notes.txt 2>/dev/null

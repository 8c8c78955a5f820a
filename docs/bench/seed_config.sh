#!/usr/bin/env bash
# The seed's configuration: RECIPE (deepseek_5b3) on one 80 GB GPU (an H200 capped with --memory_fraction
# MEMORY_FRACTION, 0.5596) through bin/pretrain.py, in bf16 and in FP8, with CONFIG (ds_configs/zero3_offload.json:
# pick the fastest from docs/bench/offload_80gb.sh first) and DS_SET edits of it (python-literal KEY=VALUE pairs,
# dotted keys, e.g. DS_SET="zero_optimization.offload_optimizer.ratio=0.3"). One run per train.fp8 value in MODES
# ("false dense all"), STEPS (12) steps each, the same seed and data, metrics every step. Host RAM used: the drop of
# /proc/meminfo's MemAvailable from before the launch to its lowest during the run (sampled every second).
#   bash docs/bench/seed_config.sh     (on the GPU machine, from the checkout, .whl/ carried; ~3 min a row at 30k
#                                       tokens/s, far more on a slow config: size STEPS and T_RUN to it)
# LOSS=N: instead, N steps (50) of bf16 with CONFIG capped against UNCAPPED (ds_configs/zero3.json: fp32 Adam states
# on the GPU) uncapped, the same data (and the same init when both have the same ZeRO stage: zero.Init draws it
# differently): the losses side by side, and their largest gap. TOKENS_PER_STEP sets train.tokens_per_step_per_gpu
# (the "auto" accumulation's target) for every run; UNCAPPED_SET edits UNCAPPED as DS_SET does CONFIG (write the capped
# run's micro-batch and accumulation there, so both train on the same batches); LOSS_RUNS ("capped uncapped") which.
# SR sets every run's train.stochastic_rounding (true/false/auto; unset: the recipe's, auto) and names the rows
# seed_<mode>_sr_<SR>.jsonl, so SR=false and SR=auto rows of one config can sit in one OUT.
# FIRST=N: instead, N steps (10 will do) uncapped from one init on the same batches (micro-batch 1 x accumulation 4: 8192
# tokens a step): fp32 (zero2.json with bf16 off: fp32 weights, forward and AdamW), master (zero2.json: bf16 forward,
# fp32 master weights), sr (zero2_bf16_states.json, AdamWSR) and nearest (the same, DeepSpeed's optimizer): whether
# the bf16 variants follow fp32 weights' trajectory in the first steps of the warmup (docs/bench/first_updates.py is
# the same comparison on the CPU at a small shape). FIRST_RUNS picks and orders them (the first is the reference).
# MFU: the metrics rows' own (engine/flops.py: model FLOPs over the GPU's dense bf16 peak; FP8 rows against the same
# bf16 peak, so FP8 shows as a higher MFU, not a different denominator).
# Files: $OUT/seed_<mode>.jsonl (metrics rows; LOSS: seed_capped.jsonl, seed_uncapped.jsonl), $OUT/seed.md, $OUT/logs.tgz.
set -u
OUT=${OUT:-/tmp/seed}; W=/tmp/seedw; mkdir -p "$OUT" $W/logs
. docs/bench/gpu_env.sh deepspeed
RECIPE=${RECIPE:-engine/recipes/deepseek_5b3.yaml}; CONFIG=${CONFIG:-ds_configs/zero3_offload.json}
FRACTION=${MEMORY_FRACTION:-0.5596}
edit() {  # edit CONFIG OUTPUT KEY=VALUE...: the DS config with python-literal values at dotted keys
  python3 - "$@" <<'PY'
import ast, json, sys
cfg = json.load(open(sys.argv[1]))
for item in sys.argv[3:]:
    key, _, value = item.partition("=")
    *path, last = key.split(".")
    node = cfg
    for k in path:
        node = node.setdefault(k, {})
    try:
        node[last] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        node[last] = value
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
print(f"DS config: {sys.argv[1]} with {sys.argv[3:] or 'no edits'}")
PY
}
edit "$CONFIG" $W/ds.json ${DS_SET:-} || exit 1
recipe() {  # recipe MODE PATH: the recipe with train.fp8 MODE, metrics every step, no checkpoint at the end
  python3 -c "import sys, yaml; r = yaml.safe_load(open(sys.argv[1])); t = r.setdefault('train', {})
t['fp8'] = sys.argv[2] != 'false' and sys.argv[2]; t['log_every'] = 1; r['checkpoint'] = {'at_end': False}
t.update({'tokens_per_step_per_gpu': int(sys.argv[4])} if sys.argv[4] else {})
t.update({'stochastic_rounding': {'true': True, 'false': False}.get(sys.argv[5], sys.argv[5])} if sys.argv[5] else {})
yaml.safe_dump(r, open(sys.argv[3], 'w'))" "$RECIPE" "$1" "$2" "${TOKENS_PER_STEP:-}" "${SR:-}"
}
avail() { awk '/^MemAvailable:/ {print $2}' /proc/meminfo; }
port=29700
run() {  # run NAME MODE DS_CONFIG STEPS [pretrain args...]: one bin/pretrain.py run, host RAM sampled meanwhile
  local name=$1 mode=$2 ds=$3 steps=$4; shift 4
  recipe "$mode" $W/$name.yaml; rm -rf $W/$name; port=$((port + 1))
  local before t=$SECONDS; before=$(avail)
  ( low=$before; while sleep 1; do a=$(avail); [ "$a" -lt "$low" ] && low=$a && echo "$low" > $W/$name.low; done ) &
  local sampler=$!
  timeout -k 15 ${T_RUN:-300} python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 bin/pretrain.py \
    --deepspeed_config "$ds" --config $W/$name.yaml --max_steps "$steps" --run_dir $W/$name "$@" > $W/logs/$name.log 2>&1
  local rc=$?
  gpu_settle "--run_dir $W/$name"
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  local low; low=$(cat $W/$name.low 2>/dev/null || echo "$before")
  echo "$name: exit $rc in $((SECONDS - t))s, host RAM used $(( (before - low) / 1048576 )) GiB" \
    "$(grep -m1 -oE 'batch: .{0,90}' $W/logs/$name.log) $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,200}|error: .{0,200}' $W/logs/$name.log)" \
    | tee -a $W/notes.txt
  python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
rows.append({'summary': sys.argv[3], 'host_ram_gib': round(int(sys.argv[2]) / 1048576, 1)})
open(sys.argv[4], 'w').write(''.join(json.dumps(r) + '\n' for r in rows))" \
    $W/$name/metrics.jsonl $((before - low)) "$name" "$OUT/seed_$name.jsonl" 2>/dev/null
}
rm -f $W/notes.txt
if [ -n "${LOSS:-}" ]; then
  edit "${UNCAPPED:-ds_configs/zero3.json}" $W/uncapped.json ${UNCAPPED_SET:-} || exit 1
  case " ${LOSS_RUNS:-capped uncapped} " in *" capped "*) run capped false $W/ds.json "$LOSS" --memory_fraction "$FRACTION" ;; esac
  case " ${LOSS_RUNS:-capped uncapped} " in *" uncapped "*) run uncapped false $W/uncapped.json "$LOSS" ;; esac
  NAMES="capped uncapped"
elif [ -n "${FIRST:-}" ]; then
  batch="train_micro_batch_size_per_gpu=1 gradient_accumulation_steps=4 train_batch_size=4"  # fp32 at micro 2: out of memory on 141 GB
  edit ds_configs/zero2.json $W/fp32.json $batch bf16.enabled=False || exit 1
  edit ds_configs/zero2.json $W/master.json $batch || exit 1
  edit ds_configs/zero2_bf16_states.json $W/bf16.json $batch || exit 1
  NAMES=${FIRST_RUNS:-fp32 master sr nearest}; LOSS=$FIRST
  for n in $NAMES; do
    case $n in
      fp32) SR=false run fp32 false $W/fp32.json "$FIRST" ;;
      master) SR=false run master false $W/master.json "$FIRST" ;;
      sr) SR=auto run sr false $W/bf16.json "$FIRST" ;;
      nearest) SR=false run nearest false $W/bf16.json "$FIRST" ;;
      *) echo "FIRST_RUNS: unknown run $n (fp32 master sr nearest)"; exit 2 ;;
    esac
  done
else
  for mode in ${MODES:-false dense all}; do
    run "$mode${SR:+_sr_$SR}" "$mode" $W/ds.json "${STEPS:-12}" --memory_fraction "$FRACTION"
  done
  NAMES="$(for m in ${MODES:-false dense all}; do printf '%s ' "$m${SR:+_sr_$SR}"; done)"
fi
python3 - "$OUT" "$NAMES" "${LOSS:-}" <<'PY' | tee "$OUT/seed.md"
import json, statistics, sys
out, names, loss = sys.argv[1], sys.argv[2].split(), sys.argv[3]
runs = {}
for n in names:
    try:
        rows = [json.loads(l) for l in open(f"{out}/seed_{n}.jsonl")]
    except OSError:
        continue
    runs[n] = ([r for r in rows if "loss" in r], next((r for r in rows if "summary" in r), {}))
if loss:
    got = [n for n in names if n in runs and runs[n][0]]
    print("| step | " + " | ".join(got) + " |\n|---|" + "---|" * len(got))
    by = [{r["step"]: r["loss"] for r in runs[n][0]} for n in got]
    steps = sorted(set.intersection(*(set(b) for b in by))) if by else []
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{b[s]:.4f}" for b in by) + " |")
    for i in range(1, len(by)):
        gaps = [abs(by[0][s] - by[i][s]) for s in steps]
        print(f"\nlargest |{got[i]} - {got[0]}| {max(gaps):.4f} (step {steps[gaps.index(max(gaps))]}), mean {statistics.mean(gaps):.4f}")
else:
    print("| train.fp8 | steps | tokens/s (median from step 3) | vs bf16 | MFU (median) | peak GiB | host RAM GiB | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for n in names:
        if n not in runs or not runs[n][0]:
            print(f"| {n} | 0 | - | - | - | - | - | - |")
            continue
        rows, summ = runs[n]
        timed = rows[2:] or rows
        tps = statistics.median(r["tokens_per_s"] for r in timed)
        mfu = statistics.median(r["mfu"] for r in timed) if all("mfu" in r for r in timed) else None
        base = tps if n.split("_sr_")[0] == "false" else base
        print(f"| {n} | {len(rows)} | {tps:.0f} | {f'{tps / base:.3f}' if base and n != 'false' else '-'} | "
              f"{f'{100 * mfu:.1f}%' if mfu is not None else '-'} | {max(r.get('peak_mem_gib') or 0 for r in rows)} | "
              f"{summ.get('host_ram_gib', '-')} | {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} |")
PY
cat $W/notes.txt >> "$OUT/seed.md"
tar czf "$OUT/logs.tgz" -C $W logs notes.txt ds.json

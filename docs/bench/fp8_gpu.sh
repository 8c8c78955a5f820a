#!/usr/bin/env bash
# FP8 against bf16 through bin/pretrain.py on one GPU, in one call: RECIPE (deepseek_2b6) at seq 2048 for STEPS (30)
# steps with each DS config in CONFIGS ("zero2.json zero3.json"), train.fp8 false then each of MODES (a copy of the recipe),
# the same seed and data; a table of tokens/s (median from step 3), the FP8 / bf16 ratio, peak memory, and the loss of
# both at every step. Needs torchao importable (in .whl/: ../shared/tools/offline-wheels.sh trl==1.16.0
# torchao==0.18.0; 0.18.0 needs torch >= 2.11, which the GPU image has); prints the versions it ran with.
#   bash docs/bench/fp8_gpu.sh   (on the GPU machine, from the checkout, .whl/ carried; ~4 runs x 2-3 min)
# MODES ("false dense all"): the train.fp8 values to run (ratios are against false, when it ran in the same call).
# PROFILE=N: then, per config and mode, bin/bench.py profiles N steps (after WARMUP_P, 3, and 2 timed ones) and the
# time shares by kind (routed experts' grouped GEMMs and FP8 casts, attention, dense GEMMs, ...) go under the table;
# each full profile table in logs.tgz (profile_<config>_<mode>.txt). T_PROF (200) s per run.
# Files: $OUT/fp8_<config>_<mode>.jsonl (metrics rows), $OUT/fp8.md (table), $OUT/logs.tgz.
set -u
OUT=${OUT:-/tmp/fp8}; W=/tmp/fp8w; mkdir -p "$OUT" $W/logs
. docs/bench/gpu_env.sh deepspeed
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
RECIPE=${RECIPE:-deepseek_2b6}
for mode in ${MODES:-false dense all}; do
  python3 -c "import sys, yaml; r = yaml.safe_load(open(sys.argv[1])); r.setdefault('train', {})['fp8'] = sys.argv[2] != 'false'\
 and sys.argv[2]; r['train']['log_every'] = 1; r['checkpoint'] = {'at_end': False}; yaml.safe_dump(r, open(sys.argv[3], 'w'))" \
    engine/recipes/$RECIPE.yaml $mode $W/$mode.yaml
done
port=29900
for cfg in ${CONFIGS:-zero2.json zero3.json}; do
  for mode in ${MODES:-false dense all}; do
    port=$((port + 1)); name=${cfg%.json}_$mode; t=$SECONDS; rm -rf $W/$name
    timeout -k 15 ${T_RUN:-240} python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 bin/pretrain.py \
      --deepspeed_config ds_configs/$cfg --config $W/$mode.yaml --max_steps ${STEPS:-30} --run_dir $W/$name \
      > $W/logs/$name.log 2>&1
    echo "$name: exit $? in $((SECONDS - t))s $(grep -m1 -oE 'batch: .{0,60}' $W/logs/$name.log) $(grep -m1 -oE 'fp8: .{0,120}|OutOfMemoryError|Error: .{0,160}|error: .{0,200}' $W/logs/$name.log)"
    cp $W/$name/metrics.jsonl "$OUT/fp8_$name.jsonl" 2>/dev/null
  done
done
python3 - "$OUT" "${MODES:-false dense all}" ${CONFIGS:-zero2.json zero3.json} <<'PY' | tee "$OUT/fp8.md"
import json, statistics, sys
out, modes = sys.argv[1], sys.argv[2].split()
def rows(p):
    try:
        return [r for r in map(json.loads, open(p)) if "loss" in r]
    except OSError:
        return []
print("| config | train.fp8 | steps | tokens/s (median from step 3) | FP8 / bf16 | peak GiB | loss first -> last |")
print("|---|---|---|---|---|---|---|")
for cfg in sys.argv[3:]:
    c = cfg.removesuffix(".json")
    base = None
    for mode in modes:
        r = rows(f"{out}/fp8_{c}_{mode}.jsonl")
        if not r:
            print(f"| {cfg} | {mode} | 0 | - | - | - | - |")
            continue
        tps = statistics.median(x["tokens_per_s"] for x in r[2:] or r)
        base = tps if mode == "false" else base
        ratio = f"{tps / base:.3f}" if mode != "false" and base else "-"
        print(f"| {cfg} | {mode} | {len(r)} | {tps:.0f} | {ratio} | {max(x.get('peak_mem_gib') or 0 for x in r)} | "
              f"{r[0]['loss']:.3f} -> {r[-1]['loss']:.3f} |")
    runs = [(m, rows(f"{out}/fp8_{c}_{m}.jsonl")) for m in modes]
    runs = [(m, r) for m, r in runs if r]
    if len(runs) > 1:
        print(f"\n{cfg} loss by step ({' / '.join(m for m, _ in runs)}): " + ", ".join(
            f"{x[0]['step']}: " + "/".join(f"{y['loss']:.3f}" for y in x) for x in zip(*(r for _, r in runs))) + "\n")
PY
if [ -n "${PROFILE:-}" ]; then
  for cfg in ${CONFIGS:-zero2.json zero3.json}; do
    for mode in ${MODES:-false dense all}; do
      port=$((port + 1)); name=${cfg%.json}_$mode; t=$SECONDS
      timeout -k 15 ${T_PROF:-200} python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 bin/bench.py \
        --deepspeed_config ds_configs/$cfg --config engine/recipes/$RECIPE.yaml --set train.fp8=$mode --steps 2 \
        --warmup ${WARMUP_P:-3} --profile $PROFILE --label $name --out $W/logs/profile_$name.jsonl > $W/logs/profile_$name.log 2>&1
      echo "profile $name: exit $? in $((SECONDS - t))s"
      cp $W/logs/profile_$name.jsonl.profile.txt $W/logs/profile_$name.txt 2>/dev/null
      { echo; echo "$name, $PROFILE profiled steps:"; sed -n '/^time shares/,/^$/p' $W/logs/profile_$name.txt 2>/dev/null; } >> "$OUT/fp8.md"
    done
  done
  cat "$OUT/fp8.md"
fi
tar czf "$OUT/logs.tgz" -C $W logs

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
# NOISE=1: one more bf16 run per config ("reseed": the same init, data.seed = train.seed + 1), and under the table the
# run-to-run noise floor |bf16 - reseed| at each step against |FP8 - bf16|: the steps where the FP8 gap is inside the
# floor, raw and against the floor's maximum over +-WINDOW (10) steps. TOKENS_PER_STEP sets the recipe's
# train.tokens_per_step_per_gpu (32768: 16 sequences of 2048 a step). Loss curves, as issue-28 asks (one call per config):
#   NOISE=1 TOKENS_PER_STEP=32768 STEPS=300 CONFIGS=zero2.json MODES="false dense" T_RUN=200 bash docs/bench/fp8_gpu.sh
# SUMMARY_ONLY=1: only the table and the floor, from the rows already in $OUT (e.g. runs of one series split over
# two calls: MODES=false NOISE=1 in one, MODES=dense in the next, then MODES="false dense" NOISE=1 SUMMARY_ONLY=1).
# Files: $OUT/fp8_<config>_<mode>.jsonl (metrics rows), $OUT/fp8.md (table), $OUT/logs.tgz.
set -u
OUT=${OUT:-/tmp/fp8}; W=/tmp/fp8w; mkdir -p "$OUT" $W/logs
[ -z "${SUMMARY_ONLY:-}" ] && . docs/bench/gpu_env.sh deepspeed
[ -z "${SUMMARY_ONLY:-}" ] && python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
RECIPE=${RECIPE:-deepseek_2b6}
RUNS="${MODES:-false dense all}"; [ -n "${NOISE:-}" ] && RUNS="$RUNS reseed"
for mode in $RUNS; do
  python3 -c "import sys, yaml; r = yaml.safe_load(open(sys.argv[1])); t = r.setdefault('train', {}); m = sys.argv[2]
t['fp8'] = m not in ('false', 'reseed') and m; t['log_every'] = 1; r['checkpoint'] = {'at_end': False}
if m == 'reseed': r.setdefault('data', {})['seed'] = t.get('seed', 1234) + 1
if sys.argv[4]: t['tokens_per_step_per_gpu'] = int(sys.argv[4])
yaml.safe_dump(r, open(sys.argv[3], 'w'))" engine/recipes/$RECIPE.yaml $mode $W/$mode.yaml "${TOKENS_PER_STEP:-}"
done
port=29900
for cfg in ${CONFIGS:-zero2.json zero3.json}; do
  for mode in $RUNS; do
    [ -n "${SUMMARY_ONLY:-}" ] && continue
    port=$((port + 1)); name=${cfg%.json}_$mode; t=$SECONDS; rm -rf $W/$name
    timeout -k 15 ${T_RUN:-240} python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 bin/pretrain.py \
      --deepspeed_config ds_configs/$cfg --config $W/$mode.yaml --max_steps ${STEPS:-30} --run_dir $W/$name \
      > $W/logs/$name.log 2>&1
    rc=$?; gpu_settle "--run_dir $W/$name"
    echo "$name: exit $rc in $((SECONDS - t))s $(grep -m1 -oE 'batch: .{0,60}' $W/logs/$name.log) $(grep -m1 -oE 'fp8: .{0,120}|OutOfMemoryError|Error: .{0,160}|error: .{0,200}' $W/logs/$name.log)"
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
    runs = [(m, rows(f"{out}/fp8_{c}_{m}.jsonl")) for m in modes + ["reseed"]]
    runs = [(m, r) for m, r in runs if r]
    if len(runs) > 1:
        print(f"\n{cfg} loss by step ({' / '.join(m for m, _ in runs)}): " + ", ".join(
            f"{x[0]['step']}: " + "/".join(f"{y['loss']:.3f}" for y in x) for x in zip(*(r for _, r in runs))) + "\n")
    got = dict(runs)
    if "reseed" in got and "false" in got:  # the noise floor: the same init on another data order
        w = int(__import__("os").environ.get("WINDOW", "10"))
        base = {x["step"]: x["loss"] for x in got["false"]}
        floor = {x["step"]: abs(x["loss"] - base[x["step"]]) for x in got["reseed"] if x["step"] in base}
        steps = sorted(floor)
        wide = {s: max(floor[t] for t in steps if abs(t - s) <= w) for s in steps}
        print(f"{cfg} noise floor |bf16 - reseed|: mean {statistics.mean(floor.values()):.4f}, "
              f"max {max(floor.values()):.4f} over {len(steps)} steps")
        for m, r in runs:
            if m in ("false", "reseed"):
                continue
            gap = {x["step"]: abs(x["loss"] - base[x["step"]]) for x in r if x["step"] in floor}
            inside = sum(gap[s] <= floor[s] for s in gap)
            inside_w = sum(gap[s] <= wide[s] for s in gap)
            print(f"{cfg} {m}: |FP8 - bf16| mean {statistics.mean(gap.values()):.4f}, max {max(gap.values()):.4f}; "
                  f"inside the floor at {inside} of {len(gap)} steps, inside its max over +-{w} steps at "
                  f"{inside_w} of {len(gap)}")
PY
if [ -n "${PROFILE:-}" ] && [ -z "${SUMMARY_ONLY:-}" ]; then
  for cfg in ${CONFIGS:-zero2.json zero3.json}; do
    for mode in ${MODES:-false dense all}; do
      port=$((port + 1)); name=${cfg%.json}_$mode; t=$SECONDS
      timeout -k 15 ${T_PROF:-200} python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 bin/bench.py \
        --deepspeed_config ds_configs/$cfg --config engine/recipes/$RECIPE.yaml --set train.fp8=$mode --steps 2 \
        --warmup ${WARMUP_P:-3} --profile $PROFILE --label $name --out $W/logs/profile_$name.jsonl > $W/logs/profile_$name.log 2>&1
      rc=$?; gpu_settle "--label $name "
      echo "profile $name: exit $rc in $((SECONDS - t))s"
      cp $W/logs/profile_$name.jsonl.profile.txt $W/logs/profile_$name.txt 2>/dev/null
      { echo; echo "$name, $PROFILE profiled steps:"; sed -n '/^time shares/,/^$/p' $W/logs/profile_$name.txt 2>/dev/null; } >> "$OUT/fp8.md"
    done
  done
  cat "$OUT/fp8.md"
fi
[ -z "${SUMMARY_ONLY:-}" ] && tar czf "$OUT/logs.tgz" -C $W logs

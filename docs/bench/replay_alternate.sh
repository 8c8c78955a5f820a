#!/usr/bin/env bash
# Routing replay's step-time cost on one H200, one device call: docs/bench/replay_alternate.py
# (bin/grpo.py with replay off on odd steps and r3 on even ones, one process) on grpo_vs_trl.sh's workload (grpo_2b6
# random init, 8 prompts x G 8 x 256 new tokens forced, beta 0.04 k3), ZeRO-3 then ZeRO-2, STEPS (13) steps each;
# the table: medians over steps 2..N of each mode's step, policy (forward + backward + step) and ref times.
#   bash docs/bench/replay_alternate.sh     (on the GPU machine, from the checkout, with .whl/ carried)
# Files: $OUT/alt_<config>.jsonl (rows), $OUT/alternate.md (table).
# SCRIPT=docs/bench/pack_alternate.py: the same with packing of the train passes switched instead (off: plain); with
# FREE_LENGTH=1 the completions end at EOS (otherwise all are forced to max_new_tokens, and there is nothing to pack).
set -u
OUT=${OUT:-/tmp/replay_alt}; W=/tmp/ra; mkdir -p "$OUT" $W
. docs/bench/gpu_env.sh deepspeed
RECIPE=${RECIPE:-engine/recipes/grpo_2b6.yaml}
python3 - "$RECIPE" $W/recipe.yaml "${REPLAY:-r3}" "${FREE_LENGTH:-0}" <<'PY'
import sys, yaml
r = yaml.safe_load(open(sys.argv[1]))
g = r.setdefault("grpo", {})
g.update(beta=0.04, kl="k3", rewards=[{"name": "numeric", "weight": 1.0, "which": "first"}],
         routing_replay=sys.argv[3])
if sys.argv[4] != "1":  # every completion max_new_tokens long, as TRL's runs in grpo_vs_trl.sh
    g["min_new_tokens"] = g.get("max_new_tokens", 8)
g.pop("eval_path", None)
r["checkpoint"] = {"every_steps": 0, "every_minutes": 0, "at_end": False}
yaml.safe_dump(r, open(sys.argv[2], "w"), sort_keys=False)
PY
python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" > $W/fused_adam.log 2>&1
[ -f $W/init/config.json ] || python3 docs/bench/save_random_model.py --config "$RECIPE" --out $W/init | tail -1
port=29700
for cfg in ${CONFIGS:-zero3_grpo zero2_grpo}; do
  t=$SECONDS; port=$((port + 1)); rm -rf $W/run_$cfg
  timeout -k 15 ${T_RUN:-200} python3 -m deepspeed.launcher.runner --master_port $port --num_gpus 1 \
    ${SCRIPT:-docs/bench/replay_alternate.py} --deepspeed_config ds_configs/$cfg.json --config $W/recipe.yaml --init_from $W/init \
    --max_steps ${STEPS:-13} --run_dir $W/run_$cfg > $W/$cfg.log 2>&1
  echo "$cfg: exit $? in $((SECONDS - t))s $(grep -m1 -oE 'Error: .{0,160}' $W/$cfg.log)"
  cp $W/run_$cfg/metrics.jsonl "$OUT/alt_$cfg.jsonl" 2>/dev/null
done
python3 - "$OUT" ${CONFIGS:-zero3_grpo zero2_grpo} <<'PY' | tee "$OUT/alternate.md"
import json, statistics, sys
out = sys.argv[1]
print("| DS config | mode | steps | step s | policy s | ref s | rollout s | logp diff mean | logp diff max | k3 | agree (choice / token) | live agree (choice / token) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for cfg in sys.argv[2:]:
    try:
        rows = [json.loads(l) for l in open(f"{out}/alt_{cfg}.jsonl")]
    except OSError:
        continue
    rows = [r for r in rows if "mode" in r and r["step"] >= 2]
    med = {}
    modes = sorted({r["mode"] for r in rows}, key=lambda m: m not in ("off", "plain"))  # the baseline first
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        m = lambda k: statistics.median(r[k] for r in rs)
        med[mode] = m("step_s")
        live = f"{m('routing_live_agree_choice'):.4f} / {m('routing_live_agree_token'):.4f}" if "routing_live_agree_choice" in rs[0] else "-"
        print(f"| {cfg} | {mode} | {len(rs)} | {m('step_s'):.3f} | {m('policy_s'):.3f} | {m('ref_s'):.3f} | {m('rollout_s'):.3f} | "
              f"{m('rollout_logp_diff_mean'):.4f} | {m('rollout_logp_diff_max'):.3f} | {m('rollout_kl_k3'):.2e} | "
              f"{m('routing_agree_choice'):.4f} / {m('routing_agree_token'):.4f} | {live} |")
    if len(med) == 2:
        print(f"| {cfg} | {modes[1]} / {modes[0]} | | {med[modes[1]] / med[modes[0]]:.3f} | | | | | | | | |")
PY

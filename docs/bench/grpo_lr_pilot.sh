#!/usr/bin/env bash
# The learning rate of grpo_arith*.yaml, chosen on TRAIN prompts (no tuning on the held-out ones), in one
# short device call. The first call of 2026-12-01 (docs/bench/grpo_task.sh, train.lr 3e-4) lowered held-out accuracy from
# 39% to 5-11% in every variant, the training reward falling with it: a step size problem, so this pilot compares lrs.
#   1. pretrain engine/recipes/arith_small.yaml for its max_steps (no checkpoint scan); the DeepSpeed configs are
#      copies with "torch_adam": true (torch's AdamW: no FusedAdam JIT build on a fresh machine; the same update rule)
#   2. export it (fp32) and pack it into $OUT (init_hf.tgz.part-*) so a later call can start GRPO from it
#      (INIT_FROM of grpo_task.sh) without pretraining again
#   3. plain GRPO (grpo_arith.yaml, seed 1) once per lr in LRS, all at once: trained on the train prompts except the
#      first 200, evaluated (greedy, every 10 steps) on those 200 (dev); budget TOKENS generated tokens
#   4. a table: dev accuracy before, along the way and at the end, training reward and KL at the end, per lr;
#      the lr to choose: the highest mean dev accuracy over the last 3 evals (200 prompts are noisy: ~3.5 points sd)
#   bash docs/bench/grpo_lr_pilot.sh
# Run once (2026-12-01) with BUDGET_S=185: pretraining took 118 s (no JIT build) and the export 21 s, so the pilots
# were cut after 31 s, before their first step: no result (docs/bench/s8/pilot_console.txt). Give it BUDGET_S >= 330,
# or INIT_FROM=<an HF dir, e.g. the unpacked init_hf.tgz of a former call> to skip pretraining (then ~150 s).
# Run on the 2-core CPU (fp32, docs/bench/s8/cpu/zero2_grpo_cpu.json, INIT_FROM, two lrs per call): about 250-350 s a
# call of two 32000-token runs; it chose train.lr 1e-5 (docs/bench/s8/cpu/pilot_summary.md, docs/grpo.md).
# Switches: PORT=<first --master_port (29510)> OUT=/tmp/grpo_lr_pilot BUDGET_S=330 INIT_FROM=<HF dir> LRS="3e-6 1e-5 3e-5 1e-4" TOKENS=32000 PT_STEPS=<recipe's>
#   PT_RECIPE=engine/recipes/arith_small.yaml PT_DS=ds_configs/zero3.json GRPO_DS=ds_configs/zero2_grpo.json
# CPU smoke test: OUT=/tmp/plo PT_RECIPE=engine/recipes/tiny.yaml PT_STEPS=3 LRS="1e-5 1e-4" TOKENS=40 \
#   GRPO_DS=/tmp/gt_ds.json BUDGET_S=200 bash docs/bench/grpo_lr_pilot.sh   (/tmp/gt_ds.json: zero2_grpo at 8 x 1)
set -u
OUT=${OUT:-/tmp/grpo_lr_pilot}
W=${WORK:-/tmp/grpo_lr_pilot_work}
LOGS=$W/logs
LRS=${LRS:-3e-6 1e-5 3e-5 1e-4}
mkdir -p "$OUT" "$LOGS" "$W/recipes"
export NCCL_NVLS_ENABLE=0 TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
T0=$SECONDS
END=$((SECONDS + ${BUDGET_S:-330}))
DS="python3 -m deepspeed.launcher.runner"
python3 - "$W" "${PT_STEPS:-}" "${PT_RECIPE:-engine/recipes/arith_small.yaml}" "${PT_DS:-ds_configs/zero3.json}" \
  "${GRPO_DS:-ds_configs/zero2_grpo.json}" <<'EOF'
import json, sys, yaml
w, pt_steps, pt_recipe, pt_ds, grpo_ds = sys.argv[1:6]
for src, dst in ((pt_ds, "pt_ds.json"), (grpo_ds, "grpo_ds.json")):
    d = json.load(open(src))
    d["optimizer"]["params"]["torch_adam"] = True
    json.dump(d, open(f"{w}/{dst}", "w"), indent=1)
r = yaml.safe_load(open(pt_recipe))
if pt_steps:
    r["train"]["max_steps"] = int(pt_steps)
r["checkpoint"] = {"every_steps": 0, "at_end": True}
r["run_dir"] = f"{w}/pretrain"
yaml.safe_dump(r, open(f"{w}/pretrain.yaml", "w"), sort_keys=False)
rows = open("engine/assets/arith_train.jsonl").read().splitlines()
open(f"{w}/dev.jsonl", "w").write("\n".join(rows[:200]) + "\n")
open(f"{w}/train_rest.jsonl", "w").write("\n".join(rows[200:]) + "\n")
print(f"pretraining {r['train']['max_steps']} steps; dev 200 / train {len(rows) - 200} prompts")
EOF
rm -rf "$W/pretrain" "$W/init_hf"
if [ -n "${INIT_FROM:-}" ]; then
  cp -r "$INIT_FROM" "$W/init_hf"; echo "init: $INIT_FROM (no pretraining)"
else
$DS --master_port 29500 --num_gpus 1 bin/pretrain.py --deepspeed_config "$W/pt_ds.json" --config "$W/pretrain.yaml" \
  > "$LOGS/pretrain.log" 2>&1
echo "pretraining: exit $? at $((SECONDS - T0))s: $(tail -1 "$W/pretrain/metrics.jsonl" | cut -c1-120)"
cp "$W/pretrain/metrics.jsonl" "$OUT/pilot_pretrain_metrics.jsonl"
python3 -c "import sys; sys.path.insert(0, '.'); from engine.export import export
export(sys.argv[1], sys.argv[2], dtype='fp32', log=lambda *a, **k: None)" "$W/pretrain" "$W/init_hf" \
  && (cd "$W" && tar czf - init_hf | split -b 12M - "$OUT/init_hf.tgz.part-")
echo "export: at $((SECONDS - T0))s: $(ls "$OUT" | tr '\n' ' ')"
fi

port=${PORT:-29510}
PIDS=""
limit=$(( END - SECONDS - 15 ))
for lr in $LRS; do
  python3 - "$lr" "$W" "${TOKENS:-32000}" <<'EOF'
import sys, yaml
lr, w, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = yaml.safe_load(open("engine/recipes/grpo_arith.yaml"))
r["train"].update(lr=float(lr), seed=1)
r["data"]["path"] = f"{w}/train_rest.jsonl"
r["grpo"].update(eval_path=f"{w}/dev.jsonl", eval_every=10, max_generated_tokens=tokens)
r["checkpoint"] = {"every_steps": 0, "at_end": False}
yaml.safe_dump(r, open(f"{w}/recipes/lr_{lr}.yaml", "w"), sort_keys=False)
EOF
  timeout -k 10 "$limit" $DS --master_port $port --num_gpus 1 bin/grpo.py --deepspeed_config "$W/grpo_ds.json" \
    --config "$W/recipes/lr_$lr.yaml" --init_from "$W/init_hf" --run_dir "$W/runs/lr_$lr" > "$LOGS/grpo_lr_$lr.log" 2>&1 &
  PIDS="$PIDS $!"
  port=$((port + 1))
done
for p in $PIDS; do wait "$p"; done
echo "pilots done at $((SECONDS - T0))s (each cut at ${limit}s)"
rm -f "$OUT/pilot_metrics.jsonl"
for lr in $LRS; do
  f="$W/runs/lr_$lr/metrics.jsonl"
  [ -f "$f" ] && python3 -c "import json, sys
for line in open(sys.argv[1]):
    print(json.dumps({**json.loads(line), 'train_lr': float(sys.argv[2])}))" "$f" "$lr" >> "$OUT/pilot_metrics.jsonl"
done
python3 - "$OUT/pilot_metrics.jsonl" <<'EOF' 2>&1 | tee "$OUT/pilot_summary.md"
import json, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[r["train_lr"]].append(r)
print("| train.lr | steps | generated tokens | dev accuracy (%): before -> each eval (every 10 steps) | "
      "dev: mean of the last 3 evals (selects) | last 10 steps: train reward, KL |")
print("|---|---|---|---|---|---|")
for lr, rows in sorted(runs.items()):
    ev = [f"{100 * r['eval_reward_numeric']:.1f}" for r in rows if "eval_reward_numeric" in r]
    st = [r for r in rows if r["step"] > 0][-10:]
    rew = sum(r["reward"] for r in st) / max(len(st), 1)
    kl = sum(r["kl"] for r in st) / max(len(st), 1)
    last3 = [100 * r["eval_reward_numeric"] for r in rows if "eval_reward_numeric" in r][-3:]
    print(f"| {lr:g} | {rows[-1]['step']} | {rows[-1].get('generated_tokens_total', 0):.0f} | {' -> '.join(ev)} | "
          f"{sum(last3) / len(last3):.1f} | {rew:.3f}, {kl:.3f} |")
EOF
tar czf "$OUT/pilot_logs.tgz" -C "$LOGS" . 2>/dev/null
echo "total: $((SECONDS - T0))s"

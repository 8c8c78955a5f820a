#!/usr/bin/env bash
# GRPO speed: this engine (bin/grpo.py) against TRL's GRPOTrainer with ZeRO-3, same model and workload, in ONE
# 10-minute device call on one H200. From the checkout on the GPU machine (no registry access), with .whl/ built
# here by ../shared/tools/offline-wheels.sh trl==1.16.0 (deepspeed, datasets, trl, ...), carried as `.whl`:
#   bash docs/bench/grpo_vs_trl.sh
# Steps:
# Both systems write every completion to max_new_tokens (equal work: a random model's EOS rate depends on the
# vocabulary): TRL through transformers' min_new_tokens, the engine through grpo.min_new_tokens (FREE_LENGTH=1: the
# engine stops at EOS instead).
#   1. install the wheels into /tmp/site unless deepspeed and trl import already; build FusedAdam once (CUDA)
#   2. save one random-init bf16 model of engine/recipes/grpo_2b6.yaml's architecture with the engine's tokenizer
#      (docs/bench/save_random_model.py) to $INIT: both systems start from these weights
#   3. bin/grpo.py on it with ds_configs/zero3_grpo.json, then ds_configs/zero2_grpo.json if that file exists:
#      a copy of the recipe with beta 0.04, kl k3, the numeric reward alone, no eval, no checkpoints
#   4. docs/bench/trl_grpo.py (TRL GRPOTrainer, ZeRO-3 from zero3_grpo.json without expert_parallel, completions
#      forced to max_new_tokens tokens, same prompts file, beta, lr, G, batch)
#   5. a summary: $OUT/grpo_vs_trl.jsonl (one row per run) and a table with the median step times (steps 2..N)
#      and the ratio TRL / engine; also in $OUT/summary.txt
# Every run gets $STEPS (6) optimizer steps of 8 prompts x G 8 x up to 256 new tokens, under a `timeout` cut so
# the whole script ends inside BUDGET_S (550 s); TRL's time is reserved first (the engine's zero2 run is the one
# dropped when time runs short).
# Switches (environment): STEPS=6  TRL_STEPS=$STEPS (TRL's own; its step time varies by up to ~15% from step to step,
#   so more steps steady its median: ~14 s each on one H200)  SKIP_TRL=1  SKIP_ENGINE=1  SUMMARY_ONLY=1 (re-read $OUT)  BUDGET_S=550
#   RECIPE=engine/recipes/grpo_2b6.yaml  MAX_NEW_TOKENS=<recipe's>  GROUP_SIZE=<recipe's> (the sequences per step stay
#   the batch's 64: GROUP_SIZE=4 MAX_NEW_TOKENS=1024 is the long-completion shape, 16 prompts x 4 x 1024)  INIT=/tmp/gvt_init (REUSE_INIT=1 keeps it)
#   T_ENGINE=180 T_TRL=240 (per-run timeouts, s)  MASTER_PORT=29600  FREE_LENGTH=1  CONFIGS='zero3_grpo zero2_grpo'
#   ENGINE_ARGS='--profile_step 4' (more bin/grpo.py arguments; profiles are copied to $OUT)
#   PRETRAIN_ROWS=docs/bench/vocab/pretrain.jsonl PRETRAIN_CARD=H200 (pretraining's rows for the "train / pretraining"
#   column, and the card they ran on: the column stays empty on another card)
#   TRAIN_COMPILE=true (the recipe's train.compile: true compiles the policy's decoder layers; give T_ENGINE its compile)
#   COMMIT=<git rev-parse --short HEAD> (the rows' "commit": name the tree's commit when the run's copy has no .git of
#   its own, or an older one: the device machine's copy reported 0439584 for a tree at 7fe7d41)
#   GRPO_SCRIPT=bin/grpo.py (a wrapper that patches something for a diagnosis and runs bin/grpo.py; CONFIGS may name files)
# CPU smoke test (here, tiny model; the same steps):
#   OUT=/tmp/gvt RECIPE=engine/recipes/grpo_tiny.yaml MAX_NEW_TOKENS=8 STEPS=2 bash docs/bench/grpo_vs_trl.sh
# Files back from the device ($OUT, 6 of the 8 allowed): grpo_vs_trl.jsonl, summary.txt, trl.jsonl,
# engine_<config>_metrics.jsonl (one per engine run), logs_grpo_vs_trl.tgz.
set -u
OUT=${OUT:-/tmp/grpo_vs_trl}
STEPS=${STEPS:-6}
TRL_STEPS=${TRL_STEPS:-$STEPS}
RECIPE=${RECIPE:-engine/recipes/grpo_2b6.yaml}
INIT=${INIT:-/tmp/gvt_init}
PORT=${MASTER_PORT:-29600}
LOGS=/tmp/gvt_logs  # packed into $OUT/logs_grpo_vs_trl.tgz at the end (the device returns at most 8 files)
mkdir -p "$OUT" "$LOGS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1  # 9.0a breaks DeepSpeed's op builds (FusedAdam)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # everything is local; no hub lookups (or their retries) on the device
T0=$SECONDS
END=$((SECONDS + ${BUDGET_S:-550}))
# A budget that cannot hold one engine run (60 s) or, without REUSE_INIT=1, the init (30 s, with 120 s kept for the
# runs after it) stops here, before the install and the FusedAdam build (up to ~45 s) spend any of it.
floor=60 what="one engine run"; [ "${REUSE_INIT:-0}" = 1 ] || floor=150 what="the init and the runs after it"
if [ "${SUMMARY_ONLY:-0}" != 1 ] && [ "${BUDGET_S:-550}" -lt "$floor" ]; then
  echo "BUDGET_S=${BUDGET_S}: below the ${floor} s that $what need; raise BUDGET_S"; exit 2
fi
if ! python3 -c "import deepspeed, trl" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/install.log" 2>&1 || { echo "install failed:"; tail -5 "$LOGS/install.log"; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
python3 -c "import deepspeed, trl, transformers, torch; print('deepspeed', deepspeed.__version__, 'trl', trl.__version__,
  'transformers', transformers.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1
DS="python3 -m deepspeed.launcher.runner"  # the `deepspeed` command, whatever wraps it (a pyenv shim is no Python)
CUDA=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
RUNS=""  # label|system|ds_config|file, for the summary

left() { echo $((END - SECONDS)); }
cut_to() {  # cut_to LIMIT RESERVE: LIMIT, cut so that RESERVE seconds stay for what comes after
  local lim=$1 room=$(( $(left) - $2 )); [ "$room" -lt "$lim" ] && lim=$room; echo "$lim"
}

if [ "${SUMMARY_ONLY:-0}" != 1 ]; then
  if [ "$CUDA" = 1 ]; then
    t=$SECONDS
    python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()" \
      > "$LOGS/prebuild_fused_adam.log" 2>&1
    echo "FusedAdam build: exit $? in $((SECONDS - t))s"
  fi
  # The recipe both engine runs use: the workload's settings on top of $RECIPE
  python3 - "$RECIPE" /tmp/gvt_recipe.yaml "${MAX_NEW_TOKENS:-}" "${FREE_LENGTH:-0}" "${GROUP_SIZE:-}" \
    "${TRAIN_COMPILE:-}" <<'EOF'
import sys, yaml
src, dst, mnt, free, group, compile_ = sys.argv[1:7]
r = yaml.safe_load(open(src))
if compile_:
    r.setdefault("train", {})["compile"] = yaml.safe_load(compile_)
g = r.setdefault("grpo", {})
g.update(beta=0.04, kl="k3", rewards=[{"name": "numeric", "weight": 1.0, "which": "first"}])
g.pop("eval_path", None); g.pop("eval_every", None)
if mnt:
    g["max_new_tokens"] = int(mnt)
if group:
    g["group_size"] = int(group)
if free != "1":
    g["min_new_tokens"] = g.get("max_new_tokens", 8)
r["checkpoint"] = {"every_steps": 0, "every_minutes": 0, "at_end": False}
yaml.safe_dump(r, open(dst, "w"), sort_keys=False)
print(f"recipe {dst}: {src} with grpo {g}")
EOF
  # what TRL takes from the same recipe and zero3_grpo.json: max_new_tokens, lr, G, prompts file, micro x accumulation
  # (the file's "auto" batch is the engine's: TRL gets TRL_MICRO x TRL_GA, 16 x 4 = the same 64 sequences per step)
  read -r MNT LR G DATA MICRO GA < <(python3 -c "import json, yaml; r = yaml.safe_load(open('/tmp/gvt_recipe.yaml'))
d = json.load(open('ds_configs/zero3_grpo.json'))
m, a = d['train_micro_batch_size_per_gpu'], d['gradient_accumulation_steps']
print(r['grpo']['max_new_tokens'], r['train']['lr'], r['grpo'].get('group_size', 8), r['data']['path'],
      ${TRL_MICRO:-16} if m == 'auto' else m, ${TRL_GA:-4} if a == 'auto' else a)")
  if [ "${REUSE_INIT:-0}" = 1 ] && [ -f "$INIT/config.json" ] \
      && { [ -f "$INIT/model.safetensors" ] || [ -f "$INIT/model.safetensors.index.json" ]; }; then
    echo "init: reusing $INIT"
  else
    t=$SECONDS lim=$(cut_to 180 120)
    # BUDGET_S too small for the init and the runs after it: say so (a negative limit is no `timeout` argument)
    if [ "$lim" -lt 30 ]; then echo "init: not started, ${lim}s of BUDGET_S left for it: raise BUDGET_S"; exit 1; fi
    # written next to $INIT and moved in place once complete: a cut save never looks like a model
    rm -rf "$INIT.part" && timeout "$lim" python3 docs/bench/save_random_model.py --config "$RECIPE" --out "$INIT.part" \
      > "$LOGS/save_init.log" 2>&1 && rm -rf "$INIT" && mv "$INIT.part" "$INIT"
    echo "init: exit $? in $((SECONDS - t))s: $(tail -1 "$LOGS/save_init.log")"
  fi

  engine() {  # engine DS_CONFIG: bin/grpo.py for $STEPS steps, metrics to $OUT/engine_<config>_metrics.jsonl
    local cfg=$1 name label limit t=$SECONDS reserve=0
    name=$(basename "$cfg" .json); label=engine_$name
    [ "${SKIP_TRL:-0}" != 1 ] && reserve=${TRL_RESERVE_S:-210}
    limit=$(cut_to "${T_ENGINE:-180}" "$reserve")
    if [ "$limit" -lt 60 ]; then echo "$label: skipped, $(left)s left"; return; fi
    rm -rf "/tmp/gvt_$label"
    PORT=$((PORT + 1))
    timeout -k 15 "$limit" $DS --master_port "$PORT" --num_gpus 1 "${GRPO_SCRIPT:-bin/grpo.py}" --deepspeed_config "$cfg" \
      --config /tmp/gvt_recipe.yaml --init_from "$INIT" --max_steps "$STEPS" --run_dir "/tmp/gvt_$label" \
      ${ENGINE_ARGS:-} > "$LOGS/$label.log" 2>&1
    echo "$label: exit $? in $((SECONDS - t))s (limit ${limit}s) $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,120}' "$LOGS/$label.log")"
    cp "/tmp/gvt_$label/metrics.jsonl" "$OUT/${label}_metrics.jsonl" 2>/dev/null
    for f in /tmp/gvt_$label/profile_step_*.txt; do [ -f "$f" ] && cp "$f" "$OUT/${label}_$(basename "$f")"; done
    RUNS="$RUNS $label|engine|$cfg|$OUT/${label}_metrics.jsonl"
  }
  if [ "${SKIP_ENGINE:-0}" != 1 ]; then
    for c in ${CONFIGS:-zero3_grpo zero2_grpo}; do  # a name in ds_configs/, or a file's path
      if [ -f "ds_configs/$c.json" ]; then engine "ds_configs/$c.json"; elif [ -f "$c" ]; then engine "$c"; fi
    done
  fi

  if [ "${SKIP_TRL:-0}" != 1 ]; then
    limit=$(cut_to "${T_TRL:-240}" 0); t=$SECONDS
    if [ "$limit" -lt 60 ]; then echo "trl: skipped, $(left)s left"; else
      rm -f "$OUT/trl.jsonl"
      PORT=$((PORT + 1))
      timeout -k 15 "$limit" $DS --master_port "$PORT" --num_gpus 1 docs/bench/trl_grpo.py --model "$INIT" \
        --prompts "$DATA" --steps "$TRL_STEPS" --max_new_tokens "$MNT" --lr "$LR" --group_size "$G" \
        --micro_batch "$MICRO" --grad_accum "$GA" --prompts_per_step $((MICRO * GA / G)) --ds_config ds_configs/zero3_grpo.json --out "$OUT/trl.jsonl" \
        --output_dir /tmp/gvt_trl > "$LOGS/trl.log" 2>&1
      echo "trl: exit $? in $((SECONDS - t))s (limit ${limit}s) $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,120}' "$LOGS/trl.log")"
    fi
  fi
else  # re-read what an earlier call left in $OUT
  for f in "$OUT"/engine_*_metrics.jsonl; do
    [ -f "$f" ] || continue
    name=$(basename "$f" _metrics.jsonl); name=${name#engine_}
    RUNS="$RUNS engine_$name|engine|ds_configs/$name.json|$f"
  done
fi
[ -f "$OUT/trl.jsonl" ] && RUNS="$RUNS trl|trl|-|$OUT/trl.jsonl"

# Summary: one row per run in $OUT/grpo_vs_trl.jsonl, and the table
RUNS="$RUNS" COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} STEPS=$STEPS TRL_STEPS=$TRL_STEPS RECIPE=$RECIPE \
python3 - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, os, statistics, sys

import yaml

out = sys.argv[1]
steps_wanted = int(os.environ["STEPS"])
trl_steps_wanted = int(os.environ["TRL_STEPS"])


def med(xs):
    """Median of steps 2..N (the first step compiles, builds caches, warms the allocator); step 1 if it is alone."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs[1:]) if len(xs) > 1 else (xs[0] if xs else None)


def engine_row(label, cfg, path):
    rows = [r for r in map(json.loads, open(path)) if "step_s" in r]
    col = lambda k: [r.get(k) for r in rows]  # noqa: E731
    dec = col("decode_ms_per_step")
    return {"system": "engine", "label": label, "ds_config": cfg, "steps": len(rows),
            "complete": len(rows) >= steps_wanted, "steps_s": col("step_s"), "median_step_s": med(col("step_s")),
            "rollout_s": col("rollout_s"), "median_rollout_s": med(col("rollout_s")),
            "decode_ms_per_step": med(dec) if any(d is not None for d in dec) else None,
            "rollout_tokens_per_s": med(col("rollout_tokens_per_s")), "train_s": med(col("train_s")),
            "train_tokens_per_s": med(col("train_tokens_per_s")), "train_padding_frac": med(col("train_padding_frac")),
            "peak_mem_gib": max((x for x in col("peak_mem_gib") if x is not None), default=None),
            "response_len": col("response_len"), "reward": col("reward"), "kl": col("kl")}


def trl_row(path):
    r = [json.loads(l) for l in open(path) if l.strip()][-1]
    keep = ("system", "label", "ds_config", "zero_stage", "steps", "steps_s", "median_step_s", "rollout_s",
            "median_rollout_s", "rollout_tokens_per_s", "gen_ms_per_token_step", "completion_len",
            "completion_min_len", "peak_mem_gib", "reward", "kl", "trl_settings", "versions", "device")
    row = {k: r.get(k) for k in keep}
    row["complete"] = (r.get("steps") or 0) >= trl_steps_wanted
    row["decode_ms_per_step"] = None  # TRL's generate is timed whole: gen_ms_per_token_step includes prefill, gather
    return row


# Pretraining's tokens/s on the same DS config (zeroN_grpo.json is zeroN.json with a written batch) and vocabulary:
# rows of docs/bench/vocab_pretrain.sh (bin/pretrain.py, deepseek_2b6.yaml, seq 2048; the same architecture as
# grpo_2b6.yaml), by default the committed ones of one H200 (PRETRAIN_ROWS, PRETRAIN_CARD name others). Not measured in
# this call, and compared only on a card of that name.
ARCH = lambda path: {k: v for k, v in yaml.safe_load(open(path))["model"].items()  # noqa: E731
                     if k not in ("vocab_size", "max_position_embeddings")}
VOCAB = yaml.safe_load(open(os.environ["RECIPE"]))["model"].get("vocab_size")
PRETRAIN_ROWS = os.environ.get("PRETRAIN_ROWS") or "docs/bench/vocab/pretrain.jsonl"
PRETRAIN_CARD = os.environ.get("PRETRAIN_CARD") or "H200"
try:
    import torch

    CARD = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
except ImportError:
    CARD = "unknown"
PRETRAIN = {(r["ds_config"], r["vocab"]): r["tokens_per_s_per_gpu"]
            for r in map(json.loads, open(PRETRAIN_ROWS))
            if ARCH(os.environ["RECIPE"]) == ARCH("engine/recipes/deepseek_2b6.yaml")  # that architecture only
            and PRETRAIN_CARD in CARD}  # the same kind of card


def pretrain_tps(cfg):
    return PRETRAIN.get((os.path.basename(cfg).replace("_grpo", ""), VOCAB))


rows = []
for spec in os.environ.get("RUNS", "").split():
    label, system, cfg, path = spec.split("|")
    if not os.path.isfile(path) or not os.path.getsize(path):
        rows.append({"system": system, "label": label, "ds_config": cfg, "steps": 0, "complete": False,
                     "median_step_s": None, "error": f"no rows in {os.path.basename(path)} (see the logs)"})
        continue
    rows.append(engine_row(label, cfg, path) if system == "engine" else trl_row(path))
trl = next((r for r in rows if r["system"] == "trl" and r.get("median_step_s")), None)
for r in rows:
    r["commit"] = os.environ.get("COMMIT")
    if r["system"] == "engine" and trl and r.get("median_step_s"):
        r["trl_over_engine"] = trl["median_step_s"] / r["median_step_s"]
    if r["system"] == "engine" and r.get("train_tokens_per_s") and pretrain_tps(r["ds_config"]):
        r["pretrain_tokens_per_s"] = pretrain_tps(r["ds_config"])
        r["train_over_pretrain"] = r["train_tokens_per_s"] / r["pretrain_tokens_per_s"]
with open(os.path.join(out, "grpo_vs_trl.jsonl"), "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")

fmt = lambda v, p=2: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
head = ["run", "DS config", "steps", "median step s (2..N)", "rollout s", "rollout tok/s", "decode ms/step",
        "train tok/s", "pretraining tok/s", "train / pretraining", "train padding %", "peak GiB", "TRL / this"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for r in rows:
    print("| " + " | ".join([r["label"], str(r["ds_config"]), f"{r['steps']}{'' if r['complete'] else ' (cut)'}",
                            fmt(r.get("median_step_s")), fmt(r.get("median_rollout_s")),
                            fmt(r.get("rollout_tokens_per_s"), 0), fmt(r.get("decode_ms_per_step")),
                            fmt(r.get("train_tokens_per_s"), 0), fmt(r.get("pretrain_tokens_per_s"), 0),
                            "-" if r.get("train_over_pretrain") is None else f"{100 * r['train_over_pretrain']:.0f}%",
                            fmt(None if r.get("train_padding_frac") is None else 100 * r["train_padding_frac"], 1),
                            fmt(r.get("peak_mem_gib"), 1), fmt(r.get("trl_over_engine")) if r["system"] == "engine"
                            else "1.00"]) + " |")
for r in rows:
    if r.get("error"):
        print(f"{r['label']}: {r['error']}")
for r in rows:
    if r["system"] == "engine" and r.get("trl_over_engine"):
        print(f"TRL / engine ({r['ds_config']}): {trl['median_step_s']:.2f} s / {r['median_step_s']:.2f} s = "
              f"{r['trl_over_engine']:.2f} ({'engine faster' if r['trl_over_engine'] > 1 else 'TRL faster'})")
print(f"pretraining tok/s: bin/pretrain.py on deepseek_2b6.yaml at vocabulary {VOCAB}, the same DS config without "
      f"_grpo, one {PRETRAIN_CARD} ({PRETRAIN_ROWS}, an earlier call)"
      + ("" if PRETRAIN_CARD in CARD else f"; not compared: this card is {CARD}") + "; train tok/s as the metrics row "
      "defines it: real tokens x forward passes / train_s")
if trl:
    print(f"TRL completion lengths per step: {trl.get('completion_len')} (forced: "
          f"{(trl.get('trl_settings') or {}).get('generation_kwargs')})")
print(f"rows: {os.path.join(out, 'grpo_vs_trl.jsonl')}")
EOF
echo "total: $((SECONDS - T0))s"
[ -d "$LOGS" ] && tar czf "$OUT/logs_grpo_vs_trl.tgz" -C "$LOGS" . 2>/dev/null
exit 0

#!/usr/bin/env bash
# One-GPU figures for the model families beyond DeepSeek-V3. For each model (a published shape truncated in
# depth: engine/recipes/mixtral_8x7b_l3.yaml, deepseek_v2_lite_l8.yaml, and Qwen3.5-35B-A3B at 4 layers, built
# below): bin/pretrain.py for PT_STEPS (20) steps with ds_configs/zero2.json ("auto" batch), then bin/grpo.py for
# GRPO_STEPS (4) steps from a random init of the same model (docs/bench/save_random_model.py) with
# ds_configs/zero3_grpo.json (grpo_2b6.yaml's grpo section, beta 0.04; the rollout path is what "auto" picks for the
# family: the local decoder for mixtral and deepseek_v2, the engine for qwen3_5), and a table of tokens/s, MFU (see
# flops_per_token below), peak memory, loss at the first and last step, the GRPO step and decode ms per step.
#   bash docs/bench/families_gpu.sh     (on the GPU machine, from the checkout, with .whl/ carried; about 4 minutes a
#   family: split RECIPES over two 10-minute calls)
# Switches: RECIPES, PT_STEPS, GRPO_STEPS, T_PT / T_GRPO (timeouts, s), PT_DS (pretraining DeepSpeed config),
# SKIP_GRPO / SKIP_PT: 1 (every recipe) or the recipe names whose GRPO / pretraining part to skip;
# LAYERS="mixtral_8x7b_l3=2 deepseek_v2_lite_l8=5": those recipes at that depth (a copy in $W; the published depths
# here are sized for a 141 GB card, and GRPO's "auto" refuses them on an 80 GB one).
# Files: $OUT/<recipe>_pretrain.jsonl, $OUT/<recipe>_grpo.jsonl (metrics rows), $OUT/families.md (table), logs.tgz.
# CPU smoke test: RECIPES="tiny_mixtral tiny_deepseek_v2 qwen3_5_35b_a3b_l4" PT_STEPS=4 GRPO_STEPS=1 MAX_NEW=8 \
#   QWEN_OVERRIDES='{"hidden_size": 64, "num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
#   "vocab_size": 512, "num_attention_heads": 4, "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
#   "linear_key_head_dim": 16, "linear_value_head_dim": 16}' bash docs/bench/families_gpu.sh
set -u
OUT=${OUT:-/tmp/families}; W=/tmp/fam; mkdir -p "$OUT" $W/logs
. docs/bench/gpu_env.sh deepspeed
DS="python3 -m deepspeed.launcher.runner"
port=29800
# qwen3_5_35b_a3b_l4: Qwen3.5-35B-A3B's text model as transformers' Qwen3_5MoeTextConfig defaults describe it (hidden
# 2048, head_dim 256, 256 experts of 512 top-8 + a shared one, vocabulary 248,320), at 4 of its 40 layers (3 Gated
# DeltaNet + 1 full attention), random init saved to $W and trained through model.init_from (the recipe fields cannot
# say head_dim 256 or the linear layers' own head counts). QWEN_OVERRIDES (JSON) shrinks it for a CPU smoke test.
make_qwen() {
  [ -f "$W/qwen3_5_l4/config.json" ] && [ -f "$W/qwen3_5_35b_a3b_l4.yaml" ] && [ -z "${QWEN_OVERRIDES:-}" ] && return  # built by an earlier run of this machine
  python3 - "$W/qwen3_5_l4" "$W/qwen3_5_35b_a3b_l4.yaml" "${QWEN_OVERRIDES:-}" <<'PY'
import json, sys, torch, yaml
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
out, recipe, over = sys.argv[1], sys.argv[2], json.loads(sys.argv[3] or "{}")
d = Qwen3_5MoeTextConfig()
cfg = Qwen3_5MoeTextConfig(**{**d.to_dict(), "num_hidden_layers": 4, "layer_types": d.layer_types[:4],
                              "tie_word_embeddings": False, **over})
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(out)
print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters ({cfg.layer_types}) to {out}")
yaml.safe_dump({"model": {"init_from": out}, "data": {"seq_len": 2048 if not over else 128},
                "train": {"max_steps": 20, "warmup_steps": 5, "log_every": 1}, "checkpoint": {"at_end": False},
                "run_dir": "runs/qwen3_5_35b_a3b_l4"}, open(recipe, "w"), sort_keys=False)
PY
}
skips() { [ "$1" = 1 ] || [[ " $1 " == *" $rec "* ]]; }  # SKIP_PT / SKIP_GRPO name this recipe (or are 1)
for rec in ${RECIPES:-mixtral_8x7b_l3 deepseek_v2_lite_l8 qwen3_5_35b_a3b_l4}; do
  recipe=engine/recipes/$rec.yaml
  if [ "$rec" = qwen3_5_35b_a3b_l4 ]; then make_qwen 2>&1 | tail -1; recipe=$W/$rec.yaml
  else rm -f $W/$rec.yaml; fi  # an earlier run's LAYERS copy
  for pair in ${LAYERS:-}; do  # the recipe at another depth: a copy in $W, which the table below reads too
    [ "${pair%%=*}" = "$rec" ] || continue
    sed -E "s/^(  num_layers:) [0-9]+/\1 ${pair#*=}/" $recipe > $W/$rec.yaml.tmp && mv $W/$rec.yaml.tmp $W/$rec.yaml
    recipe=$W/$rec.yaml; echo "$rec at ${pair#*=} layers ($recipe)"
  done
  python3 - engine/recipes/grpo_2b6.yaml $W/grpo_$rec.yaml "${MAX_NEW:-}" <<'PY'
import sys, yaml
r = yaml.safe_load(open(sys.argv[1]))
r.pop("model")  # the model is the pretraining run's (its config.json picks the family)
r["grpo"].update(beta=0.04, kl="k3")
if sys.argv[3]:
    r["grpo"]["max_new_tokens"] = int(sys.argv[3])
r["checkpoint"] = {"every_steps": 0, "every_minutes": 0, "at_end": False}
yaml.safe_dump(r, open(sys.argv[2], "w"), sort_keys=False)
PY
  t=$SECONDS; port=$((port + 1)); rm -rf $W/run_$rec $W/grpo_run_$rec
  if ! skips "${SKIP_PT:-}"; then
  timeout -k 15 ${T_PT:-240} $DS --master_port $port --num_gpus ${GPUS:-1} bin/pretrain.py --deepspeed_config ${PT_DS:-ds_configs/zero2.json} \
    --config $recipe --max_steps ${PT_STEPS:-20} --run_dir $W/run_$rec > $W/logs/pretrain_$rec.log 2>&1
  echo "$rec pretrain: exit $? in $((SECONDS - t))s $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,160}|error: .{0,200}' $W/logs/pretrain_$rec.log)"
  cp $W/run_$rec/metrics.jsonl "$OUT/${rec}_pretrain.jsonl" 2>/dev/null
  fi
  # GRPO from a random init of the same model (its speed does not depend on the weights; a 4.6B run's checkpoint with
  # fp32 Adam states would not fit this machine's disk)
  skips "${SKIP_GRPO:-}" && continue
  init=$W/init_$rec
  if [ "$rec" = qwen3_5_35b_a3b_l4 ]; then init=$W/qwen3_5_l4; else
    python3 docs/bench/save_random_model.py --config $recipe --out $init 2>&1 | tail -1; fi
  t=$SECONDS; port=$((port + 1))
  timeout -k 15 ${T_GRPO:-240} $DS --master_port $port --num_gpus ${GPUS:-1} bin/grpo.py --deepspeed_config ds_configs/zero3_grpo.json \
    --config $W/grpo_$rec.yaml --init_from $init --max_steps ${GRPO_STEPS:-4} --run_dir $W/grpo_run_$rec \
    > $W/logs/grpo_$rec.log 2>&1
  echo "$rec grpo: exit $? in $((SECONDS - t))s $(grep -m1 -oE 'OutOfMemoryError|Error: .{0,160}|error: .{0,200}|auto picks engine' $W/logs/grpo_$rec.log)"
  cp $W/grpo_run_$rec/metrics.jsonl "$OUT/${rec}_grpo.jsonl" 2>/dev/null
done
W=$W python3 - "$OUT" ${RECIPES:-mixtral_8x7b_l3 deepseek_v2_lite_l8 qwen3_5_35b_a3b_l4} <<'PY' | tee "$OUT/families.md"
import json, statistics, sys
out = sys.argv[1]
def flops_per_token(rec):
    """6 x active parameters (embedding excluded, routed experts at k/E) + attention's 3 x 2 x seq x heads x
    (qk + v) per softmax-attention layer (the full square, no causal discount): the formula of docs/bench/vocab_pretrain.sh, at H200 bf16 dense peak 989 TFLOP/s."""
    import os
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM
    from engine.config import load_recipe
    from engine.model import make_hf_config
    path = Path(os.environ["W"]) / f"{rec}.yaml"  # LAYERS' copy or the Qwen recipe built above, else the shipped one
    r = load_recipe(path if path.exists() else Path(f"engine/recipes/{rec}.yaml"))
    m = r.model
    cfg = make_hf_config(m) if m.init_from is None else __import__("transformers").AutoConfig.from_pretrained(m.init_from)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    k = cfg.num_experts_per_tok
    E = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.num_experts
    active = total - cfg.vocab_size * cfg.hidden_size - experts + experts * k / E
    if hasattr(cfg, "kv_lora_rank"):
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        qk = v = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = sum(t == "full_attention" for t in getattr(cfg, "layer_types", None) or []) or cfg.num_hidden_layers
    # softmax attention layers only (Gated DeltaNet's cost is linear in the sequence and left out)
    return 6 * active + 3 * layers * 2 * r.data.seq_len * cfg.num_attention_heads * (qk + v)


def rows(path):
    try:
        return [json.loads(l) for l in open(path)]
    except OSError:
        return []
print("| recipe | pretrain steps | tokens/s (median, steps 2..) | MFU | peak GiB | loss first -> last | GRPO steps | step s | decode ms/step | rollout |")
print("|---|---|---|---|---|---|---|---|---|---|")
for rec in sys.argv[2:]:
    pt = [r for r in rows(f"{out}/{rec}_pretrain.jsonl") if "loss" in r]
    g = [r for r in rows(f"{out}/{rec}_grpo.jsonl") if "step_s" in r]
    med = lambda xs: statistics.median(xs[1:] if len(xs) > 1 else xs) if xs else float("nan")
    mfu = med([r["tokens_per_s_per_rank"] for r in pt]) * flops_per_token(rec) / 989e12 if pt else None
    dec = [r["decode_ms_per_step"] for r in g if "decode_ms_per_step" in r]
    eng = [r["rollout_ms_per_step"] for r in g if "rollout_ms_per_step" in r]  # grpo.rollout engine: generate's ms per step
    grpo = (f"{len(g)} | {med([r['step_s'] for r in g]):.2f} | {med(dec or eng):.2f} | {'local' if dec else 'engine'}"
            if g else f"{len(g)} | - | - | -")
    print(f"| {rec} | {len(pt)} | {med([r['tokens_per_s'] for r in pt]):.0f} | "
          f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {max((r.get('peak_mem_gib') or 0) for r in pt)} | "
          f"{pt[0]['loss']:.3f} -> {pt[-1]['loss']:.3f} | {grpo} |" if pt else f"| {rec} | 0 | - | - | - | - | {grpo} |")
PY
tar czf "$OUT/logs.tgz" -C $W logs

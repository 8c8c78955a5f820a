"""Bytes saved for backward per token, per decoder layer and per sub-module, CPU, bf16, eager.

Whole-model way: build the HF causal LM (reduced experts, vocab 512), register a forward pre-hook / forward hook on
every decoder layer and on its sub-modules (norms, attention / linear attention, mlp and the mlp's experts / shared
expert(s) / router), and run one forward with torch.autograd.graph.saved_tensors_hooks. Each saved tensor is
deduplicated by its untyped storage's data_ptr (counted once, with the storage's full nbytes, attributed to the
module stack active when it was first saved); parameter storages and the input_ids are excluded.

usage (from the checkout):  python docs/bench/saved_activations.py --model deepseek|qwen --seq 512 [--autoep] [--attn gpulike|sdpa]
Rows: docs/bench/saved_activations/ (summary.txt: the table of docs/benchmarks.md "model families", Qwen3.5 bullet).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

p = argparse.ArgumentParser()
p.add_argument("--model", choices=["deepseek", "qwen"], required=True)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--experts", default="eager", help="transformers experts_implementation: eager | grouped_mm")
p.add_argument("--n_experts", type=int, default=None)
p.add_argument("--layers", type=int, default=None)
p.add_argument("--top", type=int, default=12, help="largest saved tensors listed per layer")
p.add_argument("--out", default=None)
p.add_argument("--attn", default="gpulike", help="gpulike (saves q, k, v, out, lse as GPU flash/efficient "
               "SDPA does) | sdpa (CPU SDPA: MLA's 192/128 head dims fall to the math path, fp32 S x S probs)")
p.add_argument("--peak", action="store_true", help="instead: forward + backward under torch's MemTracker, each "
               "parameter's .grad dropped as soon as it is accumulated (as ZeRO-2 moves it into its bucket); peak minus "
               "parameters = activations + the transient at the peak")
p.add_argument("--autoep", action="store_true", help="swap the MoE blocks for DeepSpeed AutoEP layers (ep_size 1)")
p.add_argument("--combine", default="weighted_sum", help="AutoEP combine_impl (CPU: weighted_sum)")
a = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(2)

if a.model == "deepseek":
    sys.path.insert(0, "/work/main")
    from engine.config import load_recipe
    from engine.model import make_hf_config

    r = load_recipe(Path("/work/main/engine/recipes/deepseek_2b6.yaml"))
    print("recipe model:", {k: getattr(r.model, k) for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size",
          "moe_intermediate_size", "num_experts", "experts_per_token", "num_shared_experts", "first_dense_layers",
          "vocab_size", "kv_lora_rank", "q_lora_rank", "attn_implementation")})
    cfg = make_hf_config(r.model)
    cfg.n_routed_experts = a.n_experts or 8
    cfg.vocab_size = 512
    if a.layers:
        cfg.num_hidden_layers = a.layers
    attn_impl = r.model.attn_implementation
else:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    d = Qwen3_5MoeTextConfig()
    n = a.layers or 4
    cfg = Qwen3_5MoeTextConfig(**{**d.to_dict(), "num_hidden_layers": n, "layer_types": d.layer_types[:n],
                                  "tie_word_embeddings": False, "num_experts": a.n_experts or 16, "vocab_size": 512})
    attn_impl = "sdpa"

from transformers import AttentionInterface, AutoModelForCausalLM  # noqa: E402


class _FlashLike(torch.autograd.Function):
    """Causal SDPA whose saved-for-backward set is what GPU flash / memory-efficient SDPA keeps: q, k, v, out (model
    dtype) and the fp32 log-sum-exp (B x H x S); no S x S matrix. Backward recomputes through the math path."""

    @staticmethod
    def forward(ctx, q, k, v, scale, gqa):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        lse = torch.empty(q.shape[:3], dtype=torch.float32)
        ctx.scale, ctx.gqa = scale, gqa
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale,
                                                                   enable_gqa=ctx.gqa)
            return (*torch.autograd.grad(out, (q, k, v), g), None, None)


def flashlike_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    gqa = query.shape[1] != key.shape[1]
    out = _FlashLike.apply(query, key, value, scaling, gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("gpulike", flashlike_attention)
if a.attn != "sdpa":
    attn_impl = a.attn

t0 = time.time()
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn_impl,
                                         experts_implementation=a.experts)
model.config.use_cache = False
model.train()
print(f"built {type(model).__name__} {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params in "
      f"{time.time() - t0:.0f}s; attn {model.config._attn_implementation}, experts "
      f"{model.config._experts_implementation}")
if a.autoep:
    import os

    import deepspeed
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.utils import groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    groups._create_expert_and_data_parallel(1, mp_size=1, pp_size=1, mp_mode="sp")
    aec = parse_autoep_config({"enabled": True, "autoep_size": 1, "combine_impl": a.combine})
    ae = AutoEP(model, aec)
    specs = ae.ep_parser()
    ae.replace_moe_layers(specs, ep_size=1, ep_rank=0)
    model.to(torch.bfloat16)
    print(f"AutoEP: replaced {len(specs)} MoE blocks; layer 1 mlp: {type(model.model.layers[-1].mlp).__name__}, "
          f"children {[n for n, _ in model.model.layers[-1].mlp.named_children()]}, "
          f"combine {model.model.layers[-1].mlp.combine_impl}, experts grouped_mm "
          f"{getattr(model.model.layers[-1].mlp.experts, 'use_grouped_mm', None)} triton "
          f"{getattr(model.model.layers[-1].mlp.experts, 'use_triton_grouped_mm', None)}")
h = cfg.hidden_size
sub_cfg = {k: getattr(cfg, k, None) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts", "n_routed_experts",
           "num_experts_per_tok", "n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace",
           "intermediate_size", "linear_num_value_heads", "linear_value_head_dim", "linear_num_key_heads",
           "linear_key_head_dim", "linear_conv_kernel_dim", "layer_types", "vocab_size", "attn_output_gate")}
print("config:", sub_cfg)

exclude = {q.untyped_storage().data_ptr() for q in model.parameters()}
exclude |= {b.untyped_storage().data_ptr() for b in model.buffers()}

stack: list[str] = []
seen: set[int] = set()
nbytes = defaultdict(int)  # bucket -> bytes
by_dtype = defaultdict(lambda: defaultdict(int))
tensors = defaultdict(list)  # layer -> [(nbytes, shape, dtype, innermost module)]

layers = model.model.layers
tracked = {}
for i, layer in enumerate(layers):
    tracked[layer] = f"L{i}"
    for name, mod in layer.named_modules():
        if name and name.count(".") <= 1 and not isinstance(mod, torch.nn.Linear):
            tracked[mod] = f"L{i}.{name}"
        elif name in ("mlp.gate", "mlp.shared_expert_gate"):
            tracked[mod] = f"L{i}.{name}"


def pre(mod, args, kwargs=None):
    stack.append(tracked[mod])


def post(mod, args, out, kwargs=None):
    assert stack and stack[-1] == tracked[mod], (stack, tracked[mod])
    stack.pop()


for mod in tracked:
    mod.register_forward_pre_hook(pre)
    mod.register_forward_hook(post)


def pack(t):
    s = t.untyped_storage()
    ptr = s.data_ptr()
    if ptr in exclude or ptr in seen or s.nbytes() == 0:
        return t
    seen.add(ptr)
    b = s.nbytes()
    nbytes["TOTAL"] += b
    if not stack:
        nbytes["outside_layers"] += b
        return t
    for key in stack:
        nbytes[key] += b
    layer = stack[0]
    by_dtype[layer][str(t.dtype).replace("torch.", "")] += b
    tensors[layer].append((b, tuple(t.shape), str(t.dtype).replace("torch.", ""), stack[-1]))
    return t


ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
if a.peak:
    from torch.distributed._tools.mem_tracker import MemTracker

    for q in model.parameters():
        q.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    params = sum(q.numel() * q.element_size() for q in model.parameters())
    params += sum(b.numel() * b.element_size() for b in model.buffers())
    tokens = a.batch * a.seq
    mt = MemTracker()
    mt.track_external(model)
    t0 = time.time()
    with mt:
        loss = model(input_ids=ids, labels=ids).loss
        after_fwd = mt.get_tracker_snapshot("current")
        loss.backward()
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    cur = after_fwd[torch.device("cpu")]
    cats = {str(k).split(".")[-1].split(":")[0].strip("<_'"): v for k, v in peak.items()}
    print(f"fwd+bwd {time.time() - t0:.0f}s; peak snapshot by category (bytes): {cats}")
    print(f"after forward, by category: { {str(k): v for k, v in cur.items()} }")
    pk = peak["Total"] - params
    fw = cur["Total"] - params
    print(f"PEAK minus parameters+buffers: {pk / tokens:.0f} B/token = {pk / tokens / cfg.hidden_size:.1f} B/(tok*h); "
          f"live after forward minus parameters: {fw / tokens:.0f} B/token = {fw / tokens / cfg.hidden_size:.1f}")
    Path(a.out or f"/tmp/saved_activations_{a.model}_s{a.seq}_{'autoep' if a.autoep else a.experts}_{a.attn}_peak.json").write_text(
        json.dumps({"peak_minus_params_per_token": pk / tokens, "after_forward_minus_params_per_token": fw / tokens,
                    "hidden": cfg.hidden_size, "peak_by_category": {str(k): v for k, v in peak.items()},
                    "params_bytes": params, "tokens": tokens}, indent=1))
    sys.exit(0)
exclude.add(ids.untyped_storage().data_ptr())
tokens = a.batch * a.seq
t0 = time.time()
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    out = model(input_ids=ids, labels=ids)
fwd_s = time.time() - t0
print(f"forward {fwd_s:.1f}s, loss {out.loss.item():.3f}, tokens {tokens}")

res = {"model": a.model, "seq": a.seq, "batch": a.batch, "experts_impl": model.config._experts_implementation,
       "attn_impl": model.config._attn_implementation, "hidden": h, "config": sub_cfg, "per_token": {},
       "per_token_hidden": {}}
types = getattr(cfg, "layer_types", None)
print(f"\n{'bucket':40s} {'B/token':>10s} {'B/(tok*h)':>10s}")
for k in sorted(nbytes, key=lambda k: (k.split(".")[0] if k.startswith("L") else "~" + k,
                                       k.count("."), k)):
    pt = nbytes[k] / tokens
    res["per_token"][k] = pt
    res["per_token_hidden"][k] = pt / h
    label = k
    if k.startswith("L") and "." not in k:
        i = int(k[1:])
        kind = types[i] if types else ("dense" if i < getattr(cfg, "first_k_dense_replace", 0) else "moe")
        label = f"{k} [{kind}]"
        res.setdefault("layer_kind", {})[k] = kind
    print(f"{label:40s} {pt:10.0f} {pt / h:10.2f}")
for layer in sorted(by_dtype, key=lambda k: int(k[1:])):
    d = {k: round(v / tokens / h, 2) for k, v in by_dtype[layer].items()}
    res.setdefault("dtype_per_token_hidden", {})[layer] = d
for layer in sorted(tensors, key=lambda k: int(k[1:]))[: 4 if a.model == "qwen" else 2]:
    print(f"\nlargest saved tensors of {layer} (bytes/token, shape, dtype, module); dtype split per (tok*h): "
          f"{res['dtype_per_token_hidden'][layer]}")
    for b, shape, dt, m in sorted(tensors[layer], reverse=True)[: a.top]:
        print(f"  {b / tokens:9.0f}  {str(shape):28s} {dt:9s} {m}")
    res.setdefault("top_tensors", {})[layer] = [(b / tokens, shape, dt, m) for b, shape, dt, m in
                                                sorted(tensors[layer], reverse=True)[: a.top]]
res["forward_s"] = fwd_s
res["autoep"] = a.autoep
out_path = a.out or f"/tmp/saved_activations_{a.model}_s{a.seq}_{'autoep' if a.autoep else a.experts}_{a.attn}.json"
Path(out_path).write_text(json.dumps(res, indent=1))
print("wrote", out_path)

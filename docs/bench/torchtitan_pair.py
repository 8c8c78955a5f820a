#!/usr/bin/env python3
"""torchtitan's DeepSeek-V3 trained with a model config derived from one of our recipes, on our data, timed as bin/bench.py.

    python3 docs/bench/torchtitan_pair.py --config engine/recipes/deepseek_2b6.yaml --global_batch 64 \
        --micro_batch 16 --steps 20 --warmup 5 --out titan.jsonl --label titan     (one GPU; see torchtitan_pair.sh)
    python3 docs/bench/torchtitan_pair.py --config engine/recipes/deepseek_2b6.yaml --check    (CPU: counts only)

The model (torchtitan 0.3.0; 0.2.2 below): its own `build_mla_moe_layers` / `DeepSeekV3Model.Config` (DeepSeek-V3
inits), every size taken from engine.model.make_hf_config(recipe.model) (hidden, layers, heads, MLA ranks and head
dims, dense and expert widths, routed/shared experts, top-k, first dense layers, vocabulary, RoPE theta, RMSNorm
eps); the routing as DeepSeek-V3 with n_group = 1 (sigmoid scores, bias only for the choice, top-k weights
renormalized, scale routed_scaling_factor); aux-loss-free balancing at train.balance_rate. What cannot match is
printed ("differs:").
The training step is torchtitan's Trainer's: the model built on the meta device, its parallelize_deepseekv3 (per-block
torch.compile, activation checkpointing if asked, FSDP2 over the one GPU: bf16 parameters for compute, fp32 master
weights and gradient reduction), init_weights, ChunkedLossWrapper (lm_head + cross entropy in 8 chunks, compiled),
its AdamW container (fused; lr train.lr, betas 0.9/0.95, eps 1e-8, weight decay 0.1 = ds_configs/zero*.json), its
MoE load-balancing optimizer hook, Trainer.post_dataloading_process (FlexAttention block mask from per-row positions)
and Trainer._forward_backward_body (wrapped in CUDA graphs unless --cuda_graphs 0, its default), clip_grad_norm_ 1.0.
The LR follows the recipe's schedule (engine.parallel.lr_multiplier, as the engine's LambdaLR), per optimizer step.
The data: engine.data.build_data on the recipe's data section with train.seed, read as the engine reads it on one rank
(step s takes sequences s*G .. s*G+G-1 of the shuffled windows, G = --global_batch), so both systems see the same
tokens at every step; labels are the inputs shifted by one (the last position ignored: seq-1 predicted tokens per
row, as the engine's HF-style loss).

FLOPs per token (bin/bench.py's formula, counted here from torchtitan's module and checked against our HF model on
the meta device): 6 x active non-embedding parameters (every parameter except the input embedding, the output layer
included; routed experts at experts_per_token / num_experts) + 3 x layers x 2 x seq x heads x (qk_head_dim +
v_head_dim). MFU = tokens/s x FLOPs per token / 989 TFLOP/s. One JSON row per run to --out (bench.py's keys where
they apply, with "system": "torchtitan"); --losses N runs N steps and keeps every step's loss.

Two torchtitan versions, chosen by the one installed (`--check` prints which): 0.3.0 as above, and 0.2.2 (released
2026-02-20, when PyTorch nightlies were 2.11.0.dev: the GPU image's torch line). With 0.2.2 the model is its
DeepSeekV3ModelArgs / DeepSeekV3Model of the same sizes (YaRN off, the final norm's eps set after the build) and the
step its Trainer's on one GPU: parallelize_deepseekv3 (per-block compile, AC if asked; no FSDP on one GPU, so no
reshard), bf16 autocast over fp32 parameters (its maybe_enable_amp), grouped-GEMM MoE, FlexAttention with a causal block
mask, its cross_entropy_loss (full logits, compiled), build_optimizers_with_moe_load_balancing (the same AdamW and
balancing hook), Trainer.forward_backward_step. It has no CUDA graphs (--cuda_graphs is ignored) and no chunked loss.

torchtitan 0.3.0 pins a torch nightly newer than the GPU image's 2.11. On an older torch this driver installs
stand-ins, each printed: torch.distributed.fsdp.DataParallelMeshDims (torch 2.12; imported at module level, used only
on multi-GPU / full_dtensor paths), spmd_backend partial_dtensor instead of spmd_types (--spmd_backend auto), and
create_block_mask options the older torch lacks are dropped. Absent triton / tensorboard get stand-ins too (either
version). With --device cpu, a smoke test of a small recipe, FlexAttention (no backward on the CPU) is replaced by
causal sdpa.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def titan_version() -> tuple[int, int]:
    """The installed torchtitan's (major, minor), read from its metadata without importing it (the stand-ins below
    must go in first). 0.2: the JobConfig / ModelArgs API; 0.3: Trainer.Config / Module.Config."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("torchtitan").split("+")[0].split(".")[:2])


def stub_missing_optional_modules(v02: bool) -> list[str]:
    """torchtitan imports two things at module level that a CPU box or a lean GPU image may lack and this driver never
    uses: triton (0.3: only for the minimal_async_ep EP kernels; 0.2: only for the grouped-GEMM index padding, which
    runs on SM90 GPUs, where triton is real) and tensorboard (only for the Trainer's metrics logger). Where they are
    missing, stand-ins let the imports pass; on the GPU image triton is real."""
    done = []
    if importlib.util.find_spec("triton") is None:
        class _Absent(types.ModuleType):
            def __getattr__(self, name):
                return None
        kernels = "torchtitan.models.moe.kernels" if v02 else "torchtitan.distributed.minimal_async_ep.kernels"
        sys.modules[kernels] = _Absent("kernels (triton absent)")
        done.append(f"triton ({kernels})")
    import torch.distributed.fsdp as fsdp

    if not v02 and not hasattr(fsdp, "DataParallelMeshDims"):  # 0.3 on torch < 2.12: imported at module level, used
        @dataclasses.dataclass                                  # only by the full_dtensor / multi-GPU spmd_types
        class DataParallelMeshDims:                             # paths, not taken here
            shard: object = None
            replicate: object = None

            def __post_init__(self):
                raise RuntimeError("DataParallelMeshDims needs torch >= 2.12 (a stand-in on this torch)")
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        done.append("torch.distributed.fsdp.DataParallelMeshDims (torch < 2.12)")
    if importlib.util.find_spec("tensorboard") is None:
        tb = types.ModuleType("torch.utils.tensorboard")
        tb.SummaryWriter = None
        sys.modules["torch.utils.tensorboard"] = tb
        done.append("tensorboard (Trainer metrics logger)")
    return done


def routing(hf, rate: float):
    """What both versions' builders share: checks that the recipe maps, RoPE theta, DeepSeek routing in torchtitan's
    terms (score function, renormalization, expert groups), and the notes that hold for both."""
    arch = hf.model_type
    if arch not in ("deepseek_v3", "deepseek_v2"):
        raise SystemExit(f"recipe arch {arch}: this driver maps deepseek_v3 / deepseek_v2 recipes only")
    rp = getattr(hf, "rope_parameters", None) or {}
    if rp.get("rope_type", "default") != "default":
        raise SystemExit(f"RoPE {rp}: only the default (unscaled) RoPE is mapped")
    if getattr(hf, "tie_word_embeddings", False):
        raise SystemExit("tied embeddings: not mapped")
    theta = rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    n_group = getattr(hf, "n_group", 1) or 1
    notes = []
    if arch == "deepseek_v3":
        score, route_norm = "sigmoid", bool(hf.norm_topk_prob)
        groups = (None, None) if n_group == 1 else (n_group, hf.topk_group)
    else:
        score, route_norm, groups = "softmax", False, (None, None)
        notes.append("router: deepseek_v2 greedy softmax top-k without renormalization -> torchtitan softmax, "
                     "route_norm off")
    notes += [
        f"MLA: q_lora_rank {hf.q_lora_rank}, kv_lora_rank {hf.kv_lora_rank}, qk {hf.qk_nope_head_dim}+"
        f"{hf.qk_rope_head_dim}, v {hf.v_head_dim}; softmax scale qk_head_dim^-0.5 in both (no YaRN mscale); "
        "same projections and norms (q_a/q_b, kv_a with the shared rope key, kv_b, o)",
        f"router: {score}, bias only for the top-{hf.num_experts_per_tok} choice, renormalized={route_norm}, "
        f"scale {getattr(hf, 'routed_scaling_factor', 1.0)}, groups {groups[0] or 'none'} (ours: n_group "
        f"{n_group}), weights applied to the experts' outputs",
        f"shared experts: one SwiGLU of width {hf.n_shared_experts} x {hf.moe_intermediate_size} in both",
        f"balancing: both bias += rate x sign(mean load - load) once per optimizer step at rate "
        f"{rate:g}; differs: torchtitan subtracts the mean of the update (biases stay centred) and updates "
        "in an optimizer pre-step hook from the counts of that step's micro-batches",
        "differs: no auxiliary/sequence balance loss in either (DeepSeek-V3's seq-aux loss absent in both)",
        "differs: initialization is each system's own (torchtitan: embedding N(0,1), trunc-normal 0.02 with "
        "depth-scaled output projections, lm_head std dim^-0.5; ours: transformers' normal(0, 0.02))",
    ]
    return theta, score, route_norm, groups, notes


def attention_note(attn_backend: str, flex_mask: str) -> str:
    kernel = (f"FlexAttention (compiled, max-autotune) with {flex_mask}" if attn_backend == "flex"
              else f"{attn_backend} (causal)")
    return f"{'differs: ' if attn_backend == 'flex' else ''}attention kernel: torchtitan {kernel}; ours sdpa causal. Same masking (no document masking in either)"


def titan_model_config(hf, recipe, attn_backend: str):
    """torchtitan 0.3's DeepSeekV3Model.Config for our HF config `hf` (make_hf_config of the recipe), and the notes on
    what differs."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT, _NORM_INIT, _output_linear_init, _build_dsv3_layers)
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    theta, score, route_norm, groups, notes = routing(hf, recipe.train.balance_rate)
    dim = hf.hidden_size
    layers = _build_dsv3_layers(
        n_layers=hf.num_hidden_layers, n_dense_layers=hf.first_k_dense_replace, dim=dim,
        n_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank or 0, kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        mscale=1.0, dense_hidden_dim=hf.intermediate_size, moe_hidden_dim=hf.moe_intermediate_size,
        num_experts=hf.n_routed_experts, num_shared_experts=hf.n_shared_experts, router_top_k=hf.num_experts_per_tok,
        router_score_func=score, router_num_expert_groups=groups[0], router_num_limited_groups=groups[1],
        router_route_scale=float(getattr(hf, "routed_scaling_factor", 1.0)), router_route_norm=route_norm,
        attn_backend=attn_backend, moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=hf.qk_rope_head_dim, max_seq_len=hf.max_position_embeddings, theta=theta,
                                scaling="none"))
    rate = recipe.train.balance_rate
    for layer in layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = rate if rate > 0 else None
    cfg = DeepSeekV3Model.Config(
        vocab_size=hf.vocab_size, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=hf.vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=hf.vocab_size, param_init=_output_linear_init(dim)),
        layers=layers, mtp_layers=[])
    eps = hf.rms_norm_eps
    n_norms = 0
    for obj in _walk(cfg):
        if isinstance(obj, RMSNorm.Config):
            obj.eps = eps
            n_norms += 1
    notes = [f"RoPE: ComplexRoPE (interleaved pairs) theta {theta:g}, no scaling; transformers' DeepSeek-V3 rotates "
             "the same pairs (rope_interleave) -> same attention scores"] + notes + [
        "router: torchtitan 0.3 computes the gate and scores in fp32 under autocast",
        f"RMSNorm eps {eps:g} set on all {n_norms} torchtitan norms (its default is 1e-5)",
        "differs: precision: torchtitan keeps fp32 parameters, FSDP2 casts to bf16 for compute and reduces "
        "gradients in fp32; ours trains bf16 parameters with fp32 optimizer master weights (DeepSpeed bf16)",
        attention_note(attn_backend, "a causal block mask per row"),
    ]
    return cfg, notes


def titan022_model_args(hf, recipe, attn_backend: str):
    """torchtitan 0.2's DeepSeekV3ModelArgs for our HF config `hf`, and the notes on what differs."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    theta, score, route_norm, groups, notes = routing(hf, recipe.train.balance_rate)
    seq, rate = recipe.data.seq_len, recipe.train.balance_rate
    margs = DeepSeekV3ModelArgs(
        max_seq_len=seq, vocab_size=hf.vocab_size, dim=hf.hidden_size, inter_dim=hf.intermediate_size,
        moe_inter_dim=hf.moe_intermediate_size, n_layers=hf.num_hidden_layers,
        n_dense_layers=hf.first_k_dense_replace, n_heads=hf.num_attention_heads, norm_eps=hf.rms_norm_eps,
        moe_args=MoEArgs(num_experts=hf.n_routed_experts, num_shared_experts=hf.n_shared_experts, score_func=score,
                         route_norm=route_norm, route_scale=float(getattr(hf, "routed_scaling_factor", 1.0)),
                         score_before_experts=False, top_k=hf.num_experts_per_tok, num_expert_groups=groups[0],
                         num_limited_groups=groups[1], load_balance_coeff=rate if rate > 0 else None),
        q_lora_rank=hf.q_lora_rank or 0, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, attn_type=attn_backend,
        attn_mask_type="causal",
        # YaRN (frequencies and softmax mscale) applies only past original_seq_len; rope_factor 1 makes it a no-op
        original_seq_len=max(seq, hf.max_position_embeddings), rope_theta=theta, rope_factor=1.0, mscale=1.0)
    margs.moe_impl = "standard"  # update_from_config sets it from the JobConfig; the meta build for --check needs it
    notes = [f"RoPE: complex (interleaved pairs) theta {theta:g}, YaRN off (original_seq_len "
             f"{margs.original_seq_len} >= seq {seq}); transformers' DeepSeek-V3 rotates the same pairs "
             "(rope_interleave) -> same attention scores"] + notes + [
        "router: torchtitan 0.2 computes the gate in bf16 under autocast, the scores (sigmoid/softmax) in fp32",
        f"RMSNorm eps {hf.rms_norm_eps:g}: norm_eps on the block and MLA norms; the final norm (built with eps None, "
        "the dtype's) set after the build",
        "differs: precision: torchtitan 0.2 on one GPU has no FSDP: fp32 parameters, gradients and AdamW, bf16 "
        "autocast for compute (routed experts' grouped GEMMs cast to bf16); ours trains bf16 parameters with fp32 "
        "optimizer master weights (DeepSpeed bf16)",
        attention_note(attn_backend, "one causal block mask"),
    ]
    return margs, notes


def build_titan_model(mcfg, v02: bool):
    """The torchtitan model of mcfg, on the current default device."""
    if not v02:
        return mcfg.build()
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    model = DeepSeekV3Model(mcfg)
    model.norm.eps = mcfg.norm_eps  # 0.2 builds the final RMSNorm without its eps (None: the dtype's epsilon)
    return model


def _walk(obj, seen=None):
    """Every dataclass instance reachable from obj (configs nest in fields, lists and dicts)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield obj
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name, None), seen)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _walk(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _walk(x, seen)


TITAN_NAMES = ((".experts.", "inner_experts"), "tok_embeddings")  # torchtitan (0.2, 0.3): routed experts, embedding
HF_NAMES = ((".experts.",), "embed_tokens")  # transformers'


def count(model, hf, seq_len: int, names) -> dict:
    """bench.py's count (model_flops_per_token) by parameter name: names = (routed-expert substrings, the embedding's
    substring), TITAN_NAMES or HF_NAMES."""
    experts, embedding = names
    total = active = embed = 0
    E, k = hf.n_routed_experts, hf.num_experts_per_tok
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if any(e in name for e in experts):
            active += n * k / E
        elif embedding in name:
            embed += n
        else:
            active += n
    heads = hf.num_attention_heads
    qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    attn = 3 * hf.num_hidden_layers * 2 * seq_len * heads * (qk + hf.v_head_dim)
    return {"total": int(total), "active_non_embedding": int(round(active)), "embedding": int(embed),
            "attention_flops_per_token": attn, "flops_per_token": 6 * active + attn}


def hf_meta_counts(recipe, tok, seq_len):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model import make_hf_config

    hf = make_hf_config(recipe.model, tok)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return hf, count(model, hf, seq_len, HF_NAMES)


def use_device(device_type: str, v02: bool) -> None:
    """A CPU smoke test: torchtitan assumes "cuda" when it finds no accelerator; point every torchtitan module imported
    so far at the CPU, and replace FlexAttention's kernel (no backward on the CPU) by causal sdpa."""
    import torch
    from torchtitan.tools import utils as tt_utils

    if device_type == tt_utils.device_type:
        return
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("torchtitan") and getattr(mod, "device_type", None) == "cuda":
            mod.device_type, mod.device_module = device_type, getattr(torch, device_type)
    if v02:
        import torchtitan.models.moe.moe as tt_moe
        from torchtitan.models.attention import FlexAttentionWrapper as Flex

        class _Torch(types.ModuleType):  # 0.2's router counts tokens per expert with histc on int64: CUDA only
            def __getattr__(self, name):
                return getattr(torch, name)
        tt_moe.torch = _Torch("torch")
        tt_moe.torch.histc = lambda x, *a, **kw: torch.histc(x.float(), *a, **kw).to(x.dtype)
        print("CPU smoke test: torchtitan 0.2's MoE histc on int64 has no CPU kernel; counted in float32 here",
              flush=True)
    else:
        from torchtitan.models.common.attention import FlexAttention as Flex

    def causal_sdpa(q, k, v, *, scale, score_mod=None, **kw):
        assert score_mod is None and not kw.get("return_lse") and not getattr(kw.get("return_aux"), "lse", False)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out if v02 else (out, None)
    Flex._compiled_flex_attn = staticmethod(causal_sdpa)
    print("CPU smoke test: FlexAttention has no backward on the CPU; its kernel is replaced by causal sdpa "
          "(the block mask is still built)", flush=True)


def setup_titan030(args, recipe, hf, tok, mcfg, device_type, G, micro, total_steps):
    """torchtitan 0.3's Trainer.__init__, the parts that matter on one GPU (no tokenizer/dataloader/checkpointer/
    metrics). Returns the trainer, its model and the settings to report."""
    import inspect

    import torch
    import torchtitan.models.common.decoder as tt_decoder
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook
    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.tools import utils as tt_utils
    from torchtitan.trainer import Trainer

    known = set(inspect.signature(create_block_mask).parameters)
    if "separate_full_blocks" not in known:  # an older torch: drop the block-mask options it lacks (defaults there)
        make_mask = tt_decoder.create_attention_mask

        def create_attention_mask(*a, **kw):
            return make_mask(*a, **{k: v for k, v in kw.items() if k in known})
        tt_decoder.create_attention_mask = create_attention_mask
        print("compat: this torch's create_block_mask has no separate_full_blocks; torchtitan's value dropped",
              flush=True)
    use_device(device_type, v02=False)
    spmd_backend = args.spmd_backend
    if spmd_backend == "auto":
        major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        spmd_backend = "spmd_types" if major_minor >= (2, 12) else "partial_dtensor"
    seq = recipe.data.seq_len
    config = Trainer.Config(
        model_spec=ModelSpec(name="deepseek_v3", flavor=Path(args.config).stem, model=mcfg,
                             parallelize_fn=parallelize_deepseekv3, pipelining_fn=pipeline_llm,
                             post_optimizer_build_fn=register_moe_load_balancing_hook, state_dict_adapter=None),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=hf.vocab_size)),
        optimizer=default_adamw(lr=recipe.train.lr),
        training=TrainingConfig(local_batch_size=micro, global_batch_size=G, seq_len=seq, steps=total_steps,
                                max_norm=1.0, disable_cuda_graphs=not args.cuda_graphs),
        parallelism=ParallelismConfig(fsdp_reshard_after_forward=args.reshard, spmd_backend=spmd_backend),
        compile=CompileConfig(enable=bool(args.compile), components=["model", "loss"]),
        activation_checkpoint={"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[args.ac],
        debug=DebugConfig(seed=recipe.train.seed),
        dump_folder="/tmp/torchtitan_pair")

    trainer = object.__new__(Trainer)
    trainer.config = config
    device = tt_utils.get_local_device() if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        tt_utils.device_module.set_device(device)
    trainer.device = device
    world = dist_utils.init_distributed(config.comm, base_folder=config.dump_folder)
    trainer.parallel_dims = pd = ParallelDims.from_config(config.parallelism, world)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    dist_utils.set_determinism(pd, device, config.debug, distinct_seed_mesh_dims=["pp"])
    mcfg.update_from_config(config=config)
    trainer.model_config = mcfg
    with torch.device("meta"), tt_utils.set_default_dtype(torch.float32):
        model = build_titan_model(mcfg, v02=False)
    model.verify_module_protocol()
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    trainer.gradient_accumulation_steps, trainer.num_pipeline_parallel_microbatches = G // micro, 1
    model = parallelize_deepseekv3(model, parallel_dims=pd, training=config.training,
                                   parallelism=config.parallelism, compile_config=config.compile,
                                   ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    model.to_empty(device=device_type)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    trainer.model_parts = [model]
    trainer.loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    register_moe_load_balancing_hook(trainer.optimizers, trainer.model_parts, pd)
    trainer.step, trainer.ntokens_seen = 0, 0
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=pd, spmd_typechecking=False)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    if not config.training.disable_cuda_graphs:
        trainer.fwd_bwd_fn = wrap_with_cuda_graph(trainer.fwd_bwd_fn)
    return trainer, model, {"reshard": args.reshard, "spmd_backend": spmd_backend,
                            "precision": "FSDP2: bf16 compute, fp32 master weights and reduction",
                            "loss": "ChunkedLossWrapper"}


def setup_titan022(args, recipe, hf, tok, mcfg, device_type, G, micro, total_steps):
    """torchtitan 0.2's Trainer.__init__, the parts that matter on one GPU (no dataloader/checkpointer/metrics/LR
    scheduler), from a JobConfig of the same settings. Returns the trainer, its model and the settings to report."""
    import torch
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.config.job_config import (
        ActivationCheckpoint, Compile, Debug, Job, JobConfig, Optimizer, Training)
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
    from torchtitan.tools import utils as tt_utils
    from torchtitan.train import Trainer

    use_device(device_type, v02=True)
    job = JobConfig(
        job=Job(dump_folder="/tmp/torchtitan_pair"),
        optimizer=Optimizer(lr=recipe.train.lr),  # its defaults: AdamW, fused, betas 0.9/0.95, eps 1e-8, wd 0.1
        training=Training(local_batch_size=micro, global_batch_size=G, seq_len=recipe.data.seq_len,
                          steps=total_steps, max_norm=1.0),  # mixed_precision_param bfloat16 (its default)
        compile=Compile(enable=bool(args.compile), components=["model", "loss"]),
        activation_checkpoint=ActivationCheckpoint(mode=args.ac, selective_ac_option="op"),  # per-op SAC, as 0.3's
        debug=Debug(seed=recipe.train.seed))
    trainer = object.__new__(Trainer)
    trainer.job_config = job
    device = torch.device(f"{device_type}:0") if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        tt_utils.device_module.set_device(device)
    trainer.device = device
    trainer.parallel_dims = pd = trainer.init_distributed()  # world 1: no FSDP, no DP mesh
    dist_utils.set_determinism(pd, device, job.debug, distinct_seed_mesh_dims=["pp"])
    mcfg.update_from_config(job)  # max_seq_len = seq; grouped GEMM only on SM90+
    trainer.model_args = mcfg
    with torch.device("meta"), tt_utils.set_default_dtype(torch.float32):
        model = build_titan_model(mcfg, v02=True)
    trainer.loss_fn = build_cross_entropy_loss(job)
    trainer.gradient_accumulation_steps = G // micro
    model = parallelize_deepseekv3(model, pd, job)
    model.to_empty(device=device_type)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    trainer.model_parts = [model]
    trainer.optimizers = build_optimizers_with_moe_load_balancing(trainer.model_parts, job.optimizer, pd)
    trainer.tokenizer = tok  # post_dataloading_process asserts one for FlexAttention; a causal mask does not read it
    trainer.train_context = dist_utils.get_train_context(False)
    trainer.maybe_enable_amp = dist_utils.maybe_enable_amp(pd, job.training.mixed_precision_param, device_type)
    trainer.step, trainer.ntokens_seen = 0, 0
    fsdp = pd.fsdp_enabled
    return trainer, model, {
        "reshard": args.reshard if fsdp else "none (no FSDP)", "spmd_backend": None,
        "precision": ("FSDP2" if fsdp else "autocast") + " bf16 compute, fp32 parameters and AdamW"
                     + ("" if fsdp else f" (grouped GEMM {'on' if mcfg.moe_args.use_grouped_mm else 'off'})"),
        "loss": "cross_entropy_loss (full logits)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "engine/recipes/deepseek_2b6.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (YAML value)")
    ap.add_argument("--global_batch", type=int, default=64, help="sequences per optimizer step (the engine's "
                    "micro x accum; zero2.json/zero3.json 'auto' picks 16 x 4 on an H200)")
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--losses", type=int, default=0, metavar="N",
                    help="loss mode: N steps from step 0 (no warmup), every step's loss in the row")
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--ac", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--cuda_graphs", type=int, default=1, help="torchtitan 0.3's default (training.disable_cuda_graphs "
                    "False): capture forward+backward once, replay it. torchtitan 0.2 has none: ignored")
    ap.add_argument("--attn", default="flex", help="torchtitan attention backend: flex (DeepSeek-V3 configs' "
                    "default), flex_flash, varlen (0.3); flex, sdpa (0.2)")
    ap.add_argument("--reshard", choices=["default", "always", "never"], default="default",
                    help="parallelism.fsdp_reshard_after_forward (default: torchtitan's; 'never' keeps the bf16 "
                    "copies of the weights from forward to backward on the one GPU). 0.2 has no FSDP on one GPU")
    ap.add_argument("--spmd_backend", choices=["auto", "spmd_types", "partial_dtensor"], default="auto",
                    help="torchtitan 0.3's parallelism.spmd_backend; auto: its default spmd_types on torch >= 2.12, "
                    "partial_dtensor (DTensor for model-parallel axes only, none here) on an older torch")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="then N more steps under torch.profiler: "
                    "bin/bench.py's tables and time shares, written to OUT.profile.txt")
    ap.add_argument("--check", action="store_true", help="build both models on the meta device, compare counts")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu (tiny smoke tests)")
    ap.add_argument("--out", default="titan.jsonl")
    ap.add_argument("--label", default="torchtitan")
    args = ap.parse_args()

    v02 = titan_version() < (0, 3)  # which API to drive: 0.2 (JobConfig, ModelArgs) or 0.3 (Trainer.Config)
    stubs = stub_missing_optional_modules(v02)
    import torch
    import yaml

    from engine.config import load_recipe
    from engine.data import build_data, load_tokenizer, to_device
    from engine.flops import H100_SXM_BF16_TFLOPS as PEAK_TFLOPS
    from engine.parallel import lr_multiplier

    sets = {}
    for item in args.set:
        key, _, value = item.partition("=")
        sets[key] = yaml.safe_load(value)
    total_steps = args.losses or (args.warmup + args.steps + args.profile)
    recipe = load_recipe(args.config, {**sets, "train.max_steps": total_steps})
    seq = recipe.data.seq_len
    tok = load_tokenizer(recipe.data.tokenizer)
    hf, ours = hf_meta_counts(recipe, tok, seq)
    mcfg, notes = (titan022_model_args if v02 else titan_model_config)(hf, recipe, args.attn)

    import torchtitan
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    print(f"torch {torch.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')}"
          + (f"; stand-ins for absent {', '.join(stubs)}" if stubs else ""), flush=True)
    for n in notes:
        print("shape: " + n, flush=True)

    with torch.device("meta"):
        meta_model = build_titan_model(mcfg, v02)
    titan = count(meta_model, hf, seq, TITAN_NAMES)
    del meta_model
    print(f"params ours (HF, meta): total {ours['total']:,}, active non-embedding {ours['active_non_embedding']:,}, "
          f"embedding {ours['embedding']:,}", flush=True)
    print(f"params torchtitan:      total {titan['total']:,}, active non-embedding "
          f"{titan['active_non_embedding']:,}, embedding {titan['embedding']:,}", flush=True)
    same = all(ours[k] == titan[k] for k in ("total", "active_non_embedding", "embedding"))
    print(f"FLOPs per token (seq {seq}): {titan['flops_per_token'] / 1e9:.4f} G (torchtitan count), "
          f"{ours['flops_per_token'] / 1e9:.4f} G (ours); counts {'MATCH' if same else 'DIFFER'}", flush=True)
    if args.check:
        return 0 if same else 1

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": os.environ.get("MASTER_PORT", "29751")}.items():
        os.environ.setdefault(k, v)
    G, micro = args.global_batch, args.micro_batch
    if G % micro:
        raise SystemExit(f"--global_batch {G} is not a multiple of --micro_batch {micro}")
    accum = G // micro
    if v02 and args.cuda_graphs:
        print("torchtitan 0.2 has no CUDA graphs: --cuda_graphs 1 ignored", flush=True)
        args.cuda_graphs = 0
    t0 = time.perf_counter()
    trainer, model, settings = (setup_titan022 if v02 else setup_titan030)(
        args, recipe, hf, tok, mcfg, device_type, G, micro, total_steps)
    device = trainer.device
    mult = lr_multiplier(recipe.train)
    groups = [g for opt in trainer.optimizers.optimizers for g in opt.param_groups]
    print(f"built in {time.perf_counter() - t0:.1f}s on {device}: global batch {G} = micro {micro} x accum {accum}, "
          f"seq {seq}, compile {bool(args.compile)}, AC {args.ac}, CUDA graphs {bool(args.cuda_graphs)}, "
          f"attention {args.attn}, FSDP reshard {settings['reshard']}, spmd_backend {settings['spmd_backend']}, "
          f"precision {settings['precision']}, loss {settings['loss']}; optimizer "
          f"{type(trainer.optimizers.optimizers[0]).__name__} "
          f"{ {k: v for k, v in groups[0].items() if k in ('lr', 'betas', 'eps', 'weight_decay', 'fused')} } "
          f"({len(groups)} param group(s)); LR x{mult(0):.3g} at step 1, peak {recipe.train.lr:g}",
          flush=True)

    data = build_data(recipe.data, tok, 0, 1, recipe.data_seed())
    batches = data.micro_batches(micro, 0, 1)
    positions = torch.arange(seq, device=device).expand(micro, seq).contiguous()  # one document per row: causal

    def train_step(step: int) -> torch.Tensor:
        """Trainer.train_step on one GPU: zero_grad, every micro-batch through post_dataloading_process and the
        (0.3: graph-captured) forward+backward, the loss divided by the step's valid tokens; clip; optimizer; LR."""
        for g in groups:
            g["lr"] = recipe.train.lr * mult(step)
        trainer.optimizers.zero_grad(set_to_none=not args.cuda_graphs)
        gvt = torch.tensor(G * (seq - 1), dtype=torch.int64, device=device)
        total = None
        for _ in range(accum):
            _, ids = next(batches)
            ids = to_device(ids, device)
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[:, :-1] = ids[:, 1:]
            # 0.3 builds its block mask from per-row positions; 0.2's causal mask and RoPE need none
            inputs = {"input": ids} if v02 else {"input": ids, "positions": positions}
            loss = trainer.forward_backward_step(input_dict=inputs, labels=labels, global_valid_tokens=gvt)
            loss = loss.detach()
            total = loss.clone() if total is None else total.add_(loss)
        dist_utils.clip_grad_norm_([p for m in trainer.model_parts for p in m.parameters()], 1.0,
                                   foreach=True, pp_mesh=None, ep_enabled=False)
        trainer.optimizers.step()
        return total

    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    losses = []
    t_first = time.perf_counter()
    warm = 0 if args.losses else args.warmup
    for s in range(warm):
        losses.append(train_step(s))
    sync()
    warm_s = time.perf_counter() - t_first
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed = args.losses or args.steps
    t_start = time.perf_counter()
    for s in range(warm, warm + timed):
        losses.append(train_step(s))
        if args.losses and (s + 1) % 10 == 0:
            print(f"step {s + 1}: loss {losses[-1].item():.4f}", flush=True)
    sync()
    elapsed = time.perf_counter() - t_start
    tps = timed * G * seq / elapsed
    flops_tok = ours["flops_per_token"]  # the one formula, on our model's count (torchtitan's is printed beside it)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device_type == "cuda" else None
    if args.profile:  # bin/bench.py's profile: the same tables and shares for both systems
        spec = importlib.util.spec_from_file_location("engine_bench", ROOT / "bin" / "bench.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        extra = iter(range(warm + timed, warm + timed + args.profile))
        bench.profile(lambda: train_step(next(extra)), args.profile, device_type, f"{args.out}.profile.txt", 0)
    bias_name = "expert_bias" if v02 else "expert_bias_E"
    biases = [getattr(m, bias_name) for m in model.modules() if getattr(m, bias_name, None) is not None]
    bias_absmax = max((float(b.abs().max()) for b in biases), default=None)  # > 0: the balancing hook ran
    row = {"label": args.label, "system": "torchtitan", "recipe": Path(args.config).name, "ds_config": "-",
           "world": 1, "micro": micro, "accum": accum, "seq": seq, "vocab": hf.vocab_size, "device": str(device),
           "params_m": round(titan["total"] / 1e6, 3), "active_m": round(titan["active_non_embedding"] / 1e6, 3),
           "counts_match_ours": same, "flops_per_token": flops_tok,
           "tokens_per_s_per_gpu": round(tps), "mfu": float(f"{tps * flops_tok / (PEAK_TFLOPS * 1e12):.4g}"),
           "step_s": round(elapsed / timed, 3), "warmup_s": round(warm_s, 1),
           "peak_gib": round(peak, 2) if peak is not None else None, "loss": round(losses[-1].item(), 4),
           "losses": [round(float(x), 4) for x in losses], "compile": bool(args.compile), "ac": args.ac,
           "cuda_graphs": bool(args.cuda_graphs), "attn": args.attn, "reshard": settings["reshard"],
           "spmd_backend": settings["spmd_backend"], "precision": settings["precision"], "loss_fn": settings["loss"],
           "expert_bias_absmax": bias_absmax, "steps": timed, "warmup": warm,
           "torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", "?"), "sets": args.set,
           "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""torchtitan's DeepSeek-V3 trained with a model config derived from one of our recipes, on our data, timed as bin/bench.py.

    python3 docs/bench/torchtitan_pair.py --config engine/recipes/deepseek_2b6.yaml --global_batch 64 \
        --micro_batch 16 --steps 20 --warmup 5 --out titan.jsonl --label titan     (one GPU; see torchtitan_pair.sh)
    python3 docs/bench/torchtitan_pair.py --config engine/recipes/deepseek_2b6.yaml --check    (CPU: counts only)

The model: torchtitan 0.3's own `build_mla_moe_layers` / `DeepSeekV3Model.Config` (DeepSeek-V3 inits), every size
taken from engine.model.make_hf_config(recipe.model) (hidden, layers, heads, MLA ranks and head dims, dense and expert
widths, routed/shared experts, top-k, first dense layers, vocabulary, RoPE theta, RMSNorm eps); the routing as
DeepSeek-V3 with n_group = 1 (sigmoid scores, bias only for the choice, top-k weights renormalized, scale
routed_scaling_factor); aux-loss-free balancing at train.balance_rate. What cannot match is printed ("differs:").
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

torchtitan 0.3.0 pins a torch nightly newer than the GPU image's 2.11. On an older torch this driver installs
stand-ins, each printed: torch.distributed.fsdp.DataParallelMeshDims (torch 2.12; imported at module level, used only
on multi-GPU / full_dtensor paths), spmd_backend partial_dtensor instead of spmd_types (--spmd_backend auto), and
create_block_mask options the older torch lacks are dropped. Absent triton / tensorboard get stand-ins too. With
--device cpu, a smoke test of a small --set model, FlexAttention (no backward on the CPU) is replaced by causal sdpa.
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
PEAK_TFLOPS = 989.0


def stub_missing_optional_modules() -> list[str]:
    """torchtitan imports two things at module level that a CPU box or a lean GPU image may lack and this driver never
    uses: triton (only for the minimal_async_ep EP kernels) and tensorboard (only for the Trainer's metrics logger).
    Where they are missing, stand-ins let the imports pass; on the GPU image triton is real."""
    done = []
    if importlib.util.find_spec("triton") is None:
        class _Absent(types.ModuleType):
            def __getattr__(self, name):
                return None
        sys.modules["torchtitan.distributed.minimal_async_ep.kernels"] = _Absent("kernels (triton absent)")
        done.append("triton (minimal_async_ep kernels)")
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):  # torch < 2.12: imported at module level, used only by the
        @dataclasses.dataclass                      # full_dtensor / multi-GPU spmd_types paths, not taken here
        class DataParallelMeshDims:
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


def titan_model_config(hf, recipe, attn_backend: str):
    """torchtitan's DeepSeekV3Model.Config for our HF config `hf` (make_hf_config of the recipe), and the notes on
    what differs."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT, _NORM_INIT, _output_linear_init, _build_dsv3_layers)
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
    from torchtitan.models.common.moe import MoE

    notes = []
    arch = hf.model_type
    if arch not in ("deepseek_v3", "deepseek_v2"):
        raise SystemExit(f"recipe arch {arch}: this driver maps deepseek_v3 / deepseek_v2 recipes only")
    rp = getattr(hf, "rope_parameters", None) or {}
    if rp.get("rope_type", "default") != "default":
        raise SystemExit(f"RoPE {rp}: only the default (unscaled) RoPE is mapped")
    theta = rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    n_group = getattr(hf, "n_group", 1) or 1
    if arch == "deepseek_v3":
        score, route_norm = "sigmoid", bool(hf.norm_topk_prob)
        groups = (None, None) if n_group == 1 else (n_group, hf.topk_group)
    else:
        score, route_norm, groups = "softmax", False, (None, None)
        notes.append("router: deepseek_v2 greedy softmax top-k without renormalization -> torchtitan softmax, "
                     "route_norm off")
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
    if getattr(hf, "tie_word_embeddings", False):
        raise SystemExit("tied embeddings: not mapped")
    notes += [
        f"RoPE: ComplexRoPE (interleaved pairs) theta {theta:g}, no scaling; transformers' DeepSeek-V3 rotates "
        "the same pairs (rope_interleave) -> same attention scores",
        f"MLA: q_lora_rank {hf.q_lora_rank}, kv_lora_rank {hf.kv_lora_rank}, qk {hf.qk_nope_head_dim}+"
        f"{hf.qk_rope_head_dim}, v {hf.v_head_dim}; softmax scale qk_head_dim^-0.5 in both (no YaRN mscale); "
        "same projections and norms (q_a/q_b, kv_a with the shared rope key, kv_b, o)",
        f"router: {score}, bias only for the top-{hf.num_experts_per_tok} choice, renormalized={route_norm}, "
        f"scale {getattr(hf, 'routed_scaling_factor', 1.0)}, groups {groups[0] or 'none'} (ours: n_group "
        f"{n_group}); torchtitan computes the router in fp32 under autocast",
        f"shared experts: one SwiGLU of width {hf.n_shared_experts} x {hf.moe_intermediate_size} in both",
        f"balancing: both bias += rate x sign(mean load - load) once per optimizer step at rate {rate:g}; "
        "differs: torchtitan subtracts the mean of the update (biases stay centred) and updates in an "
        "optimizer pre-step hook from the counts of that step's micro-batches",
        "differs: no auxiliary/sequence balance loss in either (DeepSeek-V3's seq-aux loss absent in both)",
        f"RMSNorm eps {eps:g} set on all {n_norms} torchtitan norms (its default is 1e-5)",
        "differs: initialization is each system's own (torchtitan: embedding N(0,1), trunc-normal 0.02 with "
        "depth-scaled output projections, lm_head std dim^-0.5; ours: transformers' normal(0, 0.02))",
        "differs: precision: torchtitan keeps fp32 parameters, FSDP2 casts to bf16 for compute and reduces "
        "gradients in fp32; ours trains bf16 parameters with fp32 optimizer master weights (DeepSpeed bf16)",
        f"differs: attention kernel: torchtitan FlexAttention ({attn_backend}; compiled, max-autotune) with a "
        "causal block mask per row; ours sdpa causal. Same masking (no document masking in either)",
    ]
    return cfg, notes


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


TITAN_NAMES = ((".experts.", "inner_experts"), "tok_embeddings")  # torchtitan: GroupedExperts' w1/w2/w3, its embedding
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
    ap.add_argument("--cuda_graphs", type=int, default=1, help="torchtitan's default (training.disable_cuda_graphs "
                    "False): capture forward+backward once, replay it")
    ap.add_argument("--attn", default="flex", help="torchtitan attention backend: flex (DeepSeek-V3 configs' "
                    "default), flex_flash, varlen")
    ap.add_argument("--reshard", choices=["default", "always", "never"], default="default",
                    help="parallelism.fsdp_reshard_after_forward (default: torchtitan's; 'never' keeps the bf16 "
                    "copies of the weights from forward to backward on the one GPU)")
    ap.add_argument("--spmd_backend", choices=["auto", "spmd_types", "partial_dtensor"], default="auto",
                    help="parallelism.spmd_backend; auto: torchtitan's default spmd_types on torch >= 2.12, "
                    "partial_dtensor (DTensor for model-parallel axes only, none here) on an older torch")
    ap.add_argument("--check", action="store_true", help="build both models on the meta device, compare counts")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu (tiny smoke tests)")
    ap.add_argument("--out", default="titan.jsonl")
    ap.add_argument("--label", default="torchtitan")
    args = ap.parse_args()

    stubs = stub_missing_optional_modules()
    import torch
    import yaml

    from engine.config import load_recipe
    from engine.data import build_data, load_tokenizer, to_device
    from engine.parallel import lr_multiplier

    sets = {}
    for item in args.set:
        key, _, value = item.partition("=")
        sets[key] = yaml.safe_load(value)
    total_steps = args.losses or (args.warmup + args.steps)
    recipe = load_recipe(args.config, {**sets, "train.max_steps": total_steps})
    seq = recipe.data.seq_len
    tok = load_tokenizer(recipe.data.tokenizer)
    hf, ours = hf_meta_counts(recipe, tok, seq)
    mcfg, notes = titan_model_config(hf, recipe, args.attn)

    import torchtitan
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    print(f"torch {torch.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')}"
          + (f"; stand-ins for absent {', '.join(stubs)}" if stubs else ""), flush=True)
    for n in notes:
        print("shape: " + n, flush=True)

    with torch.device("meta"):
        meta_model = mcfg.build()
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

    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss, IGNORE_INDEX
    from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook
    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.tools import utils as tt_utils
    from torchtitan.trainer import Trainer
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    import inspect
    import torchtitan.models.common.decoder as tt_decoder
    from torch.nn.attention.flex_attention import create_block_mask

    known = set(inspect.signature(create_block_mask).parameters)
    if "separate_full_blocks" not in known:  # an older torch: drop the block-mask options it lacks (defaults there)
        make_mask = tt_decoder.create_attention_mask

        def create_attention_mask(*a, **kw):
            return make_mask(*a, **{k: v for k, v in kw.items() if k in known})
        tt_decoder.create_attention_mask = create_attention_mask
        print("compat: this torch's create_block_mask has no separate_full_blocks; torchtitan's value dropped",
              flush=True)

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != tt_utils.device_type:  # a CPU smoke test: torchtitan assumes "cuda" when it finds no device
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("torchtitan") and getattr(mod, "device_type", None) == "cuda":
                mod.device_type, mod.device_module = device_type, getattr(torch, device_type)
        from torchtitan.models.common.attention import FlexAttention

        def causal_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
            assert score_mod is None and not return_aux.lse
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), None
        FlexAttention._compiled_flex_attn = staticmethod(causal_sdpa)
        print("CPU smoke test: FlexAttention has no backward on the CPU; its kernel is replaced by causal sdpa "
              "(the block mask is still built)", flush=True)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": os.environ.get("MASTER_PORT", "29751")}.items():
        os.environ.setdefault(k, v)
    spmd_backend = args.spmd_backend
    if spmd_backend == "auto":
        major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        spmd_backend = "spmd_types" if major_minor >= (2, 12) else "partial_dtensor"
    G, micro = args.global_batch, args.micro_batch
    if G % micro:
        raise SystemExit(f"--global_batch {G} is not a multiple of --micro_batch {micro}")
    accum = G // micro
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

    # torchtitan's Trainer.__init__, the parts that matter on one GPU (no tokenizer/dataloader/checkpointer/metrics)
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
        model = mcfg.build()
    model.verify_module_protocol()
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    trainer.gradient_accumulation_steps, trainer.num_pipeline_parallel_microbatches = accum, 1
    t0 = time.perf_counter()
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
    mult = lr_multiplier(recipe.train)
    groups = [g for opt in trainer.optimizers.optimizers for g in opt.param_groups]
    print(f"built in {time.perf_counter() - t0:.1f}s on {device}: global batch {G} = micro {micro} x accum {accum}, "
          f"seq {seq}, compile {bool(args.compile)}, AC {args.ac}, CUDA graphs {bool(args.cuda_graphs)}, "
          f"attention {args.attn}, FSDP reshard {args.reshard}, spmd_backend {spmd_backend}; optimizer {type(trainer.optimizers.optimizers[0]).__name__} "
          f"{ {k: v for k, v in groups[0].items() if k in ('lr', 'betas', 'eps', 'weight_decay', 'fused')} } "
          f"({len(groups)} param group(s)); LR x{mult(0):.3g} at step 1, peak {recipe.train.lr:g}",
          flush=True)

    data = build_data(recipe.data, tok, 0, 1, recipe.train.seed)
    batches = data.micro_batches(micro, 0, 1)
    positions = torch.arange(seq, device=device).expand(micro, seq).contiguous()  # one document per row: causal

    def train_step(step: int) -> torch.Tensor:
        """Trainer.train_step on one GPU: zero_grad, every micro-batch through post_dataloading_process and the
        (graph-captured) forward+backward, the loss divided by the step's valid tokens; clip; optimizer; LR."""
        for g in groups:
            g["lr"] = recipe.train.lr * mult(step)
        trainer.optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
        gvt = torch.tensor(G * (seq - 1), dtype=torch.int64, device=device)
        total = None
        for _ in range(accum):
            _, ids = next(batches)
            ids = to_device(ids, device)
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[:, :-1] = ids[:, 1:]
            loss = trainer.forward_backward_step(input_dict={"input": ids, "positions": positions}, labels=labels,
                                                 global_valid_tokens=gvt)
            loss = loss.detach()
            total = loss.clone() if total is None else total.add_(loss)
        dist_utils.clip_grad_norm_([p for m in trainer.model_parts for p in m.parameters()], config.training.max_norm,
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
    biases = [m.expert_bias_E for m in model.modules() if getattr(m, "expert_bias_E", None) is not None]
    bias_absmax = max((float(b.abs().max()) for b in biases), default=None)  # > 0: the balancing hook ran
    row = {"label": args.label, "system": "torchtitan", "recipe": Path(args.config).name, "ds_config": "-",
           "world": 1, "micro": micro, "accum": accum, "seq": seq, "vocab": hf.vocab_size, "device": str(device),
           "params_m": round(titan["total"] / 1e6, 3), "active_m": round(titan["active_non_embedding"] / 1e6, 3),
           "counts_match_ours": same, "flops_per_token": flops_tok,
           "tokens_per_s_per_gpu": round(tps), "mfu": float(f"{tps * flops_tok / (PEAK_TFLOPS * 1e12):.4g}"),
           "step_s": round(elapsed / timed, 3), "warmup_s": round(warm_s, 1),
           "peak_gib": round(peak, 2) if peak is not None else None, "loss": round(losses[-1].item(), 4),
           "losses": [round(float(x), 4) for x in losses], "compile": bool(args.compile), "ac": args.ac,
           "cuda_graphs": bool(args.cuda_graphs), "attn": args.attn, "reshard": args.reshard, "spmd_backend": spmd_backend,
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

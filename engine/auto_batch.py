"""'auto' micro-batch and gradient accumulation, resolved before deepspeed.initialize (DeepSpeed never sees "auto").

    train_micro_batch_size_per_gpu: "auto"  -> the largest of 32, 16, 8, 4, 2, 1 whose predicted peak memory fits
                                               USABLE_FRACTION of the device's memory less MARGIN_GIB (CPU: 8)
    gradient_accumulation_steps: "auto"     -> train.tokens_per_step_per_gpu / (micro x data.seq_len), rounded half
                                               up, at least 1 (default target: 64 sequences on an accelerator;
                                               on the CPU 1 step, as the files shipped before "auto")
train.activation_checkpointing "auto" is decided with the micro-batch (AutoBatch.pick_micro: the micro-batch is
fitted with and without it; see CKPT_BELOW_TOKENS and PRETRAIN_CKPT_BELOW_TOKENS). A number written in the file is
kept as written. On --resume the checkpoint's recorded values win over a fresh
"auto" (exact resume depends on them); a number written in the file still wins over both.

The memory model is analytic, calibrated on peaks measured on one H200 (`max_memory_allocated`, docs/bench/*.jsonl):

    peak = states + fixed(stage) + micro x per_sample + head
    head       = the output layer's loss: one chunk of logits + the output weight's gradient buffers (engine/head.py)
    states     = bytes per parameter of weights, gradients and optimizer state, per ZeRO stage and data-parallel
                 size (dtype-aware: bf16/fp16/fp32 weights, bf16 master weights and Adam moments, optimizer offload)
    per_sample = seq_len x hidden x layers x A                 without activation checkpointing
                 seq_len x hidden x (layers x CKPT + A)        with it (each layer keeps its input; one layer at a
                                                               time is recomputed in full)
    A          = ACT[family] x max(1, MoE width / calibrated) + (EP_EXTRA_PER_K x top-k if autoep_size > 1)
    + per Gated DeltaNet layer (Qwen3.5-MoE's linear attention), seq_len x (GDN_BYTES_PER_VALUE x value width -
      CALIBRATED_ATTN_BYTES x hidden): what it keeps beyond the attention of the calibration rows (with activation
      checkpointing once: one layer is recomputed at a time)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from .config import ModelConfig, Recipe

GIB = 2**30
CANDIDATES = (32, 16, 8, 4, 2, 1)  # powers of 2, capped at 32: the largest that fits is taken
USABLE_FRACTION = 0.90  # of the device memory (x --memory_fraction): the allocator's cache and fragmentation
MARGIN_GIB = 1.0  # on top of that: the CUDA context and what the model does not count
CPU_MICRO, CPU_ACCUM = 8, 1  # the CPU: small and fixed, as zero3.json shipped (the tiny default stays quick)
GRPO_CPU_MICRO = 16  # GRPO on the CPU: its rows are short (prompt + completion), so 16 rows of them (the demo: 16 x 4)
# GRPO's train.activation_checkpointing "auto" (GRPOAutoBatch): on where, without it, a micro-batch would hold fewer
# than CKPT_BELOW_TOKENS tokens and with it at least CKPT_ROWS_GAIN times the rows. Measured on one H100 80GB with
# grpo_2b6 (rows of 272 tokens: 8 -> 64 rows under zero3_grpo.json, 4 -> 32 under zero2_grpo.json; the step times are
# in docs/benchmarks.md, "H100, 2026-12-05 (evening)"); an H200 fits all 64 rows without it, where it would only add
# the recompute. The thresholds lie between those points: a judgment, not a sweep.
CKPT_BELOW_TOKENS = 4096
CKPT_ROWS_GAIN = 4
# Pretraining's "auto" (AutoBatch): under ZeRO-3 (not pipeline stages) on where, without it, a micro-batch would hold
# fewer than PRETRAIN_CKPT_BELOW_TOKENS tokens and with it at least CKPT_ROWS_GAIN times the rows; under any stage
# where nothing fits without it. Measured on one H100 80GB, deepseek_2b6 at 129,280, seq 2048 (docs/benchmarks.md,
# "H100, 2026-12-06 (second)"): zero3.json 4 x 16 without it 44.6k tokens/s, 32 x 2 with it 52.2k (1.17x: ZeRO-3
# pays its gathers once per micro-batch); zero2.json 4 x 16 56.6k against 32 x 2 55.2k (0.976x), so ZeRO-1/2 keep it
# off. An H200 fits 16 rows of 2048 without it (32k tokens), where it is not measured: off.
PRETRAIN_CKPT_BELOW_TOKENS = 16384
SEQUENCES_PER_STEP = 64  # default accumulation target on accelerators: 64 x seq_len tokens per step per GPU

# Calibration (one H200, seq_len 2048, deepseek_2b6: 2,590,255,104 parameters, hidden 2048, 12 layers; the rows are
# docs/bench/bench_<phase>.jsonl by label, each a `bin/bench.py` run; "m8x2" = micro 8, accumulation 2). The
# per-sample constants are bytes per (token x hidden x layer); a pair of rows at two micro-batches gives the slope,
# the rest is the fixed overhead beyond the 16 bytes/parameter of bf16 weights + bf16 gradients + fp32 master +
# fp32 Adam moments (38.60 GiB for deepseek_2b6).
ACT = {
    # AutoEP, compiled around the AutoEP blocks (ZeRO-1/2 on CUDA, train.compile auto): zero2.json as shipped,
    # F same_init_tuned_m8x8 66.21 GiB and D/I/L/M/N1 16 x 4 88.42 GiB: (88.42 - 66.21) / 8 = 2.776 GiB per sample.
    "autoep_compiled": 59.23,
    # AutoEP, eager (ZeRO-3: DeepSpeed cannot compile around AutoEP there; ZeRO-1/2 with compile off): zero3.json,
    # F z3_ep_m8x2 / G z3_ep_m8x2_fused 68.10 GiB and K z3_ep_m16x4 96.54 GiB: 3.555 GiB per sample. (ZeRO-2 eager,
    # A2 z2_ep_m8x2 71.56 and z2_ep_m16 94.3, gives 2.84 per sample: this constant over-predicts it, on the safe side.)
    "autoep_eager": 75.84,
    # No expert_parallel section (the HF MoE block, bench.py --no_autoep): A/G base_z3_plain_m8x2 71.6 GiB and
    # A2 base_z3_plain_m16 103.6 GiB: 4.0 GiB per sample.
    "plain_eager": 85.33,
}
# Fixed overhead beyond the states, GiB: ZeRO-3 from the same zero3.json rows (68.10 - 8 x 3.555 - 38.60 = 1.06; the
# plain rows give 1.0); ZeRO-1/2 from the zero2.json rows (66.21 - 8 x 2.776 - 38.60 = 5.40; with the eager constant
# this over-predicts A2's eager rows by 1.2 and 7.0 GiB). Stage 0 counts as 1/2.
FIXED_GIB = {3: 1.06, 2: 5.40, 1: 5.40, 0: 5.40}
# ZeRO-2 with one micro-batch per step (accumulation 1), the optimizer and its gradients on the device: DeepSpeed's
# ZeRO-2 keeps a running sum of the micro-batches' gradients (stage_1_and_2.py: all_grad_tensors) beside the next
# micro-batch's only with accumulation above 1, which the zero2.json rows above had (8 x 8, 16 x 4). Fitted on one
# H100 80GB (docs/bench/grpo_speed/h100_1206_e/): GRPO on grpo_2b6 under zero2_grpo.json with activation checkpointing,
# 64 x 1 peaked at 63.4 GiB and 32 x 2 at 65.9 (the model with 5.40: 71.3 and 69.5); 63.4 - 46.46 (states) - 11.84
# (reference and decoder) - 64 x 0.0586 (rows) = 1.35. ZeRO-1 is left at 5.40: it accumulates in the parameters'
# own gradients (counted in the states), yet measured 63.4 GiB at 32 x 2 (h100_1206_d/), over 1.35's prediction.
ZERO2_ONE_MICRO_FIXED_GIB = 1.35
# With activation checkpointing, bytes per (token x hidden x layer) kept between forward and backward, plus one
# layer's full ACT while it is recomputed: fitted on B seed_bf16_states (deepseek_5b3, 5,342,054,400 parameters,
# 24 layers, zero3.json with bf16 master weights and Adam moments = 10 bytes/parameter, micro 4: 53.16 GiB):
# (53.16 - 49.75 - 1.06) / 4 = 0.586 GiB per sample = 2048 x 2048 x (24 x 3.09 + 75.84). Check: B seed_offload_r05
# (half the fp32 optimizer on the CPU, micro 4) measured 56.19 GiB, predicted 53.2 (3 GiB under: inside the headroom).
CKPT = 3.09
# Expert parallelism (autoep_size > 1) adds the all-to-all's dispatch/combine buffers per token: from the only
# multi-GPU pair measured (2 x H200, zero3.json, deepseek_2b6 with EP 2, 2026-11-30: micro 8 49.7 GiB in
# docs/benchmarks.md, micro 16 "about 96 GiB" in DESIGN.md): 5.79 GiB per sample against 3.555 on one GPU, i.e.
# +47.7 bytes per (token x hidden x layer) at top-4 routing, scaled by experts_per_token / 4 (one buffer row per
# routed copy of a token). Early code and an approximate figure: it errs towards smaller batches.
EP_EXTRA_PER_K = 47.7 / 4
# The rows are all one layer shape: top-4 of 1024-wide experts + 2 shared, hidden 2048. The MoE block's activations per
# token, in hidden sizes: each of the k routed copies of a token (its dispatched input and its output: 2 x hidden)
# through its expert (gate, up and their product: 3 x expert width), and the shared experts (3 x their width):
# (4 x (2 x 2048 + 3 x 1024) + 2 x 3 x 1024) / 2048 = 17.0. A larger one scales ACT up by the ratio, as if every
# activation grew with it (the attention's do not: safe side); smaller ones are not scaled. (Many narrow experts
# at a large k, as Qwen3.5-MoE's top-8 of 512-wide, are larger here than their expert width alone says.) Checked
# against one H200 (docs/bench/families/, zero2.json at micro 8): Mixtral-8x7B's shape at 3 layers predicted 93.2 GiB,
# measured 92.0; DeepSeek-V2-Lite's at 8 layers 102.2, measured 97.4.
CALIBRATED_MOE_WIDTH = 17.0
# Gated DeltaNet through transformers' PyTorch path (no flash-linear-attention): bytes per (token x value width,
# linear_num_value_heads x linear_value_head_dim) per layer, fitted on one H200 row (docs/bench/families/: Qwen3.5-35B-
# A3B's shape at 4 layers, 3 of them Gated DeltaNet, zero2.json, micro 8: 124.1 GiB measured, 101.0 predicted with
# the 94 below). Of the 218, 89-94 are the tensors the layer keeps for backward (counted on the CPU with saved-tensor
# hooks, bf16, at value widths 2048 and 4096, hidden 1024 and 2048; torch.compile keeps fewer: 67); the other ~125 are
# not explained: no saved tensor of the model accounts for them (a CPU count of the whole model at this shape, both
# MoE paths, gives 2.4-2.6 GiB per sample against the 5.9 the GPU row implies), so they are some transient of the
# GPU run (the chunked recurrence's fp32 backward, the compiled graph's buffers) or a fixed cost one row cannot tell
# from a per-sample one. Put on the Gated DeltaNet layers and per sample: the side that gives smaller batches. The
# attention of the calibration rows (deepseek_2b6's MLA) keeps 36.1 per (token x hidden), inside ACT already. At 94
# (saved tensors only) this shape ran out of memory at micro 32 on one H200 (more than 137.7 GiB allocated).
GDN_BYTES_PER_VALUE = 218.0
CALIBRATED_ATTN_BYTES = 36.1


def param_counts(m: ModelConfig) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of the recipe's model, as transformers builds it (checked against a
    meta-device build for every shipped recipe in tests/test_auto_batch.py). Routing-bias buffers are not counted."""
    if m.arch not in ("deepseek_v3", "deepseek_v2", "qwen3_moe") or m.init_from:
        return _built_counts(m)
    h, L, E = m.hidden_size, m.num_layers, m.num_experts
    experts_per_layer = E * 3 * h * m.moe_intermediate_size
    if m.arch in ("deepseek_v3", "deepseek_v2"):  # the same MLA attention and expert layout
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (h * m.num_heads * qk if m.q_lora_rank is None
             else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * qk)
        attn = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
                + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) + m.num_heads * m.v_head_dim * h)
        dense_layers = m.first_dense_layers
        moe_rest = E * h + 3 * h * m.moe_intermediate_size * m.num_shared_experts  # router + shared experts
    else:  # qwen3_moe: GQA with q/k norms, every layer MoE, no shared expert
        hd = h // m.num_heads
        attn = h * m.num_heads * hd + 2 * h * m.num_kv_heads * hd + m.num_heads * hd * h + 2 * hd
        dense_layers = 0
        moe_rest = E * h
    moe_layers = L - dense_layers
    total = (2 * m.vocab_size * h + h + L * (attn + 2 * h) + dense_layers * 3 * h * m.intermediate_size
             + moe_layers * (moe_rest + experts_per_layer))
    return total, moe_layers * experts_per_layer


def _built_counts(m: ModelConfig) -> tuple[int, int]:
    """param_counts of a model built on the meta device (no memory): Mixtral, Qwen3.5-MoE (Gated DeltaNet layers) and a
    model.init_from directory's own config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model import make_hf_config

    cfg = AutoConfig.from_pretrained(m.init_from) if m.init_from else make_hf_config(m)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for n, p in model.named_parameters() if ".experts." in n))


def _bytes_per_param(cfg: dict) -> tuple[int, int, float]:
    """(weights, gradients, optimizer) bytes per parameter on the device, from the DS config's precision settings."""
    bf16, fp16 = cfg.get("bf16") or {}, cfg.get("fp16") or {}
    half = bool(bf16.get("enabled") or fp16.get("enabled"))
    weights = 2 if half else 4
    accum = str((cfg.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
    grads = 4 if accum in ("fp32", "float32", "float") else weights  # DeepSpeed under ZeRO: the model's dtype
    master = (2 if bf16.get("bf16_master_weights_and_grads") else 4) if half else 0  # fp32: the weights are master
    moments = 4 if bf16.get("bf16_optimizer_states") else 8  # Adam's two moments
    optimizer = master + moments
    off = _offload(cfg, "offload_optimizer")
    if off is not None:
        optimizer *= 1.0 - _ratio(off)  # the part left on the device
    return weights, grads, optimizer


def _ratio(off: dict) -> float:
    """offload_optimizer.ratio as a number (1, all offloaded, where it is not one: ds_config refuses it in one line)."""
    r = off.get("ratio", 1.0)
    return float(r) if isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 else 1.0


def _offload(cfg: dict, key: str) -> dict | None:
    """zero_optimization's `key` section ("offload_optimizer", "offload_param") where it offloads (a device set)."""
    section = (cfg.get("zero_optimization") or {}).get(key) or {}
    return section if section.get("device", "none") not in ("none", None) else None


def states_gib(cfg: dict, recipe: Recipe, dp: int) -> float:
    """Weights + gradients + optimizer state held by one rank, GiB. ZeRO-1 partitions the optimizer over the
    data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights; the routed experts are split over the
    expert-parallel ranks first (autoep_size), then partitioned over dp / autoep_size, i.e. 1/dp of them too."""
    total, experts = param_counts(recipe.model)
    ep = _ep(cfg)
    local = total - experts + experts / ep  # what a rank holds unpartitioned
    weights, grads, optimizer = _bytes_per_param(cfg)
    stage = _stage(cfg)
    if stage >= 3 and _offload(cfg, "offload_param") is not None:
        weights = 0
    w = weights * (total / dp if stage >= 3 else local)
    g = grads * (total / dp if stage >= 2 else local)
    o = optimizer * (total / dp if stage >= 1 else local)
    return (w + g + o) / GIB


def family(cfg: dict, recipe: Recipe, device: str) -> str:
    """Which calibration the run follows: AutoEP compiled, AutoEP eager, or the plain HF MoE block (eager)."""
    from .ds_config import compiles_layers, uses_expert_parallel

    if not uses_expert_parallel(cfg):
        return "plain_eager"
    return "autoep_compiled" if compiles_layers(recipe.train.compile, cfg, device) else "autoep_eager"


# The output layer (engine/head.py), which the rows above (vocabulary 512) barely see: the logits of one chunk of
# tokens at a time (at most head.CHUNK_ELEMENTS values: fp32 logits and their gradient in the model's dtype,
# HEAD_CHUNK_BYTES per value) plus the output weight's gradient (an fp32 accumulator, the GEMM's fp32 result beside
# it, and the gradient kept in the model's dtype until backward: HEAD_WEIGHT_BYTES per output weight, on top of the
# gradient the states count).
HEAD_CHUNK_BYTES = 6
HEAD_WEIGHT_BYTES = 10


CALIBRATED_VOCAB = 512  # the rows above: their output layer's memory is inside FIXED_GIB and ACT already


def head_gib(recipe: Recipe, micro: int) -> float:
    """Device memory of the chunked output layer's loss at micro-batch `micro` beyond what the calibration rows (a
    vocabulary of CALIBRATED_VOCAB) hold, GiB."""
    from .head import CHUNK_ELEMENTS

    m, tokens = recipe.model, micro * recipe.data.seq_len

    def head(vocab: int) -> float:
        return HEAD_CHUNK_BYTES * min(CHUNK_ELEMENTS, tokens * vocab) + HEAD_WEIGHT_BYTES * vocab * m.hidden_size

    return max(0.0, head(m.vocab_size) - head(CALIBRATED_VOCAB)) / GIB


def moe_width(m: ModelConfig) -> float:
    """The MoE block's activations per token in hidden sizes (see CALIBRATED_MOE_WIDTH)."""
    shared = m.num_shared_experts if m.arch in ("deepseek_v3", "deepseek_v2", "qwen3_5_moe") else 0
    h, w = m.hidden_size, m.moe_intermediate_size
    return (m.experts_per_token * (2 * h + 3 * w) + shared * 3 * w) / h


def linear_attention(m: ModelConfig) -> tuple[int, int]:
    """(Gated DeltaNet layers, their value width) of the model: (0, 0) for the families without linear attention."""
    if m.arch != "qwen3_5_moe":
        return 0, 0
    from transformers import AutoConfig

    from .model import make_hf_config

    cfg = AutoConfig.from_pretrained(m.init_from) if m.init_from else make_hf_config(m)
    n = sum(t == "linear_attention" for t in (getattr(cfg, "layer_types", None) or []))
    return n, (cfg.linear_num_value_heads * cfg.linear_value_head_dim if n else 0)


def per_sample_gib(cfg: dict, recipe: Recipe, device: str) -> float:
    m, seq = recipe.model, recipe.data.seq_len
    act = ACT[family(cfg, recipe, device)] * max(1.0, moe_width(m) / CALIBRATED_MOE_WIDTH)
    act += EP_EXTRA_PER_K * m.experts_per_token if _ep(cfg) > 1 else 0.0
    ckpt = recipe.train.activation_checkpointing is True  # "auto" is resolved before (GRPOAutoBatch); else off
    per_token_hidden = (m.num_layers * CKPT + act) if ckpt else m.num_layers * act
    gdn_layers, value_width = linear_attention(m)
    gdn = max(0.0, GDN_BYTES_PER_VALUE * value_width - CALIBRATED_ATTN_BYTES * m.hidden_size)  # bytes per token
    gdn *= min(gdn_layers, 1) if ckpt else gdn_layers
    return seq * (m.hidden_size * per_token_hidden + gdn) / GIB


def with_checkpointing(recipe: Recipe, on: bool) -> Recipe:
    """`recipe` with train.activation_checkpointing set to `on`."""
    from dataclasses import replace

    return replace(recipe, train=replace(recipe.train, activation_checkpointing=on))


def settle_checkpointing(recipe: Recipe, auto: "AutoBatch | None") -> Recipe:
    """`recipe` with a train.activation_checkpointing of "auto" replaced by what `auto` chose with the micro-batch
    (off where no "auto" batch was resolved: the DS file's numbers, or no AutoBatch); true or false kept."""
    if recipe.train.activation_checkpointing != "auto":
        return recipe
    return with_checkpointing(recipe, bool(auto is not None and auto.checkpointing))


def predict_peak_gib(cfg: dict, recipe: Recipe, dp: int, micro: int, device: str = "cuda",
                     accum: int | None = None) -> float:
    """Predicted peak device memory of one rank at micro-batch `micro` (cfg: the DS config, autoep_size resolved) and
    `accum` micro-batches per step (None: the DS config's number, and more than one where it says "auto")."""
    if accum is None:
        accum = cfg.get("gradient_accumulation_steps", 1)
    return (states_gib(cfg, recipe, dp) + fixed_gib(cfg, accum) + micro * per_sample_gib(cfg, recipe, device)
            + head_gib(recipe, micro))


def fixed_gib(cfg: dict, accum) -> float:
    """The fixed overhead beyond the states (FIXED_GIB), less under ZeRO-2 with one micro-batch per step on the device
    (ZERO2_ONE_MICRO_FIXED_GIB): `accum` 1 (an int; "auto" counts as more than one)."""
    stage = min(max(_stage(cfg), 0), 3)  # a stage out of range is ds_config's line
    weights, grads, _ = _bytes_per_param(cfg)
    fp32_buffer = grads > weights  # fp32 gradient accumulation of a half model: DeepSpeed's own partition buffer
    if (stage == 2 and accum == 1 and not isinstance(accum, bool) and _offload(cfg, "offload_optimizer") is None
            and not fp32_buffer):
        return ZERO2_ONE_MICRO_FIXED_GIB
    return FIXED_GIB[stage]


def _stage(cfg: dict) -> int:
    s = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if isinstance(s, float) and s.is_integer():  # "stage": 3.0 runs as ZeRO-3 in DeepSpeed
        s = int(s)
    return s if isinstance(s, int) and not isinstance(s, bool) else 0


def _ep(cfg: dict) -> int:
    from .ds_config import uses_expert_parallel

    size = (cfg.get("expert_parallel") or {}).get("autoep_size", 1)
    return size if uses_expert_parallel(cfg) and isinstance(size, int) and size >= 1 else 1


# DeepSpeed's CPU optimizer offload (offload_optimizer.device "cpu") keeps, per rank, its share of the model (1/dp
# under ZeRO, times offload_optimizer.ratio) as fp32 master weights, fp32 gradients and Adam's two fp32 moments in host
# memory (pinned with pin_memory): 16 bytes per parameter; offload_param "cpu" adds the weights in the model's dtype.
HOST_OPTIMIZER_BYTES = 16


def host_offload_gib(cfg: dict, recipe: Recipe, dp: int) -> float:
    """Host memory one rank's offloaded optimizer state (and offloaded parameters) take, GiB; 0 without offload."""
    zero = cfg.get("zero_optimization") or {}
    opt, par = zero.get("offload_optimizer") or {}, zero.get("offload_param") or {}
    on_cpu = [x.get("device") == "cpu" for x in (opt, par)]
    if not any(on_cpu):
        return 0.0
    total = param_counts(recipe.model)[0]
    b = HOST_OPTIMIZER_BYTES * _ratio(opt) * total / dp if on_cpu[0] else 0.0
    if on_cpu[1]:
        b += _bytes_per_param(cfg)[0] * total / dp
    return b / GIB


def host_available_gib() -> float | None:
    """This machine's available memory (MemAvailable of /proc/meminfo), GiB; None where it cannot be read."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


def host_memory_problem(cfg: dict, recipe: Recipe, dp: int, ranks_per_node: int) -> str | None:
    """One line when the ranks of this node would offload more than the node's available memory."""
    per_rank = host_offload_gib(cfg, recipe, dp)
    have = host_available_gib() if per_rank else None
    need = per_rank * ranks_per_node
    if have is None or need <= have:
        return None
    optimizer = _offload(cfg, "offload_optimizer") is not None
    what = ("fp32 master weights, gradients and Adam moments" if optimizer else "the weights") + (
        " and the weights" if optimizer and _offload(cfg, "offload_param") is not None else "")
    fix = "lower offload_optimizer.ratio, use more nodes, or zero2_bf16_states.json" if optimizer else (
        "use more nodes, or leave the parameters on the GPU (no offload_param)")
    return (f"zero_optimization offload: the {ranks_per_node} rank{'s' if ranks_per_node > 1 else ''} of this node "
            f"would keep {need:.1f} GiB in host memory ({per_rank:.1f} GiB each: {what} of its share of "
            f"{param_counts(recipe.model)[0] / 1e9:.2f}B parameters) but {have:.1f} GiB are available; {fix}")


def device_memory_gib(device: str, fraction: float | None = None) -> float | None:
    """This rank's device memory in GiB (x `fraction`: --memory_fraction, which the entry point also gives torch as
    the per-process cap once the device is set), None on the CPU. Asked before any rank sets its device, so it
    reads LOCAL_RANK."""
    if device == "cpu":
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    import torch

    if device in ("cuda", "rocm"):
        total = torch.cuda.get_device_properties(local).total_memory
    else:
        from deepspeed.accelerator import get_accelerator

        total = get_accelerator().total_memory(local)
    return total * (fraction if fraction else 1.0) / GIB


@dataclass
class AutoBatch:
    """What resolving "auto" batch sizes needs (entry points that support it pass one to resolve_ds_config), and,
    once resolved, what was chosen and why (`note`: one line, printed at start by rank 0)."""
    memory_gib: float | None = None
    """Device memory per rank in GiB, already times the memory fraction (device_memory_gib); None on the CPU."""
    recorded: dict | None = None
    """On --resume: the checkpoint's engine_state.json ("micro_batch", "grad_accum"); these win over a fresh "auto"."""
    note: str = ""
    chosen: dict = field(default_factory=dict)
    checkpointing: bool = False  # train.activation_checkpointing as resolved (pick_micro): what the model runs with

    def resolve(self, cfg: dict, recipe: Recipe, dp: int, device: str) -> list[str]:
        """Fill cfg's "auto" micro-batch and accumulation in place; returns problems (nothing fits the device)."""
        micro_auto = cfg.get("train_micro_batch_size_per_gpu") == "auto"
        accum_auto = cfg.get("gradient_accumulation_steps", 1) == "auto"
        rec = self.recorded or {}
        why = []
        if micro_auto:
            micro, why_micro, problem = self.pick_micro(cfg, recipe, dp, device)
            if problem and rec.get("micro_batch") is None:
                return [problem]
            if rec.get("micro_batch") is not None:
                if rec["micro_batch"] != micro:
                    why_micro = (f"the checkpoint's, kept for an exact resume; auto would pick "
                                 f"{micro if not problem else 'none'} here: {why_micro or problem}")
                else:
                    why_micro = f"the checkpoint's, the same as auto here: {why_micro}"
                micro = rec["micro_batch"]
            cfg["train_micro_batch_size_per_gpu"] = micro
            why.append(f"micro-batch {micro}: {why_micro}")
        micro = cfg.get("train_micro_batch_size_per_gpu")
        if accum_auto:
            if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
                return []  # reported by the batch-size check
            accum, why_accum = self.pick_accum(recipe, micro, device)
            rec_micro, rec_accum = rec.get("micro_batch"), rec.get("grad_accum")
            if rec_accum is not None and rec_micro not in (None, micro):
                # the micro-batch differs from the checkpoint's (written in the file): keep its sequences per step
                if rec_micro * rec_accum % micro == 0:
                    accum = rec_micro * rec_accum // micro
                    why_accum = (f"the checkpoint's {rec_micro} x {rec_accum} sequences per step at micro-batch "
                                 f"{micro}")
            elif rec_accum is not None:
                if rec["grad_accum"] != accum:
                    why_accum = f"the checkpoint's, kept for an exact resume; auto would pick {accum} here: {why_accum}"
                else:
                    why_accum = f"the checkpoint's, the same as auto here: {why_accum}"
                accum = rec["grad_accum"]
            cfg["gradient_accumulation_steps"] = accum
            why.append(f"accumulation {accum}: {why_accum}")
        self.chosen = {"micro_batch": cfg["train_micro_batch_size_per_gpu"],
                       "grad_accum": cfg.get("gradient_accumulation_steps", 1)}
        self.note = (f"batch: micro-batch {self.chosen['micro_batch']} x {self.chosen['grad_accum']} accumulation per "
                     f"GPU (\"auto\": {'; '.join(why)})")
        if (micro_auto and rec.get("micro_batch") is not None and recipe.train.activation_checkpointing == "auto"
                and self.sized(device) and "pipeline" not in cfg):
            # --resume: the checkpoint's micro-batch, with checkpointing where it does not fit without
            without = self.peak_gib(cfg, with_checkpointing(recipe, False), dp, rec["micro_batch"], device)
            self.checkpointing = without > self.usable_gib()
            self.note += (f"; activation checkpointing {'on' if self.checkpointing else 'off'} at micro-batch "
                          f"{rec['micro_batch']}")
        return []

    def sized(self, device: str) -> bool:
        """Whether "auto" fits this device's memory (an accelerator whose memory is known), not fixed CPU values."""
        return device != "cpu" and self.memory_gib is not None

    def usable_gib(self) -> float:
        return USABLE_FRACTION * self.memory_gib - MARGIN_GIB

    def candidates(self) -> tuple[int, ...]:
        return CANDIDATES

    def cpu_micro(self) -> tuple[int, str]:
        return CPU_MICRO, "the CPU's fixed value"

    def peak_gib(self, cfg: dict, recipe: Recipe, dp: int, micro: int, device: str) -> float:
        return predict_peak_gib(cfg, recipe, dp, micro, device, self.accum_at(cfg, recipe, micro, device))

    def accum_at(self, cfg: dict, recipe: Recipe, micro: int, device: str) -> int:
        """The accumulation a run at micro-batch `micro` would get: the DS file's number, the checkpoint's on a
        --resume at its micro-batch, else what "auto" picks for it."""
        accum = cfg.get("gradient_accumulation_steps", 1)
        if isinstance(accum, int):
            return accum
        rec = self.recorded or {}
        if rec.get("micro_batch") == micro and rec.get("grad_accum") is not None:
            return rec["grad_accum"]
        return self.pick_accum(recipe, micro, device)[0]

    def pick_micro(self, cfg: dict, recipe: Recipe, dp: int, device: str) -> tuple[int, str, str | None]:
        """(micro-batch, why, problem): the largest candidate whose predicted peak fits; problem if none does. With
        train.activation_checkpointing "auto", also whether to checkpoint (`checkpointing`): on where nothing fits
        without it but something does with it, or where `checkpointing_pays`. A refusal names checkpointing as the
        way out only where a micro-batch would fit with it."""
        ckpt = recipe.train.activation_checkpointing
        self.checkpointing = ckpt is True
        micro, why, problem = self.fit_micro(cfg, with_checkpointing(recipe, ckpt is True), dp, device)
        if ckpt is True or not self.sized(device) or "pipeline" in cfg or not (ckpt == "auto" or problem):
            return micro, why, problem
        on, why_on, problem_on = self.fit_micro(cfg, with_checkpointing(recipe, True), dp, device)
        if ckpt == "auto" and not problem_on and (problem or self.checkpointing_pays(cfg, recipe, micro, on)):
            without = "nothing fits" if problem else f"{micro} row{'s' if micro > 1 else ''}"
            self.checkpointing, micro, problem = True, on, None
            why = f"{why_on}; activation checkpointing on (\"auto\": {without} without it)"
        elif problem and problem_on:  # checkpointing would not fit either: the refusal names the other ways out
            problem = problem_on if ckpt == "auto" else self.fit_micro(cfg, recipe, dp, device, hint=False)[2]
        return micro, why, problem

    def checkpointing_pays(self, cfg: dict, recipe: Recipe, micro: int, on: int) -> bool:
        """Pretraining: ZeRO-3, fewer than PRETRAIN_CKPT_BELOW_TOKENS tokens a micro-batch without checkpointing and
        CKPT_ROWS_GAIN times the rows with it (measured, see the constants)."""
        return (_stage(cfg) == 3 and micro * recipe.data.seq_len < PRETRAIN_CKPT_BELOW_TOKENS
                and on >= CKPT_ROWS_GAIN * micro)

    def fit_micro(self, cfg: dict, recipe: Recipe, dp: int, device: str,
                  hint: bool = True) -> tuple[int, str, str | None]:
        """(micro-batch, why, problem) as the recipe stands: the largest candidate whose predicted peak fits. `hint`
        False: the refusal does not name activation checkpointing (pick_micro found it would not fit either)."""
        if not self.sized(device):
            return (*self.cpu_micro(), None)
        usable = self.usable_gib()
        cands = self.candidates()
        peaks = {m: self.peak_gib(cfg, recipe, dp, m, device) for m in cands}
        fits = [m for m in cands if peaks[m] <= usable]
        where = (f"{usable:.1f} GiB usable ({USABLE_FRACTION:.0%} of {self.memory_gib:.1f} GiB less "
                 f"{MARGIN_GIB:g} GiB)")
        if fits:
            m = fits[0]
            bigger = [c for c in cands if c > m]
            nxt = f"; {bigger[-1]} would need {peaks[bigger[-1]]:.1f}" if bigger else ""
            return m, f"predicted peak {peaks[m]:.1f} GiB of {where}{nxt}", None
        states = states_gib(cfg, recipe, dp)
        smallest = cands[-1]
        fix = ("use more GPUs (ZeRO-3 splits the states), ds_configs/zero2_bf16_states.json (bf16 master weights and "
               "Adam moments on the GPU: the fastest on one GPU) or zero3_offload.json (fp32 Adam, half of it in CPU "
               "memory)")
        if states + self.beside_gib() < usable:  # the activations overflow, not the states (and what is beside them)
            if hint and recipe.train.activation_checkpointing is False:
                fix = (f"set train.activation_checkpointing to auto or true (the states fit; the activations do not), "
                       f"or {self.shorter_rows()}")
            else:
                fix = f"{self.shorter_rows()} (the states fit; the activations do not, even checkpointed)"
        return 1, "", (f'train_micro_batch_size_per_gpu "auto": nothing fits this device: predicted peak '
                       f"{peaks[smallest]:.1f} GiB at micro-batch {smallest} (weights, gradients and optimizer state "
                       f"alone {states:.1f} GiB per rank on {dp} data-parallel rank{'s' if dp > 1 else ''}"
                       f"{self.beside()}) against {where}; {fix}, or write a number to try anyway")

    def beside(self) -> str:
        return ""

    def beside_gib(self) -> float:
        """What the run holds on the device beside the model's states and activations."""
        return 0.0

    def shorter_rows(self) -> str:
        return "lower data.seq_len"

    def pick_accum(self, recipe: Recipe, micro: int, device: str) -> tuple[int, str]:
        seq = recipe.data.seq_len
        target = recipe.train.tokens_per_step_per_gpu
        if target is None:
            if not self.sized(device):
                return CPU_ACCUM, "the CPU's fixed value"
            target, what = SEQUENCES_PER_STEP * seq, f"{SEQUENCES_PER_STEP} x {seq} tokens per step per GPU (default)"
        else:
            what = f"train.tokens_per_step_per_gpu {target}"
        accum = max(1, math.floor(target / (micro * seq) + 0.5))
        return accum, f"{what} / ({micro} x {seq})"


@dataclass
class GRPOAutoBatch(AutoBatch):
    """"auto" for bin/grpo.py. The rollout batch per GPU (`sequences`: prompts x completions) is the recipe's; the
    micro-batch is the largest candidate dividing it whose predicted peak fits, for training rows of `seq_len`
    tokens (the longest prompt + grpo.max_new_tokens) and with `extra_gib` beside the policy (the reference policy's
    weights and the rollout decoder's copy and KV cache); the accumulation is sequences / micro-batch. Its
    activations follow the eager calibration: an over-prediction where the policy's layers are compiled (train.compile
    true, or "auto" under ZeRO-3 with AutoEP: ds_config.grpo_compiles_layers)."""
    sequences: int = SEQUENCES_PER_STEP
    seq_len: int = 1
    extra_gib: float = 0.0
    what: str = ""  # how `sequences` was set, for the batch line

    def candidates(self) -> tuple[int, ...]:
        """Powers of 2 dividing the rollout batch, up to the tokens of pretraining's largest candidate (32 rows of
        2048): GRPO's rows are short, and a micro-batch of few tokens pays ZeRO-3's per-module gathers and every
        kernel launch once per few tokens (one H200, zero3.json: 32 x 2 rows of 272 tokens took 15-20% less per step
        than 16 x 4, docs/benchmarks.md)."""
        most = max(CANDIDATES) * 2048
        return tuple(m for m in (2 ** i for i in range(16, -1, -1))
                     if self.sequences % m == 0 and (m * self.seq_len <= most or m == 1))

    def cpu_micro(self) -> tuple[int, str]:
        m = next(c for c in self.candidates() if c <= GRPO_CPU_MICRO)
        return m, f"the CPU's: the largest power of 2 up to {GRPO_CPU_MICRO} dividing it"

    def train_recipe(self, recipe: Recipe) -> Recipe:
        from dataclasses import replace

        return replace(recipe, data=replace(recipe.data, seq_len=self.seq_len),
                       train=replace(recipe.train, compile=False))

    def peak_gib(self, cfg: dict, recipe: Recipe, dp: int, micro: int, device: str) -> float:
        return (predict_peak_gib(cfg, self.train_recipe(recipe), dp, micro, device,
                                 self.accum_at(cfg, recipe, micro, device)) + self.extra_gib)

    def beside(self) -> str:
        return f", the reference policy and the rollout decoder {self.extra_gib:.1f} GiB"

    def beside_gib(self) -> float:
        return self.extra_gib

    def shorter_rows(self) -> str:
        return "lower grpo.max_new_tokens"

    def checkpointing_pays(self, cfg: dict, recipe: Recipe, micro: int, on: int) -> bool:
        """GRPO: any stage, fewer than CKPT_BELOW_TOKENS tokens a micro-batch without it (its rows are short)."""
        return micro * self.seq_len < CKPT_BELOW_TOKENS and on >= CKPT_ROWS_GAIN * micro

    def pick_micro(self, cfg: dict, recipe: Recipe, dp: int, device: str) -> tuple[int, str, str | None]:
        micro, why, problem = super().pick_micro(cfg, recipe, dp, device)
        if not problem and self.sized(device):
            why = f"rows of up to {self.seq_len} tokens, {why} (the reference and the decoder {self.extra_gib:.1f} GiB)"
        return micro, why, problem

    def pick_accum(self, recipe: Recipe, micro: int, device: str) -> tuple[int, str]:
        return max(1, self.sequences // micro), f"{self.sequences} sequences per step per GPU ({self.what}) / {micro}"

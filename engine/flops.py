"""Model FLOPs per token and MFU: one count for bin/pretrain.py's metrics, bin/bench.py and the benchmark scripts.

FLOPs per token = 6 x active non-embedding parameters (the output layer included, tied to the input embedding or
not; routed experts at top-k / experts)
+ 3 x softmax-attention layers x 2 x seq x heads x (qk head dim + v head dim) for attention: the full seq x seq
square, no causal discount (PaLM's convention); a linear-attention layer (Qwen3.5-MoE's Gated DeltaNet) counts its
projections only. Recomputation (activation checkpointing) is not counted: this is model FLOPs, the MFU convention.
"""
from __future__ import annotations

import re

import torch

from . import pipeline

H100_SXM_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM, the H200, H800 and GH200: bin/bench.py's reference
# Dense bf16 peak (TFLOP/s, no sparsity) by the GPU model in the device's name, first match wins (the PCIe and NVL
# H100s and H200s are slower than the SXM ones); MFU is left out on any other device.
PEAK_BF16_TFLOPS = ((r"GH200", H100_SXM_BF16_TFLOPS), (r"H100 PCIe", 756.0), (r"H100 NVL", 835.0),
                    (r"H100", H100_SXM_BF16_TFLOPS), (r"H200 NVL", 835.0), (r"H200", H100_SXM_BF16_TFLOPS),
                    (r"H800 PCIe", 756.0),
                    (r"H800", H100_SXM_BF16_TFLOPS),
                    (r"H20", 148.0), (r"A100", 312.0), (r"A800", 312.0))


def model_flops_per_token(engine, cfg, seq_len: int, ep: int) -> tuple[float, float, float]:
    """(FLOPs per token, total parameters, active parameters), counted from the live engine's parameters (ZeRO-3's
    ds_numel; AutoEP's w1/w2/w3 hold E/ep experts per rank, transformers' fused expert tensors all E)."""
    total = active = 0.0
    embedding = {}  # id -> numel of the input embedding's parameters
    E, k = getattr(cfg, "n_routed_experts", None) or cfg.num_experts, cfg.num_experts_per_tok
    for name, p in engine.module.named_parameters():
        n = float(getattr(p, "ds_numel", p.numel()))
        if ".experts." in name:
            n_all = n * ep if ".experts.w" in name else n
            total += n_all
            active += n_all * k / E
            continue
        total += n
        if "embed_tokens" not in name:
            active += n
        else:
            embedding[id(p)] = n
    # An output layer tied to the input embedding is listed once, as the embedding; its matmul runs all the same.
    out = getattr(getattr(engine.module, "get_output_embeddings", lambda: None)(), "weight", None)
    active += embedding.get(id(out), 0.0)
    total, active = pipeline.sum_over_stages(engine, total, active)  # a pipeline rank holds one stage
    heads = cfg.num_attention_heads
    qk = getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    v = getattr(cfg, "v_head_dim", None) or qk
    types = getattr(cfg, "layer_types", None)  # Qwen3.5-MoE: "full_attention" or "linear_attention" per layer
    softmax_layers = sum(t != "linear_attention" for t in types) if types else cfg.num_hidden_layers
    attn = 3 * softmax_layers * 2 * seq_len * heads * (qk + v)
    return 6 * active + attn, total, active


def peak_tflops(device: torch.device | str) -> float | None:
    """The device's dense bf16 peak from PEAK_BF16_TFLOPS, None for a CPU or a GPU not listed."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def peak_for_name(name: str) -> float | None:
    """PEAK_BF16_TFLOPS's entry for a device name (whole words: "H20" is not the start of "H200")."""
    return next((v for k, v in PEAK_BF16_TFLOPS if re.search(rf"\b{k}\b", name)), None)

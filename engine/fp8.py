"""train.fp8: FP8 training of the model's dense linear layers through torchao (a PyTorch project).

    train.fp8: false   bf16 / the DS config's precision everywhere (default)
    train.fp8: dense   the attention projections, the shared experts and the dense MLPs become torchao Float8Linear
                       (dynamic tensorwise scaling: e4m3 inputs and weights, e5m2 output gradients); the output
                       layer, the routers and the routed experts stay in the model's dtype
    train.fp8: all     also the routed experts through FP8 grouped GEMM: not built yet, refused in one line

The weights stay what they were (the master weights, partitioned by ZeRO as before): each forward quantizes them on
the fly, so checkpoints hold no FP8 tensors, resume with or without FP8, and export the same Hugging Face model.
A linear is converted only when both its dimensions are multiples of 16 (what the FP8 GEMM needs). On the CPU, and
wherever torch's FP8 GEMM is missing, torchao's emulation runs the same quantization in the model's dtype, so CPU
tests check the same numerics path.
"""
from __future__ import annotations

import os

import torch

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later


def fp8_problems(mode, ds: dict, device: str) -> list[str]:
    """Why train.fp8 (a value the recipe check let through) cannot run here, each in one line (empty when off or
    when it can)."""
    if mode is False:
        return []
    if mode == "all":
        return ["train.fp8: all (the routed experts through FP8 grouped GEMM as well) is not built yet; use "
                "train.fp8: dense (attention, shared experts and dense MLPs in FP8)"]
    p = []
    if "pipeline" in ds:
        p.append("train.fp8: not supported with a pipeline section (the stages are built apart from the FP8 "
                 "conversion); use a ZeRO config (ds_configs/zero2.json, zero3.json)")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        p.append('train.fp8: needs torchao, which is not installed: pip install -e ".[fp8]"')
    if device == "cuda":
        cap = torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0")))
        if cap < MIN_CAPABILITY:
            p.append(f"train.fp8: this GPU (compute capability {cap[0]}.{cap[1]}) has no FP8 tensor cores (needs "
                     f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: H100, H200, L40S, RTX 4090); set train.fp8: false")
    return p


def convertible(name: str, module: torch.nn.Module) -> bool:
    """The dense linears train.fp8 dense converts: not the output layer, not a router (a `gate` linear, e.g.
    Mixtral's and Qwen3-MoE's; DeepSeek's router is no Linear), not a shared-expert gate, and only with both
    dimensions multiples of 16."""
    if type(module) is not torch.nn.Linear:
        return False
    leaf = name.rsplit(".", 1)[-1]
    if name == "lm_head" or leaf in ("gate", "shared_expert_gate", "router"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: torch.nn.Module, mode, device: str) -> list[str]:
    """Swap the convertible linears of `model` for Float8Linear in place (before deepspeed.initialize: the same
    parameters, so ZeRO partitions them as before); returns the converted modules' names."""
    if mode is False:
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = [n for n, m in model.named_modules() if convertible(n, m)]
    keep = set(names)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=not can_run_fp8(device)),
                               module_filter_fn=lambda m, fqn: fqn in keep)
    return names


def can_run_fp8(device: str) -> bool:
    """Real FP8 GEMMs (torch._scaled_mm) on this device; otherwise torchao emulates them."""
    if device != "cuda":
        return False
    return torch.cuda.get_device_capability() >= MIN_CAPABILITY

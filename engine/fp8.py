"""train.fp8: FP8 training of the model's dense linear layers through torchao (a PyTorch project).

    train.fp8: false   bf16 / the DS config's precision everywhere (default)
    train.fp8: dense   the attention projections, the shared experts and the dense MLPs become torchao Float8Linear
                       (dynamic tensorwise scaling: e4m3 inputs and weights, e5m2 output gradients); the output
                       layer, the routers and the routed experts stay in the model's dtype
    train.fp8: all     also AutoEP's routed experts through FP8 grouped GEMMs (torchao's rowwise-scaled grouped GEMM:
                       each token row and each weight column its own power-of-2 scale, e4m3 both ways; the gate
                       and up projections in one GEMM); each expert's rows padded to a multiple of 16

The weights stay what they were (the master weights, partitioned by ZeRO as before): each forward quantizes them on
the fly, so checkpoints hold no FP8 tensors, resume with or without FP8, and export the same Hugging Face model.
A linear (or an expert) is converted only when its dimensions are multiples of 16 (what the FP8 GEMMs need). On the
CPU torchao emulates the dense FP8 GEMMs with the same quantization; torchao has no emulation of its FP8 grouped GEMM
(Triton kernels and torch._scaled_grouped_mm, CUDA only), so `emulated_grouped_mm` below does its arithmetic in fp32:
the same scales (the same amax axes, the same power-of-2 rounding), the same e4m3 values, forward and backward.
FP8 scales depend on the batch: tensorwise ones on the micro-batch, the routed experts' weight-gradient ones on the
rows each expert received (under expert parallelism, from every rank of the group), so FP8 runs equal their
non-FP8 counterparts' batch arrangement only where the batches are alike.
"""
from __future__ import annotations

import os
import types

import torch

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later
MULTIPLE = 16  # what the FP8 GEMMs need of a converted layer's dimensions and of each expert's rows


def fp8_problems(mode, ds: dict, device: str) -> list[str]:
    """Why train.fp8 (a value the recipe check let through) cannot run here, each in one line (empty when off or
    when it can)."""
    if mode is False:
        return []
    p = []
    ep = ds.get("expert_parallel") or {}
    if mode == "all" and not ep.get("enabled", False):
        p.append("train.fp8: all runs the routed experts through AutoEP's grouped GEMM, and this DS config has no "
                 "enabled expert_parallel section; use ds_configs/zero2.json or zero3.json, or train.fp8: dense")
    elif mode == "all" and ep.get("comm_backend", "comm") != "comm":
        p.append(f"train.fp8: all needs expert_parallel.comm_backend \"comm\" (its token groups are padded to the "
                 f"FP8 GEMM's multiple of 16), not {ep.get('comm_backend')!r}; remove comm_backend or use dense")
    elif mode == "all" and ep.get("use_grouped_mm") is False:
        p.append("train.fp8: all needs AutoEP's grouped GEMM: remove expert_parallel.use_grouped_mm: false, or use "
                 "train.fp8: dense")
    if "pipeline" in ds:
        p.append("train.fp8: not supported with a pipeline section (the stages are built apart from the FP8 "
                 "conversion); use a ZeRO config (ds_configs/zero2.json, zero3.json)")
    try:
        import torchao.float8  # noqa: F401
        if mode == "all":
            import torchao.prototype.moe_training  # noqa: F401
    except ImportError:
        p.append('train.fp8: needs torchao, which is not installed: pip install -e ".[fp8]"')
    if device == "cuda":
        cap = torch.cuda.get_device_capability(int(os.environ.get("LOCAL_RANK", "0")))
        if cap < MIN_CAPABILITY:
            p.append(f"train.fp8: this GPU (compute capability {cap[0]}.{cap[1]}) has no FP8 tensor cores (needs "
                     f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: H100, H200, L40S, RTX 4090); set train.fp8: false")
    elif device != "cpu":  # the CPU emulates, for the tests; elsewhere emulation would only be a slower bf16 run
        p.append(f"train.fp8: its FP8 GEMMs run on NVIDIA GPUs (compute capability {MIN_CAPABILITY[0]}."
                 f"{MIN_CAPABILITY[1]}+) only; on {device} they would be emulated, slower than bf16; set train.fp8: false")
    return p


def convertible(name: str, module: torch.nn.Module) -> bool:
    """The dense linears train.fp8 dense converts: not the output layer, not a router (a `gate` linear, e.g.
    Mixtral's and Qwen3-MoE's; DeepSeek's router is no Linear), not a shared-expert gate, not Gated DeltaNet's
    per-head beta and decay gates (Qwen3.5's in_proj_b, in_proj_a), and only with both dimensions multiples of 16."""
    if type(module) is not torch.nn.Linear:
        return False
    leaf = name.rsplit(".", 1)[-1]
    if name == "lm_head" or leaf in ("gate", "shared_expert_gate", "router", "in_proj_a", "in_proj_b"):
        return False
    return module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0


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


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def convert_experts(model: torch.nn.Module, device: str) -> list[str]:
    """train.fp8 all: AutoEP's GroupedExperts modules (built by deepspeed.initialize, so called on the engine's
    module) compute through FP8 grouped GEMMs from their next forward on; returns their names. The weights (w1, w2,
    w3) stay the module's parameters, gathered and partitioned by ZeRO as before. AutoEP pads each expert's token
    group to DeepSpeed's TOKEN_GROUP_ALIGN_SIZE_M, raised here to MULTIPLE for this process."""
    from deepspeed.moe import ep_kernels
    from deepspeed.moe.ep_experts import GroupedExperts

    names = []
    for name, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        _, dim, ffn = getattr(module.w2, "ds_shape", module.w2.shape)  # the full shape under ZeRO-3
        if dim % MULTIPLE == 0 and ffn % MULTIPLE == 0:
            module._fp8_grouped_mm = fp8_grouped_mm if can_run_fp8(device) else emulated_grouped_mm
            module.forward = types.MethodType(_fp8_experts_forward, module)
            names.append(name)
    if names:
        ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M = max(ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M, MULTIPLE)
    return names


def _fp8_experts_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """GroupedExperts.forward in FP8: gate and up as one grouped GEMM over [w1; w3], the expert activation, down."""
    from deepspeed.moe.ep_experts import apply_packed_expert_activation

    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    dtype = x.dtype
    w13 = torch.cat([self.w1.to(dtype), self.w3.to(dtype)], dim=1)  # (E, 2F, D)
    gate_up = self._fp8_grouped_mm(x, w13.transpose(-2, -1), offs, dtype)  # (T, 2F)
    h = apply_packed_expert_activation(gate_up, self.activation, self.activation_alpha, self.activation_limit,
                                       fused=x.is_cuda)
    return self._fp8_grouped_mm(h, self.w2.to(dtype).transpose(-2, -1), offs, dtype).type_as(x)


def fp8_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """torchao's differentiable FP8 rowwise grouped GEMM (CUDA): a (T, K) row-major, b_t (E, K, N) column-major."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, out_dtype=out_dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def _fp8_round(x: torch.Tensor, dim) -> torch.Tensor:
    """x through e4m3 with one power-of-2 scale per slice along `dim` (the amax axis), back in fp32: what torchao's
    rowwise kernels store (scale = 448 / amax rounded down to a power of 2, saturated cast)."""
    x = x.float()
    amax = x.abs().amax(dim=dim, keepdim=True).double().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(FP8_MAX / amax))).float()
    return (x * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() / scale


def _groups(offs: torch.Tensor):
    ends = offs.tolist()
    return zip([0] + ends[:-1], ends)


class _EmulatedFp8GroupedMM(torch.autograd.Function):
    """fp8_grouped_mm's arithmetic in fp32 (for the CPU): forward a (rows) @ b_t (columns); grad_a from grad_out
    (rows) and b_t (scaled along N); grad_b_t from grad_out and a, each scaled per column within each group."""

    @staticmethod
    def forward(ctx, a, b_t, offs, out_dtype):
        ctx.save_for_backward(a, b_t, offs)
        ctx.out_dtype = out_dtype
        aq, bq = _fp8_round(a, -1), _fp8_round(b_t, -2)
        out = a.new_zeros(a.shape[0], b_t.shape[-1], dtype=torch.float32)
        for e, (s, t) in enumerate(_groups(offs)):
            out[s:t] = aq[s:t] @ bq[e]
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        a, b_t, offs = ctx.saved_tensors
        gq, bq = _fp8_round(grad_out, -1), _fp8_round(b_t, -1)
        grad_a = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
        grad_b = torch.zeros(b_t.shape, dtype=torch.float32, device=b_t.device)
        for e, (s, t) in enumerate(_groups(offs)):
            grad_a[s:t] = gq[s:t] @ bq[e].transpose(0, 1)
            if t > s:  # per-group column scales over the group's rows
                grad_b[e] = _fp8_round(a[s:t], 0).transpose(0, 1) @ _fp8_round(grad_out[s:t], 0)
        return grad_a.to(ctx.out_dtype), grad_b.to(ctx.out_dtype), None, None


def emulated_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _EmulatedFp8GroupedMM.apply(a, b_t, offs, out_dtype)

"""AdamW for bf16 master weights that rounds each new weight stochastically (train.stochastic_rounding).

With `bf16.bf16_master_weights_and_grads` DeepSpeed's optimizer updates bf16 weights, and rounding the new weight to
the nearest bf16 drops every update smaller than half a bf16 step (|w| / 512 to |w| / 256): early in a warmup, late
in a decay, and for the largest weights, AdamW's ~lr-sized updates vanish (docs/benchmarks.md, "the seed's
configuration": 10 steps behind fp32 AdamW at step 6-14 of 50). Here the update is computed in fp32 from the bf16
weight and moments, exactly as AdamW, and the fp32 result is rounded up with probability equal to its distance from
the bf16 value below it, so every update lands in expectation. The moments are stored in the weights' dtype, rounded
to nearest (an update to a moment is 5-10% of it, far above bf16's resolution). On fp32 weights nothing is rounded
and this is plain AdamW.
On CUDA each 16M-element chunk of a bf16 parameter is one compiled kernel (_sr_chunk: ~22 bytes of traffic per
element with the noise, where the eager path's ~12 passes move ~150); elsewhere, or if it cannot be compiled, the
eager path runs (the same arithmetic and noise; tests/test_optim.py).
"""
from __future__ import annotations

import math

import torch

CHUNK = 1 << 24  # elements per pass: ZeRO hands the optimizer one flat partition; fp32 temporaries stay ~64 MB each
COMPILE_ON = ("cuda",)  # devices where the bf16 update runs as one compiled kernel per chunk (_sr_chunk)
_compiled = None  # torch.compile(_sr_chunk), built at the first CUDA step; False once a compile failed


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None) -> None:
    """dst (bf16) <- src (fp32) rounded to one of its two bf16 neighbours, up with probability equal to the part of
    the gap below src: fp32's top 16 bits are bf16, so adding a uniform 16-bit integer to the bits and dropping the
    low 16 carries into the kept bits exactly that often (sign-magnitude: the same for negative values)."""
    if dst.dtype != torch.bfloat16:
        dst.copy_(src)
        return
    bits = src.view(torch.int32)
    bits.add_(torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator))
    bits.bitwise_and_(-(1 << 16))
    dst.copy_(src)  # exact: the low 16 bits are zero


def _sr_chunk(w, g, m, v, noise, s):
    """One chunk of AdamWSR's update of bf16 weights, written for torch.compile (one fused kernel: read w, g, m, v and
    the noise, write w, m, v, where the eager step makes ~12 passes): the eager step's arithmetic, and its rounding
    with the same noise. s (fp32): 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, 1 - lr x weight decay,
    lr / bias correction 1."""
    g32 = g.float()
    m32 = m.float().lerp(g32, s[0])
    v32 = v.float() * s[1] + g32 * g32 * s[2]
    w32 = w.float() * s[5] - s[6] * (m32 / (v32.sqrt() / s[3] + s[4]))
    m.copy_(m32)
    v.copy_(v32)
    w.copy_(((w32.view(torch.int32) + noise) & -(1 << 16)).view(torch.float32))  # exact: the low 16 bits are zero


def compiled_chunk():
    """torch.compile(_sr_chunk) for any chunk length, or None where compiling failed before (eager from then on)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_sr_chunk, dynamic=True, fullgraph=True)
    return _compiled or None


class AdamWSR(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), computed in fp32 per chunk,
    written back to bf16 weights by stochastic rounding (defaults: DeepSpeed's FusedAdam's). Each rank draws its noise from a generator seeded by
    (seed, rank, step, parameter), so a resumed run draws what the uninterrupted one would."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.seed = seed

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        index = 0
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = step = int(state["step"]) + 1  # an int, as DeepSpeed's FusedAdam keeps it
                gen = None
                if p.dtype == torch.bfloat16:
                    gen = torch.Generator(device=p.device)
                    gen.manual_seed((((self.seed * 1_000_003 + rank) * 1_000_003 + step) * 1_000_003 + index) % 2**63)
                step_size = lr / (1 - b1 ** step)
                root_bc2 = math.sqrt(1 - b2 ** step)
                parts = (p.view(-1), p.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
                if gen is not None and p.device.type in COMPILE_ON and self._step_compiled(
                        parts, gen, torch.tensor([1 - b1, b2, 1 - b2, root_bc2, eps, 1 - lr * wd, step_size],
                                                 dtype=torch.float32, device=p.device)):
                    continue
                for w, g, m, v in zip(*(t.split(CHUNK) for t in parts)):
                    g32 = g.float()
                    m32 = m.float().lerp_(g32, 1 - b1)
                    v32 = v.float().mul_(b2).addcmul_(g32, g32, value=1 - b2)
                    m.copy_(m32)
                    v.copy_(v32)
                    denom = v32.sqrt().div_(root_bc2).add_(eps)  # not in place: on fp32 weights v32 is v
                    w32 = w.float().mul_(1 - lr * wd).addcdiv_(m32, denom, value=-step_size)
                    stochastic_round_(w, w32, gen)
        return loss

    @staticmethod
    def _step_compiled(parts, gen: torch.Generator, scalars: torch.Tensor) -> bool:
        """The chunks through the compiled kernel, the noise drawn as the eager path draws it. False (nothing
        changed) when the kernel cannot be compiled here: the eager path runs instead, and from then on."""
        global _compiled
        fn = compiled_chunk()
        if fn is None:
            return False
        for i, (w, g, m, v) in enumerate(zip(*(t.split(CHUNK) for t in parts))):
            noise = torch.randint(0, 1 << 16, w.shape, dtype=torch.int32, device=w.device, generator=gen)
            try:
                fn(w, g, m, v, noise, scalars)
            except Exception as e:  # a compiler failure happens at the first call, before any write
                if i or _compiled is False:
                    raise
                _compiled = False
                print(f"warning: train.stochastic_rounding: the compiled update failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}); using the eager one (slower)", flush=True)
                gen.manual_seed(gen.initial_seed())  # the eager path draws the same noise from the start
                return False
        return True

"""One decode step of DeepSeek's attention (MLA) over the latent cache as one Triton kernel (grpo.decode_attention).

The decoder's absorbed MLA (engine/decoder.py `absorbed_mla_forward`) attends in the latent space: each head's query
times W_UK against the compressed cache (kv_lora_rank values per slot, shared by the heads) plus its rope part
against the rope keys, a masked softmax, then the probabilities' weighted sum of the same latent cache. With one
query per row these are three batched GEMMs and a softmax per layer, each a small latency-bound kernel (one H200,
grpo_2b6 at batch 64: 3.4-6.1 us each, about 20 us per layer; docs/benchmarks.md). Here one program per row and
block of 16 heads streams that row's cache once, block by block: scores, an online softmax in fp32 and the weighted
sum of the block it already holds, as flash-decoding does. The arithmetic differs from the eager path's by rounding
only: scores stay fp32 (the eager path rounds them to the model's dtype before its fp32 softmax), and the
probabilities meet the cache in its dtype as there. fp32 inputs multiply in full fp32 (not TF32).

The kernel runs on CUDA (and in Triton's interpreter, TRITON_INTERPRET=1, where tests check it on a CPU).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton: the decoder keeps its GEMMs
    triton = None

MASKED = -1.0e30  # a masked slot's score: exp() of it is 0 beside any real score; a row with no slot left (none in
# decoding: a row always sees its own token) gets the uniform average, as the eager path's dtype minimum gives


def available() -> bool:
    return triton is not None


if triton is not None:
    _MASKED = tl.constexpr(MASKED)  # a jitted function reads module globals only as constexpr

    @triton.jit
    def _mla_decode(q_lat, q_rot, lat, rope, mask, out, scale, H, L, C, R,
                    s_qb, s_qh, s_rb, s_rh, s_lb, s_ll, s_pb, s_pl, s_mb, s_ml, s_ob, s_oh,
                    MASK_BOOL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        hc = (h[:, None] < H) & (c[None, :] < C)
        ql = tl.load(q_lat + b * s_qb + h[:, None] * s_qh + c[None, :], mask=hc, other=0.0)
        qr = tl.load(q_rot + b * s_rb + h[:, None] * s_rh + r[None, :], mask=(h[:, None] < H) & (r[None, :] < R),
                     other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for start in range(0, L, BLOCK_L):
            j = start + tl.arange(0, BLOCK_L)
            jm = j < L
            kv = tl.load(lat + b * s_lb + j[:, None] * s_ll + c[None, :], mask=jm[:, None] & (c[None, :] < C),
                         other=0.0)
            kr = tl.load(rope + b * s_pb + j[:, None] * s_pl + r[None, :], mask=jm[:, None] & (r[None, :] < R),
                         other=0.0)
            if IEEE:  # fp32 inputs: full-precision products (tests); bf16/fp16 take the default MMA
                s = tl.dot(ql, tl.trans(kv), input_precision="ieee") + tl.dot(qr, tl.trans(kr), input_precision="ieee")
            else:
                s = tl.dot(ql, tl.trans(kv)) + tl.dot(qr, tl.trans(kr))
            s = (s * scale).to(tl.float32)  # (BLOCK_H, BLOCK_L); a float argument may arrive as fp64 (Inductor's
            # wrapper of a user kernel inside a compiled graph types it so), which would make the loop's m_i fp64
            if MASK_BOOL:
                keep = tl.load(mask + b * s_mb + j * s_ml, mask=jm, other=0) != 0
                s = tl.where(keep[None, :], s, _MASKED)
            else:
                s = s + tl.load(mask + b * s_mb + j * s_ml, mask=jm, other=0.0).to(tl.float32)[None, :]
            s = tl.where(jm[None, :], s, float("-inf"))  # past the cache's end: not a slot at all
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(out + b * s_ob + h[:, None] * s_oh + c[None, :], o.to(out.dtype.element_ty), mask=hc)


BLOCK_H, BLOCK_L = 16, 32  # tl.dot needs 16 rows at least; heads beyond 16 take more programs (grid axis 1)


def mla_decode(q_lat: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
               mask: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale x (q_lat . latent + q_rot . rope) + mask) . latent per row and head.

    q_lat (B, H, C) and q_rot (B, H, R): one query per row; latent (B, L, C) and rope (B, L, R): the cache;
    mask (B, L): bool (True = attend) or additive. Returns (B, H, C) in q_lat's dtype. The last dimension of
    each tensor must be contiguous."""
    B, H, C = q_lat.shape
    L, R = latent.shape[1], rope.shape[2]
    for name, t in (("q_lat", q_lat), ("q_rot", q_rot), ("latent", latent), ("rope", rope)):
        if t.stride(-1) != 1:
            raise ValueError(f"mla_decode: {name}'s last dimension must be contiguous (strides {t.stride()})")
    out = torch.empty((B, H, C), dtype=q_lat.dtype, device=q_lat.device)
    grid = (B, triton.cdiv(H, BLOCK_H))
    _mla_decode[grid](q_lat, q_rot, latent, rope, mask, out, float(scale), H, L, C, R,
                      q_lat.stride(0), q_lat.stride(1), q_rot.stride(0), q_rot.stride(1),
                      latent.stride(0), latent.stride(1), rope.stride(0), rope.stride(1),
                      mask.stride(0), mask.stride(1), out.stride(0), out.stride(1),
                      MASK_BOOL=mask.dtype == torch.bool, BLOCK_H=BLOCK_H, BLOCK_L=BLOCK_L,
                      BLOCK_C=max(16, triton.next_power_of_2(C)), BLOCK_R=max(16, triton.next_power_of_2(R)),  # tl.dot: K >= 16
                      IEEE=q_lat.dtype == torch.float32, num_warps=4)
    return out


def reference(q_lat, q_rot, latent, rope, mask, scale) -> torch.Tensor:
    """The same attention in fp32 with torch ops (what the tests hold the kernel to)."""
    s = (torch.einsum("bhc,blc->bhl", q_lat.float(), latent.float())
         + torch.einsum("bhr,blr->bhl", q_rot.float(), rope.float())) * scale
    s = s.masked_fill(~mask[:, None, :], MASKED) if mask.dtype == torch.bool else s + mask[:, None, :].float()
    return torch.einsum("bhl,blc->bhc", s.softmax(-1), latent.float())

"""engine/mla_decode.py's kernel against the same attention in torch, and the decoder with it against the decoder
without it; prints one JSON line of the differences for tests/test_mla_decode.py.

On a CPU run it under Triton's interpreter (TRITON_INTERPRET=1 in the environment before Python starts: Triton reads
it when the kernel is defined) in fp32, whose dot products the interpreter computes exactly (its bf16 tl.dot is not
usable). On CUDA it checks the compiled kernel in bf16 and fp32.
    python tests/scripts/mla_decode_check.py [--device cuda]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def kernel_cases(device: str, dtype: torch.dtype) -> dict:
    """Largest |kernel - reference| over shapes with heads, slots, latent and rope widths off the block sizes, a
    row that sees no slot, a cache slice as the decoder passes it (strided rows), bool / additive / batch-broadcast
    masks."""
    from engine.mla_decode import mla_decode, reference

    g = torch.Generator().manual_seed(0)
    worst = {}
    for B, H, L, C, R in ((3, 16, 45, 32, 16), (2, 20, 70, 48, 8), (2, 4, 33, 64, 64)):
        q = torch.randn(B, H, C, generator=g).to(device, dtype)
        qr = torch.randn(B, H, R, generator=g).to(device, dtype)
        cache = torch.randn(B, 1, L + 5, C, generator=g).to(device, dtype)[:, 0, :L]  # a static cache's first L slots
        rope = torch.randn(B, 1, L, R, generator=g).to(device, dtype)[:, 0]
        keep = torch.rand(B, L, generator=g).to(device) > 0.3
        keep[0] = False  # sees nothing: the uniform average, as the eager path gives
        masks = {"bool": keep, "additive": torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype),
                 "broadcast": keep[:1].expand(B, L)}
        for name, mask in masks.items():
            out = mla_decode(q, qr, cache, rope, mask, 0.125)
            ref = reference(q, qr, cache, rope, mask, 0.125)
            worst[name] = max(worst.get(name, 0.0), ((out.float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def decoder_case(device: str, arch: str) -> dict:
    """A tiny fp32 DeepSeek decoder, greedy, with the kernel in every MLA layer against the batched GEMMs."""
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config

    torch.manual_seed(0)
    mc = ModelConfig(arch=arch, q_lora_rank=48, num_shared_experts=1, first_dense_layers=1, num_layers=3)
    model = AutoModelForCausalLM.from_config(make_hf_config(mc)).eval().to(device)
    ids = torch.randint(1, 512, (3, 9), device=device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: masked slots
    out = {}
    for attention in ("torch", "triton"):
        dec = Decoder(model, device, batch_size=4, cache_len=40, compile=False)
        mla = [m for m in dec.model.modules() if hasattr(m, "kv_b_proj")]
        for m in mla:  # by hand on a CPU: Decoder(attention="triton") is for CUDA devices
            m._mla_kernel = attention == "triton"
        torch.manual_seed(1)
        toks = dec.generate(ids, mask, 12, eos_id=-1, pad_id=0, temperature=1.0)
        out[attention] = (toks.cpu(), dec.last_logps.cpu(), len(mla))
    (a, la, n), (b, lb, _) = out["torch"], out["triton"]
    return {"layers": n, "tokens_equal": bool(torch.equal(a, b)), "logp_diff": (la - lb).abs().max().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    res = {"kernel_fp32": kernel_cases(args.device, torch.float32)}
    if args.device == "cuda":
        res["kernel_bf16"] = kernel_cases(args.device, torch.bfloat16)
    res["decoder"] = {arch: decoder_case(args.device, arch) for arch in ("deepseek_v3", "deepseek_v2")}
    print(json.dumps(res))


if __name__ == "__main__":
    main()

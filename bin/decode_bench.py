#!/usr/bin/env python3
"""The rollout decoder alone (engine/decoder.py), on one device: a recipe's model with random weights, a fixed
batch of arithmetic prompts, every completion forced to max_new_tokens (EOS never stops it). Prints a table:
per call the wall time, decode ms per step, rollout tokens/s and the compiled graphs so far; then changes every
weight in place, refreshes the decoder from the changed model and decodes again (no new graph, new tokens).

    python bin/decode_bench.py --config engine/recipes/grpo_2b6.yaml --batch 64 --new_tokens 256 --out rows.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "engine" / "recipes" / "grpo_2b6.yaml"),
                    help="the GRPO recipe whose model is decoded (random init; default grpo_2b6.yaml)")
    ap.add_argument("--batch", type=int, default=64, help="rows decoded together (default 64)")
    ap.add_argument("--new_tokens", type=int, default=256, help="tokens each row decodes, forced (default 256)")
    ap.add_argument("--calls", type=int, default=3,
                    help="generate calls before the weights change (the first compiles; default 3)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy (default 1)")
    ap.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling's mass (default 1: off)")
    ap.add_argument("--no_compile", action="store_true", help="decode eagerly (no compiled step, no CUDA graphs)")
    ap.add_argument("--decode_experts", help="grpo.decode_experts to use instead of the recipe's")
    ap.add_argument("--profile", action="store_true", help="print the device kernels of one call, by time")
    ap.add_argument("--tree", action="store_true", help="then tree rollouts (grpo.tree defaults, greedy) on a second "
                    "decoder sized for them: wall time, counts, graphs, and how many leaves equal the greedy chain")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                    help="weights, activations and cache: auto is bf16 on CUDA, fp32 elsewhere; fp32 on CUDA tells "
                    "rounding on near-tie logits from a fork that copies the wrong cache (--tree)")
    ap.add_argument("--record_routes", action="store_true",
                    help="the decoder records every token's expert ids (what GRPO's local rollouts do, for "
                    "grpo.routing_replay and the routing agreement metric); compare the ms per step without it")
    ap.add_argument("--min_new_tokens", action="store_true",
                    help="force the length as GRPO's grpo.min_new_tokens does (the real EOS id, masked until the last "
                    "token) instead of an EOS id that never occurs")
    ap.add_argument("--no_fold_shared", action="store_true",
                    help="keep DeepSeek's shared experts as their own GEMMs (dense experts fold them in by default)")
    ap.add_argument("--decode_attention", help="grpo.decode_attention to use instead of the recipe's (triton: "
                    "DeepSeek's latent attention as one kernel per layer, engine/mla_decode.py)")
    ap.add_argument("--compile_mode", default="reduce-overhead",
                    help="torch.compile mode of the decode step (max-autotune: also tunes its GEMMs; compiles longer)")
    ap.add_argument("--logits", choices=("bf16", "fp32"), default="fp32",
                    help="fp32 (the default): the decoder's logits as one GEMM with an fp32 result (CUDA), as the "
                    "trainer's output layer; bf16: transformers' bf16 logits upcast, to compare the two")
    ap.add_argument("--topk", choices=("torch", "rank"), default="rank",
                    help="the router's top-k in the decode step: counted ranks (the default), which the compile fuses "
                    "with the router's arithmetic (engine/decoder.py topk_by_rank), or torch.topk")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch._dynamo.utils
    from transformers import AutoModelForCausalLM

    from engine.config import load_recipe
    from engine.data import load_tokenizer
    from engine.decoder import Decoder
    from engine.grpo import left_pad, load_prompts
    from engine.model import make_hf_config

    recipe = load_recipe(args.config, {})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype,
                                                                 torch.bfloat16 if device.type == "cuda" else torch.float32)
    tok = load_tokenizer(recipe.data.tokenizer)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(make_hf_config(recipe.model, tok), dtype=dtype)
    model.eval()
    prompts = [r["prompt"] for r in load_prompts(recipe.data.path)[: args.batch]]
    req = left_pad(prompts, tok, device)
    cache_len = -(-(req.prompt_ids.shape[1] + args.new_tokens) // 16) * 16
    t0 = time.perf_counter()
    dec = Decoder(model, device, args.batch, cache_len, args.decode_experts or recipe.grpo.decode_experts,
                  compile=False if args.no_compile else None, record_routes=args.record_routes,
                  fold_shared=not args.no_fold_shared, compile_mode=args.compile_mode,
                  attention=args.decode_attention or recipe.grpo.decode_attention, logits=args.logits,
                  topk=args.topk)
    build_s = time.perf_counter() - t0
    rows = []

    def call(label: str) -> torch.Tensor:
        t = time.perf_counter()
        out = dec.generate(req.prompt_ids, req.prompt_attention_mask, args.new_tokens,
                           eos_id=tok.eos_token_id if args.min_new_tokens else -1, pad_id=tok.pad_token_id,
                           temperature=args.temperature, top_p=args.top_p,
                           min_new_tokens=args.new_tokens if args.min_new_tokens else 0)
        wall = time.perf_counter() - t
        row = {"call": label, "wall_s": round(wall, 3), "decode_steps": dec.decode_steps,
               "decode_ms_per_step": round(1000 * dec.decode_s / max(dec.decode_steps, 1), 3),
               "rollout_tokens_per_s": round(args.batch * args.new_tokens / wall),
               "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
               "decoder_mem_gib": round(dec.memory_bytes() / 2**30, 3),
               "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None}
        rows.append(row)
        print(" | ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        return out

    print(f"decoder built and filled in {build_s:.2f} s: batch {args.batch}, cache {cache_len} slots, "
          f"prompt width {req.prompt_ids.shape[1]}, compile {dec.compile}", flush=True)
    for i in range(args.calls):
        before = call(f"call{i + 1}")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    t = time.perf_counter()
    dec.refresh(model)
    refresh_s = time.perf_counter() - t
    torch.manual_seed(1)
    after = call("after_refresh")
    rows[-1]["refresh_s"] = round(refresh_s, 3)
    rows[-1]["tokens_changed"] = bool((after != before).any())
    print(f"refresh {refresh_s:.3f} s; tokens changed after the weights changed: {rows[-1]['tokens_changed']}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            call("profiled")
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=100))
    if args.tree:
        rows.append(tree_check(model, device, args, recipe, req, tok))
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"config": args.config, "decode_experts": dec.decode_experts, "batch": args.batch,
                                    "new_tokens": args.new_tokens, "record_routes": args.record_routes,
                                    "fold_shared": not args.no_fold_shared, "compile_mode": args.compile_mode,
                                    "attention": dec.attention,
                                    "dtype": str(dtype).replace("torch.", ""), "cache_len": cache_len, **r}) + "\n")
    return 0


def tree_check(model, device, args, recipe, req, tok) -> dict:
    """Greedy tree rollouts (grpo.tree's defaults) of batch / leaves prompts: a branch resamples its token from its
    source's prefix, so greedy leaves should repeat the greedy chain (forks copy the prefix's cache, not recompute
    it). Two calls (the first compiles); then the same prompts as greedy chains through Decoder.generate."""
    import torch._dynamo.utils

    from engine.config import GRPOConfig, TreeConfig
    from engine.decoder import Decoder
    from engine.tree import cache_tokens, generate_tree

    cfg = TreeConfig(enabled=True)
    G = cfg.leaves()
    P = args.batch // G
    ids, mask = req.prompt_ids[:P], req.prompt_attention_mask[:P]
    cache_len = -(-(ids.shape[1] + cache_tokens(GRPOConfig(max_new_tokens=args.new_tokens, tree=cfg))) // 16) * 16
    dec = Decoder(model, device, args.batch, cache_len, args.decode_experts or recipe.grpo.decode_experts,
                  compile=False if args.no_compile else None)
    row = {"call": "tree", "prompts": P, "leaves": G, "cache_len": cache_len}
    for i in range(2):
        t = time.perf_counter()
        out, info = generate_tree(dec, ids, mask, cfg, args.new_tokens, eos_id=-1, pad_id=tok.pad_token_id,
                                  temperature=0)
        row[f"wall_s_{i + 1}"] = round(time.perf_counter() - t, 3)
    row.update({k: v for k, v in info.counts.items() if isinstance(v, (int, float))})
    row["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    chains = dec.generate(ids, mask, args.new_tokens, eos_id=-1, pad_id=tok.pad_token_id, temperature=0)
    same = [bool(torch.equal(out[j * G + i], chains[j])) for j in range(P) for i in range(G)]
    row["leaves_equal_to_greedy_chain"] = f"{sum(same)}/{len(same)}"
    # For branched leaves: does the resampled branch token equal the chain's, and for how many tokens do they agree
    # from there? A wrong cache copy breaks at once; rounding (bf16, a different row and cache slots) later.
    # (TreeInfo's parents and starts are per row: row j * G + i is prompt j's leaf i.)
    w, first, run, starts = ids.shape[1], [], [], []
    for j in range(P):
        for i in range(G):
            r = j * G + i
            if info.parents[r] < 0:
                continue
            a, b = out[r, w:].tolist(), chains[j, w:].tolist()
            k = info.starts[r]
            starts.append(k)
            first.append(a[k] == b[k])
            n = 0
            while k + n < len(a) and a[k + n] == b[k + n]:
                n += 1
            run.append(n)
    row["branch_token_equal"] = f"{sum(first)}/{len(first)}"
    row["agreeing_tokens_after_branch_mean"] = round(sum(run) / max(len(run), 1), 1)
    row["agreeing_tokens_after_branch_min"] = min(run, default=None)
    row["agreeing_tokens_after_branch"] = run  # per branched leaf; a branch can agree for new_tokens - start at most
    row["branch_starts"] = starts
    print(" | ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Save one random-init Hugging Face model of a recipe's architecture, with the engine's tokenizer, so that
several systems (bin/grpo.py under different DS configs, TRL's GRPOTrainer) start from the same weights.

    python3 docs/bench/save_random_model.py --config engine/recipes/grpo_2b6.yaml --out /tmp/init_2b6
    python3 docs/bench/save_random_model.py --config engine/recipes/grpo_tiny.yaml --out /tmp/init_tiny --device cpu

The model is built with transformers' own initialization (`from_config`, no zero.Init) on --device (cuda when
there is one: 2.6B parameters initialize in seconds there, in a minute or more on a CPU), in --dtype, from a fixed
seed, and written as safetensors next to config.json and the tokenizer files. Loads with from_pretrained, and
bin/grpo.py --init_from takes the directory as it is.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "engine/recipes/grpo_2b6.yaml"), help="recipe YAML")
    ap.add_argument("--out", required=True, help="output directory (created; existing files are overwritten)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default=None, help="where to build it (default: cuda if available, else cpu)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import load_recipe
    from engine.data import load_tokenizer
    from engine.model import make_hf_config

    t0 = time.time()
    recipe = load_recipe(args.config)
    tok = load_tokenizer(recipe.data.tokenizer)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(make_hf_config(recipe.model, tok), dtype=getattr(torch, DTYPES[args.dtype]))
    n = sum(p.numel() for p in model.parameters())
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        print(f"error: non-finite initial weights in {bad[:3]}", file=sys.stderr)
        return 1
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"saved {n / 1e6:,.1f}M parameters ({args.dtype}, {model.config.model_type}, seed {args.seed}) from "
          f"{args.config} to {args.out} in {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Export a training checkpoint as a Hugging Face model: `bin/zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`.

One path for every layout (ZeRO-3, ZeRO-1/2, pipeline): open_checkpoint (engine/export/__init__.py) plans it and
checks it against the recorded model before anything is written; the weights are then written one safetensors
shard at a time (Checkpoint.read: only the pieces of that shard are read), with config.json, generation_config.json
and the tokenizer, into a temporary folder next to OUTPUT_DIR that is renamed into place at the end. Bad input is
one line and exit 2, and OUTPUT_DIR is left as it was.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
from pathlib import Path

from . import ExportError, find_tag_dir, open_checkpoint
from .plan import Checkpoint, numel
from .read import DTYPES, INIT_DIR


def export(checkpoint_dir: str | Path, output_dir: str | Path, tag: str | None = None, dtype: str = "fp32",
           max_shard_size: str = "2GB", force: bool = False, log=print) -> Path:
    """Export; raises ExportError on bad input, leaving OUTPUT_DIR as it was."""
    import torch

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    tag_dir = find_tag_dir(checkpoint_dir, tag).resolve()
    out = Path(output_dir).absolute()
    _check_output(out, tag_dir, force)
    ckpt = open_checkpoint(tag_dir, dtype=dtype)

    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise ExportError(f"output {out}: cannot write in {out.parent} ({e.strerror or type(e).__name__}); "
                          "pass an OUTPUT_DIR in a writable folder") from None
    try:
        write_shards(ckpt, tmp, max_bytes, log)
        cfg = ckpt.hf_config
        cfg.dtype = getattr(torch, DTYPES[dtype])
        cfg.use_cache = True
        cfg.save_pretrained(tmp)
        from transformers import GenerationConfig

        gen = tag_dir / INIT_DIR / "generation_config.json"  # a model.init_from run keeps its init's (EOS ids, sampling)
        if gen.is_file():
            shutil.copyfile(gen, tmp / "generation_config.json")
        else:
            GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
        if ckpt.tokenizer_dir is not None:
            for f in ckpt.tokenizer_dir.iterdir():
                if f.is_file():
                    shutil.copyfile(f, tmp / f.name)
        else:
            log(f"warning: {tag_dir} has no tokenizer/ folder; the export has none")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)  # safetensors creates its files 0600
        tmp.chmod(0o777 & ~umask)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_shards(ckpt: Checkpoint, folder: Path, max_bytes: int, log=print) -> None:
    """model-0000i-of-0000n.safetensors of at most max_bytes each (one tensor may exceed it) + their index."""
    from safetensors.torch import save_file

    shards = _shards(ckpt.keys, max_bytes)
    weight_map, total = {}, 0
    for i, keys in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = ckpt.read(keys)
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(keys, name))
        log(f"wrote {name} ({len(keys)} tensors)")
        del tensors
        gc.collect()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _shards(keys: dict, max_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    for key, (shape, dt) in keys.items():
        n = numel(shape) * dt.itemsize
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += n
    if cur:
        shards.append(cur)
    return shards


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ExportError(f"--max_shard_size {text!r}: expected a size like 2GB, 500MB or 1000000")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(m.group(1)) * mult)
    if size < 1:
        raise ExportError(f"--max_shard_size {text!r}: must be at least 1 byte")
    return size


def _check_output(out: Path, tag_dir: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out}: exists and is not a directory; choose a directory path")
    real = out.resolve()
    if real == tag_dir or real in tag_dir.parents or tag_dir in real.parents:
        raise ExportError(f"output {out}: overlaps the checkpoint {tag_dir}; write the export somewhere else")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output {out}: not empty; pass --force to replace it, or choose an empty directory")


# ---------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="zero_to_fp32",
        description="Turn a checkpoint of this engine (ZeRO-3, ZeRO-1/2 or pipeline, AutoEP experts included) into a "
                    "Hugging Face model folder (config.json, sharded *.safetensors, tokenizer) that loads with "
                    "AutoModelForCausalLM.from_pretrained.")
    ap.add_argument("checkpoint_dir", help="RUN_DIR, RUN_DIR/checkpoints (uses `latest`) or one checkpoint folder")
    ap.add_argument("output_dir", help="where to write the Hugging Face model (must be empty unless --force)")
    ap.add_argument("--tag", help="checkpoint to export, e.g. step_00000100 (default: the one `latest` names)")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of the exported weights")
    ap.add_argument("--max_shard_size", default="2GB", help="largest safetensors file, e.g. 2GB, 500MB (default 2GB)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty OUTPUT_DIR")
    ap.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    try:
        out = export(args.checkpoint_dir, args.output_dir, tag=args.tag, dtype=args.dtype,
                     max_shard_size=args.max_shard_size, force=args.force, log=log)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    log(f"exported to {out}")
    return 0

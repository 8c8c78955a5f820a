"""A checkpoint planned for export: every Hugging Face tensor as fragments of the checkpoint's files.

The layout modules (zero3.py, zero12.py, pipeline.py) read only metadata and say, for each output tensor, which
flat pieces of which files make it up (`Frag`): a piece of an fp32 master partition in an optimizer file, or a
whole tensor in a model file. `Checkpoint.read` then reads one output shard at a time: each file that holds a
piece of the shard is opened memory-mapped, only those pieces are copied out, and the file is closed again, so
peak memory is about one shard plus what the pieces take, whatever the model's size.

Experts: a checkpoint stores each expert-parallel rank's local experts stacked, `<moe>.experts.w1`/`w3` (gate/up,
[local experts, ffn, hidden]) and `w2` (down, [local experts, hidden, ffn]) (deepspeed/moe/ep_repack.py), or one
expert per file; Hugging Face wants `<moe>.experts.gate_up_proj` [experts, 2*ffn, hidden] = cat(gate, up) along
dim 1 (`is_transposed` models store [experts, hidden, 2*ffn]) and `<moe>.experts.down_proj` [experts, hidden, ffn].
`place` writes a piece of a local stack into that layout.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

from .read import DTYPES, ExportError, check_against_config, load


@dataclass
class Target:
    """Where the pieces of one engine tensor (on one expert-parallel rank) go in the output."""
    key: str                      # Hugging Face key
    kind: str                     # "dense" | "gate" | "up" | "down"
    experts: list | None = None   # experts only: global index of each local expert (None: skip this copy)


@dataclass
class Frag:
    path: tuple   # the flat source inside its file: keys from the loaded object down to a tensor
    offset: int   # first element in that (flattened) tensor
    length: int   # elements
    start: int    # first element in the (local) flattened engine tensor
    target: Target


@dataclass
class Source:
    file: Path
    frags: list[Frag] = field(default_factory=list)


@dataclass
class Checkpoint:
    """One checkpoint tag folder, planned: its model, what the export holds, and where each piece of it lies."""
    layout: str        # "zero3" | "zero12" | "pipeline"
    tag_dir: Path
    hf_config: object  # the recorded model's transformers config (architectures set)
    keys: dict         # HF key -> (shape, torch dtype of the export), in the model's state_dict order
    transposed: dict   # HF expert key -> is_transposed
    sources: list[Source]

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.tag_dir / "tokenizer"
        return d if d.is_dir() else None

    def read(self, keys: list[str]) -> dict:
        """The tensors `keys` (HF names), in the export's dtypes, read from the files' pieces."""
        import torch

        wanted = set(keys)
        out = {k: torch.empty(self.keys[k][0], dtype=self.keys[k][1]) for k in keys}
        done = dict.fromkeys(keys, 0)
        with torch.no_grad():
            for src in self.sources:
                frags = [f for f in src.frags if f.target.key in wanted]
                if not frags:
                    continue
                sd = load(src.file, mmap=True)
                for f in frags:
                    t = sd
                    for k in f.path:
                        t = t[k]
                    # detach: DeepSpeed saved the masters with requires_grad=True, and an in-place copy from them
                    # would record autograd history that keeps the whole mapped file alive.
                    piece = t.detach().reshape(-1).narrow(0, f.offset, f.length)
                    done[f.target.key] += place(out[f.target.key], f, piece, self.transposed.get(f.target.key, False))
                del sd, t, piece
                gc.collect()
        short = [k for k in keys if done[k] != out[k].numel()]
        if short:
            raise ExportError(f"{self.tag_dir}: {short[0]} got {done[short[0]]} of {out[short[0]].numel()} values "
                              "from the files; the checkpoint is incomplete")
        return out


def finish(layout: str, tag_dir: Path, cfg, expected: tuple, got_shapes: dict, sources: list[Source],
           dtype: str) -> Checkpoint:
    """The plan, once the layout has mapped every piece: tied keys dropped, shapes checked against the config,
    export dtypes set (transformers' strict-fp32 tensors stay fp32)."""
    import torch

    keys, transposed, strict_fp32, tied = expected
    for key in tied:
        got_shapes.pop(key, None)
        keys.pop(key, None)
    check_against_config(got_shapes, keys, tag_dir)
    keys = {k: (shape, torch.float32 if k in strict_fp32 else getattr(torch, DTYPES[dtype]))
            for k, (shape, _) in keys.items()}
    sources = [s for s in sources if s.frags]
    return Checkpoint(layout, tag_dir, cfg, keys, {k: v for k, v in transposed.items() if k in keys}, sources)


def expert_target(name: str, local_shape, num: int, hf_prefix: str, transposed: dict) -> tuple[str, str, tuple]:
    """`<moe>.experts.w1|w2|w3` with local stack shape [local experts, A, B] -> (HF key, kind, full HF shape);
    `hf_prefix` is the HF name of `<moe>.experts`."""
    w = name.rsplit(".", 1)[1]
    key = f"{hf_prefix}.{'down_proj' if w == 'w2' else 'gate_up_proj'}"
    kind = {"w1": "gate", "w3": "up", "w2": "down"}[w]
    ffn, hidden = (local_shape[1], local_shape[2]) if w != "w2" else (local_shape[2], local_shape[1])
    full = (num, 2 * ffn, hidden) if w != "w2" else (num, hidden, ffn)
    if transposed.get(key):
        full = (full[0], full[2], full[1])
    return key, kind, full


def same_shape(got: dict, key: str, shape: tuple, tag_dir: Path) -> None:
    if got.setdefault(key, tuple(shape)) != tuple(shape):
        raise ExportError(f"{tag_dir}: {key} has shape {got[key]} in one file and {tuple(shape)} in another; "
                          "the files come from different saves")


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _copy_rows(dst, off: int, src) -> None:
    """Write 1-D `src` into the row-major positions [off, off + len) of the 2-D view `dst`."""
    cols = dst.shape[1]
    n, pos = src.numel(), 0
    r, c = divmod(off, cols)
    if c:
        take = min(cols - c, n)
        dst[r, c:c + take].copy_(src[:take])
        pos, r = take, r + 1
    full = (n - pos) // cols
    if full:
        dst[r:r + full].copy_(src[pos:pos + full * cols].view(full, cols))
        pos, r = pos + full * cols, r + full
    if pos < n:
        dst[r, :n - pos].copy_(src[pos:])


def place(out, frag: Frag, src, transposed: bool) -> int:
    """Copy one fragment into its output tensor; returns the number of elements written."""
    t = frag.target
    if t.kind == "dense":
        out.view(-1)[frag.start:frag.start + frag.length].copy_(src)
        return frag.length
    # Experts: local [E_local, A, B] in the checkpoint; expert g of the output seen as an [A, B] view.
    if t.kind == "down":  # w2 [hidden, ffn] -> down_proj[g] [hidden, ffn] (transposed: [ffn, hidden])
        view = (lambda g: out[g].t()) if transposed else (lambda g: out[g])
    else:  # w1 / w3 [ffn, hidden] -> first / second half of gate_up_proj[g] [2*ffn, hidden] ([hidden, 2*ffn])
        half = (out.shape[2] if transposed else out.shape[1]) // 2
        sl = slice(0, half) if t.kind == "gate" else slice(half, 2 * half)
        view = (lambda g: out[g][:, sl].t()) if transposed else (lambda g: out[g][sl])
    per = out[0].numel() // (2 if t.kind != "down" else 1)
    written, pos = 0, 0
    while pos < frag.length:
        j, off = divmod(frag.start + pos, per)
        take = min(per - off, frag.length - pos)
        g = t.experts[j]
        if g is not None:
            _copy_rows(view(g), off, src[pos:pos + take])
            written += take
        pos += take
    return written

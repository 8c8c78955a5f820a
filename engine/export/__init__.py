"""Reading a training checkpoint as a Hugging Face model: one interface over every checkpoint layout.

    ckpt = open_checkpoint(RUN_DIR)      # or RUN_DIR/checkpoints, or one tag folder; --tag picks another
    ckpt.hf_config                       # the recorded model's transformers config
    ckpt.keys                            # HF key -> (shape, dtype), in the model's state_dict order
    ckpt.read([...keys])                 # those tensors, read from the files' pieces
    ckpt.tokenizer_dir                   # the checkpoint's tokenizer/ folder, or None

Beneath it, one module per layout, each reading only metadata to plan (plan.py: where every piece of every
Hugging Face tensor lies): zero3.py (ZeRO-3: zero_pp_rank_*_model_states.pt per rank), zero12.py (ZeRO-1/2:
mp_rank_00_model_states.pt, per-expert files, fp32 masters in the optimizer files), pipeline.py (a pipeline run:
ZeRO-1 per stage). read.py is what they share: safe loading, the recorded config, the expected keys. On top,
write.py turns a Checkpoint into a folder that `from_pretrained` loads (`bin/zero_to_fp32`, GRPO's --init_from).
Bad input raises ExportError: one line saying what, where and how to fix it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from .read import ExportError

if TYPE_CHECKING:
    from .plan import Checkpoint

ZERO3_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")  # ZeRO-1/2 runs (00), pipeline runs (one per stage)

__all__ = ["ExportError", "find_tag_dir", "layout", "open_checkpoint"]


def open_checkpoint(path: str | Path, tag: str | None = None, dtype: str = "fp32",
                    verify: bool = True) -> Checkpoint:
    """The checkpoint at `path` (see find_tag_dir), planned for an export in `dtype`: every file's metadata read and
    checked against the recorded model. `verify` first checks it as `--resume` does (engine/checkpoint.py: manifest
    sizes, zip CRCs: reads every byte once)."""
    from .read import DTYPES

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    tag_dir = find_tag_dir(path, tag).resolve()
    if verify:
        from ..checkpoint import damage

        bad = damage(tag_dir, verify_crc=True)  # torch.load skips the zip CRCs
        if bad:
            raise ExportError(f"checkpoint {tag_dir} is damaged ({bad}): a file is missing, truncated or corrupt; copy "
                              "the checkpoint again, or export an older one with --tag")
    kind = layout(tag_dir)
    if kind == "zero3":
        from .zero3 import plan
    elif kind == "pipeline":
        from .pipeline import plan
    else:
        from .zero12 import plan
    return plan(tag_dir, dtype)


def layout(tag_dir: Path) -> str:
    """"zero3", "zero12" or "pipeline": which DeepSpeed layout the files in `tag_dir` have."""
    files = _model_files(tag_dir)
    if any(ZERO3_FILE.match(f.name) for f in files):
        return "zero3"
    if not files:
        raise ExportError(f"{tag_dir}: no DeepSpeed model-states files (zero_pp_rank_*_model_states.pt or "
                          "mp_rank_*_model_states.pt); not a checkpoint folder")
    from .pipeline import stages

    return "pipeline" if stages(tag_dir) else "zero12"


def find_tag_dir(path: str | Path, tag: str | None) -> Path:
    """The checkpoint folder to read: RUN_DIR or RUN_DIR/checkpoints (+ `latest` or `tag`), or a tag folder."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"checkpoint dir {p}: no such directory (give RUN_DIR or RUN_DIR/checkpoints)")
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if tag is None and _model_files(p):
        return p  # a tag folder itself
    tags = sorted(d.name for d in p.iterdir() if d.is_dir() and _model_files(d))
    if tag is not None:
        if not (p / tag).is_dir() or "/" in tag or tag in (".", ".."):
            raise ExportError(f"--tag {tag}: no such checkpoint in {p} (available: {', '.join(tags) or 'none'})")
        return p / tag
    latest = p / "latest"
    if not latest.is_file():
        if not tags:
            raise ExportError(f"checkpoint dir {p}: no checkpoints in it (expected RUN_DIR/checkpoints/<tag>/ "
                              "with DeepSpeed's *_model_states.pt files)")
        raise ExportError(f"checkpoint dir {p}: no `latest` file; pass --tag (available: {', '.join(tags)})")
    name = latest.read_text().strip()
    if not name or not (p / name).is_dir():
        raise ExportError(f"checkpoint dir {p}: `latest` names {name!r}, which is not there; pass --tag "
                          f"(available: {', '.join(tags) or 'none'})")
    return p / name


def _model_files(d: Path) -> list[Path]:
    try:
        return sorted(f for f in d.iterdir() if ZERO3_FILE.match(f.name) or MP_FILE.match(f.name))
    except OSError:
        return []

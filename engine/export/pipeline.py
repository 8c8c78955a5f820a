"""Pipeline-parallel checkpoints (ds_configs/pipe.json runs) -> the export plan (plan.py).

A pipeline checkpoint (DeepSpeed 0.19.8, PipelineEngine + ZeRO-1 or stage 0, S stages x D data-parallel ranks) is a
ZeRO-1 checkpoint per stage, model-parallel rank s = stage s (zero12.py has the files). Its engine names are
`<layer>.<path>`, layer 0 the embedding, 1..L the decoder layers, L+1 norm + head (engine/pipeline.py: hf_key maps
them to the model's); AutoEP's expert groups live inside one stage, so stage s's optimizer files number D.
"""
from __future__ import annotations

from pathlib import Path

from ..pipeline import hf_key
from .plan import Checkpoint
from .read import load
from .zero12 import model_file, plan_stages


def stages(tag_dir: Path) -> int:
    """The number of pipeline stages of the checkpoint in `tag_dir`, 0 when it is not a pipeline checkpoint."""
    f = model_file(tag_dir, 0)
    if not f.is_file():
        return 0
    ds = load(f, mmap=True).get("ds_config") or {}
    return int((ds.get("pipeline") or {}).get("stages", 0))


def plan(tag_dir: Path, dtype: str = "fp32") -> Checkpoint:
    return plan_stages(tag_dir, dtype, "pipeline", stages(tag_dir),
                       lambda name, cfg: hf_key(name, cfg.num_hidden_layers))

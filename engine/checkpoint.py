"""Checkpoints: DeepSpeed engine state + our client state, in RUN_DIR/checkpoints/<tag>.

Layout:  RUN_DIR/checkpoints/step_00000100/   DeepSpeed's files, plus rng_rank{r}.pt and engine_state.json
         RUN_DIR/checkpoints/latest            names the newest complete tag
`latest` moves only after every rank has finished writing (barrier, then an atomic rename on rank 0), so a
crash during a save leaves the previous checkpoint the one that resumes.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config import CheckpointConfig, ConfigError, Recipe

STATE_FILE = "engine_state.json"


def ckpt_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: str | Path) -> str | None:
    f = ckpt_dir(run_dir) / "latest"
    if not f.is_file():
        return None
    tag = f.read_text().strip()
    return tag if (ckpt_dir(run_dir) / tag).is_dir() else None


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


class Cadence:
    """When to save: every N steps, every M minutes (agreed across ranks), and at the last step."""

    def __init__(self, c: CheckpointConfig, device: torch.device | str = "cpu"):
        self.c, self.last, self.device = c, time.time(), device

    def due(self, step: int, max_steps: int) -> bool:
        elapsed = time.time() - self.last
        by_time = torch.tensor(float(self.c.every_minutes > 0 and elapsed >= 60 * self.c.every_minutes),
                               device=self.device)  # NCCL only moves accelerator tensors
        if dist.is_initialized():
            dist.broadcast(by_time, 0)  # rank 0's clock decides, so all ranks enter the save together
        due = (self.c.at_end and step == max_steps) or (self.c.every_steps and step % self.c.every_steps == 0) or bool(by_time)
        if due:
            self.last = time.time()
        return bool(due)


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def save(engine, recipe: Recipe, state: dict, tokenizer=None) -> Path:
    """Save engine + client state under a new tag, then move `latest`; prune to checkpoint.keep_last."""
    root = ckpt_dir(recipe.run_dir)
    tag = tag_for(state["step"])
    engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)
    rank = dist.get_rank()
    torch.save(_rng_state(), root / tag / f"rng_rank{rank}.pt")
    if rank == 0:
        (root / tag / STATE_FILE).write_text(json.dumps({**state, "world_size": dist.get_world_size(),
                                                         "recipe": recipe.to_dict()}, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(root / tag / "tokenizer")
    dist.barrier()  # every rank has written its shards
    if rank == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / "latest")
        tags = sorted(p.name for p in root.glob("step_*") if p.is_dir())
        for old in tags[: -recipe.checkpoint.keep_last]:
            shutil.rmtree(root / old, ignore_errors=True)
    dist.barrier()
    return root / tag


def load(engine, run_dir: str | Path) -> dict:
    """Restore engine state and this rank's RNG from `latest`; returns the client state."""
    root = ckpt_dir(run_dir)
    tag = latest(run_dir)
    if tag is None:
        raise ConfigError(f"--resume: no checkpoint in {root}")
    path, client = engine.load_checkpoint(str(root), tag=tag)
    if path is None:
        raise ConfigError(f"--resume: DeepSpeed could not load {root / tag}")
    rng_file = root / tag / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)  # our own file: python/numpy RNG states are not tensors
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
    return {k: client[k] for k in ("step", "position", "tokens")}

"""Shared helpers: start the real `deepspeed` launcher on CPU ranks, write test configs."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ZERO3 = ROOT / "ds_configs" / "zero3.json"
DEEPSPEED = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")  # the real launcher


def pytest_sessionstart(session):
    """Build DeepSpeed's CPU ops (shared-memory all-reduce, Adam) once, in this process, before any launch.

    They are JIT-compiled into ~/.cache/torch_extensions on first use. Built here, no two ranks race for the
    build lock, and a launch's timeout never includes a compile (27 min once, on a loaded 2-core machine).
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    for name in ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             # Return freed memory to the OS at once so RSS tracks live memory (memory tests read it).
             MALLOC_MMAP_THRESHOLD_="65536")
    e.update(extra)
    return e


def launch(n_ranks: int, script: str | Path, *args, cwd: Path, timeout: int = 600,
           check: bool = True) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N script args` on CPU ranks; output kept for the assertion message."""
    cmd = [DEEPSPEED, "--master_port", str(free_port()),
           "--num_gpus", str(n_ranks), str(script), *map(str, args)]
    p = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def write_ds(path: Path, base: Path = ZERO3, drop: tuple = (), **changes) -> Path:
    """A copy of a shipped DS config with some keys dropped or changed."""
    cfg = json.loads(base.read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT

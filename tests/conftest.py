"""Shared helpers: start the real `deepspeed` launcher on CPU ranks, write test configs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
    return launch_together([(n_ranks, script, *args)], cwd=cwd, timeout=timeout, check=check)[0]


def launch_together(jobs: list[tuple], cwd: Path, timeout: int = 600,
                    check: bool = True) -> list[subprocess.CompletedProcess]:
    """Several independent launches `(n_ranks, script, *args)` at once; waits for all of them.

    Each launch spends most of its first 15-25 s in imports and DeepSpeed's start on one core per rank, so two
    1-rank launches side by side take about the time of one on a 2-core machine. Each one is still its own
    `deepspeed` launcher and its own processes; nothing is shared but the wall clock.
    """
    procs = []
    for n_ranks, script, *args in jobs:
        cmd = [DEEPSPEED, "--master_port", str(free_port()),
               "--num_gpus", str(n_ranks), str(script), *map(str, args)]
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append((cmd, subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=out, stderr=err, text=True,
                                            start_new_session=True), out, err))
    done, end = [], time.time() + timeout
    try:
        for cmd, p, out, err in procs:
            try:
                rc = p.wait(timeout=max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            out.seek(0), err.seek(0)
            done.append(subprocess.CompletedProcess(cmd, rc, out.read(), err.read()))
    finally:
        for _, p, out, err in procs:
            if p.poll() is None:  # a timeout or a failed wait: end this launch's whole process group, by its id
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            out.close(), err.close()
    for p in done:
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(p.args)} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return done


def run_in_process(main, argv: list, capfd, monkeypatch, cwd: Path | None = None,
                   **environ) -> subprocess.CompletedProcess:
    """A command-line entry point (`engine.pretrain.main`, `engine.export.main`, ...) called in this process, as
    `python bin/X argv` would run it, with `environ` set; returns its exit code and what it wrote to the file
    descriptors 1 and 2 (capfd: every write, Python's or a C library's, not only sys.stdout/sys.stderr).

    For the refusal tests: a subprocess spends 5-10 s importing torch and transformers before the check that
    refuses the input takes milliseconds. What a fresh process prints at import time is checked once per entry
    point by a test that still runs it as a subprocess. Stopping "before any work" is enforced here:
    `engine.pretrain.init_distributed` raises, so a check that lets bad input through fails instead of waiting
    for ranks that do not exist.
    """
    import engine.pretrain

    def no_work(*a, **k):
        raise AssertionError(f"{argv}: got past the checks to init_distributed (bad input was let through)")

    monkeypatch.setattr(engine.pretrain, "init_distributed", no_work)
    for k, v in environ.items():
        monkeypatch.setenv(k, str(v))
    if cwd is not None:
        monkeypatch.chdir(cwd)
    capfd.readouterr()  # drop what came before
    rc = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["<in process>", *map(str, argv)], rc, out, err)


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

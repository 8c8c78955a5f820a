"""Metrics: one JSON object per logged step in RUN_DIR/metrics.jsonl, DeepSpeed's monitor, a progress bar.

Only rank 0 writes; other ranks get the same object and it does nothing (no rank checks in the loop).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def print0(*args, **kwargs) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


class Metrics:
    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0, monitor=None):
        self.enabled = rank() == 0
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.bar = None
        if self.enabled:
            from tqdm import tqdm

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(run_dir) / "metrics.jsonl", "a")
            # A bar on a terminal (ETA included); plain lines per logged step when piped to a file.
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=None)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.monitor is not None:
            self.monitor.write_events([(f"Train/{k}", v, row["step"]) for k, v in row.items()
                                       if k != "step" and isinstance(v, (int, float))])
        shown = {k: row[k] for k in ("loss", "reward", "eval_reward", "kl", "lr", "tokens_per_s") if k in row}
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        else:
            print(" ".join([f"step {row['step']}"] + [f"{k} {v:.4g}" for k, v in shown.items()]), flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()


class DeviceClock:
    """Time marks that never make the host wait: on a CUDA accelerator an event recorded on the stream (read later,
    once the last mark has happened), elsewhere the wall clock (a CPU runs each op as it is called). Shared by GRPO's
    phase times (engine/grpo.py: Timer) and bin/bench.py's forward/backward/step times."""

    def __init__(self, acc=None):
        if acc is None:
            from deepspeed.accelerator import get_accelerator

            acc = get_accelerator()
        self.cuda = acc.device_name() == "cuda"
        self._acc = acc

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = self._acc.Event(enable_timing=True)  # torch.cuda.Event(**kw): an event, not the class
        e.record()
        return e

    def wait(self, mark) -> None:
        """Until `mark` has happened on the device (nothing to wait for on the wall clock)."""
        if self.cuda:
            mark.synchronize()

    def seconds(self, a, b) -> float:
        """Seconds from mark `a` to mark `b` (on CUDA, once `b` has happened)."""
        return a.elapsed_time(b) / 1000 if self.cuda else b - a

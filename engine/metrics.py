"""Metrics: one JSON object per logged step in RUN_DIR/metrics.jsonl, DeepSpeed's monitor, a progress bar.

Only rank 0 writes; other ranks get the same object and it does nothing (no rank checks in the loop).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def finite(value):
    """The value with every float that is not finite (NaN, inf: a diverged loss, a skipped step's gradient norm)
    as None, inside lists and dicts too: JSON has no NaN or Infinity, and many readers reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_line(row: dict) -> str:
    """One metrics row as standard JSON (non-finite floats as null)."""
    return json.dumps(finite(row), allow_nan=False)


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
            set_aside_later_rows(Path(run_dir), start_step)
            self.file = open(Path(run_dir) / "metrics.jsonl", "a")
            # A bar on a terminal (ETA included); plain lines per logged step when piped to a file.
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=None)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json_line(row) + "\n")
        self.file.flush()
        if self.monitor is not None:
            self.monitor.write_events(monitor_events(row))
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


def set_aside_later_rows(run_dir: Path, start_step: int) -> None:
    """Rows of metrics.jsonl past the step this run starts from (written before a crash, after the checkpoint it
    resumes; or all of them when a run starts over at step 0) move to metrics.replaced.jsonl, so that metrics.jsonl
    holds each step once, as the run that continues computes it."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep, later = [], []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None
        later_row = isinstance(step, int) and (step > start_step or step == start_step == 0)
        (later if later_row else keep).append(line)
    if not later:
        return
    with open(run_dir / "metrics.replaced.jsonl", "a") as f:
        f.write("".join(line + "\n" for line in later))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    print(f"note: {path}: {len(later)} rows past step {start_step}, written before this start, moved to "
          f"{run_dir / 'metrics.replaced.jsonl'}", flush=True)


def monitor_events(row: dict) -> list[tuple[str, float, int]]:
    """The row for DeepSpeed's monitor: each number as Train/<key>, each list of numbers (per layer, e.g.
    expert_load_max_over_mean) as Train/<key>/<index>; other values (text) are not sent."""
    events = []
    for k, v in row.items():
        if k == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            events.append((f"Train/{k}", v, row["step"]))
        elif isinstance(v, (list, tuple)):
            events += [(f"Train/{k}/{i}", x, row["step"]) for i, x in enumerate(v)
                       if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return events


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

#!/usr/bin/env python3
"""bin/grpo.py with grpo.routing_replay switched every step (odd steps off, even steps r3), to measure replay's cost
inside one process: the same warm engine, allocator and decoder for both, so the comparison is not the 0.3-0.5 s
that separate runs differ by. Each row gets `mode` (off or r3). Start it as bin/grpo.py (deepspeed launcher, same
arguments); the recipe must set routing_replay: r3 (preflight checks that replay can run).
    deepspeed --num_gpus 1 docs/bench/replay_alternate.py --deepspeed_config ... --config ... --init_from ...
"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import grpo  # noqa: E402

_step = grpo.grpo_step


def alternating_step(run, rows, sampling, step):
    run.g = replace(run.g, routing_replay="r3" if step % 2 == 0 else "off")
    return {**_step(run, rows, sampling, step), "mode": run.g.routing_replay}


if __name__ == "__main__":
    grpo.grpo_step = alternating_step
    sys.exit(grpo.main())

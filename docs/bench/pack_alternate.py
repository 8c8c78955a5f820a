#!/usr/bin/env python3
"""bin/grpo.py with the train passes' packing switched every step (odd steps: consecutive full-width micro-batches as
before packing; even steps: packed, engine/grpo.py micro_batches), in one process; each row gets `mode` (plain or
packed). Started like bin/grpo.py; docs/bench/replay_alternate.sh runs it with SCRIPT=docs/bench/pack_alternate.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import grpo  # noqa: E402

_step, _micro_batches = grpo.grpo_step, grpo.micro_batches
packed = {"on": True}


def switched_micro_batches(attn, micro, pack=True):
    return _micro_batches(attn, micro, pack=pack and packed["on"])


def alternating_step(run, rows, sampling, step):
    packed["on"] = step % 2 == 0
    return {**_step(run, rows, sampling, step), "mode": "packed" if packed["on"] else "plain"}


if __name__ == "__main__":
    grpo.grpo_step, grpo.micro_batches = alternating_step, switched_micro_batches
    sys.exit(grpo.main())

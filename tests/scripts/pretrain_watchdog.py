#!/usr/bin/env python3
"""bin/pretrain.py with the peer watchdog (engine/cluster.py) started right after init_distributed: the
one-line change proposed for engine/parallel.py.init_distributed, run here until it lands there (then
start_peer_watchdog, which starts once per process, makes this wrapper a plain bin/pretrain.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import engine.pretrain as pretrain  # noqa: E402
from engine.cluster import start_peer_watchdog  # noqa: E402

_init_distributed = pretrain.init_distributed


def init_distributed() -> None:
    _init_distributed()
    start_peer_watchdog()


pretrain.init_distributed = init_distributed

if __name__ == "__main__":
    sys.exit(pretrain.main())

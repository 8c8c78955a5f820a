"""What the data checks add to bin/pretrain.py's preflight on a big corpus (docs/data.md, "Measured").
usage: python tests/scripts/preflight_time.py DATA [DS_CONFIG]
Calls engine.pretrain.preflight once to pay the imports, then 5 times with the data checks and 5 times without
them (check_corpus replaced by what preflight did before: data_files, which only lists the files), alternating,
and prints the median and every time of each.
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import engine.pretrain as pretrain  # noqa: E402
from engine.data import data_files  # noqa: E402
from engine.parallel import World  # noqa: E402

ds = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "ds_configs", "zero3.json")
args = pretrain.parse_args(["--deepspeed_config", ds, "--data", sys.argv[1]])
checks = {"with": pretrain.check_corpus, "without": lambda d, *_: data_files(d.path) and []}
pretrain.preflight(args, World(0, 1, 1))
times = {name: [] for name in checks}
for _ in range(5):
    for name, check in checks.items():
        pretrain.check_corpus = check
        t = time.perf_counter()
        pretrain.preflight(args, World(0, 1, 1))
        times[name].append(time.perf_counter() - t)
for name, ts in times.items():
    print(f"preflight {name} the data checks: median {sorted(ts)[2]:.3f} s (all: {' '.join(f'{t:.3f}' for t in ts)})")

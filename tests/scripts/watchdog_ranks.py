"""Ranks for tests/test_watchdog.py: a torch.distributed world (gloo, env://, as the deepspeed launcher or the test
sets it up) with engine/watchdog.py's peer watchdog started as engine/parallel.py: init_distributed starts it, and
nothing else (no model, no DeepSpeed), so a launch costs the launcher and torch's import.
    deepspeed --num_gpus 2 tests/scripts/watchdog_ranks.py DIR [--busy S] [--hang]
Each rank reports to DIR/rank{r}.{event}.json as it goes:
  started   its pid, whether start_peer_watchdog() started a watchdog ($MOE_PEER_TIMEOUT), its timeout, the threads
  busy_done --busy S: rank 1 computed for S seconds (a long step) while rank 0 waited for it in an all-reduce
  hanging   --hang: every rank then waits in all-reduces for good (a test freezes one and sees what ends)
Without --hang the ranks exit 0 (the watchdog's clean goodbye: rank 0 serves the store until the others are done).
"""
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.watchdog import start_peer_watchdog  # noqa: E402


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out = Path(args[0])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def report(event: str, **info) -> None:
        tmp = out / f"rank{rank}.{event}.tmp"
        tmp.write_text(json.dumps({"rank": rank, "time": time.time(), **info}))
        tmp.rename(out / f"rank{rank}.{event}.json")

    wd = start_peer_watchdog()
    report("started", pid=os.getpid(), watchdog=wd is not None, timeout=wd and wd.timeout,
           threads=sorted(t.name for t in threading.enumerate()))
    x = torch.ones(1)
    if "--busy" in args:
        seconds = float(args[args.index("--busy") + 1])
        t0 = time.time()
        if rank == 1:  # a long step: the main thread computes, in torch and in Python, and touches no collective
            a = torch.randn(128, 128)
            while time.time() < t0 + seconds:
                a = torch.tanh(a @ a)
                sum(i * i for i in range(20000))
        dist.all_reduce(x)  # rank 0 waits here for rank 1 the whole time
        report("busy_done", seconds=time.time() - t0)
    if "--hang" in args:
        report("hanging")
        while True:
            dist.all_reduce(x)
            time.sleep(0.05)
    dist.barrier()
    return 0


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown (atexit handlers still run)

    exit_now(main())

"""bin/grpo.py with ZeRO-3's parameter coordinator logging its trace mode: a diagnosis wrapper for the benchmarks.

DeepSpeed's ZeRO-3 records the order modules fetch their parameters in ("trace") and prefetches from it once
complete; with an incomplete trace every parameter is released after use and gathered again. This prints each
reset_step (called at the start of every forward of the engine's module) and each invalidation, with the mode before
and after and a timestamp, so a slow step can be matched to the coordinator's state:
    GRPO_SCRIPT=docs/bench/zero3_trace_log.py CONFIGS=zero3_grpo bash docs/bench/grpo_vs_trl.sh
"""
import runpy
import sys
import time
from pathlib import Path

from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator


def mode(c) -> str:
    return "complete" if c.is_complete_trace() else "record" if c.is_record_trace() else "invalid"


def logged(name, fn):
    def wrapper(self, *args, **kwargs):
        before = mode(self)
        out = fn(self, *args, **kwargs)
        print(f"[zero3 trace] {time.time():.3f} {name}: {before} -> {mode(self)}", flush=True)
        return out
    return wrapper


Coordinator.reset_step = logged("reset_step", Coordinator.reset_step)
Coordinator._invalidate_trace = logged("invalidate", Coordinator._invalidate_trace)
script = Path(__file__).resolve().parents[2] / "bin" / "grpo.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")

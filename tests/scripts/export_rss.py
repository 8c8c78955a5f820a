"""Peak RSS of bin/zero_to_fp32's export, measured in this process.
usage: python tests/scripts/export_rss.py CHECKPOINT_DIR OUTPUT_DIR [zero_to_fp32 options]
Prints one JSON line, peak RSS (VmHWM) in MiB at three points:
  imports_mib  after importing what the export imports;
  planned_mib  after planning the export once (engine/export: open_checkpoint): it reads every file's metadata,
               loads the tokenizer and builds the transformers model on the meta device, but reads no weights;
  peak_mib     after the whole export (which plans again, then writes the shards).
VmHWM, not getrusage's ru_maxrss: on Linux ru_maxrss keeps the parent's peak across fork + exec (a child of a
400 MiB pytest starts at 400 MiB), while VmHWM belongs to this process's own address space.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ctypes  # noqa: E402
# Freed blocks of 64 KiB or more go back to the OS at once (glibc's M_MMAP_THRESHOLD = -3), so RSS tracks live
# memory; only the memory probes pay its page faults, not every launch of the suite.
ctypes.CDLL(None).mallopt(-3, 65536)
import safetensors.torch  # noqa: E402,F401  (what the export imports lazily)
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401

from engine import checkpoint  # noqa: E402,F401
from engine.export import open_checkpoint, pipeline, plan, write, zero3, zero12  # noqa: E402,F401


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    figures = {"imports_mib": peak_mib()}
    args = write.parse_args(sys.argv[1:])
    open_checkpoint(args.checkpoint_dir, args.tag, args.dtype, verify=False)
    figures["planned_mib"] = peak_mib()
    rc = write.main(sys.argv[1:])
    figures["peak_mib"] = peak_mib()
    print(json.dumps({"rc": rc, **{k: round(v, 1) for k, v in figures.items()}}), flush=True)
    exit_now(rc)

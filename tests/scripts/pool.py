"""Ranks that stay up and run one test job after another (conftest.run_ranks); started by the real launcher:
    deepspeed --num_gpus 2 tests/scripts/pool.py DIR
A job is a script (bin/pretrain.py, bin/grpo.py, a probe) run as `python SCRIPT ARGS` would run it on this rank
(runpy, as __main__, with the job's argv, environment, sys.path and working directory), its stdout and stderr (file
descriptors 1 and 2 too) in DIR/K.rankR.out/.err and its exit code in DIR/K.rankR.rc. Job K is DIR/K.json; DIR/stop
ends the pool, and so does the exit of the process whose pid is in DIR/owner (the test worker).

Why: every launch spends ~8 CPU-s in the runner and launcher and ~11 CPU-s per rank importing torch, transformers
and DeepSpeed before its first step (docs/testing.md), on a 2-core machine. A job here pays only its own work. What
only a fresh process shows (start-up, signals, exit codes, peak memory, the launcher's own behaviour) is tested
through real launches of their own; a job reads and writes only its own run directory.
"""
import gc
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


_GROUPS: dict | None = None  # deepspeed.utils.groups' module state before the first job


def reset_deepspeed_groups() -> None:
    """Put DeepSpeed's process-group registry (deepspeed.utils.groups) back as it was before the first job. An engine
    leaves its groups there for the next one: a pipeline engine's model-parallel unit (`mpu`) made the next ZeRO-3
    engine take its model-parallel size, and expert groups are cached by size alone, whatever ranks they hold."""
    import types

    from deepspeed.utils import groups

    global _GROUPS
    state = {k: v for k, v in vars(groups).items() if not k.startswith("__") and not callable(v)
             and not isinstance(v, types.ModuleType)}
    if _GROUPS is None:
        _GROUPS = {k: (v.copy() if isinstance(v, dict) else v) for k, v in state.items()}
    for k in state:
        if k in _GROUPS:
            setattr(groups, k, _GROUPS[k].copy() if isinstance(_GROUPS[k], dict) else _GROUPS[k])


def run_job(spec: dict, out: Path, err: Path) -> int:
    """Run spec = {"script", "argv", "env", "path", "cwd"} in this process as `python script argv` would; returns its
    exit code. Everything it changes in the process (environment, sys.path, argv, working directory, streams) is
    put back, and so is DeepSpeed's token-group alignment of AutoEP (train.fp8 all raises it to 16)."""
    from deepspeed.moe import ep_kernels

    import engine.proc

    env, path, argv, cwd = dict(os.environ), list(sys.path), sys.argv, os.getcwd()
    align = ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M
    streams, exit_now = (sys.stdout, sys.stderr), engine.proc.exit_now
    os.environ.update(spec.get("env", {}))
    sys.path[:0] = spec.get("path", [])
    sys.argv = [spec["script"], *spec.get("argv", [])]
    os.chdir(spec.get("cwd") or cwd)
    engine.proc.exit_now = sys.exit  # a job's `exit_now(main())` must not end the pool
    for s in streams:
        s.flush()
    saved_fds = os.dup(1), os.dup(2)
    rc = 0
    reset_deepspeed_groups()
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1), os.dup2(e.fileno(), 2)
        sys.stdout, sys.stderr = os.fdopen(os.dup(1), "w", buffering=1), os.fdopen(os.dup(2), "w", buffering=1)
        try:
            runpy.run_path(spec["script"], run_name="__main__")
        except SystemExit as x:
            rc = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
        except BaseException:  # noqa: BLE001 (as an uncaught exception would end the process: printed, exit 1)
            traceback.print_exc()
            rc = 1
        finally:
            for s in (sys.stdout, sys.stderr):
                s.flush()
                s.close()
            os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            sys.stdout, sys.stderr = streams
            engine.proc.exit_now = exit_now
            os.chdir(cwd)
            sys.argv = argv
            sys.path[:] = path
            os.environ.clear()
            os.environ.update(env)
            reset_deepspeed_groups()
            ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M = align
            if "transformers.integrations.deepspeed" in sys.modules:  # a probe that builds without main() leaves
                sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()  # zero.Init on
            gc.collect()
    return rc


def owner_gone(pid: int) -> bool:
    """The test process that started the pool (DIR/owner) has exited: killed, say, by a timeout, so its teardown
    never wrote DIR/stop. The pool, in a session of its own, would otherwise poll for jobs forever."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def main() -> int:
    from engine.parallel import init_distributed

    d = Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    owner = int((d / "owner").read_text()) if (d / "owner").exists() else None
    init_distributed()
    rank = int(os.environ["RANK"])
    k, checked = 0, time.time()
    while True:
        job = d / f"{k}.json"
        while not job.exists():
            if (d / "stop").exists():
                return 0
            if owner is not None and time.time() > checked + 1:
                if owner_gone(owner):
                    return 0
                checked = time.time()
            time.sleep(0.02)
        rc = run_job(json.loads(job.read_text()), d / f"{k}.rank{rank}.out", d / f"{k}.rank{rank}.err")
        (d / f"{k}.rank{rank}.tmp").write_text(str(rc))
        (d / f"{k}.rank{rank}.tmp").rename(d / f"{k}.rank{rank}.rc")
        k += 1


if __name__ == "__main__":
    from engine.proc import exit_now

    exit_now(main())

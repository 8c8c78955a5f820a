"""The suite's own machinery: a JIT-build lock left by a killed run does not hang the next one; the processes the
tests start find the checkout first and the caller's PYTHONPATH after it."""
import os
import subprocess
import sys
import time

from conftest import ROOT, STALE_LOCK_S, drop_stale_build_lock, env


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    lock = tmp_path / "cpu_adam" / "lock"
    assert drop_stale_build_lock(lock) is False  # none there
    lock.parent.mkdir()
    lock.write_text("")
    assert drop_stale_build_lock(lock) is False and lock.exists()  # just taken: a build may be running
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert drop_stale_build_lock(lock) is True and not lock.exists()


def test_started_processes_import_the_checkout_first_and_keep_the_callers_path(tmp_path, monkeypatch):
    """Packages installed with `pip install --target DIR` and DIR on PYTHONPATH (the GPU machine's DeepSpeed) stay
    importable in every process the suite starts, after the checkout."""
    (tmp_path / "x_site_probe.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert env()["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(tmp_path)]
    code = "import x_site_probe, engine.grpo; print(engine.grpo.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env(), cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(ROOT / "engine" / "grpo.py")  # after DeepSpeed's log lines


def test_a_rank_that_fails_while_the_other_waits_ends_the_job_soon(tmp_path):
    """Rank 1 raises while rank 0 waits for it in a barrier (as a pipeline stage waits for its neighbour): the job
    returns rank 1's failure and its traceback stuck_s later, not after the whole timeout, and the next job on a new
    pool runs. [fails if: the pool waits for every rank's exit code until the timeout]"""
    from conftest import RankPool

    probe = tmp_path / "probe.py"
    probe.write_text("import os, torch.distributed as dist\nfrom engine.parallel import init_distributed\n"
                     "init_distributed()\nif int(os.environ['RANK']) == 1:\n    raise RuntimeError('rank one broke')\n"
                     "dist.barrier()\n")
    pool = RankPool(2)
    try:
        t = time.time()
        p = pool.run(probe, [], tmp_path, {}, [str(ROOT)], timeout=300, stuck_s=3)
        assert time.time() - t < 120 and p.returncode == 1, (time.time() - t, p.returncode, p.stderr[-2000:])
        assert "rank one broke" in p.stderr and "rank(s) [0] still running" in p.stderr, p.stderr[-2000:]
        assert pool.proc.poll() is not None  # killed: the next job starts a new pool
    finally:
        pool.close(kill=True)

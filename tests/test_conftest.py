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

"""The suite's own machinery: a JIT-build lock left by a killed run does not hang the next one."""
import os
import time

from conftest import STALE_LOCK_S, drop_stale_build_lock


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    lock = tmp_path / "cpu_adam" / "lock"
    assert drop_stale_build_lock(lock) is False  # none there
    lock.parent.mkdir()
    lock.write_text("")
    assert drop_stale_build_lock(lock) is False and lock.exists()  # just taken: a build may be running
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert drop_stale_build_lock(lock) is True and not lock.exists()

"""The peer watchdog (engine/watchdog.py) on CPU ranks, no ssh: $MOE_PEER_TIMEOUT (0 = off), a long step that is not
taken for a dead rank, and rank 0's store vanishing (its node frozen): the surviving rank ends itself, the launcher
ends the rest, and no process of the job is left. A frozen node of two is tests/test_multinode.py's (cluster only).

The ranks are tests/scripts/watchdog_ranks.py: torch.distributed and the watchdog only (no model, no DeepSpeed)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import DEEPSPEED, ROOT, env, free_port, run_in_process

RANKS = ROOT / "tests" / "scripts" / "watchdog_ranks.py"


def test_peer_timeout_from_the_environment(monkeypatch):
    from engine.watchdog import DEFAULT_PEER_TIMEOUT, PeerTimeoutError, peer_timeout, start_peer_watchdog

    monkeypatch.delenv("MOE_PEER_TIMEOUT", raising=False)
    assert peer_timeout() == DEFAULT_PEER_TIMEOUT == 30.0
    for raw, seconds in (("7.5", 7.5), ("120", 120.0), ("0", 0.0), (" 2 ", 2.0)):
        monkeypatch.setenv("MOE_PEER_TIMEOUT", raw)
        assert peer_timeout() == seconds, raw
    for raw in ("30s", "inf", "1e300", "nan", "-5"):  # inf crashed every rank in the store; nan and -5 meant "off"
        monkeypatch.setenv("MOE_PEER_TIMEOUT", raw)
        with pytest.raises(PeerTimeoutError) as e:
            peer_timeout()
        assert str(e.value) == (f"MOE_PEER_TIMEOUT={raw!r}: expected seconds from 0 (0 turns the peer watchdog off) "
                                "to 604800"), raw
    monkeypatch.setenv("MOE_PEER_TIMEOUT", "5")
    assert start_peer_watchdog() is None  # this process: no process group, or a world of one (in-process jobs)


def reports(d: Path, event: str, ranks: int = 2) -> list[dict] | None:
    files = [d / f"rank{r}.{event}.json" for r in range(ranks)]
    return [json.loads(f.read_text()) for f in files] if all(f.exists() for f in files) else None


def wait_for(what, timeout: float, why: str, procs=(), log=None):
    end = time.time() + timeout
    while time.time() < end:
        got = what()
        if got:
            return got
        if any(p.poll() is not None for p in procs):
            got = what()  # it may have come just before the process ended
            if got:
                return got
            raise AssertionError(f"{why}: a process ended first\n{log() if log else ''}")
        time.sleep(0.05)
    raise AssertionError(f"{why}: not within {timeout} s\n{log() if log else ''}")


def test_timeout_0_starts_no_watchdog_on_two_ranks(tmp_path):
    """MOE_PEER_TIMEOUT=0 on a world of two (two plain processes, env:// as the launcher sets it): no watchdog, no
    thread, and the ranks still end cleanly."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port), MOE_PEER_TIMEOUT="0"))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    for info in reports(tmp_path, "started"):
        assert info["watchdog"] is False and "peer-watchdog" not in info["threads"], info


def job_processes(sid: int) -> list[psutil.Process]:
    """Every live process of the session a launch was started in (start_new_session: the runner's pid)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


TIMEOUT = 3  # MOE_PEER_TIMEOUT for the launch below: heartbeats every 0.5 s


def test_a_long_step_is_not_a_dead_rank_and_a_frozen_rank_0_ends_the_job(tmp_path):
    """One launch of 2 ranks with MOE_PEER_TIMEOUT=3: rank 1 computes for 12 s (4 x the timeout) while rank 0 waits
    for it in an all-reduce: both go on. Then both wait in all-reduces and rank 0, which serves the rendezvous store,
    is frozen (SIGSTOP: its node gone without closing a connection). Rank 1's watchdog must end rank 1 within about
    the timeout with its one line, and the launcher the rest: afterwards no process of the job is left.

    Once rank 1 has ended, rank 0 is let go on (SIGCONT, as a node that comes back): the launcher's SIGTERM then
    reaches it at once instead of after the 30 s DeepSpeed's launcher waits for a process that does not react."""
    log = tmp_path / "launch.log"
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", RANKS, tmp_path, "--busy", 4 * TIMEOUT,
           "--hang"]
    with open(log, "w") as f:
        job = subprocess.Popen(list(map(str, cmd)), cwd=tmp_path, env=env(MOE_PEER_TIMEOUT=str(TIMEOUT)), stdout=f,
                               stderr=subprocess.STDOUT, start_new_session=True)
    tail = lambda: log.read_text()[-4000:]  # noqa: E731
    rank0 = None
    try:
        started = wait_for(lambda: reports(tmp_path, "started"), 300, "both ranks started", [job], tail)
        assert all(s["watchdog"] and s["timeout"] == TIMEOUT and "peer-watchdog" in s["threads"] for s in started), \
            started
        busy = wait_for(lambda: reports(tmp_path, "busy_done"), 120, "the long step ended on both ranks", [job], tail)
        # rank 1 computed for 4 x the timeout; rank 0, started a little later, waited for it over 2 x the timeout
        assert busy[1]["seconds"] >= 4 * TIMEOUT and busy[0]["seconds"] >= 2 * TIMEOUT, busy
        wait_for(lambda: reports(tmp_path, "hanging"), 60, "both ranks in their last all-reduces", [job], tail)
        rank0, rank1 = (psutil.Process(s["pid"]) for s in started)
        rank0.suspend()
        t0 = time.time()
        wait_for(lambda: not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE, 10 * TIMEOUT,
                 "rank 1 ended after rank 0 froze", log=tail)
        took = time.time() - t0
        rank0.resume()
        rc = job.wait(timeout=60)
        left = job_processes(job.pid)
    finally:
        if rank0 is not None and rank0.is_running():
            rank0.resume()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = log.read_text()
    print(f"rank 0 frozen: rank 1 ended after {took:.1f} s, the launcher exited {rc}")
    # (The long step was not taken for a dead rank: a rank that ended then would have reported no busy_done.)
    assert took < 3 * TIMEOUT, tail()  # the store's timeout (3 s) and a heartbeat interval, with room for load
    assert rc != 0, tail()
    lines = [line for line in text.splitlines() if line.startswith("[rank 1] the rendezvous store at 127.0.0.1:")]
    assert len(lines) == 1 and "(rank 0) stopped answering" in lines[0], tail()
    assert lines[0].endswith("ending this rank (docs/multinode.md, 'When a node dies')"), lines
    assert left == [], [(p.pid, p.cmdline()) for p in left]


def test_a_bad_timeout_is_refused_before_any_work(tmp_path, capfd, monkeypatch):
    """bin/pretrain.py's preflight (main() in this process as rank 0 of 1): one line, exit 2, nothing written (it was a
    traceback from init_distributed on every rank)."""
    from engine.pretrain import main

    monkeypatch.setenv("MOE_PEER_TIMEOUT", "30s")
    p = run_in_process(main, ["--deepspeed_config", ROOT / "ds_configs" / "zero3.json", "--run_dir", tmp_path / "run"],
                       capfd, monkeypatch, cwd=tmp_path, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_SIZE=1)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and lines == ["error: MOE_PEER_TIMEOUT='30s': expected seconds from 0 (0 turns the "
                                           "peer watchdog off) to 604800"], p.stderr
    assert not (tmp_path / "run").exists()

"""engine/watchdog.py's and engine/proc.py's rules that every other fast test let through, one a test, each a change
to the module (a mutant) that survived tests/test_watchdog.py, tests/test_proc.py and
tests/test_watchdog_metrics_units.py:

- the watchdog on a real TCPStore served in this process, real threads, timeouts of 1-1.5 s: two healthy ranks beat
  on their own counters and neither is taken for dead, a rank that stops beating is named by the other within
  about the timeout, a rank whose peer never starts gives up after the timeout with its own line, the thread is a
  daemon;
- its construction (on a fake TCPStore): the store's address, port, client role and timeout, the counters it creates,
  the start-up wait; the excepthook and atexit hooks; close() waiting for a beat in flight; a counter that moved by
  one; several silent ranks named together; the beat helper a daemon;
- start_peer_watchdog: $MOE_PEER_TIMEOUT read when no timeout is given, no watchdog without MASTER_ADDR, one a process;
- print_error's writer arguments (its 120 s limit, its 30 s start-up limit and a start that times out), launcher_pid
  on an argument that merely contains the launcher's module name, AFTER_LAUNCHER's limit read in seconds (without
  pidfd, kernel < 5.3: tests/test_proc.py's writer tests run both ways), exit_now on a code that is falsy yet not 0
  for sys.exit (the bug this file found: exit_now('') and exit_now(0.0) ended with 0 where sys.exit ends with 1).

The watchdog's _die (os._exit(1)) is replaced by a recorder in the real-store tests, so nothing here ends pytest;
their timeouts are 1-1.5 s and their bounds several times that. Expectations are literal values. The bracket at the end
of a docstring says which mutant the test kills."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from conftest import ROOT, env
from test_proc import read_until_eof, streams
from test_watchdog_metrics_units import FakeStore, bare_watchdog

# ----------------------------------------------------------------------------------------- a real store, real threads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class World:
    """A job's rendezvous store (a TCPStore server in this process, as rank 0's) and PeerWatchdogs for ranks of a
    world of `size`, each with its own client, on real threads; _die records (rank, why) instead of ending pytest."""

    def __init__(self, monkeypatch, size: int):
        import torch.distributed as dist

        import engine.watchdog as watchdog

        self.port = free_port()
        self.server = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=30))
        self.size, self.rank, self.dogs, self.died, self.registered = size, [0], [], [], []
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(self.port))
        monkeypatch.setattr(dist, "get_rank", lambda: self.rank[0])
        monkeypatch.setattr(dist, "get_world_size", lambda: self.size)
        monkeypatch.setattr(watchdog.atexit, "register", self.registered.append)
        monkeypatch.setattr(sys, "excepthook", sys.excepthook)
        died = self.died

        def die(wd, why):
            if not wd.stopping.is_set():
                died.append((wd.rank, why, time.monotonic()))

        monkeypatch.setattr(watchdog.PeerWatchdog, "_die", die)
        self.PeerWatchdog = watchdog.PeerWatchdog

    def start(self, rank: int, timeout: float = 1.0, interval: float | None = None):
        self.rank[0] = rank
        wd = self.PeerWatchdog(timeout, interval)
        self.dogs.append(wd)
        return wd

    def counter(self, key: str) -> int:
        return int(self.server.get(key))

    def stop(self) -> None:
        for wd in self.dogs:
            wd.stopping.set()
        for wd in self.dogs:
            wd.thread.join(30)


@pytest.fixture
def world(monkeypatch):
    made = []

    def make(size: int) -> World:
        made.append(World(monkeypatch, size))
        return made[-1]

    yield make
    for w in made:
        w.stop()


def wait_until(what, seconds: float):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not what():
        time.sleep(0.05)
    return what()



def as_rank_1_of_2(monkeypatch, store_class):
    """This process as rank 1 of 2, the store `store_class`, no atexit hook, the excepthook restored after."""
    import torch.distributed as dist

    import engine.watchdog as watchdog

    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "TCPStore", store_class)
    monkeypatch.setattr(watchdog.atexit, "register", lambda f: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")

def test_two_healthy_ranks_beat_on_their_own_counters_then_a_silent_one_is_named(world):
    """A world of two, timeout 1.5 s and a beat every 0.25 s (a sixth, as 30 s and 5 s in use), each rank's watchdog
    its own client of a real store. For 3 s (2 x the timeout) nobody is taken for dead, and each rank's own counter
    has moved at least 5 times (12 expected; a beat every 1 s makes 3); the watchdog threads are daemons named
    peer-watchdog, and each rank registered its close() for the interpreter's exit. Then rank 1's watchdog stops
    without a done mark (the rank is gone): rank 0 names it well within 8 s. [kills: the beat bumping rank 0's counter
    (or none), a beat result dropped, the loop waiting 4 x the interval, a beat counted only past one increment, the
    start-up counter or done mark not created, a non-daemon thread, no atexit hook]"""
    w = world(2)
    r0, r1 = w.start(0, 1.5, 0.25), w.start(1, 1.5, 0.25)
    time.sleep(3.0)
    assert w.died == []
    assert w.counter(r0.hb[0]) >= 6 and w.counter(r1.hb[1]) >= 6, (w.counter(r0.hb[0]), w.counter(r1.hb[1]))
    assert [(t.name, t.daemon) for t in (r0.thread, r1.thread)] == [("peer-watchdog", True)] * 2
    assert w.registered == [r0.close, r1.close]
    gone = time.monotonic()
    r1.stopping.set()
    r1.thread.join(10)
    assert wait_until(lambda: w.died, 8.0), "rank 0 never named rank 1"
    rank, why, when = w.died[0]
    assert (rank, why) == (0, "no heartbeat from rank(s) 1 for over 1.5 s: dead, or its node is unreachable")
    assert when - gone < 8.0, when - gone


def test_a_peer_that_never_starts_its_watchdog_ends_the_rank_after_the_timeout(world):
    """A world of two where only rank 0 starts its watchdog (timeout 1 s): its start-up wait for every rank's counter
    gives up after about a second with its own line, not a store error and not 10 s later.
    [kills: the start-up wait skipped or 10 x the timeout, its failure printed instead of ending the rank]"""
    w = world(2)
    t0 = time.monotonic()
    w.start(0)
    assert wait_until(lambda: w.died, 8.0), "rank 0 waited on"
    rank, why, when = w.died[0]
    assert (rank, why) == (0, "not every rank started its peer watchdog within 1 s")
    assert 0.9 <= when - t0 < 8.0, when - t0


# --------------------------------------------------------------------------- construction, hooks, close, _stale


def test_the_watchdog_is_a_client_of_the_env_store_with_the_timeout_and_creates_its_counters(monkeypatch):
    """__init__ on a fake TCPStore (rank 1 of 2, timeout 12): it connects to MASTER_ADDR:MASTER_PORT as a client
    (rank 0's launcher-made server already listens there) with the timeout, not waiting for workers; it creates its
    done mark (0) and its first beat (1) before anyone reads them, and its thread first waits for every rank's counter
    for the timeout. [kills: is_master=True, the store's timeout changed, the done mark or first beat not created,
    the start-up wait's timeout changed]"""
    import torch.distributed as dist

    import engine.watchdog as watchdog

    made, waited = [], threading.Event()

    class Store(FakeStore):
        def __init__(self, *args, **kwargs):
            super().__init__()
            made.append((args, kwargs))
            self.waits = []

        def wait(self, keys, timeout):
            self.waits.append((list(keys), timeout))
            waited.set()

    as_rank_1_of_2(monkeypatch, Store)
    wd = watchdog.PeerWatchdog(12.0, interval=60.0)
    assert waited.wait(10)
    hb, done = [f"{watchdog.KEY_PREFIX}/hb/{r}" for r in (0, 1)], f"{watchdog.KEY_PREFIX}/done/1"
    assert wd.store.values == {done: 0, hb[1]: 1}
    wd.close()  # rank 1: marks done, serves nothing
    assert made == [(("10.0.0.7", 29500), {"is_master": False, "timeout": timedelta(seconds=12),
                                            "wait_for_workers": False})]
    assert wd.store.waits == [(hb, timedelta(seconds=12))]
    assert wd.store.values == {done: 1, hb[1]: 1}


def test_an_unhandled_exception_marks_the_rank_crashed_and_still_reaches_the_previous_hook(monkeypatch):
    """_hook_exit: the excepthook it installs sets `crashed` (close() then says no goodbye) and calls the hook that was
    there with the same arguments (the traceback is still printed); close() is registered for the interpreter's exit.
    [kills: crashed not set, the previous hook not called, close() not registered with atexit]"""
    import engine.watchdog as watchdog

    wd = bare_watchdog(monkeypatch, rank=1, world=2)
    calls, registered = [], []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: calls.append(exc))
    monkeypatch.setattr(watchdog.atexit, "register", registered.append)
    wd._hook_exit()
    err = ValueError("boom")
    sys.excepthook(ValueError, err, None)
    assert wd.crashed is True and calls == [(ValueError, err, None)] and registered == [wd.close]
    wd.close()
    assert wd.store.values == {}


def test_close_waits_for_a_beat_in_flight_before_the_goodbye(monkeypatch):
    """Rank 1 of 2 on a fake TCPStore whose read is held (a beat in flight): close() waits for the watchdog thread,
    so the done mark is not written while the beat runs; once the read is let go, close() returns with the thread
    ended and the mark written. [kills: close() not joining the thread]"""
    import torch.distributed as dist

    import engine.watchdog as watchdog

    entered, release = threading.Event(), threading.Event()

    class Store(FakeStore):
        def __init__(self, *args, **kwargs):
            super().__init__()

        def wait(self, keys, timeout):
            pass

        def multi_get(self, keys):
            entered.set()
            release.wait(30)
            return super().multi_get(keys)

    as_rank_1_of_2(monkeypatch, Store)
    wd = watchdog.PeerWatchdog(20.0, interval=0.05)
    try:
        assert entered.wait(10)
        closer = threading.Thread(target=wd.close, daemon=True)
        closer.start()
        closer.join(0.5)
        assert closer.is_alive() and wd.store.values[wd.done[1]] == 0
    finally:
        release.set()
    closer.join(10)
    assert not closer.is_alive() and not wd.thread.is_alive() and wd.store.values[wd.done[1]] == 1


def test_a_counter_that_moved_by_one_restarts_the_silence(monkeypatch):
    """Rank 0 of 2, timeout 10 (fake clock): rank 1's counter read as 1, 2, 3 at t=0, 5, 8, then not again: at t=16 it
    has been silent 8 s, not 11. [kills: a counter counted as moved only once it went up by more than one]"""
    wd = bare_watchdog(monkeypatch, rank=0, world=2, timeout=10)
    for t, hb in ((0.0, [1, 1]), (5.0, [2, 2]), (8.0, [3, 3]), (16.0, [4, 3])):
        wd.now[0] = t
        assert wd._stale(hb, [0, 0]) == [], t
    wd.now[0] = 18.5
    assert wd._stale([5, 3], [0, 0]) == [1]


def test_every_silent_rank_is_named_in_the_one_line(monkeypatch):
    """Rank 0 of 4, timeout 10: ranks 1 and 3 silent for 10.5 s, rank 2 beating: one line naming 1 and 3.
    [kills: only the first silent rank named]"""
    wd = bare_watchdog(monkeypatch, rank=0, world=4, timeout=10)
    for r in (1, 2, 3):
        wd.store.add(wd.hb[r], 1)
    assert wd._beat() is None
    wd.now[0] = 10.5
    wd.store.add(wd.hb[2], 1)
    assert wd._beat() == "no heartbeat from rank(s) 1, 3 for over 10 s: dead, or its node is unreachable"


def test_the_beat_runs_on_a_daemon_helper(monkeypatch):
    """The helper a blocked beat is left on (rank 0's store frozen) is a daemon: it must not hold the process at its
    exit once the watchdog has given up on it. [kills: the helper made a non-daemon thread]"""
    wd = bare_watchdog(monkeypatch, rank=1, world=2, timeout=0.3)
    release, seen = threading.Event(), []

    def blocked():
        seen.extend((t.name, t.daemon) for t in threading.enumerate() if t is threading.current_thread())
        release.wait(30)

    monkeypatch.setattr(wd, "_beat", blocked)
    try:
        assert wd._beat_in_time().endswith("stopped answering (no reply within 0.3 s)")
    finally:
        release.set()
    assert seen == [("peer-watchdog-beat", True)]


# --------------------------------------------------------------------------------------------- start_peer_watchdog


@pytest.fixture
def initialized(monkeypatch):
    """torch.distributed initialized for a world of 2 under the env:// rendezvous; PeerWatchdog records its timeouts."""
    import torch.distributed as dist

    import engine.watchdog as watchdog

    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(watchdog, "_watchdog", None)
    monkeypatch.setattr(watchdog, "PeerWatchdog", lambda timeout: made.append(timeout) or ("watchdog", timeout))
    return made


def test_start_reads_moe_peer_timeout_when_no_timeout_is_given(initialized, monkeypatch):
    """No argument: $MOE_PEER_TIMEOUT (7.5) is the watchdog's timeout; a bad value is refused, not replaced by 30.
    [kills: the default used instead of the environment]"""
    import engine.watchdog as watchdog

    monkeypatch.setenv("MOE_PEER_TIMEOUT", "7.5")
    assert watchdog.start_peer_watchdog() == ("watchdog", 7.5) and initialized == [7.5]
    monkeypatch.setattr(watchdog, "_watchdog", None)
    monkeypatch.setenv("MOE_PEER_TIMEOUT", "soon")
    with pytest.raises(watchdog.PeerTimeoutError):
        watchdog.start_peer_watchdog()


def test_start_needs_master_addr_and_starts_one_watchdog_a_process(initialized, monkeypatch):
    """Without MASTER_ADDR (no env:// store to beat in) there is no watchdog; with it the first call starts one and a
    second call returns that one without starting another. [kills: MASTER_ADDR not checked, the watchdog started
    not kept]"""
    import engine.watchdog as watchdog

    monkeypatch.delenv("MASTER_ADDR")
    assert watchdog.start_peer_watchdog(5.0) is None and initialized == []
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    first = watchdog.start_peer_watchdog(5.0)
    assert first == ("watchdog", 5.0) and watchdog.start_peer_watchdog(6.0) is first and initialized == [5.0]


# ------------------------------------------------------------------------------------------------- engine/proc.py


def test_print_error_gives_the_writer_120_s_and_its_start_30_s(monkeypatch):
    """Under the launcher the detached writer waits for the launcher at most 120 s (its third argument), and starting
    it may take at most 30 s; a start that times out still gets the line written now, once.
    [kills: LAUNCHER_WAIT_S changed, subprocess.run without its timeout, a TimeoutExpired not caught]"""
    import engine.proc as proc

    events = streams(monkeypatch, 4242)
    monkeypatch.setattr(proc.subprocess, "run", lambda argv, **kw: events.append(("run", argv[-1], kw["timeout"])))
    proc.print_error("error: bad value")
    assert [e for e in events if e[1] != "flush"] == [("run", "120", 30)]

    events = streams(monkeypatch, 4242)

    def times_out(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    monkeypatch.setattr(proc.subprocess, "run", times_out)
    proc.print_error("error: bad value")
    assert [e for e in events if e[1] != "flush"] == [("stderr", "error: bad value"), ("stderr", "\n")], events


def test_launcher_pid_needs_the_module_as_a_whole_argument():
    """A parent whose one argument merely contains 'deepspeed.launcher.launch' (a shell's `-c` command line that starts
    the launcher, say) is not the launcher: None. [kills: the name looked for in the joined command line]"""
    child = "import os; from engine.proc import launcher_pid; print(launcher_pid(), os.getppid())"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    p = subprocess.run([sys.executable, "-c", parent, "python -u -m deepspeed.launcher.launch --world_info=x"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    pid, ppid = p.stdout.split()
    assert pid == "None" and ppid != str(os.getpid()), p.stdout + p.stderr


def test_the_writer_s_limit_is_its_argument_in_seconds():
    """A launcher that does not end, a 1 s limit: nothing in the first half second, the line well before 6 s (a limit
    read as 10 x its argument would write it at 10 s). [kills: the deadline scaled]"""
    from test_proc import start_writer

    launcher = subprocess.Popen(["sleep", "60"])
    try:
        writer = start_writer(launcher.pid, 1.0)
        t0 = time.monotonic()
        assert writer.wait(timeout=10) == 0
        assert read_until_eof(writer.stderr, 0.4) == b""
        assert read_until_eof(writer.stderr, 6.0 - (time.monotonic() - t0)) == b"error: bad value\n"
    finally:
        launcher.kill()
        launcher.wait()


EXIT = "import sys\nfrom engine.proc import exit_now\nexit_now(CODE)\n"


@pytest.mark.parametrize("code, rc, err", [("''", 1, "\n"), ("0.0", 1, "0.0\n"), ("False", 0, ""), ("None", 0, "")])
def test_exit_now_ends_as_sys_exit_would_for_falsy_codes(tmp_path, code, rc, err):
    """exit_now(code) ends with the status sys.exit(code) ends with: '' and 0.0 are falsy but not 0 for sys.exit (it
    prints them and ends with 1), False and None are 0. [fails if: every falsy code ends with 0 through os._exit
    (the bug: a main() returning '' or 0.0 was a success)]"""
    script = tmp_path / "prog.py"
    script.write_text(EXIT.replace("CODE", code))
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (rc, err), p.stderr

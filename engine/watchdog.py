"""The peer watchdog every training rank starts (engine/parallel.py: init_distributed; docs/multinode.md, 'When a
node dies'): it ends this rank within about MOE_PEER_TIMEOUT seconds of another rank dying or its node vanishing.

Why: a killed rank closes its sockets, so the survivors' next collective fails at once (measured: the job exits
~3 s after a kill -9). A node that powers off, panics or drops off the network closes nothing; the survivors then
wait inside a collective until its timeout, and the collectives that hang run on groups DeepSpeed creates itself
(ZeRO-3 / expert-data-parallel groups, torch.distributed new_group without a timeout), which take torch's default:
30 min on gloo, 10 min on NCCL, whatever deepspeed.init_distributed(timeout=...) or DEEPSPEED_TIMEOUT says.
Shortening every collective's timeout would also kill healthy jobs whose ranks wait on one another legitimately
(a slow checkpoint write).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta

PEER_TIMEOUT_ENV = "MOE_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 30.0
KEY_PREFIX = "moe_engine_watchdog"


class PeerTimeoutError(ValueError):
    """$MOE_PEER_TIMEOUT is not a number: the message is one line (what, where, how to fix)."""


class PeerWatchdog:
    """Every rank bumps a counter in the job's rendezvous store (rank 0's TCPStore at MASTER_ADDR:MASTER_PORT,
    through its own client connection) every `interval` seconds from a thread, and reads everyone's counters. A
    counter that has not moved for `timeout` seconds, or a store that stops answering (rank 0's node is gone), ends
    this rank with one line on stderr and exit 1; its launcher then ends the node's other ranks and pdsh returns.
    The thread runs while the main thread waits in a collective or writes a checkpoint, so a busy rank is never
    taken for a dead one. At a clean exit each rank marks itself done, and rank 0, which serves the store, waits
    for the others' marks before it goes.
    """

    def __init__(self, timeout: float = DEFAULT_PEER_TIMEOUT, interval: float | None = None):
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = float(timeout)
        self.interval = interval or max(0.5, min(5.0, self.timeout / 6))
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=self.timeout), wait_for_workers=False)
        self.hb = [f"{KEY_PREFIX}/hb/{r}" for r in range(self.world)]
        self.done = [f"{KEY_PREFIX}/done/{r}" for r in range(self.world)]
        self.stopping = threading.Event()
        self.crashed = False
        self.store.add(self.done[self.rank], 0)
        self.store.add(self.hb[self.rank], 1)
        self.last = {r: (None, time.monotonic()) for r in range(self.world)}
        self.thread = threading.Thread(target=self._run, name="peer-watchdog", daemon=True)
        self.thread.start()
        self._hook_exit()

    def _hook_exit(self) -> None:
        """An unhandled exception leaves at once, waiting for no one; a clean exit runs close()."""
        hook = sys.excepthook

        def excepthook(*exc):
            self.crashed = True
            hook(*exc)

        sys.excepthook = excepthook
        atexit.register(self.close)

    def _read(self) -> tuple[list[int], list[int]]:
        vals = self.store.multi_get(self.hb + self.done)
        nums = [int(v) for v in vals]
        return nums[: self.world], nums[self.world:]

    def _stale(self, hb: list[int], done: list[int]) -> list[int]:
        now, out = time.monotonic(), []
        for r in range(self.world):
            seen, since = self.last[r]
            if hb[r] != seen:
                self.last[r] = (hb[r], now)
            elif r != self.rank and not done[r] and now - since > self.timeout:
                out.append(r)
        return out

    def _die(self, why: str) -> None:
        if self.stopping.is_set():
            return
        print(f"[rank {self.rank}] {why}; ending this rank (docs/multinode.md, 'When a node dies')",
              file=sys.stderr, flush=True)
        os._exit(1)

    def _run(self) -> None:
        try:  # every rank starts its watchdog right after the rendezvous
            self.store.wait(self.hb, timedelta(seconds=self.timeout))
        except Exception:
            return self._die(f"not every rank started its peer watchdog within {self.timeout:g} s")
        while not self.stopping.wait(self.interval):
            why = self._beat_in_time()
            if why:
                return self._die(why)

    def _beat_in_time(self) -> str | None:
        """_beat, given `timeout` seconds to finish. A TCPStore client call to a server that neither answers nor
        closes the connection (rank 0's node frozen or cut off) blocks for good whatever the store's timeout
        (torch 2.13, add and get against a SIGSTOPped server: still blocked after 40 s with a 3 s timeout), so the
        calls run on a helper thread and this one stops waiting for it."""
        out: list = []
        helper = threading.Thread(target=lambda: out.append(self._beat()), name="peer-watchdog-beat", daemon=True)
        helper.start()
        helper.join(self.timeout)
        if helper.is_alive():
            return (f"the rendezvous store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (rank 0) "
                    f"stopped answering (no reply within {self.timeout:g} s)")
        return out[0] if out else None

    def _beat(self) -> str | None:
        """Bump this rank's counter and read everyone's: why this rank must end, or None."""
        try:
            self.store.add(self.hb[self.rank], 1)
            hb, done = self._read()
        except Exception as e:
            return (f"the rendezvous store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (rank 0) "
                    f"stopped answering ({str(e).splitlines()[0][:120]})")
        stale = self._stale(hb, done)
        if stale:
            return (f"no heartbeat from rank(s) {', '.join(map(str, stale))} for over {self.timeout:g} s: dead, "
                    "or its node is unreachable")
        return None

    def close(self) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.thread.join()
        if self.crashed:
            return
        try:
            self.store.add(self.done[self.rank], 1)
            if self.rank == 0:
                self._serve_until_done()
        except Exception:
            pass

    def _serve_until_done(self) -> None:
        """Rank 0 serves the store: keep it up until every other rank has finished (or gone silent)."""
        while True:
            hb, done = self._read()
            if all(done) or self._stale(hb, done):
                return
            time.sleep(0.2)


_watchdog: PeerWatchdog | None = None
MAX_PEER_TIMEOUT = 7 * 86400.0  # a week; the store's timedelta and its C++ int take no more (inf crashed every rank)


def peer_timeout() -> float:
    """$MOE_PEER_TIMEOUT in seconds, else 30."""
    raw = os.environ.get(PEER_TIMEOUT_ENV, str(DEFAULT_PEER_TIMEOUT))
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= MAX_PEER_TIMEOUT:  # NaN too: it fails every comparison
        raise PeerTimeoutError(f"{PEER_TIMEOUT_ENV}={raw!r}: expected seconds from 0 (0 turns the peer watchdog "
                               f"off) to {MAX_PEER_TIMEOUT:.0f}")
    return value


def start_peer_watchdog(timeout: float | None = None) -> PeerWatchdog | None:
    """Start the peer watchdog once per process, after torch.distributed is initialized. Timeout in seconds:
    the argument, else $MOE_PEER_TIMEOUT, else 30; 0 turns it off. A world of one needs none."""
    global _watchdog
    import torch.distributed as dist

    if timeout is None:
        timeout = peer_timeout()
    if (_watchdog is None and timeout > 0 and dist.is_initialized() and dist.get_world_size() > 1
            and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):  # the env:// rendezvous store
        _watchdog = PeerWatchdog(timeout)
    return _watchdog

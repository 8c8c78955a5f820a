"""How a bin/ program ends: its error line, and its exit (torch-free at import, so bin/check_cluster's host checks
stay quick)."""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from typing import NoReturn

LAUNCHER_MODULE = "deepspeed.launcher.launch"  # what DeepSpeed's runner starts on every node; it starts the ranks
LAUNCHER_WAIT_S = 120  # the most an error line waits for the launcher to end (it ends 1-2 s after a rank fails)

# Run as `python -I -S -c AFTER_LAUNCHER PID LINE`: leaves its starter at once (the fork) so that the launcher's
# process-tree kill of a still-running rank cannot reach it, waits for process PID to end, writes LINE to stderr.
AFTER_LAUNCHER = """
import os, select, sys, time
if os.fork():
    os._exit(0)
pid, line, deadline = int(sys.argv[1]), sys.argv[2], time.monotonic() + float(sys.argv[3])
try:
    fd = os.pidfd_open(pid)
    select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
except (AttributeError, OSError):  # no pidfd (kernel < 5.3): look for the process every 20 ms
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
os.write(2, (line + "\\n").encode())
"""


def print_error(line: str) -> None:
    """Write `line` (one `error: ...` line) to stderr so that it is the last line of the run's output.

    Under the `deepspeed` launcher a rank that fails is followed by the launcher's own log lines: once it sees the
    exit code (it looks every second) `deepspeed.launcher.launch` logs "Killing subprocess N" and "[ERROR] ... exits
    with return code = 2" on stdout, then exits. So a rank whose stderr is the one the launcher gave it hands the
    line to a small detached process that writes it the moment that launcher has exited (the runner, `deepspeed`,
    writes nothing after it). Elsewhere (no launcher; stderr captured by a test or redirected, as the test rank pool
    does) the line is written now. Either way it goes to this process's stderr, once.
    """
    launcher = launcher_pid()
    if launcher is None or sys.stderr is not sys.__stderr__:
        print(line, file=sys.stderr, flush=True)
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", AFTER_LAUNCHER, str(launcher), line, str(LAUNCHER_WAIT_S)],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, timeout=30,
                       check=True)
    except (OSError, subprocess.SubprocessError):  # could not hand it over: say it now rather than never
        print(line, file=sys.stderr, flush=True)


def launcher_pid() -> int | None:
    """The pid of the DeepSpeed launcher that started this process (its parent), or None (Linux's /proc only)."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    return parent if LAUNCHER_MODULE.encode() in argv else None


def exit_now(code) -> NoReturn:
    """End a finished program (bin/*: `exit_now(main())`) without the interpreter's teardown.

    Python's own exit then spends 1-3 CPU-seconds per process freeing torch's, transformers' and DeepSpeed's
    modules one by one (measured: a CPU rank's last atexit handler to its exit, 2-3 s; `import torch` plus the
    DeepSeek-V3 model class alone, 2.2 s), which nothing needs once the work is on disk. Everything a normal exit
    does that matters still happens, in the same order: other non-daemon threads are joined, the atexit handlers
    run (the peer watchdog's goodbye, logging's flush), stdout and stderr are flushed; then the process ends with
    0. Only a normal return comes here: an exception leaves the usual way.

    A failure code (a refusal, a data error; anything sys.exit would not end with 0) also leaves the usual way:
    the launcher ends every other rank as soon as one exits non-zero, and a refusing rank that left at once cut
    off rank 0 while it printed the one-line error (test_resume.py's damaged checkpoint through the launcher). So
    does a run under a profiler or tracer (`python -m cProfile`, coverage), which writes its results at exit.
    """
    # sys.exit ends with 0 only for None and an integer 0 (False too); any other value, falsy ones such as '' or 0.0
    # included, is printed and ends with 1
    if not (code is None or isinstance(code, int) and code == 0) or sys.getprofile() is not None \
            or sys.gettrace() is not None:
        sys.exit(code)
    # The interpreter's own first step: threading's exit hooks, then every non-daemon thread joined. A thread pool
    # (concurrent.futures; inductor compiles in one) ends its idle workers only from its hook, so joining them
    # without it waited forever: a cold-cache `train.compile: true` run hung after its last line.
    threading._shutdown()  # noqa: SLF001 (what Py_Finalize calls; public API has no equivalent)
    atexit._run_exitfuncs()  # noqa: SLF001 (the handlers sys.exit would run; os._exit skips them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)

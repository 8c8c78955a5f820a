"""How a finished bin/ program ends (torch-free at import, so bin/check_cluster's host checks stay quick)."""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


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
    if code or sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # noqa: SLF001 (the handlers sys.exit would run; os._exit skips them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)

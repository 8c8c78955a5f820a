"""engine/proc.py exit_now: a bin/ program's end without the interpreter's teardown keeps what a normal exit does."""
import subprocess
import sys

from conftest import ROOT, env

PROGRAM = """
import atexit, sys, threading, time
from engine.proc import exit_now

def late_write():
    time.sleep(0.3)
    open(sys.argv[1], "w").write("written")

print("buffered line")  # stdout is a pipe here: block-buffered until flushed
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=late_write).start()  # not a daemon: a normal exit waits for it
exit_now(CODE)
"""


def run(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM.replace("CODE", code))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "out.txt")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=60)


def test_exit_now_joins_threads_runs_atexit_and_flushes(tmp_path):
    """A finished run (code 0 or None) leaves through os._exit: what a normal exit does must still happen."""
    p = run(tmp_path, "0")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["buffered line", "atexit ran"]
    assert (tmp_path / "out.txt").read_text() == "written"


def test_exit_now_takes_codes_as_sys_exit_does(tmp_path):
    """A failure code leaves the usual way (sys.exit), so a refusing rank never outruns rank 0's error line."""
    assert run(tmp_path, "None").returncode == 0
    p = run(tmp_path, "3")
    assert p.returncode == 3 and p.stdout.splitlines() == ["buffered line", "atexit ran"], p.stderr
    p = run(tmp_path, "'bad thing'")
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == "bad thing"


def test_engine_proc_does_not_import_torch():
    """bin/check_cluster imports it before its host checks, which run without torch."""
    p = subprocess.run([sys.executable, "-c", "import sys, engine.proc; print('torch' in sys.modules)"], cwd=ROOT,
                       env=env(), capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "False", p.stderr


def test_exit_now_leaves_the_usual_way_under_a_profiler(tmp_path):
    """`python -m cProfile -o F bin/X` writes F at the interpreter's exit: it must still be written."""
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM.replace("CODE", "0"))
    p = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "prof.out"), str(script),
                        str(tmp_path / "out.txt")], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "prof.out").stat().st_size > 0 and (tmp_path / "out.txt").read_text() == "written"

"""engine/proc.py: exit_now (a bin/ program's end without the interpreter's teardown keeps what a normal exit does),
print_error (the one error line, last, under the launcher) and launcher_pid."""
import os
import select
import subprocess
import sys
import time

import pytest

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
from concurrent.futures import ThreadPoolExecutor  # an idle pool's workers (as inductor's compile leaves) end at exit
pool = ThreadPoolExecutor(2)  # kept alive, as inductor keeps its own
pool.submit(time.sleep, 0.01).result()
exit_now(CODE)
"""


def run(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM.replace("CODE", code))
    # PYTHONUNBUFFERED off (empty), as in a plain shell: stdout is a pipe, so its lines wait in the buffer until flushed
    return subprocess.run([sys.executable, str(script), str(tmp_path / "out.txt")], cwd=ROOT,
                          env=env(PYTHONUNBUFFERED=""), capture_output=True, text=True, timeout=60)


def test_exit_now_joins_threads_runs_atexit_and_flushes(tmp_path):
    """A finished run (code 0 or None) leaves through os._exit: what a normal exit does must still happen, an idle
    thread pool's workers ended too (joined without threading's exit hook, they waited forever). [fails if: exit_now
    skips threading's shutdown, the atexit handlers or the flush of stdout]"""
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


def test_exit_now_leaves_the_usual_way_under_a_tracer(tmp_path):
    """`python -m trace --count --summary` (as coverage does, a tracer set with sys.settrace) writes its report
    after the program's SystemExit: it must still be written. [fails if: exit_now checks for a profiler only]"""
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM.replace("CODE", "0"))
    p = subprocess.run([sys.executable, "-m", "trace", "--count", "--summary", "-C", str(tmp_path / "cover"),
                        str(script), str(tmp_path / "out.txt")], cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    # the report after the program's output, the atexit handlers at the interpreter's exit after it
    assert lines[0] == "buffered line" and lines[-1] == "atexit ran", p.stdout
    assert "lines   cov%   module   (path)" in lines, p.stdout
    assert (tmp_path / "out.txt").read_text() == "written"


def test_exit_now_ends_with_0_when_stdout_is_closed(tmp_path):
    """A program that closed sys.stdout still ends with 0 and no traceback: the final flush of a closed stream
    (ValueError) is skipped like one that fails (OSError). [fails if: only OSError is caught around the flush]"""
    script = tmp_path / "prog.py"
    script.write_text("import sys\nfrom engine.proc import exit_now\nsys.stdout.close()\nexit_now(0)\n")
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "")


def launch_pretrain(tmp_path, port: int, max_steps: int):
    """bin/pretrain.py on 2 ranks through the real launcher, stdout and stderr in one stream as a terminal shows them:
    the process and its non-blank lines."""
    from conftest import DEEPSPEED

    cmd = [DEEPSPEED, "--master_port", str(port), "--num_gpus", "2", str(ROOT / "bin" / "pretrain.py"),
           "--deepspeed_config", str(ROOT / "ds_configs" / "zero3.json"), "--max_steps", str(max_steps),
           "--run_dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    return p, [line for line in p.stdout.splitlines() if line.strip()]


def test_a_refused_launch_ends_with_its_error_line(tmp_path):
    """Through the real launcher, 2 ranks refusing a bad recipe value in preflight: the launcher's lines ("Killing
    subprocess", "[ERROR] ... exits with return code = 2") come first, the one `error:` line last (engine/proc.py:
    print_error), and the exit code stays 2."""
    from conftest import free_port

    p, lines = launch_pretrain(tmp_path, free_port(), max_steps=0)
    assert p.returncode == 2, p.stdout[-3000:]
    assert "exits with return code = 2" in p.stdout, p.stdout[-3000:]  # the launcher did print its lines
    assert [line for line in lines if "error:" in line] == [lines[-1]], p.stdout[-3000:]
    assert lines[-1].startswith("error: recipe ") and "train.max_steps: must be >= 1, got 0" in lines[-1], lines[-1]
    assert not (tmp_path / "run").exists()


def test_a_taken_master_port_is_one_line(tmp_path):
    """Rank 0 cannot listen on --master_port (another process holds it): instead of torch's EADDRINUSE traceback,
    one `error:` line naming the port and the fix, last, exit 2; the launcher stops the other rank, which was waiting
    for rank 0."""
    import socket

    from conftest import free_port

    port = free_port()
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", port))
        holder.listen()
        p, lines = launch_pretrain(tmp_path, port, max_steps=1)
    assert p.returncode == 2, p.stdout[-3000:]
    assert [line for line in lines if "error:" in line] == [lines[-1]], p.stdout[-3000:]
    assert lines[-1].startswith(f"error: --master_port {port} is taken on {socket.gethostname()}: "), lines[-1]
    assert "Traceback" not in p.stdout, p.stdout[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_print_error_without_a_launcher_writes_at_once(capfd):
    from engine.proc import print_error

    print_error("error: something")
    assert capfd.readouterr().err == "error: something\n"


class Stream:
    """A stand-in for sys.stdout or sys.stderr that records its writes and flushes in one shared list."""

    def __init__(self, name: str, events: list):
        self.name, self.events = name, events

    def write(self, text: str) -> int:
        self.events.append((self.name, text))
        return len(text)

    def flush(self) -> None:
        self.events.append((self.name, "flush"))


def streams(monkeypatch, launcher: int | None) -> list:
    """sys.stdout and sys.stderr replaced by Streams, stderr the process's own (sys.__stderr__) as under the launcher;
    launcher_pid() returns `launcher`. The list the streams record into."""
    import engine.proc as proc

    events = []
    err = Stream("stderr", events)
    monkeypatch.setattr(sys, "stdout", Stream("stdout", events))
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "__stderr__", err)
    monkeypatch.setattr(proc, "launcher_pid", lambda: launcher)
    return events


def test_print_error_under_the_launcher_flushes_then_hands_the_line_to_a_detached_writer(monkeypatch):
    """A rank whose stderr is its own under the launcher: stdout and stderr are flushed first (what the rank wrote
    comes before the launcher's lines), then the line and the launcher's pid go to AFTER_LAUNCHER in a process
    detached from the rank's process group (setsid), its exit status checked: nothing is written now. [fails if: the
    flush is skipped, the writer's arguments are swapped, it stays in the rank's process group, or its exit status
    is not checked]"""
    import engine.proc as proc

    events = streams(monkeypatch, 4242)
    monkeypatch.setattr(proc.subprocess, "run", lambda argv, **kw: events.append(("run", argv, kw)))
    proc.print_error("error: bad value")
    assert events[:2] == [("stdout", "flush"), ("stderr", "flush")] and len(events) == 3, events
    _, argv, kw = events[2]
    assert argv == [sys.executable, "-I", "-S", "-c", proc.AFTER_LAUNCHER, "4242", "error: bad value",
                    str(proc.LAUNCHER_WAIT_S)]
    assert (kw["start_new_session"], kw["check"], kw["stdin"], kw["stdout"]) == (True, True, subprocess.DEVNULL,
                                                                                  subprocess.DEVNULL), kw


def test_print_error_without_a_launcher_writes_at_once_to_the_process_s_own_stderr(monkeypatch):
    """No launcher (a plain `python bin/X`), stderr the process's own: the line is written now, no writer started.
    [fails if: the writer is started whenever stderr is the process's own]"""
    import engine.proc as proc

    events = streams(monkeypatch, None)
    monkeypatch.setattr(proc.subprocess, "run", lambda argv, **kw: events.append(("run", argv)))
    proc.print_error("error: bad value")
    assert [e for e in events if e[1] != "flush"] == [("stderr", "error: bad value"), ("stderr", "\n")], events


@pytest.mark.parametrize("python", ["/bin/false", "/nonexistent/python"])
def test_print_error_writes_the_line_itself_when_the_writer_cannot_start(monkeypatch, python):
    """The detached writer exits non-zero (/bin/false: CalledProcessError) or cannot be started (OSError): the
    line is written now rather than never. [fails if: the writer's exit status is not checked, or either error is
    not caught, or the fallback does not write]"""
    import engine.proc as proc

    events = streams(monkeypatch, os.getpid())
    monkeypatch.setattr(proc.sys, "executable", python)
    proc.print_error("error: bad value")
    assert [e for e in events if e[1] != "flush"] == [("stderr", "error: bad value"), ("stderr", "\n")], events


def read_until_eof(pipe, timeout: float) -> bytes:
    """What `pipe` yields until its end or `timeout` seconds."""
    out, end = b"", time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0 and select.select([pipe], [], [], left)[0]:
        chunk = os.read(pipe.fileno(), 4096)
        if not chunk:
            break
        out += chunk
    return out


def start_writer(pid: int, wait_s: float, pidfd: bool = True) -> subprocess.Popen:
    """AFTER_LAUNCHER as print_error starts it; pidfd False: on a Python whose os has no pidfd_open (kernel < 5.3,
    Python < 3.9), where it watches the launcher's /proc entry instead."""
    from engine.proc import AFTER_LAUNCHER

    code = AFTER_LAUNCHER if pidfd else (
        f"import os\ndel os.pidfd_open\nexec(compile({AFTER_LAUNCHER!r}, '<after_launcher>', 'exec'))")
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", code, str(pid), "error: bad value", str(wait_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("pidfd", [True, False])
def test_the_detached_writer_writes_the_line_to_stderr_once_the_launcher_has_ended(pidfd):
    """AFTER_LAUNCHER (as print_error starts it): its starter returns at once (the writer is a forked child), nothing
    is written while the launcher runs, the line and its newline go to stderr as soon as the launcher ends (well
    before the 120 s limit), with os.pidfd_open and without it (the /proc entry watched instead).
    [fails if: the starter waits for the launcher, the line is written before the launcher ends, goes to stdout, or
    lacks its newline; without pidfd_open: the AttributeError not caught, the /proc entry not looked at]"""
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        writer = start_writer(launcher.pid, 120, pidfd)
        assert writer.wait(timeout=10) == 0
        assert read_until_eof(writer.stderr, 0.5) == b""
        launcher.kill()
        launcher.wait()
        assert read_until_eof(writer.stderr, 20) == b"error: bad value\n"
        assert read_until_eof(writer.stdout, 5) == b""
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize("pidfd", [True, False])
def test_the_detached_writer_waits_for_the_launcher_no_longer_than_its_limit(pidfd):
    """A launcher that does not end: the line is written after the limit (0.5 s here; LAUNCHER_WAIT_S in use), the
    launcher still running, with os.pidfd_open and without it. [fails if: the wait has no limit; the /proc loop
    without the deadline]"""
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        writer = start_writer(launcher.pid, 0.5, pidfd)
        assert writer.wait(timeout=10) == 0
        assert read_until_eof(writer.stderr, 20) == b"error: bad value\n"
        assert launcher.poll() is None
    finally:
        launcher.kill()
        launcher.wait()


CHILD = "import os; from engine.proc import launcher_pid; print(launcher_pid(), os.getppid())"


def test_launcher_pid_is_the_parent_only_when_it_runs_the_deepspeed_launcher():
    """A process whose parent's command line has the argument deepspeed.launcher.launch (as `python -u -m
    deepspeed.launcher.launch ...`) gets the parent's pid; one started by any other process (this test) gets None.
    [fails if: the process's own command line is read instead of its parent's, or any parent counts]"""
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}], check=True)"
    p = subprocess.run([sys.executable, "-c", parent, "-m", "deepspeed.launcher.launch"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=60)
    pid, ppid = p.stdout.split()
    assert pid == ppid and pid != str(os.getpid()), p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["None", str(os.getpid())], p.stdout + p.stderr


def test_launcher_pid_is_none_when_the_parent_cannot_be_read(monkeypatch):
    """A parent outside this process's pid namespace (getppid() is 0) has no /proc entry: no launcher.
    [fails if: an unreadable parent counts as the launcher]"""
    import engine.proc as proc

    monkeypatch.setattr(proc.os, "getppid", lambda: 0)
    assert proc.launcher_pid() is None


STUCK = """
import os, signal, threading, time
from engine.parallel import dump_stacks_on_sigusr1

def waiting_in_a_collective():
    time.sleep(30)

dump_stacks_on_sigusr1()
threading.Thread(target=waiting_in_a_collective, daemon=True).start()
time.sleep(0.2)
os.kill(os.getpid(), signal.SIGUSR1)
print("went on", flush=True)
"""


def test_sigusr1_prints_every_threads_stack_and_the_rank_goes_on(tmp_path):
    """What init_distributed sets up on every rank (docs/multinode.md, troubleshooting: a job that makes no progress)."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "went on\n", p.stderr
    assert "in waiting_in_a_collective" in p.stderr and "Current thread" in p.stderr, p.stderr

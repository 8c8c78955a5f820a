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
from concurrent.futures import ThreadPoolExecutor  # an idle pool's workers (as inductor's compile leaves) end at exit
pool = ThreadPoolExecutor(2)  # kept alive, as inductor keeps its own
pool.submit(time.sleep, 0.01).result()
exit_now(CODE)
"""


def run(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM.replace("CODE", code))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "out.txt")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=60)


def test_exit_now_joins_threads_runs_atexit_and_flushes(tmp_path):
    """A finished run (code 0 or None) leaves through os._exit: what a normal exit does must still happen, an idle
    thread pool's workers ended too (joined without threading's exit hook, they waited forever)."""
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

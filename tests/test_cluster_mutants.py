"""engine/cluster.py's own rules, one a test, each a change to cluster.py (a mutant) that every other fast test let
through: the hostfile's 'HOST slots=N' spacing and a file that is not UTF-8, which .deepspeed_env files count and what
wins over the launch directory's PYTHONPATH, the forwarded MV2/PYTHON prefixes, `ssh -G`'s keepalive read, the probe
run locally and over SSH (its directory, exports with $VAR expanded, master arguments, timeouts, a result after other
output, a silent failure), the probe script itself (NCCL_SOCKET_IFNAME's prefix / '=' / '^' forms, the master address
and port binds, the engine hash, torch failing), judge()'s reference host, required packages, Python compared and the
table rows, the launcher's command line, the hang path (SIGKILL to its own session), _tail, the argument defaults and
main() from the hostfile to the verdict. Then the bugs it found (a comment glued to the slot count, a quote in a
.deepspeed_env value, one host probed with exports the runner does not send, an unreadable file, a byte-order mark).

No launcher, no SSH, no torch: the probe script is executed in this process with a fake `torch` module (and a fake
`engine` package where the hash is the point); SSH is replaced by bash running the remote script here; the launcher
by a shell script or a fake Popen. The only sockets are binds on 127.0.0.1 (and one refused on 192.0.2.1, an address
this machine does not have), as the probe itself does. Expectations are literal values. The bracket at the end of a
docstring says which mutant the test kills."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import cluster
from engine.cluster import Host, InputError, judge, parse_args, parse_hostfile, read_deepspeed_env, remote_exports

A, B, C = "10.124.0.2", "10.124.0.3", "10.124.0.4"
PROBE = {"python": "3.11.9", "torch": "2.5.1", "deepspeed": "0.16.4", "transformers": "4.47.0",
         "engine": "checkout (aaaa1111)", "gpus": 8, "gpu_name": "H100"}
SSH_FIX = "set up passwordless SSH from this machine (docs/multinode.md, 'SSH between nodes')"


def probe(**changes) -> dict:
    return {**PROBE, **changes}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------- hostfile


def test_a_host_glued_to_its_slots_is_not_a_host_line(tmp_path):
    """'10.124.0.2slots=8' (the space lost) is not 'HOST slots=N': DeepSpeed's pattern needs whitespace there too.
    [fails if: HOST_RE takes \\s* instead of \\s+ between the host and 'slots=']"""
    f = write(tmp_path / "hosts", f"{A}slots=8\n")
    with pytest.raises(InputError) as e:
        parse_hostfile(f)
    assert str(e.value) == f"hostfile {f}: line 1: '{A}slots=8' is not 'HOST slots=N'"


def test_a_hostfile_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path):
    """A byte UTF-8 cannot decode is an InputError naming the file and the byte's offset (19: after the 19 characters of
    the first line), never UnicodeDecodeError. [fails if: read_text stops catching UnicodeDecodeError, or names the
    end of the bad byte (e.end, 20) instead of its start]"""
    f = tmp_path / "hosts"
    f.write_bytes(f"{A} slots=8\n".encode() + b"\xff slots=8\n")
    with pytest.raises(InputError) as e:
        parse_hostfile(f)
    assert str(e.value) == f"{f}: not UTF-8 text (byte 19); write it as plain text"


# ---------------------------------------------------------------------------------------------- .deepspeed_env


def test_a_folder_named_deepspeed_env_is_not_read(tmp_path, monkeypatch):
    """DeepSpeed's runner reads .deepspeed_env only when it is a file (os.path.isfile): a folder of that name is
    skipped, not an IsADirectoryError. [fails if: deepspeed_env_files keeps paths that merely exist]"""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / cluster.DS_ENV_NAME).mkdir()
    write(tmp_path / cluster.DS_ENV_NAME, "NCCL_TEST_X=1\n")
    assert cluster.deepspeed_env_files(tmp_path) == [tmp_path / cluster.DS_ENV_NAME]
    assert remote_exports(tmp_path)["NCCL_TEST_X"] == "1"


def test_mv2_and_python_variables_are_forwarded(tmp_path, monkeypatch):
    """The runner forwards every variable starting with MV2 or PYTHON (EXPORT_ENVS), not only PYTHONPATH.
    [fails if: MV2 or PYTHON is left out of the forwarded prefixes]"""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MV2_USE_CUDA", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    env = remote_exports(tmp_path)
    assert (env["MV2_USE_CUDA"], env["PYTHONWARNINGS"]) == ("1", "ignore")


def test_a_pythonpath_in_deepspeed_env_wins(tmp_path, monkeypatch):
    """The runner adds the launch directory to PYTHONPATH first and reads .deepspeed_env after: a PYTHONPATH written
    there is what the nodes get. [fails if: PYTHONPATH is set after the .deepspeed_env files are applied]"""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    write(tmp_path / cluster.DS_ENV_NAME, "PYTHONPATH=/opt/mine\n")
    assert remote_exports(tmp_path)["PYTHONPATH"] == "/opt/mine"


# ---------------------------------------------------------------------------------------------- ssh -G


def fake_ssh_g(monkeypatch, stdout: str | None = None, raises: Exception | None = None) -> list:
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        if raises is not None:
            raise raises
        return SimpleNamespace(stdout=stdout, returncode=0)

    monkeypatch.setattr(cluster.subprocess, "run", run)
    return calls


def test_ssh_g_keepalive_is_read_from_its_own_line_with_the_port(monkeypatch):
    """`ssh -G -p PORT host` prints one 'key value' a line: serveraliveinterval 0 (not the first line) reads as 0.
    [fails if: the -p option is left out of ssh -G, or the line is searched without re.M (only the first line)]"""
    calls = fake_ssh_g(monkeypatch, "user root\nport 2222\nserveraliveinterval 0\nserveralivecountmax 3\n")
    assert cluster.ssh_server_alive(B, 2222) == 0
    assert calls == [["ssh", "-G", "-p", "2222", B]]


def test_ssh_g_without_a_keepalive_line_is_unknown(monkeypatch):
    """No serveraliveinterval line: None (unknown), not 0, so no keepalive note is given on a guess.
    [fails if: a missing line reads as 0]"""
    fake_ssh_g(monkeypatch, "user root\nport 22\n")
    assert cluster.ssh_server_alive(B, None) is None


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory: 'ssh'"),
                                   subprocess.TimeoutExpired(["ssh"], 10)], ids=["no-ssh", "timeout"])
def test_ssh_g_that_cannot_run_is_unknown(monkeypatch, error):
    """ssh missing (OSError) or hanging: None, not a traceback. [fails if: OSError is not caught]"""
    fake_ssh_g(monkeypatch, raises=error)
    assert cluster.ssh_server_alive(B, None) is None


# ---------------------------------------------------------------------------------------------- probe_host

ECHO = ('import json, os, sys\nprint("PROBE_RESULT " + json.dumps({"cwd": os.getcwd(), '
        '"v": os.environ.get("NCCL_TEST_V"), "argv": sys.argv[1:]}))\n')


def test_the_local_probe_runs_in_the_launch_directory_with_the_exports_and_master(tmp_path, monkeypatch):
    """One host: the probe runs here, in the launch directory, with the exports, and node 0 gets the master address
    and port as arguments. [fails if: the local probe drops cwd, the exports, or the master arguments]"""
    monkeypatch.setattr(cluster, "PROBE", ECHO)
    monkeypatch.chdir("/")
    got = cluster.probe_host(Host("localhost", 1, 1), tmp_path, {"NCCL_TEST_V": "x y"}, True, ("127.0.0.1", 29500),
                             None, 5)
    assert got == {"cwd": str(tmp_path), "v": "x y", "argv": ["127.0.0.1", "29500"]}


def test_the_remote_probe_exports_as_the_runner_does(tmp_path, monkeypatch):
    """Over SSH (bash here): `export K=V;` with the runner's double quotes, so $HOME expands on the node and a space
    survives; then cd into the launch directory. [fails if: the exports are shlex-quoted (no $VAR expansion) or
    dropped from the remote script]"""
    monkeypatch.setattr(cluster, "PROBE", ECHO)
    monkeypatch.setattr(cluster, "ssh_cmd", lambda host, command, port, timeout: ["bash", "-c", command])
    monkeypatch.setenv("HOME", "/home/node")
    got = cluster.probe_host(Host(B, 1, 2), tmp_path, {"NCCL_TEST_V": "$HOME/a b"}, False, None, None, 5)
    assert got == {"cwd": str(tmp_path), "v": "/home/node/a b", "argv": []}


def fake_run_timeout(monkeypatch) -> list:
    timeouts = []

    def run(cmd, **kw):
        timeouts.append(kw["timeout"])
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(cluster.subprocess, "run", run)
    return timeouts


def test_a_local_probe_that_hangs_is_one_line(tmp_path, monkeypatch):
    """The local probe gets 300 s, then fails in one line saying so. [fails if: the 300 s leaves the message]"""
    timeouts = fake_run_timeout(monkeypatch)
    assert cluster.probe_host(Host("localhost", 1, 1), tmp_path, {}, True, None, None, 5) == {
        "error": "probe did not finish in 300 s"}
    assert timeouts == [300]


def test_a_remote_probe_that_hangs_is_one_line(tmp_path, monkeypatch):
    """Over SSH: the connect timeout plus 300 s, then 'no answer over SSH'. [fails if: the SSH timeout message
    changes]"""
    timeouts = fake_run_timeout(monkeypatch)
    assert cluster.probe_host(Host(B, 1, 2), tmp_path, {}, False, None, None, 7) == {
        "error": "no answer over SSH within the timeout"}
    assert timeouts == [307]


def remote(monkeypatch, tmp_path, script: str) -> dict:
    monkeypatch.setattr(cluster, "ssh_cmd", lambda host, command, port, timeout: ["bash", "-c", script])
    return cluster.probe_host(Host(B, 8, 2), tmp_path, {}, False, None, None, 5)


def test_a_silent_ssh_failure_still_names_ssh(tmp_path, monkeypatch):
    """ssh exiting 255 with nothing on stderr: 'ssh exited 255' stands in for its message.
    [fails if: the stand-in for an empty stderr changes]"""
    assert remote(monkeypatch, tmp_path, "exit 255") == {"error": f"SSH failed (ssh exited 255); {SSH_FIX}"}


def test_a_probe_that_exits_0_without_its_result_fails(tmp_path, monkeypatch):
    """Exit 0 but no PROBE_RESULT line (a profile script that exits, a wrong python): a failed probe quoting the last
    line, not an AttributeError. [fails if: the missing result line is not checked]"""
    assert remote(monkeypatch, tmp_path, "echo hello") == {"error": "probe failed with exit 0: hello"}


def test_a_probe_that_fails_silently_says_no_output(tmp_path, monkeypatch):
    """A failing probe with no output at all: 'no output', so the line still ends in something readable.
    [fails if: the empty-output stand-in changes]"""
    assert remote(monkeypatch, tmp_path, "exit 1") == {"error": "probe failed with exit 1: no output"}


def test_the_result_line_is_found_after_other_output(tmp_path, monkeypatch):
    """A login banner or warning printed before the result does not hide it. [fails if: PROBE_RESULT is searched
    without re.M, so only at the start of the output]"""
    got = remote(monkeypatch, tmp_path, "echo 'Warning: banner'; echo 'PROBE_RESULT {\"hostname\": \"n1\"}'")
    assert got == {"hostname": "n1"}


# ---------------------------------------------------------------------------------------------- the probe script


def fake_torch(gpus=2, error: Exception | None = None) -> types.ModuleType:
    def count():
        if error is not None:
            raise error
        return gpus

    t = types.ModuleType("torch")
    t.cuda = SimpleNamespace(device_count=count, get_device_name=lambda i: "H100")
    return t


def run_probe(monkeypatch, capsys, argv=(), ifname=None, torch=None, engine_dir=None) -> dict:
    """cluster.PROBE executed here as `python -c PROBE *argv` would run it, with a fake torch (and engine)."""
    monkeypatch.setattr(sys, "argv", ["-c", *argv])
    if ifname is None:
        monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    else:
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", ifname)
    monkeypatch.setitem(sys.modules, "torch", torch or fake_torch())
    if engine_dir is not None:
        fake = types.ModuleType("engine")
        fake.__path__ = [str(engine_dir)]
        monkeypatch.setitem(sys.modules, "engine", fake)
    capsys.readouterr()
    exec(compile(cluster.PROBE, "<probe>", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("PROBE_RESULT "), out
    return json.loads(out[0][len("PROBE_RESULT "):])


@pytest.mark.skipif(not Path("/sys/class/net/lo").exists(), reason="needs Linux's /sys/class/net/lo")
@pytest.mark.parametrize("ifname, ok", [
    ("lo", True), ("l", True), ("=lo", True), ("=l", False), ("nosuch0", False), ("nosuch0,lo", True), ("^lo", True),
])
def test_nccl_socket_ifname_is_matched_as_nccl_matches_it(monkeypatch, capsys, ifname, ok):
    """NCCL reads NCCL_SOCKET_IFNAME as prefixes ('l' matches lo), '=' for an exact name ('=l' matches nothing),
    '^' to exclude (always satisfiable), a comma list matching if any entry does.
    [fails if: '=' is matched as a prefix, plain names exactly, every list entry must match, or '^' is not exempt]"""
    got = run_probe(monkeypatch, capsys, ifname=ifname)["ifname"]
    assert (got["value"], got["ok"]) == (ifname, ok) and "lo" in got["interfaces"]


def test_the_master_port_taken_on_node_0_is_found(monkeypatch, capsys):
    """Node 0's probe binds the master address (port 0: the address is its own) and then the master port: a port held
    by another socket is 'not free', with the OS's reason. [fails if: the port bind is skipped (port 0 twice), the
    two verdicts swap keys, or the check needs more arguments than address and port]"""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        got = run_probe(monkeypatch, capsys, argv=("127.0.0.1", str(port)))
    assert (got["master_addr_local"], got["master_port_free"], got["master_port_free_error"]) == (
        True, False, "Address already in use")


def test_a_master_address_not_on_node_0_is_found(monkeypatch, capsys):
    """192.0.2.1 (TEST-NET-1) is no address of this machine: master_addr_local False, with the OS's reason; a free
    port on an own address is free; other nodes get no master check. [fails if: the master check needs more
    arguments than the address and the port]"""
    got = run_probe(monkeypatch, capsys, argv=("192.0.2.1", "29500"))
    assert (got["master_addr_local"], got["master_addr_local_error"]) == (False, "Cannot assign requested address")
    got = run_probe(monkeypatch, capsys, argv=("127.0.0.1", "0"))
    assert (got["master_addr_local"], got["master_port_free"]) == (True, True)
    assert "master_addr_local" not in run_probe(monkeypatch, capsys)  # other nodes: no master check


def engine_pkg(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "engine"
    pkg.mkdir(parents=True)
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_the_engine_hash_follows_file_names_and_bytes_not_the_checkout_path(tmp_path, monkeypatch, capsys):
    """sha256 over each .py's path relative to the package, then its bytes: a.py holding 'x = 1\\n' is dc676514
    wherever the checkout lies; the same bytes as b.py hash differently.
    [fails if: the file names leave the hash, or the absolute paths enter it]"""
    def engine_hash(pkg):
        return run_probe(monkeypatch, capsys, engine_dir=pkg)["engine"].rsplit(" ", 1)[1]

    assert engine_hash(engine_pkg(tmp_path / "one", {"a.py": "x = 1\n"})) == "(dc676514)"
    assert engine_hash(engine_pkg(tmp_path / "two", {"a.py": "x = 1\n"})) == "(dc676514)"
    assert engine_hash(engine_pkg(tmp_path / "three", {"b.py": "x = 1\n"})) == "(af2cb482)"


def test_torch_failing_to_count_gpus_is_none_with_its_error(monkeypatch, capsys):
    """torch raising while counting GPUs: gpus None (judge fails it) and the error, never 0 GPUs (CPU ranks).
    [fails if: a torch error reads as 0 GPUs]"""
    got = run_probe(monkeypatch, capsys, torch=fake_torch(error=RuntimeError("driver")))
    assert (got["gpus"], got["torch_error"]) == (None, "RuntimeError('driver')")
    assert (run_probe(monkeypatch, capsys)["gpus"], run_probe(monkeypatch, capsys)["gpu_name"]) == (2, "H100")


# ---------------------------------------------------------------------------------------------- judge


def test_differences_name_the_first_host_that_answered():
    """First host unreachable: the versions are compared with the second, and a 'differs' line names it.
    [fails if: the reference host's name is always the first host's]"""
    r = judge([Host(A, 8, 1), Host(B, 8, 2), Host(C, 8, 3)],
              [{"error": "SSH failed (x)"}, probe(), probe(torch="2.4.0")], B, 29500)
    assert r.failures == [f"host {A}: SSH failed (x)",
                          f"host {C}: torch 2.4.0 differs from {B}'s 2.5.1; every node needs the same versions"]


@pytest.mark.parametrize("pkg", ["torch", "deepspeed", "transformers"])
def test_a_package_missing_everywhere_fails_every_host(pkg):
    """A package missing on every node (so no 'differs') still fails each host, named with this Python.
    [fails if: torch or transformers is left out of the required packages]"""
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [probe(**{pkg: None}), probe(**{pkg: None})], A, 29500)
    assert r.failures == [f"host {h}: {pkg} is not installed for {sys.executable}" for h in (A, B)]


def test_a_different_python_fails():
    """The Python version is compared like the packages. [fails if: python is left out of the comparison]"""
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [probe(), probe(python="3.10.12")], A, 29500)
    assert r.failures == [f"host {B}: python 3.10.12 differs from {A}'s 3.11.9; every node needs the same versions"]


def test_the_table_rows_carry_the_probe_values():
    """A row: host, slots, GPUs, the five software versions, the status (a failed host's values are None).
    [fails if: the GPU count leaves the row]"""
    r = judge([Host(A, 8, 1), Host(B, 4, 2)], [probe(), {"error": "SSH failed (x)"}], A, 29500)
    assert r.rows == [
        {"host": A, "slots": 8, "gpus": 8, "python": "3.11.9", "torch": "2.5.1", "deepspeed": "0.16.4",
         "transformers": "4.47.0", "engine": "checkout (aaaa1111)", "status": "ok"},
        {"host": B, "slots": 4, "gpus": None, "python": None, "torch": None, "deepspeed": None, "transformers": None,
         "engine": None, "status": "FAIL"}]


def test_unknown_values_print_as_a_dash(capsys):
    """None in the table prints as '-'. [fails if: None prints as 'None']"""
    cluster.print_table([{"host": B, "slots": 4, "status": "FAIL"}])
    assert [ln.rstrip() for ln in capsys.readouterr().out.splitlines()] == [
        "host        slots  gpus  python  torch  deepspeed  transformers  engine  status",
        "10.124.0.3  4      -     -       -      -          -             -       FAIL"]


# ---------------------------------------------------------------------------------------------- all-reduce


def fake_launcher(tmp_path, monkeypatch, exit_code: int = 0, log: str = "") -> Path:
    script = tmp_path / "deepspeed"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'argv.txt'}\nprintf '{log}'\nexit {exit_code}\n")
    script.chmod(0o755)
    monkeypatch.setattr(cluster, "deepspeed_bin", lambda: str(script))
    return tmp_path / "argv.txt"


def test_the_launcher_gets_the_hostfile_master_ssh_port_and_worker_arguments(tmp_path, monkeypatch):
    """The whole command line: hostfile, master address and port, --ssh_port when given, then bin/check_cluster
    --worker with the size, iterations and timeout. [fails if: --master_addr, --ssh_port, --size_mb or --timeout is
    left out]"""
    argv = fake_launcher(tmp_path, monkeypatch, log="starting\\n")
    cluster.run_allreduce(tmp_path / "hosts", [Host(A, 1, 1), Host(B, 1, 2)], A, 29500, 8.0, 10, 60, 2222)
    assert argv.read_text().splitlines() == [
        "--hostfile", str(tmp_path / "hosts"), "--master_addr", A, "--master_port", "29500", "--ssh_port", "2222",
        str(cluster.CHECK_CLUSTER), "--worker", "--size_mb", "8.0", "--iters", "10", "--timeout", "60"]


def test_a_launcher_exiting_0_without_a_result_fails(tmp_path, monkeypatch):
    """Exit 0 and no result line (the ranks never got to report): a failure, not a JSON error.
    [fails if: the missing result line is not checked]"""
    fake_launcher(tmp_path, monkeypatch, log="starting\\nall ranks exited\\n")
    assert cluster.run_allreduce(tmp_path / "hosts", [Host(A, 1, 1), Host(B, 1, 2)], A, 29500, 8.0, 10, 60, None) == (
        None, "all-reduce over 2 ranks failed (launcher exit 0): all ranks exited")


def test_a_launcher_failing_after_the_result_fails(tmp_path, monkeypatch):
    """A result line, then a rank dying at teardown (launcher exit 1): a failure with the launcher's exit code and the
    error line, not a passed all-reduce. [fails if: a result line is taken whatever the launcher's exit code]"""
    line = f"{cluster.RESULT_TAG} " + json.dumps(RESULT)
    fake_launcher(tmp_path, monkeypatch, exit_code=1, log=line + "\\nRuntimeError: rank 1 died in teardown\\n")
    assert cluster.run_allreduce(tmp_path / "hosts", [Host(A, 8, 1), Host(B, 4, 2)], A, 29500, 8.0, 3, 60, None) == (
        None, "all-reduce over 12 ranks failed (launcher exit 1): RuntimeError: rank 1 died in teardown")


class HangingLauncher:
    """A Popen whose first communicate() times out; records how it was started and what it was asked."""
    made: list = []

    def __init__(self, cmd, **kw):
        self.pid, self.kw, self.waits = 4242, kw, []
        HangingLauncher.made.append(self)

    def communicate(self, timeout=None):
        self.waits.append(timeout)
        if len(self.waits) == 1:
            raise subprocess.TimeoutExpired("deepspeed", timeout)
        return "rank 0 waiting\nRuntimeError: stuck in rendezvous\nstill waiting\n", None


def test_a_hung_launcher_is_killed_by_its_session_with_sigkill(monkeypatch):
    """The launcher runs in its own session; past timeout + 120 s its whole group gets SIGKILL (never SIGTERM, which the
    runner's handler turns into `pkill -f` on every host), and the failure line quotes the log's last error.
    [fails if: the launcher shares our session, is sent SIGTERM, or the message gives the ranks' timeout]"""
    HangingLauncher.made = []
    killed = []
    monkeypatch.setattr(cluster.subprocess, "Popen", HangingLauncher)
    monkeypatch.setattr(cluster.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(cluster, "deepspeed_bin", lambda: "deepspeed")
    got = cluster.run_allreduce(Path("hosts"), [Host(A, 1, 1), Host(B, 1, 2)], A, 29500, 8.0, 10, 60, None)
    assert got == (None, "all-reduce: the launcher did not finish in 180 s (log tail: RuntimeError: stuck in "
                         "rendezvous)")
    (p,) = HangingLauncher.made
    assert (p.kw["start_new_session"], p.waits, killed) == (True, [180, None], [(4242, signal.SIGKILL)])


def test_the_log_tail_is_the_end_of_the_last_error_line():
    """_tail: the last line with an error word (FAIL counts: a rank's watchdog line), else the last line, else 'no
    output'; a long line keeps its last 400 characters. [fails if: FAIL is not an error word, the head of a long line
    is kept, or the empty stand-in changes]"""
    assert cluster._tail("FAIL rank 1 on n1: all-reduce did not finish in 60 s\nteardown\n") == (
        "FAIL rank 1 on n1: all-reduce did not finish in 60 s")
    assert cluster._tail("RuntimeError: " + "x" * 500) == "x" * 400
    assert cluster._tail("one\ntwo\n") == "two"
    assert cluster._tail("\n  \n") == "no output"


# ---------------------------------------------------------------------------------------------- arguments, main


def test_the_argument_defaults():
    """As documented in --help: 64 MiB, 10 iterations, 120 s per rank, SSH ConnectTimeout 5 s, the all-reduce on.
    [fails if: a default changes]"""
    a = parse_args(["--hostfile", "h"])
    assert (a.size_mb, a.iters, a.timeout, a.connect_timeout, a.no_allreduce, a.master_addr, a.master_port,
            a.ssh_port) == (64.0, 10, 120, 5, False, None, None, None)


def test_one_host_takes_the_given_master_address():
    """--master_addr applies to one host too (127.0.0.1 only when it is left out). [fails if: one host always gets
    127.0.0.1]"""
    args = parse_args(["--hostfile", "h", "--master_addr", "10.0.0.5", "--master_port", "29500"])
    assert cluster.master_address(args, [Host(A, 8, 1)]) == ("10.0.0.5", 29500)


def cluster_dir(tmp_path, monkeypatch, hosts: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path / "hosts", hosts)


def test_no_pdsh_for_several_hosts_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """Several hosts and no pdsh: one line saying what to install, exit 1, no host probed.
    [fails if: pdsh is not required, its package is named openssh-client, or the missing tool is ignored or exits 2]"""
    cluster_dir(tmp_path, monkeypatch, f"{A} slots=1\n{B} slots=1\n")
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "pdsh" else f"/usr/bin/{tool}")
    monkeypatch.setattr(cluster, "probe_host", lambda *a: pytest.fail("a host was probed"))
    monkeypatch.setattr(cluster, "ssh_server_alive", lambda *a: pytest.fail("ssh -G ran"))
    assert cluster.main(["--hostfile", "hosts"]) == 1
    assert capsys.readouterr() == ("", "check_cluster: pdsh is not installed on this machine; the deepspeed launcher "
                                       "needs it for several hosts (apt-get install -y pdsh)\n")


RESULT = {"world_size": 12, "nodes": 2, "backend": "nccl", "bytes": 8 * 2**20, "iters": 3, "seconds": 0.004,
          "algbw_gbs": 2.097, "busbw_gbs": 3.845, "correct": True, "got": [78.0, 78.0], "expected": 78.0}


def fake_cluster(monkeypatch, probes: dict, allreduce=(RESULT, None)) -> dict:
    """main()'s collaborators replaced: ssh/pdsh present, keepalive 5, probes by host name, the all-reduce's answer."""
    seen = {"probes": [], "allreduce": []}
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(cluster, "ssh_server_alive", lambda host, port: 5)

    def fake_probe(host, cwd, exports, local, master, ssh_port, timeout):
        seen["probes"].append((host.name, ssh_port, timeout))
        return probes[host.name]

    def fake_allreduce(*a):
        seen["allreduce"].append(a)
        return allreduce

    monkeypatch.setattr(cluster, "probe_host", fake_probe)
    monkeypatch.setattr(cluster, "run_allreduce", fake_allreduce)
    return seen


def test_main_passes_the_arguments_on_and_prints_launch_notes_first(tmp_path, monkeypatch, capsys):
    """A cluster that passes: exit 0, 'cluster OK'; the probes get --ssh_port and --connect_timeout, the all-reduce the
    hostfile, --size_mb, --iters, --timeout and --ssh_port; the launcher's notes come before judge's.
    [fails if: the probes get --timeout as their SSH timeout, the all-reduce gets --connect_timeout, the notes are
    appended after judge's]"""
    cluster_dir(tmp_path, monkeypatch, f"{A} slots=8\n{B} slots=4\n")
    seen = fake_cluster(monkeypatch, {A: probe(), B: probe()})
    code = cluster.main(["--hostfile", "hosts", "--master_port", "29500", "--size_mb", "8", "--iters", "3",
                         "--timeout", "30", "--connect_timeout", "7", "--ssh_port", "2222"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert sorted(seen["probes"]) == [(A, 2222, 7), (B, 2222, 7)]
    (call,) = seen["allreduce"]
    assert call[0].resolve() == (tmp_path / "hosts").resolve()
    assert call[1:] == ([Host(A, 8, 1), Host(B, 4, 2)], A, 29500, 8.0, 3, 30, 2222)
    notes = [ln.split(":", 2)[1].strip() for ln in out.splitlines() if ln.startswith("note: ")]
    assert notes == ["--master_addr not given", f"host {B}", "slots differ between nodes (8, 4)"], out
    assert out.splitlines()[-1] == "cluster OK"


def test_no_allreduce_skips_it(tmp_path, monkeypatch, capsys):
    """--no_allreduce: the hosts are checked, the all-reduce is not run. [fails if: the flag's test is inverted]"""
    cluster_dir(tmp_path, monkeypatch, f"{A} slots=8\n{B} slots=8\n")
    seen = fake_cluster(monkeypatch, {A: probe(), B: probe()})
    assert cluster.main(["--hostfile", "hosts", "--master_addr", A, "--no_allreduce"]) == 0
    assert seen["allreduce"] == [] and capsys.readouterr().out.splitlines()[-1] == "cluster OK"


def test_a_failed_all_reduce_fails_the_cluster(tmp_path, monkeypatch, capsys):
    """Hosts fine, the all-reduce failing: its line on stderr and exit 1. [fails if: the all-reduce's failure line is
    dropped from the report]"""
    cluster_dir(tmp_path, monkeypatch, f"{A} slots=8\n{B} slots=8\n")
    line = "all-reduce over 16 ranks failed (launcher exit 1): RuntimeError: boom"
    fake_cluster(monkeypatch, {A: probe(), B: probe()}, allreduce=(None, line))
    assert cluster.main(["--hostfile", "hosts", "--master_addr", A]) == 1
    out, err = capsys.readouterr()
    assert err == f"check_cluster: {line}\n" and out.splitlines()[-1] == "cluster NOT OK: 1 failure(s)"


def test_an_unreachable_host_is_exit_1(tmp_path, monkeypatch, capsys):
    """A host failing its probe: exit 1 (a failing cluster, not bad input), its line on stderr, no all-reduce.
    [fails if: main returns 0 whatever the failures]"""
    cluster_dir(tmp_path, monkeypatch, f"{A} slots=8\n{B} slots=8\n")
    seen = fake_cluster(monkeypatch, {A: probe(), B: {"error": "SSH failed (x)"}})
    assert cluster.main(["--hostfile", "hosts", "--master_addr", A]) == 1
    out, err = capsys.readouterr()
    assert err == f"check_cluster: host {B}: SSH failed (x)\n" and seen["allreduce"] == []
    assert "note: all-reduce skipped: fix the failures above first" in out.splitlines()


# ---------------------------------------------------------------------------------------------- bugs found


def test_a_comment_right_after_the_slot_count_is_a_comment(tmp_path):
    """hostfiles/template: "'#' starts a comment"; DeepSpeed's runner reads 'HOST slots=8#note' as 8 slots, and so does
    the check when the comment holds a space ('slots=8#node 0'). Without one, HOST_RE's greedy (\\S+) slot group
    swallows the comment. [fails if: HOST_RE's slot group can take a '#' (\\S+ instead of [^\\s#]+)]"""
    hosts = parse_hostfile(write(tmp_path / "hosts", f"{A} slots=8#node 0\n{B} slots=8#node1\n{C} slots=8#\n"))
    assert [(h.name, h.slots) for h in hosts] == [(A, 8), (B, 8), (C, 8)]


@pytest.mark.parametrize("line", ['NCCL_DEBUG_FILE=/tmp/a"b', 'PYTHONWARNINGS="ignore a"'])
def test_a_deepspeed_env_value_with_a_double_quote_is_refused(tmp_path, line):
    """add_export sends `export K="<value>";`: a '"' inside ends the quoting early, so the nodes get a syntax error
    or another value than written. Refused before anything is contacted, naming the line.
    [fails if: values are not checked for '"']"""
    f = write(tmp_path / ".deepspeed_env", f"NCCL_IB_DISABLE=1\n{line}\n")
    with pytest.raises(InputError, match="^" + re.escape(f"{f} line 2: ")):
        read_deepspeed_env(f)


def test_one_host_is_probed_without_the_deepspeed_env(tmp_path, monkeypatch, capsys):
    """DeepSpeed's runner reads .deepspeed_env only for a multi-node launch (runner.py: multi_node_exec); one host runs
    with the launching shell's environment, so a NCCL_SOCKET_IFNAME written there for the nodes does not apply.
    [fails if: the one-host probe gets the .deepspeed_env exports]"""
    cluster_dir(tmp_path, monkeypatch, "localhost slots=1\n")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    write(tmp_path / ".deepspeed_env", "NCCL_SOCKET_IFNAME=nosuch0\n")
    got = []
    monkeypatch.setattr(cluster, "probe_host", lambda host, cwd, exports, *a: got.append(exports) or probe(gpus=1))
    cluster.main(["--hostfile", "hosts", "--no_allreduce"])
    assert len(got) == 1 and "NCCL_SOCKET_IFNAME" not in got[0]
    assert "one host: deepspeed runs the ranks with this shell's environment and does not read" in capsys.readouterr().out


def test_an_unreadable_hostfile_is_one_line(tmp_path, monkeypatch):
    """read_text catches only UnicodeDecodeError; a file the user may not read is bad input too (as root every file
    is readable, so the denial is simulated). [fails if: read_text lets OSError through]"""
    f = write(tmp_path / "hosts", f"{A} slots=8\n")

    def denied(self, *a, **kw):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(cluster.Path, "read_text", denied)
    with pytest.raises(InputError, match="Permission denied"):
        parse_hostfile(f)


def test_a_byte_order_mark_in_the_hostfile_is_not_part_of_the_first_host(tmp_path):
    """Editors on Windows write a BOM; DeepSpeed's runner would keep it in the host name. The check should refuse it in
    one line naming line 1 (reading past it would pass a hostfile the runner still breaks on).
    [fails if: the BOM is accepted as part of the host name]"""
    f = tmp_path / "hosts"
    f.write_bytes(b"\xef\xbb\xbf" + f"{A} slots=8\n{B} slots=8\n".encode())
    with pytest.raises(InputError, match=f"hostfile {re.escape(str(f))}: line 1: "):
        parse_hostfile(f)

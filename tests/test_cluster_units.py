"""bin/check_cluster's pieces (engine/cluster.py) that need no cluster: the hostfile and .deepspeed_env rules
tests/test_cluster_config_units.py leaves out, the quoting and SSH command the launcher's way, the remote probe's
failures (its script run by bash in place of ssh), judge()'s verdicts on probe results, the notes, the all-reduce's
outcome (a stand-in launcher script) and the report. The bracket at the end of a docstring says which bent rule the
test fails on."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine import cluster
from engine.cluster import Host, InputError, judge, parse_args, parse_hostfile, read_deepspeed_env, remote_exports

A, B = "10.124.0.2", "10.124.0.3"
PROBE = {"python": "3.11.9", "torch": "2.5.1", "deepspeed": "0.16.4", "transformers": "4.47.0",
         "engine": "checkout (aaaa1111)", "gpus": 8, "gpu_name": "H100"}
SLOTS_RULE = "slots must be a whole number >= 1 (the ranks, i.e. GPUs, to start on that host)"


def hostfile(tmp_path, text: str) -> Path:
    f = tmp_path / "hosts"
    f.write_text(text)
    return f


def env_file(tmp_path, text: str) -> Path:
    f = tmp_path / ".deepspeed_env"
    f.write_text(text)
    return f


def probe(**changes) -> dict:
    return {**PROBE, **changes}


# ---------------------------------------------------------------------------------------------- hostfile


def test_a_missing_hostfile_is_one_line():
    """A hostfile path that names no file is an InputError pointing at the template, not FileNotFoundError.
    [fails if: the is_file check before reading the hostfile is dropped]"""
    with pytest.raises(InputError) as e:
        parse_hostfile("/nonexistent/hosts")
    assert str(e.value) == "hostfile /nonexistent/hosts: no such file (see hostfiles/template)"


def test_a_hostfile_of_bad_lines_only_names_them_not_no_hosts(tmp_path):
    """When every host line is bad, the message is those lines' problems; 'no hosts' is only for a hostfile without
    host lines. [fails if: 'no hosts' is added whenever no host was read]"""
    f = hostfile(tmp_path, f"# one node\n{A} slots=0\n")
    with pytest.raises(InputError) as e:
        parse_hostfile(f)
    assert str(e.value) == f"hostfile {f}: line 2: {A} slots=0: {SLOTS_RULE}"


def test_localhost_alone_is_a_one_node_hostfile(tmp_path):
    """'localhost' is refused only beside other hosts: alone it is this machine (hostfiles/do_1node).
    [fails if: the loopback rule also applies to a hostfile of one host]"""
    hosts = parse_hostfile(hostfile(tmp_path, "localhost slots=8\n"))
    assert [(h.name, h.slots, h.line) for h in hosts] == [("localhost", 8, 1)]


def test_the_loopback_refusal_names_the_loopback_line(tmp_path):
    """The refusal names the line of the loopback host, wherever it stands among the hosts.
    [fails if: the message names the last host instead of the loopback one]"""
    f = hostfile(tmp_path, f"localhost slots=1\n{A} slots=1\n{B} slots=1\n")
    with pytest.raises(InputError) as e:
        parse_hostfile(f)
    assert str(e.value) == (f"hostfile {f}: line 1: localhost in a multi-node hostfile names a different machine on "
                            "every node; use the node's private address")


# ---------------------------------------------------------------------------------------------- .deepspeed_env


def test_a_deepspeed_env_line_without_an_equals_sign_is_refused(tmp_path):
    """A line with a name but no '=' crashes DeepSpeed's runner (ValueError in its split): refused, naming the line.
    [fails if: the '=' check is dropped, keeping only the variable-name check]"""
    f = env_file(tmp_path, "NCCL_IB_DISABLE=1\nNCCL_SOCKET_IFNAME\n")
    with pytest.raises(InputError) as e:
        read_deepspeed_env(f)
    assert str(e.value) == (f"{f} line 2: 'NCCL_SOCKET_IFNAME' is not KEY=VALUE; DeepSpeed's runner reads every line "
                            "as KEY=VALUE (no comments, no blank lines)")


def test_spaces_around_a_deepspeed_env_key_and_value_are_stripped(tmp_path):
    """The runner strips the key and the value (MultiNodeRunner.add_export), so 'KEY = VALUE' is accepted as KEY.
    [fails if: the key is checked without stripping its spaces]"""
    f = env_file(tmp_path, "NCCL_IB_DISABLE = 1\n  NCCL_DEBUG=WARN  \n")
    assert read_deepspeed_env(f) == {"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}


def test_a_deepspeed_env_key_starting_with_a_digit_is_refused(tmp_path):
    """`export 1NCCL=1` is a shell error on every node: a key must be a variable name, which starts with no digit.
    [fails if: the key pattern lets a digit come first]"""
    f = env_file(tmp_path, "1NCCL=1\n")
    with pytest.raises(InputError, match=r"line 1: '1NCCL=1' is not KEY=VALUE"):
        read_deepspeed_env(f)


def test_the_launching_shells_forwarded_variables_reach_the_nodes(tmp_path, monkeypatch):
    """Variables of the launching shell with a forwarded prefix (NCCL_, MLFLOW_, UCX_) are sent to every node, others
    are not. [fails if: NCCL is left out of the forwarded prefixes]"""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.deepspeed_env
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:/tmp/mlruns")
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("CHECK_CLUSTER_TEST_OTHER", "x")
    env = remote_exports(tmp_path)
    assert (env["NCCL_SOCKET_IFNAME"], env["MLFLOW_TRACKING_URI"], env["UCX_TLS"]) == ("eth1", "file:/tmp/mlruns",
                                                                                      "tcp")
    assert "CHECK_CLUSTER_TEST_OTHER" not in env


def test_without_a_pythonpath_the_nodes_get_the_launch_directory_alone(tmp_path, monkeypatch):
    """With no PYTHONPATH in the launching shell, the nodes' PYTHONPATH is the launch directory, with no trailing ':'
    (an empty entry, which Python reads as the current directory). [fails if: ':' is appended to an unset PYTHONPATH]"""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert remote_exports(tmp_path)["PYTHONPATH"] == str(tmp_path)


# ---------------------------------------------------------------------------------------------- SSH


@pytest.mark.parametrize("value, quoted", [
    ("eth1", "eth1"), ("/usr/bin:/bin", "/usr/bin:/bin"), ("INIT,ENV", "INIT,ENV"),
    ("a-b_c@d%e+f=g.h", "a-b_c@d%e+f=g.h"),
    (" eth1 \n", "eth1"), ("a b", '"a b"'), ("$HOME/venv/bin:$PATH", '"$HOME/venv/bin:$PATH"'),
    ("^docker0,lo", '"^docker0,lo"'),
])
def test_exports_are_quoted_as_deepspeeds_runner_quotes_them(value, quoted):
    """The value stripped; double quotes only around a value with a character outside [\\w@%+=:,./-], so a $VAR expands
    on the node as it does under the launcher. [fails if: the value is not stripped, '-' needs quoting, or the value is
    single-quoted (shlex.quote: no $VAR expansion)]"""
    assert cluster.runner_quote(value) == quoted


def test_the_ssh_command_is_the_launchers_batch_mode_one():
    """Never a password prompt (BatchMode, no password auth), a short connect timeout, the port when given.
    [fails if: the -p option is dropped or BatchMode is off]"""
    opts = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "PasswordAuthentication=no"]
    assert cluster.ssh_cmd(A, "true", 2222, 5) == [*opts, "-p", "2222", A, "true"]
    assert cluster.ssh_cmd(A, "true", None, 5) == [*opts, A, "true"]


def remote_probe(monkeypatch, cwd: Path, ssh: list[str] | None = None) -> dict:
    """probe_host for a remote host, the SSH command replaced by bash running the remote script here (or by `ssh`)."""
    monkeypatch.setattr(cluster, "ssh_cmd", lambda host, command, port, timeout: ssh or ["bash", "-c", command])
    return cluster.probe_host(Host(B, 8, 2), cwd, {"NCCL_SOCKET_IFNAME": "^docker0,lo", "NCCL_IB_DISABLE": "1"},
                              False, None, None, 5)


def test_a_node_without_the_launch_directory_is_named(tmp_path, monkeypatch):
    """The remote script's cd fails: the probe says the checkout is missing there, in one line.
    [fails if: the script's exit code for a missing directory and probe_host's disagree]"""
    missing = tmp_path / "missing"
    assert remote_probe(monkeypatch, missing) == {
        "error": f"directory {missing} does not exist there; the launcher cd's into the launch directory on every "
                 "node: same checkout at the same path"}


def test_a_node_without_this_python_is_named(tmp_path, monkeypatch):
    """The remote script finds no executable at this Python's path: the probe says so, without running anything.
    [fails if: the missing-Python exit code is not recognised]"""
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    assert remote_probe(monkeypatch, tmp_path) == {
        "error": "/nonexistent/bin/python not found there; install the same environment at the same path on every node"}


def test_an_ssh_failure_is_its_last_stderr_line_and_the_fix(tmp_path, monkeypatch):
    """ssh exits 255 when it cannot connect or log in: the failure quotes ssh's last line and points at the guide.
    [fails if: exit 255 is not read as an SSH failure]"""
    ssh = ["bash", "-c", "echo 'Warning: x' >&2; echo 'ssh: connect to host n port 22: Connection refused' >&2; "
                         "exit 255"]
    assert remote_probe(monkeypatch, tmp_path, ssh) == {
        "error": "SSH failed (ssh: connect to host n port 22: Connection refused); set up passwordless SSH from this "
                 "machine (docs/multinode.md, 'SSH between nodes')"}


def test_a_probe_that_exits_nonzero_fails_even_after_its_result(tmp_path, monkeypatch):
    """A result line followed by a crash is a failed probe (exit code and the last stderr line), not a result.
    [fails if: a PROBE_RESULT line is taken whatever the exit code]"""
    ssh = ["bash", "-c", "echo 'PROBE_RESULT {\"hostname\": \"n\"}'; echo 'Segmentation fault' >&2; exit 139"]
    assert remote_probe(monkeypatch, tmp_path, ssh) == {"error": "probe failed with exit 139: Segmentation fault"}


# ---------------------------------------------------------------------------------------------- judge


def test_an_unreachable_first_host_is_its_only_failure(tmp_path):
    """The versions are compared with the first host that answered: an unreachable first host is one failure, not a
    'differs' line for every version of the others. [fails if: the reference probe is the first, failed or not]"""
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [{"error": "SSH failed (x)"}, probe()], A, 29500)
    assert r.failures == [f"host {A}: SSH failed (x)"]
    assert [row["status"] for row in r.rows] == ["FAIL", "ok"]


def test_a_missing_package_is_named_with_this_python():
    """A node without deepspeed fails as 'not installed for <this Python>' (and differs from the first node).
    [fails if: the not-installed check is dropped]"""
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [probe(), probe(deepspeed=None)], A, 29500)
    assert r.failures == [f"host {B}: deepspeed is not installed for {sys.executable}",
                          f"host {B}: deepspeed None differs from {A}'s 0.16.4; every node needs the same versions"]


def test_an_engine_that_does_not_import_anywhere_fails():
    """The engine failing to import on every node (the same everywhere, so no 'differs') still fails, with the error.
    [fails if: the engine import check is dropped]"""
    bad = probe(engine=None, engine_error="ModuleNotFoundError('engine')")
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [dict(bad), dict(bad)], A, 29500)
    assert r.failures == [f"host {h}: the engine does not import (ModuleNotFoundError('engine')); launch from the "
                          "checkout or pip install -e it on every node" for h in (A, B)]


def test_cpu_nodes_pass_as_cpu_ranks_with_a_note():
    """Nodes with no GPU at all run CPU ranks: no failure, 'CPU ranks' in the table, one note.
    [fails if: 0 GPUs is read as torch failing to count them]"""
    r = judge([Host(A, 2, 1), Host(B, 2, 2)], [probe(gpus=0), probe(gpus=0)], A, 29500)
    assert r.failures == []
    assert [row["status"] for row in r.rows] == ["CPU ranks", "CPU ranks"]
    assert r.notes == ["no GPUs: the ranks run on the CPU (DeepSpeed's CPU accelerator, gloo); fine for trying the "
                       "pipeline, not for speed"]


def test_a_cpu_node_beside_gpu_nodes_fails():
    """A node seeing no GPU while another has GPUs fails (the job would mix accelerators).
    [fails if: a GPU-less node is taken as CPU ranks whatever the others have]"""
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [probe(), probe(gpus=0)], A, 29500)
    assert r.failures == [f"host {B}: no GPU visible while {A} has GPUs; every node must run the same accelerator"]
    assert r.notes == []


def test_torch_that_cannot_count_gpus_fails_with_its_error():
    """gpus None (torch raised) fails with torch's error. [fails if: the None case is dropped]"""
    r = judge([Host(A, 8, 1)], [probe(gpus=None, torch_error="RuntimeError('driver')")], A, 29500)
    assert r.failures == [f"host {A}: torch failed to count GPUs (RuntimeError('driver'))"]


def test_as_many_gpus_as_slots_pass_and_more_gpus_get_a_note():
    """slots == GPUs passes silently; more GPUs than slots is a note naming the GPUs the launcher uses.
    [fails if: slots == GPUs fails, or the note's last GPU index is slots rather than slots - 1]"""
    r = judge([Host(A, 8, 1), Host(B, 4, 2)], [probe(), probe()], A, 29500)
    assert r.failures == []
    assert r.notes[0] == f"host {B}: 8 GPUs, slots=4: the launcher uses GPUs 0..3"
    assert len(r.notes) == 2 and r.notes[1].startswith("slots differ between nodes (8, 4)")
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [probe(), probe()], A, 29500)
    assert (r.failures, r.notes, [row["status"] for row in r.rows]) == ([], [], ["ok", "ok"])


@pytest.mark.parametrize("ok", [True, False])
def test_an_nccl_interface_that_matches_nothing_fails(ok):
    """NCCL_SOCKET_IFNAME matching none of a node's interfaces fails, naming the ones it has; a match passes.
    [fails if: the interface verdict is inverted]"""
    ifname = {"value": "eth1", "interfaces": ["eth0", "lo"], "ok": ok}
    r = judge([Host(A, 8, 1)], [probe(ifname=ifname)], A, 29500)
    assert r.failures == ([] if ok else [f"host {A}: NCCL_SOCKET_IFNAME=eth1 matches no interface (it has eth0, lo); "
                                         "fix it in .deepspeed_env"])


def test_a_master_address_not_on_the_first_host_is_one_failure():
    """An address the first host does not have also fails the port bind there: only the address is reported.
    [fails if: the port check is not skipped after the address check failed]"""
    p0 = probe(master_addr_local=False, master_addr_local_error="Cannot assign requested address",
               master_port_free=False, master_port_free_error="Cannot assign requested address")
    r = judge([Host(A, 8, 1), Host(B, 8, 2)], [p0, probe()], "10.0.0.9", 29500)
    assert r.failures == [f"--master_addr 10.0.0.9 is not an address of the first host {A} (Cannot assign requested "
                          "address); rank 0 runs there, so pass its private address"]
    r = judge([Host(A, 8, 1)], [probe(master_addr_local=True, master_port_free=False,
                                      master_port_free_error="Address already in use")], A, 29500)
    assert r.failures == [f"--master_port 29500 is taken on {A} (Address already in use); pick another"]


def test_no_cpu_note_while_a_host_failed():
    """The CPU-ranks note is for a cluster whose hosts all answered: a failed host may have the GPUs.
    [fails if: the note ignores failed hosts]"""
    r = judge([Host(A, 2, 1), Host(B, 2, 2)], [probe(gpus=0), {"error": "SSH failed (x)"}], A, 29500)
    assert r.failures == [f"host {B}: SSH failed (x)"] and r.notes == []


# ---------------------------------------------------------------------------------------------- notes, probing


def test_launch_notes(monkeypatch):
    """One host not named as this machine: a note that it runs here anyway. Several hosts: a note when --master_addr
    is left out, and when ssh -G says ServerAliveInterval 0 (not when it cannot tell).
    [fails if: the one-host note is given for localhost, the master_addr note for one host, or the keepalive note
    when ssh -G gave no answer]"""
    alive = {}
    monkeypatch.setattr(cluster, "ssh_server_alive", lambda host, port: alive[host])
    one, two = parse_args(["--hostfile", "h"]), parse_args(["--hostfile", "h", "--master_addr", A])
    assert cluster.launch_notes(one, [Host("localhost", 8, 1)], "127.0.0.1") == []
    assert cluster.launch_notes(one, [Host(A, 8, 1)], "127.0.0.1") == [
        f"one host: deepspeed starts every rank on this machine, without SSH, whatever the hostfile calls it ({A})"]
    hosts = [Host(A, 8, 1), Host(B, 8, 2)]
    for interval, notes in ((None, 0), (5, 0), (0, 1)):
        alive[B] = interval
        got = cluster.launch_notes(two, hosts, A)
        assert len(got) == notes and all(n.startswith(f"ssh has no ServerAliveInterval for {B}:") for n in got), got
    alive[B] = 5
    got = cluster.launch_notes(one, hosts, A)
    assert len(got) == 1 and got[0].startswith(f"--master_addr not given: using the first host, {A}. "), got


def test_only_node_0_checks_the_master_and_one_host_is_probed_locally(monkeypatch):
    """probe_hosts gives the master address and port to the first host's probe only, and probes locally (no SSH)
    exactly when the hostfile has one host. [fails if: every host gets the master to check]"""
    calls = []

    def fake_probe(host, cwd, exports, local, master, ssh_port, timeout):
        calls.append((host.name, local, master))
        return probe()

    monkeypatch.setattr(cluster, "probe_host", fake_probe)
    args = parse_args(["--hostfile", "h"])
    r = cluster.probe_hosts(args, [Host(A, 8, 1), Host(B, 8, 2)], {}, A, 29500)
    assert sorted(calls) == [(A, False, (A, 29500)), (B, False, None)] and r.failures == []
    calls.clear()
    cluster.probe_hosts(args, [Host("localhost", 8, 1)], {}, "127.0.0.1", 29500)
    assert calls == [("localhost", True, ("127.0.0.1", 29500))]


def test_missing_ssh_or_pdsh_matters_only_for_several_hosts(monkeypatch):
    """One host launches here without SSH; several need ssh and pdsh, and the line says what to install.
    [fails if: ssh and pdsh are required for one host too]"""
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None)
    assert cluster.missing_launcher_tool([Host(A, 8, 1)]) is None
    assert cluster.missing_launcher_tool([Host(A, 8, 1), Host(B, 8, 2)]) == (
        "ssh is not installed on this machine; the deepspeed launcher needs it for several hosts (apt-get install -y "
        "openssh-client)")


# ---------------------------------------------------------------------------------------------- arguments


def test_no_hostfile_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """check_cluster without --hostfile: one line on stderr, exit 2. [fails if: the --hostfile check is dropped]"""
    monkeypatch.chdir(tmp_path)
    assert cluster.main([]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "check_cluster: --hostfile is required (e.g. --hostfile hostfiles/do_2node)\n")


def test_master_port_0_is_refused(tmp_path, monkeypatch):
    """Port 0 is not a rendezvous port (it means 'any'): refused. [fails if: the lower port bound is inclusive]"""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    hostfile(tmp_path, f"{A} slots=1\n")
    with pytest.raises(InputError, match="^--master_port 0 is not a port number$"):
        cluster.read_inputs(parse_args(["--hostfile", "hosts", "--master_port", "0"]))


# ---------------------------------------------------------------------------------------------- all-reduce, report


def fake_launcher(tmp_path, monkeypatch, exit_code: int = 0, result: dict | None = None, log: str = "") -> Path:
    """A stand-in for the deepspeed launcher: writes its arguments to argv.txt, prints `log` and the result line."""
    script = tmp_path / "deepspeed"
    line = f"{cluster.RESULT_TAG} {json.dumps(result)}" if result else ""
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'argv.txt'}\nprintf '{log}'\n"
                      f"echo '{line}'\nexit {exit_code}\n")
    script.chmod(0o755)
    monkeypatch.setattr(cluster, "deepspeed_bin", lambda: str(script))
    return tmp_path / "argv.txt"


RESULT = {"world_size": 2, "nodes": 2, "backend": "gloo", "bytes": 8 * 2**20, "iters": 10, "seconds": 0.004,
          "algbw_gbs": 2.097, "busbw_gbs": 2.097, "correct": True, "got": [3.0, 3.0], "expected": 3.0}


def allreduce(tmp_path, hosts):
    return cluster.run_allreduce(tmp_path / "hosts", hosts, A, 29500, 8.0, 10, 60, None)


def test_one_host_skips_the_launchers_ssh_check(tmp_path, monkeypatch):
    """One host: the launcher gets --no_ssh_check (it starts the ranks here); several hosts: not.
    [fails if: --no_ssh_check is not passed for one host]"""
    argv = fake_launcher(tmp_path, monkeypatch, result=RESULT)
    assert allreduce(tmp_path, [Host(A, 2, 1)]) == (RESULT, None)
    assert "--no_ssh_check" in argv.read_text().split()
    assert allreduce(tmp_path, [Host(A, 1, 1), Host(B, 1, 2)]) == (RESULT, None)
    assert "--no_ssh_check" not in argv.read_text().split()


def test_a_wrong_sum_fails_the_all_reduce(tmp_path, monkeypatch):
    """A result whose sum is wrong is returned with a failure line giving both sums.
    [fails if: the correctness verdict is inverted]"""
    wrong = {**RESULT, "correct": False, "got": [3.0, 2.0]}
    fake_launcher(tmp_path, monkeypatch, result=wrong)
    assert allreduce(tmp_path, [Host(A, 1, 1), Host(B, 1, 2)]) == (wrong, "all-reduce: wrong sum ([3.0, 2.0] != 3.0)")


def test_a_failed_launch_names_its_last_error_line(tmp_path, monkeypatch):
    """The launcher failing: the line gives the ranks, the exit code and the last line that reads like an error.
    [fails if: the first error line of the log is quoted instead of the last]"""
    log = "starting\\nRuntimeError: first\\nmore\\nERROR: the last one\\nexiting\\n"
    fake_launcher(tmp_path, monkeypatch, exit_code=1, log=log)
    assert allreduce(tmp_path, [Host(A, 1, 1), Host(B, 2, 2)]) == (
        None, "all-reduce over 3 ranks failed (launcher exit 1): ERROR: the last one")


def test_a_cluster_that_failed_gets_no_all_reduce(monkeypatch):
    """Host failures skip the all-reduce with a note. [fails if: the all-reduce runs despite failures]"""
    monkeypatch.setattr(cluster, "run_allreduce", lambda *a: pytest.fail("the all-reduce ran"))
    report = cluster.Report(failures=["host x: SSH failed"])
    assert cluster.check_allreduce(parse_args(["--hostfile", "h"]), [Host(A, 1, 1)], A, 29500, report) is None
    assert report.notes == ["all-reduce skipped: fix the failures above first"]


def test_the_report_ends_with_the_verdict(capsys):
    """The table, the all-reduce line, notes, then failures on stderr; the last line says OK or counts failures.
    [fails if: the verdict line ignores the failures]"""
    rows = [{"host": A, "slots": 8, "gpus": 8, **{k: PROBE[k] for k in cluster.SOFTWARE}, "status": "ok"}]
    cluster.print_report(cluster.Report(rows=rows, notes=["n1"]), RESULT)
    out, err = capsys.readouterr()
    assert [ln.rstrip() for ln in out.splitlines()] == [
        "host        slots  gpus  python  torch  deepspeed  transformers  engine               status",
        "10.124.0.2  8      8     3.11.9  2.5.1  0.16.4     4.47.0        checkout (aaaa1111)  ok",
        "all-reduce: 2 ranks on 2 node(s), gloo, 8 MiB fp32 x 10: 4.00 ms each, algbw 2.097 GB/s, busbw 2.097 GB/s, "
        "sum correct",
        "note: n1", "cluster OK"] and err == ""
    cluster.print_report(cluster.Report(rows=rows, failures=["f1", "f2"]), None)
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "cluster NOT OK: 2 failure(s)"
    assert err == "check_cluster: f1\ncheck_cluster: f2\n"

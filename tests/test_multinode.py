"""Multi-node through the real path, on one machine: two "droplets" at 127.0.0.2 and 127.0.0.3.

An sshd listens on both addresses (a free port, a throwaway key, a marked block at the top of ~/.ssh/config
that teardown removes), and `deepspeed --hostfile hostfiles/do_2node --master_addr 127.0.0.2` goes the way
it goes between droplets: the runner's ssh check, pdsh over ssh, one launcher per host (node ranks 0 and
1), the environment from .deepspeed_env. Where mount namespaces are allowed, node 1's sshd runs in its own
one with RUN_DIR bind-mounted from another folder, so each node writes its checkpoint shards to its own
disk, as droplets do, and the guide's rsync steps are what makes --resume and the export work.

The commands are docs/multinode.md's `sh` blocks, taken from that file and run as written with the guide's
variables set to this machine's values (VARS: addresses, port, interface, one slot per node). Needs
openssh-server, pdsh and rsync: installed with apt-get when missing; skipped only when that is impossible.
Never signal the deepspeed runner with SIGTERM/SIGINT here: its handler runs `pkill -f` over pdsh for every
DeepSpeed launcher on the hosts, other people's too. Every process is ended by pid (SIGKILL).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import DEEPSPEED, ROOT, env, free_port, port_free_on, read_metrics, run_in_process

from engine.cluster import InputError, parse_hostfile, read_deepspeed_env

NODE0, NODE1, NOWHERE = "127.0.0.2", "127.0.0.3", "127.0.0.9"  # NOWHERE: nothing listens there
HOSTFILE = "hostfiles/do_2node"
GUIDE = ROOT / "docs" / "multinode.md"
# The guide's `sh` blocks, in its order; every one is run below, as written.
BLOCKS = ["vars", "hostfile", "ssh-config", "ssh-check", "sync-code", "deepspeed-env", "check", "launch",
          "sync-checkpoints", "resume"]
RUN = "runs/smoke"  # the guide's smoke launch: the embedded tiny recipe, --max_steps STEPS --checkpoint_every EVERY
LOG_EVERY = 10  # engine/recipes/tiny.yaml: train.log_every


def guide_blocks() -> dict[str, str]:
    """docs/multinode.md's fenced blocks opened with ```sh NAME, by name, in order."""
    return dict(re.findall(r"^```sh (\S+)\n(.*?)^```$", GUIDE.read_text(), re.M | re.S))


STEPS = int(re.search(r"--max_steps (\d+)", guide_blocks().get("launch", "--max_steps 0")).group(1))
EVERY = int(re.search(r"--checkpoint_every (\d+)", guide_blocks().get("launch", "--checkpoint_every 0")).group(1))
SBIN = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
PACKAGES = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client", "pdsh": "pdsh",
            "rsync": "rsync"}


# ---------------------------------------------------------------------------------------------- helpers


def tool(name: str) -> str | None:
    return shutil.which(name, path=SBIN)


def install_missing() -> None:
    missing = sorted({pkg for t, pkg in PACKAGES.items() if tool(t) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"needs {' '.join(missing)} and cannot apt-get them (not root, or no apt-get)")
    e = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *lock, *missing]
    p = subprocess.run(install, env=e, capture_output=True, text=True)
    if p.returncode:
        subprocess.run(["apt-get", "update", "-q", *lock], env=e, capture_output=True, text=True)
        p = subprocess.run(install, env=e, capture_output=True, text=True)
    if p.returncode:
        why = (p.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"apt-get install {' '.join(missing)} failed: {why}")


def wait_listening(addr: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 15) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise AssertionError(f"sshd on {addr}:{port} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection((addr, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"sshd on {addr}:{port} is not listening after {timeout} s: {log.read_text()[-2000:]}")


def ssh_config_block(token: str, port: int, key: Path, known_hosts: Path) -> str:
    # Only what differs from droplets (our sshd's port, a throwaway key, a known-hosts file of our own); the
    # guide's ssh-config block, appended below, brings the rest. At the top: ssh takes the first value it
    # finds for each option. The closing `Host *` hands the rest of the file back to every host.
    return (f"# >>> {token} >>>\n"
            f"Host {NODE0} {NODE1} {NOWHERE}\n"
            f"    Port {port}\n    IdentityFile {key}\n    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {known_hosts}\n"
            f"Host *\n# <<< {token} <<<\n")


def guide_env(cluster) -> dict:
    """The guide's variables with this machine's values: the only difference from the guide's commands. A free
    rendezvous port for each block: a port picked once and reused minutes later by a resume can meanwhile be taken
    (a killed job's leftovers, other work on the host), and then rank 0 fails to listen while node 1 waits out its
    store timeout."""
    return dict(os.environ, NODE0=NODE0, NODE1=NODE1, PORT=str(rendezvous_port(cluster.ssh_port)), IFNAME="lo",
                GPUS="1")


def rendezvous_port(ssh_port: int) -> int:
    for _ in range(5):
        rdv = free_port()
        if rdv != ssh_port and port_free_on(rdv, NODE0):
            return rdv
    return rdv


def run_block(cluster, name: str, **kw) -> subprocess.CompletedProcess:
    """One of the guide's blocks, as written, from the launch directory."""
    return subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", guide_blocks()[name]], cwd=cluster.work,
                          env=guide_env(cluster), **kw)


def edit_ssh_config(change) -> None:
    """Read-modify-write ~/.ssh/config under a lock (other test sessions may edit it too)."""
    d = Path.home() / ".ssh"
    d.mkdir(mode=0o700, exist_ok=True)
    with open(Path("/tmp") / f"moe-engine-ssh-config-{os.geteuid()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cfg = d / "config"
        old = cfg.read_text() if cfg.exists() else None
        new = change(old or "")
        if new:
            cfg.write_text(new)
            cfg.chmod(0o600)
        elif cfg.exists() and old is not None:
            cfg.unlink()


def remove_block(text: str, token: str) -> str:
    start, end = f"# >>> {token} >>>\n", f"# <<< {token} <<<\n"
    i = text.find(start)
    j = text.find(end, i)
    return text if i < 0 or j < 0 else text[:i] + text[j + len(end):]


def proc_cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def proc_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def proc_env(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def procs_in(work: Path) -> list[int]:
    """Our processes: everything running in the launch directory (runner, pdsh, launchers, ranks, probes)."""
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me
            and proc_cwd(int(p)) == str(work)]


def rank_pid(work: Path, rank: int, script: str) -> int | None:
    for pid in procs_in(work):
        cmd = proc_cmdline(pid)
        if script in cmd and "deepspeed.launcher" not in cmd and proc_env(pid).get("RANK") == str(rank):
            return pid
    return None


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def end_job(job: subprocess.Popen | None, work: Path) -> None:
    """SIGKILL, by pid: the runner's session (runner, pdsh, ssh clients), then whatever still runs in `work`."""
    if job is not None and job.poll() is None:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
    for _ in range(3):
        kill(procs_in(work))
        time.sleep(0.2)


def tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


# ---------------------------------------------------------------------------------------------- fixture


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    install_missing()
    tmp = tmp_path_factory.mktemp("multinode")
    token = f"moe-engine tests/test_multinode.py {uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen] = []
    work = tmp / "work"  # the launch directory: looks like the checkout (bin/, ds_configs/, engine/, tests/)
    work.mkdir()
    for d in ("bin", "ds_configs", "engine", "tests"):
        (work / d).symlink_to(ROOT / d)
    (work / "hostfiles").mkdir()  # the guide's hostfile block writes do_2node here
    (work / "runs").mkdir()
    node1_runs = tmp / "node1_disk"  # node 1's own disk, where mount namespaces are allowed
    node1_runs.mkdir()

    key, host_key = tmp / "id_ed25519", tmp / "host_ed25519"
    for k in (key, host_key):
        subprocess.run([tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
    (tmp / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    os.chmod(tmp / "authorized_keys", 0o600)
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # sshd's privilege-separation directory

    probe = tmp / "mount_probe"
    probe.mkdir()
    local_disks = bool(shutil.which("unshare")) and subprocess.run(  # a private mount namespace + a bind mount
        ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$1"', "sh", str(probe)],
        capture_output=True).returncode == 0

    def sshd_config(name: str, *addrs: str) -> Path:
        cfg = tmp / f"sshd_{name}"
        cfg.write_text("".join(f"ListenAddress {a}:{port}\n" for a in addrs) + f"""\
HostKey {host_key}
AuthorizedKeysFile {tmp / 'authorized_keys'}
PidFile none
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
PrintMotd no
MaxStartups 64
LogLevel ERROR
""")
        return cfg

    def start(name: str, cmd: list[str], addr: str) -> subprocess.Popen:
        log = tmp / f"sshd_{name}.log"
        p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(p)
        wait_listening(addr, port, p, log)
        return p

    try:
        for _ in range(5):
            port = free_port()
            if port_free_on(port, NODE0, NODE1):
                break
        sshd = tool("sshd")
        if local_disks:
            start("node0", [sshd, "-D", "-e", "-f", str(sshd_config("node0", NODE0))], NODE0)
            script = f'mount --bind "$1" "$2" && exec "$3" -D -e -f "$4"'
            start("node1", ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(node1_runs),
                            str(work / "runs"), sshd, str(sshd_config("node1", NODE1))], NODE1)
        else:
            start("nodes", [sshd, "-D", "-e", "-f", str(sshd_config("nodes", NODE0, NODE1))], NODE0)
            wait_listening(NODE1, port, procs[0], tmp / "sshd_nodes.log")
        edit_ssh_config(lambda text: ssh_config_block(token, port, key, tmp / "known_hosts") + text)
        c = SimpleNamespace(tmp=tmp, work=work, ssh_port=port, local_disks=local_disks,
                            node1_runs=node1_runs if local_disks else work / "runs", sshd=[p.pid for p in procs])

        def append_guide_ssh_config(text: str) -> str:  # under the lock; marked so that teardown removes it
            run_block(c, "ssh-config", check=True, timeout=30)
            new = (Path.home() / ".ssh" / "config").read_text()
            assert new.startswith(text), "~/.ssh/config changed under the lock"
            return text + f"# >>> {token} guide >>>\n" + new[len(text):] + f"# <<< {token} guide <<<\n"

        edit_ssh_config(append_guide_ssh_config)
        for name in ("hostfile", "ssh-check", "sync-code", "deepspeed-env"):
            p = run_block(c, name, capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, f"guide block {name}: {p.stdout}{p.stderr}"
        print(f"\nsshd on {NODE0} and {NODE1} port {port}; node 1 has its own disk for runs/: {local_disks}")
        yield c
    finally:
        kill(procs_in(work))
        for p in procs:
            kill(q for q in map(int, filter(str.isdigit, os.listdir("/proc"))) if ppid(q) == p.pid)  # sessions
            p.kill()
            p.wait()
        edit_ssh_config(lambda text: remove_block(remove_block(text, token), f"{token} guide"))


def launch(cluster, name: str, log: str) -> subprocess.Popen:
    """The guide's launch block `name`, from the launch directory, in its own session (to SIGKILL it whole)."""
    return subprocess.Popen(["bash", "-eu", "-o", "pipefail", "-c", guide_blocks()[name]], cwd=cluster.work,
                            env=guide_env(cluster), stdout=open(cluster.tmp / log, "w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def wait_for(cond, timeout: float, what: str, job: subprocess.Popen, log: Path) -> None:
    end = time.time() + timeout
    while not cond():
        if job.poll() is not None:
            raise AssertionError(f"the job exited {job.returncode} while waiting for {what}:\n{tail(log)}")
        if time.time() > end:
            raise AssertionError(f"no {what} after {timeout} s:\n{tail(log)}")
        time.sleep(0.2)


def tag(step: int) -> str:
    return f"step_{step:08d}"


def latest(run_dir: Path) -> str | None:
    f = run_dir / "checkpoints" / "latest"
    return f.read_text().strip() if f.is_file() else None


# ---------------------------------------------------------------------------------------------- no cluster


def test_the_guide_blocks_are_the_ones_this_test_runs():
    blocks = guide_blocks()
    assert list(blocks) == BLOCKS  # a block added to the guide must be run here too
    assert re.findall(r"^(\w+)=", blocks["vars"], re.M) == ["NODE0", "NODE1", "PORT", "IFNAME", "GPUS"]
    for name, text in blocks.items():  # addresses (and the port) only through the variables
        assert name == "vars" or not re.search(r"10\.124\.|29500", text), (name, text)
    assert blocks["resume"].strip() == blocks["launch"].strip() + " --resume"
    tiny = yaml.safe_load((ROOT / "engine" / "recipes" / "tiny.yaml").read_text())
    assert tiny["train"]["log_every"] == LOG_EVERY and EVERY % LOG_EVERY == 0
    assert EVERY < STEPS  # the smoke run checkpoints before its end: the kill and resume below need it


def test_shipped_hostfiles_parse():
    hf = ROOT / "hostfiles"
    assert [(h.name, h.slots) for h in parse_hostfile(hf / "do_1node")] == [("localhost", 8)]
    assert [(h.name, h.slots) for h in parse_hostfile(hf / "do_2node")] == [("10.124.0.2", 8), ("10.124.0.3", 8)]
    with pytest.raises(InputError, match="no hosts"):  # the template is all comments until filled in
        parse_hostfile(hf / "template")


def test_hostfile_refusals_and_slot_notes(tmp_path):
    """parse_hostfile: 'localhost' beside other nodes names another machine on each; a slot count int() cannot read
    (str.isdigit takes '²') is one line, not a traceback. judge: slots above the GPUs visible fail; nodes with
    different slots get a note (expert_parallel.autoep_size "auto" would differ between them)."""
    from engine.cluster import Host, judge

    for text, message in ((f"{NODE0} slots=1\nlocalhost slots=1\n", "line 2: localhost in a multi-node hostfile"),
                          (f"{NODE0} slots=²\n", "line 1: 127.0.0.2 slots=²: slots must be a whole number >= 1")):
        (tmp_path / "hosts").write_text(text)
        with pytest.raises(InputError, match=re.escape(message)):
            parse_hostfile(tmp_path / "hosts")
    probe = {"python": "3", "torch": "2", "deepspeed": "0", "transformers": "5", "engine": "ok", "gpus": 4}
    hosts = [Host(NODE0, 8, 1), Host(NODE1, 4, 2)]
    r = judge(hosts, [dict(probe), dict(probe)], NODE0, 29500)
    assert r.failures == [f"host {NODE0}: slots=8 (hostfile line 1) but 4 GPUs visible; set slots=4"], r.failures
    assert any(n.startswith("slots differ between nodes (8, 4)") for n in r.notes), r.notes
    r = judge([Host(NODE0, 4, 1), Host(NODE1, 4, 2)], [dict(probe), dict(probe)], NODE0, 29500)
    assert not r.failures and not any("slots differ" in n for n in r.notes), (r.failures, r.notes)


def test_nodes_with_different_slots_stop_before_deepspeed_groups(tmp_path):
    """DeepSpeed's per-node launcher as pdsh runs it on each node, for a hostfile of slots 2, 1, 1 (4 CPU ranks here):
    "auto" gives autoep_size 2 on the first node and 1 on the others, whose different expert groups hung every rank in
    torch's new_group (the peer watchdog saw live peers). check_ranks_agree stops them with one line on each."""
    import base64
    import json

    info = base64.urlsafe_b64encode(json.dumps({"n0": [0, 1], "n1": [0], "n2": [0]}).encode()).decode()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}",
                               f"--node_rank={k}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               str(ROOT / "bin" / "pretrain.py"), "--deepspeed_config", str(ROOT / "ds_configs" / "zero3.json"),
                               "--max_steps", "2", "--run_dir", str(tmp_path / "run")],
                              cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for k in range(3)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode != 0 for p in procs), outs
    said = "the ranks chose different expert_parallel.autoep_size (1-2) (the nodes run 1 to 2 ranks"
    assert [out.count(said) for out in outs] == [1, 1, 1], outs  # one line per node (rank 0: "error:", the others "error on")


def test_one_droplet_hostfile_command_as_documented(tmp_path):
    """docs/multinode.md's do_1node command (also in the hostfile's header) starts every rank on this machine
    with no ssh; `--include localhost:0,1` takes 2 of its 8 slots, as CPU ranks here."""
    doc = [ln.strip() for ln in GUIDE.read_text().splitlines() if ln.startswith("    deepspeed --hostfile hostfiles/do_1node")]
    header = [ln.lstrip("# ").strip() for ln in (ROOT / "hostfiles" / "do_1node").read_text().splitlines()
              if ln.lstrip("# ").startswith("deepspeed --hostfile hostfiles/do_1node")]
    assert len(doc) == 1 and header == doc, (doc, header)
    argv = doc[0].split()
    assert argv[:2] == ["deepspeed", "--hostfile"]
    argv = [DEEPSPEED, "--include", "localhost:0,1", "--master_port", str(free_port()), *argv[1:],
            "--max_steps", "2", "--run_dir", str(tmp_path / "run")]
    p = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [(r["step"], r["world_size"]) for r in rows] == [(2, 2)]


def test_deepspeed_env_is_key_value_lines_only(tmp_path):
    f = tmp_path / ".deepspeed_env"
    f.write_text("NCCL_SOCKET_IFNAME=eth1\nNCCL_IB_DISABLE=1\nPATH=/root/venv/bin:/usr/bin:/bin\n")
    assert read_deepspeed_env(f) == {"NCCL_SOCKET_IFNAME": "eth1", "NCCL_IB_DISABLE": "1",
                                     "PATH": "/root/venv/bin:/usr/bin:/bin"}
    for bad, line in (("# private network\nNCCL_SOCKET_IFNAME=eth1\n", 1), ("NCCL_IB_DISABLE=1\n\n", 2)):
        f.write_text(bad)
        with pytest.raises(InputError, match=f"line {line}: .* is not KEY=VALUE"):
            read_deepspeed_env(f)


# ---------------------------------------------------------------------------------------------- check_cluster


def check_cluster(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, str(ROOT / "bin" / "check_cluster"), *args], cwd=cwd, env=env(),
                       capture_output=True, text=True, timeout=600)
    print(p.stdout, p.stderr)
    return p


def check_cluster_in_process(cwd: Path, capfd, monkeypatch, *args: str) -> subprocess.CompletedProcess:
    """check_cluster's main in this process, from `cwd` (conftest.run_in_process)."""
    from engine.cluster import main

    p = run_in_process(main, list(args), capfd, monkeypatch, cwd=cwd)
    print(p.stdout, p.stderr)
    return p


def test_check_cluster_prints_the_table_and_bus_bandwidth(cluster):
    p = run_block(cluster, "check", capture_output=True, text=True, timeout=600)
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:8] == ["host", "slots", "gpus", "python", "torch", "deepspeed", "transformers", "engine"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:3]}
    assert set(rows) == {NODE0, NODE1}
    assert all(r[1] == "1" and r[2] == "0" and "CPU" in " ".join(r) for r in rows.values())  # 0 GPUs: CPU ranks
    assert rows[NODE0][3:8] == rows[NODE1][3:8]  # same python, torch, deepspeed, transformers, engine hash
    ar = next(ln for ln in lines if ln.startswith("all-reduce:"))
    assert "2 ranks on 2 node(s), gloo" in ar and "sum correct" in ar, ar
    algbw, busbw = re.search(r"algbw ([0-9.]+) GB/s, busbw ([0-9.]+) GB/s", ar).groups()
    assert busbw == algbw, ar  # busbw = algbw * 2(n-1)/n as nccl-tests reports it: algbw itself for 2 ranks
    assert p.stderr == "" and lines[-1] == "cluster OK"


def test_check_cluster_one_host_runs_locally_without_ssh(cluster, tmp_path):
    (tmp_path / "one").write_text("localhost slots=2\n")
    p = check_cluster(cluster.work, "--hostfile", str(tmp_path / "one"), "--size_mb", "8")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all-reduce: 2 ranks on 1 node(s), gloo" in p.stdout


@pytest.mark.parametrize("text, code, message", [
    (f"{NODE0} slots=1\n{NODE1} slot=1\n", 2, "line 2: '127.0.0.3 slot=1' is not 'HOST slots=N'"),
    (f"{NODE0} slots=0\n{NODE1} slots=1\n", 2, "line 1: 127.0.0.2 slots=0: slots must be a whole number >= 1"),
    (f"{NODE0} slots=1\n{NODE1} slots=1\n{NODE0} slots=1\n", 2, "line 3: host 127.0.0.2 is listed twice"),
    (f"{NODE0} slots=1\n{NOWHERE} slots=1\n", 1, "host 127.0.0.9: SSH failed"),
], ids=["malformed", "slots0", "duplicate", "unreachable"])
def test_check_cluster_bad_hostfile_one_line_and_nonzero_exit(cluster, tmp_path, text, code, message, capfd,
                                                             monkeypatch):
    """bin/check_cluster's main in this process (conftest.run_in_process); its fresh-process runs are the two tests
    above, whose stderr must stay empty."""
    (tmp_path / "hosts").write_text(text)
    p = check_cluster_in_process(cluster.work, capfd, monkeypatch, "--hostfile", str(tmp_path / "hosts"),
                                 "--master_addr", NODE0)
    assert p.returncode == code, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("check_cluster: ") and message in err[0], err


def test_check_cluster_refuses_a_deepspeed_env_the_runner_would_choke_on(tmp_path, capfd, monkeypatch):
    (tmp_path / "hosts").write_text(f"{NODE0} slots=1\n{NODE1} slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("# the private interface\nNCCL_SOCKET_IFNAME=eth1\n")
    p = check_cluster_in_process(tmp_path, capfd, monkeypatch, "--hostfile", "hosts")
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and ".deepspeed_env line 1: '# the private interface' is not KEY=VALUE" in err[0], err


# ---------------------------------------------------------------------------------------------- the job


@pytest.fixture(scope="module")
def job(cluster):
    """The guide's two-node smoke launch (STEPS steps, a checkpoint every EVERY)."""
    state = SimpleNamespace(proc=launch(cluster, "launch", log="job.log"), log=cluster.tmp / "job.log")
    yield state
    end_job(state.proc, cluster.work)


def test_two_node_job_trains_and_checkpoints(cluster, job):
    run0, run1 = cluster.work / RUN, cluster.node1_runs / "smoke"
    wait_for(lambda: latest(run0) == tag(EVERY), 900, f"checkpoint {tag(EVERY)}", job.proc, job.log)
    log = job.log.read_text()
    # The multi-node path: pdsh prefixes each host's lines; one launcher per host, node ranks 0 and 1.
    assert f"{NODE0}: " in log and f"{NODE1}: " in log
    assert "nnodes=2, num_local_procs=1, node_rank=0" in log and "nnodes=2, num_local_procs=1, node_rank=1" in log
    rows = read_metrics(run0)
    assert [r["step"] for r in rows][:EVERY // LOG_EVERY] == list(range(LOG_EVERY, EVERY + 1, LOG_EVERY))
    assert all(r["world_size"] == 2 for r in rows)
    assert rows[EVERY // LOG_EVERY - 1]["loss"] < 6.24 - 1.0  # ln(512) = 6.24 at step 0: it trained
    ck0, ck1 = run0 / "checkpoints" / tag(EVERY), run1 / "checkpoints" / tag(EVERY)
    assert (ck0 / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file() and (ck0 / "rng_rank0.pt").is_file()
    assert (ck1 / "zero_pp_rank_1_mp_rank_00_model_states.pt").is_file() and (ck1 / "rng_rank1.pt").is_file()
    if cluster.local_disks:  # each node wrote its own ranks' shards to its own disk; `latest` is on node 0 only
        assert not (ck0 / "zero_pp_rank_1_mp_rank_00_model_states.pt").exists()
        assert not (ck1 / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists()
        assert not (run1 / "checkpoints" / "latest").exists()


def test_killing_one_rank_ends_the_whole_job_within_60s(cluster, job):
    if job.proc.poll() is not None or latest(cluster.work / RUN) is None:
        pytest.fail(f"the job is not running past its first checkpoint:\n{tail(job.log)}")
    victim = rank_pid(cluster.work, 1, "bin/pretrain.py")
    assert victim, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    try:
        rc = job.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job was still running 60 s after rank 1 was killed:\n{tail(job.log)}")
    took = time.time() - t0
    print(f"kill -9 of rank 1 on {NODE1}: the launcher exited {rc} after {took:.1f} s")
    assert rc != 0
    time.sleep(2)
    left = [p for p in procs_in(cluster.work) if "pretrain" in proc_cmdline(p)]
    assert not left, [proc_cmdline(p) for p in left]  # no rank or launcher left behind on either node
    assert latest(cluster.work / RUN) == tag(EVERY)


def wait_or_dump(p: subprocess.Popen, timeout: float, cluster, log: str) -> int:
    """The launch's exit code; past `timeout`, every rank prints its threads' stacks (SIGUSR1: engine/parallel.py)
    into the log, and the test fails with the log's end. The launch is ended either way."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for r in (0, 1):
            pid = rank_pid(cluster.work, r, "bin/pretrain.py")
            if pid:
                os.kill(pid, signal.SIGUSR1)
        time.sleep(5)
        pytest.fail(f"still running after {timeout} s; the ranks' stacks are at the end:\n{tail(cluster.tmp / log, 20000)}")
    finally:
        end_job(p, cluster.work)


def test_resume_after_syncing_checkpoints_completes(cluster, job):
    if job.proc.poll() is None:
        pytest.fail("the killed job is still running")
    run = cluster.work / RUN
    before = len(read_metrics(run))  # metrics.jsonl is appended to: the killed run's rows come first
    if cluster.local_disks:
        # Without the sync node 1 has no checkpoint: its rank fails its resume check, and the whole job ends with
        # exit 2 and that rank's line (before: rank 0 waited at the rendezvous for torch's 10 min).
        t0 = time.time()
        rc = wait_or_dump(launch(cluster, "resume", log="unsynced.log"), 300, cluster, "unsynced.log")
        log = (cluster.tmp / "unsynced.log").read_text()
        errors = [line for line in log.splitlines() if "error: " in line]
        print(f"--resume before the sync: exit {rc} after {time.time() - t0:.1f} s")
        assert rc != 0 and len(errors) == 1 and "error: rank 1 on " in errors[0], log[-4000:]
        assert "--resume: no checkpoint in runs/smoke/checkpoints" in errors[0], errors
        assert len(read_metrics(run)) == before  # nothing trained
    # The guide's steps for node-local disks, on node 0: gather every node's shards, then give every node
    # the whole checkpoint (`latest`, manifest, rank 0's files) so that each rank's resume check passes.
    run_block(cluster, "sync-checkpoints", check=True, timeout=120)
    resumed_from = latest(run)
    assert (cluster.node1_runs / "smoke" / "checkpoints" / "latest").read_text().strip() == resumed_from
    rc = wait_or_dump(launch(cluster, "resume", log="resume.log"), 600, cluster, "resume.log")
    assert rc == 0, tail(cluster.tmp / "resume.log")
    rows = read_metrics(run)
    start = int(resumed_from.split("_")[1])
    # Only a resume writes these rows: a run from step 0 would start at LOG_EVERY.
    assert [r["step"] for r in rows[before:]] == list(range(start + LOG_EVERY, STEPS + 1, LOG_EVERY)), rows
    assert all(r["world_size"] == 2 for r in rows)
    assert latest(run) == tag(STEPS)


def test_a_frozen_node_ends_the_job_within_60s_with_the_peer_watchdog(cluster):
    """A node that vanishes without closing its connections (power loss, kernel panic, network partition),
    played by SIGSTOP on node 1's rank, its launcher and its ssh session. Without the peer watchdog the
    surviving rank waits in its collective for torch's default group timeout (30 min on gloo); with it
    (every rank starts it, engine/parallel.py) it ends itself within MOE_PEER_TIMEOUT (30 s), and the
    guide's ServerAliveInterval ends node 1's pdsh leg. The guide's smoke launch again, from a clean run dir."""
    for d in (cluster.work / RUN, cluster.node1_runs / "smoke"):
        shutil.rmtree(d, ignore_errors=True)
    job = launch(cluster, "launch", log="frozen.log")
    log = cluster.tmp / "frozen.log"
    frozen: list[int] = []
    try:
        wait_for(lambda: (cluster.work / RUN / "metrics.jsonl").is_file(), 400, "a logged step", job, log)
        pid = rank_pid(cluster.work, 1, "bin/pretrain.py")
        assert pid, "rank 1 not found"
        while pid and not proc_cmdline(pid).startswith("sshd"):  # rank -> launcher -> ... -> its ssh session
            frozen.append(pid)
            pid = ppid(pid)
        frozen.append(pid)
        ancestors, q = set(), pid
        while q > 1:
            ancestors.add(q)
            q = ppid(q)
        assert ancestors & set(cluster.sshd), "the ssh session is not one of our sshd's"
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.time()
        try:
            rc = job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job was still running 60 s after node 1 froze:\n{tail(log)}")
        took = time.time() - t0
        print(f"node 1 frozen: the launcher exited {rc} after {took:.1f} s")
        assert rc != 0
        assert "no heartbeat from rank(s) 1 for over 30 s" in log.read_text()
    finally:
        kill(frozen)
        end_job(job, cluster.work)

"""Cluster checks before a multi-node run (`bin/check_cluster`; the guide is docs/multinode.md).

    bin/check_cluster --hostfile hostfiles/do_2node --master_addr 10.124.0.2

1. The hostfile: the syntax DeepSpeed's runner accepts ("HOST slots=N", # comments), no duplicate host,
   slots >= 1. The `.deepspeed_env` files the runner reads (./ and ~/): one KEY=VALUE a line.
2. Every host over SSH the way the launcher reaches it (BatchMode, short ConnectTimeout), running what the
   launcher runs there: `cd` into this directory, the same exports, this Python (sys.executable).
3. The same software everywhere: Python, torch, deepspeed, transformers, the engine (version + a hash of
   its source), and GPUs against slots (CPU hosts: 0 GPUs, CPU ranks, with a note).
4. An all-reduce over every rank, started by the real `deepspeed` launcher with that hostfile (pdsh over
   SSH for several hosts), reporting bus bandwidth the way nccl-tests does: busbw = algbw * 2(n-1)/n.

Bad input (hostfile, .deepspeed_env, arguments): one line on stderr, exit 2, before anything is contacted.
A failing cluster: one line on stderr per failure, exit 1. The ranks of the all-reduce end themselves after
--timeout seconds, so a blocked port fails the check instead of hanging it.

A tool on top of the runtime: it uses engine/parallel.py for its ranks; nothing in the runtime imports it (the peer
watchdog every training rank starts is engine/watchdog.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK_CLUSTER = ROOT / "bin" / "check_cluster"
RESULT_TAG = "CHECK_CLUSTER_ALLREDUCE"
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
# What DeepSpeed's runner (launcher/runner.py) forwards to remote nodes from the launching shell: variables
# with these prefixes (NCCL only where the accelerator is CUDA), then .deepspeed_env from ~ and from ./.
EXPORT_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
DS_ENV_NAME = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
HOST_RE = re.compile(r"^(\S+)\s+slots=([^\s#]+)\s*(#.*)?$")  # "slots=8#note": 8, then a comment, as the runner reads it


class InputError(ValueError):
    """Bad input: the message is one line (what, where, how to fix); exit 2."""


@dataclass
class Host:
    name: str
    slots: int
    line: int


# ---------------------------------------------------------------------------------------------- input


def parse_hostfile(path: str | Path) -> list[Host]:
    """A DeepSpeed hostfile: "HOST slots=N" lines, blank lines and # comments. Stricter than DeepSpeed's own
    parser, which accepts slots=0 and trailing junk; every problem is raised at once, one line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"hostfile {path}: no such file (see hostfiles/template)")
    hosts: list[Host] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(read_text(path).splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "\ufeff" in line:  # a byte-order mark: the runner would keep it in the host name
            problems.append(f"line {n}: starts with a byte-order mark (U+FEFF), which DeepSpeed's runner reads as "
                            "part of the host name; save the file as UTF-8 without BOM")
            continue
        m = HOST_RE.match(line)
        if not m:
            problems.append(f"line {n}: {line!r} is not 'HOST slots=N'")
            continue
        name, slots = m.group(1), m.group(2)
        if not re.fullmatch(r"[0-9]+", slots) or int(slots) < 1:  # str.isdigit() also takes '²', which int() refuses
            problems.append(f"line {n}: {name} slots={slots}: slots must be a whole number >= 1 "
                            "(the ranks, i.e. GPUs, to start on that host)")
            continue
        if name in seen:
            problems.append(f"line {n}: host {name} is listed twice (first on line {seen[name]}); "
                            "give each node one line with its total slots")
            continue
        seen[name] = n
        hosts.append(Host(name, int(slots), n))
    if not hosts and not problems:
        problems.append("no hosts (add lines like '10.124.0.2 slots=8')")
    if len(hosts) > 1 and any(h.name in LOCAL_NAMES for h in hosts):
        h = next(h for h in hosts if h.name in LOCAL_NAMES)
        problems.append(f"line {h.line}: {h.name} in a multi-node hostfile names a different machine on every "
                        "node; use the node's private address")
    if problems:
        raise InputError(f"hostfile {path}: " + "; ".join(problems))
    return hosts


def deepspeed_env_files(cwd: Path) -> list[Path]:
    """The .deepspeed_env files DeepSpeed's runner reads, in its order (later entries win)."""
    return [p for p in (Path.home() / DS_ENV_NAME, cwd / DS_ENV_NAME) if p.is_file()]


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}); write it as plain text") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e}); check its permissions") from None


def read_deepspeed_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as DeepSpeed's runner reads them: it splits each line at its first '=' and sends
    `export KEY=VALUE;` to every node. A line without '=' (blank, a plain comment) crashes it (ValueError);
    a comment holding an '=' becomes `export # ...;`, which comments out the rest of the remote command
    line, so the job exits 0 having started nothing."""
    out = {}
    for n, line in enumerate(read_text(path).splitlines(keepends=True), 1):
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise InputError(f"{path} line {n}: {line.strip()!r} is not KEY=VALUE; DeepSpeed's runner reads "
                             "every line as KEY=VALUE (no comments, no blank lines)")
        if '"' in value:  # the runner wraps such a value in double quotes, unescaped
            raise InputError(f"{path} line {n}: {key.strip()}'s value holds a double quote, which DeepSpeed's runner "
                             "does not escape (the nodes' command breaks or gets another value); write the value "
                             "without quotes: the runner quotes it")
        out[key.strip()] = value.strip()
    return out


def remote_exports(cwd: Path) -> dict[str, str]:
    """The environment the runner sends to every node: forwarded prefixes, PYTHONPATH with the launch
    directory first, then the .deepspeed_env files."""
    env = {k: v for k, v in os.environ.items() if k.startswith(EXPORT_PREFIXES)}
    env["PYTHONPATH"] = str(cwd) + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    for f in deepspeed_env_files(cwd):
        env.update(read_deepspeed_env(f))
    return env


# ---------------------------------------------------------------------------------------------- probe

# Runs on every host, under the launcher's exports, in the launch directory. Prints one JSON line.
PROBE = r'''
import hashlib, importlib.metadata as md, json, os, socket, sys
out = {"hostname": socket.gethostname(), "python": sys.version.split()[0]}
for pkg in ("torch", "deepspeed", "transformers"):
    try:
        out[pkg] = md.version(pkg)
    except Exception:
        out[pkg] = None
try:
    import engine, pathlib
    src = pathlib.Path(list(engine.__path__)[0]).resolve()  # a namespace package: no __file__
    h = hashlib.sha256()
    for f in sorted(src.rglob("*.py")):
        h.update(str(f.relative_to(src)).encode()); h.update(f.read_bytes())
    try:
        v = md.version("moe-engine")
    except Exception:
        v = "checkout"
    out["engine"] = v + " (" + h.hexdigest()[:8] + ")"
except Exception as e:
    out["engine"] = None
    out["engine_error"] = repr(e)
try:
    import torch
    out["gpus"] = torch.cuda.device_count()
    out["gpu_name"] = torch.cuda.get_device_name(0) if out["gpus"] else None
except Exception as e:
    out["gpus"] = None
    out["torch_error"] = repr(e)
ifname = os.environ.get("NCCL_SOCKET_IFNAME")
if ifname:
    have = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    want = [w for w in ifname.split(",") if w]
    ok = [w for w in want if w.startswith("^") or
          (w[1:] in have if w.startswith("=") else any(i.startswith(w) for i in have))]
    out["ifname"] = {"value": ifname, "interfaces": have, "ok": bool(ok)}
if len(sys.argv) > 2:  # node 0: the master address must be one of its own, the port free
    addr, port = sys.argv[1], int(sys.argv[2])
    for p, key in ((0, "master_addr_local"), (port, "master_port_free")):
        try:
            with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
                s.bind((addr, p))
            out[key] = True
        except OSError as e:
            out[key] = False
            out[key + "_error"] = e.strerror or str(e)
print("PROBE_RESULT " + json.dumps(out), flush=True)
'''


def runner_quote(value: str) -> str:
    """As DeepSpeed's runner quotes an exported value (MultiNodeRunner.add_export): "$VAR" expands remotely."""
    value = value.strip()
    return f'"{value}"' if re.search(r"[^\w@%+=:,./-]", value) else value


def ssh_server_alive(host: str, ssh_port: int | None) -> int | None:
    """ServerAliveInterval that ssh would use for `host` (ssh -G), None if unknown."""
    try:
        p = subprocess.run(["ssh", "-G", *(["-p", str(ssh_port)] if ssh_port else []), host], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^serveraliveinterval (\d+)$", p.stdout, re.M)
    return int(m.group(1)) if m else None


def ssh_cmd(host: str, command: str, ssh_port: int | None, timeout: int) -> list[str]:
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", "-o", "PasswordAuthentication=no"]
    if ssh_port:
        cmd += ["-p", str(ssh_port)]
    return cmd + [host, command]


def probe_host(host: Host, cwd: Path, exports: dict, local: bool, master: tuple[str, int] | None,
               ssh_port: int | None, connect_timeout: int) -> dict:
    """What the launcher will find on `host`. {'error': line} when it can't be reached or lacks this
    directory or this Python."""
    py = sys.executable
    args = [py, "-c", PROBE] + ([master[0], str(master[1])] if master else [])
    if local:
        try:
            p = subprocess.run(args, cwd=cwd, env={**os.environ, **exports}, capture_output=True, text=True,
                               timeout=300)
        except subprocess.TimeoutExpired:
            return {"error": "probe did not finish in 300 s"}
    else:
        script = (" ".join(f"export {k}={runner_quote(v)};" for k, v in exports.items())
                  + f" cd {shlex.quote(str(cwd))} 2>/dev/null || {{ echo NO_CWD; exit 97; }};"
                  + f" test -x {shlex.quote(py)} || {{ echo NO_PYTHON; exit 98; }};"
                  + " " + " ".join(shlex.quote(a) for a in args))
        try:
            p = subprocess.run(ssh_cmd(host.name, script, ssh_port, connect_timeout), capture_output=True,
                               text=True, timeout=connect_timeout + 300, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"error": "no answer over SSH within the timeout"}
        if p.returncode == 255:
            why = (p.stderr.strip().splitlines() or ["ssh exited 255"])[-1]
            return {"error": f"SSH failed ({why}); set up passwordless SSH from this machine "
                             f"(docs/multinode.md, 'SSH between nodes')"}
        if p.returncode == 97:
            return {"error": f"directory {cwd} does not exist there; the launcher cd's into the launch "
                             "directory on every node: same checkout at the same path"}
        if p.returncode == 98:
            return {"error": f"{py} not found there; install the same environment at the same path on "
                             "every node"}
    m = re.search(r"^PROBE_RESULT (.*)$", p.stdout, re.M)
    if p.returncode != 0 or not m:
        tail = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["no output"])[-1]
        return {"error": f"probe failed with exit {p.returncode}: {tail}"}
    return json.loads(m.group(1))


# ---------------------------------------------------------------------------------------------- checks


@dataclass
class Report:
    rows: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


SOFTWARE = ("python", "torch", "deepspeed", "transformers", "engine")


def judge(hosts: list[Host], probes: list[dict], master_addr: str, master_port: int) -> Report:
    r = Report()
    ref = next((p for p in probes if "error" not in p), None)
    ref_host = hosts[probes.index(ref)].name if ref else None
    gpu_hosts = [h.name for h, p in zip(hosts, probes) if (p.get("gpus") or 0) > 0]
    for i, (h, p) in enumerate(zip(hosts, probes)):
        row = {"host": h.name, "slots": h.slots, **{k: p.get(k) for k in ("gpus", *SOFTWARE)}}
        status = []
        if "error" in p:
            r.failures.append(f"host {h.name}: {p['error']}")
            status.append("FAIL")
        else:
            for k in ("torch", "deepspeed", "transformers"):
                if p.get(k) is None:
                    r.failures.append(f"host {h.name}: {k} is not installed for {sys.executable}")
            if p.get("engine") is None:
                r.failures.append(f"host {h.name}: the engine does not import ({p.get('engine_error')}); "
                                  "launch from the checkout or pip install -e it on every node")
            for k in SOFTWARE:
                if p is not ref and p.get(k) != ref.get(k):
                    r.failures.append(f"host {h.name}: {k} {p.get(k)} differs from {ref_host}'s {ref.get(k)}; "
                                      "every node needs the same versions")
            gpus = p.get("gpus")
            if gpus is None:
                r.failures.append(f"host {h.name}: torch failed to count GPUs ({p.get('torch_error')})")
            elif gpus == 0:
                if gpu_hosts:
                    r.failures.append(f"host {h.name}: no GPU visible while {gpu_hosts[0]} has GPUs; every "
                                      "node must run the same accelerator")
                else:
                    status.append("CPU ranks")
            elif gpus < h.slots:
                r.failures.append(f"host {h.name}: slots={h.slots} (hostfile line {h.line}) but {gpus} GPUs "
                                  f"visible; set slots={gpus}")
            elif gpus > h.slots:
                r.notes.append(f"host {h.name}: {gpus} GPUs, slots={h.slots}: the launcher uses GPUs "
                               f"0..{h.slots - 1}")
            ifn = p.get("ifname")
            if ifn and not ifn["ok"]:
                r.failures.append(f"host {h.name}: NCCL_SOCKET_IFNAME={ifn['value']} matches no interface "
                                  f"(it has {', '.join(ifn['interfaces'])}); fix it in .deepspeed_env")
            if i == 0 and p.get("master_addr_local") is False:
                r.failures.append(f"--master_addr {master_addr} is not an address of the first host {h.name} "
                                  f"({p.get('master_addr_local_error')}); rank 0 runs there, so pass its "
                                  "private address")
            elif i == 0 and p.get("master_port_free") is False:
                r.failures.append(f"--master_port {master_port} is taken on {h.name} "
                                  f"({p.get('master_port_free_error')}); pick another")
        row["status"] = ", ".join(status) or ("ok" if "error" not in p else "FAIL")
        r.rows.append(row)
    if len({h.slots for h in hosts}) > 1:
        r.notes.append(f"slots differ between nodes ({', '.join(str(h.slots) for h in hosts)}): expert_parallel."
                       "autoep_size \"auto\" follows each node's ranks, so the ranks would disagree (the job "
                       "refuses to start); write autoep_size as a number that divides every node's slots")
    if not gpu_hosts and probes and all("error" not in p for p in probes):
        r.notes.append("no GPUs: the ranks run on the CPU (DeepSpeed's CPU accelerator, gloo); "
                       "fine for trying the pipeline, not for speed")
    return r


# ---------------------------------------------------------------------------------------------- all-reduce


def deepspeed_bin() -> str:
    return shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_allreduce(hostfile: Path, hosts: list[Host], master_addr: str, master_port: int, size_mb: float,
                  iters: int, timeout: int, ssh_port: int | None) -> tuple[dict | None, str | None]:
    """The all-reduce through the real launcher. Returns (result, None) or (None, failure line)."""
    cmd = [deepspeed_bin(), "--hostfile", str(hostfile), "--master_addr", master_addr,
           "--master_port", str(master_port)]
    if len(hosts) == 1:
        cmd += ["--no_ssh_check"]  # one host: DeepSpeed launches here, without SSH
    if ssh_port:
        cmd += ["--ssh_port", str(ssh_port)]
    cmd += [str(CHECK_CLUSTER), "--worker", "--size_mb", str(size_mb), "--iters", str(iters),
            "--timeout", str(timeout)]
    # Own session: on a hang we kill the runner and pdsh by their group, never through the runner's
    # SIGTERM handler, which runs `pkill -f` for every DeepSpeed launcher on every host.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = p.communicate(timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, f"all-reduce: the launcher did not finish in {timeout + 120} s (log tail: {_tail(out)})"
    m = re.search(rf"{RESULT_TAG} (\{{.*\}})", out)
    if p.returncode != 0 or not m:
        return None, f"all-reduce over {sum(h.slots for h in hosts)} ranks failed (launcher exit " \
                     f"{p.returncode}): {_tail(out)}"
    res = json.loads(m.group(1))
    if not res["correct"]:
        return res, f"all-reduce: wrong sum ({res['got']} != {res['expected']})"
    return res, None


def _tail(out: str) -> str:
    lines = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln or "ERROR" in ln or "FAIL" in ln]
    return (errs or lines or ["no output"])[-1][-400:]


def worker_main(args: argparse.Namespace) -> int:
    """One rank of the all-reduce (started by the deepspeed launcher)."""
    def watchdog():
        time.sleep(args.timeout)
        print(f"FAIL rank {os.environ.get('RANK')} on {socket.gethostname()}: all-reduce did not finish in "
              f"{args.timeout} s", flush=True)
        os._exit(3)

    from datetime import timedelta

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from .parallel import skip_cpu_shm_op

    # Started after the imports: they cannot hang on a peer, and on a loaded machine they alone took most of the
    # 120 s (a 2-core CI machine running two test workers). The timeout covers the rendezvous and the all-reduces.
    threading.Thread(target=watchdog, daemon=True).start()

    acc = get_accelerator()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if acc.device_name() == "cuda":
        torch.cuda.set_device(local)
    skip_cpu_shm_op()
    deepspeed.init_distributed(timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = acc.device_name(local) if acc.device_name() != "cpu" else "cpu"
    n = max(1, int(args.size_mb * 2**20) // 4)
    x = torch.full((n,), float(rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    got = [x[0].item(), x[-1].item()]
    correct = all(g == expected for g in got)
    x.zero_()
    for _ in range(2):  # warm-up
        dist.all_reduce(x)
    acc.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    acc.synchronize()
    dt = torch.tensor([(time.perf_counter() - t0) / args.iters], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    where = [None] * world
    dist.all_gather_object(where, os.environ.get("CROSS_RANK", socket.gethostname()))  # the launcher's node rank
    if rank == 0:
        seconds = dt.item()
        algbw = n * 4 / seconds / 1e9
        print(RESULT_TAG + " " + json.dumps({
            "world_size": world, "nodes": len(set(where)), "backend": dist.get_backend(), "bytes": n * 4,
            "iters": args.iters, "seconds": seconds, "algbw_gbs": algbw,
            "busbw_gbs": algbw * 2 * (world - 1) / world, "correct": correct, "got": got,
            "expected": expected}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- main


def print_table(rows: list[dict]) -> None:
    cols = ["host", "slots", "gpus", *SOFTWARE, "status"]
    cells = [[str(r.get(c) if r.get(c) is not None else "-") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="check_cluster",
        description="Check a DeepSpeed hostfile and its nodes before a multi-node run (docs/multinode.md).")
    ap.add_argument("--hostfile", help="DeepSpeed hostfile, e.g. hostfiles/do_2node")
    ap.add_argument("--master_addr", help="node 0's private address, as you will pass it to deepspeed "
                                          "(default: the first host of the hostfile)")
    ap.add_argument("--master_port", type=int, help="port for the all-reduce's rendezvous (default: a free one)")
    ap.add_argument("--ssh_port", type=int, help="as deepspeed --ssh_port (default: ~/.ssh/config, else 22)")
    ap.add_argument("--size_mb", type=float, default=64.0, help="all-reduce message size in MiB (default 64)")
    ap.add_argument("--iters", type=int, default=10, help="timed all-reduces (default 10)")
    ap.add_argument("--timeout", type=int, default=120,
                    help="seconds each rank of the all-reduce may take before it gives up (default 120)")
    ap.add_argument("--connect_timeout", type=int, default=5, help="SSH ConnectTimeout in seconds (default 5)")
    ap.add_argument("--no_allreduce", action="store_true", help="skip the all-reduce")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of the all-reduce
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    return ap.parse_args(argv)


def fail(msg: str) -> None:
    print(f"check_cluster: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    try:
        hosts, exports = read_inputs(args)
    except InputError as e:
        fail(str(e))
        return 2
    missing = missing_launcher_tool(hosts)
    if missing:
        fail(missing)
        return 1
    master_addr, master_port = master_address(args, hosts)
    notes = launch_notes(args, hosts, master_addr)
    report = probe_hosts(args, hosts, exports, master_addr, master_port)
    report.notes[:0] = notes
    allreduce = None
    if not args.no_allreduce:
        allreduce = check_allreduce(args, hosts, master_addr, master_port, report)
    print_report(report, allreduce)
    return 1 if report.failures else 0


def read_inputs(args: argparse.Namespace) -> tuple[list[Host], dict[str, str]]:
    """The arguments, the hostfile and the .deepspeed_env files, checked before anything is contacted."""
    if not args.hostfile:
        raise InputError("--hostfile is required (e.g. --hostfile hostfiles/do_2node)")
    for name in ("size_mb", "iters", "timeout", "connect_timeout"):
        if not getattr(args, name) > 0 or getattr(args, name) == float("inf"):  # nan fails > 0
            raise InputError(f"--{name} must be a finite number > 0, got {getattr(args, name)}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise InputError(f"--master_port {args.master_port} is not a port number")
    hosts = parse_hostfile(args.hostfile)
    exports = remote_exports(Path.cwd())  # read on one host too, so a bad file is found before the nodes need it
    # one host: the runner starts the ranks here with this shell's environment, no exports and no .deepspeed_env
    return hosts, exports if len(hosts) > 1 else {}


def missing_launcher_tool(hosts: list[Host]) -> str | None:
    """The failure line when ssh or pdsh, which the launcher needs for several hosts, is not installed."""
    for tool in ("ssh", "pdsh") if len(hosts) > 1 else ():
        if shutil.which(tool) is None:
            return (f"{tool} is not installed on this machine; the deepspeed launcher needs it for several "
                    f"hosts (apt-get install -y {'openssh-client' if tool == 'ssh' else 'pdsh'})")
    return None


def master_address(args: argparse.Namespace, hosts: list[Host]) -> tuple[str, int]:
    """Rank 0's address and port: the arguments, else localhost (one host) or the first host, and a free port."""
    if len(hosts) == 1:
        master_addr = args.master_addr or "127.0.0.1"
    else:
        master_addr = args.master_addr or hosts[0].name
    return master_addr, args.master_port or free_port()


def launch_notes(args: argparse.Namespace, hosts: list[Host], master_addr: str) -> list[str]:
    """What the launcher will do that the user may not expect: local ranks, the master address, ssh keepalives."""
    single, notes = len(hosts) == 1, []
    if single and deepspeed_env_files(Path.cwd()):
        notes.append("one host: deepspeed runs the ranks with this shell's environment and does not read "
                     f"{', '.join(map(str, deepspeed_env_files(Path.cwd())))} (it sends that to nodes over pdsh)")
    if single and hosts[0].name not in LOCAL_NAMES:
        notes.append(f"one host: deepspeed starts every rank on this machine, without SSH, whatever the "
                     f"hostfile calls it ({hosts[0].name})")
    if not single and not args.master_addr:
        notes.append(f"--master_addr not given: using the first host, {master_addr}. Pass it to deepspeed "
                     "too: left out, deepspeed takes the first address of `hostname -I` there, which on a "
                     "droplet is the public one")
    if not single and ssh_server_alive(hosts[-1].name, args.ssh_port) == 0:
        notes.append(f"ssh has no ServerAliveInterval for {hosts[-1].name}: if a node dies without closing its "
                     "connection, pdsh (and so the job) waits for it; add `ServerAliveInterval 5` and "
                     "`ServerAliveCountMax 3` for your nodes in ~/.ssh/config (docs/multinode.md)")
    return notes


def probe_hosts(args: argparse.Namespace, hosts: list[Host], exports: dict[str, str], master_addr: str,
                master_port: int) -> Report:
    """Every host probed at once (node 0 also checks the master address and port), then judged together."""
    cwd, single = Path.cwd(), len(hosts) == 1
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = [pool.submit(probe_host, h, cwd, exports, single, (master_addr, master_port) if i == 0 else None,
                               args.ssh_port, args.connect_timeout) for i, h in enumerate(hosts)]
        probes = [f.result() for f in futures]
    return judge(hosts, probes, master_addr, master_port)


def check_allreduce(args: argparse.Namespace, hosts: list[Host], master_addr: str, master_port: int,
                    report: Report) -> dict | None:
    """The all-reduce over every rank, unless the hosts already failed; its failure goes into `report`."""
    if report.failures:
        report.notes.append("all-reduce skipped: fix the failures above first")
        return None
    allreduce, err = run_allreduce(Path(args.hostfile).resolve(), hosts, master_addr, master_port, args.size_mb,
                                   args.iters, args.timeout, args.ssh_port)
    if err:
        report.failures.append(err)
    return allreduce


def print_report(report: Report, allreduce: dict | None) -> None:
    print_table(report.rows)
    if allreduce:
        a = allreduce
        print(f"all-reduce: {a['world_size']} ranks on {a['nodes']} node(s), {a['backend']}, "
              f"{a['bytes'] / 2**20:g} MiB fp32 x {a['iters']}: {a['seconds'] * 1e3:.2f} ms each, "
              f"algbw {a['algbw_gbs']:.3f} GB/s, busbw {a['busbw_gbs']:.3f} GB/s, "
              f"sum {'correct' if a['correct'] else 'WRONG'}")
    for n in report.notes:
        print(f"note: {n}")
    for f in report.failures:
        fail(f)
    print("cluster OK" if not report.failures else f"cluster NOT OK: {len(report.failures)} failure(s)",
          flush=True)

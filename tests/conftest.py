"""Shared helpers: start the real `deepspeed` launcher on CPU ranks, write test configs."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ZERO3 = ROOT / "ds_configs" / "zero3.json"
DEEPSPEED = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")  # the real launcher


def pytest_configure(config):
    """Refuse a pytest that loses xdist's groups; one torch thread per test worker; one packed-corpus cache
    (engine/data.py: cache_dir) for the whole run, shared by both test workers and every launch, fresh each run and
    removed at the end: the default corpus is tokenized once, not once per rank."""
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        major, minor = (int(x) for x in pytest.__version__.split(".")[:2])
        if (major, minor) >= (9, 1):  # pytest 9.1 builds test ids itself: xdist 3.8's "@group" tags are lost, files
            # are split across workers, a module fixture is built once per worker and test_multinode.py's job fails
            raise pytest.UsageError(f"pytest {pytest.__version__} drops pytest-xdist's --dist loadgroup groups; "
                                    "install the tested pytest: pip install 'pytest>=8,<9.1'")
    if "PYTEST_XDIST_WORKER" in os.environ:  # two workers on two cores: one thread each, as every launch has
        import torch

        torch.set_num_threads(1)
    if "PYTEST_XDIST_WORKER" not in os.environ and "MOE_ENGINE_CACHE" not in os.environ:
        os.environ["MOE_ENGINE_CACHE"] = config._moe_cache = tempfile.mkdtemp(prefix="moe-engine-cache-")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        drop_stale_build_lock(TEST_OPS / "cpu_adam" / "lock")
        config._op_build = start_cpu_adam_build()
        compile_imports()


STALE_LOCK_S = 900  # a build takes 1-2 minutes on 2 cores; a lock this old outlived the run that took it


def drop_stale_build_lock(lock: Path, now: float | None = None) -> bool:
    """Remove torch's JIT-build lock left by a run killed mid-build (every later build would wait on it forever);
    a lock younger than STALE_LOCK_S may belong to a build in progress and is kept. Returns whether it removed one."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    lock.unlink(missing_ok=True)
    print(f"removed a stale op build lock ({age / 60:.0f} min old): {lock}", file=sys.stderr)
    return True


RANK_IMPORTS = ("import torch, deepspeed, datasets, torch._inductor.compile_fx\n"
                "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                "import transformers.models.deepseek_v3.modeling_deepseek_v3, transformers.models.qwen3_moe.modeling_qwen3_moe\n"
                "import engine.pretrain, engine.grpo, engine.export.write, engine.export.zero3, engine.export.zero12\n"
                "import engine.export.pipeline")


def compile_imports() -> None:
    """After an install without byte-compiling (the test command's `pip install --no-compile`), import what a rank
    imports once, in one process, before any test starts: that process writes the .pyc files. Otherwise the first
    few processes of the run (both test workers, the first launches' runners, launchers and ranks, side by side)
    each compile the same modules themselves (~15 CPU-s each on a 2-core machine). Skipped once torch's own .pyc
    exists, or when PYTHONDONTWRITEBYTECODE forbids writing them."""
    import importlib.util

    torch_init = importlib.util.find_spec("torch").origin
    if os.environ.get("PYTHONDONTWRITEBYTECODE") or os.path.exists(importlib.util.cache_from_source(torch_init)):
        return
    subprocess.run([sys.executable, "-c", RANK_IMPORTS], cwd=ROOT, env=env(), capture_output=True, timeout=600)


def start_cpu_adam_build() -> subprocess.Popen:
    """Build DeepSpeed's CPU Adam op (DeepSpeedCPUAdam: zero3_offload.json's optimizer) in the background, from the
    start of the run, while the tests run.

    It is JIT-compiled into TEST_OPS on first use (two source files, ~50 CPU-s each without debug info, see env;
    ~76 each with it, as DeepSpeed builds it; a no-op once built). Started here, it is done long before the offload
    test's launch, whose ranks would otherwise compile it inside their timeout; a rank that asks for it while it is still building waits on torch's build lock. The configs
    without offload run torch's AdamW on CPU ranks (engine/ds_config.py: resolve_optimizer), so FusedAdam is not built;
    the shared-memory all-reduce is skipped too (engine/parallel.py: skip_cpu_shm_op).
    """
    code = ("from deepspeed.accelerator import get_accelerator as a\n"
            "b = a().create_op_builder('CPUAdamBuilder') if a().device_name() == 'cpu' else None\n"
            "b is not None and b.is_compatible() and b.load(verbose=False)")
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    p.log = log
    return p


def pytest_unconfigure(config):
    if _pool is not None:
        _pool.close()
    build = getattr(config, "_op_build", None)
    if build is not None:  # let it finish (never leave torch's build lock behind a killed compile)
        if build.wait() != 0:
            build.log.seek(0)
            print(f"CPU Adam op build failed (exit {build.returncode}):\n{build.log.read()[-3000:]}", file=sys.stderr)
    if getattr(config, "_moe_cache", None):
        shutil.rmtree(config._moe_cache, ignore_errors=True)


def _ephemeral_ports() -> tuple[int, int]:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out: set[int] = set()
_rng = random.Random()  # apart from the random module's state, which tests seed


def free_port() -> int:
    """A TCP port nothing listens on, for a launcher's rendezvous, taken outside the kernel's ephemeral range: a port
    the kernel hands out for bind(0) can be handed out again, to the other worker's gloo sockets or outgoing
    connections, between this check and the launcher's listen (EADDRINUSE). Each xdist worker draws from its own
    residue class, and never hands out a port twice."""
    lo, hi = _ephemeral_ports()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    w = int(worker[2:]) if worker[2:].isdigit() else 0
    n = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), w + 1)
    pool = [p for p in [*range(20000, lo), *range(hi + 1, 65536)] if p % n == w and p not in _handed_out]
    for port in _rng.sample(pool, min(200, len(pool))):
        if port_free_on(port, "127.0.0.1", "0.0.0.0"):
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no port outside the ephemeral range is free: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free_on(port: int, *addrs: str) -> bool:
    for a in addrs:
        with socket.socket() as s:
            try:
                s.bind((a, port))
            except OSError:
                return False
    return True


NODEBUG_CXX = ROOT / "tests" / "scripts" / "nodebug" / "c++"
# Where the processes the tests start JIT-build C++ ops (DeepSpeed's CPU Adam): apart from ~/.cache/torch_extensions,
# so that a build without debug info (NODEBUG_CXX) and a user's own build never replace each other.
TEST_OPS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-engine-test-ops"


def env(**extra) -> dict:
    """The environment of every process the tests start: the checkout first on PYTHONPATH (what was there stays
    after it: packages installed with `pip install --target`, as on the GPU machine), one thread per process, and
    JIT-built ops compiled without debug info (CXX=NODEBUG_CXX around the real compiler) into TEST_OPS."""
    real_cxx = os.environ.get("MOE_TEST_CXX") or os.environ.get("CXX") or "c++"
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    e = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             CXX=str(NODEBUG_CXX), MOE_TEST_CXX="c++" if real_cxx == str(NODEBUG_CXX) else real_cxx,
             TORCH_EXTENSIONS_DIR=str(TEST_OPS))
    e.update(extra)
    return e


def launch(n_ranks: int, script: str | Path, *args, cwd: Path, timeout: int = 600,
           check: bool = True) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N script args` on CPU ranks; output kept for the assertion message."""
    return launch_together([(n_ranks, script, *args)], cwd=cwd, timeout=timeout, check=check)[0]


def launch_together(jobs: list[tuple], cwd: Path, timeout: int = 600,
                    check: bool = True) -> list[subprocess.CompletedProcess]:
    """Several independent launches `(n_ranks, script, *args)` at once; waits for all of them.

    Each launch spends most of its first 15-25 s in imports and DeepSpeed's start on one core per rank, so two
    1-rank launches side by side take about the time of one on a 2-core machine. Each one is still its own
    `deepspeed` launcher and its own processes; nothing is shared but the wall clock.
    """
    procs = []
    for n_ranks, script, *args in jobs:
        cmd = [DEEPSPEED, "--master_port", str(free_port()),
               "--num_gpus", str(n_ranks), str(script), *map(str, args)]
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append((cmd, subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=out, stderr=err, text=True,
                                            start_new_session=True), out, err))
    done, end = [], time.time() + timeout
    try:
        for cmd, p, out, err in procs:
            try:
                rc = p.wait(timeout=max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            out.seek(0), err.seek(0)
            done.append(subprocess.CompletedProcess(cmd, rc, out.read(), err.read()))
    finally:
        for _, p, out, err in procs:
            if p.poll() is None:  # a timeout or a failed wait: end this launch's whole process group, by its id
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            out.close(), err.close()
    for p in done:
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(p.args)} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return done


# ------------------------------------------------------------------------------------- jobs on warm ranks

POOL = ROOT / "tests" / "scripts" / "pool.py"


class RankPool:
    """Two CPU ranks started once through the real launcher (tests/scripts/pool.py), each running the jobs given to
    `run` one after another, as `python SCRIPT ARGS` would on that rank. One per test worker, started on first use."""

    def __init__(self, ranks: int = 2):
        self.ranks, self.k = ranks, 0
        self.dir = Path(tempfile.mkdtemp(prefix="moe-engine-pool-"))
        self.log = open(self.dir / "pool.log", "w")
        (self.dir / "owner").write_text(str(os.getpid()))  # the ranks exit if this process dies without close()
        self.proc = subprocess.Popen([DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", str(ranks),
                                      str(POOL), str(self.dir)], cwd=self.dir, env=env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def outputs(self, k: int) -> tuple[str, str]:
        read = [[(self.dir / f"{k}.rank{r}.{s}") for r in range(self.ranks)] for s in ("out", "err")]
        return tuple("".join(f.read_text() for f in files if f.exists()) for files in read)

    def run(self, script, args: list, cwd: Path, environ: dict, path: list, timeout: float, stuck_s: float = 60):
        """Job k on every rank; its exit code is the first non-zero one. A rank that fails while another waits for it
        in a collective (which would wait out the whole timeout): stuck_s after the failure the pool is killed (the
        next job starts a new one) and the failure returned, with a line on stderr naming the ranks left waiting."""
        k, self.k = self.k, self.k + 1
        spec = {"script": str(script), "argv": [str(a) for a in args], "cwd": str(cwd),
                "env": {k_: str(v) for k_, v in environ.items()}, "path": [str(p) for p in path]}
        (self.dir / f"{k}.tmp").write_text(json.dumps(spec))
        (self.dir / f"{k}.tmp").rename(self.dir / f"{k}.json")
        rcs, end = [self.dir / f"{k}.rank{r}.rc" for r in range(self.ranks)], time.time() + timeout
        failed_at = None
        while not all(f.exists() for f in rcs):
            done = [(r, int(f.read_text())) for r, f in enumerate(rcs) if f.exists()]
            failed = [(r, c) for r, c in done if c]
            if failed and failed_at is None:
                failed_at = time.time()
            if failed_at is not None and time.time() > failed_at + stuck_s:
                out, err = self.outputs(k)
                self.close(kill=True)
                waiting = [r for r in range(self.ranks) if r not in dict(done)]
                err += (f"\n<rank pool> rank {failed[0][0]} exited {failed[0][1]}; rank(s) {waiting} still running "
                        f"{stuck_s:.0f} s later (waiting for it in a collective?): pool killed\n")
                return subprocess.CompletedProcess(["<rank pool>", str(script), *spec["argv"]], failed[0][1], out, err)
            if self.proc.poll() is not None or time.time() > end:
                why = f"exited {self.proc.returncode}" if self.proc.poll() is not None else f"ran past {timeout} s"
                (out, err), log = self.outputs(k), (self.dir / "pool.log").read_text()
                self.close(kill=True)
                raise AssertionError(f"{script} {' '.join(spec['argv'])} on the rank pool: {why}\n{out[-3000:]}\n"
                                     f"{err[-3000:]}\npool log:\n{log[-3000:]}")
            time.sleep(0.02)
        codes = [int(f.read_text()) for f in rcs]
        return subprocess.CompletedProcess(["<rank pool>", str(script), *spec["argv"]],
                                           next((c for c in codes if c), 0), *self.outputs(k))

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None and not kill:
            (self.dir / "stop").touch()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill = True
        if self.proc.poll() is None:  # SIGINT first: a rank inside a JIT op build drops torch's build lock on its way out
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_pool: RankPool | None = None
_jobs = None  # tests/scripts/pool.py, loaded once: run_job for 1-rank jobs in this process (its group snapshot too)


def run_ranks(n_ranks: int, script, *args, cwd: Path, environ: dict | None = None, path: tuple = (),
              timeout: float = 600, check: bool = True, stuck_s: float = 60) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus n_ranks script args` for a test that checks what the run computes and writes, not how
    processes start and end: 2 ranks run it on this worker's RankPool, 1 rank in this process (a world of one, as
    `python script args` without a launcher), any other count as a real launch (`launch`: no `environ` or `path`).
    `environ` and `path` (PYTHONPATH entries) are the job's additions; stuck_s: how long the pool waits for
    the other rank after one fails (RankPool.run). What only a fresh process shows (start-up,
    signals, exit codes of the processes, peak memory) is tested through `launch` and friends."""
    global _pool, _jobs
    environ = {k: str(v) for k, v in (environ or {}).items()}
    if n_ranks not in (1, 2):
        if environ or path:
            raise ValueError("run_ranks: environ and path are for pool and in-process jobs (1 or 2 ranks)")
        return launch(n_ranks, script, *args, cwd=cwd, timeout=int(timeout), check=check)
    if n_ranks == 1:
        if _jobs is None:
            import importlib.util

            loader = importlib.util.spec_from_file_location("moe_test_pool", POOL)
            _jobs = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(_jobs)
        out = Path(tempfile.mkdtemp(prefix="moe-engine-job-"))
        environ = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(free_port()), **environ}
        spec = {"script": str(script), "argv": [str(a) for a in args], "cwd": str(cwd), "env": environ,
                "path": [str(p) for p in path]}
        rc = _jobs.run_job(spec, out / "out", out / "err")
        p = subprocess.CompletedProcess(["<this process>", str(script), *spec["argv"]], rc,
                                        (out / "out").read_text(), (out / "err").read_text())
        shutil.rmtree(out, ignore_errors=True)
    else:
        if _pool is None or _pool.proc.poll() is not None:
            _pool = RankPool(2)
        p = _pool.run(script, list(args), cwd, environ, list(path), timeout, stuck_s)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(p.args)} exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def run_in_process(main, argv: list, capfd, monkeypatch, cwd: Path | None = None,
                   **environ) -> subprocess.CompletedProcess:
    """A command-line entry point (`engine.pretrain.main`, `engine.export.write.main`, ...) called in this process, as
    `python bin/X argv` would run it, with `environ` set; returns its exit code and what it wrote to the file
    descriptors 1 and 2 (capfd: every write, Python's or a C library's, not only sys.stdout/sys.stderr).

    For the refusal tests: a subprocess spends 5-10 s importing torch and transformers before the check that
    refuses the input takes milliseconds. What a fresh process prints at import time is checked once per entry
    point by a test that still runs it as a subprocess. Stopping "before any work" is enforced here:
    `init_distributed` (engine.pretrain's and the entry point module's) raises, so a check that lets bad input
    through fails instead of waiting for ranks that do not exist. A rank that refuses in a world of several joins the
    others only to tell them (engine.pretrain.fail_together); here it is alone, so it says its own problem.
    """
    import engine.pretrain

    def no_work(*a, **k):
        raise AssertionError(f"{argv}: got past the checks to init_distributed (bad input was let through)")

    monkeypatch.setattr(engine.pretrain, "init_distributed", no_work)
    monkeypatch.setattr(engine.pretrain, "fail_together", lambda world, problem: str(problem))
    own = sys.modules[main.__module__]  # engine.grpo imports its own name for it
    if hasattr(own, "init_distributed"):
        monkeypatch.setattr(own, "init_distributed", no_work)
    for k, v in environ.items():
        monkeypatch.setenv(k, str(v))
    if cwd is not None:
        monkeypatch.chdir(cwd)
    capfd.readouterr()  # drop what came before
    rc = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["<in process>", *map(str, argv)], rc, out, err)


def write_ds(path: Path, base: Path = ZERO3, drop: tuple = (), **changes) -> Path:
    """A copy of a shipped DS config with some keys dropped or changed."""
    cfg = json.loads(base.read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


# ------------------------------------------------------------------------------------- two workers (pytest-xdist)

# `pytest -n 2 --dist loadgroup` (the README's test command): each file is one unit of work on one worker, so its
# module fixtures run once; test_export.py and test_pipeline.py share the session fixture `deepseek_2ranks`, so they
# are one unit, as are test_grpo.py and test_tree.py (`pretrained`). Units go to the workers longest first (seconds measured per file on the 2-core machine, see
# docs/testing.md), so the last unit to start is a short one.
GROUPS = {"test_export.py": "deepseek_2ranks", "test_pipeline.py": "deepseek_2ranks",
          "test_grpo.py": "grpo_pretrained", "test_tree.py": "grpo_pretrained"}
LONGEST_FIRST = ["test_multinode.py", "deepseek_2ranks", "grpo_pretrained", "test_pretrain.py", "test_families.py",
                 "test_two_ranks.py", "test_resume.py", "test_balance.py", "test_bench.py", "test_data_checks.py",
                 "test_readme.py"]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    def group(item) -> str:
        name = Path(str(item.fspath)).name
        return GROUPS.get(name, name)

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    if not hasattr(config, "workerinput"):  # one process (no -n): the files in their usual order
        return
    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: a file's own order is kept


# ------------------------------------------------------------------------------------- shared pretraining runs

PRETRAIN_LOGITS = ROOT / "tests" / "scripts" / "pretrain_logits.py"

# A small DeepSeek-V3 (MLA, a first dense layer, 4 routed experts top-2 + 1 shared): moe_intermediate_size !=
# hidden_size, so a transposed expert weight cannot pass unnoticed; balance_rate > 0 moves the routing biases off
# zero, so their checkpointing and export are exercised too. 5 steps, checkpoints at steps 3 and 5.
SMALL_DEEPSEEK = """
model: {arch: deepseek_v3, hidden_size: 32, num_layers: 3, first_dense_layers: 1, num_heads: 4,
        intermediate_size: 64, moe_intermediate_size: 48, num_experts: 4, experts_per_token: 2,
        num_shared_experts: 1, vocab_size: 512, max_position_embeddings: 128, kv_lora_rank: 16,
        qk_rope_head_dim: 8, qk_nope_head_dim: 8, v_head_dim: 8}
data: {seq_len: 32}
train: {max_steps: 5, warmup_steps: 1, log_every: 1, balance_rate: 0.01}
checkpoint: {every_steps: 3}
"""


def fixed_ids() -> "torch.Tensor":
    """The token ids whose logits the export and pipeline tests compare (2 x 24, inside the bundled tokenizer)."""
    import torch

    return torch.randint(3, 483, (2, 24), generator=torch.Generator().manual_seed(0))


def small_corpus(path: Path) -> Path:
    """The first 200 documents of the bundled corpus: tokenizing stays quick."""
    lines = (ROOT / "engine" / "assets" / "corpus.jsonl").read_text().splitlines()[:200]
    path.write_text("\n".join(lines) + "\n")
    return path


def save_tiny_hf(path: Path, vocab: int, tokenizer: bool = False) -> Path:
    """The tiny default model at vocabulary `vocab`, saved as a Hugging Face directory (weights and config); with
    `tokenizer`, beside it the bundled tokenizer grown to `vocab` tokens (its 483 and new ones), as a model's own."""
    from transformers import AutoModelForCausalLM

    from engine.config import load_recipe
    from engine.data import load_tokenizer
    from engine.model import make_hf_config

    r = load_recipe(None, {"model.vocab_size": vocab})
    tok = load_tokenizer(r.data.tokenizer)
    AutoModelForCausalLM.from_config(make_hf_config(r.model, tok)).save_pretrained(path)
    if tokenizer:
        tok.add_tokens([f"<model_token_{i}>" for i in range(vocab - len(tok))])
        tok.save_pretrained(path)
    return path


def fp32_zero3(path: Path, preset: str = "deepseek_v3", autoep_size="auto", micro: int = 2) -> Path:
    """ds_configs/zero3.json in fp32 (bounds of 1e-5 need it), micro-batch `micro`, AutoEP with `preset`."""
    zero3 = json.loads(ZERO3.read_text())
    return write_ds(path, drop=("bf16",), train_micro_batch_size_per_gpu=micro,
                    expert_parallel={**zero3["expert_parallel"], "preset_model": preset, "autoep_size": autoep_size})


def pretrain_job(tmp: Path, recipe: str, ranks: int, ds: Path, corpus: Path | None = None,
                 run_name: str = "run", weights: bool = False) -> tuple[tuple, dict]:
    """A launch of tests/scripts/pretrain_logits.py (bin/pretrain.py + the trained engine's logits, and with `weights`
    its gathered parameters and buffers) into tmp/run_name, for `run_ranks`/`launch`, and the dict its fixture
    returns once it has run (logits still to be read)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "recipe.yaml").write_text(recipe)
    corpus = corpus or small_corpus(tmp / "corpus.jsonl")
    import torch

    torch.save(fixed_ids(), tmp / "ids.pt")
    common = ["--deepspeed_config", ds, "--config", tmp / "recipe.yaml", "--run_dir", tmp / run_name, "--data", corpus]
    job = (ranks, PRETRAIN_LOGITS, "--ids", tmp / "ids.pt", "--logits", tmp / "logits.pt",
           *(("--weights", tmp / "weights.pt") if weights else ()), *common)
    return job, {"dir": tmp, "run": tmp / run_name, "ranks": ranks, "common": common, "ds": ds}


def finished(run: dict) -> dict:
    """A pretrain_job's dict once the launch has ended: with the engine's logits, each rank's parameter count and,
    when the job saved them, the engine's gathered weights ("weights": engine name -> tensor)."""
    import torch

    run["logits"] = torch.load(run["dir"] / "logits.pt")
    if (run["dir"] / "weights.pt").is_file():
        run["weights"] = torch.load(run["dir"] / "weights.pt")
    run["params"] = [json.loads((run["dir"] / f"params_rank{r}.json").read_text()) for r in range(run["ranks"])]
    return run


@pytest.fixture(scope="session")
def deepseek_2ranks(tmp_path_factory) -> dict:
    """One pretraining run shared by tests/test_export.py (ZeRO-3 + AutoEP export, 2 ranks) and test_pipeline.py (the
    ZeRO-3 run the pipeline must equal): SMALL_DEEPSEEK (5 steps, log every step) on the rank pool's 2 CPU
    ranks, fp32 ZeRO-3, AutoEP size 2, micro-batch 2, the first 200 corpus documents, `fp32_zero3`'s DS config.
    Returns {"dir", "run" (RUN_DIR: metrics.jsonl, checkpoints/step_00000003 and step_00000005, latest = step 5),
    "ranks": 2, "common" (the pretrain arguments), "ds" (the DS config path), "logits" (the trained engine's logits
    for conftest.fixed_ids(), 2 x 24 x 512 fp32), "params" (each rank's local parameter count), "weights" (the
    trained engine's gathered parameters and buffers)}. Read only: copy a checkpoint before changing it."""
    tmp = tmp_path_factory.mktemp("shared") / "deepseek2"
    tmp.mkdir(parents=True)
    job, run = pretrain_job(tmp, SMALL_DEEPSEEK, 2, fp32_zero3(tmp / "ds.json"), weights=True)
    run_ranks(*job, cwd=tmp)
    return finished(run)


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory):
    """The GRPO tests' pretrained tiny model (tests/test_grpo.py build_pretrained: a run dir and its Hugging Face
    export), built once for test_grpo.py and test_tree.py. Tests write their runs into their own subdirectories."""
    from test_grpo import build_pretrained

    return build_pretrained(tmp_path_factory)


def check_decoder_follows_generate(model, dec, ids, mask, rounds: int = 2) -> None:
    """The rollout decoder's greedy tokens equal transformers' generate on `model`, before and after the model's
    weights move and the decoder is refreshed from them (`rounds` times)."""
    import torch

    for _ in range(rounds):
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        got = dec.generate(ids, mask, 10, eos_id=-1, pad_id=0, temperature=0)
        assert torch.equal(got, ref[:, : got.shape[1]]) and got.shape[1] == ref.shape[1]
        # sampled: the decoder's log-probs of its tokens equal the model's forward over prompt + completion (greedy
        # tokens alone are blind to small errors in the scores, e.g. a rotary applied to the wrong dims)
        got = dec.generate(ids, mask, 10, eos_id=-1, pad_id=0, temperature=1.0)
        full = torch.cat([mask, torch.ones_like(got[:, ids.shape[1]:])], dim=1)
        with torch.no_grad():
            logits = model(got, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits
        want = logits[:, ids.shape[1] - 1:-1].float().log_softmax(-1).gather(-1, got[:, ids.shape[1]:, None])[..., 0]
        assert torch.allclose(dec.last_logps, want, atol=1e-4), (dec.last_logps - want).abs().max()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        dec.refresh(model)

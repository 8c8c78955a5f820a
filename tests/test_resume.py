"""Crash-safe checkpoints and exact resume, through the real launcher on 2 CPU ranks.

fp32 (the DS config without "bf16"), one row per step, so a resumed run can be compared with an uninterrupted one
bitwise, its logged losses and its last checkpoint's tensors: kill -9 inside a save, then, resumed, kill -9 inside an
optimizer step; SIGTERM to the launcher, Ctrl-C to the whole process group, resume on 1 rank from a 2-rank checkpoint
(DeepSpeed's universal checkpoint), keep_last, and damaged or mismatched checkpoints refused with one line before any
work.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from conftest import DEEPSPEED, ROOT, env, free_port, read_metrics, run_in_process, run_ranks, write_ds

HOOKS = ROOT / "tests" / "scripts" / "pretrain_hooks.py"
PRETRAIN = ROOT / "bin" / "pretrain.py"
STEPS = 8
RECIPE = f"""
model: {{arch: deepseek_v3, hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 128,
        moe_intermediate_size: 64, num_experts: 8, experts_per_token: 2, num_shared_experts: 1,
        vocab_size: 512, max_position_embeddings: 512}}
data: {{seq_len: 32}}
train: {{max_steps: {STEPS}, warmup_steps: 2, log_every: 1, balance_rate: 0.01}}
checkpoint: {{every_steps: 2, keep_last: 2}}
"""


def tag(step: int) -> str:
    return f"step_{step:08d}"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("resume")
    (d / "recipe.yaml").write_text(RECIPE)
    write_ds(d / "ds2.json", drop=("bf16",), train_micro_batch_size_per_gpu=1)  # 2 ranks x 1 ...
    write_ds(d / "ds1.json", drop=("bf16",), train_micro_batch_size_per_gpu=2)  # ... = 1 rank x 2 sequences
    return d


def start(base: Path, run: str, ranks: int = 2, *args, **hooks) -> subprocess.Popen:
    """tests/scripts/pretrain_hooks.py through the launcher, in its own process group (a test can signal or kill
    all of it); the i-th launch on RUN logs to RUN.i.log and its hooks report to RUN/hook{i}/."""
    i = len(list(base.glob(f"{run}.*.log")))
    hooks.setdefault("HOOK_OUT", base / run / f"hook{i}")
    log = open(base / f"{run}.{i}.log", "w")
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", str(ranks), *hooks_argv(base, run, ranks, *args)]
    p = subprocess.Popen(list(map(str, cmd)), cwd=base, env=env(**{k: str(v) for k, v in hooks.items()}),
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    p.log, p.hook_out = Path(log.name), Path(hooks["HOOK_OUT"])
    return p


def hooks_argv(base: Path, run: str, ranks: int, *args) -> list:
    """tests/scripts/pretrain_hooks.py and its arguments for a run of `ranks` ranks into base/run."""
    return [HOOKS, "--deepspeed_config", base / f"ds{ranks}.json", "--config", base / "recipe.yaml",
            "--run_dir", base / run, *args]


def run_to_end(base: Path, run_name: str, ranks: int = 2, *args, **hooks) -> SimpleNamespace:
    """start()'s run for one that is not killed or signalled (conftest.run_ranks: 2 ranks on the rank pool, 1 in this
    process), once it has ended: returncode, log (RUN.i.log: its stdout and stderr) and hook_out, as start() names
    them."""
    i = len(list(base.glob(f"{run_name}.*.log")))
    hooks.setdefault("HOOK_OUT", base / run_name / f"hook{i}")
    p = run_ranks(ranks, *hooks_argv(base, run_name, ranks, *args), cwd=base, environ=hooks, timeout=300, check=False)
    log = base / f"{run_name}.{i}.log"
    log.write_text(p.stdout + p.stderr)
    return SimpleNamespace(returncode=p.returncode, log=log, hook_out=Path(hooks["HOOK_OUT"]))


def finish(p: subprocess.Popen, timeout: int = 300) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"timed out\n{p.log.read_text()[-4000:]}") from None


def latest(run: Path) -> str | None:
    f = run / "checkpoints" / "latest"
    return f.read_text() if f.is_file() else None


def logged(run: Path) -> int:
    f = run / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.is_file() else 0


def hook(p: subprocess.Popen, rank: int) -> dict:
    return json.loads((p.hook_out / f"rank{rank}.json").read_text())


def tree_digest(folder: Path) -> dict:
    return {str(f.relative_to(folder)): hashlib.md5(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def reference(base) -> dict[int, dict]:
    """An uninterrupted 2-rank run: step -> its metrics row."""
    p = run_to_end(base, "ref")
    assert p.returncode == 0, p.log.read_text()[-4000:]
    rows = read_metrics(base / "ref")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def crashes(base) -> dict:
    """Two kills -9 of one run, each SIGKILL to every process (the launcher and both ranks), each followed by a
    resume: inside step 6's save, after DeepSpeed wrote its files and before `latest` moved (mid-run, after step 4's
    checkpoint); then, resumed from step 4, inside step 7's optimizer step, once a rank's optimizer has updated its
    fp32 partition and before the model has the new values (after step 6's checkpoint). The last resume runs to
    the end."""
    run, seen = base / "crash", {}
    p = start(base, "crash", HOOK_DIE_IN_SAVE=6)
    assert finish(p) == -signal.SIGKILL, p.log.read_text()[-4000:]
    seen["killed_at"] = max(r["step"] for r in read_metrics(run))
    seen["after_save_crash"] = {"latest": latest(run), "step6": sorted(f.name for f in (run / "checkpoints" / tag(6))
                                                                       .iterdir())}

    p = start(base, "crash", 2, "--resume", HOOK_DIE_IN_STEP=7)
    assert finish(p) == -signal.SIGKILL, p.log.read_text()[-4000:]
    seen["after_step_crash"] = {"latest": latest(run), "logged": [r["step"] for r in read_metrics(run)]}
    ds_file = torch.load(run / "checkpoints" / tag(6) / "zero_pp_rank_1_mp_rank_00_model_states.pt", weights_only=False)
    seen["bias_in_ds_file"] = {n: t.tolist() for n, t in ds_file["module"].items() if n.endswith("correction_bias")}

    p = run_to_end(base, "crash", 2, "--resume")
    assert p.returncode == 0, p.log.read_text()[-4000:]
    seen["final"] = [hook(p, r) for r in (0, 1)]
    p = run_to_end(base, "crash", 2, "--resume")  # once more, at train.max_steps: nothing to do
    seen["again"] = {"rc": p.returncode, "log": p.log.read_text(), "rows": [r["step"] for r in read_metrics(run)]}
    return seen


def test_resume_after_kill9_is_bitwise_equal_to_an_uninterrupted_run(base, reference, crashes):
    rows = read_metrics(base / "crash")
    assert 4 <= crashes["killed_at"] < STEPS  # killed mid-run, after step 4's checkpoint
    # The second launch resumed at step 4 and was killed inside step 7 (after logging 6, saving 6), the last at 6.
    assert crashes["after_step_crash"]["latest"] == tag(6)
    assert crashes["final"][0]["resumed"] == {"step": 6, "position": 6, "tokens": 6 * 2 * 32}
    # Each step once: the first launch's rows past step 4 (its last checkpoint) were set aside when the second
    # launch resumed from 4, into metrics.replaced.jsonl.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) == list(range(1, 9))
    replaced = [json.loads(line) for line in (base / "crash" / "metrics.replaced.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replaced] == list(range(5, crashes["killed_at"] + 1))
    assert crashes["after_step_crash"]["logged"] == [r["step"] for r in rows][:-2]
    # Every row ever logged (each killed launch's, the resumed ones) equals the uninterrupted
    # run's row at that step: loss (RNG, data position, parameters, optimizer, routing biases), lr (scheduler).
    for r in rows + replaced:
        ref = reference[r["step"]]
        assert (r["loss"], r["lr"], r["tokens"]) == (ref["loss"], ref["lr"], ref["tokens"]), (r, ref)


def test_resuming_a_finished_run_says_there_is_nothing_to_train(crashes):
    again = crashes["again"]
    assert again["rc"] == 0, again["log"][-3000:]
    assert "note: nothing to train: checkpoint at step 8 has reached train.max_steps (8)" in again["log"]
    assert again["rows"] == list(range(1, 9))  # no row added, none set aside


def checkpoint_tensors(folder: Path) -> dict:
    """Every tensor in a checkpoint's .pt files (each rank's model and optimizer states, the buffers, each rank's
    RNG), by file and key path."""
    out = {}

    def walk(obj, key):
        if isinstance(obj, torch.Tensor):
            out[key] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")

    for f in sorted(folder.glob("*.pt")):
        walk(torch.load(f, weights_only=False), f.name)
    return out


def test_the_resumed_runs_last_checkpoint_equals_the_uninterrupted_runs(base, reference, crashes):
    """The run killed twice ends with the same parameters, optimizer state, routing biases and RNG states as the
    uninterrupted run, bitwise: every tensor of step 8's checkpoint (both fp32, both 2 ranks)."""
    got, want = (checkpoint_tensors(base / run / "checkpoints" / tag(STEPS)) for run in ("crash", "ref"))
    assert got.keys() == want.keys() and len(got) > 10, sorted(got.keys() ^ want.keys())
    assert any("fp32_flat_groups" in k for k in got) and any("exp_avg_sq" in k for k in got), sorted(got)
    differ = [k for k in got if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    assert not differ, differ


def test_routing_bias_round_trips_through_the_zero3_checkpoint(crashes):
    """After --resume every rank's e_score_correction_bias equals the buffer in DeepSpeed's own model_states file
    (step 6's, which the last resume loaded; DeepSpeed's ZeRO-3 load restores module buffers), and balancing had
    moved it away from zero."""
    saved = crashes["bias_in_ds_file"]
    assert len(saved) == 2 and all(any(v != 0 for v in b) for b in saved.values())
    for info in crashes["final"]:
        assert info["bias_after_resume"] == saved


def test_kill_during_a_save_leaves_the_previous_checkpoint(base, crashes):
    after = crashes["after_save_crash"]
    assert after["latest"] == tag(4)  # `latest` never named the half-written tag
    assert "manifest.json" not in after["step6"] and any(f.endswith("_model_states.pt") for f in after["step6"])
    # The next --resume loaded step 4 (see the rows above) and rewrote step 6 completely.
    ck = base / "crash" / "checkpoints"
    assert latest(base / "crash") == tag(STEPS)
    assert (ck / tag(6) / "manifest.json").is_file()
    assert sorted(p.name for p in ck.glob("step_*")) == [tag(6), tag(STEPS)]


def test_keep_last_prunes_old_checkpoints(base, reference):
    ck = base / "ref" / "checkpoints"
    # every_steps 2 saved steps 2, 4, 6 and 8; keep_last 2 keeps the two newest, each complete.
    assert sorted(p.name for p in ck.glob("step_*")) == [tag(6), tag(8)]
    assert latest(base / "ref") == tag(8)
    for t in (6, 8):
        manifest = json.loads((ck / tag(t) / "manifest.json").read_text())["files"]
        assert {"engine_state.json", "buffers.pt", "rng_rank0.pt", "rng_rank1.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= manifest.keys()


@pytest.fixture(scope="module")
def stopped(base) -> dict:
    """SIGTERM to the launcher (deepspeed.launcher.launch) mid-run: it forwards SIGTERM to rank 0 only (then waits
    up to 30 s before rank 1); rank 1 learns through the all-reduce at the step boundary.

    Beside it, from the same start, the run of test_ctrl_c_to_the_process_group_saves_and_exits: Ctrl-C in a terminal,
    SIGINT to the runner, the launcher and every rank at once (key "ctrl_c"). The two runs are independent launches
    that sleep 1 s at each step boundary, so they share the 2 cores well while both start."""
    run, run_c = base / "stop", base / "ctrl_c"
    p, p_c = start(base, "stop", HOOK_STEP_SLEEP=1), start(base, "ctrl_c", HOOK_STEP_SLEEP=1)
    t0 = time.time()
    procs = None
    try:
        pending = {"stop", "ctrl_c"}
        while pending:  # each signal as soon as its run is where its test wants it
            if "ctrl_c" in pending and logged(run_c) >= 1:
                procs = psutil.Process(p_c.pid).children(recursive=True)
                os.killpg(p_c.pid, signal.SIGINT)
                pending.discard("ctrl_c")
            if "stop" in pending and logged(run) >= 2:
                launcher = next(c for c in psutil.Process(p.pid).children()
                                if "deepspeed.launcher.launch" in " ".join(c.cmdline()))
                launcher.send_signal(signal.SIGTERM)
                pending.discard("stop")
            for q, name in ((p, "stop"), (p_c, "ctrl_c")):
                if name in pending and q.poll() is not None:
                    raise AssertionError(f"run {name} ended (rc {q.returncode}) before its signal\n"
                                         f"{q.log.read_text()[-4000:]}")
            time.sleep(0.05)
            if time.time() > t0 + 300:
                raise AssertionError(f"no signal point within 300 s: {pending}\n{p.log.read_text()[-2000:]}"
                                     f"\n{p_c.log.read_text()[-2000:]}")
        finish(p_c)  # the runner dies at once (KeyboardInterrupt); the ranks are still saving: wait for them
        psutil.wait_procs(procs, timeout=120)
        rc = finish(p)
    finally:
        for q in (p, p_c):
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
    buffers = torch.load(run / "checkpoints" / latest(run) / "buffers.pt")  # before later saves prune it
    return {"rc": rc, "ranks": [hook(p, r) for r in (0, 1)], "rows": read_metrics(run), "latest": latest(run),
            "log": p.log.read_text(), "bias": {n: b.tolist() for n, b in buffers.items()}, "ctrl_c": p_c}


def test_sigterm_to_the_launcher_saves_at_the_next_step_and_exits(stopped):
    assert [r["rc"] for r in stopped["ranks"]] == [0, 0], stopped["log"][-3000:]
    assert stopped["rc"] == 1  # the deepspeed launcher's own code once it has forwarded a signal
    last = stopped["rows"][-1]["step"]
    assert 2 <= last < STEPS
    assert stopped["latest"] == tag(last)  # the step at which the signal was seen, saved and named
    assert f"stopped by signal {int(signal.SIGTERM)} after step {last}" in stopped["log"]


def test_ctrl_c_to_the_process_group_saves_and_exits(base, stopped):
    """Ctrl-C in a terminal: SIGINT reaches the runner, the launcher and every rank at once (run by `stopped`)."""
    run, p = base / "ctrl_c", stopped["ctrl_c"]
    assert [hook(p, r)["rc"] for r in (0, 1)] == [0, 0], p.log.read_text()[-3000:]
    last = read_metrics(run)[-1]["step"]
    assert last < STEPS and latest(run) == tag(last)


def test_resume_on_one_rank_from_a_two_rank_checkpoint(base, reference, stopped):
    """--resume on another world size converts `latest` to DeepSpeed's universal format and loads it: 1 rank x
    micro-batch 2 continues the 2-rank x micro-batch 1 run (the same global batches) where it stopped."""
    k = stopped["rows"][-1]["step"]
    p = run_to_end(base, "stop", 1, "--resume")
    assert p.returncode == 0, p.log.read_text()[-4000:]
    info = hook(p, 0)
    # k micro-batches of 1 x 2 ranks = k micro-batches of 2 x 1 rank
    assert info["resumed"] == {"step": k, "position": k, "tokens": k * 2 * 32}
    assert f"converting {base / 'stop' / 'checkpoints' / tag(k)} to DeepSpeed's universal format" in p.log.read_text()
    assert not (base / "stop" / "checkpoints" / "universal" / tag(k)).exists()  # pruned with its tag
    # Routing biases come back although DeepSpeed's universal load skips module buffers.
    assert info["bias_after_resume"] == stopped["bias"] and any(any(b) for b in stopped["bias"].values())
    rows = [r for r in read_metrics(base / "stop") if r["world_size"] == 1]
    assert [r["step"] for r in rows] == list(range(k + 1, STEPS + 1))
    for r in rows:
        ref = reference[r["step"]]
        assert r["lr"] == ref["lr"] and r["tokens"] == ref["tokens"]
        # fp32, the same global batch, summed in another order (one rank's micro-batch of 2 vs a 2-rank
        # reduce-scatter): measured 1 ulp (4.8e-7, 9e-8 relative) at each of steps 4-8 after stopping at 3.
        # Without the routing biases (DeepSpeed's universal load drops them) the first loss moved by 6e-4 relative.
        assert abs(r["loss"] - ref["loss"]) < 5e-6 * ref["loss"], (r, ref)


def test_a_resume_with_another_lr_trains_at_it(base, reference):
    """The uninterrupted run (lr 0.003, schedule over 8 steps, at its end) resumed to step 10 with train.lr 0.01 and
    the same schedule (decay_steps 8: flat at min_lr_ratio 0.1 after it): steps 9 and 10 train at 0.01 x 0.1, not at
    the checkpoint's 0.003 x 0.1, which DeepSpeed restores with the scheduler. [fails if: checkpoint.load does not put
    the recipe's LR under the restored schedule]"""
    shutil.copytree(base / "ref", base / "new_lr")
    lr = RECIPE.replace("warmup_steps: 2,", "warmup_steps: 2, lr: 0.01, decay_steps: 8,")
    (base / "recipe_lr.yaml").write_text(lr)
    p = run_ranks(2, PRETRAIN, "--deepspeed_config", base / "ds2.json", "--config", base / "recipe_lr.yaml",
                  "--run_dir", base / "new_lr", "--resume", "--max_steps", 10, cwd=base, timeout=300, check=False)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert reference[STEPS]["lr"] == pytest.approx(3e-3 * 0.1)  # the checkpoint's LR at its last step
    rows = {r["step"]: r for r in read_metrics(base / "new_lr")}
    assert [rows[s]["lr"] for s in (9, 10)] == pytest.approx([1e-3, 1e-3]), [rows[s]["lr"] for s in (9, 10)]


def resume_rank0(base: Path, run: Path, capfd, monkeypatch, recipe: Path | None = None, ds: Path | None = None,
                 resume: bool = True) -> subprocess.CompletedProcess:
    """bin/pretrain.py --resume as the launcher would start rank 0 of 2 ranks (preflight stops it alone): its main in
    this process (conftest.run_in_process). Through the real launcher: test_damaged_checkpoint_through_the_launcher.
    `resume` False: the same command without --resume."""
    from engine.pretrain import main

    argv = ["--deepspeed_config", ds or base / "ds2.json", "--config", recipe or base / "recipe.yaml", "--run_dir",
            run, *(["--resume"] if resume else [])]
    return run_in_process(main, argv, capfd, monkeypatch, cwd=base, RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, LOCAL_SIZE=2)


def damage(base: Path, run: Path, case: str, tmp_path: Path) -> dict:
    """Break a copy of a finished run, or the command resuming it, the way `case` says; returns resume_rank0's
    arguments for that (another recipe or DS config, no --resume)."""
    last = run / "checkpoints" / tag(STEPS)
    ds = json.loads((base / "ds2.json").read_text())
    if case == "no_checkpoint":
        shutil.rmtree(run / "checkpoints")
    elif case == "truncated":
        f = last / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif case == "flipped_byte":
        f = last / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size; torch.load would not notice
        f.write_bytes(bytes(data))
    elif case == "missing_file":
        (last / "rng_rank1.pt").unlink()
    elif case == "other_model":
        recipe = tmp_path / "other.yaml"
        recipe.write_text(RECIPE.replace("hidden_size: 64", "hidden_size: 96"))
        return {"recipe": recipe}
    elif case == "past_max_steps":
        recipe = tmp_path / "shorter.yaml"
        recipe.write_text(RECIPE.replace(f"max_steps: {STEPS}", f"max_steps: {STEPS - 2}"))
        return {"recipe": recipe}
    elif case in ("other_stage", "other_optimizer"):
        z = ds["zero_optimization"]
        z.update({"stage": 2} if case == "other_stage" else {"offload_optimizer": {"device": "cpu"}})
        if case == "other_stage":
            z.pop("leaf_module", None)
        (tmp_path / "other_ds.json").write_text(json.dumps(ds))
        return {"ds": tmp_path / "other_ds.json"}
    elif case == "no_resume":
        return {"resume": False}
    elif case in ("latest_names_a_missing_tag", "latest_missing_no_resume"):  # e.g. the last save's folder deleted
        (run / "checkpoints" / "latest").write_text("step_00000099")
        return {"resume": case == "latest_names_a_missing_tag"}
    return {}


@pytest.mark.parametrize("case, expect", [
    ("no_checkpoint", "--resume: no checkpoint in"),
    ("other_model", "holds a different model (model.hidden_size: 64 in the checkpoint, 96 in the recipe)"),
    ("truncated", "zero_pp_rank_1_mp_rank_00_optim_states.pt has"),
    ("flipped_byte", "zero_pp_rank_0_mp_rank_00_optim_states.pt fails its CRC check"),
    ("missing_file", "rng_rank1.pt is missing"),
    ("past_max_steps", f"is at step {STEPS}, past train.max_steps ({STEPS - 2}); raise --max_steps"),
    ("other_stage", "was trained with ZeRO stage 3, the DeepSpeed config has stage 2"),
    ("other_optimizer", "holds torch AdamW's state, and this DS config and recipe build DeepSpeedCPUAdam"),
    ("no_resume", f"holds another run's checkpoints (latest: {tag(STEPS)}); continue that run with --resume"),
    # with and without --resume, the same advice: name a complete checkpoint in `latest`, then --resume
    ("latest_names_a_missing_tag", "latest names 'step_00000099', which is not there; its complete checkpoints: "
                                   f"{tag(6)}, {tag(STEPS)}: write one of those tags into"),
    ("latest_missing_no_resume", "holds another run's checkpoints, but"),
])
def test_bad_resume_is_one_clear_line_before_any_work(base, reference, tmp_path, case, expect, capfd, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(base / "ref", run)
    changed = damage(base, run, case, tmp_path)
    before = tree_digest(run)
    p = resume_rank0(base, run, capfd, monkeypatch, **changed)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], p.stderr[-3000:]
    if case.startswith("latest_"):
        assert lines[0].endswith("and run with --resume"), lines[0]
    if case in ("truncated", "flipped_byte", "missing_file"):  # and says how to go on from the older checkpoint
        assert f"writing its tag ({tag(6)}) into {run / 'checkpoints' / 'latest'}" in lines[0]
    assert tree_digest(run) == before  # nothing written, nothing removed


def test_damaged_checkpoint_through_the_launcher(base, reference, tmp_path):
    """Both ranks stop in preflight; the launcher passes on exit code 2."""
    run = tmp_path / "run"
    shutil.copytree(base / "ref", run)
    damage(base, run, "truncated", tmp_path)
    before = tree_digest(run)
    p = subprocess.run(list(map(str, [DEEPSPEED, "--master_port", free_port(), "--num_gpus", 2, PRETRAIN,
                                      "--deepspeed_config", base / "ds2.json", "--config", base / "recipe.yaml",
                                      "--run_dir", run, "--resume"])),
                       cwd=base, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is damaged" in errors[0] and "Traceback" not in p.stdout + p.stderr
    assert tree_digest(run) == before


def test_cadence_by_steps_time_and_signal():
    """One process, no launcher: what `due` answers, and that the signal handlers are put back."""
    from engine.checkpoint import Cadence
    from engine.config import CheckpointConfig

    before = signal.getsignal(signal.SIGTERM)
    c = Cadence(CheckpointConfig(every_steps=3, every_minutes=0.01, at_end=True))
    try:
        assert c.due(1, 10) == (False, False)
        assert c.due(3, 10) == (True, False)
        time.sleep(0.7)  # past every_minutes (0.6 s)
        assert c.due(4, 10) == (True, False)
        assert c.due(5, 10) == (False, False)  # the clock restarted at the last save
        assert c.due(10, 10) == (True, False)  # at_end
        os.kill(os.getpid(), signal.SIGTERM)  # handled: only a flag
        assert c.due(7, 10) == (True, True) and c.signal == signal.SIGTERM
    finally:
        c.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_grpo_from_a_damaged_checkpoint_is_one_line_before_any_work(base, reference, tmp_path, capfd, monkeypatch):
    """bin/grpo.py --init_from a pretraining run whose latest checkpoint has a flipped byte: refused in preflight
    (rank 0 would otherwise export it after every rank started), nothing written."""
    from engine.grpo import main

    run = tmp_path / "run"
    shutil.copytree(base / "ref", run)
    damage(base, run, "flipped_byte", tmp_path)
    before = tree_digest(run)
    argv = ["--deepspeed_config", ROOT / "ds_configs" / "zero3_grpo.json", "--config",
            ROOT / "engine" / "recipes" / "grpo_tiny.yaml", "--init_from", run, "--run_dir", tmp_path / "grpo"]
    p = run_in_process(main, argv, capfd, monkeypatch, cwd=ROOT)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert f"--init_from {run}: checkpoint {(run / 'checkpoints' / tag(STEPS)).resolve()} is damaged " \
           "(zero_pp_rank_0_mp_rank_00_optim_states.pt fails its CRC check" in lines[0], lines[0]
    assert tree_digest(run) == before and not (tmp_path / "grpo").exists()


def test_a_checkpoint_carries_the_gpus_generator(monkeypatch):
    """The rollout decoder samples from the GPU's generator (and compiled code seeds its random numbers from it), so
    a checkpoint saves this rank's CUDA generator with the CPU's, and a resume restores it. On a CPU the CUDA calls
    are stood in for (they are checked for wiring: which state goes where); on a GPU machine a real draw follows."""
    import engine.checkpoint as ck

    if torch.cuda.is_available():
        torch.cuda.init()
        state = ck._rng_state()
        first = torch.rand(4, device="cuda")
        torch.rand(100, device="cuda")
        ck._restore_rng(state)
        assert torch.equal(torch.rand(4, device="cuda"), first)
        return
    saved, restored = torch.arange(8, dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    state = ck._rng_state()
    first = torch.rand(3)
    ck._restore_rng(state)
    assert restored == [saved] and torch.equal(torch.rand(3), first)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU-only process saves no CUDA state
    assert "cuda" not in ck._rng_state()

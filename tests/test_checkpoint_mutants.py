"""engine/checkpoint.py's own work, one rule a test, each a change to checkpoint.py (a mutant) that every other fast
test let through: what save() writes and in which order (every file fsynced, the manifest, then `latest`; a folder
left by a crashed save cleared, the tag `latest` names never rewritten, keep_last), _write_atomic's tmp + rename +
fsyncs, the exporter script put in DeepSpeed's place, what load() restores (the universal folder, routing biases,
unshared optimizer steps, this rank's RNG, the data position converted to this shape, GRPO's counters, the recipe's
LR), to_universal's conversion once and its refusal line, the CPU Adam replay, the Cadence across ranks, the
`latest` pointer, prune, damage() and check_resume's refusals. No launcher, no DeepSpeed engine: fakes of the few
engine and torch.distributed calls checkpoint.py makes, on folders in tmp_path; every expectation is written out
by hand (file names, sizes read from disk, exact lines, values worked out in the docstrings)."""
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from engine import checkpoint
from engine.checkpoint import (MANIFEST, Cadence, check_resume, damage, latest, no_latest, prune, recorded_batch,
                               run_dir_problems, saved_state, tag_for)
from engine.config import CheckpointConfig, ConfigError, ModelConfig, Recipe, TrainConfig
from engine.export import ExportError

ROOT = Path(__file__).resolve().parent.parent
DS = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}


# ------------------------------------------------------------------------------------------------ fakes


class Module(torch.nn.Module):
    """A router with a persistent routing bias, and a rotary table that is not persistent (never saved)."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Module()
        self.router.register_buffer("bias", torch.tensor([1.0, -2.0]))
        self.rope = torch.nn.Module()
        self.rope.register_buffer("inv_freq", torch.tensor([0.5]), persistent=False)


class AdamW:
    """torch.optim.AdamW as saved_optimizer() tells it: by its class name (a real one takes seconds to build)."""


class SaveEngine:
    """The DeepSpeed engine as save() sees it: save_checkpoint writes a torch file (a zip), a plain file, and copies
    its recovery script next to the tags as DeepSpeed does."""

    def __init__(self):
        self.device, self.module, self.config = "cpu", Module(), {}
        self.basic_optimizer = AdamW()

    def save_checkpoint(self, root, tag, client_state, save_latest):
        assert save_latest is False
        folder = Path(root, tag)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.ones(3)}, folder / "mp_rank_00_model_states.pt")
        (folder / "notes.bin").write_bytes(b"12345")
        Path(root, "zero_to_fp32.py").write_text("# DeepSpeed's script\n")

    def train_micro_batch_size_per_gpu(self):
        return 2

    def gradient_accumulation_steps(self):
        return 3

    def zero_optimization_stage(self):
        return 3


class Tokenizer:
    def save_pretrained(self, folder):
        Path(folder).mkdir()
        (Path(folder) / "tokenizer.json").write_text("{}")


@pytest.fixture(autouse=True)
def _no_deepspeed_import(monkeypatch):
    """load() imports DeepSpeed's Adam classes (for the CPU Adam replay); stand-ins keep these tests from importing
    DeepSpeed (seconds), and are what test_the_cpu_adam_products_are_replayed_for_every_step_taken checks against."""
    class DeepSpeedCPUAdam:
        pass

    class FusedAdam:
        pass

    stub = types.SimpleNamespace(DeepSpeedCPUAdam=DeepSpeedCPUAdam, FusedAdam=FusedAdam)
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", stub)
    return stub


@pytest.fixture
def world(monkeypatch):
    """torch.distributed as rank 0 (or `world.rank`) of 2 sees it: the collectives change nothing."""
    w = SimpleNamespace(rank=0, size=2)
    monkeypatch.setattr(dist, "get_rank", lambda: w.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: w.size)
    monkeypatch.setattr(dist, "broadcast", lambda t, src: None)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    return w


def recipe_in(run_dir, keep_last=2, **model) -> Recipe:
    return Recipe(model=ModelConfig(**model), checkpoint=CheckpointConfig(keep_last=keep_last), run_dir=str(run_dir))


def save(run_dir, step, engine=None, tokenizer=None, keep_last=2, **model):
    return checkpoint.save(engine or SaveEngine(), recipe_in(run_dir, keep_last, **model),
                           {"step": step, "position": step, "tokens": 64 * step}, tokenizer)


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ save


def test_a_save_writes_its_files_its_manifest_and_moves_latest(tmp_path, world):
    """Step 4 of a 2-rank run with micro-batch 2 x accumulation 3, torch AdamW, ZeRO-3: the tag folder holds
    DeepSpeed's files, rng_rank0.pt, engine_state.json, buffers.pt (the persistent routing bias only) and the
    tokenizer folder; manifest.json lists each file (not the folder, not itself) with its size on disk and whether
    it is a torch zip; `latest` names the tag; no .tmp file is left. [fails if: world_size, micro_batch or the
    optimizer is recorded wrong, the manifest's zip flag is lost (by manifest() or _is_zip's magic), folders are
    listed as files, the non-persistent buffers are saved instead of the persistent ones, or a .tmp is left behind]"""
    got = save(tmp_path, 4, tokenizer=Tokenizer())
    tag = tmp_path / "checkpoints" / "step_00000004"
    assert got == tag and (tmp_path / "checkpoints" / "latest").read_text() == "step_00000004"
    files = {"mp_rank_00_model_states.pt", "notes.bin", "rng_rank0.pt", "engine_state.json", "buffers.pt",
             "tokenizer/tokenizer.json"}
    assert {str(p.relative_to(tag)) for p in tag.rglob("*") if p.is_file()} == files | {MANIFEST}
    listed = json.loads((tag / MANIFEST).read_text())
    assert listed["tag"] == "step_00000004" and set(listed["files"]) == files
    for name, info in listed["files"].items():
        assert info["size"] == os.path.getsize(tag / name), name
        assert info["zip"] == (name in ("mp_rank_00_model_states.pt", "rng_rank0.pt", "buffers.pt")), name
    state = json.loads((tag / "engine_state.json").read_text())
    assert (state["step"], state["position"], state["tokens"]) == (4, 4, 256)
    assert (state["world_size"], state["micro_batch"], state["grad_accum"]) == (2, 2, 3)
    assert (state["optimizer"], state["zero_stage"], state["autoep_size"], state["pipeline_stages"]) == \
           ("torch AdamW", 3, 1, 0)
    buffers = torch.load(tag / "buffers.pt")
    assert list(buffers) == ["router.bias"] and torch.equal(buffers["router.bias"], torch.tensor([1.0, -2.0]))
    assert not list(tmp_path.rglob("*.tmp"))


def test_every_rank_writes_its_own_rng_file(tmp_path, world):
    """Rank 1 writes rng_rank1.pt (and not rank 0's name, which rank 0 writes at the same time). [fails if: every
    rank writes rng_rank0.pt]"""
    world.rank = 1
    save(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000002").glob("rng_*")) == ["rng_rank1.pt"]


def test_the_tag_latest_names_is_never_saved_again(tmp_path, world):
    """A stop right after resuming from step 4 saves step 4 again: nothing on disk changes (the folder is not cleared
    and rewritten under `latest`), and the next step's save is written. [fails if: latest's own tag is re-saved, or
    the already-saved check is inverted]"""
    save(tmp_path, 4)
    before = tree(tmp_path)
    (tmp_path / "checkpoints" / "step_00000004" / "notes.bin").write_bytes(b"xx")  # a re-save would rewrite it
    before["checkpoints/step_00000004/notes.bin"] = b"xx"
    assert save(tmp_path, 4) == tmp_path / "checkpoints" / "step_00000004"
    assert tree(tmp_path) == before
    save(tmp_path, 6)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000006"
    assert (tmp_path / "checkpoints" / "step_00000006" / MANIFEST).is_file()


def test_a_crashed_saves_folder_and_a_stale_conversion_are_cleared(tmp_path, world):
    """Step 6's folder left by a save killed before its manifest (a file DeepSpeed will not write again: another
    rank count's shard) and a universal conversion of step 6 from before: the save of step 6 starts from an empty
    folder and removes the old conversion. [fails if: the crashed folder is not cleared, or the stale universal
    copy is kept]"""
    save(tmp_path, 4)
    ck = tmp_path / "checkpoints"
    (ck / "step_00000006").mkdir()
    (ck / "step_00000006" / "zero_pp_rank_3_mp_rank_00_model_states.pt").write_bytes(b"old")
    (ck / "universal" / "step_00000006").mkdir(parents=True)
    (ck / "universal" / "step_00000006" / "old").write_text("x")
    save(tmp_path, 6)
    assert not (ck / "step_00000006" / "zero_pp_rank_3_mp_rank_00_model_states.pt").exists()
    assert "zero_pp_rank_3_mp_rank_00_model_states.pt" not in json.loads((ck / "step_00000006" / MANIFEST)
                                                                         .read_text())["files"]
    assert not (ck / "universal" / "step_00000006").exists()


def test_every_file_is_fsynced_before_the_manifest_and_the_manifest_before_latest(tmp_path, world, monkeypatch):
    """The order a power cut needs: each file of the tag fsynced, then manifest.json renamed into place, then
    `latest`; the folders that hold them (the tag's, tokenizer/) too, before the manifest. [fails if: the files or
    their folders are not fsynced, or `latest` moves before the manifest is written]"""
    events = []
    real_fsync, real_replace = checkpoint._fsync, os.replace
    monkeypatch.setattr(checkpoint, "_fsync", lambda p: events.append(("fsync", Path(p).name)) or real_fsync(p))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", Path(b).name)) or real_replace(a, b))
    save(tmp_path, 2, tokenizer=Tokenizer())
    m = events.index(("replace", MANIFEST))
    synced = {e[1] for e in events[:m] if e[0] == "fsync"}
    assert synced >= {"mp_rank_00_model_states.pt", "notes.bin", "rng_rank0.pt", "engine_state.json", "buffers.pt",
                      "tokenizer.json", "tokenizer", "step_00000002"}, events
    assert m < events.index(("replace", "latest")), events


def test_a_save_that_fails_before_its_manifest_leaves_latest_on_the_previous_tag(tmp_path, world, monkeypatch):
    """The manifest cannot be written (a full disk): the save fails and `latest` still names step 2, whose folder
    is untouched. [fails if: `latest` is moved before the manifest]"""
    save(tmp_path, 2)

    def full(folder):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "manifest", full)
    with pytest.raises(OSError):
        save(tmp_path, 4)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002"
    assert latest(tmp_path) == "step_00000002"


def test_keep_last_two_keeps_the_two_newest_saves(tmp_path, world):
    """Saves at steps 2, 4 and 6 with keep_last 2: steps 4 and 6 are left. [fails if: save prunes to keep_last + 1]"""
    for step in (2, 4, 6):
        save(tmp_path, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]


def test_deepspeeds_script_becomes_ours_and_stays_executable(tmp_path, world):
    """DeepSpeed copied zero_to_fp32.py (not zero_to_torch.py) next to the tags: after the save it is the pointer to
    bin/zero_to_fp32 of this checkout, mode 755, and no zero_to_torch.py appears. [fails if: the existing script is
    skipped and a missing one written, or it is not executable]"""
    save(tmp_path, 2)
    script = tmp_path / "checkpoints" / "zero_to_fp32.py"
    text = script.read_text()
    assert "from engine.export.write import main" in text and f"CHECKOUT = {str(ROOT)!r}" in text
    assert script.stat().st_mode & 0o777 == 0o755
    assert not (tmp_path / "checkpoints" / "zero_to_torch.py").exists()


def test_an_init_from_run_keeps_the_inits_generation_config(tmp_path, world):
    """A model.init_from run saves the config it trained with and a copy of the init's generation_config.json
    into init_model/. [fails if: the generation config is not copied]"""
    init = tmp_path / "init"
    init.mkdir()
    (init / "generation_config.json").write_text('{"eos_token_id": 7}')
    engine = SaveEngine()
    engine.module.config = SimpleNamespace(to_json_file=lambda p: Path(p).write_text('{"hidden_size": 8}'))
    save(tmp_path / "run", 2, engine=engine, init_from=str(init))
    folder = tmp_path / "run" / "checkpoints" / "step_00000002" / "init_model"
    assert (folder / "config.json").read_text() == '{"hidden_size": 8}'
    assert (folder / "generation_config.json").read_text() == '{"eos_token_id": 7}'


# ------------------------------------------------------------------------------------------------ _write_atomic


def test_write_atomic_renames_a_fsynced_temporary_file_and_fsyncs_the_folder(tmp_path, monkeypatch):
    """The new `latest` reaches its name by rename (the inode fsynced is the one the name then holds), the folder
    is fsynced after it, no .tmp stays, and a write that fails leaves the old `latest` whole. [fails if: the target
    is written in place, the file or the folder is not fsynced, or the temporary file is copied, not renamed]"""
    path = tmp_path / "latest"
    path.write_text("step_00000002")
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real(fd))
    checkpoint._write_atomic(path, "step_00000004")
    assert path.read_text() == "step_00000004" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert path.stat().st_ino in synced and tmp_path.stat().st_ino in synced
    assert synced.index(path.stat().st_ino) < synced.index(tmp_path.stat().st_ino)

    class Unwritable:  # open(..., "w").write() of it raises after the file was opened
        pass

    with pytest.raises(TypeError):
        checkpoint._write_atomic(path, Unwritable())
    assert path.read_text() == "step_00000004"


# ------------------------------------------------------------------------------------------------ load


class LoadEngine:
    """The DeepSpeed engine as load() sees it: load_checkpoint records where it was asked to load from."""

    def __init__(self, universal=False, micro=1, optimizer=None):
        self.universal, self.micro, self.loaded_from = universal, micro, None
        self.module = Module()
        self.optimizer = optimizer
        self.lr_scheduler = None

    def load_universal_checkpoint(self):
        return self.universal

    def load_checkpoint(self, load_dir, tag):
        self.loaded_from = (Path(load_dir), tag)
        return str(Path(load_dir, tag)), {"step": 6, "tokens": 384}

    def train_micro_batch_size_per_gpu(self):
        return self.micro


def checkpoint_at(run_dir, step=6, **state) -> Path:
    tag = run_dir / "checkpoints" / tag_for(step)
    tag.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(tag.name)
    (tag / checkpoint.STATE_FILE).write_text(json.dumps({"step": step, **state}))
    return tag


def test_load_converts_the_position_and_keeps_grpos_counters(tmp_path, world):
    """6 micro-batches of 1 sequence x 2 ranks = 12 sequences: on 3 ranks x micro-batch 2 that is position 2. The
    non-universal load reads RUN/checkpoints; GRPO's prompts_done and curriculum come back as saved. [fails if: the
    saved position is returned unconverted, the universal folder is used for a plain load, or prompts_done is
    dropped]"""
    checkpoint_at(tmp_path, position=6, micro_batch=1, world_size=2, prompts_done=40, curriculum={"seen": [1, 2]})
    world.size = 3
    engine = LoadEngine(micro=2)
    got = checkpoint.load(engine, tmp_path)
    assert got == {"step": 6, "position": 2, "tokens": 384, "prompts_done": 40, "curriculum": {"seen": [1, 2]}}
    assert engine.loaded_from == (tmp_path / "checkpoints", "step_00000006")


def test_each_rank_restores_its_own_generators(tmp_path, world):
    """Rank 1 restores rng_rank1.pt (python, numpy and torch), not rank 0's file. [fails if: every rank restores
    rng_rank0.pt, or the python or numpy state is not restored]"""
    tag = checkpoint_at(tmp_path, position=6, micro_batch=1, world_size=2)
    draws = {}
    for rank, seed in ((0, 1), (1, 2)):
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        torch.save(checkpoint._rng_state(), tag / f"rng_rank{rank}.pt")
        draws[rank] = (random.random(), float(np.random.rand()), float(torch.rand(())))
    world.rank = 1
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.load(LoadEngine(), tmp_path)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == draws[1]


def test_a_universal_load_restores_routing_biases_and_unshares_the_optimizer_step(tmp_path, world):
    """DeepSpeed's universal load reads RUN/checkpoints/universal, skips module buffers (they come from
    buffers.pt) and gives every partition the same step tensor: after load() each state has its own, so Adam's
    in-place step += 1 on one partition does not count again on the other. [fails if: the folders are swapped, the
    biases are not copied, or the step tensor stays shared]"""
    tag = checkpoint_at(tmp_path, position=6, micro_batch=1, world_size=2)
    torch.save({"router.bias": torch.tensor([0.25, 0.75])}, tag / "buffers.pt")
    step = torch.tensor(6.0)
    opt = SimpleNamespace(state={"p0": {"step": step}, "p1": {"step": step}}, param_groups=[])
    engine = LoadEngine(universal=True, optimizer=opt)
    checkpoint.load(engine, tmp_path)
    assert engine.loaded_from == (tmp_path / "checkpoints" / "universal", "step_00000006")
    assert torch.equal(engine.module.router.bias, torch.tensor([0.25, 0.75]))
    opt.state["p0"]["step"] += 1
    assert float(opt.state["p0"]["step"]) == 7.0 and float(opt.state["p1"]["step"]) == 6.0


def test_load_puts_the_recipes_lr_under_the_restored_schedule(tmp_path, world):
    """The checkpoint's scheduler had base LR 0.003 at epoch 5 of a flat x0.5 schedule; load(lr=0.01) makes the
    next update's LR 0.01 x 0.5 = 0.005. [fails if: load does not apply the recipe's LR]"""
    checkpoint_at(tmp_path, position=6, micro_batch=1, world_size=2)
    group = {"lr": 3e-3 * 0.5, "initial_lr": 3e-3}  # torch's LambdaLR as DeepSpeed restored it (a real one: seconds)
    sched = SimpleNamespace(base_lrs=[3e-3], optimizer=SimpleNamespace(param_groups=[group]),
                            lr_lambdas=[lambda epoch: 0.5 if epoch == 5 else 0.0], last_epoch=5)
    engine = LoadEngine()
    engine.lr_scheduler = sched
    checkpoint.load(engine, tmp_path, lr=1e-2)
    assert sched.base_lrs == [1e-2] and group == {"lr": pytest.approx(5e-3), "initial_lr": 1e-2}


def test_the_cpu_adam_products_are_replayed_for_every_step_taken(_no_deepspeed_import):
    """After 3 steps DeepSpeedCPUAdam's running products are rebuilt by steps t = 1, 2, 3 (after 2, the CPU
    FusedAdam's by 1, 2), with the group's betas and eps and lr 0. [fails if: the replay stops one step short]"""
    calls = []
    CPUAdam, Fused = _no_deepspeed_import.DeepSpeedCPUAdam, _no_deepspeed_import.FusedAdam
    cpu = CPUAdam()
    cpu.state = {"p": {"step": torch.tensor(3.0)}}
    cpu.param_groups = [{"betas": (0.8, 0.9), "eps": 1e-6}]
    cpu.opt_id = 5
    cpu.ds_opt_adam = SimpleNamespace(adam_update=lambda opt_id, t, lr, b1, b2, eps, *rest: calls.append(
        (opt_id, t, lr, b1, b2, eps)))
    checkpoint._rebuild_cpu_adam_products(SimpleNamespace(optimizer=cpu, device="cpu"))
    assert calls == [(5, t, 0.0, 0.8, 0.9, 1e-6) for t in (1, 2, 3)]
    fused = Fused()
    fused.state, fused.param_groups = {"p": {"step": 2}}, [{"betas": (0.8, 0.9), "eps": 1e-6}]
    fused._dummy_overflow_buf, fused.adam_w_mode = None, 1
    fused.multi_tensor_adam = lambda chunk, buf, lists, lr, b1, b2, eps, t, *rest: calls.append(("fused", t))
    calls.clear()
    checkpoint._rebuild_cpu_adam_products(SimpleNamespace(optimizer=SimpleNamespace(optimizer=fused), device="cpu"))
    assert calls == [("fused", 1), ("fused", 2)]


# ------------------------------------------------------------------------------------------------ to_universal


def test_to_universal_converts_once_into_place_and_names_the_tag(tmp_path, monkeypatch):
    """ds_to_universal writes into <tag>.converting (and names that folder in latest_universal); the folder is
    renamed to universal/<tag>, latest_universal names the tag, and a second call converts nothing. [fails if: an
    existing conversion is redone, or latest_universal keeps the temporary folder's name]"""
    tag = checkpoint_at(tmp_path)
    runs = []

    def ds_to_universal(cmd, capture_output, text):
        out = Path(cmd[cmd.index("--output_folder") + 1])
        runs.append((cmd[cmd.index("--input_folder") + 1], out.name))
        out.mkdir()
        (out / "zero").mkdir()
        (out.parent / "latest_universal").write_text(out.name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(checkpoint.subprocess, "run", ds_to_universal)
    uni = tmp_path / "checkpoints" / "universal"
    assert checkpoint.to_universal(tmp_path) == uni / "step_00000006"
    assert checkpoint.to_universal(tmp_path) == uni / "step_00000006"
    assert runs == [(str(tag), "step_00000006.converting")]
    assert sorted(p.name for p in uni.iterdir()) == ["latest_universal", "step_00000006"]
    assert (uni / "latest_universal").read_text() == "step_00000006" and (uni / "step_00000006" / "zero").is_dir()


def test_a_failed_conversion_is_one_line_quoting_its_last_line_and_leaves_nothing(tmp_path, monkeypatch):
    """ds_to_universal exits 1 after a traceback: the refusal quotes the traceback's last line (the error), and
    neither the temporary nor the final folder is left. [fails if: the first line is quoted, or the half-written
    folder stays]"""
    tag = checkpoint_at(tmp_path)

    def fails(cmd, capture_output, text):
        out = Path(cmd[cmd.index("--output_folder") + 1])
        out.mkdir()
        (out / "partial").write_text("x")
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback (most recent call last):\n  File \"x\"\n"
                                                       "ValueError: shapes differ\n")

    monkeypatch.setattr(checkpoint.subprocess, "run", fails)
    with pytest.raises(ConfigError) as e:
        checkpoint.to_universal(tmp_path)
    assert str(e.value) == (f"--resume: DeepSpeed could not convert {tag} to its universal format (ValueError: "
                            "shapes differ); resume on the world size it was saved with")
    assert list((tmp_path / "checkpoints" / "universal").iterdir()) == []


# ------------------------------------------------------------------------------------------------ Cadence


@pytest.fixture
def other_rank(monkeypatch):
    """A pretend peer in the all-reduce: its flags (by_time, signal, fail, stop file) are `theirs`, and the op is
    applied as torch.distributed would."""
    peer = SimpleNamespace(theirs=[0.0, 0.0, 0.0, 0.0], rank=0)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: peer.rank)

    def all_reduce(t, op):
        other = torch.tensor(peer.theirs[: t.numel()], dtype=t.dtype)
        t.copy_(torch.maximum(t, other) if op == dist.ReduceOp.MAX else torch.minimum(t, other))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return peer


def test_a_signal_only_the_other_rank_got_saves_stops_and_is_named(other_rank):
    """The launcher forwarded SIGTERM (15) to the other rank only: this rank saves and stops at the boundary too, and
    says `signal 15`. [fails if: the flags are reduced with MIN, the peer's signal is not recorded, or why()'s
    branches are swapped]"""
    other_rank.theirs = [0.0, 15.0, 0.0, 0.0]
    c = Cadence(CheckpointConfig(every_steps=0, at_end=True))
    try:
        assert c.due(3, 10) == (True, True)
        assert c.signal == 15 and c.why() == "signal 15"
    finally:
        c.close()


def test_a_failure_on_the_other_rank_is_agreed_before_the_first_step(other_rank):
    """agree_failed: the peer could not read its first batch. [fails if: the flag is reduced with MIN]"""
    other_rank.theirs = [1.0]
    c = Cadence(CheckpointConfig())
    try:
        assert c.agree_failed() is True and c.failed
    finally:
        c.close()


def test_the_stop_file_stops_with_a_save_and_is_removed(tmp_path, other_rank):
    """RUN/STOP exists: rank 0 saves, stops, removes the file (a --resume must not stop at once), and names the file
    as the reason. [fails if: the file does not stop the run, is not removed, or why() names a signal]"""
    stop = tmp_path / "STOP"
    stop.touch()
    c = Cadence(CheckpointConfig(every_steps=0, at_end=False), stop_file=stop)
    try:
        assert c.due(2, 10) == (True, True)
        assert not stop.exists() and c.stopped_by_file and c.why() == str(stop)
    finally:
        c.close()


def test_at_end_a_failure_and_a_signal_each_save(monkeypatch):
    """Outside a process group: every_steps 0 and at_end: step 9 of 10 saves nothing, step 10 saves without stopping;
    fail() at step 4 saves and stops (at_end); a signal at step 5 saves and stops; a second signal keeps the
    first one's number. [fails if: at_end is off by one, a failure does not save at the end, a signal stops without
    saving, or a second signal replaces the first]"""
    import signal

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    c = Cadence(CheckpointConfig(every_steps=0, at_end=True))
    try:
        assert c.due(9, 10) == (False, False)
        assert c.due(10, 10) == (True, False)
        c.fail()
        assert c.due(4, 10) == (True, True) and c.failed
    finally:
        c.close()
    c = Cadence(CheckpointConfig(every_steps=0, at_end=False))
    try:
        c._on_signal(signal.SIGTERM, None)
        c._on_signal(signal.SIGINT, None)
        assert c.due(5, 10) == (True, True) and c.why() == f"signal {int(signal.SIGTERM)}"
    finally:
        c.close()


# ------------------------------------------------------------------------------------------------ latest, prune


def test_latest_reads_a_hand_written_tag_and_refuses_a_missing_one(tmp_path):
    """`latest` written by hand (`echo step_00000012 > latest`, as the refusal lines ask) ends with a newline and
    still names step 12; a `latest` naming a folder that is not there names nothing. tag_for pads to 8 digits.
    [fails if: the newline is kept, or a missing folder is accepted, or the tag has another width]"""
    assert tag_for(12) == "step_00000012"
    (tmp_path / "checkpoints" / "step_00000012").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000012\n")
    assert latest(tmp_path) == "step_00000012"
    (tmp_path / "checkpoints" / "latest").write_text("step_00000099")
    assert latest(tmp_path) is None


def test_prune_keeps_exactly_keep_last_and_removes_orphan_conversions(tmp_path):
    """Complete tags 2, 4, 6, 8 (latest 8), a half-written 10, universal copies of 2 and 8 and a half-converted
    8.converting: keep_last 2 leaves 6 and 8 and the universal copy of 8 only. [fails if: one more tag is kept,
    half-written tags survive, or universal copies are kept for removed tags and removed for kept ones]"""
    for step in (2, 4, 6, 8, 10):
        (tmp_path / tag_for(step)).mkdir()
        if step != 10:
            (tmp_path / tag_for(step) / MANIFEST).write_text("{}")
    (tmp_path / "latest").write_text(tag_for(8))
    for name in (tag_for(2), tag_for(8), tag_for(8) + ".converting"):
        (tmp_path / "universal" / name).mkdir(parents=True)
    (tmp_path / "universal" / "latest_universal").write_text(tag_for(8))
    prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000006", "step_00000008"]
    assert sorted(p.name for p in (tmp_path / "universal").iterdir()) == ["latest_universal", "step_00000008"]


# ------------------------------------------------------------------------------------------------ damage


def manifest_of(folder: Path, **files):
    (folder / MANIFEST).write_text(json.dumps({"files": files}))


def flipped_torch_file(path: Path) -> int:
    """A torch file with one byte of its (uncompressed) tensor data flipped: same size, a CRC mismatch."""
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, path)
    data = bytearray(path.read_bytes())
    data[data.index(np.arange(64, dtype=np.float32).tobytes()) + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    return len(data)


def test_damage_names_a_short_file_a_missing_one_and_a_manifest_without_files(tmp_path):
    """Each a line naming the file: 3 bytes on disk against 5 saved; a listed file that is gone; a manifest with no
    "files" key is unreadable (KeyError), not a crash. [fails if: a shrunk file passes, a missing one raises, or a
    KeyError escapes]"""
    (tmp_path / "a.bin").write_bytes(b"abc")
    manifest_of(tmp_path, **{"a.bin": {"size": 5, "zip": False}})
    assert damage(tmp_path, False) == "a.bin has 3 bytes, 5 when saved"
    manifest_of(tmp_path, **{"gone.pt": {"size": 5, "zip": True}})
    assert damage(tmp_path, False) == "gone.pt is missing"
    (tmp_path / MANIFEST).write_text('{"tag": "step_00000002"}')
    assert damage(tmp_path, False) == f"{MANIFEST} is unreadable: KeyError"


def test_crcs_are_verified_where_asked_also_without_a_manifest(tmp_path):
    """A flipped byte in a torch file keeps its size: with a manifest (zip true) and in a folder saved before
    manifests (.pt files are zips), verify_crc finds the entry; without verify_crc it passes. [fails if: the CRC
    is never tested, or folders without a manifest are never zip-checked]"""
    size = flipped_torch_file(tmp_path / "model.pt")
    assert damage(tmp_path, False) is None
    assert damage(tmp_path, True).startswith("model.pt fails its CRC check in entry ")
    manifest_of(tmp_path, **{"model.pt": {"size": size, "zip": True}})
    assert damage(tmp_path, True).startswith("model.pt fails its CRC check in entry ")
    assert damage(tmp_path, False) is None


# ------------------------------------------------------------------------------------------------ check_resume


def saved(run_dir, step=10, **state) -> Path:
    """A complete checkpoint at `step` that `latest` names: engine_state.json (default model, ZeRO-3, one rank,
    FusedAdam) over `state`, and a manifest of its files."""
    tag = run_dir / "checkpoints" / tag_for(step)
    tag.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(tag.name)
    full = {"step": step, "position": step, "micro_batch": 1, "world_size": 1, "zero_stage": 3,
            "recipe": {"model": dataclasses.asdict(ModelConfig())}, **state}
    full = {k: v for k, v in full.items() if v is not None}
    (tag / checkpoint.STATE_FILE).write_text(json.dumps(full))
    (tag / MANIFEST).write_text(json.dumps({"files": {checkpoint.STATE_FILE: {
        "size": (tag / checkpoint.STATE_FILE).stat().st_size, "zip": False}}}))
    return tag


def recipe(run_dir, model=None, **train) -> Recipe:
    return Recipe(model=model or ModelConfig(), train=dataclasses.replace(TrainConfig(), **train), run_dir=str(run_dir),
                  resume=True)


def test_a_damaged_checkpoint_offers_the_newest_older_one_and_rank_0_checks_crcs(tmp_path):
    """Tags 4, 6 and 8 complete, 8 (latest) with a flipped byte: rank 0 refuses it and offers step 6, the newest
    older one (never 8 itself); rank 1 checks sizes only and passes. [fails if: the damaged tag is offered, or the
    CRC check runs on the wrong ranks]"""
    for step in (4, 6):
        saved(tmp_path, step)
    tag = saved(tmp_path, 8)
    size = flipped_torch_file(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    files = json.loads((tag / MANIFEST).read_text())["files"]
    files["zero_pp_rank_0_mp_rank_00_optim_states.pt"] = {"size": size, "zip": True}
    (tag / MANIFEST).write_text(json.dumps({"files": files}))
    problems, _ = check_resume(recipe(tmp_path), DS, 1, rank=0)
    assert len(problems) == 1 and problems[0].startswith(
        f"--resume: checkpoint {tag} is damaged (zero_pp_rank_0_mp_rank_00_optim_states.pt fails its CRC check")
    assert problems[0].endswith(f"; restore it, or resume from an older checkpoint by writing its tag "
                                f"(step_00000006) into {tmp_path / 'checkpoints' / 'latest'}")
    assert check_resume(recipe(tmp_path), DS, 1, rank=1) == ([], False)


def test_a_checkpoint_at_max_steps_resumes_and_one_past_it_is_refused(tmp_path):
    """Step 10 with train.max_steps 10 is no problem (the run says there is nothing to train); with max_steps 9 it is
    refused by its line. [fails if: a checkpoint at max_steps is refused]"""
    saved(tmp_path, 10)
    assert check_resume(recipe(tmp_path, max_steps=10), DS, 1) == ([], False)
    assert check_resume(recipe(tmp_path, max_steps=9), DS, 1)[0] == [
        f"--resume: checkpoint {tmp_path / 'checkpoints' / 'step_00000010'} is at step 10, past train.max_steps (9); "
        "raise --max_steps to train on"]


def test_a_checkpoint_from_before_zero_stage_was_recorded(tmp_path):
    """Without zero_stage in engine_state.json: no ZeRO-3 model-states file means "1 or 2" (refused under stage 3);
    DeepSpeed's ZeRO-3 layout (zero_pp_rank_0_mp_rank_00_model_states.pt) means stage 3 (refused under stage 2).
    [fails if: "1 or 2" passes under stage 3, or the ZeRO-3 layout is looked for under another file name]"""
    tag = saved(tmp_path, zero_stage=None)
    assert check_resume(recipe(tmp_path), DS, 1)[0] == [
        f"--resume: checkpoint {tag} was trained with ZeRO stage 1 or 2, the DeepSpeed config has stage 3 (DeepSpeed "
        "cannot load one's partitions as the other's); resume with the DS config it was trained with"]
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    files = json.loads((tag / MANIFEST).read_text())["files"]
    files["zero_pp_rank_0_mp_rank_00_model_states.pt"] = {"size": 0, "zip": False}
    (tag / MANIFEST).write_text(json.dumps({"files": files}))
    assert check_resume(recipe(tmp_path), {**DS, "zero_optimization": {"stage": 2}}, 1)[0] == [
        f"--resume: checkpoint {tag} was trained with ZeRO stage 3, the DeepSpeed config has stage 2 (DeepSpeed "
        "cannot load one's partitions as the other's); resume with the DS config it was trained with"]


def test_a_pipeline_checkpoint_that_recorded_its_stage_is_compared(tmp_path):
    """A pipeline run's checkpoint recorded zero_stage 1; a pipeline DS config with stage 0 is refused (only a
    pipeline checkpoint without a recorded stage skips the comparison). [fails if: the recorded stage of a
    pipeline run is not compared]"""
    tag = saved(tmp_path, zero_stage=1, pipeline_stages=2, world_size=2)
    ds = {**DS, "zero_optimization": {"stage": 0}, "pipeline": {"stages": 2}}
    problems, _ = check_resume(recipe(tmp_path), ds, 2)
    assert problems == [f"--resume: checkpoint {tag} was trained with ZeRO stage 1, the DeepSpeed config has stage 0 "
                        "(DeepSpeed cannot load one's partitions as the other's); resume with the DS config it was "
                        "trained with"]


def test_another_expert_parallel_size_loads_through_the_universal_form(tmp_path):
    """Same world size (2), autoep_size 2 in the checkpoint and 1 now: universal; and pipeline mode refuses a
    world-size change by its line. A DS config's own checkpoint.load_universal is kept on the same layout. [fails
    if: only the world size makes a resume universal, the pipeline refusal's condition is inverted, or the DS
    config's load_universal is ignored]"""
    saved(tmp_path, world_size=2, autoep_size=2)
    assert check_resume(recipe(tmp_path), DS, 2) == ([], True)
    plain = tmp_path / "plain"
    saved(plain, world_size=2, autoep_size=1)
    assert check_resume(recipe(plain), DS, 2) == ([], False)
    assert check_resume(recipe(plain), {**DS, "checkpoint": {"load_universal": True}}, 2) == ([], True)
    pipe = tmp_path / "pipe"
    tag = saved(pipe, world_size=4, autoep_size=1, pipeline_stages=2, zero_stage=None)
    ds = {**DS, "zero_optimization": {"stage": 0}, "pipeline": {"stages": 2}}
    problems, universal = check_resume(recipe(pipe), ds, 2)
    assert universal and problems == [f"--resume: checkpoint {tag} was saved on 4 ranks with autoep_size 1; pipeline "
                                      "mode resumes only on the same world size and autoep_size (2 and 1 now)"]


def test_recipe_fields_are_skipped_only_when_both_sides_started_from_init_from(tmp_path):
    """A checkpoint of a run without model.init_from, resumed by a recipe that has one: its arch is compared (only a
    checkpoint that also recorded init_from holds unused recipe values). [fails if: either side's init_from skips
    the comparison]"""
    saved(tmp_path, recipe={"model": dataclasses.asdict(ModelConfig(hidden_size=96))})
    r = recipe(tmp_path, model=dataclasses.replace(ModelConfig(), init_from=str(tmp_path)))
    problems, _ = check_resume(r, DS, 1)
    assert len(problems) == 1 and "model.hidden_size: 96 in the checkpoint, 64 in the recipe" in problems[0], problems


# ------------------------------------------------------------------------------------------------ the rest


def test_no_latest_names_the_newest_complete_tags_and_a_missing_named_one(tmp_path):
    """Complete tags 2, 4, 6, 8 and `latest` naming 9, which is gone: the line names that and the three newest
    complete tags. [fails if: the oldest are named, or a `latest` naming a missing tag is called no checkpoint]"""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        (root / tag_for(step)).mkdir(parents=True)
        (root / tag_for(step) / MANIFEST).write_text("{}")
    (root / "latest").write_text(tag_for(9))
    assert no_latest(root, resume=True) == (
        f"--resume: {root / 'latest'} names 'step_00000009', which is not there; its complete checkpoints: "
        f"step_00000004, step_00000006, step_00000008: write one of those tags into {root / 'latest'} and run with "
        "--resume")
    empty = tmp_path / "empty" / "checkpoints"
    empty.mkdir(parents=True)
    (empty / "latest").write_text(tag_for(9))
    assert no_latest(empty, resume=True) == (f"--resume: {empty / 'latest'} names 'step_00000009', which is not "
                                             f"there, and none of its checkpoints is complete; move {empty} away or "
                                             "pass another --run_dir")


def test_a_run_dir_this_user_cannot_write_is_refused(tmp_path, monkeypatch):
    """os.access says the run_dir is readable and searchable but not writable: refused by its line. [fails if: the
    check asks for read access instead of write access]"""
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & os.W_OK)
    r = dataclasses.replace(recipe(tmp_path), resume=False)
    assert run_dir_problems(r) == [f"run_dir {tmp_path}: {tmp_path} is not writable by this user; pass another "
                                   "--run_dir"]


def test_unreadable_states_and_a_zero_batch_are_not_taken_for_a_checkpoints_values(tmp_path):
    """engine_state.json holding a JSON list is no state (None); a recorded micro_batch of 0 is not a batch.
    [fails if: a non-dict state is returned, or 0 passes as a batch value]"""
    tag = saved(tmp_path)
    (tag / checkpoint.STATE_FILE).write_text("[1, 2]")
    assert saved_state(tmp_path) is None and recorded_batch(tmp_path) is None
    (tag / checkpoint.STATE_FILE).write_text(json.dumps({"step": 10, "micro_batch": 0, "grad_accum": 4}))
    assert recorded_batch(tmp_path) is None  # a state with a zero batch is refused whole (check_resume's line)


# ------------------------------------------------------------------------------------------------ wrong shapes


def resealed(tag: Path) -> None:
    (tag / MANIFEST).write_text(json.dumps({"tag": tag.name, "files": checkpoint.manifest(tag)}))


@pytest.mark.parametrize("text, why", [
    ("[]", "it is an array, not an object"),
    ("null", "it is null, not an object"),
    ('{"step": 2, "recipe": {}}', "it has no position"),
    ('{"step": 2, "position": 2}', "it has no recipe"),
    ('{"step": "2", "position": 2, "recipe": {}}', 'it has step "2", not an integer'),
    ('{"step": 2, "position": 2, "recipe": []}', "it has recipe [], not an object"),
    ('{"step": 2, "position": 2, "recipe": {"model": [1]}}', "it has recipe.model [1], not an object"),
    ('{"step": 2, "position": -1, "recipe": {}}', "it has position -1, below 0"),
    ('{"step": 2, "position": 2, "world_size": 0, "recipe": {}}', "it has world_size 0, below 1"),
    ('{"step": 2, "position": 2, "micro_batch": true, "recipe": {}}', "it has micro_batch true, not an integer"),
    ('{"step": 2, "position": 2, "optimizer": 3, "recipe": {}}', "it has optimizer 3, not a string"),
    ('{"step": 2, "position": 2, "curriculum": [], "recipe": {}}', "it has curriculum [], not an object"),
    ('{"step": 2, "position": 2, "curriculum": {"n_prompts": 0}, "recipe": {}}',
     "it has curriculum.n_prompts 0, not a count of prompts"),
    ('{"step": 2, "position": 2, "curriculum": {"n_prompts": 2, "attempts": [1, 2], "passes": [1], '
     '"reward_sum": [0.5, 0]}, "recipe": {}}',
     "it has curriculum.passes that is not 2 finite numbers (one per prompt)"),
    ('{"step": 2, "position": 2, "curriculum": {"n_prompts": 2, "attempts": [1, 2], "passes": [1, 0], '
     '"reward_sum": [NaN, 0]}, "recipe": {}}',
     "it has curriculum.reward_sum that is not 2 finite numbers (one per prompt)"),
    ('{"step": 2, "position": 2, "curriculum": {"n_prompts": 2, "attempts": [1, "2"], "passes": [1, 0], '
     '"reward_sum": [0.5, 0]}, "recipe": {}}',
     "it has curriculum.attempts that is not 2 finite numbers (one per prompt)"),
    ('{"step": 2, "position": 2, "curriculum": {"n_prompts": 2, "attempts": [1, 2], "passes": [-1, 0], '
     '"reward_sum": [-0.5, 0]}, "recipe": {}}', "it has curriculum.passes below 0"),
])
def test_an_engine_state_of_the_wrong_shape_is_refused_by_its_line(tmp_path, text, why):
    """engine_state.json that parses but is not what save writes (hand-edited, another tool's): --resume's preflight
    refuses it in one line naming what is wrong, the single-field readers (saved_state, recorded_batch) see no
    state where a field has the wrong type, and the exporter refuses it too; none raises. [fails if: any of these
    raises (the traceback this replaced: AttributeError, KeyError, TypeError), or a wrong field passes]"""
    from engine.export.read import read_state

    tag = saved(tmp_path, 10)
    (tag / checkpoint.STATE_FILE).write_text(text)
    resealed(tag)  # consistent files: only the content is wrong
    problems, universal = check_resume(recipe(tmp_path), DS, 1)
    assert problems == [f"--resume: checkpoint {tag} has an {checkpoint.STATE_FILE} this engine did not "
                        f"write ({why}); restore it, or start a fresh run_dir"] and not universal
    if "has no" not in why:  # a missing field is for check_resume to report; the single-field readers go on
        assert saved_state(tmp_path) is None and recorded_batch(tmp_path) is None
    with pytest.raises(ExportError, match=f"not one this engine wrote \\({re.escape(why)}\\)"):
        read_state(tag)


def test_the_state_as_save_writes_it_passes_the_shape_check(tmp_path):
    """Every field save and GRPO's save write, with their real types (optimizer null, init_source a path, a
    curriculum's statistics as PromptCurriculum.state_dict writes them), passes; so does a state without the optional
    fields. [fails if: the check refuses a real state]"""
    from engine.config import CurriculumConfig
    from engine.curriculum import PromptCurriculum

    full = {"step": 4, "position": 8, "tokens": 4096, "micro_batch": 2, "world_size": 2, "grad_accum": 1,
            "autoep_size": 1, "pipeline_stages": 0, "zero_stage": 3, "optimizer": None, "init_source": "/m",
            "prompts_done": 8, "recipe": {"model": {}, "data": {}, "train": {}}}
    cur = PromptCurriculum(CurriculumConfig(enabled=True), 3, 2, 0)
    cur.update([0, 0, 2, 2], [1.0, 0.0, -0.5, 2.0])
    cur.update([0, 0], [1.0, 1.0])  # decayed counts: floats
    full["curriculum"] = json.loads(json.dumps(cur.state_dict()))
    assert checkpoint.state_problem(full) is None
    assert checkpoint.state_problem({"step": 4, "position": 8, "recipe": {}}) is None


@pytest.mark.parametrize("text", ["null", "[]", '{"files": ["a"]}', '{"files": {"a": 3}}', '{"files": {"a": {}}}',
                                  '{"files": {"a": {"size": "3"}}}', '{"files": {"a": {"size": 3, "zip": 1}}}',
                                  '{"files": {"a": {"size": 3, "crc32": "x"}}}', '{"files": null}'])
def test_a_manifest_of_the_wrong_shape_is_damage_not_a_crash(tmp_path, text):
    """manifest.json that parses but is not save's {files: {name: {size, zip, crc32}}}: damage() names the manifest
    (for --resume and the exporter alike). [fails if: it raises, or passes the folder]"""
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / MANIFEST).write_text(text)
    bad = damage(tmp_path, True)
    assert bad is not None and bad.startswith(MANIFEST), bad


def test_a_same_size_edit_of_engine_state_is_found_by_its_crc(tmp_path):
    """A non-zip file's CRC-32 is in the manifest: engine_state.json edited to the same size (step 10 -> 99,
    position alike) is damage where CRCs are checked (rank 0, the exporter), and a manifest without crc32 (older
    saves) is still read by sizes. [fails if: the CRC is not recorded, not compared, or required]"""
    tag = saved(tmp_path, 10)
    resealed(tag)
    assert "crc32" in json.loads((tag / MANIFEST).read_text())["files"][checkpoint.STATE_FILE]
    text = (tag / checkpoint.STATE_FILE).read_text()
    (tag / checkpoint.STATE_FILE).write_text(text.replace('"step": 10', '"step": 99'))
    assert damage(tag, True) == f"{checkpoint.STATE_FILE} has changed since it was saved: its CRC-32 differs"
    assert damage(tag, False) is None  # sizes only
    files = json.loads((tag / MANIFEST).read_text())["files"]
    del files[checkpoint.STATE_FILE]["crc32"]
    manifest_of(tag, **files)
    assert damage(tag, True) is None

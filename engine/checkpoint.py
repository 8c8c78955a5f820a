"""Checkpoints: DeepSpeed engine state + the engine's client state, in RUN_DIR/checkpoints/<tag>; crash-safe, exact
resume.

Layout:  RUN_DIR/checkpoints/step_00000100/   DeepSpeed's files, rng_rank{r}.pt, engine_state.json, buffers.pt,
                                              tokenizer/, init_model/ (model.init_from runs: the config trained
                                              with, the init's generation config), and manifest.json (written
                                              last: every file and its size)
         RUN_DIR/checkpoints/latest            names the newest complete tag
         RUN_DIR/checkpoints/universal/<tag>   DeepSpeed's universal form of <tag>, made when resuming on another
                                              world size or expert-parallel size
Saving: every rank writes its files; barrier; rank 0 fsyncs them, writes manifest.json, then atomically moves
`latest`. A crash (kill -9, power cut) at any point before that rename leaves `latest` on the previous tag, and
the half-written folder is removed by the next save of that tag or by pruning. `--resume` checks the manifest
(sizes on every rank, zip CRCs of every file on rank 0) before any rank does work.
Signals: SIGTERM/SIGINT set a flag; at the next step boundary the ranks agree (all-reduce MAX), save, and stop.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config import BUNDLED_TOKENIZER, FROM_HF, CheckpointConfig, ConfigError, Recipe
from .ds_config import ep_size

STATE_FILE = "engine_state.json"
MANIFEST = "manifest.json"
BUFFERS = "buffers.pt"
INIT_DIR = "init_model"  # a model.init_from run's config.json and generation_config.json, as trained (the export's)
STOP_FILE = "STOP"  # RUN_DIR/STOP: save at the next step boundary and end the run with exit 0 (Cadence)
UNIVERSAL = "universal"


def ckpt_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: str | Path) -> str | None:
    f = ckpt_dir(run_dir) / "latest"
    if not f.is_file():
        return None
    tag = f.read_text().strip()
    return tag if tag and (ckpt_dir(run_dir) / tag).is_dir() else None


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


class Cadence:
    """When to save: every N steps, every M minutes, at the last step, and after SIGTERM/SIGINT or once `stop_file`
    exists (then stop). A stop by signal leaves the `deepspeed` launcher's exit code at 1 (it exits 1 whenever it has
    forwarded a signal); a stop by the file is a normal end, exit 0. The file is removed once seen, so --resume goes on.

    The signal handler only sets a flag; `due` all-reduces (MAX) the flags of every rank at each step boundary,
    so all ranks enter the save together even when only one rank (or only the launcher's first child) got the
    signal. `fail()` (this rank cannot read its next batch) stops every rank the same way, saving when at_end is
    set (the run ends there); `failed` then says so on every rank. Call `close()` to restore the previous handlers.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, c: CheckpointConfig, device: torch.device | str = "cpu", stop_file: Path | None = None):
        self.c, self.last, self.device, self.stop_file = c, time.time(), device, stop_file
        self.signal: int = 0
        self.stopped_by_file = False
        self.failed = self._fail = False
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
                signal.siginterrupt(sig, False)  # restart interrupted system calls (sockets of gloo/NCCL)

    def _on_signal(self, signum, frame) -> None:
        self.signal = self.signal or signum  # acted on at the next step boundary; a second signal changes nothing

    def fail(self) -> None:
        self._fail = True  # acted on at this step boundary, on every rank

    def agree_failed(self) -> bool:
        """Whether any rank called fail(), the same on every rank: before the first step (due() does it after)."""
        flag = torch.tensor([float(self._fail)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.failed = bool(flag[0])
        return self.failed

    def due(self, step: int, max_steps: int) -> tuple[bool, bool]:
        """(save now, stop after saving), the same on every rank."""
        by_time = self.c.every_minutes > 0 and time.time() - self.last >= 60 * self.c.every_minutes
        asked = self.stop_file is not None and self.stop_file.exists()  # one stat per step
        flags = torch.tensor([float(by_time), float(self.signal), float(self._fail), float(asked)],
                             device=self.device)  # NCCL: accelerator tensors
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.failed, self.stopped_by_file = bool(flags[2]), bool(flags[3])
        if self.stopped_by_file and (not dist.is_initialized() or dist.get_rank() == 0):
            self.stop_file.unlink(missing_ok=True)  # every rank has looked (the all-reduce): --resume must not stop
        stop = bool(flags[1]) or self.failed or self.stopped_by_file
        due = ((self.c.at_end and (step == max_steps or self.failed))
               or (self.c.every_steps and step % self.c.every_steps == 0) or bool(flags[0]) or bool(flags[1])
               or self.stopped_by_file)
        if due:
            self.last = time.time()
        if stop and not self.signal:
            self.signal = int(flags[1])
        return bool(due), stop

    def why(self) -> str:
        """What stopped the run (after due() said stop and not failed): `signal N` or the stop file."""
        return f"signal {self.signal}" if self.signal else f"{self.stop_file}"

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def save_init_config(engine, recipe: Recipe, folder: Path) -> None:
    """For a model.init_from run: the config the model trained with and the init model's generation config, so the
    export does not read them from an init folder that may have changed, moved, or be relative to another cwd."""
    cfg = getattr(engine.module, "config", None)
    if not recipe.model.init_from or cfg is None:
        return
    folder.mkdir()
    cfg.to_json_file(folder / "config.json")
    gen = Path(recipe.model.init_from, "generation_config.json")
    if gen.is_file():
        shutil.copyfile(gen, folder / "generation_config.json")


def saved_optimizer(engine) -> str | None:
    """optimizer_kind's name for the optimizer this engine runs (None: one it does not name)."""
    name = type(getattr(engine, "basic_optimizer", None)).__name__
    return {"AdamWSR": "AdamWSR", "DeepSpeedCPUAdam": "DeepSpeedCPUAdam", "FusedAdam": "FusedAdam",
            "AdamW": "torch AdamW"}.get(name)


def _rng_state() -> dict:
    """Every generator a rank draws from: the GPU's too (the rollout decoder samples there; compiled code seeds
    its own random numbers from it)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device
    return state


def _restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _persistent_buffers(module: torch.nn.Module) -> dict:
    return {f"{prefix}.{name}" if prefix else name: b.detach().cpu().clone()
            for prefix, m in module.named_modules() for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"  # torch.save's format: a zip whose entries carry CRC-32s


def save(engine, recipe: Recipe, state: dict, tokenizer=None) -> Path:
    """Save engine + client state under a new tag, then move `latest`; prune to checkpoint.keep_last."""
    root = ckpt_dir(recipe.run_dir)
    tag = tag_for(state["step"])
    rank = dist.get_rank()
    saved = torch.tensor([float(tag == latest(recipe.run_dir))], device=engine.device)
    dist.broadcast(saved, 0)  # rank 0's `latest` decides for all: other nodes' disks may hold none, or an older one
    if saved.item():
        return root / tag  # already saved (e.g. stopped right after resuming from it); never rewrite `latest`'s tag
    if rank == 0:  # left by a save that crashed (DeepSpeed would mix its files with ours), or a stale conversion
        shutil.rmtree(root / tag, ignore_errors=True)
        shutil.rmtree(root / UNIVERSAL / tag, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False)
    torch.save(_rng_state(), root / tag / f"rng_rank{rank}.pt")
    if rank == 0:
        point_to_our_exporter(root)
        torch.save(_persistent_buffers(engine.module), root / tag / BUFFERS)
        (root / tag / STATE_FILE).write_text(json.dumps({
            **state, "world_size": dist.get_world_size(), "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "grad_accum": engine.gradient_accumulation_steps(),  # with micro_batch: what --resume keeps for "auto"
            "autoep_size": ep_size(engine.config), "pipeline_stages": engine.config.get("pipeline", {}).get("stages", 0),
            "zero_stage": engine.zero_optimization_stage(), "optimizer": saved_optimizer(engine),
            "recipe": recipe.to_dict()}, indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(root / tag / "tokenizer")
        save_init_config(engine, recipe, root / tag / INIT_DIR)
    dist.barrier()  # every rank has written its shards
    if rank == 0:
        files = _files(root / tag)
        for f in files:
            _fsync(f)  # on disk before `latest` can name them (a power cut must not leave a named, empty file)
        for d in sorted({f.parent for f in files} | {root / tag}):
            _fsync(d)  # and their names in their folders (tokenizer/, init_model/ and the tag's own)
        _write_atomic(root / tag / MANIFEST, json.dumps({"tag": tag, "files": manifest(root / tag)}, indent=1))
        _write_atomic(root / "latest", tag)
        prune(root, recipe.checkpoint.keep_last)
    dist.barrier()
    return root / tag


# DeepSpeed's save copies its own zero_to_fp32.py (and zero_to_torch.py, which imports it) next to the tags. It cannot
# export this engine's checkpoints (it refuses AutoEP ZeRO-3 experts, and writes DeepSpeed's names, not Hugging
# Face's), so after each save both become this: bin/zero_to_fp32, run from wherever the user finds it.
EXPORTER_POINTER = '''#!/usr/bin/env python3
"""Written by moe-engine in place of DeepSpeed's script, which cannot export this engine's checkpoints (AutoEP
experts, Hugging Face names). It runs moe-engine's exporter, bin/zero_to_fp32 (docs/checkpoints.md):
    python {name} CHECKPOINT_DIR OUTPUT_DIR [--tag TAG] [--dtype fp32|bf16] [--max_shard_size 2GB] [--force] [--quiet]
CHECKPOINT_DIR: this folder (the checkpoint `latest` names), one step_* folder in it, or the run dir. OUTPUT_DIR gets
config.json, sharded *.safetensors and the tokenizer: AutoModelForCausalLM.from_pretrained(OUTPUT_DIR) loads it.
"""
import os
import sys

CHECKOUT = {root!r}  # the moe-engine that wrote this checkpoint; an installed one is used when it is gone
if os.path.isdir(os.path.join(CHECKOUT, "engine", "export")):
    sys.path.insert(0, CHECKOUT)
from engine.export.write import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
'''


def point_to_our_exporter(root: Path) -> None:
    """Replace the recovery scripts DeepSpeed copied into `root` (RUN_DIR/checkpoints) with EXPORTER_POINTER."""
    checkout = str(Path(__file__).resolve().parent.parent)
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        if (root / name).is_file():
            _write_atomic(root / name, EXPORTER_POINTER.format(name=name, root=checkout))
            (root / name).chmod(0o755)


def manifest(folder: Path) -> dict:
    """What manifest.json records of a tag folder: every other file, its size, whether it is a zip, and for the
    others (engine_state.json, the tokenizer's and init config's files: small) their CRC-32, as zips carry theirs."""
    def entry(f: Path) -> dict:
        z = _is_zip(f)
        return {"size": f.stat().st_size, "zip": z, **({} if z else {"crc32": zlib.crc32(f.read_bytes())})}
    return {str(f.relative_to(folder)): entry(f) for f in _files(folder)}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete tags (and `latest`'s); remove older ones and half-written ones."""
    current = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    tags = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    complete = [t for t in tags if (root / t / MANIFEST).is_file()]
    keep = set(complete[-keep_last:]) | {current}
    for t in tags:
        if t not in keep:
            shutil.rmtree(root / t, ignore_errors=True)
    for p in (root / UNIVERSAL).glob("*"):  # universal copies of tags that are gone, or half-converted ones
        if p.is_dir() and p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- resume


def resume_position(saved: dict, micro: int, world: int) -> int | None:
    """The data position (micro-batches per rank) after `saved`'s sequences, for this micro-batch and world size.

    A position counts micro-batches of `micro x world` global sequences, so it carries over to another shape as
    long as the sequences consumed fill whole micro-batches of the new shape; None when they do not.
    """
    consumed = saved["position"] * saved.get("micro_batch", micro) * saved.get("world_size", world)
    return consumed // (micro * world) if consumed % (micro * world) == 0 else None


# engine_state.json's fields that a resume reads, with their types (ints: >= 0; those in POSITIVE: >= 1). A file that
# parses but breaks these (hand-edited, or written by something else) is refused by check_resume's line, not by a
# traceback wherever the first field is read.
STATE_FIELDS = {"step": int, "position": int, "tokens": int, "micro_batch": int, "world_size": int, "grad_accum": int,
                "autoep_size": int, "pipeline_stages": int, "zero_stage": int, "prompts_done": int,
                "optimizer": (str, type(None)), "init_source": (str, type(None)), "recipe": dict, "curriculum": dict}
STATE_REQUIRED, POSITIVE = ("step", "position", "recipe"), ("micro_batch", "world_size", "grad_accum", "autoep_size")
JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
              bool: "a boolean", type(None): "null"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is no count


def state_problem(saved, complete: bool = True) -> str | None:
    """What is wrong with the shape of a parsed engine_state.json, or None. complete: also every field a resume
    needs is there (check_resume's test; the readers of single fields take what is there)."""
    if not isinstance(saved, dict):
        return f"is {JSON_TYPES.get(type(saved), type(saved).__name__)}, not an object"
    missing = [k for k in STATE_REQUIRED if k not in saved] if complete else []
    if missing:
        return f"has no {' or '.join(missing)}"
    for k, kind in STATE_FIELDS.items():
        v = saved.get(k)
        if k in saved and not (_is_int(v) if kind is int else isinstance(v, kind)):
            return f"has {k} {json.dumps(v)}, not {JSON_TYPES[kind if isinstance(kind, type) else kind[0]]}"
        if kind is int and k in saved and v < (1 if k in POSITIVE else 0):
            return f"has {k} {v}, below {1 if k in POSITIVE else 0}"
    for k in ("model", "data", "train"):
        if not isinstance(saved.get("recipe", {}).get(k, {}), dict):
            return f"has recipe.{k} {json.dumps(saved['recipe'][k])}, not an object"
    return _curriculum_problem(saved["curriculum"]) if "curriculum" in saved else None


def _curriculum_problem(c: dict) -> str | None:
    """What is wrong with GRPO's curriculum statistics (engine/curriculum.py PromptCurriculum.state_dict): a count
    of prompts and, per prompt, its decayed attempts and passes (finite, >= 0) and reward sum (finite)."""
    n = c.get("n_prompts")
    if not _is_int(n) or n < 1:
        return f"has curriculum.n_prompts {json.dumps(n)}, not a count of prompts"
    for k in ("attempts", "passes", "reward_sum"):
        v = c.get(k)
        if not (isinstance(v, list) and len(v) == n and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
            return f"has curriculum.{k} that is not {n} finite numbers (one per prompt)"
        if k != "reward_sum" and min(v) < 0:
            return f"has curriculum.{k} below 0"
    return None


def saved_state(run_dir: str | Path) -> dict | None:
    """`latest`'s engine_state.json (step, position, world, the recipe it ran, ...); None when there is none readable
    or its shape is wrong (check_resume reports why)."""
    tag = latest(run_dir)
    try:
        saved = json.loads((ckpt_dir(run_dir) / tag / STATE_FILE).read_text()) if tag else None
    except (OSError, json.JSONDecodeError):
        return None
    return None if state_problem(saved, complete=False) else saved


def recorded_batch(run_dir: str | Path) -> dict | None:
    """The micro-batch and accumulation `latest` was trained with ({"micro_batch", "grad_accum"}), for resolving a DS
    config's "auto" on --resume; None when there is nothing readable (check_resume reports why). A checkpoint saved
    before "auto" has no grad_accum: it follows from the tokens per step (tokens / step = micro x accumulation x
    data-parallel ranks x seq_len), when that divides evenly."""
    saved = saved_state(run_dir)
    if saved is None:
        return None
    found = {k: saved[k] for k in ("micro_batch", "grad_accum") if k in saved}  # state_problem: integers >= 1
    if "grad_accum" not in found and "micro_batch" in found:
        try:
            seq = saved["recipe"]["data"]["seq_len"]
            dp = saved["world_size"] // max(1, saved.get("pipeline_stages", 0) or 1)
            per_step = found["micro_batch"] * dp * seq
            if saved["step"] >= 1 and saved["tokens"] % (saved["step"] * per_step) == 0:
                found["grad_accum"] = saved["tokens"] // (saved["step"] * per_step)
        except (KeyError, TypeError, ZeroDivisionError):
            pass
    return found


SCHEDULE = ("max_steps", "warmup_steps", "min_lr_ratio", "decay_steps")


def lr_schedule(recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The recipe with the LR schedule this run uses, and the lines to print about it (before any work).

    On --resume with another train.max_steps (train.decay_steps unset) the checkpoint's schedule is kept where the
    recipe's would change the LR at the next step: a longer run goes on at the final LR rather than jumping back up a
    stretched cosine. Where both give the same LR there (the checkpoint stopped in its warmup, or where its cosine had
    not begun), the recipe's schedule goes on from it without a jump, and one line says so. A schedule changed on
    purpose (decay_steps, warmup_steps or min_lr_ratio) is used, and the LR jump it makes is printed. A run too
    short to finish its warmup is warned about."""
    from .parallel import lr_multiplier

    t, lines = recipe.train, []
    if t.max_steps < t.warmup_steps:
        lines.append(f"warning: train.max_steps ({t.max_steps}) < train.warmup_steps ({t.warmup_steps}): the whole run "
                     f"is warmup and the LR never reaches train.lr ({t.lr:g}); lower train.warmup_steps")
    saved = saved_state(recipe.run_dir) if recipe.resume else None
    lines += data_change(recipe, saved)
    old = (saved or {}).get("recipe", {}).get("train")
    if not isinstance(old, dict) or not isinstance(saved.get("step"), int) or saved["step"] >= t.max_steps:
        return recipe, lines  # nothing recorded to compare, or nothing left to train (a note says so)
    then = dataclasses.replace(t, **{k: old[k] for k in SCHEDULE if k in old})
    old_lr = old["lr"] if isinstance(old.get("lr"), (int, float)) and not isinstance(old.get("lr"), bool) else t.lr
    step = saved["step"]
    was, now = lr_multiplier(then)(step), lr_multiplier(t)(step)  # step + 1's LR (LambdaLR counts from 0)
    if old_lr != t.lr:  # checkpoint.load puts this recipe's LR under the restored schedule (use_recipe_lr)
        lines.append(f"note: --resume with train.lr {t.lr:g} (the checkpoint's run: {old_lr:g}): this run's LR is used "
                     f"from step {step + 1}")
    length = lambda x: x.decay_steps or x.max_steps  # noqa: E731
    if (then.warmup_steps, length(then), then.min_lr_ratio) == (t.warmup_steps, length(t), t.min_lr_ratio):
        if old_lr != t.lr:
            lines[-1] += f" under the same schedule (the LR goes from {old_lr * was:.4g} to {t.lr * now:.4g})"
        return recipe, lines
    jump = f"the LR would jump from {old_lr * was:.4g} to {t.lr * now:.4g} at step {step + 1}"
    same = (then.warmup_steps, then.min_lr_ratio) == (t.warmup_steps, t.min_lr_ratio)
    why = (f"train.max_steps {t.max_steps} (the checkpoint's run: {then.max_steps})" if t.max_steps != then.max_steps
           else f"train.decay_steps unset (the checkpoint's run: {then.decay_steps})")
    if t.decay_steps is None and same and abs(was - now) <= 1e-9 * max(abs(was), abs(now)):
        has = f"the checkpoint's LR ({t.lr * now:.4g})" if old_lr == t.lr else "the checkpoint's multiplier"
        lines.append(f"note: --resume with {why} takes this run's LR schedule from step {step + 1}, where it has "
                     f"{has}: warmup to step {t.warmup_steps}, then cosine to step {length(t)}")
    elif t.decay_steps is None and same:
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(t, decay_steps=length(then)))
        lines.append(f"note: --resume with {why} keeps its LR schedule: cosine to step {length(then)}, then "
                     f"{t.lr * t.min_lr_ratio:.4g}; set train.decay_steps: {t.max_steps} to stretch it instead ({jump})")
    else:
        lines.append(f"warning: --resume with another LR schedule than the checkpoint's (warmup_steps "
                     f"{then.warmup_steps} -> {t.warmup_steps}, length {length(then)} -> {length(t)}, min_lr_ratio "
                     f"{then.min_lr_ratio} -> {t.min_lr_ratio}): {jump.replace('would jump', 'jumps')}")
    return recipe, lines


def use_recipe_lr(engine, lr: float) -> bool:
    """After a load: the recipe's train.lr under the restored schedule. DeepSpeed restores the LR scheduler's base LRs
    (the checkpoint's train.lr) and each parameter group's current LR, so a resume with another train.lr went on at
    the old one while its schedule note named the new one. Returns whether anything changed."""
    sched = getattr(engine, "lr_scheduler", None)
    if sched is None or not hasattr(sched, "base_lrs") or all(b == lr for b in sched.base_lrs):
        return False
    sched.base_lrs = [lr] * len(sched.base_lrs)
    for group, factor in zip(sched.optimizer.param_groups, sched.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(sched.last_epoch)  # what the next update uses, as LambdaLR's own step sets it
    return True


DATA_KEYS = ("path", "name", "split", "seq_len", "text_field", "tokenizer", "streaming", "seed", "curriculum")


def data_change(recipe: Recipe, saved: dict | None) -> list[str]:
    """A warning when --resume runs on another data section than the checkpoint's: the saved position (windows or
    prompts consumed) goes on in the new data's order, which is not where the old run would have gone on."""
    theirs = ((saved or {}).get("recipe") or {}).get("data")
    if not isinstance(theirs, dict):
        return []
    ours = dataclasses.asdict(recipe.data)
    def same(k, v):  # data.tokenizer auto that found none with the model is the bundled one
        return BUNDLED_TOKENIZER if k == "tokenizer" and v == "auto" else v

    diff = [f"data.{k}: {theirs[k]!r} -> {ours[k]!r}" for k in DATA_KEYS
            if k in theirs and same(k, theirs[k]) != same(k, ours[k])]
    return [f"warning: --resume with another data section than the checkpoint's ({'; '.join(diff)}): training goes on "
            f"{saved.get('position', 0)} micro-batches per rank into the new data's order, not where the old run "
            "would have"] if diff else []


def run_dir_problems(recipe: Recipe) -> list[str]:
    """run_dir must be a folder this rank can write, and a run without --resume must not start over another run's
    checkpoints: its saves would replace them tag by tag, and `latest` would end up naming a mix (or, where its last
    tag equals theirs, its own final save would be skipped as already done)."""
    run, root = Path(recipe.run_dir), ckpt_dir(recipe.run_dir)
    for p in (run, root):
        if p.exists() and not p.is_dir():
            return [f"run_dir {run}: {p} is a file, not a folder; pass another --run_dir"]
    there = next(p for p in (root, run, *run.absolute().parents) if p.exists())
    if not os.access(there, os.W_OK | os.X_OK):
        return [f"run_dir {run}: {there} is not writable by this user; pass another --run_dir"]
    if not recipe.resume and ((root / "latest").is_file() or any(root.glob("step_*"))):
        tag = latest(recipe.run_dir)
        if tag is None:
            return [no_latest(root, resume=False, run=run)]
        return [f"run_dir {run} holds another run's checkpoints (latest: {tag}); continue that run with --resume, or "
                "start this one in another --run_dir (starting over them would overwrite them)"]
    return []


def nothing_to_train(step: int, limit: str) -> str:
    """The note of a --resume whose checkpoint has already reached the run's end (`limit`: which setting, with its
    value); the run then exits 0 without a step."""
    return f"note: nothing to train: checkpoint at step {step} has reached {limit}; raise it to train on"


def no_latest(root: Path, resume: bool, run: Path | None = None) -> str:
    """Why `root` has no checkpoint `latest` names, and what to do: --resume (resume) or a new run in a run_dir that
    holds checkpoint folders (not resume). `latest` may be missing, empty or name a missing folder while complete
    checkpoints are there: then the fix is to name one."""
    named = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    complete = sorted(p.parent.name for p in root.glob(f"step_*/{MANIFEST}"))
    if resume and named is None and not complete:
        return f"--resume: no checkpoint in {root} (run without --resume to start fresh)"
    who = "--resume:" if resume else f"run_dir {run} holds another run's checkpoints, but"
    what = f"{root / 'latest'} names {named!r}, which is not there" if named else f"{root / 'latest'} is missing"
    if complete:
        return (f"{who} {what}; its complete checkpoints: {', '.join(complete[-3:])}: write one of those tags into "
                f"{root / 'latest'} and run with --resume")
    return f"{who} {what}, and none of its checkpoints is complete; move {root} away or pass another --run_dir"


def optimizer_kind(ds: dict, train) -> str | None:
    """The optimizer class a run with this resolved DS config builds (what `engine.basic_optimizer` is), as far as
    its checkpointed state layout goes; None: not one the engine can predict (then a resume does not compare it)."""
    from .ds_config import uses_stochastic_rounding

    opt = ds.get("optimizer") or {}
    kind = str(opt.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        return None
    if uses_stochastic_rounding(ds, train):
        return "AdamWSR"
    if (((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") or "none") != "none":
        return "DeepSpeedCPUAdam"
    return "torch AdamW" if (opt.get("params") or {}).get("torch_adam") else "FusedAdam"


def saved_zero_stage(folder: Path, saved: dict):
    """The ZeRO stage a checkpoint was trained with: recorded, or (older checkpoints) 3 where DeepSpeed's ZeRO-3
    layout (a model-states file per rank) is there, else 1 or 2 (one layout for both)."""
    if "zero_stage" in saved:
        return saved["zero_stage"]
    return 3 if any(folder.glob("zero_pp_rank_*_model_states.pt")) else "1 or 2"


def check_resume(recipe: Recipe, ds: dict, world_size: int, rank: int = 0) -> tuple[list[str], bool]:
    """Preflight for --resume. Returns (problems, universal): universal means the checkpoint was saved with
    another world size or expert-parallel size and must be loaded through DeepSpeed's universal format.

    Every rank checks that each file in the manifest exists with its recorded size; rank 0 also verifies the
    CRC-32 of every zip entry (torch.load does not, and silently loads flipped bits).
    """
    root = ckpt_dir(recipe.run_dir)
    tag = latest(recipe.run_dir)
    if tag is None:
        return [no_latest(root, resume=True)], False
    where = root / tag
    older = sorted(p.parent.name for p in root.glob(f"step_*/{MANIFEST}") if p.parent.name < tag)
    fix = (f"restore it, or resume from an older checkpoint by writing its tag ({older[-1]}) into {root / 'latest'}"
           if older else "restore it, or start a fresh run_dir")
    bad = damage(where, verify_crc=rank == 0)
    if bad:
        return [f"--resume: checkpoint {where} is damaged ({bad}); {fix}"], False
    try:
        saved = json.loads((where / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"--resume: checkpoint {where} has no readable {STATE_FILE} ({type(e).__name__}); {fix}"], False
    wrong = state_problem(saved)
    if wrong:
        return [f"--resume: checkpoint {where} has an {STATE_FILE} this engine did not write (it {wrong}); "
                f"{fix}"], False
    problems = []
    ours = dataclasses.asdict(recipe.model)
    theirs = saved.get("recipe", {}).get("model", {})
    # Started from model.init_from, the architecture is that directory's config.json (config.py: model_from_hf_dir);
    # the fields a checkpoint recorded for it before they were read from there are the recipe's unused values.
    derived = ({"arch", "moe_intermediate_size", "num_shared_experts", *FROM_HF}
               if recipe.model.init_from and theirs.get("init_from") else set())
    diff = [f"model.{k}: {theirs.get(k)!r} in the checkpoint, {v!r} in the recipe"
            for k, v in ours.items() if k != "init_from" and k not in derived and theirs.get(k) != v]
    if diff:
        problems.append(f"--resume: checkpoint {where} holds a different model ({', '.join(diff)}); resume with the "
                        f"recipe it was trained with (its {STATE_FILE} holds it) or use another run_dir")
    if saved.get("step", 0) > recipe.train.max_steps:
        problems.append(f"--resume: checkpoint {where} is at step {saved['step']}, past train.max_steps "
                        f"({recipe.train.max_steps}); raise --max_steps to train on")
    stage, was = (ds.get("zero_optimization") or {}).get("stage", 0), saved_zero_stage(where, saved)
    if ("pipeline" not in ds or "zero_stage" in saved) and was != stage and not (was == "1 or 2" and stage in (1, 2)):
        problems.append(f"--resume: checkpoint {where} was trained with ZeRO stage {was}, the DeepSpeed config has "
                        f"stage {stage} (DeepSpeed cannot load one's partitions as the other's); resume with the DS "
                        "config it was trained with")
    kind = optimizer_kind(ds, recipe.train)
    if saved.get("optimizer") and kind and saved["optimizer"] != kind:
        problems.append(f"--resume: checkpoint {where} holds {saved['optimizer']}'s state, and this DS config and "
                        f"recipe build {kind} (DeepSpeed cannot hand one's state to the other); resume with the DS "
                        "config it was trained with (torch AdamW: optimizer.params.torch_adam true; DeepSpeedCPUAdam: "
                        "zero_optimization.offload_optimizer; AdamWSR: bf16 master weights and "
                        "train.stochastic_rounding)")
    micro = ds.get("train_micro_batch_size_per_gpu", 1)
    universal = bool((ds.get("checkpoint") or {}).get("load_universal"))
    stages = (ds.get("pipeline") or {}).get("stages", 0)
    if saved.get("pipeline_stages", 0) != stages:  # the layouts differ (engine/export/): no conversion
        mode = lambda n: f"{n} pipeline stages" if n else "no pipeline"  # noqa: E731
        problems.append(f"--resume: checkpoint {where} was saved with {mode(saved.get('pipeline_stages', 0))}, the "
                        f"DeepSpeed config has {mode(stages)}; resume with the DS config it was trained with")
    elif saved.get("world_size", world_size) != world_size or saved.get("autoep_size", ep_size(ds)) != ep_size(ds):
        universal = True
        if "pipeline" in ds:
            problems.append(f"--resume: checkpoint {where} was saved on {saved.get('world_size', world_size)} ranks "
                            f"with autoep_size {saved.get('autoep_size')}; pipeline mode resumes only on the same world "
                            f"size and autoep_size ({world_size} and {ep_size(ds)} now)")
    if resume_position(saved, micro, world_size) is None:
        problems.append(f"--resume: checkpoint {where} consumed {saved['position']} micro-batches of "
                        f"{saved.get('micro_batch', micro)} x {saved.get('world_size', world_size)} ranks, which is "
                        f"not a whole number of micro-batches of {micro} x {world_size} ranks; pick "
                        "train_micro_batch_size_per_gpu so that they divide evenly")
    return problems, universal


def damage(folder: Path, verify_crc: bool) -> str | None:
    """What is wrong with a saved tag folder, or None. Also used by bin/zero_to_fp32 (engine/export/)."""
    mf = folder / MANIFEST
    if mf.is_file():
        try:
            files = json.loads(mf.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{MANIFEST} is unreadable: {type(e).__name__}"
        if not isinstance(files, dict) or not all(
                isinstance(i, dict) and _is_int(i.get("size")) and isinstance(i.get("zip", False), bool)
                and _is_int(i.get("crc32", 0)) for i in files.values()):
            return f"{MANIFEST} is not one this engine wrote (files: {{name: {{size, zip, crc32}}}} expected)"
    else:  # saved before manifests existed: check what is there
        files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "zip": p.suffix == ".pt"}
                 for p in _files(folder)}
    for name, info in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != info["size"]:
            return f"{name} has {f.stat().st_size} bytes, {info['size']} when saved"
        if verify_crc and "crc32" in info and zlib.crc32(f.read_bytes()) != info["crc32"]:
            return f"{name} has changed since it was saved: its CRC-32 differs"
        if info.get("zip"):
            try:
                with zipfile.ZipFile(f) as z:
                    bad = z.testzip() if verify_crc else None
            except (zipfile.BadZipFile, OSError) as e:
                return f"{name} is not a readable torch file: {e}"
            if bad is not None:
                return f"{name} fails its CRC check in entry {bad}"
    return None


def to_universal(run_dir: str | Path) -> Path:
    """Convert `latest` to DeepSpeed's universal format (once; rank 0 only) into checkpoints/universal/<tag>."""
    root = ckpt_dir(run_dir)
    tag = latest(run_dir)
    out = root / UNIVERSAL / tag
    if out.is_dir():
        return out
    tmp = root / UNIVERSAL / f"{tag}.converting"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    print(f"resume: converting {root / tag} to DeepSpeed's universal format in {out}", flush=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(root / tag),
           "--output_folder", str(tmp), "--inject_missing_state", "--num_extract_workers", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (p.stderr.strip() or p.stdout.strip() or "no output").splitlines()[-1]
        raise ConfigError(f"--resume: DeepSpeed could not convert {root / tag} to its universal format ({last}); "
                          f"resume on the world size it was saved with")
    os.replace(tmp, out)
    _write_atomic(root / UNIVERSAL / "latest_universal", tag)  # ds_to_universal named the temporary folder
    return out


def load(engine, run_dir: str | Path, lr: float | None = None) -> dict:
    """Restore engine state, this rank's RNG and the routing biases from `latest`; returns the client state. `lr`:
    the recipe's train.lr, which replaces the checkpoint's under the restored schedule (use_recipe_lr)."""
    root = ckpt_dir(run_dir)
    tag = latest(run_dir)
    if tag is None:
        raise ConfigError(f"--resume: no checkpoint in {root}")
    universal = engine.load_universal_checkpoint()
    load_dir = root / UNIVERSAL if universal else root
    path, client = engine.load_checkpoint(str(load_dir), tag=tag)
    if path is None:
        raise ConfigError(f"--resume: DeepSpeed could not load {load_dir / tag}")
    if universal:
        # DeepSpeed's universal load restores parameters and optimizer state but not the module's buffers
        # (it skips load_module_state_dict), so the routing biases (e_score_correction_bias) come from our file.
        # The non-universal ZeRO-3 load does restore them from its model_states files.
        buffers = torch.load(root / tag / BUFFERS)
        own = dict(engine.module.named_buffers())
        with torch.no_grad():
            for name, value in buffers.items():
                own[name].copy_(value)
        # DeepSpeed 0.19.8's ZeRO-3 universal load gives every flat partition's optimizer state the same `step`
        # tensor. torch's Adam adds 1 to each state's step in place, so a shared one would count once per
        # partition per step, and the bias correction would drift from the uninterrupted run's.
        opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
        for state in (opt.state.values() if opt is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
    _rebuild_cpu_adam_products(engine)
    if lr is not None:
        use_recipe_lr(engine, lr)
    rng_file = root / tag / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():  # a rank beyond the saved world size keeps its seeded RNG
        _restore_rng(torch.load(rng_file, weights_only=False))  # our own file: python/numpy states are no tensors
    saved = json.loads((root / tag / STATE_FILE).read_text())
    position = resume_position(saved, engine.train_micro_batch_size_per_gpu(), dist.get_world_size())
    extra = {k: saved[k] for k in ("curriculum", "prompts_done") if k in saved}  # GRPO's: curriculum statistics,
    # prompts consumed over all ranks (any group size, batch or world size continues from it)
    return {"step": client["step"], "position": position, "tokens": client["tokens"], **extra}


def _rebuild_cpu_adam_products(engine) -> None:
    """Make a resumed run bitwise equal to an uninterrupted one where Adam runs on the CPU.

    DeepSpeed's CPU Adam kernels (FusedAdam on the CPU accelerator, DeepSpeedCPUAdam under ZeRO-Offload) keep
    beta1^t and beta2^t as running products in a C++ object; in a new process the first step computes them with
    pow() instead, which differs in the last bit and moves every later loss by ~1e-7. Replaying steps 1..t on a
    one-element dummy rebuilds the same products. (CUDA FusedAdam computes pow() at every step: nothing to do.)
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = max((int(s.get("step", 0)) for s in opt.state.values()), default=0) if opt is not None else 0
    if not steps or not opt.param_groups:
        return
    g = opt.param_groups[0]
    (b1, b2), eps = g["betas"], g["eps"]
    dummy = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq; lr 0
    if isinstance(opt, DeepSpeedCPUAdam):
        for t in range(1, steps + 1):
            opt.ds_opt_adam.adam_update(opt.opt_id, t, 0.0, b1, b2, eps, 0.0, True, *dummy)
    elif isinstance(opt, FusedAdam) and torch.device(engine.device).type == "cpu":
        for t in range(1, steps + 1):  # one process-wide kernel object per adam_w_mode
            opt.multi_tensor_adam(2048 * 32, opt._dummy_overflow_buf, [[d] for d in dummy], 0.0, b1, b2, eps, t,
                                  opt.adam_w_mode, 1, 0.0)

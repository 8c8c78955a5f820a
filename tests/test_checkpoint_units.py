"""engine/checkpoint.py's decisions on synthetic checkpoint folders, in milliseconds (tests/test_resume.py runs the real
thing through the launcher): what --resume compares, the LR schedule it keeps, the data position it converts, the
save cadence, and the advice for a run_dir whose `latest` is missing or wrong. Each case was a change to the code that
every other test let through."""
import dataclasses
import json
import time

import pytest
import torch

from engine import checkpoint
from engine.checkpoint import (MANIFEST, Cadence, check_resume, damage, lr_schedule, no_latest, recorded_batch,
                               resume_position, run_dir_problems)
from engine.config import CheckpointConfig, DataConfig, ModelConfig, Recipe, TrainConfig

DS = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}


def saved(run_dir, step: int = 10, **state) -> dict:
    """A run_dir whose `latest` is a checkpoint at `step` holding engine_state.json = `state` over a default one (the
    default model, ZeRO-3, one rank, FusedAdam)."""
    tag = run_dir / "checkpoints" / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(tag.name)
    full = {"step": step, "position": step, "micro_batch": 1, "world_size": 1, "zero_stage": 3,
            "recipe": {"model": dataclasses.asdict(ModelConfig()), "train": dataclasses.asdict(TrainConfig())},
            **state}
    (tag / checkpoint.STATE_FILE).write_text(json.dumps(full))
    return full


def recipe(run_dir, model=None, **train) -> Recipe:
    return Recipe(model=model or ModelConfig(), train=dataclasses.replace(TrainConfig(), **train), run_dir=str(run_dir),
                  resume=True)


def other(value):
    """A different value of a ModelConfig field's kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2
    return "x" if value is None else value + "x"


def test_resume_refuses_a_change_to_any_model_field(tmp_path):
    """Every field of the model section is compared (the launcher test changes hidden_size only)."""
    saved(tmp_path)
    assert check_resume(recipe(tmp_path), DS, 1) == ([], False)
    for field in dataclasses.fields(ModelConfig):
        if field.name == "init_from":  # a checkpoint's own source, compared by GRPO's resume
            continue
        model = dataclasses.replace(ModelConfig(), **{field.name: other(getattr(ModelConfig(), field.name))})
        problems, _ = check_resume(recipe(tmp_path, model), DS, 1)
        assert len(problems) == 1 and f"model.{field.name}:" in problems[0], (field.name, problems)


def test_resume_accepts_what_it_cannot_tell_apart(tmp_path):
    """A checkpoint from before zero_stage was recorded (one layout for ZeRO-1 and 2) resumes under stage 2; an
    optimizer the engine does not predict (a DS config's Lamb) is not compared with the checkpoint's."""
    state = saved(tmp_path, optimizer="FusedAdam")
    del state["zero_stage"]
    (tmp_path / "checkpoints" / checkpoint.tag_for(10) / checkpoint.STATE_FILE).write_text(json.dumps(state))
    assert check_resume(recipe(tmp_path), {**DS, "zero_optimization": {"stage": 2}}, 1)[0] == []
    lamb = {**DS, "zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}
    assert check_resume(recipe(tmp_path), lamb, 1)[0] == []
    problems = check_resume(recipe(tmp_path), {**DS, "zero_optimization": {"stage": 2},
                                               "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, 1)[0]
    assert len(problems) == 1 and "holds FusedAdam's state" in problems[0], problems


def test_a_position_that_does_not_fill_whole_micro_batches_is_refused(tmp_path):
    """3 micro-batches of 1 x 2 ranks = 6 sequences: 6 of 1 x 3 ranks is whole (2), 4 x 1 is not (1.5)."""
    assert resume_position({"position": 3, "micro_batch": 1, "world_size": 2}, 1, 3) == 2
    assert resume_position({"position": 3, "micro_batch": 1, "world_size": 2}, 4, 1) is None
    saved(tmp_path, position=3, micro_batch=1, world_size=2)
    problems, universal = check_resume(recipe(tmp_path), {**DS, "train_micro_batch_size_per_gpu": 4}, 1)
    assert universal and len(problems) == 1 and "not a whole number of micro-batches of 4 x 1 ranks" in problems[0]


def test_the_recorded_accumulation_of_a_pipeline_run(tmp_path):
    """A checkpoint from before "auto" recorded no accumulation: with 2 pipeline stages on 4 ranks the data-parallel
    size is 2, so 10 steps of 10 x 8 x 3 x 2 x 128 tokens mean accumulation 3."""
    saved(tmp_path, micro_batch=8, world_size=4, pipeline_stages=2, tokens=10 * 8 * 3 * 2 * 128,
          recipe={"data": {"seq_len": 128}})
    assert recorded_batch(tmp_path) == {"micro_batch": 8, "grad_accum": 3}


def test_a_schedule_the_checkpoint_set_itself_and_a_changed_floor(tmp_path):
    """The checkpoint's run had decay_steps 100 (of 150): kept at 100 when resumed to 300, not its max_steps. A
    changed min_lr_ratio with another max_steps is a schedule changed on purpose: used, and its jump warned about."""
    saved(tmp_path, 120, recipe={"train": dataclasses.asdict(dataclasses.replace(
        TrainConfig(), max_steps=150, decay_steps=100, warmup_steps=10, min_lr_ratio=0.1))})
    got, lines = lr_schedule(recipe(tmp_path, max_steps=300, warmup_steps=10, min_lr_ratio=0.1))
    assert got.train.decay_steps == 100 and lines[0].startswith("note: --resume with train.max_steps 300"), lines
    saved(tmp_path / "b", 100, recipe={"train": dataclasses.asdict(dataclasses.replace(
        TrainConfig(), max_steps=100, warmup_steps=10, min_lr_ratio=0.1))})
    got, lines = lr_schedule(recipe(tmp_path / "b", max_steps=200, warmup_steps=10, min_lr_ratio=0.2))
    assert got.train.decay_steps is None and lines[0].startswith("warning: --resume with another LR schedule"), lines


def test_a_resume_with_another_data_seed_is_warned_about(tmp_path):
    saved(tmp_path, recipe={"data": dataclasses.asdict(DataConfig(seed=1)),
                            "train": dataclasses.asdict(TrainConfig())})
    r = dataclasses.replace(recipe(tmp_path), data=DataConfig(seed=2))
    assert any("data.seed: 1 -> 2" in line for line in lr_schedule(r)[1])


def test_step_folders_without_latest_and_a_latest_naming_nothing(tmp_path):
    """A new run over step_* folders with no `latest` is refused (its saves would replace them); with `latest` naming
    a missing folder and no complete checkpoint, the advice is not "run without --resume" (which is refused too)."""
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    fresh = dataclasses.replace(recipe(tmp_path), resume=False)
    assert any("holds another run's checkpoints, but" in p for p in run_dir_problems(fresh))
    (tmp_path / "checkpoints" / "latest").write_text("step_00000099")
    line = no_latest(tmp_path / "checkpoints", resume=True)
    assert "names 'step_00000099', which is not there, and none of its checkpoints is complete" in line, line
    assert "without --resume" not in line


def test_a_file_that_grew_since_the_save_is_damage(tmp_path):
    (tmp_path / "a.txt").write_text("abcd")
    (tmp_path / MANIFEST).write_text(json.dumps({"files": {"a.txt": {"size": 3, "zip": False}}}))
    assert damage(tmp_path, False) == "a.txt has 4 bytes, 3 when saved"


def test_the_minute_clock_restarts_at_every_save():
    """every_minutes counts from the last save of any kind: a step save at 0.9 s restarts it, so 0.6 s later (1.5 s
    after the start, past the 1.2 s period) nothing is due."""
    c = Cadence(CheckpointConfig(every_steps=3, every_minutes=0.02))
    try:
        time.sleep(0.9)
        assert c.due(3, 10) == (True, False)
        time.sleep(0.6)
        assert c.due(4, 10) == (False, False)
    finally:
        c.close()


@pytest.fixture(autouse=True)
def _no_distributed(monkeypatch):
    """The checks above run outside any process group (Cadence all-reduces only inside one)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)


def test_data_tokenizer_auto_finds_a_checkpoints_tokenizer(tmp_path):
    """GRPO's --init_from may be a pretraining run: data.tokenizer auto (grpo.model_tokenizer) takes the tokenizer/
    that run's latest checkpoint saved, from the run dir, its checkpoints/ dir or the step dir; nothing where the
    checkpoint has none or the path is no checkpoint. A resume whose checkpoint recorded the bundled tokenizer's path
    while the recipe now says auto (and finds no other) is no data change. [fails if: auto misses a checkpoint's
    tokenizer/, or "auto" against the bundled path is warned about as another tokenizer]"""
    from engine.config import BUNDLED_TOKENIZER
    from engine.grpo import model_tokenizer

    saved(tmp_path)
    tag = tmp_path / "checkpoints" / checkpoint.tag_for(10)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert model_tokenizer(str(tmp_path)) is None  # a checkpoint without tokenizer/
    (tag / "tokenizer").mkdir()
    (tag / "tokenizer" / "tokenizer_config.json").write_text("{}")
    for given in (tmp_path, tmp_path / "checkpoints", tag):
        assert model_tokenizer(str(given)) == str(tag / "tokenizer"), given
    assert model_tokenizer(str(tmp_path / "nothing")) is None and model_tokenizer(None) is None
    was = {"recipe": {"data": dataclasses.asdict(DataConfig(tokenizer=BUNDLED_TOKENIZER))}}
    assert checkpoint.data_change(dataclasses.replace(recipe(tmp_path), data=DataConfig()), was) == []
    assert checkpoint.data_change(dataclasses.replace(recipe(tmp_path), data=DataConfig(tokenizer="/t")), was)


def test_a_resume_with_another_lr_trains_at_it_under_the_restored_schedule():
    """DeepSpeed restores the LR scheduler's base LRs and each group's LR from the checkpoint, so a resume with a
    new train.lr trained at the old one while the schedule note named the new one. use_recipe_lr: the group's LR is
    the new base times the schedule where it stands, and every later step follows the new base; the old base gives
    what it gave before. [fails if: only base_lrs is set (the next update still at the old LR), or the schedule's
    position is reset]"""
    from types import SimpleNamespace

    from engine.checkpoint import use_recipe_lr
    from engine.parallel import warmup_cosine

    mult = warmup_cosine(2, 10, 0.1)

    def engine_at(lr, state=None):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, mult)
        if state is not None:
            sched.load_state_dict(state)
            opt.param_groups[0]["lr"] = 3e-3 * mult(sched.last_epoch)  # as the optimizer's state dict restores it
        return SimpleNamespace(lr_scheduler=sched, optimizer=opt)

    old = engine_at(3e-3)
    for _ in range(5):
        old.optimizer.step()
        old.lr_scheduler.step()
    state = old.lr_scheduler.state_dict()
    same = engine_at(3e-3, state)
    assert use_recipe_lr(same, 3e-3) is False and same.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * mult(5))
    new = engine_at(1e-2, state)
    assert use_recipe_lr(new, 1e-2) is True
    assert new.lr_scheduler.last_epoch == 5
    for step in range(5, 9):
        assert new.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * mult(step)), step
        new.optimizer.step()
        new.lr_scheduler.step()


def test_the_schedule_note_names_a_changed_lr_and_says_nothing_when_nothing_is_left(tmp_path):
    """A resume with another train.lr: one note with both LRs, and the jump in LR (not multiplier) it makes; a
    resume whose checkpoint has reached max_steps gets no schedule note (the nothing-to-train note follows).
    [fails if: the LR change is not named, the jump is computed with the new LR on both sides, or a finished run
    gets a schedule note]"""
    train = dataclasses.asdict(dataclasses.replace(TrainConfig(), max_steps=100, warmup_steps=10, lr=3e-3))
    saved(tmp_path, 50, recipe={"train": train})
    r = recipe(tmp_path, max_steps=100, warmup_steps=10)
    r = dataclasses.replace(r, train=dataclasses.replace(r.train, lr=1e-2))
    _, lines = lr_schedule(r)
    assert len(lines) == 1 and lines[0].startswith("note: --resume with train.lr 0.01 (the checkpoint's run: 0.003): "
                                                   "this run's LR is used from step 51 under the same schedule"), lines
    from engine.parallel import lr_multiplier

    m = lr_multiplier(r.train)(50)
    assert f"the LR goes from {3e-3 * m:.4g} to {1e-2 * m:.4g}" in lines[0], lines
    longer = dataclasses.replace(r, train=dataclasses.replace(r.train, max_steps=200))  # another LR and schedule
    _, lines = lr_schedule(longer)
    was, now = lr_multiplier(r.train)(50), lr_multiplier(longer.train)(50)
    assert any(f"the LR would jump from {3e-3 * was:.4g} to {1e-2 * now:.4g} at step 51" in x for x in lines), lines
    saved(tmp_path / "done", 100, recipe={"train": train})
    assert lr_schedule(recipe(tmp_path / "done", max_steps=100, warmup_steps=20))[1] == []


def test_prune_keeps_complete_checkpoints_and_the_one_latest_names(tmp_path):
    """keep_last counts complete checkpoints only (a half-written one, newer or not, is no checkpoint to keep), and
    never removes the one `latest` names (after a resume from an older tag, as the damaged-checkpoint line says to
    do). [fails if: the newest tags are kept whatever their state, or `latest`'s tag can be pruned]"""
    def tag(step, complete=True):
        d = tmp_path / checkpoint.tag_for(step)
        d.mkdir()
        if complete:
            (d / MANIFEST).write_text("{}")

    for step in (2, 4, 8):
        tag(step)
    tag(6, complete=False)
    (tmp_path / "latest").write_text(checkpoint.tag_for(4))
    checkpoint.prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [checkpoint.tag_for(4), checkpoint.tag_for(8)]
    (tmp_path / "latest").write_text(checkpoint.tag_for(8))
    tag(10, complete=False)
    checkpoint.prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [checkpoint.tag_for(4), checkpoint.tag_for(8)]

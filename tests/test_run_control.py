"""Controlling a run: the LR schedule across a --resume with another train.max_steps, a run that is all warmup
(engine/checkpoint.py lr_schedule), and a clean stop through RUN_DIR/STOP (checkpoint.Cadence)."""
import dataclasses
import json

import pytest

from conftest import ROOT, ZERO3, launch, read_metrics, run_ranks

RECIPE = """
model: {arch: deepseek_v3, hidden_size: 32, num_layers: 2, num_heads: 4, intermediate_size: 64,
        moe_intermediate_size: 32, num_experts: 4, experts_per_token: 2, vocab_size: 512, max_position_embeddings: 64}
data: {seq_len: 32}
train: {max_steps: 4, warmup_steps: 1, lr: 1.0e-3, min_lr_ratio: 0.1, log_every: 1}
checkpoint: {every_steps: 4}
"""


def saved_run(run_dir, step: int, **train):
    """A run dir whose `latest` checkpoint records `step` and the train section `train` (nothing else is read)."""
    from engine.config import TrainConfig

    tag = run_dir / "checkpoints" / f"step_{step:08d}"
    tag.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text(tag.name)
    state = {"step": step, "recipe": {"train": dataclasses.asdict(dataclasses.replace(TrainConfig(), **train))}}
    (tag / "engine_state.json").write_text(json.dumps(state))


def recipe_for(run_dir, resume: bool, **train):
    from engine.config import Recipe, TrainConfig

    return Recipe(train=dataclasses.replace(TrainConfig(), **train), run_dir=str(run_dir), resume=resume)


def test_a_longer_resumed_run_keeps_the_saved_schedule(tmp_path):
    from engine.checkpoint import lr_schedule

    saved_run(tmp_path, 100, max_steps=100, warmup_steps=10, lr=3e-4, min_lr_ratio=0.1)
    recipe, lines = lr_schedule(recipe_for(tmp_path, True, max_steps=200, warmup_steps=10, lr=3e-4, min_lr_ratio=0.1))
    assert recipe.train.decay_steps == 100 and recipe.train.max_steps == 200
    # At step 100 the saved cosine has ended at 3e-5; stretched to 200 steps it would be back at 1.76e-4.
    assert lines == ["note: --resume with train.max_steps 200 (the checkpoint's run: 100) keeps its LR schedule: "
                     "cosine to step 100, then 3e-05; set train.decay_steps: 200 to stretch it instead (the LR would "
                     "jump from 3e-05 to 0.0001761 at step 101)"]
    # Not resuming, or resuming with the same schedule: nothing to say, nothing changed.
    for resume, steps in ((False, 200), (True, 100)):
        r = recipe_for(tmp_path, resume, max_steps=steps, warmup_steps=10, lr=3e-4, min_lr_ratio=0.1)
        assert lr_schedule(r) == (r, [])


def test_a_schedule_changed_on_purpose_is_used_and_its_jump_printed(tmp_path):
    from engine.checkpoint import lr_schedule

    saved_run(tmp_path, 100, max_steps=100, warmup_steps=10, lr=3e-4, min_lr_ratio=0.1)
    r = recipe_for(tmp_path, True, max_steps=200, decay_steps=200, warmup_steps=10, lr=3e-4, min_lr_ratio=0.1)
    recipe, lines = lr_schedule(r)
    assert recipe is r
    assert lines == ["warning: --resume with another LR schedule than the checkpoint's (warmup_steps 10 -> 10, length "
                     "100 -> 200, min_lr_ratio 0.1 -> 0.1): the LR jumps from 3e-05 to 0.0001761 at step 101"]


def test_a_resume_on_another_data_section_is_warned_about(tmp_path):
    """The saved position is a count of windows (prompts in GRPO): on other data it lands elsewhere, so a --resume
    whose data section differs from the checkpoint's says which keys changed; the same data says nothing."""
    from engine.checkpoint import lr_schedule
    from engine.config import DataConfig

    saved_run(tmp_path, 10, max_steps=20, warmup_steps=2)
    state = tmp_path / "checkpoints" / "step_00000010" / "engine_state.json"
    saved = json.loads(state.read_text())
    saved["recipe"]["data"], saved["position"] = dataclasses.asdict(DataConfig(path="a.jsonl", seq_len=128)), 10
    state.write_text(json.dumps(saved))
    r = recipe_for(tmp_path, True, max_steps=20, warmup_steps=2)
    assert lr_schedule(dataclasses.replace(r, data=DataConfig(path="a.jsonl", seq_len=128)))[1] == []
    _, lines = lr_schedule(dataclasses.replace(r, data=DataConfig(path="b.jsonl", seq_len=64)))
    assert lines == ["warning: --resume with another data section than the checkpoint's (data.path: 'a.jsonl' -> "
                     "'b.jsonl'; data.seq_len: 128 -> 64): training goes on 10 micro-batches per rank into the new "
                     "data's order, not where the old run would have"]


def test_a_run_that_is_all_warmup_is_warned_about(tmp_path):
    from engine.checkpoint import lr_schedule

    _, lines = lr_schedule(recipe_for(tmp_path, False, max_steps=5, warmup_steps=20, lr=3e-4))
    assert lines == ["warning: train.max_steps (5) < train.warmup_steps (20): the whole run is warmup and the LR "
                     "never reaches train.lr (0.0003); lower train.warmup_steps"]
    # ending exactly where the warmup does, the last step runs at train.lr: nothing to warn about
    from engine.parallel import lr_multiplier

    r = recipe_for(tmp_path, False, max_steps=20, warmup_steps=20, lr=3e-4)
    assert lr_schedule(r)[1] == [] and lr_multiplier(r.train)(19) == 1.0


def test_a_run_resumed_inside_its_warmup_takes_the_new_schedule_without_a_jump(tmp_path):
    """A trial run of 20 steps with 30 warmup steps, resumed to 50: keeping its schedule (length 20) would warm up
    to train.lr at step 30 and then drop at once to lr x min_lr_ratio; at step 20 both schedules are on the same
    warmup ramp, so the resumed run takes the recipe's (warmup to 30, cosine to 50) with no jump."""
    from engine.checkpoint import lr_schedule
    from engine.parallel import lr_multiplier

    saved_run(tmp_path, 20, max_steps=20, warmup_steps=30, lr=3e-3, min_lr_ratio=0.1)
    r = recipe_for(tmp_path, True, max_steps=50, warmup_steps=30, lr=3e-3, min_lr_ratio=0.1)
    recipe, lines = lr_schedule(r)
    assert recipe is r and recipe.train.decay_steps is None
    assert lines == ["note: --resume with train.max_steps 50 (the checkpoint's run: 20) takes this run's LR schedule "
                     "from step 21, where it has the checkpoint's LR (0.0021): warmup to step 30, then cosine to "
                     "step 50"]
    lrs = [lr_multiplier(recipe.train)(s) for s in range(20, 50)]
    assert all(b <= a + 1e-12 for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] > 0.1  # no drop to the floor
    # past its warmup, with the cosine under way, the saved schedule is kept as before
    saved_run(tmp_path / "b", 40, max_steps=40, warmup_steps=10, lr=3e-3, min_lr_ratio=0.1)
    recipe, lines = lr_schedule(recipe_for(tmp_path / "b", True, max_steps=80, warmup_steps=10, lr=3e-3,
                                           min_lr_ratio=0.1))
    assert recipe.train.decay_steps == 40 and lines[0].startswith("note: --resume with train.max_steps 80 (the "
                                                                  "checkpoint's run: 40) keeps its LR schedule")


def test_resume_with_more_steps_goes_on_at_the_final_lr(tmp_path):
    """bin/pretrain.py (1 rank, in this process): 4 steps with a cosine to 1e-4 at step 4, then --resume
    --max_steps 6. The LR logged after steps 5 and 6 is 1e-4, the saved schedule's end (a cosine stretched to 6
    steps would log 1.86e-4 after step 5)."""
    (tmp_path / "r.yaml").write_text(RECIPE)
    args = ["--deepspeed_config", ZERO3, "--config", tmp_path / "r.yaml", "--run_dir", tmp_path / "run"]
    run_ranks(1, ROOT / "bin" / "pretrain.py", *args, cwd=tmp_path)
    p = run_ranks(1, ROOT / "bin" / "pretrain.py", *args, "--resume", "--max_steps", 6, cwd=tmp_path)
    assert "note: --resume with train.max_steps 6 (the checkpoint's run: 4) keeps its LR schedule" in p.stdout
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run")}
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6]
    assert lrs[4] == pytest.approx(1e-4) and lrs[5] == lrs[6] == pytest.approx(1e-4), lrs


def test_a_stop_file_ends_the_run_with_exit_0_through_the_launcher(tmp_path):
    """RUN_DIR/STOP: every rank saves at the next step boundary and the `deepspeed` command exits 0 (a stop by SIGTERM
    saves too, but DeepSpeed's launcher then exits 1: tests/test_resume.py). The file is removed once seen."""
    (tmp_path / "r.yaml").write_text(RECIPE.replace("max_steps: 4", "max_steps: 50"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "STOP").touch()  # there before the first step: the run stops after it
    p = launch(2, ROOT / "bin" / "pretrain.py", "--deepspeed_config", ZERO3, "--config", tmp_path / "r.yaml",
               "--run_dir", run, cwd=tmp_path, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"stopped by {run / 'STOP'} after step 1; saved, continue with --resume" in p.stdout
    assert (run / "checkpoints" / "latest").read_text() == "step_00000001"
    assert not (run / "STOP").exists() and [r["step"] for r in read_metrics(run)] == [1]

"""engine/grpo.py's run loop (`train`) and its `setup`, in this process on the CPU: the step itself (grpo_step), the
held-out evaluation and the checkpoint files are fakes that record what train asks of them, so what is checked is
train's own bookkeeping: which prompts each rank takes, when it evaluates and saves, what a checkpoint records,
where a resume starts and when the token budget ends the run; and setup's LR schedule, seed and routing record."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ROOT  # noqa: F401  (puts the project on sys.path)
import engine.grpo as grpo
from engine.config import load_recipe
from engine.parallel import World

RECIPE = ROOT / "engine" / "recipes" / "grpo_tiny.yaml"
N_PROMPTS = 23  # not a multiple of any batch below: the order wraps mid-batch


def recipe_for(tmp_path, **overrides):
    over = {"run_dir": str(tmp_path / "run"), "train.max_steps": 4, "grpo.group_size": 2, "grpo.eval_every": 2,
            "checkpoint.every_steps": 0}
    over.update(overrides)
    return load_recipe(RECIPE, over)


class Fakes:
    """grpo.setup, grpo_step, evaluate and checkpoint.load/save replaced; what train passed them is kept."""

    def __init__(self, monkeypatch, tmp_path, *, rank=0, size=1, n_seq=4, micro=2, tokens_per_step=10, state=None):
        self.steps, self.evals, self.saves, self.step = [], [], [], 0
        world = World(rank=rank, size=size, local_size=size)

        def setup(recipe, ds, tok, rewards, prompts, evals, w):
            policy = SimpleNamespace(device=torch.device("cpu"), monitor=None)
            return grpo.Run(policy, None, None, tok, rewards, recipe.grpo, None, w, micro, n_seq)

        def grpo_step(run, rows, sampling, step):
            self.step = step
            self.steps.append((step, [r["id"] for r in rows]))
            return {"step": step, "generated_tokens": tokens_per_step}

        def evaluate(run, evals):
            self.evals.append(self.step)
            return {"eval_reward": 0.25}

        monkeypatch.setattr(grpo, "setup", setup)
        monkeypatch.setattr(grpo, "grpo_step", grpo_step)
        monkeypatch.setattr(grpo, "evaluate", evaluate)
        monkeypatch.setattr(grpo.checkpoint, "save", lambda engine, recipe, st, tok=None: self.saves.append(dict(st)))
        monkeypatch.setattr(grpo.checkpoint, "load", lambda engine, run_dir, lr=None: dict(state))
        self.world = world
        self.prompts = [{"id": i} for i in range(N_PROMPTS)]

    def train(self, recipe, evals=({"id": "e"},), source="src"):
        return grpo.train(recipe, {}, None, self.prompts, list(evals), None, None, self.world, source=source)


def global_order(recipe):
    return [int(i) for i in np.random.default_rng(recipe.data_seed()).permutation(N_PROMPTS)]


def test_ranks_take_consecutive_disjoint_slices_of_one_global_order(monkeypatch, tmp_path):
    """Two ranks of 2 prompts each (n_seq 4 / group 2) over 3 steps: step s, rank r takes positions
    4(s-1) + 2r + [0, 2) of the one seeded permutation, wrapping at its end; one rank of 4 prompts takes the same
    prompts in the same order. [fails if: the rank offset is dropped or not scaled by the prompts per rank, `done`
    advances before `start` is read or by the wrong amount, or the wrap / order index is wrong]"""
    recipe = recipe_for(tmp_path, **{"train.max_steps": 7})
    order = global_order(recipe)
    taken = {}
    for rank in (0, 1):
        f = Fakes(monkeypatch, tmp_path, rank=rank, size=2, n_seq=4)
        f.train(replace(recipe, run_dir=str(tmp_path / f"r{rank}")), evals=())
        taken[rank] = f.steps
    assert [s for s, _ in taken[0]] == list(range(1, 8))
    seq = [i for (_, a), (_, b) in zip(taken[0], taken[1]) for i in a + b]
    assert seq == [order[k % N_PROMPTS] for k in range(28)]
    one = Fakes(monkeypatch, tmp_path, rank=0, size=1, n_seq=8)
    one.train(replace(recipe, run_dir=str(tmp_path / "one")), evals=())
    assert [i for _, ids in one.steps for i in ids] == seq


def test_a_fresh_run_evaluates_at_step_0_every_eval_every_and_at_the_last_step(monkeypatch, tmp_path):
    """max_steps 5, eval_every 2: evaluated at steps 0, 2, 4 and 5 (the last), and those rows carry the
    held-out reward; no evals, no evaluation. [fails if: step 0 is not evaluated, the cadence is another, the last
    step is not evaluated, or evaluation runs without an eval set]"""
    recipe = recipe_for(tmp_path, **{"train.max_steps": 5})
    f = Fakes(monkeypatch, tmp_path)
    rows = f.train(recipe)
    assert f.evals == [0, 2, 4, 5]
    assert [r["step"] for r in rows if "eval_reward" in r] == [0, 2, 4, 5]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    g = Fakes(monkeypatch, tmp_path)
    rows = g.train(replace(recipe, run_dir=str(tmp_path / "noeval")), evals=())
    assert g.evals == [] and [r["step"] for r in rows] == [1, 2, 3, 4, 5]


def test_checkpoints_record_step_tokens_source_and_both_data_positions(monkeypatch, tmp_path):
    """Rank 1 of 2, 3 prompts of group 2 per rank (n_seq 6, micro 2), every_steps 2, max_steps 5: saves after
    steps 2, 4 and 5 (at_end), each with the generated tokens so far, the --init_from source, the prompts done over
    all ranks (6 per step) and the position in micro-batches per rank (prompts_done x 2 / (2 x 2)).
    [fails if: the cadence or at_end arguments to saver.due are wrong, or a saved field (step, tokens, init_source,
    prompts_done, position) is computed wrongly]"""
    recipe = recipe_for(tmp_path, **{"train.max_steps": 5, "checkpoint.every_steps": 2})
    f = Fakes(monkeypatch, tmp_path, rank=1, size=2, n_seq=6, micro=2, tokens_per_step=7)
    f.train(recipe, source="hf/x")
    assert f.saves == [{"step": s, "tokens": 7 * s, "init_source": "hf/x", "prompts_done": 6 * s,
                        "position": 6 * s * 2 // 4} for s in (2, 4, 5)]


def test_a_resume_goes_on_from_the_checkpoints_prompts_tokens_and_step_without_a_step_0_eval(monkeypatch, tmp_path):
    """Resuming at step 2 with 5 prompts done and 100 tokens: no evaluation before step 3, step 3 takes the
    prompts from position 5 of the order, the tokens total goes on from 100 and the next checkpoint records it.
    [fails if: a resumed run evaluates its starting step again, the checkpoint's prompts_done, tokens or step are
    ignored, or `generated` is not accumulated]"""
    recipe = recipe_for(tmp_path, **{"train.max_steps": 4, "grpo.eval_every": 3})
    recipe = replace(recipe, resume=True)
    order = global_order(recipe)
    f = Fakes(monkeypatch, tmp_path, n_seq=4, tokens_per_step=10,
              state={"step": 2, "position": 999, "tokens": 100, "prompts_done": 5})
    rows = f.train(recipe)
    assert f.evals == [3, 4]
    assert f.steps == [(3, [order[5], order[6]]), (4, [order[7], order[8]])]
    assert [r["generated_tokens_total"] for r in rows] == [110, 120]
    assert f.saves[-1]["tokens"] == 120 and f.saves[-1]["prompts_done"] == 9 and f.saves[-1]["step"] == 4


def test_a_checkpoint_without_prompts_done_resumes_from_its_data_position(monkeypatch, tmp_path):
    """An older checkpoint holds only the position (micro-batches per rank): 3 x micro 2 x 2 ranks / group 2 = 6
    prompts done, so rank 1 (2 prompts per rank) starts at position 8. [fails if: the position is converted without
    micro, world size or group size, or prompts_done's absence is not handled]"""
    recipe = replace(recipe_for(tmp_path, **{"train.max_steps": 3}), resume=True)
    order = global_order(recipe)
    f = Fakes(monkeypatch, tmp_path, rank=1, size=2, n_seq=4, micro=2, state={"step": 2, "position": 3, "tokens": 0})
    f.train(recipe, evals=())
    assert f.steps == [(3, [order[8], order[9]])]


@pytest.mark.parametrize("budget, last", [(30, 3), (25, 3), (20, 2)])
def test_the_token_budget_ends_the_run_at_its_step_which_is_evaluated_and_saved(monkeypatch, tmp_path, capsys,
                                                                               budget, last):
    """10 tokens a step, max_steps 40, eval_every 20, no step cadence: a budget of 30 or 25 ends after step 3, 20
    after step 2 (reached at the limit, not past it); that last step is evaluated and checkpointed as a last step is.
    [fails if: the budget is compared with > instead of >=, is not checked in the loop, or its last step is not
    evaluated or not saved (saver.due's max_steps not the step itself when the budget ends the run)]"""
    recipe = recipe_for(tmp_path, **{"train.max_steps": 40, "grpo.eval_every": 20,
                                     "grpo.max_generated_tokens": budget})
    f = Fakes(monkeypatch, tmp_path, tokens_per_step=10)
    rows = f.train(recipe)
    assert [s for s, _ in f.steps] == list(range(1, last + 1))
    assert f.evals == [0, last] and rows[-1]["step"] == last and "eval_reward" in rows[-1]
    assert [s["step"] for s in f.saves] == [last] and f.saves[0]["tokens"] == 10 * last
    assert f"grpo.max_generated_tokens {budget} reached after step {last}" in capsys.readouterr().out


@pytest.mark.parametrize("state, limit", [({"step": 4, "position": 0, "tokens": 0}, "train.max_steps (4)"),
                                          ({"step": 1, "position": 0, "tokens": 50}, "grpo.max_generated_tokens (50)")])
def test_a_resumed_run_at_its_end_trains_and_evaluates_nothing(monkeypatch, tmp_path, capsys, state, limit):
    """A checkpoint at max_steps, or one whose tokens reach the budget: no step, no evaluation, no save, and the
    note names the limit reached, once (not also "reached after step"). [fails if: the nothing-to-train check or its
    message is wrong, a finished run evaluates or steps again, or the budget line follows the note]"""
    recipe = replace(recipe_for(tmp_path, **{"train.max_steps": 4, "grpo.max_generated_tokens": 50}), resume=True)
    f = Fakes(monkeypatch, tmp_path, state=state)
    assert f.train(recipe) == []
    assert f.steps == [] and f.evals == [] and f.saves == []
    out = capsys.readouterr().out
    assert f"has reached {limit}" in out and "reached after step" not in out, out


def test_a_step_before_the_budget_is_not_the_last(monkeypatch, tmp_path):
    """Budget 35 at 10 tokens a step, eval_every 3, max_steps 10: steps 1-3 do not reach it, so only step 3 (the
    cadence) and step 4 (which reaches 40) are evaluated. [fails if: `last` is set before the budget is reached]"""
    recipe = recipe_for(tmp_path, **{"train.max_steps": 10, "grpo.eval_every": 3, "grpo.max_generated_tokens": 35})
    f = Fakes(monkeypatch, tmp_path, tokens_per_step=10)
    f.train(recipe)
    assert f.evals == [0, 3, 4] and [s["step"] for s in f.saves] == [4]


class SetupCalls:
    """setup's builders replaced: the schedule build_engine got, the routing record build_rollout got."""

    def __init__(self, monkeypatch, moe=True, kind="local"):
        self.schedule = self.record = None
        model = SimpleNamespace(config=None, modules=lambda: [])
        self.build_seed = None

        def build_model(*a, **k):
            self.build_seed = torch.initial_seed()
            return model

        monkeypatch.setattr(grpo, "build_model", build_model)
        monkeypatch.setattr(grpo, "no_dropout", lambda m: None)
        monkeypatch.setattr(grpo, "_build_device", lambda ds: "cpu")
        monkeypatch.setattr(grpo, "model_dtype", lambda ds: torch.float32)
        policy = SimpleNamespace(module=SimpleNamespace(config=None), train_micro_batch_size_per_gpu=lambda: 2,
                                 gradient_accumulation_steps=lambda: 3, device="cpu")

        def build_engine(m, ds, schedule, lengths_vary, layers):
            self.schedule = schedule
            return policy

        def build_rollout(kind_, pol, tok, n_seq, cache_len, *a, record_routes, **k):
            self.record, self.n_seq = record_routes, n_seq
            return "rollout"

        monkeypatch.setattr(grpo, "build_engine", build_engine)
        monkeypatch.setattr(grpo, "build_reference", lambda *a: "ref")
        monkeypatch.setattr(grpo, "build_rollout", build_rollout)
        monkeypatch.setattr(grpo, "rollout_kind", lambda recipe: kind)
        monkeypatch.setattr(grpo, "has_moe", lambda config: moe)
        monkeypatch.setattr(grpo, "decoder_cache_len", lambda rows, n: 16)
        monkeypatch.setattr(grpo, "Router", lambda module: "router")


@pytest.mark.parametrize("decay", [None, 7])
def test_setup_scales_the_lr_schedule_by_the_iterations_and_seeds_by_rank(monkeypatch, tmp_path, decay):
    """iterations 3: max_steps 4 -> 12, warmup 2 -> 6, decay_steps 7 -> 21 (unset stays unset); the model is built
    under train.seed on every rank (one random init), the samples after it under train.seed + rank (rank 1); the
    rollout batch is micro 2 x accumulation 3. [fails if: a schedule field is not scaled by grpo.iterations, an unset
    decay_steps is turned into a number, every rank gets the same sampling seed, or a rank's own seed is set before
    the build]"""
    recipe = recipe_for(tmp_path, **{"grpo.iterations": 3, "train.warmup_steps": 2, "train.decay_steps": decay,
                                     "train.compile": False, "train.activation_checkpointing": False})
    calls = SetupCalls(monkeypatch)
    run = grpo.setup(recipe, {}, None, None, [], [], World(rank=1, size=2, local_size=2))
    s = calls.schedule
    assert (s.max_steps, s.warmup_steps, s.decay_steps) == (12, 6, None if decay is None else decay * 3)
    assert (s.lr, s.seed) == (recipe.train.lr, recipe.train.seed)
    assert calls.build_seed == recipe.train.seed and torch.initial_seed() == recipe.train.seed + 1
    assert (run.micro, run.n_seq, calls.n_seq, run.ref) == (2, 6, 6, "ref")


@pytest.mark.parametrize("kind, moe, record", [("local", True, True), ("local", False, False),
                                               ("engine", True, False)])
def test_setup_records_expert_choices_only_for_the_local_decoder_of_an_moe_policy(monkeypatch, tmp_path, kind, moe,
                                                                                   record):
    """The decoder records its routes, and a Router watches the policy, only for the local rollout of an MoE model;
    with beta 0 no reference is built. [fails if: the record condition takes `or`, drops a term, or the router is
    made without it]"""
    recipe = recipe_for(tmp_path, **{"grpo.beta": 0.0, "train.compile": False,
                                     "train.activation_checkpointing": False})
    calls = SetupCalls(monkeypatch, moe=moe, kind=kind)
    run = grpo.setup(recipe, {}, None, None, [], [], World(rank=0, size=1, local_size=1))
    assert calls.record is record and (run.router == "router") is record and run.ref is None

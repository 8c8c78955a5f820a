"""engine/grpo.py's behaviour that its fast tests (tests/test_grpo_step_units.py, test_grpo_train_units.py,
test_grpo_preflight_units.py, test_grpo_helpers.py, and test_grpo_units.py without its 2-rank pool) let through, one
mutant a test (or a few of one kind): policy_update's dapo token normalizer on a world of several ranks (count /
(ranks x micro-batches a rank)); the routing agreement taken on the first (recording) pass only; routing_metrics
and metrics_row guarded against zero counts (no token, no completion token) and a sub-second rollout's rate; a rank
without held-out prompts generating one prompt, not all; the local decoder's refusal of linear-attention families;
grpo_batch's refusal of a single "auto" batch value and its "at least 1" note; preflight's prompts_per_step_per_gpu x
a tree's leaves, min_new_tokens 1 needing the local decoder, a group that does not divide the batch; auto_tokenizer
on a resume that recorded "auto" (and its resolved path); names_tokenizer of "auto"; grpo_auto_batch's training row
length under grpo.tree. Every expected value is worked out in the test from the definition (plain sums over the
mask, the documented rules), not read off the code. CPU only, no launcher, no process group (torch.distributed is a
stand-in where a helper reduces). The docstring's bracket names the mutant."""
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT  # noqa: F401  (puts the project on sys.path)
from engine.config import GRPOConfig
from engine.parallel import World
from test_grpo_step_units import P, R, Engine, TinyLM, make_run, rollouts


def test_dapo_divides_every_micro_batch_by_the_global_token_count_over_ranks_and_micro_batches():
    """policy_update under aggregation dapo on rank 0 of 2 (n_seq 4, micro 2: 2 micro-batches a rank), weights
    unchanged and old log-probs the policy's own (ratio 1, beta 0): each token's loss is -A of its row, and each
    micro-batch divides its sum by count / (2 ranks x 2 micro-batches). With count = 14 (both ranks' 7 response
    tokens) that is 3.5, so the summed loss stat is -sum_tokens(A) / 3.5 (the gradient then averages 4 micro-batches
    into the global token mean).
    [fails if: the normalizer leaves out the number of ranks, or the number of micro-batches a rank]"""
    from engine.grpo import policy_update

    r = rollouts()
    g = GRPOConfig(iterations=1, aggregation="dapo", beta=0.0, max_new_tokens=R)
    run = make_run(g, Engine(TinyLM()))
    run.world = World(rank=0, size=2, local_size=2)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    count = 2 * float(r.resp_mask.sum())
    assert count == 14.0
    stats, _ = policy_update(run, r, adv, None, None, count)
    per_row_tokens = r.resp_mask.sum(1).float()  # 3, 1, 2, 1
    want = -float((adv * per_row_tokens).sum()) / (count / (2 * 2))
    assert stats["loss"] == pytest.approx(want, abs=1e-5)


class OnePassRouter:
    """A Router stand-in whose recorded() tells the truth only after a forward under use(..., record=True) (the
    rollout's own experts: agreement 1); after a forward that was not recorded it gives other experts (agreement 0),
    as stale or missing records would."""

    def __init__(self, model):
        self.model, self.record = model, False

    def use(self, replay, record):
        import contextlib

        self.record = record
        return contextlib.nullcontext()

    def recorded(self):
        from test_grpo_step_units import route_of

        used = route_of(self.model.seen).reshape(-1, 1, 2)
        return (used, used) if self.record else ((used + 1) % 4, (used + 1) % 4)


def test_routing_agreement_is_measured_on_the_first_pass_only():
    """policy_update with 2 iterations and a recording router: the routing agreement is that of the first pass (the
    one that records), 1.0 here; a later pass records nothing, so its routers' state is not compared.
    [fails if: the agreement is taken on every pass (0.5 here: the second pass's unrecorded choices count)]"""
    from engine.grpo import policy_update
    from test_grpo_step_units import route_of

    model = TinyLM()
    r = rollouts()
    r.routes = route_of(r.ids)
    run = make_run(GRPOConfig(iterations=2, max_new_tokens=R), Engine(model), router=OnePassRouter(model))
    _, extra = policy_update(run, r, torch.tensor([1.0, -2.0, 0.5, 3.0]), None, None, float(r.resp_mask.sum()))
    assert extra["routing_agree_choice"] == 1.0 and extra["routing_agree_token"] == 1.0


def test_routing_metrics_of_micro_batches_without_tokens_are_zero_not_nan():
    """routing_metrics over parts that count no token (every micro-batch empty): 0 agreement, not 0/0.
    [fails if: the token count is not clamped to at least 1 before dividing]"""
    from engine.grpo import routing_metrics

    row = routing_metrics(torch.zeros(2, 2, 3), replayed=True)
    assert row == {"routing_agree_choice": 0.0, "routing_agree_token": 0.0, "routing_live_agree_choice": 0.0,
                   "routing_live_agree_token": 0.0}


def test_metrics_row_rates_of_a_sub_second_rollout_and_of_completions_without_tokens(monkeypatch):
    """metrics_row on 1 rank (no process group): a rollout of 0.25 s that generated ATTN's 7 response tokens runs at
    7 / 0.25 = 28 tokens/s, and its longest completion (3 tokens) at 250 / 3 ms a step; a batch whose completions hold
    no token (every response column padding) reports 0 tokens and 1000 x 0.25 ms a step (the longest counted as at
    least 1), not a division by zero.
    [fails if: the rollout time is floored at 1 s instead of only guarded against 0, or the longest completion is not
    floored at 1]"""
    from engine.grpo import metrics_row
    from test_grpo_step_units import metrics_args

    args = metrics_args()
    args["r"].seconds = 0.25
    row = metrics_row(**args)
    assert row["rollout_tokens_per_s"] == pytest.approx(7 / 0.25)
    assert row["rollout_ms_per_step"] == pytest.approx(250 / 3)
    args = metrics_args()
    args["r"].seconds = 0.25
    args["r"].attn[:, P:] = 0
    row = metrics_row(**args)
    assert row["generated_tokens"] == 0.0 and row["rollout_ms_per_step"] == pytest.approx(250.0)


class OtherRanks:
    """torch.distributed for evaluate on one rank: all_reduce adds the other ranks' sums, given by the test."""

    def __init__(self, others):
        self.others = others

    def all_reduce(self, t, op=None):
        t.add_(self.others)


def test_a_rank_without_held_out_prompts_generates_one_and_scores_none(monkeypatch):
    """evaluate on rank 2 of 3 with 2 held-out prompts: evals[2::3] is empty, so the rank still generates (the
    engine decodes in lockstep) but only evals[:1], and adds nothing; the means are the other ranks' sums (total 1,
    exact_match 1 over 2 prompts: 0.5).
    [fails if: a rank without a share generates every held-out prompt]"""
    import engine.grpo as grpo
    from engine.grpo import evaluate
    from engine.rewards import build_rewards
    from test_grpo_step_units import CharTok

    seen = []

    def generate(request, sampling):
        seen.append(CharTok().batch_decode(request.prompt_ids))
        ids = torch.ones(request.prompt_ids.shape[0], 1, dtype=torch.long)
        return SimpleNamespace(input_ids=torch.cat([request.prompt_ids, ids], 1),
                               attention_mask=torch.cat([request.prompt_attention_mask, ids], 1),
                               response_start_idx=torch.full((ids.shape[0],), request.prompt_ids.shape[1]))

    monkeypatch.setattr(grpo, "dist", OtherRanks(torch.tensor([1.0, 1.0, 0.0, 2.0])))
    rollout = SimpleNamespace(sync_weights=lambda *a: None, generate=generate, shutdown=lambda: None)
    run = SimpleNamespace(world=World(rank=2, size=3, local_size=3), device="cpu", rollout=rollout, tok=CharTok(),
                          rewards=build_rewards([{"name": "exact_match"}]), g=GRPOConfig(max_new_tokens=4))
    got = evaluate(run, [{"prompt": "a", "answer": "a"}, {"prompt": "b", "answer": "x"}])
    assert seen == [["a"]]
    assert got == pytest.approx({"eval_reward": 0.5, "eval_reward_exact_match": 0.5})


def test_the_decoder_family_refusal_names_linear_attention_layers():
    """decoder_family_problem: a family outside DECODER_MODEL_TYPES with linear-attention layers is refused for its
    recurrent state; one without them for not being a tested family; the listed families pass.
    [fails if: a linear-attention model gets the generic 'built and tested for' reason]"""
    from engine.grpo import DECODER_MODEL_TYPES, decoder_family_problem

    hybrid = SimpleNamespace(model_type="qwen3_next", layer_types=["linear_attention", "full_attention"])
    why = decoder_family_problem(hybrid)
    assert "cannot take a qwen3_next model" in why and "Gated DeltaNet" in why and "built and tested" not in why
    plain = SimpleNamespace(model_type="llama")
    why = decoder_family_problem(plain)
    assert "cannot take a llama model" in why and "built and tested for deepseek_v3" in why
    assert all(decoder_family_problem(SimpleNamespace(model_type=k)) is None for k in DECODER_MODEL_TYPES)


@pytest.mark.parametrize("auto_key", ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
def test_one_auto_batch_value_beside_a_number_is_refused(auto_key):
    """grpo_batch: exactly one of the two batch values "auto" (the other a number) is a ConfigError naming it; both
    auto gives the default batch; both numbers give None.
    [fails if: a single "auto" is not refused]"""
    from engine.config import ConfigError
    from engine.grpo import grpo_batch

    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    raw = {k: ("auto" if k == auto_key else 2) for k in keys}
    with pytest.raises(ConfigError, match=f'^where: {auto_key} "auto" with a number'):
        grpo_batch(raw, GRPOConfig(group_size=4), "where")
    assert grpo_batch({k: 2 for k in keys}, GRPOConfig(group_size=4), "where") is None


def test_the_default_batch_note_says_at_least_1_only_for_a_group_larger_than_the_default():
    """grpo_batch with both values "auto": a group of exactly SEQUENCES_PER_STEP (64) gives 64 // 64 = 1 whole prompt,
    no floor at 1 involved; a group of 65 gets the floor, and the note says so.
    [fails if: the ', at least 1' note is added when the group equals the default]"""
    from engine.auto_batch import SEQUENCES_PER_STEP
    from engine.grpo import grpo_batch

    assert SEQUENCES_PER_STEP == 64
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    assert grpo_batch(auto, GRPOConfig(group_size=64), "x") == (64, "1 prompt x 64 completions; default: 64 // 64 "
                                                                    "prompts")
    assert grpo_batch(auto, GRPOConfig(group_size=65), "x") == (65, "1 prompt x 65 completions; default: 64 // 65 "
                                                                    "prompts, at least 1")


def test_prompts_per_step_are_checked_against_a_trees_leaves_not_group_size(tmp_path):
    """preflight with written batch numbers (16 x 4 = 64 sequences a rank) and grpo.tree on (4 trees x (1 + 3) = 16
    leaves a prompt): grpo.prompts_per_step_per_gpu 4 makes 4 x 16 = 64, accepted, though 4 x the recipe's
    group_size would not be 64; 2 prompts (32) are refused naming the tree leaves.
    [fails if: prompts_per_step_per_gpu is multiplied by grpo.group_size while a tree is on]"""
    from test_grpo_preflight_units import refusal, run_preflight

    tree = {"enabled": True, "trees": 4, "branches": 3}
    recipe = run_preflight(tmp_path, grpo={"tree": tree, "prompts_per_step_per_gpu": 4, "group_size": 4})[0]
    assert recipe.grpo.group_size == 16
    line = refusal(tmp_path, grpo={"tree": tree, "prompts_per_step_per_gpu": 2, "group_size": 4})
    assert "grpo.prompts_per_step_per_gpu (2) x the tree leaves (16) != train_micro_batch_size_per_gpu x " \
           "gradient_accumulation_steps (64)" in line, line


def test_a_single_minimum_new_token_needs_the_local_decoder(tmp_path):
    """grpo.min_new_tokens 1 (the smallest that does something: EOS masked at the first step) on a family the local
    decoder cannot take is refused naming the setting, as 2 is in tests/test_grpo_preflight_units.py.
    [fails if: only min_new_tokens > 1 counts as needing the local decoder]"""
    from test_grpo_preflight_units import GDN, refusal

    line = refusal(tmp_path, model=GDN, grpo={"min_new_tokens": 1})
    assert "cannot take a qwen3_5_moe_text model" in line and line.endswith(
        "(grpo.min_new_tokens needs the local decoder)"), line


def test_a_group_smaller_than_the_batch_that_does_not_divide_it_is_refused(tmp_path):
    """preflight with 16 x 4 = 64 sequences a rank: grpo.group_size 24 (< 64, but 64 = 2 x 24 + 16) is refused, as
    each rank's batch must be whole groups; 32 divides it and passes.
    [fails if: only a group larger than the batch is refused]"""
    from test_grpo_preflight_units import refusal, run_preflight

    line = refusal(tmp_path, grpo={"group_size": 24})
    assert "grpo.group_size (24) must divide train_micro_batch_size_per_gpu x gradient_accumulation_steps (64)" \
           in line, line
    assert run_preflight(tmp_path, grpo={"group_size": 32})[0].grpo.group_size == 32


def test_a_resume_that_recorded_auto_takes_the_models_tokenizer_even_beside_a_dir_named_auto(tmp_path, monkeypatch):
    """auto_tokenizer on --resume: a checkpoint that recorded data.tokenizer "auto" names no tokenizer path, so the
    one saved with the model is used (resolved), even where the working directory holds a folder called auto.
    [fails if: a recorded "auto" is taken as a path when such a folder exists]"""
    import engine.grpo as grpo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "auto").mkdir()
    (tmp_path / "model_tok").mkdir()
    monkeypatch.setattr(grpo.checkpoint, "saved_state", lambda run_dir: {"recipe": {"data": {"tokenizer": "auto"}}})
    monkeypatch.setattr(grpo, "model_tokenizer", lambda init_from: "model_tok")
    recipe = SimpleNamespace(resume=True, run_dir=str(tmp_path / "run"))
    assert grpo.auto_tokenizer(recipe, "somewhere") == str(tmp_path / "model_tok")
    (tmp_path / "recorded_tok").mkdir()
    monkeypatch.setattr(grpo.checkpoint, "saved_state",
                        lambda run_dir: {"recipe": {"data": {"tokenizer": str(tmp_path / "recorded_tok")}}})
    assert grpo.auto_tokenizer(recipe, "somewhere") == str(tmp_path / "recorded_tok")


@pytest.mark.parametrize("data, names", [({"tokenizer": "auto"}, False), ({"tokenizer": "some/dir"}, True),
                                         ({"path": "p.jsonl"}, False), (None, False)])
def test_names_tokenizer_is_true_only_for_a_tokenizer_other_than_auto(tmp_path, data, names):
    """names_tokenizer reads the recipe file: data.tokenizer auto (or left out, or no data section) names no
    tokenizer, so --init_from's is used; a path names one.
    [fails if: data.tokenizer auto counts as naming a tokenizer]"""
    import yaml

    from engine.grpo import names_tokenizer

    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model": {}} if data is None else {"data": data}))
    assert names_tokenizer(str(f)) is names
    assert names_tokenizer(None) is False


def test_the_auto_batchs_training_rows_are_prompt_plus_max_new_tokens_even_with_a_tree(tmp_path):
    """grpo_auto_batch fits training rows of the longest prompt + grpo.max_new_tokens rounded up to 16 (10 + 24 ->
    48): with grpo.tree on, a leaf is still one sequence of at most max_new_tokens new tokens; only the decoder's KV
    cache needs a max_new_tokens per decoding phase (cache_tokens: 24 x (1 + 1 iteration) = 48 + 10 -> 64), and
    that is not the training row.
    [fails if: the training rows are sized by the tree's cache slots]"""
    import json
    from dataclasses import replace

    from engine.config import TreeConfig, load_recipe
    from engine.grpo import grpo_auto_batch
    from engine.model import make_hf_config
    from engine.tree import cache_tokens
    from test_grpo_preflight_units import TINY, tok

    r = load_recipe(TINY)
    tree = TreeConfig(enabled=True, trees=2, branches=2)
    r = replace(r, grpo=replace(r.grpo, rollout="engine", max_new_tokens=24, tree=tree), run_dir=str(tmp_path / "run"))
    assert cache_tokens(r.grpo) == 48
    raw = json.loads((ROOT / "ds_configs" / "zero3_grpo.json").read_text())
    auto = grpo_auto_batch((64, "x"), raw, r, make_hf_config(r.model, tok()), [{"n_tokens": 10}], World(0, 1, 1))
    assert auto.seq_len == 48

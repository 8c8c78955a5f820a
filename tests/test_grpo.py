"""GRPO on CPU ranks (conftest.run_ranks: 2 ranks on the rank pool, 1 in this process): the reference engine, the
rollout kinds, bad input, bad rewards.

One tiny DeepSeek-V3 MoE is pretrained once (module fixture) on arithmetic one-liners ("Q: 20 + 36 = ? A: 56",
each its own document, so EOS follows the answer) and longer stories. GRPO then runs on two prompts, one per
rank: the arithmetic one, which the model answers in two tokens (" 56", EOS), and a story opening, which it
continues to max_new_tokens. So the ranks' rollouts finish at different lengths, by construction.
tests/scripts/grpo_probe.py runs engine.grpo.train itself and records logits, shards and rollout lengths.
"""
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, ZERO3, env, read_metrics, run_in_process, run_ranks, write_ds

PROBE = ROOT / "tests" / "scripts" / "grpo_probe.py"
GRPO = ROOT / "bin" / "grpo.py"
ZERO3_GRPO = ROOT / "tests" / "zero3_grpo_16x4.json"  # the shipped zero3_grpo.json with its batch written: 16 x 4
ASSETS = ROOT / "engine" / "assets"
HANG = 300  # seconds: a 2-rank GRPO run takes ~30 s on 2 busy cores; past this it hangs, and the test fails

PRETRAIN = """
model: {arch: deepseek_v3, hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 128,
        moe_intermediate_size: 64, num_experts: 8, experts_per_token: 2, num_shared_experts: 1,
        vocab_size: 512, max_position_embeddings: 96}
data: {seq_len: 64, path: CORPUS}
train: {max_steps: 100, warmup_steps: 3, log_every: 50}
"""
PROMPTS = [{"prompt": "Q: 20 + 36 = ? A:", "answer": "56"}, {"prompt": "Gus went to the harbor with", "answer": "9"}]
# 1 prompt x G=4 per rank per step (micro-batch 4, no accumulation): rank r always gets prompt order[r], so one
# rank answers in 2 tokens and the other runs to 8; the eval set (the same two, greedy) splits the same way.
# length_penalty gives completions of one group different rewards, so advantages are not all zero.
GRPO_RECIPE = """
data: {path: PROMPTS}
train: {max_steps: 2, lr: 1.0e-3, warmup_steps: 0, log_every: 1}
grpo: {group_size: 4, max_new_tokens: 8, temperature: 0.7, beta: 0.04, rollout: KIND, eval_path: PROMPTS,
       eval_every: 1, rewards: [{name: numeric, which: first}, {name: length_penalty, target: 3, scale: 0.1}]}
checkpoint: {at_end: false}
"""


def run_launcher(n_ranks: int, script, *args, cwd, timeout: int = HANG, pythonpath: str | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """conftest.run_ranks (2 ranks: the worker's rank pool; 1: this process), with a PYTHONPATH entry for the job.
    A 2-rank job past `timeout` ends the pool and fails the test, so a hang there never blocks the suite; a 1-rank
    job in this process has no timeout of its own."""
    return run_ranks(n_ranks, script, *args, cwd=cwd, timeout=timeout, path=(pythonpath,) if pythonpath else (),
                     check=check)


def build_pretrained(tmp_path_factory):
    """A pretraining run dir and its Hugging Face export (context 96 tokens): conftest's session fixture
    `pretrained`, shared by this file and tests/test_tree.py (one pretraining run for both)."""
    tmp = tmp_path_factory.mktemp("grpo_pretrain")
    docs = [{"text": f"{r['prompt']} {r['answer']}"} for r in map(json.loads, (ASSETS / "arith_train.jsonl").open())]
    for line in (ASSETS / "corpus.jsonl").read_text().splitlines()[:2000]:
        docs.append({"text": re.sub(r"Q: [^A]*A: -?\d+ ?", "", json.loads(line)["text"]).strip()})
    docs = [d for d in docs if d["text"]]
    docs = [docs[(i * 7919) % len(docs)] for i in range(len(docs))]  # interleave (7919 is prime, coprime)
    (tmp / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp / "pretrain.yaml").write_text(PRETRAIN.replace("CORPUS", str(tmp / "corpus.jsonl")))
    run_launcher(1, ROOT / "bin" / "pretrain.py", "--deepspeed_config", ZERO3, "--config", tmp / "pretrain.yaml",
                 "--run_dir", tmp / "run", cwd=tmp)
    run_launcher(1, ROOT / "bin" / "zero_to_fp32", tmp / "run", tmp / "hf", cwd=tmp)
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return tmp


def grpo_ds(path, fp32: bool, accumulation: int = 1):
    """The shipped GRPO DS config at micro-batch 4, no accumulation (or `accumulation`); fp32 drops "bf16"."""
    return write_ds(path, base=ZERO3_GRPO, drop=("bf16",) if fp32 else (),
                    train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=accumulation)


def probe(pretrained, name: str, ranks: int, kind: str, fp32: bool, *extra, iterations: int = 1,
          grpo: str = "", accumulation: int = 1, train: str = "") -> list[dict]:
    d = pretrained / name
    d.mkdir()
    (d / "grpo.yaml").write_text(GRPO_RECIPE.replace("PROMPTS", str(pretrained / "prompts.jsonl"))
                                 .replace("rollout: KIND", f"rollout: {kind}, iterations: {iterations}{grpo}")
                                 .replace("train: {", "train: {" + train))
    run_launcher(ranks, PROBE, "--out", d / "out", *extra, "--deepspeed_config",
                 grpo_ds(d / "ds.json", fp32, accumulation), "--config", d / "grpo.yaml", "--init_from", pretrained / "hf",
                 "--run_dir", d / "run", cwd=d)
    return [json.loads((d / "out" / f"rank{r}.json").read_text()) for r in range(ranks)]


LOCAL_GRPO = ", rollout_correction: tis, rollout_correction_cap: 0.5, routing_replay: r3"


@pytest.fixture(scope="module")
def runs(pretrained):
    """Two 2-rank GRPO runs (2 steps, beta > 0): local rollouts in fp32, engine rollouts in bf16 (as shipped). The
    local run corrects for the rollout/train mismatch (tis) with a cap of 0.5, below every weight (all ~1 in fp32):
    each token's policy gradient is halved, and the rows say every token was truncated. It also replays the decoder's
    expert choices (grpo.routing_replay r3)."""
    return {"local": probe(pretrained, "local", 2, "local", True, grpo=LOCAL_GRPO),
            "engine": probe(pretrained, "engine", 2, "engine", False)}


@pytest.mark.parametrize("kind", ["local", "engine"])
def test_reference_equals_policy_before_the_first_update(runs, kind):
    for info in runs[kind]:
        assert info["ep_size"] == [2, 2]  # both MoE layers expert-parallel over the 2 ranks
        # build_reference copies the local ZeRO-3 shards one to one: identical shards, identical logits, on
        # every rank, in fp32 and in bf16 (0.0, not a tolerance: the same numbers through the same code).
        assert info["ref_kind"] == "DeepSpeedEngine"  # ZeRO-3 on 2 ranks: the shards, not a whole copy
        assert info["shards_before"] == 0.0, info
        assert info["ref_vs_policy_before"] == 0.0, info
        assert info["ref_training"] is False


@pytest.mark.parametrize("kind", ["local", "engine"])
def test_a_step_moves_the_policy_and_not_the_reference(runs, kind):
    for info in runs[kind]:
        assert [r["step"] for r in info["rows"]] == [0, 1, 2]  # eval at 0, then two GRPO steps
        assert info["rows"][-1]["kl"] > 0  # the KL term compared the moved policy with the reference
        assert info["policy_after_vs_before"] > 1e-2, info  # measured: 3.75 (fp32), 3.70 (bf16)
        assert info["shards_after"] > 0
        assert info["ref_after_vs_before"] == 0.0, info  # the reference's logits did not move at all
    # Every rank computed the same logits (the same model on the same input).
    a, b = runs[kind]
    assert a["policy_after_vs_before"] == b["policy_after_vs_before"]


@pytest.mark.parametrize("kind", ["local", "engine"])
def test_the_loss_scores_the_distribution_that_sampled(runs, kind):
    """Rollouts sample from softmax(logits / T) (T = 0.7 here): the log-probs that reach the loss at the first
    update (policy and reference, both still the sampling policy) are those of that distribution, not T = 1's."""
    for info in runs[kind]:
        assert info["temperature"] == 0.7
        # fp32 (local): the engine and a plain copy differ by kernels only (measured 1.2e-6 and 1.4e-6 on the two
        # ranks); bf16 (engine): by bf16 rounding in two code paths (measured 0.042 and 0.0025). The same tokens at
        # T = 1 score 0.76 and 0.22 off (the control; scored at T = 1, the loss got exactly those: 0.76 and 0.22).
        bound = 1e-4 if kind == "local" else 6e-2
        got = info["sampling_vs_train_logp"]
        assert got < bound and info["sampling_vs_ref_logp"] < bound, info
        assert info["untempered_vs_sampling_logp"] > max(bound, 3 * got), info


def test_the_rollout_train_mismatch_is_on_every_row(runs):
    """Local rollouts record the decoder's log-prob of each sampled token; every step's row compares it with the
    policy's first training forward (the same weights: the mismatch is the two code paths' arithmetic alone).
    fp32 here, so tiny; a target off by one position would be nats off. Engine rollouts record none."""
    for info in runs["local"]:
        for row in info["rows"][1:]:
            assert 0 < row["rollout_logp_diff_mean"] <= row["rollout_logp_diff_max"] < 1e-4, row
            assert abs(row["rollout_kl_k3"]) < 1e-8, row
            assert row["rollout_corrected_frac"] == 1.0, row  # tis: every weight (~1) above the cap of 0.5
        a, b = runs["local"]
        assert a["rows"][1]["rollout_logp_diff_max"] == b["rows"][1]["rollout_logp_diff_max"]  # over both ranks
    assert not any("rollout_logp_diff_mean" in row or "rollout_corrected_frac" in row
                   for info in runs["engine"] for row in info["rows"])


def test_the_routing_agreement_is_on_every_row(runs):
    """Local rollouts record every token's expert ids; with r3 the rows show the training forward used them all
    (agreement 1 by construction, measured), and what the live routers would have chosen (fp32: the same here).
    Engine rollouts record none."""
    for info in runs["local"]:
        for row in info["rows"][1:]:
            assert row["routing_agree_choice"] == row["routing_agree_token"] == 1.0, row
            assert row["routing_live_agree_choice"] > 0.99 and row["routing_live_agree_token"] > 0.99, row
    assert not any(k.startswith("routing_") for info in runs["engine"] for row in info["rows"] for k in row)
    for info in runs["local"] + runs["engine"]:  # packed train passes: the padding left is reported
        assert all(0 <= row["train_padding_frac"] < 1 for row in info["rows"][1:]), info["rows"]


@pytest.mark.parametrize("kind", ["local", "engine"])
def test_reward_std_is_over_both_ranks_rewards(runs, kind):
    """The metrics row's reward_std on 2 ranks is the standard deviation (n - 1) of both ranks' rewards together, the
    same on each rank. [fails if: it is a mean of each rank's own standard deviation, or a rank's own]"""
    import statistics

    a, b = runs[kind]
    steps = [row for row in a["rows"] if "reward_std" in row]
    assert len(steps) == len(a["step_rewards"]) == len(b["step_rewards"]) == 2
    for i, (row_a, row_b) in enumerate(zip(steps, [row for row in b["rows"] if "reward_std" in row])):
        both = a["step_rewards"][i] + b["step_rewards"][i]
        assert row_a["reward_std"] == pytest.approx(statistics.stdev(both), abs=1e-9) == row_b["reward_std"], (i, both)


def test_local_rollouts_finish_at_different_lengths_without_a_hang(runs):
    a, b = runs["local"]
    assert a["rollout_class"] == b["rollout_class"] == "DecoderRollout"
    assert len(a["rollouts"]) == len(b["rollouts"]) == 5  # eval, (rollout, eval) x 2
    for ra, rb in zip(a["rollouts"], b["rollouts"]):
        for r in (ra, rb):
            assert r["decode_steps"] == max(r["completion_lens"])  # each rank stopped once all its samples had
            # No collectives while generating (transformers turns on synced_gpus under ZeRO-3 unless told not
            # to: then a finished rank keeps stepping for the others, and its cache outgrows its mask and crashes).
            assert r["collectives"] == {}, r
    steps = [(ra["decode_steps"], rb["decode_steps"]) for ra, rb in zip(a["rollouts"], b["rollouts"])]
    # The greedy eval before any update: the arithmetic prompt ends after 2 tokens (" 56", EOS), the story
    # runs to max_new_tokens. Later rollouts sample (and the policy moves), so only most of them must differ.
    assert set(steps[0]) == {2, 8} and a["rollouts"][0]["greedy"], steps
    assert sum(x != y for x, y in steps) >= 3, steps  # measured: all 5 differ; and training went on after them
    assert len(a["rows"]) == 3


def test_engine_rollouts_finish_at_different_lengths_without_a_hang(runs):
    a, b = runs["engine"]
    assert a["rollout_class"] == b["rollout_class"] == "HybridEngineRollout"
    assert len(a["rollouts"]) == len(b["rollouts"]) == 5
    finish = []
    for ra, rb in zip(a["rollouts"], b["rollouts"]):
        assert ra["decode_steps"] == rb["decode_steps"] == 8  # lockstep through ZeRO-3 for max_new_tokens
        assert sum(ra["collectives"].values()) > 0  # the counter sees collectives where there are some
        finish.append((max(ra["completion_lens"]), max(rb["completion_lens"])))  # EOS applied afterwards
    assert set(finish[0]) == {2, 8} and a["rollouts"][0]["greedy"], finish
    assert sum(x != y for x, y in finish) >= 3, finish  # measured: all 5 differ
    assert len(a["rows"]) == 3


def check_local_copy(result: dict):
    # fp32 both: the plain HF model and the ZeRO-3/AutoEP engine differ only in kernels (measured: 1.9e-6 on
    # 1 rank; 1.9e-6 / 1.4e-6 on 2 ranks before / after an update); a wrong expert order, a missing shard or a
    # transposed weight moves logits by far more (swapping experts 0 and 7 of layer 0 in the copy: 2.76).
    assert result["copy_vs_policy"] < 1e-4, result
    assert result["swapped_experts_vs_policy"] > 1e-2, result
    for name, shape in result["copy_expert_shapes"].items():
        assert shape[0] == 8, (name, shape)  # every expert present, gathered over the expert-parallel group
    assert len(result["copy_expert_shapes"]) == 4


def test_local_copy_equals_the_policy_on_one_rank(pretrained):
    (info,) = probe(pretrained, "copy1", 1, "local", True, "--copy_only")
    assert info["ep_size"] == [1, 1]
    check_local_copy(info)


def test_local_copy_equals_the_policy_on_two_ranks(runs):
    for info in runs["local"]:  # expert parallel 2: each rank holds 4 of the 8 experts per layer
        assert info["ep_size"] == [2, 2]
        check_local_copy(info["before"])
        check_local_copy(info["after"])  # the copy follows the updated policy too


def test_a_random_init_is_one_model_on_two_expert_parallel_ranks(pretrained):
    """grpo.allow_random_init (benchmarks) under ZeRO-2 with expert parallelism 2: DeepSpeed broadcasts the dense
    weights from rank 0 but each expert only within its expert-data-parallel group (here one rank), so the ranks must
    build one model for their expert slices to belong to it. The policy's logits before the first update equal a
    1-rank run's (every expert on one rank); with a different init per rank they differ by far more than 1e-4."""
    model = PRETRAIN.split("data:")[0]
    before = {}
    for ranks in (1, 2):
        d = pretrained / f"random_init_{ranks}"
        d.mkdir()
        (d / "grpo.yaml").write_text(model + GRPO_RECIPE.replace("data: {", "data: {seq_len: 64, ")
                                     .replace("PROMPTS", str(pretrained / "prompts.jsonl"))
                                     .replace("rollout: KIND", "rollout: local, allow_random_init: true")
                                     .replace("max_steps: 2", "max_steps: 1"))
        ds = write_ds(d / "ds.json", base=ROOT / "ds_configs" / "zero2_grpo.json", drop=("bf16",),
                      train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
        run_launcher(ranks, PROBE, "--out", d / "out", "--deepspeed_config", ds, "--config", d / "grpo.yaml",
                     "--run_dir", d / "run", cwd=d)
        infos = [json.loads((d / "out" / f"rank{r}.json").read_text()) for r in range(ranks)]
        assert [i["ep_size"] for i in infos] == [[ranks, ranks]] * ranks  # experts split over the ranks
        before[ranks] = [torch.tensor(i["policy_before"]) for i in infos]
    one = before[1][0]
    for got in before[2]:
        assert got.shape == one.shape
        assert (got - one).abs().max().item() < 1e-4, (got - one).abs().max().item()


# ------------------------------------------------------------------------------ the persistent rollout decoder

def check_same_samples(info: dict):
    """Greedy tokens of the persistent decoder (static cache, weights refreshed in place) equal transformers'
    generate on a plain copy of the same weights, before any update and after the last one."""
    for key in ("samples_before", "samples_after"):
        got = info[key]
        assert got["decoder"] == got["generate"], (key, got)
        assert len(got["decoder"][0]) > got["prompt_width"]  # it decoded something


def test_decoder_is_built_once_and_samples_as_generate_on_two_ranks(runs):
    for info in runs["local"]:  # expert parallel 2: the decoder's experts are all-gathered at each refresh
        assert info["decoder_builds"] == 1, info["decoder_builds"]  # 5 rollouts (3 evals, 2 steps), one decoder
        check_same_samples(info)
        # The samples differ before and after the updates (lr 1e-3), so the refresh really moved the decoder.
        assert info["samples_before"]["decoder"] != info["samples_after"]["decoder"]


@pytest.fixture(scope="module")
def old_logps_run(pretrained):
    """The 2-rank local run again, but with the old-log-prob forward that iterations 1 now skips."""
    return probe(pretrained, "local_old", 2, "local", True, "--force_old_logps", grpo=LOCAL_GRPO)


def test_skipping_the_old_logprob_forward_changes_no_number(runs, old_logps_run):
    for new, old in zip(runs["local"], old_logps_run):
        assert new["old_logps"] == [False, False] and old["old_logps"] == [True, True]
        for a, b in zip(new["rows"][1:], old["rows"][1:]):
            for key in ("loss", "reward", "kl", "ratio_mean", "entropy", "clip_frac_low", "clip_frac_high"):
                assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), (key, a[key], b[key])
            assert a["ratio_mean"] == 1.0  # one optimizer step per batch: the ratio is exactly 1
        assert new["rows"][-1]["eval_reward"] == old["rows"][-1]["eval_reward"]


@pytest.fixture(scope="module")
def pack_runs(pretrained):
    """Two 2-rank local runs (fp32, 2 steps) with both prompts on each rank (micro-batch 4 x accumulation 2: each
    rank's 8 rows are 4 two-token answers to the short, left-padded arithmetic prompt and 4 eight-token story
    continuations): train passes packed (as shipped) and on consecutive full-width micro-batches (--no_pack)."""
    return {"packed": probe(pretrained, "packed", 2, "local", True, grpo=LOCAL_GRPO, accumulation=2),
            "plain": probe(pretrained, "unpacked", 2, "local", True, "--no_pack", grpo=LOCAL_GRPO, accumulation=2),
            "compiled": probe(pretrained, "compiled", 2, "local", True, grpo=LOCAL_GRPO, accumulation=2,
                              train="compile: true, ")}


def test_packed_train_passes_train_the_same_policy_on_two_ranks(pack_runs):
    """Packing (rows sorted by length, each micro-batch cut to its columns) changes no loss and no update: over two
    steps on 2 ranks (ZeRO-3, EP 2, fp32) the loss rows and the trained policy's logits equal the unpacked run's,
    while fewer padding slots went through the forwards."""
    import torch

    for new, old in zip(pack_runs["packed"], pack_runs["plain"]):
        for a, b in zip(new["rows"][1:], old["rows"][1:]):
            assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a["loss"], b["loss"])
            assert a["reward"] == b["reward"] and a["generated_tokens"] == b["generated_tokens"]
            assert a["train_padding_frac"] < b["train_padding_frac"], (a["train_padding_frac"], b["train_padding_frac"])
        got, want = torch.tensor(new["policy_after"]), torch.tensor(old["policy_after"])
        assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
        assert new["policy_after_vs_before"] > 100 * 1e-4  # the updates moved the policy far more than that


def test_a_compiled_policy_trains_as_the_eager_one_on_two_ranks(pack_runs):
    """train.compile: true: the policy's decoder layers compiled for any length (pretrain.compile_layers, AutoEP eager),
    under ZeRO-3 with decoder-layer leaves on 2 ranks (EP 2, fp32), packed micro-batches of changing lengths: the
    eager run's losses and trained policy, to inductor's rounding."""
    import torch

    for new, old in zip(pack_runs["compiled"], pack_runs["packed"]):
        assert new["compiled_layers"] == 2 and old["compiled_layers"] == 0  # both layers of the GRPO test model
        # compiled layers are built with torch's linear (pretrain.plain_linear_for_compiled_layers); DeepSpeed's made
        # dynamo trace each layer on its own (docs/benchmarks.md); the eager run keeps DeepSpeed's default
        assert new["deepspeed_linear"] is False and old["deepspeed_linear"] is True
        for a, b in zip(new["rows"][1:], old["rows"][1:]):
            assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-5), (a["loss"], b["loss"])
            assert a["reward"] == b["reward"] and a["generated_tokens"] == b["generated_tokens"]
        got, want = torch.tensor(new["policy_after"]), torch.tensor(old["policy_after"])
        # Inductor's fused reductions round differently (losses above: within 1e-5), and Adam's first steps move an
        # element by about lr whatever its gradient's size, so one whose tiny gradient rounds the other way moves
        # the other way: measured 8e-4 in logits the two updates moved by 1.76. A layer computed wrongly would
        # differ by a share of that motion, not 1/500 of it.
        moved = new["policy_after_vs_before"]
        assert (got - want).abs().max() < 2e-3 * moved, ((got - want).abs().max(), moved)


def test_two_iterations_run_the_old_logprob_forward_on_one_rank(pretrained):
    (info,) = probe(pretrained, "iter2", 1, "local", True, iterations=2)
    # ZeRO-3 on one CPU rank: the reference is the optimizer-free engine (a plain copy only on a GPU rank,
    # grpo.reference_is_copy), with exactly the policy's logits before the first update; it stays put while the
    # policy moves.
    assert info["ref_kind"] == "DeepSpeedEngine" and info["ref_training"] is False
    assert info["ref_vs_policy_before"] == 0.0, info["ref_vs_policy_before"]
    assert info["ref_after_vs_before"] == 0.0 and info["policy_after_vs_before"] > 1e-2
    assert info["old_logps"] == [True, True]
    assert info["decoder_builds"] == 1
    check_same_samples(info)  # one rank, expert parallel 1
    assert all(r["ratio_mean"] != 1.0 for r in info["rows"][1:])  # the second pass sees moved weights


FLAT_RECIPE = """
data: {path: PROMPTS}
train: {max_steps: 2, lr: 1.0e-3, warmup_steps: 0, log_every: 1}
grpo: {group_size: 4, max_new_tokens: 8, temperature: 0.7, beta: 0.04, rollout: local, aggregation: dapo,
       dynamic_sampling: true, rewards: [{name: format, pattern: 'no completion is this', full: true}]}
checkpoint: {at_end: false}
"""


def test_no_update_when_dynamic_sampling_leaves_no_token(pretrained, runs):
    """DAPO's dynamic sampling drops groups whose rewards are all equal; when that is every group on every rank (a
    reward nothing earns yet), the token-mean loss would be 0/0 and the update NaN. The step is skipped and says so;
    the policy does not move; the LR schedule advances as in a run that updates (the 2-rank local run, same train:)."""
    d = pretrained / "flat"
    d.mkdir()
    (d / "grpo.yaml").write_text(FLAT_RECIPE.replace("PROMPTS", str(pretrained / "prompts.jsonl")))
    run_launcher(1, PROBE, "--out", d / "out", "--deepspeed_config", grpo_ds(d / "ds.json", True), "--config",
                 d / "grpo.yaml", "--init_from", pretrained / "hf", "--run_dir", d / "run", cwd=d)
    info = json.loads((d / "out" / "rank0.json").read_text())
    rows = info["rows"]
    assert [(r["step"], r["update_skipped"], r["loss"], r["reward_std"]) for r in rows] == [(1, 1, 0.0, 0.0),
                                                                                          (2, 1, 0.0, 0.0)], rows
    assert info["policy_after_vs_before"] == 0.0  # no optimizer step: no momentum, no weight decay
    assert [r["lr"] for r in rows] == [r["lr"] for r in runs["local"][0]["rows"][1:]]
    assert all(r["update_skipped"] == 0 for r in runs["local"][0]["rows"][1:])


# ---------------------------------------------------------------------------------------------- bad input

def run_cli(tmp_path, *args, recipe: str | None = None):
    """bin/grpo.py as the launcher would start rank 0 of 1, from the repo root (the shipped recipe's paths)."""
    cmd = [sys.executable, str(GRPO), "--deepspeed_config", str(ZERO3_GRPO), *map(str, args)]
    if recipe is not None:
        (tmp_path / "recipe.yaml").write_text(recipe)
        cmd += ["--config", str(tmp_path / "recipe.yaml")]
    cmd += ["--run_dir", str(tmp_path / "run")]
    e = env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)


def run_cli_in_process(tmp_path, *args, recipe: str | None = None, capfd, monkeypatch):
    """run_cli's run, in this process (conftest.run_in_process)."""
    from engine.grpo import main

    argv = ["--deepspeed_config", ZERO3_GRPO, *args]
    if recipe is not None:
        (tmp_path / "recipe.yaml").write_text(recipe)
        argv += ["--config", tmp_path / "recipe.yaml"]
    argv += ["--run_dir", tmp_path / "run"]
    return run_in_process(main, argv, capfd, monkeypatch, cwd=ROOT, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_SIZE=1)


TINY = (ROOT / "engine" / "recipes" / "grpo_tiny.yaml").read_text()


@pytest.mark.parametrize("case, expect", [
    ("prompt_too_long", "data.path row 2: prompt of"),
    ("unknown_reward", "grpo.rewards[0].name: unknown reward 'numerik'"),
    ("group_of_one", "grpo.group_size (1) must be >= 2"),
    ("group_not_dividing_batch", "grpo.group_size (5) must divide train_micro_batch_size_per_gpu x "
                                 "gradient_accumulation_steps (64)"),
    ("missing_init_from", "--init_from /nonexistent/pretrain_run: no such directory"),
    ("init_from_without_checkpoint", "--init_from"),
    ("random_init", "no --init_from (nor model.init_from): GRPO would train a randomly initialised policy, which "
                    "earns no reward"),
    ("balance_rate", "train.balance_rate (0.01): GRPO keeps the routing biases the policy was trained with"),
    ("pretraining_corpus", "has no 'prompt' (keys: ['text'])"),
])
def test_bad_input_is_one_clear_line_before_any_work(tmp_path, case, expect, capfd, monkeypatch):
    """engine.grpo.main (what bin/grpo.py runs) in this process, as rank 0 of 1 from the repo root: exit 2, one line
    on stderr, nothing written. What a fresh process prints besides (import-time warnings, datasets' progress bar)
    is checked through `python bin/grpo.py` by test_prompts_load_without_a_progress_bar."""
    args, recipe = [], None
    if case == "prompt_too_long":
        rows = [PROMPTS[0], {"prompt": "Gus went to the harbor with 9 pens. " * 60, "answer": "9"}]
        (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        args = ["--data", tmp_path / "p.jsonl"]
    elif case == "unknown_reward":
        recipe = TINY.replace("{name: numeric, weight: 1.0, which: first}", "{name: numerik, weight: 1.0}")
    elif case == "group_of_one":
        recipe = TINY.replace("group_size: 8", "group_size: 1")
    elif case == "group_not_dividing_batch":
        recipe = TINY.replace("group_size: 8", "group_size: 5")  # zero3_grpo.json: 16 x 4 = 64 per rank
    elif case == "missing_init_from":
        args = ["--init_from", "/nonexistent/pretrain_run"]
    elif case == "pretraining_corpus":  # the pretraining corpus given to GRPO
        args = ["--data", ROOT / "engine" / "assets" / "corpus.jsonl"]
    elif case == "balance_rate":  # a pretraining recipe's setting copied over: it would do nothing here
        recipe = TINY.replace("balance_rate: 0.0", "balance_rate: 0.01")
    elif case == "init_from_without_checkpoint":
        (tmp_path / "empty").mkdir()  # exists, but neither a run dir with checkpoints nor a HF model dir
        args = ["--init_from", tmp_path / "empty"]
    assert recipe is None or recipe != TINY
    p = run_cli_in_process(tmp_path, *args, recipe=recipe, capfd=capfd, monkeypatch=monkeypatch)
    assert p.returncode == 2, p.stderr[-3000:]
    # (datasets' progress bar while reading a new prompts file: see test_prompts_load_without_a_progress_bar)
    lines = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("Generating train split")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], p.stderr[-3000:]
    if case == "pretraining_corpus":
        assert lines[0].endswith("(its rows are documents for pretraining: bin/pretrain.py trains on them; GRPO reads "
                                 "prompt/answer rows)"), lines[0]
    if case == "prompt_too_long":
        assert re.search(r"prompt of \d{3} tokens \+ grpo.max_new_tokens 4 exceeds the context \(512\)", lines[0])
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_prompts_load_without_a_progress_bar(tmp_path):
    """Bad input is one line on stderr: reading a prompts file that datasets has not cached yet must not print
    its "Generating train split" bar first (with a file seen before, the bar does not show)."""
    rows = [PROMPTS[0], {"prompt": "Gus went to the harbor with 9 pens. " * 60, "answer": "9"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = run_cli(tmp_path, "--data", tmp_path / "p.jsonl")
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]


def test_context_check_uses_the_model_being_trained(pretrained, tmp_path):
    """The recipe's model section is ignored with --init_from (the loaded model's config is used), so the prompt
    length check must use the loaded model's context (96 here), not the recipe's (512)."""
    from engine.config import ConfigError
    from engine.grpo import parse_args, preflight
    from engine.parallel import World

    rows = [PROMPTS[0], {"prompt": "Gus went to the harbor with 9 pens. " * 12, "answer": "9"}]  # 109 tokens
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = TINY.replace("eval_path: engine/assets/arith_eval.jsonl", f"eval_path: {ASSETS / 'arith_eval.jsonl'}")
    (tmp_path / "recipe.yaml").write_text(recipe)
    for init in (pretrained / "hf", pretrained / "run"):  # a HF model dir, a pretraining run dir
        args = parse_args(["--deepspeed_config", str(ZERO3_GRPO), "--config", str(tmp_path / "recipe.yaml"),
                           "--data", str(tmp_path / "p.jsonl"), "--init_from", str(init),
                           "--run_dir", str(tmp_path / "run")])
        with pytest.raises(ConfigError, match=r"data.path row 2: prompt of \d+ tokens .* exceeds the context \(96\)"):
            preflight(args, World(rank=0, size=1, local_size=1))


def test_eval_set_smaller_than_the_world_does_not_hang(pretrained, tmp_path):
    """grpo.eval_path with 1 prompt on 2 ranks, engine rollouts: a rank with no eval prompt must still take part
    in generation, whose decode steps are ZeRO-3 collectives. The same run stops at grpo.max_generated_tokens:
    a budget of 1 token ends it after step 1 of 3, and that step is evaluated as a last step is (eval_every 5)."""
    (tmp_path / "eval1.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    recipe = (GRPO_RECIPE.replace("eval_path: PROMPTS", f"eval_path: {tmp_path / 'eval1.jsonl'}")
              .replace("PROMPTS", str(pretrained / "prompts.jsonl")).replace("KIND", "engine")
              .replace("max_steps: 2", "max_steps: 3").replace("eval_every: 1", "eval_every: 5, max_generated_tokens: 1"))
    (tmp_path / "grpo.yaml").write_text(recipe)
    p = run_launcher(2, GRPO, "--deepspeed_config", grpo_ds(tmp_path / "ds.json", False), "--config",
                     tmp_path / "grpo.yaml", "--init_from", pretrained / "hf", "--run_dir", tmp_path / "run",
                     cwd=tmp_path, timeout=150)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert "eval_reward" in rows[0] and "eval_reward" in rows[1], rows
    assert rows[1]["generated_tokens_total"] == rows[1]["generated_tokens"] >= 1, rows
    assert "grpo.max_generated_tokens 1 reached after step 1" in p.stdout, p.stdout[-2000:]


def test_token_budget_below_one_is_refused():
    from engine.config import ConfigError, load_recipe

    with pytest.raises(ConfigError, match=r"grpo.max_generated_tokens \(0\) must be >= 1"):
        load_recipe(ROOT / "engine" / "recipes" / "grpo_tiny.yaml", {"grpo.max_generated_tokens": 0})


# ------------------------------------------------------------------------------------- failing rewards

FLAKY = '''
def flaky(prompt, completion, answer):
    """Raises on every arithmetic prompt; NaN for odd-length completions, else 1.0."""
    if "+" in prompt:
        raise ValueError("flaky reward: cannot score " + repr(prompt))
    return float("nan") if len(completion) % 2 else 1.0
'''


@pytest.fixture(scope="module")
def flaky_run(pretrained):
    """The real bin/grpo.py on 2 ranks from the pretraining run dir, with a user reward that fails."""
    d = pretrained / "flaky"
    (d / "mods").mkdir(parents=True)
    (d / "mods" / "my_rewards.py").write_text(FLAKY)
    (d / "grpo.yaml").write_text(f"""
data: {{path: {pretrained / 'prompts.jsonl'}}}
train: {{max_steps: 2, lr: 1.0e-3, warmup_steps: 0, log_every: 1}}
grpo: {{group_size: 4, max_new_tokens: 8, temperature: 0.7, beta: 0.04,
       rewards: [{{name: "my_rewards:flaky", label: flaky}}, {{name: numeric, which: first}}]}}
checkpoint: {{every_steps: 0, at_end: true}}
""")
    p = run_launcher(2, GRPO, "--deepspeed_config", grpo_ds(d / "ds.json", False), "--config", d / "grpo.yaml",
                     "--init_from", pretrained / "run", "--run_dir", d / "run", cwd=d, pythonpath=str(d / "mods"))
    return d, p


def test_failing_reward_scores_zero_and_is_counted(flaky_run):
    d, p = flaky_run
    rows = read_metrics(d / "run")
    assert [r["step"] for r in rows] == [1, 2]  # finished: no crash, no hang
    for r in rows:
        # 8 samples per step (2 ranks x 1 prompt x G=4): the 4 of the arithmetic prompt raise, some story
        # completions give NaN; each failure scores 0, the rest 1.0, so the mean is (8 - failures) / 8.
        assert 4 <= r["reward_flaky_failures"] <= 8, r
        assert r["reward_flaky"] == pytest.approx((8 - r["reward_flaky_failures"]) / 8), r
        assert r["reward_numeric_failures"] == 0
        assert all(v == v for v in r.values() if isinstance(v, float)), r  # no NaN reached the metrics
    assert (d / "run" / "init_hf" / "config.json").is_file()  # --init_from a run dir: exported, then trained


def test_failing_reward_reason_is_shown(flaky_run):
    """A count alone does not say what is wrong with the user's function: its first error should be printed."""
    _, p = flaky_run
    assert "flaky reward: cannot score" in p.stdout + p.stderr


def test_grpo_saves_checkpoints_on_the_configured_cadence(flaky_run):
    d, _ = flaky_run
    ck = d / "run" / "checkpoints"
    assert (ck / "latest").read_text() == "step_00000002"
    assert sorted(x.name for x in ck.iterdir() if x.is_dir()) == ["step_00000002"]  # every_steps 0: the end only


RESUME_RECIPE = """
data: {path: PROMPTS}
train: {max_steps: 4, lr: 1.0e-3, warmup_steps: 0, log_every: 1}
grpo: {group_size: 4, max_new_tokens: 6, temperature: 0.7, beta: 0.04,
       rewards: [{name: numeric, which: first}, {name: length_penalty, target: 3, scale: 0.1}]}
checkpoint: {every_steps: 2, keep_last: 2, at_end: false}
"""


@pytest.mark.parametrize("curriculum", [False, True], ids=["plain", "curriculum"])
def test_resumed_grpo_equals_an_uninterrupted_run(pretrained, curriculum):
    """2 ranks, fp32: 4 steps straight, saving at step 2; then the run is put back to that checkpoint (as after a
    crash) and resumed. The checkpoint carries the policy, optimizer, LR schedule, each rank's RNG (sampling) and
    the prompt position; the reference engine is rebuilt from --init_from. With grpo.curriculum it also carries the
    per-prompt statistics that steps 3 and 4 draw their prompts from (engine/curriculum.py)."""
    d = pretrained / f"resume_{'curriculum' if curriculum else 'plain'}"
    d.mkdir()
    rows = [json.loads(line) for line in (ASSETS / "arith_train.jsonl").read_text().splitlines()[:6]]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = RESUME_RECIPE.replace("PROMPTS", str(d / "prompts.jsonl"))
    if curriculum:  # 6 prompts, 2 a step: step 1 draws 2 unseen, later steps 1 unseen + 1 by pass rate
        recipe = recipe.replace("beta: 0.04,", "beta: 0.04, curriculum: {enabled: true},")
    (d / "grpo.yaml").write_text(recipe)
    common = ["--deepspeed_config", grpo_ds(d / "ds.json", True), "--config", d / "grpo.yaml",
              "--init_from", pretrained / "hf"]
    run_launcher(2, GRPO, *common, "--run_dir", d / "straight", cwd=d)
    shutil.copytree(d / "straight", d / "split")
    ck = d / "split" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_00000004"
    shutil.rmtree(ck / "step_00000004")
    (ck / "latest").write_text("step_00000002")
    # 1 prompt x 4 completions per rank and step: the prompts consumed over both ranks, what a resume continues from
    # under any group size or batch
    assert json.loads((ck / "step_00000002" / "engine_state.json").read_text())["prompts_done"] == 4
    # its metrics.jsonl still holds steps 3 and 4 (as after a crash): the resume sets them aside
    # Resumed without --init_from in the plain case: the reference comes from the model the checkpoint names (before,
    # a random one: KL 0.07 -> 3.4 on the resumed step); the comparison below includes the KL.
    resume_args = common[:-2] if not curriculum else common
    run_launcher(2, GRPO, *resume_args, "--run_dir", d / "split", "--resume", cwd=d)
    keys = ("step", "reward", "reward_std", "loss", "kl", "entropy", "response_len", "lr")
    if curriculum:
        keys += ("curriculum_unseen", "curriculum_in_band", "curriculum_tried", "curriculum_band_prompts")
    straight = [{k: r[k] for k in keys} for r in read_metrics(d / "straight")]
    split = [{k: r[k] for k in keys} for r in read_metrics(d / "split")]
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert split == straight  # bitwise: the resumed steps sample and learn exactly as the uninterrupted ones
    replaced = [json.loads(line) for line in (d / "split" / "metrics.replaced.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replaced] == [3, 4]
    if not curriculum:  # resumed once more at train.max_steps: nothing to train, no row (no eval of step 4 again)
        p = run_launcher(2, GRPO, *resume_args, "--run_dir", d / "split", "--resume", cwd=d)
        assert "note: nothing to train: checkpoint at step 4 has reached train.max_steps (4)" in p.stdout, p.stdout
        assert [{k: r[k] for k in keys} for r in read_metrics(d / "split")] == straight
    if curriculum:  # and the statistics the next step would draw from
        state = [json.loads((r / "checkpoints" / "step_00000004" / "engine_state.json").read_text())["curriculum"]
                 for r in (d / "straight", d / "split")]
        assert state[0] == state[1] and sum(state[0]["attempts"]) > 0
        # step 1: 2 unseen; then round(0.25 x 2) = 1 unseen + 1 tried. Resumed without the statistics, step 3 would
        # find every prompt unseen (1.0) and draw others.
        assert [r["curriculum_unseen"] for r in straight] == [1.0, 0.5, 0.5, 0.5]
    else:  # another model than the run started from is refused before any work
        from engine.config import ConfigError
        from engine.grpo import parse_args, preflight
        from engine.parallel import World

        args = parse_args([str(a) for a in resume_args[:4]] + ["--init_from", str(pretrained / "run"), "--run_dir",
                                                              str(d / "split"), "--resume"])
        with pytest.raises(ConfigError, match=rf"^--init_from {pretrained / 'run'}: the run in {d / 'split'} started "
                                              rf"from {pretrained / 'hf'} \(checkpoint .*step_00000004\), its reference "
                                              "policy; resume without --init_from"):
            preflight(args, World(rank=0, size=2, local_size=2))


def test_pipeline_config_is_refused_before_any_work(tmp_path, capfd, monkeypatch):
    """GRPO needs the ZeRO engine (rollout copies, reference shards): pipe.json gets one line and exit 2 (engine.grpo.main
    in this process as rank 0 of 2; a fresh process's output: test_prompts_load_without_a_progress_bar)."""
    from engine.grpo import main

    for world in (2, 1):  # on 1 rank the file's 2 stages do not divide the world: still the same one line
        p = run_in_process(main, ["--deepspeed_config", ROOT / "ds_configs" / "pipe.json", "--run_dir",
                                  tmp_path / "run"], capfd, monkeypatch, cwd=ROOT, RANK=0, LOCAL_RANK=0,
                           WORLD_SIZE=world, LOCAL_SIZE=world)
        assert p.returncode == 2, p.stdout + p.stderr
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "GRPO runs on ZeRO configs" in errors[0] and "stages (2)" not in errors[0], \
            p.stderr
        assert not (tmp_path / "run").exists()


REPLAY_PROBE = ROOT / "tests" / "scripts" / "replay_probe.py"


def replay_probe(pretrained, name: str, ranks: int, checkpointing: bool, ep: int | None = None) -> list[dict]:
    """tests/scripts/replay_probe.py on `ranks` ranks (ep: expert-parallel size instead of "auto")."""
    d = pretrained / name
    d.mkdir()
    recipe = GRPO_RECIPE.replace("PROMPTS", str(pretrained / "prompts.jsonl")).replace(
        "rollout: KIND", "rollout: local, routing_replay: r3")
    if checkpointing:
        recipe = recipe.replace("train: {", "train: {activation_checkpointing: true, ")
    (d / "grpo.yaml").write_text(recipe)
    ds = grpo_ds(d / "ds.json", True)
    if ep is not None:
        cfg = json.loads(ds.read_text())
        cfg["expert_parallel"]["autoep_size"] = ep
        ds.write_text(json.dumps(cfg))
    run_launcher(ranks, REPLAY_PROBE, "--out", d / "out", "--deepspeed_config", ds,
                 "--config", d / "grpo.yaml", "--init_from", pretrained / "hf", "--run_dir", d / "run", cwd=d)
    return [json.loads((d / "out" / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def replays(pretrained):
    """tests/scripts/replay_probe.py on 1 rank, on 2 ranks (ZeRO-3, expert parallel 2), and on 4 ranks as expert
    parallel 2 x data parallel 2 with activation checkpointing (the real launcher): fp32, the same 8 sampled rollouts
    everywhere."""
    return {"one": replay_probe(pretrained, "replay1", 1, False), "two": replay_probe(pretrained, "replay2", 2, False),
            "four": replay_probe(pretrained, "replay4", 4, True, ep=2)}


def test_replay_dispatches_every_token_to_the_decoders_experts(replays):
    """grpo.routing_replay r3: for every prompt and response token and every MoE layer, the training forward
    (ZeRO-3, AutoEP at expert parallel 2) dispatches to the experts the rollout decoder recorded; also to routes
    no live router would choose (each id moved to the next expert), so the match is the replay, not agreement."""
    two = replays["two"]
    assert [r["ep_size"] for r in two] == [2, 2] and replays["one"][0]["ep_size"] == 1
    assert [r["ep_size"] for r in replays["four"]] == [2] * 4
    for r in replays["one"] + two + replays["four"]:
        assert r["real_used_equal"] and r["foreign_used_equal"], r
        assert r["foreign_live_equal"] < 0.5, r  # the live routers would have chosen otherwise
        # the GRPO step's passes replay what Rollouts.replay hands them: the old-log-prob pass on the foreign routes
        # scores as the forward replaying them did, and with replay off (its routers choosing) it does not
        assert r["old_logp_r3_vs_foreign"] < 1e-5 < 1e-3 < r["old_logp_off_vs_foreign"], r
        # In fp32 the live routers choose as the decoder did (8 rollouts decoded in two turns of 4 rows: each turn's
        # routes are its own, not the next turn's)
        assert r["real_live_agree"] > 0.99, r


def test_replayed_router_gradient_equals_the_hand_computed_one(replays):
    """The router still learns under replay: its gate weight's gradient (ZeRO-3's full gradient, averaged over
    ranks) is non-zero and equals the gradient of transformers' own model whose routers return the same ids with
    the family's arithmetic; 1 rank, 2 ranks and 4 ranks (EP 2 x DP 2, with activation checkpointing: a replayed
    forward's recompute replays too) give the same gradient."""
    import torch

    def grads(r, key="grads"):
        return torch.tensor(r[key])

    ref = grads(replays["one"][0])
    assert ref.abs().max() > 1e-4
    for name, runs_ in replays.items():
        for r in runs_:
            assert r["hand_logp_vs_engine"] < 1e-4, (name, r["hand_logp_vs_engine"])
            torch.testing.assert_close(grads(r), grads(r, "hand_grads"), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(grads(r), ref, atol=1e-5, rtol=1e-4)
    assert all(r["checkpointing"] for r in replays["four"]) and not replays["two"][0]["checkpointing"]


def test_grpo_takes_the_pretraining_configs_auto_batch(pretrained):
    """One DS config for both commands: bin/grpo.py with the shipped zero3.json (batch "auto") fits the micro-batch
    (on the CPU: the largest power of 2 up to 16 dividing the rollout batch) and accumulates to the rollout batch
    (grpo.prompts_per_step_per_gpu 3 x G 4 = 12 sequences: 4 x 3), says so once, and trains exactly as
    zero3_grpo.json with those numbers written."""
    d = pretrained / "auto_batch"
    d.mkdir()
    rows = [json.loads(line) for line in (ASSETS / "arith_train.jsonl").read_text().splitlines()[:6]]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "grpo.yaml").write_text(GRPO_RECIPE.replace("PROMPTS", str(d / "prompts.jsonl")).replace(
        "rollout: KIND", "rollout: local, prompts_per_step_per_gpu: 3"))
    common = ["--config", d / "grpo.yaml", "--init_from", pretrained / "hf"]
    p = run_launcher(1, GRPO, "--deepspeed_config", ZERO3, *common, "--run_dir", d / "auto", cwd=d)
    batch = [line for line in p.stdout.splitlines() if line.startswith("batch:")]
    assert batch == ['batch: micro-batch 4 x 3 accumulation per GPU ("auto": micro-batch 4: the CPU\'s: the largest '
                     "power of 2 up to 16 dividing it; accumulation 3: 12 sequences per step per GPU "
                     "(grpo.prompts_per_step_per_gpu 3 x 4 completions) / 4)"], p.stdout
    written = write_ds(d / "written.json", base=ZERO3_GRPO, train_micro_batch_size_per_gpu=4,
                       gradient_accumulation_steps=3)
    run_launcher(1, GRPO, "--deepspeed_config", written, *common, "--run_dir", d / "written", cwd=d)
    keys = ("step", "reward", "reward_std", "loss", "kl", "entropy", "response_len", "generated_tokens", "eval_reward")
    auto, numbers = ([{k: r[k] for k in keys if k in r} for r in read_metrics(d / run)] for run in ("auto", "written"))
    assert [r["step"] for r in auto] == [0, 1, 2] and auto[-1]["generated_tokens"] > 0
    assert auto == numbers  # bitwise: the same batch, the same run


def test_an_auto_batch_grpo_run_resumes_with_its_batch(pretrained):
    """zero3.json's "auto" batch on --resume keeps the checkpoint's micro-batch and accumulation (an exact resume
    depends on them); a recipe that now asks for another rollout batch is refused in one line, nothing written."""
    d = pretrained / "auto_resume"
    d.mkdir()
    rows = [json.loads(line) for line in (ASSETS / "arith_train.jsonl").read_text().splitlines()[:6]]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = GRPO_RECIPE.replace("PROMPTS", str(d / "prompts.jsonl")).replace("checkpoint: {at_end: false}",
                                                                              "checkpoint: {every_steps: 1}")
    for n in (3, 2):
        (d / f"p{n}.yaml").write_text(recipe.replace("rollout: KIND", f"rollout: local, prompts_per_step_per_gpu: {n}"))
    common = ["--deepspeed_config", ZERO3, "--init_from", pretrained / "hf", "--run_dir", d / "run"]
    run_launcher(1, GRPO, *common, "--config", d / "p3.yaml", "--max_steps", 1, cwd=d)
    p = run_launcher(1, GRPO, *common, "--config", d / "p2.yaml", "--resume", cwd=d, check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    assert '"auto" kept the checkpoint\'s batch (4 x 3 = 12 sequences per GPU) for an exact resume, but the recipe ' \
           "now asks for 8 (grpo.prompts_per_step_per_gpu 2 x 4 completions)" in errors[0], errors[0]
    p = run_launcher(1, GRPO, *common, "--config", d / "p3.yaml", "--resume", cwd=d)
    assert "the checkpoint's, the same as auto here" in p.stdout
    assert [r["step"] for r in read_metrics(d / "run") if "loss" in r] == [1, 2]

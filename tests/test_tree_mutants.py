"""engine/tree.py's rules that the other fast tests (tests/test_tree.py, tests/test_tree_curriculum_units.py) let
through, one mutant a test: a branch that starts at its source's first own token (a fork of a fork there, or a new
chain from the prompt) is a valid tree; advantages() honours normalize_std; each rollout's decoder counts start
from zero and its decode steps add up over the decoding phases; a branch from the prompt sees the prompt's last
token once; each leaf's recorded routes sit at its own tokens; the sampling settings reach every phase in their
places; the refusal of a group larger than the decoder's batch; and tree_rollouts, what engine/grpo.py calls: the
batch (prompt masks per leaf, response start), the routes and the decode steps it hands on, and its refusal without
a local decoder. Expected values are worked out by hand from the module docstring's definitions (node value V = mean
leaf reward, A = (V(s) - V(root) + V(s) - V(parent)) / sqrt(|leaves(s)|)) and from the decoder's documented step
counts; the decoder tests use test_tree's tiny random Qwen3-MoE model on the CPU, greedy, with a fixed branch point.
The docstring's bracket names the mutant."""
import types

import pytest
import torch

from test_tree import prompts, tiny


@pytest.fixture(autouse=True)
def no_zero3_from_earlier_tests(monkeypatch):
    """As in tests/test_tree.py: a DeepSpeed engine trained earlier in this process keeps transformers' ZeRO-3 flag
    alive; the plain models built here must not be partitioned by it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)


def _fixed(offset: int):
    """A branch-point policy: the tree's first path (its chain) at `offset`, whatever the entropies."""
    def pick(entropy, starts, n, branched, window=None):  # noqa: ARG001
        return [(0, offset)][:n]
    return pick


def _one_branch_tree():
    """1 tree, 1 iteration, 1 branch point, 1 branch: 2 leaves per prompt, 2 prompts (the second left-padded by 3)."""
    from engine.config import TreeConfig

    return TreeConfig(enabled=True, trees=1, branch_points=1, branches=1, iterations=1)


def _decoder(batch_size: int = 4, new: int = 6, **kw):
    from engine.decoder import Decoder

    return Decoder(tiny("qwen3_moe"), "cpu", batch_size=batch_size, cache_len=7 + 2 * new, **kw)


def _spy(monkeypatch, dec) -> list:
    """Record (eos_id, pad_id, temperature, top_p) of every continue_rows call on `dec`, then run the real one."""
    calls, real = [], dec.continue_rows

    def continue_rows(rows, limits, eos_id, pad_id, temperature=1.0, top_p=1.0, feed=None, check_every=None):
        calls.append((eos_id, pad_id, temperature, top_p))
        return real(rows, limits, eos_id, pad_id, temperature, top_p, feed=feed, check_every=check_every)

    monkeypatch.setattr(dec, "continue_rows", continue_rows)
    return calls


# ------------------------------------------------------------------------------------------- bookkeeping

def test_a_branch_may_start_at_its_sources_first_own_token():
    """generate_tree makes branches whose start equals their source's: the fallback's new chains (offset 0 of the
    tree's chain, which starts at 0) and, with a custom pick, a fork at a forked path's own first token. Both are
    valid trees. New chain: leaves 0 (reward 1) and 1 (reward 0) share nothing: 2 (r - 1/2) = +1, -1 per token.
    Fork at offset 2 of leaf 1, itself forked from leaf 0 at 2: tokens 0-1 are every leaf's (the root: A = 0),
    leaves 1 and 2 are siblings below it; rewards 1, 0, 0, V(root) = 1/3: 2 (1 - 1/3) = 4/3, 2 (0 - 1/3) = -2/3.
    [kills: shared_leaves' check `starts[c] >= starts[p]` -> `starts[c] > starts[p]`]"""
    from engine.tree import shared_leaves, token_advantages

    assert shared_leaves([-1, 0], [0, 0], [2, 3]) == [[0b01, 0b01], [0b10, 0b10, 0b10]]
    assert token_advantages([-1, 0], [0, 0], [2, 3], [1.0, 0.0]) == [[1.0, 1.0], [-1.0, -1.0, -1.0]]
    parents, starts, lengths = [-1, 0, 1], [0, 2, 2], [4, 4, 3]
    assert shared_leaves(parents, starts, lengths) == [[0b111, 0b111, 0b001, 0b001], [0b111, 0b111, 0b010, 0b010],
                                                       [0b111, 0b111, 0b100]]
    got = token_advantages(parents, starts, lengths, [1.0, 0.0, 0.0])
    want = [[0.0, 0.0, 4 / 3, 4 / 3], [0.0, 0.0, -2 / 3, -2 / 3], [0.0, 0.0, -2 / 3]]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-12)


def test_advantages_divide_by_the_groups_std_when_normalize_std():
    """advantages(..., normalize_std=True), what engine/grpo.py calls with grpo.normalize_std (the default): two lone
    chains, rewards 1 and 0, lengths 2 and 1, prompt length 2 (response token k is target 1 + k of width 3):
    +-2 x 1/2 / (sqrt(1/2) + 1e-6) = +-1.4142115623759233; normalize_std=False keeps +-1.
    [kills: advantages() passing normalize_std=False to token_advantages whatever it is given]"""
    from engine.tree import TreeInfo, advantages

    info = TreeInfo(2, [-1, -1], [0, 0], [2, 1], [], {}, 0, [])
    s = 1.4142115623759233
    got = advantages(info, torch.tensor([1.0, 0.0]), 2, 3, normalize_std=True)
    torch.testing.assert_close(got, torch.tensor([[0.0, s, s], [0.0, -s, 0.0]]), rtol=0, atol=1e-6)
    got = advantages(info, torch.tensor([1.0, 0.0]), 2, 3, normalize_std=False)
    assert got.tolist() == [[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]]


# ------------------------------------------------------------------------------------------- decoding

def test_each_rollouts_counts_start_from_zero():
    """The counts of a rollout are its own (GRPO calls generate_tree every step on one persistent decoder, and its
    generated_tokens metric is info.generated_tokens): the second of two identical greedy rollouts (2 prompts, a
    6-token chain each, one branch at offset 3, no EOS) samples 2 x (6 + 3) = 18 tokens, forks 2 rows and prefills the
    11 real prompt tokens (7 + 4), as the first did. [kills: generate_tree's decoder.reset_counts() dropped]"""
    from engine.tree import generate_tree

    dec = _decoder()
    ids, mask = prompts()
    for _ in range(2):
        _, info = generate_tree(dec, ids, mask, _one_branch_tree(), 6, eos_id=-1, pad_id=0, temperature=0,
                                pick=_fixed(3))
        assert info.starts == [0, 3, 0, 3] and info.lengths == [6] * 4
        assert info.generated_tokens == 18
        assert (info.counts["sampled_tokens"], info.counts["forks"], info.counts["prefill_tokens"]) == (18, 2, 11)


def test_decode_steps_add_up_over_the_decoding_phases():
    """decoder.decode_steps after a tree rollout is the whole rollout's (what the metrics report), not the last
    phase's: the chains' phase samples 6 tokens from the prefill's logits (5 steps: the last token is never fed), the
    iteration's phase feeds the prefix's last token once and samples 6 - 3 = 3 (3 steps): 8.
    [kills: the phases' steps not accumulated, or decoder.decode_steps left at the last phase's]"""
    from engine.tree import generate_tree

    dec = _decoder()
    ids, mask = prompts()
    generate_tree(dec, ids, mask, _one_branch_tree(), 6, eos_id=-1, pad_id=0, temperature=0, pick=_fixed(3))
    assert dec.decode_steps == 8
    assert dec.decode_s > 0


def test_a_branch_from_the_prompt_sees_the_prompts_last_token_once():
    """A branch at offset 0 (as the fallback's new chains start) forks the prompt's slots before its last token's
    and feeds that token again: it resamples exactly the distribution the chain's first token was drawn from, so,
    greedy, it decodes the chain's 6 tokens with the chain's entropies (to float noise), for the left-padded prompt
    too. [kills: a chain's first slot recorded as width (the prompt's last token then kept by the fork and fed a
    second time, seen twice)]"""
    from engine.tree import generate_tree

    dec = _decoder()
    ids, mask = prompts()
    out, info = generate_tree(dec, ids, mask, _one_branch_tree(), 6, eos_id=-1, pad_id=0, temperature=0,
                              pick=_fixed(0))
    assert info.parents == [-1, 0, -1, 0] and info.starts == [0, 0, 0, 0]
    for chain, branch in ((0, 1), (2, 3)):
        assert torch.equal(out[branch], out[chain])
        torch.testing.assert_close(torch.tensor(info.entropy[branch]), torch.tensor(info.entropy[chain]),
                                   rtol=0, atol=2e-5)


def test_each_leafs_routes_are_its_tokens_routes_in_place():
    """info.routes (what r3 replays) holds, at each prompt position and each response token but the last (never
    fed), the expert ids the decoder recorded for that very token. Greedy, a branch at offset 3 decodes its chain's
    tokens, so all 4 leaves' routes at positions 0-11 (7 prompt, 5 fed response tokens) equal Decoder.generate's for
    the same prompt, the left-padded one included. [kills: token k's ids gathered from slots[k] (the slot token
    k - 1 was fed at); the prompt's slots left 0 in the gather]"""
    from engine.tree import generate_tree

    dec = _decoder(record_routes=True)
    ids, mask = prompts()
    out, info = generate_tree(dec, ids, mask, _one_branch_tree(), 6, eos_id=-1, pad_id=0, temperature=0,
                              pick=_fixed(3))
    chains = dec.generate(ids, mask, 6, eos_id=-1, pad_id=0, temperature=0)
    want = dec.last_routes(2, 13)
    assert info.routes.shape[:2] == (4, 13)
    for row in range(4):
        assert torch.equal(out[row], chains[row // 2]), row
        assert torch.equal(info.routes[row, :12], want[row // 2, :12]), row


def test_sampling_settings_reach_every_decode_phase_in_their_places(monkeypatch):
    """generate_tree passes eos_id, pad_id, temperature and top_p to each continue_rows call (the chains' and the
    iteration's) as themselves: eos -1, pad 0, temperature 0, top_p 0.5. (With temperature 0 and top_p 1, the tests'
    usual settings, swapping the two still decodes greedily.) [kills: temperature and top_p swapped in decode()]"""
    from engine.tree import generate_tree

    dec = _decoder()
    calls = _spy(monkeypatch, dec)
    ids, mask = prompts()
    generate_tree(dec, ids, mask, _one_branch_tree(), 6, eos_id=-1, pad_id=0, temperature=0.0, top_p=0.5,
                  pick=_fixed(3))
    assert calls == [(-1, 0, 0.0, 0.5)] * 2


def test_more_leaves_than_the_decoder_batch_is_refused_by_name():
    """2 prompts x 2 leaves on a decoder of 3 rows: generate_tree's own one-line refusal, before any work.
    [fails if: generate_tree's `P * G > decoder.batch_size` check is dropped (the decoder's prefill then refuses
    with its own message about prompts, not leaves)]"""
    from engine.tree import generate_tree

    dec = _decoder(batch_size=3)
    ids, mask = prompts()
    with pytest.raises(ValueError, match=r"^grpo\.tree: 2 prompts x 2 leaves do not fit the rollout decoder's batch "
                                         r"of 3$"):
        generate_tree(dec, ids, mask, _one_branch_tree(), 6, eos_id=-1, pad_id=0, temperature=0)
    assert dec.counts["prefill_tokens"] == 0


# ------------------------------------------------------------------------------------------- tree_rollouts

def _rollout(**kw):
    return types.SimpleNamespace(decoder=_decoder(record_routes=True), decode_steps=None, decode_s=None,
                                 last_routes=None, tokenizer=types.SimpleNamespace(eos_token_id=-1, pad_token_id=0),
                                 **kw)


def test_tree_rollouts_hand_grpo_the_leaves_routes_and_steps(monkeypatch):
    """tree_rollouts on a DecoderRollout-like object (the real decoder, recording routes; eos -1, pad 0), 2 prompts,
    greedy with top_p 0.5, 6 new tokens, one branch per tree: 4 leaves of 7 + 6 ids. Each leaf's attention mask
    starts with its own prompt's (rows 2 and 3 are prompt 1's, left-padded by 3), then 6 response 1s; the responses
    start at 7; every decode call got eos -1, pad 0, temperature 0, top_p 0.5; rollout.last_routes is the tree's
    routes (r3 replays them) and rollout.decode_steps the decoder's total, 5 + (6 - the earliest branch offset).
    [kills: the prompt masks tiled (repeat) instead of per leaf (repeat_interleave); response_start_idx 0;
    temperature / top_p or eos / pad swapped in tree_rollouts; rollout.last_routes or rollout.decode_steps not set]"""
    from engine.tree import tree_rollouts

    rollout = _rollout()
    calls = _spy(monkeypatch, rollout.decoder)
    ids, mask = prompts()
    request = types.SimpleNamespace(prompt_ids=ids, prompt_attention_mask=mask)
    sampling = types.SimpleNamespace(max_new_tokens=6, temperature=0.0, top_p=0.5)
    batch, info = tree_rollouts(rollout, request, sampling, _one_branch_tree())
    assert batch.input_ids.shape == (4, 13) and info.parents == [-1, 0, -1, 0] and info.lengths == [6] * 4
    assert batch.attention_mask.tolist() == [[1] * 13, [1] * 13, [0] * 3 + [1] * 10, [0] * 3 + [1] * 10]
    assert batch.response_start_idx.tolist() == [7] * 4
    assert calls == [(-1, 0, 0.0, 0.5)] * 2
    assert info.routes is not None and rollout.last_routes is info.routes
    assert rollout.decode_steps == 5 + 6 - min(info.starts[1], info.starts[3])
    assert rollout.decode_s > 0 and info.counts["seconds"] > 0


def test_tree_rollouts_refuse_a_rollout_without_the_local_decoder():
    """grpo.rollout engine (a HybridEngineRollout: no `decoder`) cannot fork rows: tree_rollouts says so by name.
    [fails if: the `decoder is None` check is dropped (an AttributeError from generate_tree instead)]"""
    from engine.tree import tree_rollouts

    rollout = types.SimpleNamespace(tokenizer=types.SimpleNamespace(eos_token_id=-1, pad_token_id=0))
    ids, mask = prompts()
    request = types.SimpleNamespace(prompt_ids=ids, prompt_attention_mask=mask)
    sampling = types.SimpleNamespace(max_new_tokens=6, temperature=0.0, top_p=1.0)
    with pytest.raises(ValueError, match=r"^grpo\.tree needs the local rollout decoder \(grpo\.rollout local or "
                                         r"auto\)$"):
        tree_rollouts(rollout, request, sampling, _one_branch_tree())

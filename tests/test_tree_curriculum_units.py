"""The prompt curriculum's draw and resume, and tree rollouts' sizing, checks and advantages, case by case: each test
fails if the rule its docstring names is bent (the bracketed part says how), without starting a launcher."""
import json
import math

import numpy as np
import pytest

from engine.config import CurriculumConfig
from engine.curriculum import PromptCurriculum
from test_tree import prompts, tiny


def _cur(n=10, batch=4, seed=0, **kw) -> PromptCurriculum:
    return PromptCurriculum(CurriculumConfig(enabled=True, **kw), n, batch, seed)


# ----------------------------------------------------------------------------------------------- curriculum


def test_band_is_inclusive_at_both_ends():
    """Guards against (`rate <= hi` -> `rate < hi`): a pass rate exactly at either end of the band
    (4/5 = 0.8, 1/5 = 0.2) is in it, as CurriculumConfig.band documents ("inclusive")."""
    cur = _cur(n=4)
    cur.attempts[:] = 5
    cur.passes[:] = [1, 4, 0, 5]  # 0.2, 0.8 (both ends), 0, 1
    assert cur.in_band().tolist() == [True, True, False, False]


def test_unseen_share_is_rounded_half_up_not_floored():
    """Guards against (`floor(share * k + 0.5)` -> `floor(share * k)`): 6 prompts, batch 2, 3 tried:
    round(0.25 x 2) = 1 unseen prompt every step (what test_grpo's resume test expects: curriculum_unseen 0.5)."""
    cur = _cur(n=6, batch=2)
    cur.attempts[:3], cur.passes[:3] = 4, 2
    for step in range(1, 21):
        ids = cur.draw(step)
        assert len(ids) == 2 and int((cur.attempts[ids] == 0).sum()) == 1, (step, ids)
    # 0.25 x 6 = 1.5 -> 2 unseen
    big = _cur(n=20, batch=6)
    big.attempts[:10] = 4
    assert all(int((big.attempts[big.draw(s)] == 0).sum()) == 2 for s in range(1, 11))


def test_the_draw_depends_on_the_seed():
    """Guards against (the generator seeded by [_SALT, step], the run's seed ignored): two runs with
    different seeds draw different prompts at the same step; the same seed the same ones."""
    a, b, a2 = _cur(n=50, batch=8, seed=1), _cur(n=50, batch=8, seed=2), _cur(n=50, batch=8, seed=1)
    assert [a.draw(s).tolist() for s in range(1, 6)] == [a2.draw(s).tolist() for s in range(1, 6)]
    assert [a.draw(s).tolist() for s in range(1, 6)] != [b.draw(s).tolist() for s in range(1, 6)]


def test_unseen_prompts_are_not_always_at_the_front_of_the_draw():
    """Guards against (the final rng.permutation dropped): the draw is in a random order, so the unseen
    prompts (which rank 0's slice would otherwise always get) land at varying positions."""
    cur = _cur(n=100, batch=8)
    cur.attempts[50:], cur.passes[50:] = 4, 2
    firsts = set()
    for s in range(1, 41):
        ids = cur.draw(s)
        assert int((cur.attempts[ids] == 0).sum()) == 2
        firsts.add(tuple(np.flatnonzero(cur.attempts[ids] == 0).tolist()))
    assert firsts != {(0, 1)}, firsts
    assert len(firsts) > 5


def test_describe_reports_the_drawn_prompts_shares():
    """Guards against (curriculum_in_band computed over every prompt, not over the drawn ones)."""
    cur = _cur(n=10)
    cur.attempts[:] = [0, 0, 4, 4, 4, 4, 4, 4, 4, 4]
    cur.passes[:] = [0, 0, 2, 2, 0, 0, 0, 0, 0, 0]  # prompts 2, 3 in the band [0.2, 0.8]
    d = cur.describe(np.array([0, 2, 3, 4]))
    assert d == {"curriculum_unseen": 0.25, "curriculum_in_band": 0.5, "curriculum_tried": 0.8,
                 "curriculum_band_prompts": 2}


def _checkpoint(run_dir, state):
    from engine import checkpoint

    tag = "step_00000002"
    (checkpoint.ckpt_dir(run_dir) / tag).mkdir(parents=True)
    (checkpoint.ckpt_dir(run_dir) / "latest").write_text(tag)
    (checkpoint.ckpt_dir(run_dir) / tag / checkpoint.STATE_FILE).write_text(json.dumps(state))


def test_resume_preflight_names_a_prompt_count_mismatch(tmp_path):
    """Guards against (the n_prompts comparison of resume_problems broken): the checkpoint's statistics
    for 6 prompts against a prompts file of 7 is one problem; the same count, or the curriculum off, none."""
    from engine.curriculum import resume_problems

    _checkpoint(tmp_path, {"step": 2, "curriculum": _cur(n=6).state_dict()})
    on = CurriculumConfig(enabled=True)
    assert resume_problems(str(tmp_path), on, 7) == [
        "--resume: the checkpoint's grpo.curriculum statistics are for 6 prompts but data.path has 7; resume with "
        "the prompts file the run started with"]
    assert resume_problems(str(tmp_path), on, 6) == []
    assert resume_problems(str(tmp_path), CurriculumConfig(enabled=False), 7) == []


def test_for_run_restores_the_checkpoints_statistics():
    """Guards against (for_run ignores the saved statistics on --resume): the curriculum it builds
    holds the saved counts and draws what the saved one draws; without a checkpoint it starts empty."""
    from engine.curriculum import for_run

    c = CurriculumConfig(enabled=True)
    src = _cur(n=20, batch=4, seed=3)
    src.update([0, 0, 1, 1, 5, 5], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    state = json.loads(json.dumps(src.state_dict()))
    cur = for_run(c, 20, 4, 3, state)
    assert cur.state_dict() == src.state_dict()
    assert cur.draw(7).tolist() == src.draw(7).tolist()
    assert for_run(c, 20, 4, 3, None).attempts.sum() == 0
    assert for_run(CurriculumConfig(enabled=False), 20, 4, 3, state) is None


def test_band_prompts_counts_every_prompt_in_the_band_not_only_the_drawn_ones():
    """Guards against (curriculum_band_prompts counted over the drawn prompts): prompts 2 and 3 are in the band,
    a draw of 0, 2, 4 holds only one of them; the metric is how many are in the band now (2), the drawn share 1/3."""
    cur = _cur(n=10)
    cur.attempts[:] = [0, 0, 4, 4, 4, 4, 4, 4, 4, 4]
    cur.passes[:] = [0, 0, 2, 2, 0, 0, 0, 0, 0, 0]
    d = cur.describe(np.array([0, 2, 4]))
    assert d["curriculum_band_prompts"] == 2 and d["curriculum_in_band"] == pytest.approx(1 / 3)


def test_the_reward_sum_decays_with_the_counts_on_a_new_draw():
    """Guards against (reward_sum left out of the decay): the module doc's "earlier counts are first multiplied by
    decay" holds for all three statistics; decay 0.5: rewards 1 + 0.5, then 0.25 on the next draw: 1.5 x 0.5 + 0.25."""
    cur = _cur(n=3, decay=0.5)
    cur.update([0, 0], [1.0, 0.5])
    cur.update([0], [0.25])
    assert cur.reward_sum.tolist() == [1.0, 0.0, 0.0]
    assert cur.attempts.tolist() == [2.0, 0.0, 0.0] and cur.passes.tolist() == [0.5, 0.0, 0.0]  # 1 x 0.5 + 0


def test_update_from_ranks_applies_every_ranks_completions_once(monkeypatch):
    """Guards against (update_from_ranks applying only this rank's, or one rank's, part of the all-gather): as rank 1
    of 2 (torch.distributed faked: all_gather_object returns rank 0's part, then this rank's), the statistics are
    those of both ranks' completions, a prompt drawn on both ranks decayed once (decay 0.5, pass threshold 1)."""
    import torch
    import torch.distributed as dist

    from engine.curriculum import local_part

    rank0 = local_part([3, 4], np.array([1.0, 0.0, 1.0, 1.0]))  # prompt 3: 1 pass of 2; prompt 4: 2 of 2

    def all_gather_object(parts, obj):
        parts[:] = [rank0, obj]

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    cur = _cur(n=6, decay=0.5)
    cur.attempts[3], cur.passes[3] = 2.0, 2.0
    cur.update_from_ranks([5, 3], torch.tensor([0.0, 0.0, 1.0, 1.0]))  # this rank: prompt 5 0 of 2; prompt 3 2 of 2
    assert cur.attempts.tolist() == [0, 0, 0, 2 * 0.5 + 4, 2, 2]
    assert cur.passes.tolist() == [0, 0, 0, 2 * 0.5 + 3, 2, 0]


# ----------------------------------------------------------------------------------------------- tree


def _tiny_model():
    return tiny("qwen3_moe")  # test_tree's model helper, with Qwen3-MoE attention


_prompts = prompts  # test_tree's two prompts, the second left-padded


def test_cache_tokens_cover_every_decoding_phase_of_a_tree():
    """Guards against (cache_tokens = max_new_tokens x iterations, the chains' phase forgotten): with
    iterations 2 a tree decodes 3 phases, so a decoder sized prompt + cache_tokens must hold the whole rollout
    (no EOS: every path runs to max_new_tokens)."""
    from engine.config import GRPOConfig, TreeConfig
    from engine.decoder import Decoder
    from engine.tree import cache_tokens, generate_tree

    tree = TreeConfig(enabled=True, trees=1, branch_points=1, branches=1, iterations=2)
    g = GRPOConfig(max_new_tokens=6, tree=tree)
    assert cache_tokens(g) == 6 * 3
    assert cache_tokens(GRPOConfig(max_new_tokens=6)) == 6  # chains only
    ids, mask = _prompts()
    dec = Decoder(_tiny_model(), "cpu", batch_size=2 * tree.leaves(), cache_len=7 + cache_tokens(g))
    out, info = generate_tree(dec, ids, mask, tree, 6, eos_id=-1, pad_id=0, temperature=0)
    assert out.shape == (2 * tree.leaves(), 7 + 6) and info.lengths == [6] * (2 * tree.leaves())


def test_tree_preflight_wants_whole_trees_per_rank():
    """Guards against (the per_rank % leaves check dropped): 2 x (1 + 1 x 1 x 1) = 4 leaves do not divide a
    rank's 6 sequences; they do divide 8; too many leaves is the other message; off is no problem."""
    from engine.config import GRPOConfig, TreeConfig
    from engine.tree import group_problems

    g = GRPOConfig(tree=TreeConfig(enabled=True, trees=2, branches=1))
    assert group_problems(g, 6, "local") == [
        "grpo.tree: 2 trees x (1 + 1 iterations x 1 branch_points x 1 branches) = 4 leaves per prompt must divide "
        "train_micro_batch_size_per_gpu x gradient_accumulation_steps (6): each rank's batch is whole trees"]
    assert group_problems(g, 8, "local") == [] and group_problems(g, 4, "auto") == []
    assert len(group_problems(g, 3, "local")) == 1 and "exceed" in group_problems(g, 3, "local")[0]
    assert group_problems(GRPOConfig(), 6, "engine") == []


def test_a_source_listed_after_its_branch_is_refused():
    """Guards against (`p < c and` dropped from shared_leaves' check): a leaf whose source comes after it (or
    is itself) is a malformed tree, refused even when the starts look fine."""
    from engine.tree import shared_leaves

    with pytest.raises(ValueError, match="leaf 0 branches from leaf 1 at offset 0"):
        shared_leaves([1, -1], [0, 0], [2, 2])
    with pytest.raises(ValueError, match="leaf 0 branches from leaf 0"):
        shared_leaves([0], [0], [2])


def test_normalize_std_in_a_group_of_two_divides_by_its_std():
    """Guards against (`if G > 1` -> `if G > 2`: a 2-leaf group's std taken as 0, advantages x 1e6): rewards
    1, 0 have std sqrt(1/2) (Bessel), so the lone chains get +-2 x 0.5 / (std + 1e-6)."""
    from engine.tree import token_advantages

    s = math.sqrt(0.5) + 1e-6
    got = token_advantages([-1, -1], [0, 0], [2, 1], [1.0, 0.0], normalize_std=True)
    assert got[0] == pytest.approx([1 / s, 1 / s], abs=1e-9) and got[1] == pytest.approx([-1 / s], abs=1e-9)
    # one leaf: no spread, reward units (std 0)
    assert token_advantages([-1], [0], [1], [1.0], normalize_std=True) == [[0.0]]


def _first_own_token_first(pick_branch_points):
    """A branch-point policy: the real pick_branch_points on fake entropies that peak at each branch's first own token
    (a chain's at offset 2; elsewhere falling with the offset), so the only thing keeping a new path's first token
    from being picked again is generate_tree's `branched` set."""
    def pick(entropy, starts, n, branched, window=None):
        fake = [[10.0 if k == (s if s > 0 else 2) else 1.0 / (1 + k) for k in range(len(e))]
                for e, s in zip(entropy, starts)]  # a chain peaks at offset 2
        return pick_branch_points(fake, starts, n, branched, window)
    return pick


def test_a_new_paths_first_token_is_never_branched_from_again():
    """Guards against (`branched.add((d, k))` dropped): a branch's first token resamples the distribution its
    source's token k was drawn from, which is already branched; a later iteration must not branch there again."""
    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import generate_tree, pick_branch_points

    cfg = TreeConfig(enabled=True, trees=1, branch_points=1, branches=1, iterations=2)
    G, new = cfg.leaves(), 6
    ids, mask = _prompts()
    dec = Decoder(_tiny_model(), "cpu", batch_size=2 * G, cache_len=7 + new * 3)
    out, info = generate_tree(dec, ids, mask, cfg, new, eos_id=-1, pad_id=0, temperature=0,
                              pick=_first_own_token_first(pick_branch_points))
    assert len(info.branch_points) == 2 * cfg.iterations
    for row, k in info.branch_points:
        i = row % G
        assert not (info.parents[i] >= 0 and k == info.starts[i]), (row, k, info.parents, info.starts)
    assert len(set(info.branch_points)) == len(info.branch_points)
    assert info.starts[:G] == [0, 2, 0], info.starts  # iteration 1 branched the chain at 2, iteration 2 not again


def test_segment_len_confines_each_iteration_to_its_window():
    """Guards against (the window's end one token late: [(t-1) L, t L + 1)): with segment_len 2, iteration 1
    branches only at offsets 0-1 and iteration 2 only at 2-3, even when the highest entropy is just past the end."""
    first, second = _two_window_tree(lambda k: 10.0 if k in (2, 4) else 1.0 / (1 + k), new=8)
    assert all(0 <= k < 2 for _, k in first), (first, second)
    assert all(2 <= k < 4 for _, k in second), (first, second)


def _two_window_tree(entropy_at, new: int):
    """A greedy tree rollout of the 2 test prompts (1 tree, 1 branch point a window, 2 iterations, segment_len 2)
    whose entropy at response offset k is entropy_at(k): the branch points of iterations 1 and 2 (one per prompt)."""
    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import generate_tree, pick_branch_points

    def pick(entropy, starts, n, branched, window=None):
        fake = [[entropy_at(k) for k in range(len(e))] for e in entropy]
        return pick_branch_points(fake, starts, n, branched, window)

    cfg = TreeConfig(enabled=True, trees=1, branch_points=1, branches=1, iterations=2, segment_len=2)
    ids, mask = _prompts()
    dec = Decoder(_tiny_model(), "cpu", batch_size=2 * cfg.leaves(), cache_len=7 + new * 3)
    _, info = generate_tree(dec, ids, mask, cfg, new, eos_id=-1, pad_id=0, temperature=0, pick=pick)
    return info.branch_points[:2], info.branch_points[2:]  # 2 prompts x 1 tree x 1 point per iteration


def test_tree_info_parents_are_group_local_for_every_prompt():
    """Guards against (TreeInfo.parents left as batch rows, not `% G`): with 2 prompts the second prompt's
    parents must index its own group (what advantages() slices per group), so its advantages equal those of the
    first prompt's structure computed the same way."""
    import torch

    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import advantages, generate_tree, token_advantages

    cfg = TreeConfig(enabled=True, trees=1, branch_points=1, branches=2, iterations=1)
    G, new = cfg.leaves(), 5
    ids, mask = _prompts()
    dec = Decoder(_tiny_model(), "cpu", batch_size=2 * G, cache_len=7 + new * 2)
    out, info = generate_tree(dec, ids, mask, cfg, new, eos_id=-1, pad_id=0, temperature=0)
    assert all(-1 <= p < G for p in info.parents), info.parents
    assert info.parents[:G] == info.parents[G:] == [-1, 0, 0]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
    adv = advantages(info, rewards, 7, out.shape[1] - 1, normalize_std=False)
    for j in range(2):
        want = token_advantages(info.parents[j * G:(j + 1) * G], info.starts[j * G:(j + 1) * G],
                                info.lengths[j * G:(j + 1) * G], rewards[j * G:(j + 1) * G].tolist())
        for i, a in enumerate(want):
            torch.testing.assert_close(adv[j * G + i, 6:6 + len(a)], torch.tensor(a, dtype=torch.float32))


def test_a_chain_of_three_forks_shares_each_prefix_with_every_leaf_below_it():
    """Guards against (shared_leaves' subtree sets built sources first, so a leaf's set misses its grandchildren's
    branches): leaf 1 branched from leaf 0 at offset 1, leaf 2 from leaf 1 at 2, leaf 3 from leaf 2 at 3 (4 tokens
    each, one tree). Offset 0 is every leaf's, offset 1 of leaf 1 is leaves 1-3's, offset 2 of leaf 2 leaves 2-3's.
    Rewards 0, 1, 0, 1: V(all) = 1/2, V{1,2,3} = 2/3, V{2,3} = 1/2; (GA + LA) / sqrt(|leaves|) by hand."""
    from engine.tree import shared_leaves, token_advantages

    parents, starts, lengths = [-1, 0, 1, 2], [0, 1, 2, 3], [4, 4, 4, 4]
    every, l123, l23 = 0b1111, 0b1110, 0b1100
    assert shared_leaves(parents, starts, lengths) == [[every, 0b0001, 0b0001, 0b0001],
                                                       [every, l123, 0b0010, 0b0010],
                                                       [every, l123, l23, 0b0100],
                                                       [every, l123, l23, 0b1000]]
    root = 0.0  # the all-leaves node is the root itself: GA = LA = 0
    n123 = 2 * (2 / 3 - 1 / 2) / math.sqrt(3)
    n23 = ((1 / 2 - 1 / 2) + (1 / 2 - 2 / 3)) / math.sqrt(2)
    want = [[root, -1.0, -1.0, -1.0],  # {0}: V 0, parent the root: (0 - 1/2) x 2
            [root, n123, 5 / 6, 5 / 6],  # {1}: V 1, parent {1,2,3}: (1 - 1/2) + (1 - 2/3)
            [root, n123, n23, -1.0],  # {2}: V 0, parent {2,3}: (0 - 1/2) + (0 - 1/2)
            [root, n123, n23, 1.0]]  # {3}: V 1, parent {2,3}: (1 - 1/2) + (1 - 1/2)
    got = token_advantages(parents, starts, lengths, [0.0, 1.0, 0.0, 1.0])
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-12)


def test_segment_len_starts_each_iteration_at_its_window():
    """Guards against (the window's start dropped: [0, t L)): with segment_len 2 the second iteration branches only
    at offsets 2-3, even where an unbranched offset before the window (the chain's offset 0, left by the first
    iteration, which took offset 1) has the highest entropy."""
    first, second = _two_window_tree(lambda k: {0: 9.0, 1: 10.0}.get(k, 1.0 / (1 + k)), new=6)
    assert [k for _, k in first] == [1, 1], (first, second)
    assert all(2 <= k < 4 for _, k in second), (first, second)

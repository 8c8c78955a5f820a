"""Tree rollouts (grpo.tree, engine/tree.py): branch points, forked KV-cache rows, prefix reuse, TreeRL's advantages,
bad input, and one GRPO run with trees (what its loss trains on).

The decoder tests use the real persistent Decoder (engine/decoder.py) on a tiny random model on the CPU, eagerly;
the compiled CUDA step runs the same calls with the same fixed shapes."""
import json
import math

import pytest
import torch

from conftest import ROOT, read_metrics, run_in_process

TINY = (ROOT / "engine" / "recipes" / "grpo_tiny.yaml").read_text()
ZERO3_GRPO = ROOT / "tests" / "zero3_grpo_16x4.json"  # the shipped zero3_grpo.json with its batch written: 16 x 4


@pytest.fixture(autouse=True)
def no_zero3_from_earlier_tests(monkeypatch):
    """As in tests/test_rollout.py: a DeepSpeed engine trained earlier in this process keeps transformers' ZeRO-3
    flag alive; the plain models built here must not be partitioned by it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)


# ------------------------------------------------------------------------------------- pure bookkeeping

def test_branch_points_are_the_highest_entropy_positions():
    from engine.tree import pick_branch_points

    entropy = [[0.1, 0.9, 0.5, 0.7, 3.0],  # path 0, a chain: its last token (3.0) is never a branch point
               [0.1, 0.9, 2.0, 0.2, 0.8, 5.0],  # path 1 branched from 0 at offset 2: offsets 0-1 are path 0's
               [0.6, 0.6]]  # path 2, a chain of two tokens: only offset 0
    starts = [0, 2, 0]
    assert pick_branch_points(entropy, starts, 3, set()) == [(1, 2), (0, 1), (1, 4)]
    # (1, 2) already branched: the next four by entropy
    assert pick_branch_points(entropy, starts, 4, {(1, 2)}) == [(0, 1), (1, 4), (0, 3), (2, 0)]
    # a window [2, 4): offsets 2 and 3 only
    assert pick_branch_points(entropy, starts, 5, set(), window=(2, 4)) == [(1, 2), (0, 3), (0, 2), (1, 3)]
    # equal entropies: the earlier path, then the earlier offset
    assert pick_branch_points([[1.0, 1.0, 1.0], [1.0, 1.0]], [0, 0], 3, set()) == [(0, 0), (0, 1), (1, 0)]
    assert pick_branch_points([[1.0]], [0], 2, set()) == []  # one token: nothing to branch from


# A hand-built group of 4 leaves (rewards 1, 0, 1, 0), two trees:
#   leaf 0: a chain of 5 tokens; leaf 1 branched from leaf 0 at offset 2 (4 tokens); leaf 2 from leaf 1 at offset 3
#   (5 tokens); leaf 3: the second tree's chain (3 tokens).
# Nodes (leaves below, V): root {0,1,2,3} 1/2; a = leaf 0 [0,2) {0,1,2} 2/3; b = leaf 0 [2,5) {0} 1 (parent a);
# c = leaf 1 [2,3) {1,2} 1/2 (parent a); d = leaf 1 [3,4) {1} 0 (parent c); e = leaf 2 [3,5) {2} 1 (parent c);
# f = leaf 3 [0,3) {3} 0 (parent root). A = (V - V_root + V - V_parent) / sqrt(|leaves|):
A = (2 / 3 - 1 / 2 + 2 / 3 - 1 / 2) / math.sqrt(3)  # 0.19245
B = (1 - 1 / 2) + (1 - 2 / 3)  # 0.8333
C = ((1 / 2 - 1 / 2) + (1 / 2 - 2 / 3)) / math.sqrt(2)  # -0.11785
D = (0 - 1 / 2) + (0 - 1 / 2)  # -1
E = (1 - 1 / 2) + (1 - 1 / 2)  # 1
F = (0 - 1 / 2) + (0 - 1 / 2)  # -1
HAND = {"parents": [-1, 0, 1, -1], "starts": [0, 2, 3, 0], "lengths": [5, 4, 5, 3], "rewards": [1.0, 0.0, 1.0, 0.0]}
HAND_ADV = [[A, A, B, B, B], [A, A, C, D], [A, A, C, E, E], [F, F, F]]


def test_advantages_of_a_hand_built_tree_equal_the_hand_computed_values():
    from engine.tree import shared_leaves, token_advantages

    sets = shared_leaves(HAND["parents"], HAND["starts"], HAND["lengths"])
    assert sets == [[0b0111, 0b0111, 0b0001, 0b0001, 0b0001], [0b0111, 0b0111, 0b0110, 0b0010],
                    [0b0111, 0b0111, 0b0110, 0b0100, 0b0100], [0b1000] * 3]
    got = token_advantages(**HAND)
    for g, h in zip(got, HAND_ADV):
        assert g == pytest.approx(h, abs=1e-12)
    std = math.sqrt(1 / 3)  # rewards 1, 0, 1, 0 with Bessel's correction, as group_advantages
    for g, h in zip(token_advantages(**HAND, normalize_std=True), HAND_ADV):
        assert g == pytest.approx([x / (std + 1e-6) for x in h], abs=1e-9)
    # A leaf never branched from, alone in its tree: 2 (r - mean), GRPO's advantage twice.
    assert token_advantages([-1, -1], [0, 0], [2, 1], [1.0, 0.0]) == [[1.0, 1.0], [-1.0]]


def test_tree_advantages_line_up_with_the_loss_targets():
    """engine/tree.py advantages: response token k of a row is target p_len - 1 + k of ids[:, 1:]; 0 elsewhere."""
    from engine.tree import TreeInfo, advantages

    info = TreeInfo(4, HAND["parents"], HAND["starts"], HAND["lengths"], [], {}, 0, [])
    p_len, width = 3, 3 + 5 - 1
    adv = advantages(info, torch.tensor(HAND["rewards"]), p_len, width, normalize_std=False)
    assert adv.shape == (4, width)
    for i, h in enumerate(HAND_ADV):
        assert adv[i, : p_len - 1].abs().sum() == 0
        torch.testing.assert_close(adv[i, p_len - 1: p_len - 1 + len(h)], torch.tensor(h, dtype=torch.float32))
        assert adv[i, p_len - 1 + len(h):].abs().sum() == 0


def test_a_branch_must_come_after_its_source():
    from engine.tree import shared_leaves

    with pytest.raises(ValueError, match="leaf 1 branches from leaf 0 at offset 0"):
        shared_leaves([-1, 0], [1, 0], [3, 3])


# ------------------------------------------------------------------------------------- the real decoder

def tiny(arch: str = "deepseek_v3"):
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.model import make_hf_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_hf_config(ModelConfig(arch=arch))).eval()


def prompts():
    ids = torch.randint(1, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is left-padded
    return ids, mask


def full_forward_entropy(model, prompt_ids, prompt_mask, tokens) -> torch.Tensor:
    """Entropy of each response token's distribution from one plain forward over prompt + tokens (no cache)."""
    from engine.grpo_math import token_entropy

    ids = torch.cat([prompt_ids, torch.tensor(tokens)])[None]
    mask = torch.cat([prompt_mask, torch.ones(len(tokens), dtype=torch.long)])[None]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0].float()
    return token_entropy(logits[prompt_ids.shape[0] - 1: -1])


def deepest_first(entropy, starts, n, branched, window=None):  # noqa: ARG001
    """A test's branch-point policy: the newest path, at its own first token (the fork then copies the slots
    before the token its source re-fed) and two tokens later; a chain at offset 3 and 5."""
    i = len(starts) - 1
    k = starts[i] if starts[i] > 0 else 3
    return [(i, k), (i, k + 2)][:n]


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_forked_rows_continue_exactly_as_their_source(arch):
    """Greedy: a branch resamples its branch token from the same prefix, so each forked row must decode what its
    source did. Three iterations that always fork the newest path: forks of forks of forks, some at the first
    token of a forked path (its prefix then spans its source's slots and the re-fed token's). The chains also equal
    Decoder.generate's greedy tokens. DeepSeek-V3's cache holds MLA's latent and rope key; Qwen3's K and V."""
    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import generate_tree

    model = tiny(arch)
    ids, mask = prompts()
    cfg = TreeConfig(enabled=True, trees=2, branch_points=2, branches=1, iterations=3)
    G, new = cfg.leaves(), 12
    dec = Decoder(model, "cpu", batch_size=2 * G, cache_len=7 + new * 4)
    out, info = generate_tree(dec, ids, mask, cfg, new, eos_id=-1, pad_id=0, temperature=0, pick=deepest_first)
    assert out.shape == (2 * G, 7 + new)
    depth = [0] * G
    for i in range(G):
        depth[i] = 0 if info.parents[i] < 0 else depth[info.parents[i]] + 1
    assert max(depth) == 3, info.parents
    assert any(info.starts[i] == info.starts[info.parents[i]] for i in range(G) if depth[i] > 1), info.starts
    chains = dec.generate(ids, mask, new, eos_id=-1, pad_id=0, temperature=0)
    for j in range(2):
        for i in range(G):
            assert torch.equal(out[j * G + i], chains[j]), (j, i, info.parents, info.starts)


def test_sampled_leaves_are_what_a_full_forward_of_their_tokens_gives():
    """With sampling, every leaf (forks of forks included) must be decoded against exactly its own prefix: the
    entropy each of its tokens was drawn with equals the entropy of a plain forward over prompt + leaf tokens.
    And the first iteration branched at each tree's highest-entropy token of that forward (not its last)."""
    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import generate_tree

    model = tiny()
    ids, mask = prompts()
    cfg = TreeConfig(enabled=True, trees=2, branch_points=1, branches=2, iterations=2)
    G, new = cfg.leaves(), 10
    dec = Decoder(model, "cpu", batch_size=2 * G, cache_len=7 + new * 3)
    torch.manual_seed(3)
    out, info = generate_tree(dec, ids, mask, cfg, new, eos_id=-1, pad_id=0, temperature=1.0)
    assert len({tuple(r.tolist()) for r in out}) > 2 * cfg.trees  # the branches sampled something new
    assert any(info.parents[p] >= 0 for p in info.parents if p >= 0), info.parents  # forks of forks too (seeded)
    for row in range(2 * G):
        j = row // G
        tokens = out[row, 7: 7 + info.lengths[row]].tolist()
        want = full_forward_entropy(model, ids[j][mask[j] > 0], mask[j][mask[j] > 0], tokens)
        torch.testing.assert_close(torch.tensor(info.entropy[row]), want, rtol=0, atol=1e-4)
        if info.parents[row] == -1:  # a tree's chain: its first branch point is its argmax but the last token
            assert info.branch_points[j * cfg.trees + row % G] == (row, int(want[:-1].argmax()))


def test_paths_that_end_at_once_leave_branches_to_start_from_the_prompt():
    """EOS as the first token: a one-token path has no branch point (its last token never is), so every branch of
    that tree starts from the prompt (offset 0: the fork copies the prompt's slots and re-feeds its last token),
    and every row of the batch still becomes a leaf."""
    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import generate_tree

    model = tiny()
    ids, mask = prompts()
    cfg = TreeConfig(enabled=True, trees=1, branch_points=2, branches=1, iterations=2)
    G = cfg.leaves()
    dec = Decoder(model, "cpu", batch_size=2 * G, cache_len=7 + 6 * 3)
    eos = int(dec.generate(ids[:1], mask[:1], 1, eos_id=-1, pad_id=0, temperature=0)[0, -1])  # prompt 0's first token
    out, info = generate_tree(dec, ids, mask, cfg, 6, eos_id=eos, pad_id=0, temperature=0)
    assert info.lengths[:G] == [1] * G and out[:G, 7].tolist() == [eos] * G
    assert info.starts[:G] == [0] * G and info.parents[:G] == [-1, 0, 0, 0, 0]
    assert [bp for bp in info.branch_points if bp[0] < G] == [(0, 0)] * 4
    assert sorted(set(r // G for r, _ in info.branch_points)) == [0, 1]


def test_prefix_reuse_decodes_fewer_tokens_than_the_same_leaves_as_independent_chains():
    """Count the decoder's work: the tree's leaves (2 prompts x 9 leaves of 12 tokens) against the same 18 leaves
    generated as independent chains (Decoder.generate, no EOS so every leaf is 12 tokens either way)."""
    from engine.config import TreeConfig
    from engine.decoder import Decoder
    from engine.tree import generate_tree

    model = tiny()
    ids, mask = prompts()
    cfg = TreeConfig(enabled=True, trees=1, branch_points=2, branches=2, iterations=2)
    G, new = cfg.leaves(), 12
    dec = Decoder(model, "cpu", batch_size=2 * G, cache_len=7 + new * 3)
    torch.manual_seed(0)
    out, info = generate_tree(dec, ids, mask, cfg, new, eos_id=-1, pad_id=0)
    tree = dict(dec.counts)
    assert info.lengths == [new] * (2 * G)
    # The counters are what the structure says: each chain samples `new` tokens and feeds back all but its last; a
    # branch at offset k samples new - k and feeds new - k (the prefix's last token again, then its own but last).
    ks = [info.starts[i] for i in range(2 * G) if info.parents[i] >= 0]
    assert tree["sampled_tokens"] == info.generated_tokens == 2 * new + sum(new - k for k in ks)
    assert tree["decoded_tokens"] == 2 * (new - 1) + sum(new - k for k in ks)
    assert tree["forks"] == len(ks) == 2 * cfg.iterations * cfg.branch_points * cfg.branches
    assert tree["prefill_tokens"] == int(mask.sum())  # one chain per prompt prefilled; forks copy it

    dec.reset_counts()
    dec.generate(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), new, eos_id=-1, pad_id=0)
    chains = dict(dec.counts)
    assert chains["sampled_tokens"] == sum(info.lengths) == 2 * G * new  # the same leaves, every token decoded
    assert chains["decoded_tokens"] == 2 * G * (new - 1)
    assert chains["prefill_tokens"] == G * int(mask.sum())
    assert tree["sampled_tokens"] < chains["sampled_tokens"], (tree, chains, ks)
    assert tree["decoded_tokens"] < chains["decoded_tokens"], (tree, chains, ks)
    print(f"tree {tree}, independent chains {chains}, branch offsets {ks}")


# ------------------------------------------------------------------------------------------- bad input

def grpo_cli(tmp_path, capfd, monkeypatch, recipe: str, ds=ZERO3_GRPO):
    import engine.grpo
    import engine.pretrain

    def no_work(*a, **k):
        raise AssertionError("got past the checks to init_distributed (bad input was let through)")

    monkeypatch.setattr(engine.pretrain, "init_distributed", no_work)  # engine.grpo joins through it
    (tmp_path / "recipe.yaml").write_text(recipe.replace("grpo:\n", "grpo:\n  allow_random_init: true\n", 1))
    return run_in_process(engine.grpo.main, ["--deepspeed_config", ds, "--config", tmp_path / "recipe.yaml",
                                             "--run_dir", tmp_path / "run"], capfd, monkeypatch, cwd=ROOT,
                          RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_SIZE=1)


def with_tree(tree: str, max_new: int | None = None) -> str:
    recipe = TINY.replace("  eval_path: engine/assets/arith_eval.jsonl", f"  tree: {tree}\n  eval_path: engine/assets/arith_eval.jsonl")
    if max_new is not None:
        recipe = recipe.replace("max_new_tokens: 4", f"max_new_tokens: {max_new}")
    assert recipe != TINY
    return recipe


@pytest.mark.parametrize("tree, max_new, message", [
    ("{enabled: true, iterations: 2, segment_len: 2}", 4,
     "grpo.tree: iterations x segment_len = 2 x 2 = 4 response tokens to branch in, but a path of "
     "grpo.max_new_tokens 4 has at most 3 (its last token is never a branch point); lower iterations or "
     "segment_len, or raise max_new_tokens"),
    ("{enabled: true}", 1, "grpo.tree needs grpo.max_new_tokens >= 2, got 1: a path's last token is never a branch point"),
    ("{enabled: true, branches: 0}", None, "grpo.tree.branches (0) must be >= 1: new paths from each branch point"),
    ("{enabled: true, trees: 0}", None, "grpo.tree.trees (0) must be >= 1: chains sampled per prompt"),
])
def test_a_tree_that_cannot_be_built_is_one_line_and_exit_2(tmp_path, capfd, monkeypatch, tree, max_new, message):
    p = grpo_cli(tmp_path, capfd, monkeypatch, with_tree(tree, max_new))
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [f"error: recipe {tmp_path / 'recipe.yaml'}: {message}"], p.stderr
    assert not (tmp_path / "run").exists()


def test_more_leaves_than_the_decoder_batch_is_one_line_and_exit_2(tmp_path, capfd, monkeypatch):
    """zero3_grpo.json: 16 x 4 = 64 sequences per rank; 8 trees x (1 + 1 x 1 x 8) = 72 leaves per prompt."""
    p = grpo_cli(tmp_path, capfd, monkeypatch, with_tree("{enabled: true, trees: 8, branches: 8}"))
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if not line.startswith("Generating train split")]
    assert lines == [
        "error: grpo.tree: 8 trees x (1 + 1 iterations x 1 branch_points x 8 branches) = 72 leaves per prompt exceed "
        "the rollout decoder's batch of 64 sequences per rank (train_micro_batch_size_per_gpu x "
        "gradient_accumulation_steps of the DS config), which holds a prompt's whole tree; raise those, or lower "
        "grpo.tree's trees, iterations, branch_points or branches"], p.stderr
    assert not (tmp_path / "run").exists()


def test_tree_rollouts_refuse_the_engine_rollout(tmp_path, capfd, monkeypatch):
    p = grpo_cli(tmp_path, capfd, monkeypatch, with_tree("{enabled: true}").replace("  beta: 0.04", "  beta: 0.04\n  rollout: engine"))
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines()[-1] == ("error: grpo.tree needs grpo.rollout local or auto (tree rollouts fork rows "
                                         "of the local decoder's KV cache), not engine"), p.stderr


# --------------------------------------------------------------------------------------- a GRPO run with trees

from test_grpo import grpo_ds, run_launcher  # noqa: E402  (conftest's `pretrained`: test_grpo's run)


TREE_PROBE = ROOT / "tests" / "scripts" / "tree_probe.py"  # bin/grpo.py, recording what score and the loss see


def test_grpo_with_tree_rollouts_trains_on_the_trees(pretrained):
    """bin/grpo.py on 1 rank, 2 steps, the pretrained tiny model: 1 prompt x (2 trees x (1 + 1 x 1 x 1)) = 4 leaves
    per step (micro-batch 4). What only tree rollouts give, checked where GRPO uses them (engine/grpo.py:
    generate_rollouts -> score -> policy_update; tests/scripts/tree_probe.py records them): the loss trains on 4
    leaves per prompt, 2 chains and a branch of each, every branch starting with its source's tokens; the metric
    counts those shared tokens once; and the advantages the loss gets are TreeRL's, per token: the same on a
    shared prefix in both leaves, and changing along a path where it branched."""
    from engine.tree import token_advantages

    d = pretrained / "tree"
    d.mkdir()
    (d / "grpo.yaml").write_text(f"""
data: {{path: {pretrained / 'prompts.jsonl'}}}
train: {{max_steps: 2, lr: 1.0e-3, warmup_steps: 0, log_every: 1}}
grpo: {{max_new_tokens: 8, temperature: 1.0, beta: 0.04, tree: {{enabled: true, trees: 2, branches: 1}},
       routing_replay: r3, rewards: [{{name: numeric, which: first}}, {{name: length_penalty, target: 3, scale: 0.1}}]}}
checkpoint: {{at_end: false}}
""")
    run_launcher(1, TREE_PROBE, "--out", d / "out", "--deepspeed_config", grpo_ds(d / "ds.json", True), "--config",
                 d / "grpo.yaml", "--init_from", pretrained / "hf", "--run_dir", d / "run", cwd=d)
    rows = read_metrics(d / "run")
    seen = json.loads((d / "out" / "rank0.json").read_text())
    assert seen["rc"] == 0 and [r["step"] for r in rows] == [s["step"] for s in seen["steps"]] == [1, 2]
    shared_total, varying = 0, 0
    for r, s in zip(rows, seen["steps"]):
        assert math.isfinite(r["loss"]) and math.isfinite(r["kl"]), r
        # r3 on trees: every token (shared prefixes too) went to the experts the decoder recorded; fp32, so the
        # live routers would have chosen the same
        assert r["routing_agree_choice"] == 1.0 and r["routing_live_agree_token"] > 0.99, r
        t, p_len = s["tree"], s["p_len"]
        assert t is not None, "the loss got rollouts without a tree"
        ids, adv, mask = torch.tensor(s["ids"]), torch.tensor(s["adv"]), torch.tensor(s["resp_mask"])
        # 4 leaves: each tree's chain (rows 0 and 1) and one branch from it (rows 2 and 3)
        assert t["group"] == 4 and len(ids) == 4 and t["parents"] == [-1, -1, 0, 1], t
        for i in (2, 3):
            src, k = t["parents"][i], t["starts"][i]
            assert ids[i, p_len: p_len + k].tolist() == ids[src, p_len: p_len + k].tolist(), (i, k, ids)
        # generated tokens count each branch's shared prefix once: sum over leaves of (length - start)
        own = sum(n - k for n, k in zip(t["lengths"], t["starts"]))
        assert r["generated_tokens"] == t["generated_tokens"] == own, (r["generated_tokens"], t)
        shared_total += sum(t["starts"])
        # per-token advantages, aligned with the loss's targets ids[:, 1:], TreeRL's values for these rewards
        assert s["score_adv_shape"] == list(adv.shape) == [4, ids.shape[1] - 1], (s["score_adv_shape"], adv.shape)
        want = token_advantages(t["parents"], t["starts"], t["lengths"], s["reward"], s["normalize_std"])
        for i, a in enumerate(want):
            torch.testing.assert_close(adv[i, p_len - 1: p_len - 1 + len(a)], torch.tensor(a), rtol=0, atol=1e-6)
            assert adv[i, : p_len - 1].abs().sum() == 0 and adv[i, p_len - 1 + len(a):].abs().sum() == 0
            assert mask[i, p_len - 1: p_len - 1 + len(a)].all(), (i, mask[i])
        for i in (2, 3):  # a shared prefix is one node: the same advantage in both leaves; then the branch's own
            src, k = t["parents"][i], t["starts"][i]
            assert torch.equal(adv[i, p_len - 1: p_len - 1 + k], adv[src, p_len - 1: p_len - 1 + k])
            path = adv[i, p_len - 1: p_len - 1 + t["lengths"][i]]
            varying += int(k > 0 and len(set(path.tolist())) > 1)
    # (seeded run) branches after their first token, so prefixes were shared, and advantages changed along a path
    assert shared_total > 0 and varying > 0, seen["steps"]
    print(json.dumps(rows))


def test_a_row_left_idle_by_a_decode_phase_never_sees_its_slots():
    """Every decode step runs all rows at one shared cache slot; the rows a continue_rows call leaves out write K/V
    of pad inputs there, which they must never see. A row left idle while the other decodes 5 tokens, then decoding
    on its own, gives the tokens and entropies it gives with no such phase before it. [fails if: the mask opens a
    decode step's slot to the rows that took no part in it]"""
    from engine.decoder import Decoder

    model = tiny()
    ids, mask = prompts()
    got = []
    for phase_first in (False, True):
        dec = Decoder(model, "cpu", batch_size=2, cache_len=7 + 12)
        dec.prefill(ids, mask)
        if phase_first:
            dec.continue_rows([0], [5], eos_id=-1, pad_id=0, temperature=0)
        # row 1 (3 pad slots, 4 prompt tokens at positions 0-3) fed token 17 at position 4, then 5 greedy tokens
        got.append(dec.continue_rows([1], [5], eos_id=-1, pad_id=0, temperature=0, feed=([17], [4]))[:2])
    (tok, ent), (tok_after, ent_after) = got
    assert torch.equal(tok_after, tok), (tok, tok_after)
    torch.testing.assert_close(ent_after, ent, atol=1e-5, rtol=0)

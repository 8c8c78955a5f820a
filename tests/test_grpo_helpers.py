"""engine/grpo.py's and engine/rewards.py's small helpers against values worked out by hand: left padding, the
completion text, the row statistics, the group and batch arithmetic, and two rewards' edges. Each case was a change
to the code that every fast test let through."""
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT  # noqa: F401  (puts the project on sys.path)
from engine.config import GRPOConfig, TreeConfig

TOKENIZER = str(ROOT / "engine" / "assets" / "tokenizer")


def tok():
    from engine.data import load_tokenizer

    return load_tokenizer(TOKENIZER)


def test_left_padding_puts_each_prompt_at_the_right_end():
    from engine.grpo import left_pad

    t = tok()
    texts = ["Q: 2 + 2 = ? A:", "Q: what is 17 + 25? A:", "Hi"]
    req = left_pad(texts, t, "cpu")
    enc = [t(x)["input_ids"] for x in texts]
    width = max(map(len, enc))
    for i, e in enumerate(enc):
        assert req.prompt_attention_mask[i].tolist() == [0] * (width - len(e)) + [1] * len(e)
        assert req.prompt_ids[i, width - len(e):].tolist() == e
        assert (req.prompt_ids[i, :width - len(e)] == t.pad_token_id).all()


def test_the_completion_is_the_response_up_to_its_first_eos():
    from engine.grpo import completions

    t = tok()
    p = t("Q: 2 + 2 = ? A:")["input_ids"]
    r = t(" 4 done", add_special_tokens=False)["input_ids"]
    eos = t.eos_token_id
    ids = torch.tensor([p + r + [eos, eos]])
    mask = torch.tensor([[1] * (len(p) + len(r) + 1) + [0]])
    batch = SimpleNamespace(input_ids=ids, attention_mask=mask, response_start_idx=torch.tensor([len(p)]))
    assert completions(batch, t) == [t.decode(r)]


def test_row_statistics_loss_per_micro_batch_the_rest_per_token():
    """The loss is the mean over micro-batches (3 of them: 3 / 3); the others are token means (KL 2 over 10)."""
    from engine.grpo import loss_stats

    assert loss_stats({"loss": 3.0, "tokens": 10.0, "kl": 2.0}, 3) == pytest.approx({"loss": 1.0, "kl": 0.2})


def test_a_trees_group_is_its_leaves_and_auto_fills_whole_groups():
    from engine.grpo import group_of, grpo_batch

    tree = GRPOConfig(group_size=8, tree=TreeConfig(enabled=True, trees=2, branches=2))
    assert group_of(tree) == tree.tree.leaves() == 6  # 2 trees x (1 + 1 branch point x 2 branches)
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    assert grpo_batch(auto, GRPOConfig(group_size=6), "x")[0] == 60  # 64 // 6 = 10 whole groups of 6


def test_reward_edges():
    from engine.rewards import exact_match, numeric

    assert numeric("p", "x = 0.5", 0.25, tolerance=0.25) == 1.0  # a difference equal to the tolerance is within it
    assert numeric("p", "x = 0.5", 0.25, tolerance=0.125) == 0.0
    assert exact_match("p", "42", " 42\n") == 1.0  # both sides stripped


def test_the_response_mask_covers_the_response_tokens_up_to_eos():
    """generate_rollouts on a stub rollout: prompts of width 3 (row 0 left-padded by one), responses of 2 and 3
    tokens. The mask is over the targets ids[:, 1:]: the first p_len - 1 = 2 targets are the prompt's, the rest
    follow the attention mask (row 0 ends at its EOS, position 4)."""
    from engine.grpo import generate_rollouts

    t = tok()
    attn = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    out = SimpleNamespace(input_ids=torch.randint(5, 100, (2, 6)), attention_mask=attn,
                          response_start_idx=torch.tensor([3, 3]))
    rollout = SimpleNamespace(sync_weights=lambda *a: None, generate=lambda request, sampling: out,
                              shutdown=lambda: None)
    run = SimpleNamespace(rollout=rollout, tok=t, device="cpu", g=GRPOConfig())
    r = generate_rollouts(run, [{"prompt": "a b c"}, {"prompt": "d e f"}], None)
    assert r.resp_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_advantages_follow_normalize_std():
    """score(): rewards 1, 0 in a group of 2; normalize_std false (Dr. GRPO) leaves reward minus the group mean."""
    from engine.grpo import score
    from engine.rewards import build_rewards

    for normalize, want in ((False, [0.5, -0.5]), (True, [0.7071, -0.7071])):  # std of (1, 0): 0.7071 (Bessel)
        g = GRPOConfig(group_size=2, normalize_std=normalize, rewards=[{"name": "exact_match"}])
        run = SimpleNamespace(g=g, rewards=build_rewards(g.rewards), device="cpu", world=SimpleNamespace(rank=0))
        r = SimpleNamespace(texts=["a", "b"], tree=None, resp_mask=torch.ones(2, 3))
        _, reward, adv = score(run, [{"prompt": "p", "answer": "a"}], r, 1)
        assert reward.tolist() == [1.0, 0.0] and adv.tolist() == pytest.approx(want, abs=1e-4), normalize

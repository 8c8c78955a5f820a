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

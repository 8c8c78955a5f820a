"""GRPO math against numbers worked out by hand (each expected literal says how it was obtained)."""
import math
from dataclasses import replace

import pytest
import torch

from engine.grpo_math import (GRPOLossConfig, group_advantages, keep_mask, kl_k1, kl_k3, policy_loss,
                              token_entropy, token_logprobs)

LN2, LN3 = 0.6931471805599453, 1.0986122886681098


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --- advantages and dynamic sampling -----------------------------------------------------------------

REWARDS = t([1., 0., 0., 1.,   0., 0., 0., 1.,   1., 1., 1., 1.])  # 3 prompts x G=4


def test_advantages_std_normalized():
    adv = group_advantages(REWARDS, 4)
    expected = [
        # group 1: mean 0.5, deviations +-0.5, Bessel var = 4 * 0.25 / 3 = 1/3, std = 0.57735; 0.5 / 0.57735
        0.8660254, -0.8660254, -0.8660254, 0.8660254,
        # group 2: mean 0.25, deviations -0.25 x3, 0.75; var = (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5
        -0.5, -0.5, -0.5, 1.5,
        # group 3: all equal -> 0 / (0 + eps) = 0
        0.0, 0.0, 0.0, 0.0,
    ]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)  # eps = 1e-6 shifts the 5th digit at most
    # integer rewards (a reward function's 0/1) as the floats they stand for
    assert group_advantages(torch.tensor([1, 0, 0, 1]), 4).tolist() == pytest.approx(expected[:4], abs=1e-5)


def test_advantages_dr_grpo_no_std():
    # reward minus group mean only (means 0.5, 0.25, 1.0)
    expected = [0.5, -0.5, -0.5, 0.5, -0.25, -0.25, -0.25, 0.75, 0.0, 0.0, 0.0, 0.0]
    assert group_advantages(REWARDS, 4, normalize_std=False).tolist() == pytest.approx(expected, abs=1e-12)


def test_advantages_bad_group_size():
    with pytest.raises(ValueError, match="divide the number of rewards"):
        group_advantages(REWARDS, 5)
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(REWARDS, 1)
    assert group_advantages(REWARDS, 1, normalize_std=False).tolist() == [0.0] * 12  # own mean


def test_keep_mask_drops_groups_of_equal_rewards():
    rewards = t([0., 0., 0., 0.,   0., 1., 0., 0.,   1., 1., 1., 1.,   0.5, 0.5, 0.5, 0.25])
    # all-zero: drop; mixed: keep; all-one: drop; one differs: keep
    assert keep_mask(rewards, 4).tolist() == [False, True, False, True]
    assert keep_mask(rewards, 4).repeat_interleave(4).sum().item() == 8
    near = t([0.3, 0.3 + 1e-9])
    assert keep_mask(near, 2).tolist() == [True]
    assert keep_mask(near, 2, atol=1e-6).tolist() == [False]


# --- log-probs, entropy, KL ---------------------------------------------------------------------------

def test_token_logprobs_and_entropy_by_hand():
    # position 0: uniform over 3 tokens; position 1: logits [0, ln2, ln3] -> softmax [1/6, 2/6, 3/6]
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, LN2, LN3]]])  # (B=1, T=2, V=3)
    targets = torch.tensor([[1, 2]])  # (1, 2)
    logp = token_logprobs(logits, targets)
    assert logp.shape == (1, 2) and logp.dtype == torch.float32
    assert logp.tolist()[0] == pytest.approx([-LN3, -LN2], abs=1e-6)  # ln(1/3), ln(3/6)
    ent = token_entropy(logits)
    # uniform: ln 3; [1/6, 1/3, 1/2]: (1/6) ln 6 + (1/3) ln 3 + (1/2) ln 2 = 0.298627 + 0.366204 + 0.346574
    assert ent.tolist()[0] == pytest.approx([1.0986123, 1.0114043], abs=1e-6)
    assert token_logprobs(logits.bfloat16(), targets).dtype == torch.float32  # upcast for the ratio
    with pytest.raises(ValueError, match="must agree"):
        token_logprobs(logits, torch.tensor([[1, 2, 0]]))


def test_kl_k1_k3_known_values():
    logp = t([math.log(0.5), math.log(0.25), math.log(0.3)])
    ref = t([math.log(0.25), math.log(0.5), math.log(0.3)])
    # k1 = logp - ref: ln 2, -ln 2, 0 (negative on the second token)
    assert kl_k1(logp, ref).tolist() == pytest.approx([LN2, -LN2, 0.0], abs=1e-12)
    # k3, d = ref - logp: d = -ln2 -> 0.5 + ln2 - 1 = 0.193147; d = ln2 -> 2 - ln2 - 1 = 0.306853; d = 0 -> 0
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.1931472, 0.3068528, 0.0], abs=1e-7)
    d = torch.linspace(-20, 20, 401, dtype=torch.float64)
    assert (kl_k3(torch.zeros_like(d), d) >= 0).all()  # e^d >= 1 + d


# --- the loss: aggregation ----------------------------------------------------------------------------

# B=2, T=4, old_logp = 0 on the response so ratio = e^logp. Unclipped everywhere (ratios in [0.8, 1.28]).
# seq 0: A = +1, response = tokens 1, 2 with ratios 1.0, 1.1 -> token losses -1.0, -1.1 (sum -2.1, n=2)
#        token 0 (prompt) has ratio e^5 and token 3 (padding) has old_logp = -inf: both must be ignored
# seq 1: A = -2, response = all 4 tokens, ratios 1.0, 0.9, 1.2, 1.0 -> losses 2.0, 1.8, 2.4, 2.0 (sum 8.2, n=4)
LOGP = torch.log(t([[math.exp(5), 1.0, 1.1, 1.0], [1.0, 0.9, 1.2, 1.0]]))
OLD = t([[0.0, 0.0, 0.0, -math.inf], [0.0, 0.0, 0.0, 0.0]])
ADV = t([1.0, -2.0])
MASK = t([[0, 1, 1, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize("aggregation, expected", [
    ("grpo", 0.5),                # mean of per-sequence means: (-2.1/2 + 8.2/4) / 2 = (-1.05 + 2.05) / 2
    ("dapo", 1.0166666666666667),  # all tokens: (-2.1 + 8.2) / 6 = 6.1 / 6
    ("dr_grpo", 0.38125),         # (-2.1 + 8.2) / (2 sequences x max_new_tokens 8) = 6.1 / 16
])
def test_aggregation_variants(aggregation, expected):
    logp = LOGP.clone()
    logp[0, 3] = math.nan  # a padding position's log-prob may be anything: it must reach neither loss nor gradient
    logp.requires_grad_()
    cfg = GRPOLossConfig(aggregation=aggregation, max_new_tokens=8)
    loss, stats = policy_loss(logp, OLD, ADV, MASK, cfg)
    assert loss.item() == pytest.approx(expected, rel=1e-9)
    assert stats["ratio_mean"].item() == pytest.approx(1.0333333333, rel=1e-9)  # (1+1.1+1+0.9+1.2+1) / 6
    assert stats["clip_frac_low"].item() == 0.0 and stats["clip_frac_high"].item() == 0.0
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 3].item() == 0.0  # prompt and padding
    # with the KL term: the reference's log-probs at the padding may be anything too
    logp.grad = None
    ref = (LOGP - 0.1).clone()
    ref[0, 3] = math.nan
    loss, stats = policy_loss(logp, OLD, ADV, MASK, replace(cfg, beta=0.1), ref_logp=ref)
    assert math.isfinite(loss.item()) and math.isfinite(stats["kl_mean"].item())
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 3].item() == 0.0


def test_dapo_token_normalizer_and_grpo_empty_sequence():
    cfg = GRPOLossConfig(aggregation="dapo")
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, cfg, token_normalizer=12.0)
    assert loss.item() == pytest.approx(6.1 / 12, rel=1e-9)  # token sum 6.1 over a global count of 12
    with pytest.raises(ValueError, match="dapo only"):
        policy_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(), token_normalizer=12.0)
    # grpo: a sequence with no response tokens adds 0 and still counts: (-1.05 + 0) / 2
    empty = t([[0, 1, 1, 0], [0, 0, 0, 0]])
    loss, _ = policy_loss(LOGP, OLD, ADV, empty, GRPOLossConfig())
    assert loss.item() == pytest.approx(-0.525, rel=1e-9)
    # a micro-batch with no response token at all (dynamic sampling can leave one): loss and statistics 0, not NaN
    loss, stats = policy_loss(LOGP, OLD, ADV, torch.zeros_like(MASK), GRPOLossConfig(aggregation="dapo"))
    assert loss.item() == 0.0 and {k: v.item() for k, v in stats.items()} == {
        "clip_frac_low": 0.0, "clip_frac_high": 0.0, "ratio_mean": 0.0}


# --- the loss: clipping on both sides ------------------------------------------------------------------

def test_clipping_both_sides_and_zero_gradient():
    # one sequence of 9 tokens, per-token advantages, clip_low 0.2 -> [0.8, ...], clip_high 0.28 -> [..., 1.28]
    ratios = t([[0.5, 0.5, 2.0, 2.0, 1.0, 1.25, 0.5, 0.6, 1.5]])
    adv = t([[-1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 0.0, -2.0, 0.5]])
    # per token -min(r A, clip(r) A):
    #   r=0.5,  A=-1: -min(-0.5, -0.8)  =  0.8   clipped low (active), no gradient
    #   r=0.5,  A=+1: -min( 0.5,  0.8)  = -0.5   not clipped
    #   r=2.0,  A=+1: -min( 2.0,  1.28) = -1.28  clipped high (active), no gradient
    #   r=2.0,  A=-1: -min(-2.0, -1.28) =  2.0   not clipped
    #   r=1.0,  A=+1: -1.0                        inside the band
    #   r=1.25, A=+1: -1.25                       inside [0.8, 1.28]: clip_high is not clip_low
    #   r=0.5,  A=0:   0                          no advantage: not counted as clipped
    #   r=0.6,  A=-2: -min(-1.2, -1.6)  =  1.6   clipped low
    #   r=1.5,  A=.5: -min(0.75, 0.64)  = -0.64  clipped high
    # dapo mean: (0.8 - 0.5 - 1.28 + 2.0 - 1.0 - 1.25 + 0 + 1.6 - 0.64) / 9 = -0.27 / 9
    # clipped: low 2 of 9 (A < 0 only), high 2 of 9 (A > 0 only); the other sign's count would be 1 of 9 each
    logp = torch.log(ratios).requires_grad_()
    cfg = GRPOLossConfig(clip_low=0.2, clip_high=0.28, aggregation="dapo")
    loss, stats = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp), cfg)
    assert loss.item() == pytest.approx(-0.27 / 9, rel=1e-9)
    assert stats["clip_frac_low"].item() == pytest.approx(2 / 9)
    assert stats["clip_frac_high"].item() == pytest.approx(2 / 9)
    loss.backward()
    # unclipped token: d(-r A / 9)/d logp = -r A / 9 (dr/dlogp = r); clipped tokens and A = 0: 0
    expected = [0.0, -0.5 / 9, 0.0, 2.0 / 9, -1.0 / 9, -1.25 / 9, 0.0, 0.0, 0.0]
    assert logp.grad[0].tolist() == pytest.approx(expected, abs=1e-12)


# --- the loss: rollout correction -----------------------------------------------------------------------

def test_rollout_correction_truncates_or_masks_by_the_rollout_weight():
    # ratio 1 (first pass: old = logp), advantage +1 on 4 tokens; w = pi_train / pi_rollout = 4, 1.5, 0.25, 1
    logp = torch.log(t([[0.4, 0.3, 0.1, 0.2]])).requires_grad_()
    rollout = torch.log(t([[0.1, 0.2, 0.4, 0.2]]))
    ones, adv = torch.ones(1, 4, dtype=torch.float64), t([1.0])
    # tis, cap 2: per token -min(w, 2) x 1 = -2, -1.5, -0.25, -1; dapo mean -4.75 / 4; 1 of 4 truncated
    cfg = GRPOLossConfig(aggregation="dapo", rollout_correction="tis", rollout_correction_cap=2.0)
    loss, stats = policy_loss(logp, logp.detach(), adv, ones, cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-4.75 / 4, rel=1e-12)
    assert stats["rollout_corrected_frac"].item() == pytest.approx(0.25)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -0.375, -0.0625, -0.25], abs=1e-12)  # weight x r A / 4
    # mis, cap 2: the token with w = 4 > 2 masked, the others weighted by w: -(1.5 + 0.25 + 1) / 4
    logp.grad = None
    cfg = GRPOLossConfig(aggregation="dapo", rollout_correction="mis", rollout_correction_cap=2.0)
    loss, stats = policy_loss(logp, logp.detach(), adv, ones, cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-2.75 / 4, rel=1e-12)
    assert stats["rollout_corrected_frac"].item() == pytest.approx(0.25)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.375, -0.0625, -0.25], abs=1e-12)
    # A later pass (iterations > 1): the weight is pi_train(old) / pi_rollout, not the current policy's. old = 0.2,
    # 0.3, 0.2, 0.2: ratio r = 2, 1, 0.5, 1 (clips wide enough to leave it), w = 2, 1.5, 0.5, 1.
    old = torch.log(t([[0.2, 0.3, 0.2, 0.2]]))
    wide = dict(aggregation="dapo", clip_low=0.9, clip_high=5.0, rollout_correction_cap=1.8)
    for kind, want, grad in (("tis", -(1.8 * 2 + 1.5 + 0.5 * 0.5 + 1) / 4, [-0.9, -0.375, -0.0625, -0.25]),
                             ("mis", -(1.5 + 0.5 * 0.5 + 1) / 4, [0.0, -0.375, -0.0625, -0.25])):
        logp.grad = None
        loss, stats = policy_loss(logp, old, adv, ones, GRPOLossConfig(rollout_correction=kind, **wide),
                                  rollout_logp=rollout)
        assert loss.item() == pytest.approx(want, rel=1e-12), kind
        assert stats["rollout_corrected_frac"].item() == pytest.approx(0.25)
        loss.backward()
        assert logp.grad[0].tolist() == pytest.approx(grad, abs=1e-12), kind  # w x r x A / 4, r = dr / dlogp
    # a weight exactly at the cap is not corrected: tis keeps it whole, mis keeps the token (a weight above it is)
    at = torch.exp(logp.detach() - rollout)[0, 1].item()  # 1.5, as float64 computes it
    for kind in ("tis", "mis"):
        cfg = GRPOLossConfig(aggregation="dapo", rollout_correction=kind, rollout_correction_cap=at)
        loss, stats = policy_loss(logp, logp.detach(), adv, ones, cfg, rollout_logp=rollout)
        assert stats["rollout_corrected_frac"].item() == pytest.approx(0.25), kind  # w = 4 only
        w = torch.exp(logp.detach() - rollout)[0]
        want = -(at + w[1] + w[2] + w[3]) / 4 if kind == "tis" else -(w[1] + w[2] + w[3]) / 4
        assert loss.item() == pytest.approx(want.item(), rel=1e-12), kind
    # none: the plain surrogate, no statistic
    loss, stats = policy_loss(logp, logp.detach(), adv, ones, GRPOLossConfig(aggregation="dapo"), rollout_logp=rollout)
    assert loss.item() == pytest.approx(-1.0) and "rollout_corrected_frac" not in stats
    # old_logp passed without detach (the same tensor as logp): only logp carries the gradient, -r A / 4 per token
    logp.grad = None
    loss, _ = policy_loss(logp, logp, adv, ones, GRPOLossConfig(aggregation="dapo"))
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.25] * 4, abs=1e-12)
    # the fraction corrected is over response tokens only: 1 of 4 (over all 5 positions it would read 0.2)
    pad_logp, pad_rollout = torch.log(t([[0.4, 0.3, 0.1, 0.2, 0.5]])), torch.log(t([[0.1, 0.2, 0.4, 0.2, 0.01]]))
    _, stats = policy_loss(pad_logp, pad_logp, adv, t([[1, 1, 1, 1, 0]]), GRPOLossConfig(
        aggregation="dapo", rollout_correction="tis", rollout_correction_cap=2.0), rollout_logp=pad_rollout)
    assert stats["rollout_corrected_frac"].item() == pytest.approx(0.25)
    # the KL term is not weighted by the rollout correction: advantage 0, beta 0.1, k3 to ref = the rollout's
    # log-probs: k3 = e^d - d - 1 with d = ref - logp = ln(1/4), ln(2/3), ln 4, 0 -> 0.636294, 0.072132, 1.613706,
    # 0: sum 2.322132, x 0.1 / 4 tokens (weighted by tis's 2, 1.5, 0.25, 1 it would be 0.0446053)
    loss, _ = policy_loss(logp, logp.detach(), t([0.0]), ones, GRPOLossConfig(
        aggregation="dapo", beta=0.1, rollout_correction="tis", rollout_correction_cap=2.0), ref_logp=rollout,
        rollout_logp=rollout)
    assert loss.item() == pytest.approx(0.1 * 2.3221320 / 4, rel=1e-6)
    with pytest.raises(ValueError, match="needs rollout_logp"):
        policy_loss(logp, logp.detach(), adv, ones, GRPOLossConfig(rollout_correction="tis"))
    problems = GRPOLossConfig(rollout_correction="is", rollout_correction_cap=0.0).validate()
    assert [p.split(" ")[0].rstrip(":") for p in problems] == ["grpo.rollout_correction", "grpo.rollout_correction_cap"]


# --- the loss: KL to the reference ---------------------------------------------------------------------

def test_kl_term_value_and_gradient():
    logp = torch.log(t([[0.5, 0.25]])).requires_grad_()
    ref = torch.log(t([[0.25, 0.5]]))
    zero_adv = t([0.0])  # surrogate is 0, only the KL term remains
    ones = torch.ones(1, 2, dtype=torch.float64)
    cfg = GRPOLossConfig(beta=0.1, kl="k3", aggregation="dapo")
    loss, stats = policy_loss(logp, logp.detach(), zero_adv, ones, cfg, ref_logp=ref)
    # k3 = 0.193147 and 0.306853 (see test_kl_k1_k3_known_values), mean exactly 0.25; x beta 0.1
    assert stats["kl_mean"].item() == pytest.approx(0.25, rel=1e-9)
    assert loss.item() == pytest.approx(0.025, rel=1e-9)
    loss.backward()
    # d k3 / d logp = 1 - e^(ref - logp): 1 - 0.5 = 0.5 and 1 - 2 = -1; x beta / 2 tokens
    assert logp.grad[0].tolist() == pytest.approx([0.025, -0.05], abs=1e-12)

    loss, stats = policy_loss(logp, logp.detach(), zero_adv, ones, GRPOLossConfig(beta=0.1, kl="k1",
                                                                                  aggregation="dapo"),
                              ref_logp=ref)
    assert stats["kl_mean"].item() == pytest.approx(0.0, abs=1e-12)  # k1: ln2 and -ln2 cancel
    assert loss.item() == pytest.approx(0.0, abs=1e-12)

    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(logp, logp.detach(), zero_adv, ones, cfg)
    # kl_mean over response tokens only: a padded third token (k3 0.3 there) changes nothing
    logp3, ref3 = torch.log(t([[0.5, 0.25, 0.9]])), torch.log(t([[0.25, 0.5, 0.1]]))
    _, stats = policy_loss(logp3, logp3, t([0.0]), t([[1, 1, 0]]), cfg, ref_logp=ref3)
    assert stats["kl_mean"].item() == pytest.approx(0.25, rel=1e-9)


def test_entropy_stat_is_response_mean():
    ent = t([[9.0, 1.0, 2.0, 9.0], [3.0, 3.0, 3.0, 3.0]])
    _, stats = policy_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(), entropy=ent)
    assert stats["entropy_mean"].item() == pytest.approx(15.0 / 6)  # (1 + 2 + 4 x 3) / 6 response tokens
    assert "kl_mean" not in stats


# --- config ---------------------------------------------------------------------------------------------

def test_config_validate_reports_every_problem():
    assert GRPOLossConfig().validate() == []
    assert GRPOLossConfig(aggregation="dr_grpo", max_new_tokens=256).validate() == []
    bad = GRPOLossConfig(clip_low=1.0, clip_high=-0.1, beta=-1.0, kl="k2", aggregation="sum")
    problems = bad.validate()
    assert len(problems) == 5, problems
    for field_name in ("grpo.clip_low", "grpo.clip_high", "grpo.beta", "grpo.kl", "grpo.aggregation"):
        assert any(p.startswith(field_name) for p in problems), (field_name, problems)
    assert "grpo, dapo, dr_grpo" in " ".join(problems)
    (p,) = GRPOLossConfig(aggregation="dr_grpo").validate()
    assert p.startswith("grpo.max_new_tokens")
    with pytest.raises(ValueError, match="grpo.aggregation"):
        policy_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(aggregation="sum"))


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"old_logp has shape \(2, 3\)"):
        policy_loss(LOGP, OLD[:, :3], ADV, MASK, GRPOLossConfig())
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(LOGP, OLD, t([1.0, 2.0, 3.0]), MASK, GRPOLossConfig())

"""engine/grpo_math.py's and engine/routing.py's rules that the other fast tests let through, one mutant a test: the
loss config's bounds (clip_low >= 0, clip_high = 0 allowed, dr_grpo's max_new_tokens >= 1), what carries no gradient
(advantages, the reference's log-probs, old log-probs in the rollout-correction weight), Dr. GRPO's constant
denominator when dynamic sampling empties a sequence, a ratio exactly at a clip bound (not clipped), beta 0 (the KL
reaches no loss); the replay's refusals (a policy without MoE layers, routes of another layer count, another token
count), recording without replay and after leaving `use`, route_norm off, fp32 scores from a bf16 gate, and replayed
experts whose scores underflow to 0. Each expected value is worked out by hand or by a plain loop in the test from
the documented formula; nothing here needs a launcher or a model. The docstring's bracket names the mutant."""
import math

import pytest
import torch

from engine.grpo_math import GRPOLossConfig, policy_loss
from test_replay_balance_units import _policy


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def surrogate(r: float, a: float, clip_low: float = 0.2, clip_high: float = 0.28) -> float:
    """-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) for one token, in plain floats."""
    c = min(max(r, 1 - clip_low), 1 + clip_high)
    return -min(r * a, c * a)


# ------------------------------------------------------------------------------------------- the config's bounds

def test_a_negative_clip_low_is_refused_and_zero_is_accepted():
    """clip_low must be in [0, 1): -0.1 would put the lower clip at 1.1, above ratio 1, so every fresh token would
    be 'clipped'; 0.0 is the edge and valid. [fails if: the `0.0 <=` lower bound of clip_low is dropped]"""
    problems = GRPOLossConfig(clip_low=-0.1).validate()
    assert len(problems) == 1 and problems[0].startswith("grpo.clip_low (-0.1)"), problems
    assert GRPOLossConfig(clip_low=0.0).validate() == []


def test_clip_high_zero_is_accepted():
    """clip_high must be >= 0: 0 (an upper clip at ratio 1) is valid, only a negative one is refused.
    [fails if: `clip_high < 0` becomes `clip_high <= 0`]"""
    assert GRPOLossConfig(clip_high=0.0).validate() == []
    assert GRPOLossConfig(clip_high=-1e-9).validate()[0].startswith("grpo.clip_high")


def test_dr_grpo_refuses_max_new_tokens_zero():
    """dr_grpo divides by sequences x max_new_tokens: 0 would divide by zero, so it is refused; 1 is the smallest
    accepted. [fails if: `max_new_tokens < 1` becomes `max_new_tokens < 0`]"""
    (p,) = GRPOLossConfig(aggregation="dr_grpo", max_new_tokens=0).validate()
    assert p.startswith("grpo.max_new_tokens (0) must be >= 1")
    assert GRPOLossConfig(aggregation="dr_grpo", max_new_tokens=1).validate() == []


# ------------------------------------------------------------------------------------- what carries no gradient

def test_advantages_get_no_gradient():
    """Advantages that require grad (an advantage computed from a value model, say) are detached: the loss's
    gradient reaches logp only. One sequence, A = 2, ratios 0.5, 1.0, 1.5 (the last above 1.28: clipped, no
    gradient); dapo mean over 3 tokens: d loss / d logp = -r A / 3. [fails if: advantages are not detached]"""
    logp = torch.log(t([[0.5, 1.0, 1.5]])).requires_grad_()
    adv = t([2.0]).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp), GRPOLossConfig(aggregation="dapo"))
    assert loss.item() == pytest.approx(sum(surrogate(r, 2.0) for r in (0.5, 1.0, 1.5)) / 3, rel=1e-12)
    loss.backward()
    assert adv.grad is None
    assert logp.grad[0].tolist() == pytest.approx([-0.5 * 2 / 3, -1.0 * 2 / 3, 0.0], abs=1e-12)


def test_reference_logprobs_get_no_gradient():
    """A reference's log-probs that require grad (a reference forward outside no_grad) are detached: only logp gets
    the KL's gradient, beta (1 - e^(ref - logp)) / n per token for k3. logp = ln 0.5, ln 0.25; ref = ln 0.25, ln 0.5;
    A = 0: d = ref - logp = -ln 2, ln 2 -> 0.1 x (1 - 0.5) / 2 and 0.1 x (1 - 2) / 2.
    [fails if: ref_logp is not detached]"""
    logp = torch.log(t([[0.5, 0.25]])).requires_grad_()
    ref = torch.log(t([[0.25, 0.5]])).requires_grad_()
    cfg = GRPOLossConfig(beta=0.1, kl="k3", aggregation="dapo")
    loss, _ = policy_loss(logp, logp.detach(), t([0.0]), torch.ones_like(logp), cfg, ref_logp=ref)
    k3 = [math.exp(d) - d - 1 for d in (-math.log(2), math.log(2))]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-12)
    loss.backward()
    assert ref.grad is None
    assert logp.grad[0].tolist() == pytest.approx([0.1 * 0.5 / 2, 0.1 * -1.0 / 2], abs=1e-12)


@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_the_rollout_weight_carries_no_gradient_through_old_logp(kind):
    """The rollout-correction weight w = pi_train(old) / pi_rollout is a constant: with old_logp the very tensor
    logp (first pass, not detached by the caller), the gradient is w r A / n per token (r = 1), not twice that
    through w. Probabilities 0.2, 0.3 against the rollout's 0.4, 0.2: w = 0.5, 1.5, both under the cap 2, so tis and
    mis weight alike. [fails if: old_logp is not detached in the weight]"""
    logp = torch.log(t([[0.2, 0.3]])).requires_grad_()
    rollout = torch.log(t([[0.4, 0.2]]))
    cfg = GRPOLossConfig(aggregation="dapo", rollout_correction=kind, rollout_correction_cap=2.0)
    loss, stats = policy_loss(logp, logp, t([1.0]), torch.ones_like(logp), cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-(0.5 + 1.5) / 2, rel=1e-12)
    assert stats["rollout_corrected_frac"].item() == 0.0
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5 / 2, -1.5 / 2], abs=1e-12)


# ------------------------------------------------------------------------------------------------- aggregation

def test_dr_grpo_divides_by_every_sequence_even_an_emptied_one():
    """Dr. GRPO's denominator is a constant, sequences x max_new_tokens, counting a sequence that dynamic sampling
    masked out entirely. Sequence 0: A = +1, ratios 1.0, 1.1 (token losses -1.0, -1.1); sequence 1: no response token.
    Loss = -2.1 / (2 x 4). [fails if: only sequences with response tokens are counted]"""
    logp = torch.log(t([[1.0, 1.1, 1.0], [0.7, 1.3, 0.9]]))
    mask = t([[1, 1, 0], [0, 0, 0]])
    loss, _ = policy_loss(logp, torch.zeros_like(logp), t([1.0, -1.0]), mask,
                          GRPOLossConfig(aggregation="dr_grpo", max_new_tokens=4))
    assert loss.item() == pytest.approx(-2.1 / 8, rel=1e-12)


# ------------------------------------------------------------------------------------------------ clip statistics

def test_a_ratio_exactly_at_a_clip_bound_is_not_clipped():
    """clip_low = clip_high = 0 and ratio exactly 1 (logp = old_logp): the ratio sits on both bounds, where the
    clamp still passes the gradient, so neither clip fraction counts it (clipped means ratio < 1 - clip_low with
    A < 0, ratio > 1 + clip_high with A > 0) and the gradient is the unclipped -r A / n.
    [fails if: `ratio < 1 - clip_low` becomes `<=`, or `ratio > 1 + clip_high` becomes `>=`]"""
    logp = t([[-0.7, -1.2, -0.3, -2.0]]).requires_grad_()
    adv = t([[1.0, -1.0, 2.0, -0.5]])
    cfg = GRPOLossConfig(clip_low=0.0, clip_high=0.0, aggregation="dapo")
    loss, stats = policy_loss(logp, logp.detach(), adv, torch.ones_like(logp), cfg)
    assert stats["clip_frac_low"].item() == 0.0 and stats["clip_frac_high"].item() == 0.0
    assert loss.item() == pytest.approx(-(1.0 - 1.0 + 2.0 - 0.5) / 4, rel=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0 / 4, 1.0 / 4, -2.0 / 4, 0.5 / 4], abs=1e-12)


# ---------------------------------------------------------------------------------------------------------- KL

def test_beta_zero_keeps_the_kl_out_of_the_loss():
    """With beta 0 a given reference only feeds kl_mean: a token whose k3 overflows (d = ref - logp = 1000, e^d =
    inf) must not turn the loss into inf x 0 = NaN. One token, ratio 1, A = +1: loss -1, gradient -1.
    [fails if: the KL term is added even when beta is 0]"""
    logp = t([[-1000.0]]).requires_grad_()
    ref = t([[0.0]])
    loss, stats = policy_loss(logp, logp.detach(), t([1.0]), torch.ones_like(logp),
                              GRPOLossConfig(beta=0.0, aggregation="dapo"), ref_logp=ref)
    assert loss.item() == -1.0
    assert stats["kl_mean"].item() == math.inf
    loss.backward()
    assert logp.grad[0].tolist() == [-1.0]


# ---------------------------------------------------------------------------------------------- routing replay

def make_router(logits_dim: int = 8, *, score_func="sigmoid", route_norm=True, route_scale=2.5, dtype=torch.float32,
                seed=0):
    """DeepSpeed's TokenChoiceTopKRouter over 8 experts, top-2; logits_dim=8 with an identity gate makes x the
    logits themselves (so a test can write them by hand)."""
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    torch.manual_seed(seed)
    r = TokenChoiceTopKRouter(dim=logits_dim, num_experts=8, num_expert_groups=None, num_limited_groups=None,
                              top_k=2, score_func=score_func, route_norm=route_norm, route_scale=route_scale,
                              gate_bias=False)
    if logits_dim == 8:
        with torch.no_grad():
            r.gate.weight.copy_(torch.eye(8))
    return r.to(dtype)


def as_routes(ids: torch.Tensor) -> torch.Tensor:
    """(T, k) ids of one layer -> (B T, S 1, L 1, k) int16 routes."""
    return ids[:, None, None, :].to(torch.int16)


def test_a_policy_without_moe_layers_is_refused():
    """Router on a policy with no AutoEP layer raises at once, naming the setting.
    [fails if: the empty-layer check is dropped]"""
    from engine.routing import Router

    model = _policy([make_router()])
    model.model.layers[0].mlp._is_autoep_layer = False
    with pytest.raises(ValueError, match="grpo.routing_replay: the policy has no MoE"):
        Router(model)


def test_routes_of_another_layer_count_are_refused():
    """Routes recorded for 2 MoE layers on a 1-layer policy: use() refuses them with both counts.
    [fails if: the layer-count check in use() is dropped]"""
    from engine.routing import Router

    router = Router(_policy([make_router()]))
    with pytest.raises(RuntimeError, match="routes of 2 MoE layers for a policy with 1"):
        with router.use(torch.zeros(3, 1, 2, 2, dtype=torch.int16)):
            pass


def test_routes_of_another_token_count_are_refused():
    """A replay of 3 recorded tokens on a forward over 4 tokens raises, naming both (a shorter recording would
    otherwise gather weights for 3 rows only). [fails if: the token-count check is dropped]"""
    from engine.routing import Router

    r = make_router()
    router = Router(_policy([r]))
    with router.use(as_routes(torch.tensor([[0, 1], [2, 3], [4, 5]]))):
        with pytest.raises(RuntimeError, match="3 recorded tokens for a forward over 4"):
            r(torch.randn(4, 8))


def test_recording_without_replay_keeps_the_routers_own_choice():
    """use(None, record=True): the routers choose (DeepSpeed's forward, taken before installation) and recorded()
    gives that choice as both what was dispatched and what the live router chose, per layer.
    [fails if: nothing is recorded on the live path]"""
    from engine.routing import Router

    r0, r1 = make_router(16, seed=0), make_router(16, seed=1)
    x = torch.randn(5, 16)
    want0, want1 = r0(x)[1], r1(x)[1]
    router = Router(_policy([r0, r1]))
    with router.use(None, record=True):
        r0(x)
        r1(x)
        used, live = router.recorded()
    assert used.shape == (5, 2, 2)
    assert torch.equal(used[:, 0], want0) and torch.equal(used[:, 1], want1) and torch.equal(live, used)


def test_a_forward_after_use_records_nothing():
    """recorded() is what the last forward inside use(..., record=True) did: a forward after the block (the routers
    DeepSpeed's own again) leaves it as it was. [fails if: leaving use() does not turn recording off]"""
    from engine.routing import Router

    r = make_router(16)
    router = Router(_policy([r]))
    replayed = torch.tensor([[0, 1], [2, 3], [4, 5]])
    with router.use(as_routes(replayed), record=True):
        r(torch.randn(3, 16))
    used_before, live_before = (v.clone() for v in router.recorded())
    r(torch.randn(7, 16))  # outside use: other tokens, another count
    used, live = router.recorded()
    assert torch.equal(used, used_before) and torch.equal(live, live_before)
    assert torch.equal(used[:, 0], replayed)


def test_replay_without_route_norm_keeps_the_raw_scores():
    """A router with route_norm off (Qwen-MoE's norm_topk_prob false): the replayed experts' weights are their
    softmax scores times route_scale, not renormalised to sum 1. Logits 0, ln 2, ln 3, ln 4, -100 x 4: softmax 0.1,
    0.2, 0.3, 0.4; experts 1 and 3 weigh 0.2 x 1.5 and 0.4 x 1.5. [fails if: the weights are always renormalised]"""
    from engine.routing import Router

    logits = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)] + [-100.0] * 4])
    r = make_router(score_func="softmax", route_norm=False, route_scale=1.5)
    router = Router(_policy([r]))
    with router.use(as_routes(torch.tensor([[1, 3]]))):
        top, ids, counts = r(logits)
    assert top.tolist()[0] == pytest.approx([0.3, 0.6], abs=1e-6)
    assert ids.tolist() == [[1, 3]] and counts.tolist() == [0, 1, 0, 1, 0, 0, 0, 0]


def test_replay_scores_a_bf16_gate_in_fp32():
    """A bf16 router (the policy's dtype): its gate's logits are upcast before the score function, as DeepSpeed's
    router does, so the replayed weights are fp32: sigmoid(float(logits)) of the replayed experts, renormalised, x 2.5.
    [fails if: the scores are computed in the gate's bf16]"""
    from engine.routing import Router

    r = make_router(16, dtype=torch.bfloat16)
    x = torch.randn(6, 16).bfloat16()
    ids = torch.tensor([[0, 5], [1, 2], [7, 3], [4, 6], [2, 0], [6, 1]])
    with torch.no_grad():
        s = torch.sigmoid(r.gate(x).float()).tolist()  # the reference: plain per-token arithmetic below
    want = [[2.5 * s[i][e] / (s[i][a] + s[i][b]) for e in (a, b)] for i, (a, b) in enumerate(ids.tolist())]
    router = Router(_policy([r]))
    with router.use(as_routes(ids)):
        top, _, _ = r(x)
    assert top.dtype == torch.float32
    assert top.tolist() == [pytest.approx(row, abs=1e-6) for row in want]


def test_replayed_experts_whose_scores_underflow_weigh_zero():
    """Replaying experts the live router scores at exactly 0 (sigmoid of logits -200 underflows in fp32): their
    renormalised weights are 0 as in DeepSpeed's router (sum + 1e-20), not 0 / 0 = NaN, and the gradient stays
    finite. [fails if: the 1e-20 guard of the renormalisation is dropped]"""
    from engine.routing import Router

    logits = torch.tensor([[-200.0, -200.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    r = make_router()
    router = Router(_policy([r]))
    with router.use(as_routes(torch.tensor([[0, 1]]))):
        top, _, _ = r(logits)
    assert top.tolist() == [[0.0, 0.0]]
    top.sum().backward()
    assert torch.isfinite(logits.grad).all() and torch.isfinite(r.gate.weight.grad).all()

"""GRPO's math, free of DeepSpeed: group advantages, token log-probs, KL estimators, the clipped loss.

Shapes: N = prompts x G completions, laid out as G consecutive samples per prompt; T = tokens per
sequence (prompt + response, padded); V = vocabulary. `response_mask` (N, T) is 1 on the response
tokens whose log-probs count, 0 on prompt and padding.

Variants covered by one loss:
  GRPO     std-normalized advantages, mean over each sequence's tokens, then over sequences
  DAPO     clip_high > clip_low ("clip-higher"), dynamic sampling (`keep_mask`), token-level mean
  Dr. GRPO no std normalization, sum over tokens / (sequences x max_new_tokens), a constant
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("grpo", "dapo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k3")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


@dataclass
class GRPOLossConfig:
    clip_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_low (must be in [0, 1))."""
    clip_high: float = 0.28
    """Upper clip: the ratio is clipped at 1 + clip_high. DAPO's clip-higher uses 0.28 against 0.2."""
    beta: float = 0.0
    """Weight of the per-token KL to the reference policy. 0 = no KL term (no reference needed)."""
    kl: str = "k3"
    """KL estimator: k1 = logp - ref_logp (unbiased, can be negative; in the loss its gradient, grad logp, averages to
    zero over the policy's own samples, so it barely pulls toward the reference); k3 = e^(ref-logp) - (ref-logp) - 1
    (>= 0, the default)."""
    aggregation: str = "grpo"
    """How token losses become one number: grpo, dapo or dr_grpo (see the module docstring)."""
    normalize_std: bool = True
    """Divide group advantages by the group's std (GRPO); False = Dr. GRPO."""
    max_new_tokens: int | None = None
    """The rollout length limit; dr_grpo divides by sequences x max_new_tokens."""
    rollout_correction: str = "none"
    """none | tis | mis: correct the policy-gradient term for the rollout/train mismatch with w = pi_train(old) /
    pi_rollout per token (the trainer's and the rollout decoder's log-probs of the sampled token, same weights):
    tis weights it by min(w, cap) (truncated importance sampling); mis weights it by w and zeroes the tokens whose w
    exceeds the cap (masked importance sampling). The KL term is not weighted."""
    rollout_correction_cap: float = 2.0

    def validate(self, where: str = "grpo") -> list[str]:
        """Every problem, one string each, named `where.field` (empty list = valid)."""
        p = []
        if not 0.0 <= self.clip_low < 1.0:
            p.append(f"{where}.clip_low ({self.clip_low}) must be in [0, 1) so that 1 - clip_low > 0")
        if self.clip_high < 0:
            p.append(f"{where}.clip_high ({self.clip_high}) must be >= 0")
        if self.beta < 0:
            p.append(f"{where}.beta ({self.beta}) must be >= 0")
        if self.kl not in KL_ESTIMATORS:
            p.append(f"{where}.kl: {self.kl!r} is not an estimator (choose one of {', '.join(KL_ESTIMATORS)})")
        if self.aggregation not in AGGREGATIONS:
            p.append(f"{where}.aggregation: {self.aggregation!r} is unknown (choose one of {', '.join(AGGREGATIONS)})")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            p.append(f"{where}.rollout_correction: {self.rollout_correction!r} is unknown (choose one of "
                     f"{', '.join(ROLLOUT_CORRECTIONS)})")
        if not self.rollout_correction_cap > 0:
            p.append(f"{where}.rollout_correction_cap ({self.rollout_correction_cap}) must be > 0 (the largest "
                     "importance weight kept; 2.0 is usual)")
        if self.aggregation == "dr_grpo" and (self.max_new_tokens is None or self.max_new_tokens < 1):
            p.append(f"{where}.max_new_tokens ({self.max_new_tokens}) must be >= 1 with aggregation dr_grpo "
                     "(it is the loss's constant denominator); set it to the rollout length limit")
        return p


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (prompts x group_size,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size ({group_size}) must be >= 1 and divide the number of rewards "
                         f"({rewards.numel()})")
    return rewards.view(-1, group_size)  # (prompts, G)


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(N,) rewards -> (N,) advantages: reward minus its group's mean, divided by the group's std + eps
    when normalize_std (GRPO; std with Bessel's correction, as TRL), not divided for Dr. GRPO.
    A group whose rewards are all equal gets advantage 0."""
    if normalize_std and group_size < 2:
        raise ValueError(f"group_size ({group_size}) must be >= 2 to normalize by the group's std")
    r = _groups(rewards if rewards.is_floating_point() else rewards.float(), group_size)  # (prompts, G)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def keep_mask(rewards: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """DAPO dynamic sampling: (N,) rewards -> (prompts,) bool, True where a group's rewards are not all
    equal (max - min > atol). Groups of equal rewards have zero advantage and teach nothing.
    Per sample: keep_mask(...).repeat_interleave(group_size)."""
    r = _groups(rewards, group_size)
    return (r.max(dim=1).values - r.min(dim=1).values) > atol


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: logits (B, T, V), targets (B, T) -> (B, T), float32.

    Already aligned: logits[:, t] scores targets[:, t] (the caller shifts: logits[:, :-1], ids[:, 1:]).
    Upcast to float32 because ratios exp(logp - old_logp) amplify bf16 rounding."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must agree "
                         "on (B, T)")
    logits = logits.float()
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)  # (B, T)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position: logits (B, T, V) -> (B, T), float32."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(dim=-1)  # (B, T)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k1 = logp - ref_logp: unbiased for KL(policy || ref) but negative on some tokens."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = e^d - d - 1 with d = ref_logp - logp: unbiased, always >= 0, lower variance."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, 0).sum() / mask.sum().clamp(min=1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, cfg: GRPOLossConfig, ref_logp: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, token_normalizer: float | None = None,
                rollout_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate (+ beta x KL to the reference), aggregated per `cfg.aggregation`.

    logp, old_logp, ref_logp, entropy, response_mask: (B, T). advantages: (B,) per sequence or (B, T).
    Per token: -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) + beta kl, ratio = e^(logp - old_logp).
    Only logp carries gradient (old_logp, ref_logp and advantages are detached).
    token_normalizer (dapo only): divide by this instead of this micro-batch's response-token count, e.g.
    the global count / micro-batches averaged by DeepSpeed, so that average is the global token mean.

    Returns (loss, stats); stats are detached 0-d tensors, means over response tokens: clip_frac_low
    (ratio < 1 - clip_low with A < 0: clipped, no gradient), clip_frac_high (ratio > 1 + clip_high with
    A > 0), ratio_mean, and kl_mean / entropy_mean when ref_logp / entropy are given; with cfg.rollout_correction
    (rollout_logp: the rollout's own log-probs of the tokens, (B, T)), rollout_corrected_frac: the share of tokens
    whose weight was truncated (tis) or that were masked (mis)."""
    problems = cfg.validate()
    if problems:
        raise ValueError("; ".join(problems))
    if cfg.rollout_correction != "none" and rollout_logp is None:
        raise ValueError(f"grpo.rollout_correction {cfg.rollout_correction} needs rollout_logp (the rollout's own "
                         "log-probs of the sampled tokens)")
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError(f"grpo.beta ({cfg.beta}) > 0 needs ref_logp (the reference policy's log-probs); "
                         "pass it or set beta to 0")
    if token_normalizer is not None and cfg.aggregation != "dapo":
        raise ValueError(f"token_normalizer applies to aggregation dapo only, not {cfg.aggregation!r}")
    for name, t in (("old_logp", old_logp), ("response_mask", response_mask), ("ref_logp", ref_logp),
                    ("entropy", entropy), ("rollout_logp", rollout_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logp's {tuple(logp.shape)} (B, T)")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected (B,) or (B, T) "
                         f"with (B, T) = {tuple(logp.shape)}")

    on = response_mask.bool()  # (B, T)
    mask = on.to(logp.dtype)
    # Zero the inputs off the response before exp: padding log-probs may be -inf or garbage, and
    # masking after exp would still leak NaN (inf * 0) into the loss and its gradient.
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp_r = torch.where(on, logp, zero)
    adv = advantages.detach().to(logp.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    ratio = torch.exp(logp_r - torch.where(on, old_logp.detach(), zero))  # (B, T), 1 off the response
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    corrected = None
    if cfg.rollout_correction != "none":  # w = pi_train(old) / pi_rollout per token, no gradient
        w = torch.exp(torch.where(on, old_logp.detach() - rollout_logp.detach(), zero))
        if cfg.rollout_correction == "tis":
            per_token = per_token * w.clamp(max=cfg.rollout_correction_cap)
            corrected = w > cfg.rollout_correction_cap
        else:  # mis
            corrected = w > cfg.rollout_correction_cap
            per_token = torch.where(corrected, zero, per_token * w)

    kl = None
    if ref_logp is not None:
        kl_fn = kl_k1 if cfg.kl == "k1" else kl_k3
        kl = kl_fn(logp_r, torch.where(on, ref_logp.detach(), zero))  # (B, T), 0 off the response
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl

    summed = torch.where(on, per_token, zero)  # (B, T)
    if cfg.aggregation == "grpo":
        loss = (summed.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    elif cfg.aggregation == "dapo":
        denom = token_normalizer if token_normalizer is not None else mask.sum().clamp(min=1)
        loss = summed.sum() / denom
    else:  # dr_grpo
        loss = summed.sum() / (logp.shape[0] * cfg.max_new_tokens)

    with torch.no_grad():
        adv_full = adv.expand_as(ratio)
        stats = {
            "clip_frac_low": _masked_mean(((ratio < 1 - cfg.clip_low) & (adv_full < 0)).to(mask.dtype), mask),
            "clip_frac_high": _masked_mean(((ratio > 1 + cfg.clip_high) & (adv_full > 0)).to(mask.dtype), mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
        if kl is not None:
            stats["kl_mean"] = _masked_mean(kl, mask)
        if entropy is not None:
            stats["entropy_mean"] = _masked_mean(entropy.detach(), mask)
        if corrected is not None:
            stats["rollout_corrected_frac"] = _masked_mean(corrected.to(mask.dtype), mask)
    return loss, stats

"""Rollouts for GRPO, on DeepSpeed's rollout API (`deepspeed.runtime.rollout`: RolloutRequest in,
RolloutBatch out).

Two engines, chosen by `grpo.rollout`:
  local   every rank keeps a persistent plain Hugging Face copy of the policy on its own device
          (engine/decoder.py: static KV cache, decode step compiled once on CUDA), refreshed in place from the
          policy before each rollout (dense weights all-gathered from ZeRO-3, experts all-gathered over the
          expert-parallel group), and generates with no collectives at all (ranks stop at different lengths).
          Fast; needs the model to fit one device next to the training state.
  engine  DeepSpeed's HybridEngineRollout: generation through the ZeRO-3 + AutoEP engine itself, all ranks in
          lockstep for max_new_tokens steps (EOS handled afterwards), for models that do not fit one device.
"""
from __future__ import annotations

import torch
from deepspeed.runtime.rollout import HybridEngineRollout, RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

from . import head
from .decoder import Decoder, copy_weights, empty_copy
from .metrics import print0


def local_copy(module: torch.nn.Module, device, decode_experts: str = "auto") -> torch.nn.Module:
    """A plain (unpartitioned) HF model holding the policy's current weights (collective over ranks)."""
    model = empty_copy(module, device, decode_experts)
    copy_weights(model, module)
    return head.install(model)


class DecoderRollout(RolloutEngine):
    """Rollouts from a persistent Decoder of `batch_size` rows and `cache_len` slots, built at the first sync."""

    name = "local"

    def __init__(self, engine, tokenizer, batch_size: int, cache_len: int, decode_experts: str = "auto",
                 min_new_tokens: int = 0, record_routes: bool = False, decode_attention: str = "auto"):
        self.engine, self.tokenizer, self.decoder = engine, tokenizer, None
        self.record_routes = record_routes  # keep each token's expert ids (engine/routing.py): last_routes
        self.min_new_tokens = min_new_tokens  # grpo.min_new_tokens: EOS masked before it when sampling (not greedy eval)
        self.batch_size, self.cache_len, self.decode_experts = batch_size, cache_len, decode_experts
        self.decode_attention = decode_attention
        self.decode_steps, self.decode_s = 0, 0.0  # over the last generate call
        self.last_logps = None  # the last generate call's sampled-token log-probs (Decoder.generate)
        self.last_routes = None  # record_routes: (N, T, L, k) expert ids of the last rollout's tokens, beside its ids

    def sync_weights(self, step: int) -> None:  # noqa: ARG002
        if self.decoder is None:
            self.decoder = Decoder(self.engine.module, self.engine.device, self.batch_size, self.cache_len,
                                   self.decode_experts, record_routes=self.record_routes,
                                   attention=self.decode_attention)
            print0(self.decoder.summary())
        else:
            self.decoder.refresh(self.engine.module)

    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        if self.decoder is None:
            self.sync_weights(0)
        n, prompt_len = sampling.n_samples_per_prompt, request.prompt_ids.shape[1]
        ids = request.prompt_ids.repeat_interleave(n, dim=0)  # (B*G, T_p), left-padded
        attn = request.prompt_attention_mask.repeat_interleave(n, dim=0)
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        parts, logps, routes, self.decode_steps, self.decode_s = [], [], [], 0, 0.0
        for i in range(0, len(ids), self.batch_size):  # more rows than the decoder's batch: in turns
            parts.append(self.decoder.generate(ids[i:i + self.batch_size], attn[i:i + self.batch_size],
                                               sampling.max_new_tokens, eos, pad, sampling.temperature,
                                               sampling.top_p,
                                               min_new_tokens=self.min_new_tokens if sampling.temperature > 0 else 0))
            self.decode_steps += self.decoder.decode_steps
            self.decode_s += self.decoder.decode_s
            logps.append(self.decoder.last_logps)
            if self.record_routes:
                routes.append(self.decoder.last_routes(*parts[-1].shape))
        width = max(p.shape[1] for p in parts)
        out = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts])
        # the sampled tokens' log-probs at the decoder, (B*G, T_r) beside the responses (None when greedy)
        self.last_logps = None if logps[0] is None else torch.cat(
            [torch.nn.functional.pad(x, (0, width - prompt_len - x.shape[1])) for x in logps])
        self.last_routes = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, 0, 0, width - x.shape[1])) for x in routes]) \
            if routes else None
        return RolloutBatch(input_ids=out, attention_mask=response_attention(out, attn, prompt_len, self.tokenizer),
                            response_start_idx=torch.full((out.shape[0],), prompt_len, device=out.device))

    def shutdown(self) -> None:
        """Nothing to free between steps: the decoder persists so that its compiled step is reused."""

    def memory_bytes(self) -> int:
        return self.decoder.memory_bytes() if self.decoder is not None else 0


def response_attention(out: torch.Tensor, prompt_attn: torch.Tensor, prompt_len: int, tokenizer) -> torch.Tensor:
    """1 on real prompt tokens and on response tokens up to and including the first EOS."""
    resp = out[:, prompt_len:]  # (N, T_r)
    is_eos = resp == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return torch.cat([prompt_attn, (~after_eos).long()], dim=1)


def build_rollout(kind: str, engine, tokenizer, batch_size: int, cache_len: int,
                  decode_experts: str = "auto", min_new_tokens: int = 0, record_routes: bool = False,
                  decode_attention: str = "auto") -> RolloutEngine:
    if kind == "local":
        return DecoderRollout(engine, tokenizer, batch_size, cache_len, decode_experts, min_new_tokens, record_routes,
                              decode_attention)
    return HybridEngineRollout(engine, tokenizer)

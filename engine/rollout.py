"""Rollouts for GRPO, on DeepSpeed's rollout API (`deepspeed.runtime.rollout`: RolloutRequest in,
RolloutBatch out).

Two engines, chosen by `grpo.rollout`:
  local   every rank gathers the policy once per rollout phase into a plain Hugging Face model on its own
          device (dense weights all-gathered from ZeRO-3, experts all-gathered over the expert-parallel
          group and laid out as HF's fused expert tensors), generates with no collectives at all (so ranks
          may stop at different lengths), and frees the copy afterwards. Fast; needs the model to fit.
  engine  DeepSpeed's HybridEngineRollout: generation through the ZeRO-3 + AutoEP engine itself, all ranks in
          lockstep for max_new_tokens steps (EOS handled afterwards), for models that do not fit one device.
"""
from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist
from deepspeed.runtime.rollout import HybridEngineRollout, RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

from .export import AUTOEP_NAMES


def _gathered(p: torch.nn.Parameter) -> torch.Tensor:
    import deepspeed

    with deepspeed.zero.GatheredParameters([p]):  # a collective: every rank calls it for every parameter
        return p.data.detach().clone()


def gather_hf_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's full weights and buffers under Hugging Face names (AutoEP layers mapped back)."""
    names = AUTOEP_NAMES[module.config.model_type]
    moe = {name: m for name, m in module.named_modules() if getattr(m, "_is_autoep_layer", False)}
    state: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        state[name] = _gathered(p)
    for name, b in module.named_buffers():
        state[name] = b.detach().clone()
    for path, layer in moe.items():
        experts = {}
        for w in ("w1", "w2", "w3"):
            local = state.pop(f"{path}.experts.{w}")  # (E_local, out, in)
            if layer.ep_size > 1:
                parts = [torch.empty_like(local) for _ in range(layer.ep_size)]
                dist.all_gather(parts, local, group=layer.ep_group)  # ep rank k holds experts [k*E/ep, ...)
                local = torch.cat(parts)
            experts[w] = local
        state[f"{path}.experts.gate_up_proj"] = torch.cat([experts["w1"], experts["w3"]], dim=1)  # (E, 2F, H)
        state[f"{path}.experts.down_proj"] = experts["w2"]  # (E, H, F)
        for key in [k for k in state if k.startswith(path + ".")]:
            rest = key[len(path) + 1:]
            for ours, theirs in (("router.gate.", f"{names['router']}."),
                                 ("router.e_score_correction_bias", f"{names['router']}.e_score_correction_bias"),
                                 ("shared_experts_gate.", f"{names['shared_experts_gate']}."),
                                 ("shared_experts.", f"{names['shared_experts']}.")):
                if rest.startswith(ours):
                    state[f"{path}.{theirs}{rest[len(ours):]}"] = state.pop(key)
                    break
        state.pop(f"{path}.tokens_per_expert", None)
    return state


# transformers' generate swaps grouped_mm experts for batched_mm while decoding on GPUs. batched_mm copies the
# top-k experts' weights of every token: with 64 sequences and top-4, 3 GB per MoE layer per decoded token on
# the 2.6B recipe. The same grouped_mm kernel under its own name is left alone.
DECODE_GROUPED_MM = "grouped_mm_decode"


def _experts_for_decode(kind: str) -> str:
    if kind != "grouped_mm":
        return kind
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    ExpertsInterface.register(DECODE_GROUPED_MM, grouped_mm_experts_forward)
    return DECODE_GROUPED_MM


def local_copy(module: torch.nn.Module, device, decode_experts: str = "grouped_mm") -> torch.nn.Module:
    """A plain (unpartitioned) HF model holding the policy's current weights, for generation only."""
    state = gather_hf_state(module)
    config = copy.deepcopy(module.config)  # its own: use_cache and the experts kernel must not leak into training
    config.use_cache = True
    with torch.device("meta"):
        model = type(module)(config)  # the HF class; built directly, so no zero.Init
    model.to_empty(device=device)
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = set(own) - set(state)
    if missing:
        raise RuntimeError(f"local rollout copy: no policy weights for {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, t in own.items():
            src = state[name]
            if src.shape != t.shape:  # transformers' transposed fused-expert layout
                src = src.transpose(1, 2)
            t.copy_(src)
    model.eval()
    model.set_experts_implementation(_experts_for_decode(decode_experts))
    return model


class LocalCopyRollout(RolloutEngine):
    name = "local"

    def __init__(self, engine, tokenizer, decode_experts: str = "grouped_mm"):
        self.engine, self.tokenizer, self.model = engine, tokenizer, None
        self.decode_experts = decode_experts

    def sync_weights(self, step: int) -> None:  # noqa: ARG002
        self.model = local_copy(self.engine.module, self.engine.device, self.decode_experts)

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        if self.model is None:
            self.sync_weights(0)
        n, prompt_len = sampling.n_samples_per_prompt, request.prompt_ids.shape[1]
        ids = request.prompt_ids.repeat_interleave(n, dim=0)  # (B*G, T_p), left-padded
        attn = request.prompt_attention_mask.repeat_interleave(n, dim=0)
        out = self.model.generate(ids, attention_mask=attn, max_new_tokens=sampling.max_new_tokens,
                                  do_sample=sampling.temperature > 0, temperature=max(sampling.temperature, 1e-6),
                                  top_p=sampling.top_p, top_k=0, eos_token_id=self.tokenizer.eos_token_id,
                                  pad_token_id=self.tokenizer.pad_token_id, use_cache=True,
                                  synced_gpus=False)  # stops at EOS, no collectives (ZeRO-3 would turn sync on)
        return RolloutBatch(input_ids=out, attention_mask=response_attention(out, attn, prompt_len, self.tokenizer),
                            response_start_idx=torch.full((out.shape[0],), prompt_len, device=out.device))

    def shutdown(self) -> None:
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def response_attention(out: torch.Tensor, prompt_attn: torch.Tensor, prompt_len: int, tokenizer) -> torch.Tensor:
    """1 on real prompt tokens and on response tokens up to and including the first EOS."""
    resp = out[:, prompt_len:]  # (N, T_r)
    is_eos = resp == tokenizer.eos_token_id
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return torch.cat([prompt_attn, (~after_eos).long()], dim=1)


def build_rollout(kind: str, engine, tokenizer, decode_experts: str = "grouped_mm") -> RolloutEngine:
    if kind == "local":
        return LocalCopyRollout(engine, tokenizer, decode_experts)
    return HybridEngineRollout(engine, tokenizer)


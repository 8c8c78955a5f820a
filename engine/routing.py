"""Expert routing, recorded and replayed (grpo.routing_replay).

The rollout decoder and the trainer pick experts independently: the decoder is a bf16 Hugging Face copy with its
own expert kernels, the trainer runs AutoEP layers under ZeRO-3, and small numeric differences flip top-k choices.
So the tokens the policy is trained on went through other experts than the ones that sampled them.

Routes: (N, T, L, k) global expert ids per sequence, token position, MoE layer (in layer order) and choice, as the
decoder recorded them (engine/decoder.py). `Router` is installed on the policy's AutoEP routers; per micro-batch it
  - replays: the layer dispatches to the recorded experts; their weights come from the live router (its gate, its
    score function, renormalised and scaled as the family's router does), so the router still gets a gradient;
  - records what the layer dispatched and what the live router would have chosen, for the agreement metrics.
With `use(None)` (or outside `use`) the routers behave as DeepSpeed's own.
"""
from __future__ import annotations

import contextlib
import re
import types

import torch
import torch.nn.functional as F

ROUTE_DTYPE = torch.int16  # expert ids of a recorded rollout: up to 32767 experts, a quarter of int64's memory


def moe_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The AutoEP layers of a policy in layer order (the order the decoder records in)."""
    found = [(name, m) for name, m in module.named_modules() if getattr(m, "_is_autoep_layer", False)]
    return [m for _, m in sorted(found, key=lambda x: int(re.search(r"layers\.(\d+)\.", x[0] + ".").group(1)))]


class Router:
    """Replay and recording on every AutoEP router of `module` (installed once; inert until `use`)."""

    def __init__(self, module: torch.nn.Module):
        self.layers = moe_layers(module)
        if not self.layers:
            raise ValueError("grpo.routing_replay: the policy has no MoE (AutoEP) layer to replay")
        self.replay: torch.Tensor | None = None  # (L, T, k): the micro-batch's recorded ids, tokens flattened
        self.record = False
        self.used: list[torch.Tensor | None] = []  # per layer (T, k): the ids dispatched at the last forward
        self.live: list[torch.Tensor | None] = []  # per layer (T, k): the live router's own choice
        for slot, layer in enumerate(self.layers):
            r = layer.router
            r._route_ctl, r._route_slot = self, slot
            r._own_forward = r.forward
            r.forward = types.MethodType(_routed_forward, r)

    @contextlib.contextmanager
    def use(self, routes: torch.Tensor | None, record: bool = False):
        """Within the block, forwards (and activation-checkpointing recomputes) replay `routes` ((B, S, L, k) for
        the micro-batch's (B, S) tokens; None: the live routers choose), and with `record` keep what they did."""
        if routes is not None and routes.shape[2] != len(self.layers):
            raise RuntimeError(f"routing replay: routes of {routes.shape[2]} MoE layers for a policy with "
                               f"{len(self.layers)}")
        # (L, T, k) in the recording's dtype (int16): each layer's ids contiguous, widened to int64 one layer at a time
        self.replay = None if routes is None else routes.reshape(-1, *routes.shape[2:]).transpose(0, 1).contiguous()
        self.record = record
        self.used, self.live = [None] * len(self.layers), [None] * len(self.layers)
        try:
            yield self
        finally:
            self.replay, self.record = None, False

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(used, live), each (T, L, k): what the last forward in `use(..., record=True)` dispatched and what the
        live routers chose."""
        return torch.stack(self.used, 1), torch.stack(self.live, 1)


def _routed_forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
    """TokenChoiceTopKRouter.forward, with the selection taken from the replayed routes when there are some.
    Returns (top_scores (T, k), selected (T, k), tokens per expert (E,)) as DeepSpeed's router does."""
    from deepspeed.moe.ep_count import count_tokens_per_expert

    ctl, slot = self._route_ctl, self._route_slot
    if ctl.replay is None:
        out = self._own_forward(x, expert_bias)
        if ctl.record:
            ctl.used[slot] = ctl.live[slot] = out[1].detach()
        return out
    ids = ctl.replay[slot].long()
    if ids.shape[0] != x.shape[0]:
        raise RuntimeError(f"routing replay: {ids.shape[0]} recorded tokens for a forward over {x.shape[0]}")
    logits = self.gate(x).to(torch.float32)  # the router's math from here on, on the recorded experts
    if self.score_func == "sigmoid":
        scores = torch.sigmoid(logits)
    elif self.score_func == "softmax":
        scores = F.softmax(logits, dim=1)
    else:
        raise NotImplementedError(f"routing replay: unknown score function {self.score_func}")
    if ctl.record:  # metrics only: what the live router would have chosen from these scores (its bias and groups)
        ctl.used[slot], ctl.live[slot] = ids, _live_choice(self, scores.detach(), expert_bias)
    top = scores.gather(1, ids)
    if self.route_norm:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * self.route_scale, ids, count_tokens_per_expert(ids, self.num_experts)


def _live_choice(router, scores: torch.Tensor, expert_bias: torch.Tensor | None) -> torch.Tensor:
    """TokenChoiceTopKRouter's selection from its scores (T, E): biases added, groups limited, top-k."""
    choice = scores if expert_bias is None else scores + expert_bias
    if router.e_score_correction_bias is not None:
        choice = choice + router.e_score_correction_bias.unsqueeze(0)
    if router.num_expert_groups is not None:
        choice = router._get_node_limited_routing_scores(choice)
    return torch.topk(choice, k=router.top_k, dim=-1, sorted=False)[1]


def agreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[(token, layer) choices equal, tokens with every layer equal, tokens] over the masked tokens: a, b (T, L, k)
    expert ids (a choice is the set of k experts), mask (T,)."""
    same = (a.sort(-1).values == b.sort(-1).values.to(a.dtype)).all(-1)  # (T, L)
    m = mask.float()  # a product, not an index: no wait for the device
    return torch.stack([(same.float().mean(-1) * m).sum(), (same.all(-1).float() * m).sum(), m.sum()])


def has_moe(hf_config) -> bool:
    """Whether a Hugging Face config has at least one routed-expert layer (what replay needs)."""
    n = next((getattr(hf_config, a) for a in ("n_routed_experts", "num_experts", "num_local_experts")
              if getattr(hf_config, a, None)), 0)
    if not n:
        return False
    dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
    only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1  # Qwen-MoE: every step-th layer is sparse
    return any(i >= dense and i not in only and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))

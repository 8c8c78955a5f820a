"""Expert load: measure it, and balance it without an auxiliary loss (DeepSeek-V3).

AutoEP layers count the tokens each expert received (`tokens_per_expert`, this rank's tokens, all
experts). After each optimizer step we sum the counts over ranks, and, when `train.balance_rate` > 0,
nudge each expert's routing bias towards balance: bias += rate * sign(mean_load - load). The bias only
changes which experts are chosen, not the weights given to their outputs. For DeepSeek-V3 that bias is
the model's own `gate.e_score_correction_bias` buffer, which AutoEP's router adds before top-k, so it is
saved in checkpoints and exported with the model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def moe_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if getattr(m, "_is_autoep_layer", False)]


class ExpertBalance:
    """`rows`/`total` (pipeline mode): each local MoE layer's row among all `total` MoE layers of the model. Every
    rank all-reduces the full (total, experts) table, its own rows filled, so each layer's counts are summed over
    the ranks that hold it (its stage) and every rank sees every layer's load."""

    def __init__(self, module: torch.nn.Module, rate: float, rows: list[int] | None = None, total: int | None = None,
                 num_experts: int = 0, device: torch.device | str = "cpu"):
        self.layers = moe_layers(module)
        self.rows = list(range(len(self.layers))) if rows is None else rows
        self.total = len(self.layers) if total is None else total
        self.num_experts = self.layers[0].num_experts if self.layers else num_experts
        self.device = self.layers[0].tokens_per_expert.device if self.layers else device
        self.rate = rate
        if rate > 0:
            for layer in self.layers:
                bias = getattr(layer.router, "e_score_correction_bias", None)
                if bias is None:
                    raise ValueError("train.balance_rate > 0 needs a routing-bias buffer "
                                     "(DeepSeek-V3's e_score_correction_bias); this model has none")
                layer.router.e_score_correction_bias = bias.float()
        self._window = None

    @torch.no_grad()
    def after_step(self) -> None:
        """Sum this step's expert counts over ranks; update the routing biases; keep counts for logging."""
        if not self.total:
            return
        counts = torch.zeros(self.total, self.num_experts, device=self.device)  # (layers, experts)
        for row, layer in zip(self.rows, self.layers):
            counts[row] = layer.tokens_per_expert.float()
            layer.tokens_per_expert.zero_()
        if dist.is_initialized():
            dist.all_reduce(counts)
        self._window = counts if self._window is None else self._window + counts
        if self.rate > 0:
            for row, layer in zip(self.rows, self.layers):
                load = counts[row]
                bias = layer.router.e_score_correction_bias
                bias += self.rate * torch.sign(load.mean() - load).to(bias)

    def load_stats(self) -> dict:
        """max/mean tokens per expert for each MoE layer since the last call (1.0 = perfectly balanced)."""
        if self._window is None:
            return {}
        ratio = (self._window.max(dim=1).values / self._window.mean(dim=1).clamp(min=1e-9)).tolist()
        self._window = None
        return {"expert_load_max_over_mean": [round(r, 3) for r in ratio]}

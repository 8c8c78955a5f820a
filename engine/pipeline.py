"""Pipeline-parallel mode: the same Hugging Face model cut into DeepSpeed PipelineModule stages.

Selected by a DS config with a "pipeline" section (ds_configs/pipe.json). The PipelineModule is a flat list:

    0            Embed            model.embed_tokens
    1 .. L       DecoderLayerPipe transformers' own decoder layer i-1 (+ its rotary embedding and causal mask)
    L + 1        Head             model.norm; its loss applies lm_head (engine/head.py), transformers' causal LM loss

and DeepSpeed gives each stage a contiguous run of them, balanced by decoder layers (stage 0 also holds the
embedding, the last stage the head). Only activations (B, T, hidden) cross stages, which is the point of the
mode: ZeRO-3 all-gathers every parameter every step, a pipeline sends one hidden-state tensor per micro-batch
between neighbouring stages, so it suits nodes joined by a slow network.

Memory: the full model is only ever built on the meta device; each rank materializes its own stage's layers.
Weights equal the ZeRO-3 path's for the same seed: transformers initializes a ZeRO-3 model on rank 0, module
by module in a fixed order (integrations/deepspeed.py: initialize_weights_zero3); every pipeline rank replays
that same order from the same seed, initializing its own modules in place and, for the others, one module's
own parameters at a time in a scratch copy that is dropped at once (peak: one module, e.g. one layer's experts).

Experts: AutoEP replaces each stage's MoE blocks (named `<i>.layer.mlp` here, hence the DS config's
"moe_layer_pattern"). Its expert-parallel groups are built inside each stage (DeepSpeed's groups take the
pipeline size into account), so autoep_size must divide the ranks per stage: experts never span stages.
"""
from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from . import head
from .config import ModelConfig
from .ds_config import PARTITION, uses_expert_parallel


def is_pipeline(ds: dict) -> bool:
    return "pipeline" in ds


def num_stages(ds: dict) -> int:
    return int(ds["pipeline"]["stages"]) if is_pipeline(ds) else 1


def data_coords(ds: dict, rank: int, world: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of `rank`: DeepSpeed's PipeDataParallelTopology puts
    rank = stage * dp + d, so the ranks of one stage are contiguous (one stage per node keeps dp on NVLink)."""
    dp = world // num_stages(ds)
    return rank % dp, dp


def _materialize(template: nn.Module, config, device) -> nn.Module:
    """A real copy of a meta-device module (uninitialized memory; init_like_zero3 fills it)."""
    return copy.deepcopy(template, memo={id(config): config}).to_empty(device=device)


class Embed(nn.Module):
    def __init__(self, template: nn.Module, config, device="cpu"):
        super().__init__()
        self.embed_tokens = _materialize(template, config, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # (B, T) -> (B, T, hidden)


class DecoderLayerPipe(nn.Module):
    """One transformers decoder layer; recomputes positions, rotary embedding and causal mask locally (cheap),
    so that only the hidden states travel between stages."""

    def __init__(self, template: nn.Module, rotary_cls: type, config, device="cpu"):
        super().__init__()
        self.config = config
        self.layer = _materialize(template, config, device)
        # Buffers only, computed from the config. Kept out of the module tree: DeepSpeed casts a bf16 model's
        # buffers to bf16, and the HF model keeps inv_freq in fp32 (ZeRO-3 does not cast it).
        self._rotary = [rotary_cls(config=config)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        rotary = self._rotary[0]
        if rotary.inv_freq.device != hidden.device:
            rotary.to(hidden.device)
        return self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                          position_embeddings=rotary(hidden, position_ids=position_ids))


class Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module, config, device="cpu"):
        super().__init__()
        self.norm = _materialize(norm, config, device)
        self.lm_head = _materialize(lm_head, config, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)  # (B, T, H): the output layer runs inside the loss, a chunk of tokens at a time

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss_fn: transformers' causal LM loss (labels[:, 1:] from positions [:-1], mean over
        tokens), through engine/head.py without (tokens x vocabulary) logits."""
        targets = labels[:, 1:].reshape(-1)
        total = head.cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets)
        return total / (targets != -100).sum().clamp(min=1)


def hf_key(name: str, num_layers: int) -> str:
    """A PipelineModule state-dict key -> the Hugging Face key (`3.layer.mlp.gate.weight` ->
    `model.layers.2.mlp.gate.weight`)."""
    idx, _, rest = name.partition(".")
    i = int(idx)
    if i == 0:
        return f"model.{rest}"                       # embed_tokens.*
    if i <= num_layers:
        return f"model.layers.{i - 1}.{rest[len('layer.'):]}"
    return rest if rest.startswith("lm_head.") else f"model.{rest}"  # norm.*


def build_pipeline(m: ModelConfig, ds: dict, tokenizer=None, dtype: torch.dtype = torch.float32, seed: int = 0,
                   activation_checkpointing: bool = False, hf_config=None):
    """The PipelineModule for this rank: only its own stage's layers exist, initialized as the ZeRO-3 path
    initializes the whole model from `seed`. Activation checkpointing (the recipe's train.activation_checkpointing)
    recomputes every decoder layer in backward unless the DS config's pipeline.activation_checkpoint_interval
    sets another interval."""
    import torch._dynamo  # noqa: F401  (as engine/model.py)
    from deepspeed.pipe import LayerSpec, PipelineModule
    from transformers import AutoModelForCausalLM

    from .model import make_hf_config

    cfg = hf_config or make_hf_config(m, tokenizer)
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=m.attn_implementation)
    full.config.use_cache = False
    base = full.model
    rotary_cls = type(base.rotary_emb)
    pipe_cfg = ds["pipeline"]
    specs = ([LayerSpec(Embed, base.embed_tokens, full.config)]
             + [LayerSpec(DecoderLayerPipe, layer, rotary_cls, full.config) for layer in base.layers]
             + [LayerSpec(Head, base.norm, full.lm_head, full.config)])
    interval = int(pipe_cfg.get("activation_checkpoint_interval", 0)) or int(activation_checkpointing)
    module = PipelineModule(specs, num_stages=int(pipe_cfg["stages"]), loss_fn=None,  # set below: Head.loss
                            partition_method=pipe_cfg.get("partition", PARTITION),
                            activation_checkpoint_interval=interval,
                            checkpointable_layers=["DecoderLayerPipe"])  # recomputing Embed would lose its grads
    module.loss_fn = next((f.loss for f in module.forward_funcs if isinstance(f, Head)), None)  # the last stage's
    module.config = full.config  # AutoEP reads num_experts / top_k / routing from model.config
    module.moe_layer_ids = [i for i, layer in enumerate(base.layers) if hasattr(layer.mlp, "experts")]

    # Which meta modules this rank holds for real: the templates its stage's layers were copied from.
    owned: dict[int, nn.Module] = {}
    for idx, layer in zip(range(module._local_start, module._local_stop), module.forward_funcs):
        templates = ([base.embed_tokens] if idx == 0 else [base.norm, full.lm_head] if idx > len(base.layers)
                     else [base.layers[idx - 1]])
        reals = [layer.embed_tokens] if idx == 0 else [layer.norm, layer.lm_head] if idx > len(base.layers) \
            else [layer.layer]
        for t, r in zip(templates, reals):
            owned.update({id(a): b for a, b in zip(t.modules(), r.modules())})
    torch.manual_seed(seed)
    init_like_zero3(full, owned)
    return module


@torch.no_grad()
def init_like_zero3(full: nn.Module, owned: dict[int, nn.Module]) -> None:
    """Replay transformers' initialize_weights_zero3 over the meta model `full`: the same modules, the same
    order, the same RNG draws. Modules in `owned` (meta id -> real module) are initialized in place; every
    other module with parameters is initialized in a scratch copy holding only its own parameters, which is
    dropped at once, so the RNG advances exactly as on the ZeRO-3 path's rank 0."""
    from transformers.initialization import guard_torch_init_functions
    from transformers.modeling_utils import PreTrainedModel

    device = next((p.device for r in owned.values() for p in r.parameters()), torch.device("cpu"))
    custom = full.is_remote_code()

    def visit(module: nn.Module, fn) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        if id(module) in owned:
            fn(owned[id(module)], custom)
        elif next(module.parameters(recurse=False), None) is not None:
            scratch = copy.deepcopy(module).to_empty(device=device, recurse=False)
            fn(scratch, custom)
            del scratch

    with guard_torch_init_functions():
        visit(full, full._initialize_weights)


def balance_layout(engine) -> dict:
    """ExpertBalance's arguments in pipeline mode (none otherwise): the row of each of this stage's AutoEP layers
    (named `<i>.layer.mlp`, i = 1 + decoder layer) among all MoE layers of the model."""
    ids, cfg = getattr(engine.module, "moe_layer_ids", None), getattr(engine.module, "config", None)
    if ids is None or not uses_expert_parallel(engine.config):
        return {}
    names = [name for name, m in engine.module.named_modules() if getattr(m, "_is_autoep_layer", False)]  # as moe_layers
    return {"rows": [ids.index(int(name.split(".")[0]) - 1) for name in names], "total": len(ids),
            "num_experts": getattr(cfg, "n_routed_experts", None) or cfg.num_experts, "device": engine.device}


def sum_over_stages(engine, *values: float) -> tuple[float, ...]:
    """Per-rank counts (e.g. parameters) summed over the pipeline stages; unchanged without a pipeline."""
    if not is_pipeline(engine.config):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=engine.device)
    torch.distributed.all_reduce(t)  # every stage counted once per data-parallel replica
    return tuple((t / engine.grid.data_parallel_size).tolist())


def train_step(engine, batches, accum: int, position: int) -> tuple[int, torch.Tensor]:
    """One optimizer step of the pipeline: the first and last stages each read `accum` micro-batches (inputs and
    labels are the same token ids; the loss shifts them); the returned loss is the step's mean on every rank."""
    pairs = ((ids, ids) for _, ids in itertools.islice(batches, accum))
    loss = engine.train_batch(pairs)
    return position + accum, loss.detach()

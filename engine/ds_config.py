"""DeepSpeed JSON configs: read, check against the world and the model, resolve documented "auto" values.

The file goes to DeepSpeed as written. The only values the engine fills in are ones the file leaves as
"auto" (documented in docs/configs.md):
  expert_parallel.autoep_size = "auto"  -> the largest divisor of the expert count that divides the
                                           world size and fits in one node (all-to-all stays intra-node)
  train_micro_batch_size_per_gpu = "auto"
  gradient_accumulation_steps = "auto"  -> from the device's memory and the recipe (engine/auto_batch.py,
                                           docs/configs.md); bin/pretrain.py, bin/bench.py, and
                                           bin/grpo.py (the micro-batch fitted to the device, the
                                           accumulation making up the rollout batch: engine/grpo.py)
  train_batch_size = "auto"             -> micro_batch x grad_accum x data-parallel world size
  optimizer.params.lr = "auto"          -> the recipe's train.lr (the peak of its warmup + cosine schedule)
  expert_parallel.combine_impl = "auto" -> "fused_weighted_sum" (AutoEP's Triton kernel for the top-k weighted
                                           sum) on CUDA unless DeepSpeed refuses it there (fused_combine_blocker),
                                           DeepSpeed's "weighted_sum" otherwise; a missing key counts as "auto",
                                           as it does for DeepSpeed
  zero_optimization.stage3_max_live_parameters, stage3_max_reuse_distance, stage3_prefetch_bucket_size = "auto"
                                        -> on a single GPU rank without parameter offload 1e10, 1e10, 5e8
                                           (nothing gathered is released within a step); otherwise DeepSpeed's
                                           defaults (ZERO3_GATHER)
  zero_optimization.leaf_module = "auto" -> ZeRO-3: every decoder layer is one leaf module (gathered,
                                           released and reduced whole: resolve_leaf_modules); below ZeRO-3
                                           dropped
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import typing
from pathlib import Path

from .config import ConfigError, Recipe

# Pipeline mode (engine/pipeline.py) names its stages' MoE blocks `<i>.layer.mlp`, so AutoEP finds them only with
# this expert_parallel.moe_layer_pattern; a pipeline section without "partition" balances decoder layers.
MOE_LAYER_PATTERN = r"\d+\.layer\.mlp"
PARTITION = "type:DecoderLayerPipe"
PIPELINE_ARCHS = ("deepseek_v3", "qwen3_moe")  # engine/pipeline.py's stages, tested against ZeRO-3 for these


# Sections the engine reads as objects (a `null` or a list there is refused before anything reads it).
SECTIONS = ("zero_optimization", "optimizer", "bf16", "fp16", "expert_parallel", "pipeline", "compile", "checkpoint",
            "activation_checkpointing", "tensor_parallel", "data_types")
SUBSECTIONS = {"zero_optimization": ("offload_optimizer", "offload_param"), "optimizer": ("params",)}
# Top-level keys of a DeepSpeed config (with deepspeed.runtime.constants' own): a key that is none of them but close to
# one is a misspelling DeepSpeed would silently ignore (a misspelled zero_optimization trains with ZeRO off).
TOP_LEVEL = (*SECTIONS, "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "scheduler", "steps_per_print", "wall_clock_breakdown", "memory_breakdown",
             "tensorboard", "csv_monitor", "wandb", "comet", "flops_profiler", "comms_logger", "data_types", "aio",
             "prescale_gradients", "gradient_predivide_factor", "communication_data_type", "sparse_gradients",
             "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "amp", "torch_autocast", "dump_state",
             "elasticity", "autotuning", "data_efficiency", "curriculum_learning", "compression_training",
             "sequence_parallel_size", "tensor_parallel", "nebula", "weight_quantization", "hybrid_engine",
             "dataloader_drop_last", "disable_allgather", "seed", "timers", "graph_harvesting",
             "use_data_before_expert_parallelism")


def misspelled_keys(cfg: dict) -> list[str]:
    """A line per top-level key that DeepSpeed does not read but that is close to one it does."""
    import difflib

    try:
        from deepspeed.runtime import constants

        known = set(TOP_LEVEL) | {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    except ImportError:
        known = set(TOP_LEVEL)
    out = []
    for key in cfg:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.8) if key not in known else []
        if near:
            out.append(f"{key}: not a DeepSpeed setting (DeepSpeed would ignore it); did you mean {near[0]}?")
    return out


def section_key_problems(cfg: dict) -> list[str]:
    """A line per key inside a section that DeepSpeed does not read. Its own models refuse any such key with a
    traceback on every rank after start-up (zero_optimization and its offload subsections, bf16, fp16, compile), and
    so does the Adam optimizer it builds (optimizer.params: a TypeError), so those are refused whatever the key;
    AutoEP's parser ignores one silently (expert_parallel), so there only a key close to one it reads is refused, as
    at the top level. Each line names the nearest known key."""
    import difflib

    import pydantic
    from deepspeed.compile.config import CompileConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    def closest(key, known, cutoff: float = 0.6) -> str | None:
        found = difflib.get_close_matches(str(key), known, n=1, cutoff=cutoff)
        return found[0] if found else None

    def near(key, known) -> str:
        found = closest(key, known)
        return f"; did you mean {found}?" if found else "; remove it"

    def names(model) -> list[str]:  # a pydantic model's keys, aliases included
        return sorted({n for name, f in model.model_fields.items() for n in (name, f.alias) if n})

    def model_at(model, loc):  # the pydantic model a nested key belongs to (offload_optimizer.device: its own)
        for part in loc[:-1]:
            field = model.model_fields.get(part) or next((f for f in model.model_fields.values() if f.alias == part),
                                                         None)
            kinds = [t for t in (field.annotation, *typing.get_args(field.annotation)) if isinstance(t, type)
                     and issubclass(t, pydantic.BaseModel)] if field else []
            if not kinds:
                return None
            model = kinds[0]
        return model

    out = []
    for section, model in (("zero_optimization", DeepSpeedZeroConfig), ("bf16", DeepSpeedBF16Config),
                           ("fp16", DeepSpeedFP16Config), ("compile", CompileConfig)):
        if not isinstance(cfg.get(section), dict):
            continue
        try:
            model(**cfg[section])
        except pydantic.ValidationError as e:
            for err in e.errors():
                if err["type"] == "extra_forbidden":
                    owner = model_at(model, err["loc"])
                    key = ".".join(map(str, (section, *err["loc"])))
                    out.append(f"{key}: not a DeepSpeed setting{near(err['loc'][-1], names(owner) if owner else [])}")
        except Exception:  # noqa: BLE001  (a value DeepSpeed's own validators reject: its message at start-up)
            pass
    ep = cfg.get("expert_parallel")
    if isinstance(ep, dict):
        from deepspeed.module_inject.auto_ep_config import AutoEPConfig

        known = [f.name for f in dataclasses.fields(AutoEPConfig) if not f.name.startswith("_")]
        out += [f"expert_parallel.{k}: not a DeepSpeed setting (AutoEP would ignore it); did you mean {c}?"
                for k in ep if k not in known and (c := closest(k, known, 0.8))]
    opt = cfg.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    if isinstance(params, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw"):
        known = adam_params()
        out += [f"optimizer.params.{k}: not a parameter of DeepSpeed's Adam optimizers{near(k, known)}"
                for k in params if k not in known]
    return out


@functools.cache
def adam_params() -> tuple[str, ...]:
    """What optimizer.params may hold for type Adam/AdamW: the keys DeepSpeed takes itself and the parameters of every
    Adam it may build (FusedAdam, DeepSpeedCPUAdam with offload, torch's AdamW/Adam with torch_adam)."""
    import inspect

    import torch

    classes = [torch.optim.AdamW, torch.optim.Adam]
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        classes += [FusedAdam, DeepSpeedCPUAdam]
    except ImportError:
        pass
    keys = {"adam_w_mode", "torch_adam", "fp32_optimizer_states", "foreach"}
    for c in classes:
        keys |= {n for n, p in inspect.signature(c.__init__).parameters.items()
                 if n not in ("self", "params", "model_params") and p.kind == p.POSITIONAL_OR_KEYWORD}
    return tuple(sorted(keys))


# ZeRO-3's gather settings where the file says "auto": (single rank, otherwise). On a single rank a ZeRO-3 gather is a
# view of the rank's own partition, so keeping every gathered parameter until the step ends costs no memory and saves
# the host the release and re-fetch bookkeeping on every module call (+10.5% for deepseek_2b6's pretraining on one
# H200: docs/benchmarks.md, "ZeRO-3 levers"). On several ranks each would hold the whole gathered model at the
# forward/backward turn, which the "auto" memory model does not count; with offloaded parameters it would keep them
# all on the GPU. There DeepSpeed's defaults, and on CPU ranks too: a one-rank CPU run of the tiny default was 6% slower
# with the single-rank values (2,525-2,542 against 2,666-2,729 tokens/s, 40 steps, 2 cores).
ZERO3_GATHER = {"stage3_max_live_parameters": (10**10, 10**9),
                "stage3_max_reuse_distance": (10**10, 10**9),
                "stage3_prefetch_bucket_size": (5 * 10**8, 5 * 10**7)}


def read_ds_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        shipped = Path(__file__).resolve().parents[1] / "ds_configs"
        same_name = (shipped / path.name).is_file() and not path.is_absolute()
        hint = f"the shipped one is {shipped / path.name}" if same_name else f"the shipped ones are in {shipped}"
        raise ConfigError(f"DeepSpeed config {path}: no such file ({hint})")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {path}: malformed JSON at line {e.lineno} column {e.colno}: "
                          f"{e.msg}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"DeepSpeed config {path}: expected a JSON object at the top level")
    return cfg


def auto_autoep_size(num_experts: int, world_size: int, ranks_per_node: int) -> int:
    limit = math.gcd(world_size, max(ranks_per_node, 1))
    return max(d for d in range(1, limit + 1) if num_experts % d == 0 and world_size % d == 0 and limit % d == 0)


def resolve_ds_config(cfg: dict, recipe: Recipe, world_size: int, ranks_per_node: int,
                      where: str = "DeepSpeed config", device: str = "cpu", auto_batch=None) -> dict:
    """Check `cfg` for this world and model; return a copy with "auto" values filled in.

    `device` is the accelerator the ranks run on (parallel.device_kind(): "cuda", "cpu", "rocm", ...).
    `auto_batch` (an engine.auto_batch.AutoBatch) resolves "auto" micro-batch / accumulation (and says what it
    chose); without one they are refused.

    Every problem is collected and raised together as one ConfigError line.
    """
    cfg = copy.deepcopy(cfg)
    p = [f"{k}: must be an object ({{...}}), not {json.dumps(cfg[k])}" for k in SECTIONS
         if k in cfg and not isinstance(cfg[k], dict)] + misspelled_keys(cfg)
    p += [f"{k}.{sub}: must be an object ({{...}}), not {json.dumps(cfg[k][sub])}" for k, subs in SUBSECTIONS.items()
          if isinstance(cfg.get(k), dict) for sub in subs if cfg[k].get(sub) is not None
          and not isinstance(cfg[k][sub], dict)]
    p += section_key_problems(cfg) if not p else []
    if p:  # what follows reads these as objects
        raise ConfigError(f"{where}: " + "; ".join(p))
    if (cfg.get("bf16") or {}).get("enabled") and (cfg.get("fp16") or {}).get("enabled"):
        p.append("bf16 and fp16 are both enabled; keep one (bf16 on GPUs that have it)")
    stage = zero_stage(cfg)
    if "pipeline" not in cfg and stage not in (1, 2, 3):
        p.append(f"zero_optimization.stage ({stage!r}) must be 1, 2 or 3")
    stages = 1
    if "pipeline" in cfg:
        stages, found = check_pipeline(cfg, recipe, stage)
        p += found
    p += resolve_optimizer(cfg, recipe, device)
    if recipe.train.stochastic_rounding is True and "optimizer" in cfg and stochastic_rounding_blocker(cfg):
        p.append(f"train.stochastic_rounding: true, but {stochastic_rounding_blocker(cfg)}; set it to auto or false, "
                 "or use ds_configs/zero2_bf16_states.json")
    p += resolve_expert_parallel(cfg, recipe, world_size, stages, ranks_per_node, device)
    resolve_zero3_gather(cfg, world_size, device)
    p += resolve_leaf_modules(cfg, recipe)
    p += resolve_compile(cfg, recipe)
    p += resolve_batch_size(cfg, world_size, stages, recipe, device, auto_batch)
    p += stray_auto(cfg)
    if p:
        raise ConfigError(f"{where}: " + "; ".join(p))
    return cfg


def whole_model_on_one_gpu(cfg: dict, world_size: int, device: str) -> bool:
    """One CUDA rank whose ZeRO-3 parameters stay on it: every "shard" is the whole tensor, so what ZeRO-3 does per
    module call buys nothing (ZERO3_GATHER's single-rank values; GRPO's plain-copy reference). `device`: the device
    type ("cuda", "cpu", ...); on other devices nothing was measured."""
    z = cfg.get("zero_optimization") or {}
    offload = (z.get("offload_param") or {}).get("device", "none") not in (None, "none")
    return world_size == 1 and not offload and device == "cuda"


def resolve_zero3_gather(cfg: dict, world_size: int, device: str = "cpu") -> None:
    """ZERO3_GATHER's "auto" values: the single-rank ones where whole_model_on_one_gpu."""
    z = cfg.get("zero_optimization")
    if not isinstance(z, dict):
        return
    single = whole_model_on_one_gpu(cfg, world_size, device)
    for key, (one, default) in ZERO3_GATHER.items():
        if z.get(key) == "auto":
            z[key] = one if single else default


def resolve_leaf_modules(cfg: dict, recipe: Recipe) -> list[str]:
    """zero_optimization.leaf_module "auto" (the shipped ZeRO-3 files): each decoder layer `model.layers.<i>` is a
    ZeRO-3 leaf module, by name (parallel.check_leaf_modules checks that the model has them).

    DeepSpeed's ZeRO-3 hooks every module by default: a gather before its forward and its backward and a release
    after each, autograd functions on its inputs and outputs, a reduce hook per parameter. A DeepSeek layer has ~60
    modules (each Linear and norm of its attention and shared experts, AutoEP's router and experts), so one GRPO step
    of the 12-layer grpo_2b6 runs ~1,400 module hooks and a hook per parameter tensor, on the host; on one H200 the
    ZeRO-3 policy pass waited on them (docs/benchmarks.md, 2026-12-04 late). A leaf is gathered whole before its
    forward and its backward and released after them, and its gradients are reduced together when its backward
    ends (DeepSpeed's `leaf_module`, made for MoE blocks): one decoder layer, the unit FSDP and torchtitan shard
    by. On several ranks one layer's gathered parameters and not-yet-reduced gradients are what it can add to the
    peak, against per-module hooks. Decoder layers take their hidden states positionally, which DeepSpeed's leaf
    gradient hook needs (a full backward hook: an attention module, called with keyword arguments only and tried as
    a leaf, had its gradients reduced before they existed). Below ZeRO-3 "auto" is dropped; anything else than "auto"
    goes to DeepSpeed as written."""
    z = cfg.get("zero_optimization")
    if not isinstance(z, dict) or "leaf_module" not in z:
        return []
    leaf = z["leaf_module"]
    if leaf is None:  # null: as if the key were not there (DeepSpeed's hook on every module)
        del z["leaf_module"]
        return []
    if leaf != "auto":
        return [] if isinstance(leaf, dict) else [
            f'zero_optimization.leaf_module ({leaf!r}) must be "auto" (each decoder layer one ZeRO-3 leaf) or an '
            'object such as {"names": ["model.layers.0"]}; remove it for a hook on every module']
    if z.get("stage") == 3:
        z["leaf_module"] = {"names": [f"model.layers.{i}" for i in range(recipe.model.num_layers)],
                            "classes": [], "name_suffixes": []}
    else:
        del z["leaf_module"]
    return []


def resolve_optimizer(cfg: dict, recipe: Recipe, device: str = "cpu") -> list[str]:
    """The recipe drives the LR schedule; the file's optimizer keeps its lr, "auto" taking the recipe's train.lr.

    On CPU ranks an Adam/AdamW without optimizer offload runs as torch's AdamW ("torch_adam": true, unless the file
    says otherwise) instead of DeepSpeed's FusedAdam, whose CPU build is a ~110 s C++ compile on a new 2-core
    machine and which is no faster for the small models a CPU trains. GPUs keep FusedAdam; offloaded optimizer
    states keep DeepSpeedCPUAdam."""
    p = []
    if "scheduler" in cfg:
        p.append("scheduler: remove it; the recipe's train.warmup_steps/min_lr_ratio/max_steps drive the LR "
                 "schedule (the optimizer's lr stays in this file)")
    if (cfg.get("zero_optimization") or {}).get("zenflow"):
        p.append("zero_optimization.zenflow: not supported: DeepSpeed 0.19.8's ZenFlow hands this engine's model back "
                 "from deepspeed.initialize with its matrices' values reordered (the first loss already differs, the "
                 "second is NaN); remove it and offload with ds_configs/zero3_offload.json (offload_optimizer.ratio) "
                 "or keep the states on the GPU with zero2_bf16_states.json")
    ratio = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        p.append(f"zero_optimization.offload_optimizer.ratio ({ratio!r}) must be a number from 0 to 1: the share of "
                 "the optimizer DeepSpeed keeps on the host")
    elif ratio < 1.0 and zero_stage(cfg) != 3:
        p.append(f"zero_optimization.offload_optimizer.ratio ({ratio}): DeepSpeed offloads part of the optimizer under "
                 "ZeRO-3 only (ZeRO-1/2 offload all of it); remove ratio, or use ds_configs/zero3_offload.json")
    if "optimizer" not in cfg:
        p.append('optimizer: missing; add e.g. {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}}')
    else:
        if not known_optimizer(cfg["optimizer"].get("type")):
            p.append(f"optimizer.type: {cfg['optimizer'].get('type')!r} is neither one of DeepSpeed's optimizers nor "
                     "torch.optim's (e.g. AdamW)")
        params = cfg["optimizer"]["params"] = cfg["optimizer"].get("params") or {}
        if params.get("lr", "auto") == "auto":
            params["lr"] = recipe.train.lr
        offload = (cfg.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
        adam = str(cfg["optimizer"].get("type", "")).lower() in ("adam", "adamw")
        if device == "cpu" and adam and offload in (None, "none") and "torch_adam" not in params:
            params["torch_adam"] = True
    return p


SR_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"}  # what engine/optim.py's AdamWSR takes


def stochastic_rounding_blocker(cfg: dict) -> str | None:
    """Why train.stochastic_rounding cannot apply to this DS config (None: it can): it rounds bf16 master weights
    in an AdamW (decoupled weight decay) that runs on the accelerator."""
    bf16 = cfg.get("bf16") or {}
    if not (bf16.get("enabled") and bf16.get("bf16_master_weights_and_grads")):
        return "the DS config keeps fp32 master weights (nothing to round; bf16.bf16_master_weights_and_grads is off)"
    offload = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    if offload not in (None, "none"):
        return "the optimizer is offloaded (DeepSpeedCPUAdam updates the weights on the CPU)"
    opt = cfg.get("optimizer") or {}
    params = opt.get("params") or {}
    if str(opt.get("type", "")).lower() not in ("adam", "adamw") or params.get("adam_w_mode", True) is not True:
        return f"the optimizer is {opt.get('type')!r} (only Adam/AdamW with decoupled weight decay)"
    other = sorted(set(params) - SR_PARAMS)
    if other:
        return f"optimizer.params.{other[0]} is not one AdamWSR takes ({', '.join(sorted(SR_PARAMS - {'torch_adam'}))})"
    return None


def uses_stochastic_rounding(cfg: dict, train) -> bool:
    """train.stochastic_rounding resolved against the DS config (auto: wherever it can apply)."""
    return train is not None and train.stochastic_rounding is not False and stochastic_rounding_blocker(cfg) is None


def known_optimizer(name) -> bool:
    """Whether DeepSpeed can build optimizer.type `name`: its own (by lowercase name) or one of torch.optim's."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return isinstance(name, str) and (name.lower() in DEEPSPEED_OPTIMIZERS or
                                      isinstance(getattr(torch.optim, name, None), type))


def resolve_expert_parallel(cfg: dict, recipe: Recipe, world_size: int, stages: int, ranks_per_node: int,
                            device: str) -> list[str]:
    """The expert_parallel section against the model and the ranks of a stage; fills autoep_size and combine_impl."""
    ep = cfg.get("expert_parallel")
    if not (ep and ep.get("enabled")):
        return []
    p, pipe = [], "pipeline" in cfg
    size = ep.get("autoep_size", 1)
    n = recipe.model.num_experts
    # Expert groups live inside one pipeline stage (DeepSpeed builds them per stage): with a pipeline the
    # experts are spread over the ranks of a stage, never across stages.
    group = world_size // stages if world_size % stages == 0 else world_size
    where_ep = (f"the ranks per pipeline stage ({world_size} ranks / {stages} stages = {group}; experts cannot "
                "span pipeline stages)" if pipe else f"the world size ({world_size})")
    if size == "auto":
        size = auto_autoep_size(n, group, ranks_per_node)
        ep["autoep_size"] = size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        p.append(f'expert_parallel.autoep_size ({size!r}) must be a positive integer or "auto"')
    else:
        if n % size:
            p.append(f"expert_parallel.autoep_size ({size}) must divide model.num_experts ({n}); "
                     f'use one of {[d for d in range(1, n + 1) if n % d == 0 and group % d == 0]} or "auto"')
        if group % size:
            p.append(f"expert_parallel.autoep_size ({size}) must divide {where_ep}; use \"auto\" to derive it")
    preset = ep.get("preset_model")
    if preset is not None and preset != recipe.model.arch:
        p.append(f"expert_parallel.preset_model ({preset!r}) does not match model.arch "
                 f"({recipe.model.arch!r}); set it to {recipe.model.arch!r} or remove it")
    if ep.get("combine_impl", "auto") == "auto":
        # The default weighted sum materialises [tokens x top_k x hidden] in fp32 (zeros, index_put, mul, sum);
        # the Triton kernel does it in one pass: +14% tokens/s on one H200 (docs/benchmarks.md). CUDA only, and not
        # where DeepSpeed refuses it (validate_autoep_config): folded tensor parallelism, expert tensor parallelism,
        # DeepEP across ranks (which combines the rows itself).
        fused = device == "cuda" and not fused_combine_blocker(cfg)
        ep["combine_impl"] = "fused_weighted_sum" if fused else "weighted_sum"
    return p


def fused_combine_blocker(cfg: dict) -> str | None:
    """Why DeepSpeed would refuse expert_parallel.combine_impl "fused_weighted_sum" with this file, or None."""
    ep = cfg.get("expert_parallel") or {}
    tp = (cfg.get("tensor_parallel") or {}).get("autotp_size", 1)
    size = ep.get("autoep_size", 1)
    if isinstance(tp, int) and tp > 1:
        return f"tensor_parallel.autotp_size {tp}"
    etp = ep.get("expert_tensor_parallel_size", 1)
    if isinstance(etp, int) and etp > 1:
        return f"expert_parallel.expert_tensor_parallel_size {etp}"
    if ep.get("comm_backend") == "deepep" and isinstance(size, int) and size > 1:
        return 'expert_parallel.comm_backend "deepep"'
    return None


def resolve_compile(cfg: dict, recipe: Recipe) -> list[str]:
    """train.compile against what DeepSpeed can compile; compiles around the AutoEP blocks unless told not to.
    Under ZeRO-3 with decoder-layer leaves, train.compile: true compiles the layers in the engine instead
    (zero3_compiles_layers). Runs after resolve_leaf_modules."""
    why_not = compile_blocker(cfg)
    if recipe.train.compile is not False and not why_not:
        cfg.setdefault("compile", {}).setdefault("autoep_non_moe", True)
    if recipe.train.compile is True and why_not and not zero3_compiles_layers(cfg):
        return [f"train.compile: true needs {why_not}, or ZeRO-3 with zero_optimization.leaf_module \"auto\" "
                "(each decoder layer a leaf, as the shipped ZeRO-3 files say); use ds_configs/zero2.json or "
                "zero3.json, or set train.compile to auto"]
    return []


def zero3_compiles_layers(cfg: dict) -> bool:
    """ZeRO-3 whose leaf modules are the decoder layers (leaf_module "auto", resolved): no hook of DeepSpeed's sits
    inside a layer, so each layer's forward can be compiled as under ZeRO-1/2 (engine/pretrain.py
    compile_layers), the hooks running around it. Not with a pipeline section or parameter offload."""
    z = cfg.get("zero_optimization") or {}
    leaf = z.get("leaf_module")
    names = leaf.get("names") if isinstance(leaf, dict) else None
    offload = (z.get("offload_param") or {}).get("device", "none") not in ("none", None)
    return (zero_stage(cfg) == 3 and "pipeline" not in cfg and not offload and bool(names)
            and all(n.startswith("model.layers.") for n in names))


BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
AUTO_KEYS = ("train_batch_size", *BATCH_KEYS)  # the top-level keys where the engine fills in "auto"


def resolve_batch_size(cfg: dict, world_size: int, stages: int, recipe: Recipe | None = None, device: str = "cpu",
                       auto_batch=None) -> list[str]:
    """DeepSpeed needs train_batch = micro x accum x data-parallel size; "auto" is filled in from the other two.

    "auto" micro-batch / accumulation come from `auto_batch` (engine/auto_batch.py) when the caller supports them.
    """
    pipe = "pipeline" in cfg
    total = cfg.get("train_batch_size", "auto")
    dp = world_size // stages if world_size % stages == 0 else None
    autos = [k for k in BATCH_KEYS if cfg.get(k) == "auto"]
    if autos:
        keys = " and ".join(f'{k} "auto"' for k in autos)
        if auto_batch is None or recipe is None:
            return [f"{keys}: resolved by bin/pretrain.py, bin/grpo.py and bin/bench.py only (from the device's "
                    "memory); write a number here"]
        if pipe:
            return [f"{keys}: not supported with a pipeline section (the memory model covers ZeRO without a "
                    "pipeline); write a number (ds_configs/pipe.json has 4 x 4)"]
        if dp is not None:
            found = auto_batch.resolve(cfg, recipe, dp, device)
            if found:
                return found
    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps", 1)
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        return [f'train_micro_batch_size_per_gpu ({micro!r}) must be a positive integer or "auto"']
    if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
        return [f'gradient_accumulation_steps ({accum!r}) must be a positive integer or "auto"']
    if dp is None:
        return [f"pipeline.stages ({stages}) must divide the world size ({world_size})"]
    if total == "auto":
        cfg["train_batch_size"] = micro * accum * dp
    elif total != micro * accum * dp:
        return [f"train_batch_size ({total!r}) != train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({accum}{' micro-batches in the pipeline' if pipe else ''}) x "
                f"data-parallel size ({dp}{f' = {world_size} ranks / {stages} stages' if pipe else ''}) = "
                f"{micro * accum * dp}; fix one of them or set train_batch_size to \"auto\""]
    return []


def stray_auto(cfg: dict) -> list[str]:
    """"auto" left where neither the engine nor DeepSpeed fills it in: DeepSpeed reads the top-level scalars and the
    optimizer's params as they are (a Hugging Face Trainer config's "auto" there would reach DeepSpeed as a string).
    The sections DeepSpeed parses with its own models (zero_optimization, bf16, expert_parallel, ...) treat "auto"
    as their default, so they are left alone."""
    where = [k for k, v in cfg.items() if v == "auto" and k not in AUTO_KEYS]
    where += [f"optimizer.params.{k}" for k, v in ((cfg.get("optimizer") or {}).get("params") or {}).items()
              if v == "auto"]
    if not where:
        return []
    return [f'{", ".join(where)}: "auto" is not supported there (the engine fills in "auto" only for '
            f"{', '.join(AUTO_KEYS)}, optimizer.params.lr, expert_parallel.autoep_size and "
            "expert_parallel.combine_impl); write a value"]


def check_pipeline(cfg: dict, recipe: Recipe, zero_stage) -> tuple[int, list[str]]:
    """The pipeline section's problems, and its stage count (1 when it has none usable)."""
    pipe, p = cfg["pipeline"], []
    if not isinstance(pipe, dict):
        return 1, [f'pipeline: expected an object like {{"stages": 2}}, got {pipe!r}']
    stages = pipe.get("stages")
    layers = recipe.model.num_layers
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        p.append(f"pipeline.stages ({stages!r}) must be a positive integer (one stage per node suits slow "
                 "inter-node links)")
        stages = 1
    elif stages > layers:
        p.append(f"pipeline.stages ({stages}) is more than model.num_layers ({layers}): every stage needs at least "
                 f"one decoder layer; use at most {layers} stages")
    if zero_stage != 1:
        # Stage 0 is refused too: its gradient clipping (deepspeed.runtime.utils.clip_grad_norm_ with the pipeline's
        # grid) counts only the first stage's gradients, so clipping compares the threshold with part of the norm.
        p.append(f"zero_optimization.stage ({zero_stage}) cannot be combined with a pipeline section: the pipeline "
                 "runs with ZeRO stage 1 (DeepSpeed's PipelineEngine takes 0 or 1, and its stage-0 gradient clipping "
                 "sees only the first stage's gradients); set stage 1, or remove the pipeline section to use "
                 "ZeRO-2/3 (ds_configs/zero3.json)")
    part = pipe.get("partition", PARTITION)
    if part != "uniform" and not (isinstance(part, str) and part.startswith("type:")):
        p.append(f'pipeline.partition ({part!r}) must be "uniform" or "type:<layer class regex>" (default: '
                 "balance decoder layers); \"parameters\" would build every stage's layers on every rank")
    elif isinstance(stages, int) and 1 <= stages <= layers:
        p += check_stage_layout(part, stages, recipe, uses_expert_parallel(cfg))
    interval = pipe.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        p.append(f"pipeline.activation_checkpoint_interval ({interval!r}) must be an integer >= 0")
    ep = cfg.get("expert_parallel") or {}
    if ep.get("enabled") and ep.get("moe_layer_pattern") != MOE_LAYER_PATTERN:
        p.append(f"expert_parallel.moe_layer_pattern ({ep.get('moe_layer_pattern')!r}): in pipeline mode the MoE "
                 f"blocks are named '<layer>.layer.mlp'; set it to {json.dumps(MOE_LAYER_PATTERN)} so AutoEP "
                 "finds them")
    if recipe.model.init_from:
        p.append(f"model.init_from ({recipe.model.init_from}) is not supported in pipeline mode yet; start from "
                 "random init, or train with ds_configs/zero3.json")
    elif recipe.model.arch not in PIPELINE_ARCHS:
        p.append(f"model.arch {recipe.model.arch}: pipeline mode builds its stages for {' and '.join(PIPELINE_ARCHS)} "
                 "only; train it with ds_configs/zero3.json or zero2.json")
    return stages, p


def stage_layout(partition: str, stages: int, num_layers: int) -> list[tuple[int, int]]:
    """DeepSpeed's PipelineModule partition (_partition_layers) of [Embed, decoder layer 0..L-1, Head] into
    `stages` runs, as (start, stop) indices of that list. Raises ValueError for a regex that is invalid or matches
    none of the three layer classes (engine/pipeline.py)."""

    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    names = ["Embed"] + ["DecoderLayerPipe"] * num_layers + ["Head"]
    if partition == "uniform":
        parts = partition_uniform(num_items=len(names), num_parts=stages)
    else:
        try:
            pattern = re.compile(partition.split(":", 1)[1], re.IGNORECASE)
        except re.error as e:
            raise ValueError(f"is not a valid regular expression ({e})") from None
        weights = [int(bool(pattern.search(n))) for n in names]
        if not any(weights):
            raise ValueError("matches none of the pipeline's layer classes (Embed, DecoderLayerPipe, Head)")
        parts = partition_balanced(weights=weights, num_parts=stages)
    return list(zip(parts[:-1], parts[1:]))


def check_stage_layout(partition: str, stages: int, recipe: Recipe, expert_parallel: bool) -> list[str]:
    """Problems of the stage layout DeepSpeed will build: a bad partition regex and, with AutoEP, a stage with no MoE
    layer (AutoEP raises on every rank of such a stage)."""
    L, dense = recipe.model.num_layers, recipe.model.first_dense_layers
    try:
        layout = stage_layout(partition, stages, L)
    except ValueError as e:
        return [f"pipeline.partition ({partition!r}) {e}; use the default (leave it out: one decoder layer per "
                "weight) or \"uniform\""]
    s = moe_less_stage(layout, L, dense) if expert_parallel else None
    if s is None:
        return []
    a, b = layout[s]
    layers = [i - 1 for i in range(a, b) if 1 <= i <= L]
    if layers:
        span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
        held = f"dense decoder {span}, model.first_dense_layers being {dense}"
    else:
        held = f"the {'embedding' if a == 0 else 'head'} only"
    n = max((k for k in range(2, L + 1) if moe_less_stage(stage_layout(partition, k, L), L, dense) is None), default=1)
    fix = f"use at most {n} stages" if n > 1 else "use the default partition (leave pipeline.partition out)"
    return [f"pipeline: stage {s} of {stages} would hold no MoE layer ({held}; partition {partition!r}), "
            f"and AutoEP needs one on every stage; {fix}"]


def moe_less_stage(layout: list[tuple[int, int]], num_layers: int, dense: int) -> int | None:
    """The first stage of `layout` (stage_layout) that holds no MoE layer (decoder layers from `dense` on), or None."""
    return next((s for s, (a, b) in enumerate(layout) if not any(dense <= i - 1 < num_layers for i in range(a, b))),
                None)


def compile_blocker(cfg: dict) -> str | None:
    """Why DeepSpeed cannot compile around the AutoEP blocks under this DS config (None: it can)."""
    zero = cfg.get("zero_optimization", {}) or {}
    offload = [k for k in ("offload_optimizer", "offload_param")
               if (zero.get(k) or {}).get("device", "none") not in ("none", None)]
    if not uses_expert_parallel(cfg):
        return "AutoEP (an expert_parallel section with enabled: true)"
    if "pipeline" in cfg:
        return "no pipeline section (DeepSpeed does not compile AutoEP models in pipeline mode yet)"
    if zero_stage(cfg) not in (1, 2):
        return f"ZeRO stage 1 or 2 (this config has stage {zero_stage(cfg)})"
    if offload:
        return f"no offload (this config sets zero_optimization.{offload[0]})"
    return None


def auto_compiles_layers(cfg: dict) -> bool:
    """Pretraining's train.compile "auto" on CUDA compiles the decoder layers whole: around the AutoEP blocks through
    DeepSpeed (compile_blocker None: ZeRO-1/2), or under ZeRO-3 with AutoEP and decoder-layer leaves each layer's
    forward in the engine, AutoEP eager (zero3_compiles_layers; engine/pretrain.py compile_layers; measured in
    docs/benchmarks.md). Elsewhere "auto" compiles what engine/parallel.py compiles_parameter_free says, or nothing."""
    return compile_blocker(cfg) is None or (zero3_compiles_layers(cfg) and uses_expert_parallel(cfg))


def compiles_layers(compile_, cfg: dict, device: str) -> bool:
    """Whether pretraining compiles its decoder layers whole: train.compile true, or "auto" on a GPU ("cuda", "rocm")
    where auto_compiles_layers. One rule for engine/pretrain.py (what it compiles) and engine/auto_batch.py (which
    memory calibration the run follows)."""
    if compile_ == "auto":
        return device in ("cuda", "rocm") and auto_compiles_layers(cfg)
    return bool(compile_)


def grpo_compiles_layers(compile_, cfg: dict, device: str) -> bool:
    """Whether GRPO's policy compiles its decoder layers whole (engine/pretrain.py compile_layers, one trace for any
    length): where pretraining does (compiles_layers), except "auto" under ZeRO-1/2, which keeps to the parameter-free
    functions there (engine/parallel.py compiles_parameter_free: the layers' compile did not pay at GRPO's step counts;
    measured in docs/benchmarks.md)."""
    return compiles_layers(compile_, cfg, device) and (compile_ is True or zero_stage(cfg) == 3)


def zero_stage(cfg: dict):
    return (cfg.get("zero_optimization") or {}).get("stage", 0)


def uses_expert_parallel(cfg: dict) -> bool:
    return bool((cfg.get("expert_parallel") or {}).get("enabled"))


def ep_size(cfg: dict) -> int:
    return int((cfg.get("expert_parallel") or {}).get("autoep_size", 1)) if uses_expert_parallel(cfg) else 1

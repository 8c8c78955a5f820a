"""What every checkpoint layout is read with and checked against (the bottom of engine/export/).

DeepSpeed's files are read without running DeepSpeed code (`load`); the model is the one recorded in the
checkpoint's engine_state.json (`recorded_hf_config`), and the export must match the key set and shapes of a freshly
built transformers model of that config (`hf_keys`, `check_against_config`). AutoEP's module names go back to the
model's own with `autoep_namer`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

STATE_FILE = "engine_state.json"  # engine/checkpoint.py
INIT_DIR = "init_model"  # engine/checkpoint.py: a model.init_from run's config.json and generation_config.json
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

# AutoEP renames a Hugging Face MoE block's children (deepspeed/module_inject/auto_ep_layer.py): the router
# (preset `router_pattern`) becomes `router.gate`, shared experts (preset `shared_experts_pattern` /
# `shared_experts_gate_pattern`) become `shared_experts` / `shared_experts_gate`. The presets' names, from
# deepspeed/module_inject/auto_ep_presets/*.py, by Hugging Face model_type:
AUTOEP_NAMES = {
    "deepseek_v3": {"router": "gate", "shared_experts": "shared_experts", "shared_experts_gate": None},
    "deepseek_v2": {"router": "gate", "shared_experts": "shared_experts", "shared_experts_gate": None},
    "qwen3_moe": {"router": "gate", "shared_experts": "shared_expert", "shared_experts_gate": "shared_expert_gate"},
    "qwen3_5_moe_text": {"router": "gate", "shared_experts": "shared_expert",
                         "shared_experts_gate": "shared_expert_gate"},
    "mixtral": {"router": "gate", "shared_experts": None, "shared_experts_gate": None},
}


def autoep_names(cfg, tag_dir: Path) -> dict:
    """AUTOEP_NAMES of the recorded model's type; a type without an entry is refused (guessed names would write a
    model whose shared experts are missing)."""
    names = AUTOEP_NAMES.get(cfg.model_type)
    if names is None:
        raise ExportError(f"{tag_dir}: the recorded model's type {cfg.model_type!r} has no known AutoEP names "
                          f"(known: {', '.join(AUTOEP_NAMES)}); it cannot be exported")
    return names


class ExportError(Exception):
    """Bad input: the message is one line saying what, where and how to fix it."""


class Opaque:
    """Inert stand-in for a DeepSpeed object pickled into a checkpoint (ZeroStageEnum, LossScaler, ...).

    Lets `torch.load(weights_only=True)` read DeepSpeed's files without importing or running DeepSpeed code.
    """

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def load(path: Path, mmap: bool = False):
    """torch.load(weights_only=True) of a DeepSpeed file; its DeepSpeed objects become Opaque stand-ins."""
    import torch

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        foreign = [n for n in names if not n.startswith("deepspeed.")]
        if foreign:
            raise ExportError(f"{path}: holds objects that are not tensors or DeepSpeed state ({', '.join(foreign)}); "
                              "refusing to unpickle it")
        with torch.serialization.safe_globals([(Opaque, n) for n in names]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001  (zipfile, pickle and torch raise many kinds)
        first = re.split(r"(?<=\.) ", (str(e).strip().splitlines() or [""])[0])[0][:160]
        raise ExportError(f"{path}: cannot read it ({type(e).__name__}: {first}); the file is truncated or corrupt: "
                          "copy the checkpoint again, or export an older one with --tag") from None


def check_against_config(got: dict, keys: dict, tag_dir: Path) -> None:
    missing = [k for k in keys if k not in got]
    extra = [k for k in got if k not in keys]
    wrong = [(k, got[k], tuple(keys[k][0])) for k in keys if k in got and got[k] != tuple(keys[k][0])]
    if not (missing or extra or wrong):
        return
    what = []
    if wrong:
        what.append("shapes differ: " + ", ".join(f"{k} is {a} in the checkpoint but {b} in the config"
                                                  for k, a, b in wrong[:2]) + (" ..." if len(wrong) > 2 else ""))
    if missing:
        what.append(f"the config has {len(missing)} tensors the checkpoint lacks ({', '.join(missing[:3])}"
                    f"{' ...' if len(missing) > 3 else ''})")
    if extra:
        what.append(f"the checkpoint has {len(extra)} tensors the config lacks ({', '.join(extra[:3])}"
                    f"{' ...' if len(extra) > 3 else ''})")
    raise ExportError(f"{tag_dir}: checkpoint does not match the model recorded in its {STATE_FILE}: "
                      + "; ".join(what) + f" (was {STATE_FILE} edited, or are files from different runs mixed?)")


def read_state(tag_dir: Path) -> dict:
    f = tag_dir / STATE_FILE
    if not f.is_file():
        raise ExportError(f"{tag_dir}: no {STATE_FILE}, so the model config is unknown (this exporter reads "
                          "checkpoints written by bin/pretrain.py)")
    from ..checkpoint import state_problem

    try:
        state = json.loads(f.read_text())
    except ValueError as e:
        raise ExportError(f"{f}: unreadable ({type(e).__name__}: {e})") from None
    wrong = state_problem(state) or (None if isinstance(state["recipe"].get("model"), dict) else "has no recipe.model")
    if wrong:
        raise ExportError(f"{f}: not one this engine wrote (it {wrong}); export the run's own checkpoint folder")
    return state


def recorded_hf_config(tag_dir: Path, state: dict):
    """The transformers config of the recorded recipe (engine/model.py:hf_config), dtype left to the caller."""
    import dataclasses

    from ..config import ModelConfig
    from ..model import make_hf_config as hf_config

    raw = state["recipe"]["model"]
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in raw.items() if k in known})
    if (tag_dir / INIT_DIR / "config.json").is_file():  # a model.init_from run's config as it trained
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(tag_dir / INIT_DIR)
    if m.init_from:  # checkpoints saved before INIT_DIR existed
        from transformers import AutoConfig

        if not Path(m.init_from, "config.json").is_file():
            raise ExportError(f"{tag_dir}: the run started from model.init_from={m.init_from}, whose config.json is "
                              "gone; put that model back to export")
        return AutoConfig.from_pretrained(m.init_from)
    tok = _tokenizer(tag_dir, state)
    try:
        return hf_config(m, tok)
    except (ValueError, TypeError) as e:
        raise ExportError(f"{tag_dir / STATE_FILE}: its model section gives no valid config ({e})") from None


def _tokenizer(tag_dir: Path, state: dict):
    from transformers import AutoTokenizer

    from ..config import BUNDLED_TOKENIZER

    named = state["recipe"].get("data", {}).get("tokenizer")
    for where in (tag_dir / "tokenizer", BUNDLED_TOKENIZER if named == "auto" else named):
        if where and Path(where).is_dir():
            try:
                return AutoTokenizer.from_pretrained(str(where))
            except Exception:  # noqa: BLE001
                continue
    raise ExportError(f"{tag_dir}: no tokenizer/ folder and the recipe's data.tokenizer is not readable; the config's "
                      "pad/bos/eos ids come from it")


def hf_keys(cfg, dtype: str):
    """A freshly built transformers model of `cfg`, on the meta device: its keys, shapes and expert layouts."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    keys = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    transposed = {}
    for name, mod in model.named_modules():
        for p in ("gate_up_proj", "down_proj"):  # fused 3-D expert tensors (not the dense MLP's nn.Linear)
            if f"{name}.{p}" in keys:
                transposed[f"{name}.{p}"] = bool(getattr(mod, "is_transposed", False))
    strict = set()
    if DTYPES[dtype] != "float32":
        names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        strict = {k for k in keys if names & set(k.split("."))}
    tied = []
    if getattr(cfg.get_text_config(), "tie_word_embeddings", False):
        tied = [k for k in (getattr(model, "_tied_weights_keys", None) or {}) if k in keys]
    cls = type(model).__name__
    del model
    cfg.architectures = [cls]
    return keys, transposed, strict, tied


def autoep_namer(moe_paths, names: dict, keys: dict):
    """engine name -> Hugging Face name: AutoEP's router and shared-expert names (under the MoE blocks at
    `moe_paths`) back to the model's own (`names`: AUTOEP_NAMES of the model type); other names unchanged."""
    def hf_name(name: str) -> str:
        for m in moe_paths:
            if name.startswith(m + "."):
                rest = name[len(m) + 1:]
                if rest.startswith("router.gate."):
                    return f"{m}.{names['router']}.{rest[len('router.gate.'):]}"
                if rest == "router.e_score_correction_bias":
                    cands = [k for k in keys if k.startswith(m + ".") and k.endswith(".e_score_correction_bias")]
                    return cands[0] if len(cands) == 1 else f"{m}.{names['router']}.e_score_correction_bias"
                for ours, theirs in (("shared_experts_gate.", names["shared_experts_gate"]),
                                     ("shared_experts.", names["shared_experts"])):
                    if rest.startswith(ours) and theirs:
                        return f"{m}.{theirs}.{rest[len(ours):]}"
        return name
    return hf_name

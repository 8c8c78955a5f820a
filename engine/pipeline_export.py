"""Export a pipeline-parallel checkpoint (ds_configs/pipe.json runs) to the same Hugging Face layout as ZeRO-3 runs.

Called by engine/export.py (`bin/zero_to_fp32`) when the checkpoint's DS config has a "pipeline" section. What a
pipeline checkpoint holds (DeepSpeed 0.19.8, PipelineEngine + ZeRO-1, S stages x D data-parallel ranks; engine
names are `<layer>.<path>`, layer 0 the embedding, 1..L the decoder layers, L+1 norm + head, engine/pipeline.py):
  mp_rank_{s:02d}_model_states.pt  one per stage. With AutoEP: `module`, the stage's weights and buffers in the
      model dtype except the routed experts; `ds_autoep_layers`, each MoE layer's experts per expert-parallel rank.
      Without AutoEP `module` is None and each layer i has its own layer_{i:02d}-model_states.pt (keys relative
      to the layer).
  layer_{m}_expert_{e}_mp_rank_{s:02d}_model_states.pt  (AutoEP) expert e of stage s's m-th MoE layer:
      `<moe>.experts.w1.e` (gate, [ffn, hidden]), `w3` (up), `w2` (down, [hidden, ffn]), model dtype.
  zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt  ZeRO-1: this rank's contiguous slice of each parameter group's
      fp32 masters (`single_partition_of_fp32_groups`) and where each parameter's piece lies in it
      (`param_slice_mappings`). A parameter's pieces, in partition order, are the whole parameter. Expert groups
      are partitioned over the ranks of one expert-parallel rank (DeepSpeed's groups: dp rank d has expert-parallel
      rank d % ep and partition d // ep).
Values written: the fp32 masters from the optimizer files (what ZeRO-3 export writes too); the module files supply
buffers (routing biases) and, for ZeRO stage 0 (no masters), the weights. The exported key set and shapes are checked
against a freshly built transformers model of the recorded config. Memory: the whole model once, in fp32.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .export_read import (AUTOEP_NAMES, DTYPES, ExportError, _check_against_config, _hf_keys, _load,
                          _read_state, recorded_hf_config)
from .pipeline import hf_key

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def pipeline_stages(tag_dir: Path) -> int:
    """The number of pipeline stages of the checkpoint in `tag_dir`, 0 when it is not a pipeline checkpoint."""
    f = tag_dir / "mp_rank_00_model_states.pt"
    if not f.is_file():
        return 0
    ds = _load(f, mmap=True).get("ds_config") or {}
    return int((ds.get("pipeline") or {}).get("stages", 0))


class PipelinePlan:
    def __init__(self, tag_dir: Path, hf_config, tensors: dict, keys: dict):
        self.tag_dir, self.hf_config, self.tensors, self.keys = tag_dir, hf_config, tensors, keys


def plan_pipeline(tag_dir: Path, dtype: str = "fp32") -> PipelinePlan:
    """Read every stage's files into Hugging Face tensors; check them against the recorded config."""
    state = _read_state(tag_dir)
    stages = pipeline_stages(tag_dir)
    cfg = recorded_hf_config(tag_dir, state)
    keys, transposed, strict_fp32, tied = _hf_keys(cfg, dtype)
    names = AUTOEP_NAMES.get(cfg.model_type, AUTOEP_NAMES["deepseek_v3"])
    layers = cfg.num_hidden_layers

    dense, experts, placement, moe_paths = _read_stages(tag_dir, stages)
    _fp32_masters(tag_dir, stages, dense, experts, placement)
    hf_name = _hf_namer(moe_paths, names, layers)
    out = {hf_name(k): v.float() for k, v in dense.items()}
    out.update(_hf_experts(tag_dir, experts, layers, transposed))
    for key in tied:
        keys.pop(key, None)
        out.pop(key, None)
    _check_against_config({k: tuple(v.shape) for k, v in out.items()}, keys, tag_dir)
    target = getattr(torch, DTYPES[dtype])
    out = {k: out[k].to(torch.float32 if k in strict_fp32 else target).contiguous() for k in keys}
    return PipelinePlan(tag_dir, cfg, out, keys)


def _read_stages(tag_dir: Path, stages: int) -> tuple[dict, dict, dict, list[str]]:
    """Every stage's model files: the dense tensors (engine name -> tensor, weights and buffers, experts excluded),
    the experts (`<moe>.experts.w1` -> global expert -> tensor), their placement (`<moe>.experts.w1` ->
    expert-parallel rank -> its experts) and the MoE blocks' paths."""
    dense: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    placement: dict[str, dict[int, list[int]]] = {}
    moe_paths: list[str] = []
    for s in range(stages):
        f = tag_dir / f"mp_rank_{s:02d}_model_states.pt"
        if not f.is_file():
            raise ExportError(f"{tag_dir}: {f.name} is missing (stage {s} of {stages}); copy every stage's files")
        ms = _load(f)
        autoep = ms.get("ds_autoep_layers") or []
        moe_paths += [e["module_path"] for e in autoep]
        if ms.get("module") is not None:
            # Under ZeRO, param_shapes + buffer_names name each tensor once: the module state also holds aliases
            # (AutoEP's Qwen3 layer exposes its router again as `mlp.gate` for transformers' output recorders).
            named = {n for g in ms.get("param_shapes") or [] for n in g} | set(ms.get("buffer_names") or [])
            dense.update({k: v for k, v in ms["module"].items() if not named or k in named})
        for m, e in enumerate(autoep):
            _read_experts(tag_dir, s, m, e, experts)
            ranks = (e.get("expert_placement") or {}).get("ranks") or [
                {"rank": r, "experts": list(range(r * e["num_local_experts"], (r + 1) * e["num_local_experts"]))}
                for r in range(int(e["ep_size"]))]
            for w in ("w1", "w2", "w3"):
                placement[f"{e['expert_key_prefix']}.{w}"] = {int(r["rank"]): [int(x) for x in r["experts"]]
                                                              for r in ranks}
        del ms
    for f in sorted(tag_dir.glob("layer_*-model_states.pt")):  # pipelines without AutoEP: one file per layer
        idx = int(f.name[len("layer_"):].split("-")[0])
        dense.update({f"{idx}.{k}": v for k, v in _load(f).items()})
    return dense, experts, placement, moe_paths


def _hf_namer(moe_paths: list[str], names: dict, layers: int):
    """engine name -> Hugging Face key: AutoEP's router and shared-expert names back to the model's own, then the
    PipelineModule's layer index to the model's (engine/pipeline.py: hf_key)."""
    def hf_name(name: str) -> str:
        for m in moe_paths:
            if name.startswith(m + "."):
                rest = name[len(m) + 1:]
                if rest.startswith("router.gate."):
                    rest = f"{names['router']}.{rest[len('router.gate.'):]}"
                elif rest == "router.e_score_correction_bias":
                    rest = f"{names['router']}.e_score_correction_bias"
                elif rest.startswith("shared_experts_gate.") and names["shared_experts_gate"]:
                    rest = f"{names['shared_experts_gate']}.{rest[len('shared_experts_gate.'):]}"
                elif rest.startswith("shared_experts.") and names["shared_experts"]:
                    rest = f"{names['shared_experts']}.{rest[len('shared_experts.'):]}"
                name = f"{m}.{rest}"
        return hf_key(name, layers)
    return hf_name


def _hf_experts(tag_dir: Path, experts: dict, layers: int, transposed: dict) -> dict[str, torch.Tensor]:
    """Per-expert w1/w3/w2 -> the Hugging Face fused tensors: gate_up_proj [experts, 2*ffn, hidden] = cat(gate, up),
    down_proj [experts, hidden, ffn] (each expert's matrix transposed where the model says `is_transposed`)."""
    out = {}
    for name, per_expert in experts.items():  # name: `<moe>.experts.w1|w2|w3`
        if name.endswith(".w3"):
            continue
        base = hf_key(name, layers).rsplit(".", 1)[0]  # model.layers.<i>.mlp.experts
        if name.endswith(".w2"):
            key = f"{base}.down_proj"
            parts = [per_expert[e].float() for e in sorted(per_expert)]  # [hidden, ffn]
        else:
            key = f"{base}.gate_up_proj"
            up = experts[name[:-1] + "3"]
            parts = [torch.cat([per_expert[e], up[e]]).float() for e in sorted(per_expert)]  # [2*ffn, hidden]
        if sorted(per_expert) != list(range(len(per_expert))):
            raise ExportError(f"{tag_dir}: {name} has experts {sorted(per_expert)}; copy every expert file")
        out[key] = torch.stack([p.t() for p in parts] if transposed.get(key) else parts)
    return out


def _read_experts(tag_dir: Path, stage: int, m: int, layer: dict, experts: dict) -> None:
    """Stage `stage`'s m-th AutoEP layer: every global expert from its per-expert file."""
    for e in range(int(layer["num_experts"])):
        f = tag_dir / f"layer_{m}_expert_{e}_mp_rank_{stage:02d}_model_states.pt"
        if not f.is_file():
            raise ExportError(f"{tag_dir}: {f.name} is missing (expert {e} of {layer['module_path']}); copy every "
                              "expert file of the save")
        for k, v in _load(f).items():  # `<moe>.experts.w1.<e>`
            name, _, idx = k.rpartition(".")
            experts.setdefault(name, {})[int(idx)] = v


def _fp32_masters(tag_dir: Path, stages: int, dense: dict, experts: dict, placement: dict) -> None:
    """Replace module weights by the ZeRO-1 fp32 masters where the optimizer files hold them."""
    files: dict[int, dict[int, Path]] = {}
    for f in tag_dir.iterdir():
        m = OPTIM_FILE.match(f.name)
        if m:
            files.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    if not files:
        return  # ZeRO stage 0: the module weights are the masters
    for s in range(stages):
        pieces: dict[str, list] = {}  # (engine name) -> [(expert-parallel rank, partition, tensor)]
        ranks = files.get(s, {})
        if sorted(ranks) != list(range(len(ranks))) or not ranks:
            raise ExportError(f"{tag_dir}: optimizer files of stage {s} are for data-parallel ranks {sorted(ranks)}; "
                              "copy every rank's zero_pp_rank_* files")
        ep = _ep_size(tag_dir, s)
        for d, f in sorted(ranks.items()):
            osd = _load(f, mmap=True)["optimizer_state_dict"]
            flats, maps = osd.get("single_partition_of_fp32_groups"), osd.get("param_slice_mappings")
            if flats is None or maps is None:
                return  # not ZeRO-1's layout: keep the module weights
            for flat, mapping in zip(flats, maps):
                for name, addr in mapping.items():  # DeepSpeed's fragment_address dataclass, read as _Opaque
                    where = getattr(addr, "state", None) or vars(addr)
                    piece = flat.detach().narrow(0, int(where["start"]), int(where["numel"])).clone()
                    expert = name.endswith((".experts.w1", ".experts.w2", ".experts.w3"))
                    pieces.setdefault(name, []).append((d % ep if expert else 0, d // ep if expert else d, piece))
            del osd
        for name, got in pieces.items():
            if name.endswith((".experts.w1", ".experts.w2", ".experts.w3")):
                _expert_masters(tag_dir, name, got, experts[name], placement[name])
            else:
                full = torch.cat([p for _, _, p in sorted(got, key=lambda x: x[1])])
                if name not in dense or dense[name].numel() != full.numel():
                    raise ExportError(f"{tag_dir}: the optimizer files hold {name} with {full.numel()} values, the "
                                      "model files do not match; the files come from different saves")
                dense[name] = full.view(dense[name].shape)


def _expert_masters(tag_dir: Path, name: str, got: list, per_expert: dict, owners: dict) -> None:
    """Each expert-parallel rank's stacked fp32 experts [local experts, A, B] -> per global expert."""
    shape = next(iter(per_expert.values())).shape
    for r, owned in owners.items():
        local = torch.cat([p for rank, _, p in sorted(got, key=lambda x: x[1]) if rank == r])
        if local.numel() != len(owned) * shape.numel():
            raise ExportError(f"{tag_dir}: the optimizer files hold {local.numel()} values of {name} on expert-parallel "
                              f"rank {r}, expected {len(owned)} experts of {tuple(shape)}")
        for j, e in enumerate(local.view(len(owned), *shape)):
            per_expert[owned[j]] = e


def _ep_size(tag_dir: Path, stage: int) -> int:
    layers = _load(tag_dir / f"mp_rank_{stage:02d}_model_states.pt", mmap=True).get("ds_autoep_layers") or []
    return int(layers[0]["ep_size"]) if layers else 1


def write_pipeline(plan: PipelinePlan, tmp: Path, max_bytes: int, log=print) -> None:
    """Sharded safetensors + index, keys in the transformers model's order."""
    from safetensors.torch import save_file

    shards, cur, size = [], [], 0
    for key, t in plan.tensors.items():
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += n
    shards.append(cur)
    weight_map = {}
    for i, keys in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: plan.tensors[k] for k in keys}, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        log(f"wrote {name} ({len(keys)} tensors)")
    total = sum(t.numel() * t.element_size() for t in plan.tensors.values())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


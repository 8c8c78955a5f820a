"""Export a training checkpoint as a Hugging Face model: `bin/zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR`.

What a checkpoint holds (DeepSpeed 0.19.8, ZeRO-3 + AutoEP, one file pair per rank r):
  zero_pp_rank_{r}_mp_rank_00_model_states.pt  `param_shapes`: one dict name -> full shape per ZeRO
      sub-group, in flat order; `buffer_names` + `module` (buffers in full, parameters empty);
      `ds_autoep_layers`: per MoE layer and rank, the expert-parallel rank and which global experts it holds.
  zero_pp_rank_{r}_mp_rank_00_optim_states.pt  `fp32_flat_groups[i]`: this rank's fp32 master partition of
      sub-group i: every parameter of param_shapes[i] in order, each taking ceil(numel / partition_count)
      elements (the last partition zero-padded); `ds_zero_partition_groups[i]` gives partition_count and this
      rank's partition_rank. Dense parameters are partitioned over all ranks; AutoEP experts over the ranks
      sharing an expert-parallel rank (expert data parallelism), and each expert-parallel rank stores only
      its own experts, stacked: `<moe>.experts.w1`/`w3` (gate/up, [local experts, ffn, hidden]) and `w2`
      (down, [local experts, hidden, ffn]), see deepspeed/moe/ep_repack.py.

What Hugging Face wants (transformers 5.17, DeepSeek-V3 and Qwen3-MoE): `<moe>.experts.gate_up_proj`
[experts, 2*ffn, hidden] = cat(gate, up) along dim 1 (`is_transposed` models store [experts, hidden, 2*ffn]),
`<moe>.experts.down_proj` [experts, hidden, ffn], the router as `<moe>.gate.weight` and DeepSeek-V3's
routing bias as `<moe>.gate.e_score_correction_bias` (AutoEP keeps them as `<moe>.router.gate.weight` and
`<moe>.router.e_score_correction_bias`). The exported key set and shapes are those of a freshly built
transformers model of the recorded config, checked before anything is written.

Memory: the output is written one safetensors shard at a time; for each shard every rank's optimizer file
is opened memory-mapped, only the fp32 pieces that shard needs are read, and the file is closed again.
Peak RAM is about one output shard plus one input file's share of it (Adam moments are never read), on top of a
fixed cost. Measured (tests/test_export.py::test_export_streams_shard_by_shard, 437 MiB fp32 model, one 1.3 GB
optimizer file, --max_shard_size 20MB): peak RSS 246 MiB after imports, 392 MiB once planned (tokenizer,
transformers' modeling code, the model on the meta device: independent of the model's size), 461 MiB at the end;
writing adds ~3 shard sizes (the shard's tensors, safetensors' bytes copy of them, the mapped input pieces).
The export is built in a temporary folder next to OUTPUT_DIR and renamed into place at the end. Before anything is
read, the checkpoint is checked as `--resume` checks it (engine/checkpoint.py: manifest sizes, zip CRCs).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .export_read import (AUTOEP_NAMES, DTYPES, ExportError, _check_against_config, _hf_keys, _load, _Opaque,
                          _read_state, recorded_hf_config)

MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
PIPELINE_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")  # also ZeRO-1/2 runs: refused in _rank_files


# ----------------------------------------------------------------------------------------------- locating


def find_tag_dir(path: str | Path, tag: str | None) -> Path:
    """The checkpoint folder to export: RUN_DIR or RUN_DIR/checkpoints (+ `latest` or --tag), or a tag folder."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"checkpoint dir {p}: no such directory (give RUN_DIR or RUN_DIR/checkpoints)")
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if tag is None and _model_files(p):
        return p  # a tag folder itself
    tags = sorted(d.name for d in p.iterdir() if d.is_dir() and _model_files(d))
    if tag is not None:
        if not (p / tag).is_dir() or "/" in tag or tag in (".", ".."):
            raise ExportError(f"--tag {tag}: no such checkpoint in {p} (available: {', '.join(tags) or 'none'})")
        return p / tag
    latest = p / "latest"
    if not latest.is_file():
        if not tags:
            raise ExportError(f"checkpoint dir {p}: no checkpoints in it (expected RUN_DIR/checkpoints/<tag>/ "
                              "with zero_pp_rank_*_model_states.pt files)")
        raise ExportError(f"checkpoint dir {p}: no `latest` file; pass --tag (available: {', '.join(tags)})")
    name = latest.read_text().strip()
    if not name or not (p / name).is_dir():
        raise ExportError(f"checkpoint dir {p}: `latest` names {name!r}, which is not there; pass --tag "
                          f"(available: {', '.join(tags) or 'none'})")
    return p / name


def _model_files(d: Path) -> list[Path]:
    """ZeRO-3's per-rank model-states files, or a pipeline run's per-stage ones (engine/pipeline_export.py)."""
    try:
        return sorted(f for f in d.iterdir() if MODEL_FILE.match(f.name) or PIPELINE_FILE.match(f.name))
    except OSError:
        return []


# ------------------------------------------------------------------------------------------------ reading


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class _Target:
    """Where the pieces of one engine parameter (on one expert-parallel rank) go in the output."""
    key: str                      # Hugging Face key
    kind: str                     # "dense" | "gate" | "up" | "down"
    experts: list | None = None   # experts only: global index of each local expert (None: skip this copy)


@dataclass
class _Frag:
    group: int    # sub-group: index into fp32_flat_groups
    offset: int   # first element in that flat group
    length: int   # elements (padding excluded)
    start: int    # first element in the (local) flattened engine parameter
    target: _Target


@dataclass
class _Rank:
    rank: int
    model_file: Path
    optim_file: Path
    frags: list[_Frag] = field(default_factory=list)


@dataclass
class Plan:
    tag_dir: Path
    ranks: list[_Rank]
    hf_config: object
    keys: dict            # HF key -> (shape, torch dtype), in the model's state_dict order
    buffers: dict         # HF key -> tensor (from rank 0's model states)
    layout: dict          # HF expert key -> is_transposed


def plan_export(tag_dir: Path, dtype: str = "fp32") -> Plan:
    """Read every file's metadata, map every piece to its Hugging Face key, check it all against the config."""
    import torch

    state = _read_state(tag_dir)
    ranks = _rank_files(tag_dir, state)
    models = _read_model_states(ranks)
    optims = {r.rank: _optim_meta(r.optim_file, r.rank) for r in ranks}  # before any slow import: fail fast

    cfg = recorded_hf_config(tag_dir, state)
    names = AUTOEP_NAMES.get(cfg.model_type, AUTOEP_NAMES["deepseek_v3"])
    keys, transposed, strict_fp32, tied = _hf_keys(cfg, dtype)
    moe_paths, expert_info = _expert_placement(models.autoep)
    hf_name = _hf_namer(moe_paths, names, keys)

    frags = _FragmentMap(tag_dir, expert_info, transposed, models.shared, hf_name)
    for r in ranks:
        frags.add_rank(r, models.shapes[r.rank], optims[r.rank])
    frags.check_complete()
    got_shapes = frags.shapes

    hf_buffers = {}
    for name, t in models.buffers.items():
        key = hf_name(name)
        _same_shape(got_shapes, key, tuple(t.shape), tag_dir)
        hf_buffers[key] = t
    for key in tied:
        got_shapes.pop(key, None)
        keys.pop(key, None)
    _check_against_config(got_shapes, keys, tag_dir)
    for key in keys:
        shape, _ = keys[key]
        keys[key] = (shape, torch.float32 if key in strict_fp32 else getattr(torch, DTYPES[dtype]))
    layout = {k: v for k, v in transposed.items() if k in keys}
    return Plan(tag_dir, ranks, cfg, keys, hf_buffers, layout)


@dataclass
class _ModelStates:
    shapes: dict     # rank -> [name -> full shape] per ZeRO sub-group, in flat order
    autoep: dict     # rank -> its ds_autoep_layers
    buffers: dict    # engine name -> tensor, from the first rank
    shared: dict     # DeepSpeed's shared_params (tied parameters): no fragments of their own are mapped


def _read_model_states(ranks: list[_Rank]) -> _ModelStates:
    """Every rank's model-states file: parameter shapes, AutoEP placement, shared parameters; rank 0's buffers."""
    out = _ModelStates({}, {}, {}, {})
    for r in ranks:
        ms = _load(r.model_file)
        if not isinstance(ms, dict) or "param_shapes" not in ms:
            raise ExportError(f"{r.model_file}: not a ZeRO-3 model-states file (no param_shapes); only ZeRO stage 3 "
                              "checkpoints can be exported")
        if ms.get("frozen_param_shapes"):
            raise ExportError(f"{r.model_file}: has frozen (requires_grad=False) parameters "
                              f"({', '.join(list(ms['frozen_param_shapes'])[:3])}, ...), which this exporter does "
                              "not handle yet")
        out.shapes[r.rank] = [dict(g) for g in ms["param_shapes"]]
        out.autoep[r.rank] = ms.get("ds_autoep_layers") or []
        out.shared.update(ms.get("shared_params") or {})
        if r.rank == ranks[0].rank:
            module = ms.get("module") or {}
            out.buffers = {n: module[n].clone() for n in ms.get("buffer_names") or [] if n in module}
        del ms
    return out


def _expert_placement(autoep_by_rank: dict) -> tuple[set[str], dict[str, dict[int, tuple[int, list[int], int]]]]:
    """The MoE blocks' paths, and per expert weight (`<moe>.experts.w1`): rank -> (its expert-parallel rank, the
    global experts of its local experts, the number of experts), from ds_autoep_layers."""
    moe_paths: set[str] = set()
    expert_info: dict[str, dict[int, tuple[int, list[int], int]]] = {}
    for rank, layers in autoep_by_rank.items():
        for e in layers:
            moe_paths.add(e["module_path"])
            num, ep_size, ep_rank = int(e["num_experts"]), int(e["ep_size"]), int(e.get("ep_rank", 0))
            placement = e.get("expert_placement")
            if placement:
                owned = {int(p["rank"]): [int(x) for x in p["experts"]] for p in placement["ranks"]}
            else:
                local = num // ep_size
                owned = {k: list(range(k * local, (k + 1) * local)) for k in range(ep_size)}
            for w in ("w1", "w2", "w3"):
                expert_info.setdefault(f"{e['expert_key_prefix']}.{w}", {})[rank] = (ep_rank, owned[ep_rank], num)
    return moe_paths, expert_info


def _hf_namer(moe_paths: set[str], names: dict, keys: dict):
    """engine name -> Hugging Face key: AutoEP's router and shared-expert names back to the model's own."""
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


class _FragmentMap:
    """Every parameter's fragments, rank file by rank file, into each _Rank's frags; the output shapes as the
    checkpoint implies them; and the checks that the files come from one save and miss nothing."""

    def __init__(self, tag_dir: Path, expert_info: dict, transposed: dict, shared: dict, hf_name):
        self.tag_dir, self.expert_info, self.transposed, self.shared = tag_dir, expert_info, transposed, shared
        self.hf_name = hf_name
        self.shapes: dict[str, tuple] = {}
        self.seen: dict[tuple, set] = {}     # (engine name, ep_rank) -> partition ranks seen
        self.counts: dict[tuple, int] = {}   # (engine name, ep_rank) -> partition count
        self.experts_seen: dict[tuple, dict[int, int]] = {}  # (HF key, kind) -> global expert -> ep_rank taken from

    def add_rank(self, r: _Rank, groups: list[dict], optim: dict) -> None:
        if len(groups) != len(optim["sizes"]):
            raise ExportError(f"{r.optim_file}: has {len(optim['sizes'])} parameter groups but "
                              f"{r.model_file.name} lists {len(groups)}; the files come from different saves")
        for g, group in enumerate(groups):
            pcount, prank = optim["partitions"][g]
            offset = 0
            for name, shape in group.items():
                numel = _numel(shape)
                part = -(-numel // pcount)
                if name not in self.shared:
                    length = max(0, min(part, numel - prank * part))
                    self._add(r, name, shape, _Frag(g, offset, length, prank * part, None), pcount, prank)
                offset += part
            if offset > optim["sizes"][g]:
                raise ExportError(f"{r.optim_file}: parameter group {g} holds {optim['sizes'][g]} values but its "
                                  f"parameters need {offset}; the file does not belong to {r.model_file.name}")

    def _add(self, r: _Rank, name: str, shape, frag: _Frag, pcount: int, prank: int) -> None:
        """One parameter's piece in rank file `r`: partition `prank` of `pcount`, its target not yet set."""
        if name in self.expert_info:
            frag.target, unit = self._expert_target(r, name, shape)
        else:
            key = self.hf_name(name)
            _same_shape(self.shapes, key, tuple(shape), self.tag_dir)
            frag.target, unit = _Target(key, "dense"), None
        ident = (name, unit)
        if self.counts.setdefault(ident, pcount) != pcount:
            raise ExportError(f"{self.tag_dir}: {name} is partitioned {self.counts[ident]} ways on one rank and "
                              f"{pcount} on another; the files come from different saves")
        if prank in self.seen.setdefault(ident, set()):
            raise ExportError(f"{self.tag_dir}: two files hold partition {prank} of {name}; the files come from "
                              "different saves")
        self.seen[ident].add(prank)
        if frag.length:
            r.frags.append(frag)

    def _expert_target(self, r: _Rank, name: str, shape) -> tuple[_Target, int]:
        """Where rank `r`'s stacked local experts of `name` (`<moe>.experts.w1|w2|w3`) go, and its ep rank."""
        if r.rank not in self.expert_info[name]:
            raise ExportError(f"{r.model_file}: holds {name} but no AutoEP metadata for it "
                              "(ds_autoep_layers); the files come from different saves")
        ep_rank, owned, num = self.expert_info[name][r.rank]
        if len(shape) != 3 or shape[0] != len(owned):
            raise ExportError(f"{r.model_file}: {name} has shape {tuple(shape)} but AutoEP metadata "
                              f"places {len(owned)} experts on expert-parallel rank {ep_rank}")
        w = name.rsplit(".", 1)[1]
        prefix = name[: -len(".w1")]
        key = f"{prefix}.{'down_proj' if w == 'w2' else 'gate_up_proj'}"
        kind = {"w1": "gate", "w3": "up", "w2": "down"}[w]
        ffn, hidden = (shape[1], shape[2]) if w != "w2" else (shape[2], shape[1])
        full = (num, 2 * ffn, hidden) if w != "w2" else (num, hidden, ffn)
        if self.transposed.get(key):
            full = (full[0], full[2], full[1])
        _same_shape(self.shapes, key, full, self.tag_dir)
        owners = self.experts_seen.setdefault((key, kind), {})
        local = []  # global index of each local expert; None where another rank's copy is used
        for ge in owned:
            if not 0 <= ge < num:
                raise ExportError(f"{r.model_file}: AutoEP placement names expert {ge} of {num}")
            local.append(ge if owners.setdefault(ge, ep_rank) == ep_rank else None)
        return _Target(key, kind, local), ep_rank

    def check_complete(self) -> None:
        """Every partition of every parameter, and every expert, came from some file."""
        for ident, parts in self.seen.items():
            if parts != set(range(self.counts[ident])):
                raise ExportError(f"{self.tag_dir}: partitions {sorted(set(range(self.counts[ident])) - parts)} of "
                                  f"{ident[0]} are missing; copy every rank's zero_pp_rank_* files")
        for (key, kind), owners in self.experts_seen.items():
            num = self.shapes[key][0]
            if len(owners) != num:
                raise ExportError(f"{self.tag_dir}: experts {sorted(set(range(num)) - set(owners))} of {key} ({kind}) "
                                  "are in no file; copy every rank's zero_pp_rank_* files")


def _same_shape(got: dict, key: str, shape: tuple, tag_dir: Path) -> None:
    if got.setdefault(key, tuple(shape)) != tuple(shape):
        raise ExportError(f"{tag_dir}: {key} has shape {got[key]} in one file and {tuple(shape)} in another; "
                          "the files come from different saves")


def _rank_files(tag_dir: Path, state: dict) -> list[_Rank]:
    ranks, mp = {}, set()
    for f in _model_files(tag_dir):
        m = MODEL_FILE.match(f.name)
        if not m:
            continue
        ranks[int(m.group(1))] = f
        mp.add(int(m.group(2)))
    if not ranks:
        stage12 = (tag_dir / "mp_rank_00_model_states.pt").is_file()
        raise ExportError(f"{tag_dir}: no zero_pp_rank_*_mp_rank_*_model_states.pt files; "
                          + ("this is a ZeRO stage 1/2 checkpoint, and only ZeRO-3 checkpoints can be exported (train "
                             "with ds_configs/zero3.json)" if stage12 else "not a ZeRO-3 checkpoint"))
    if mp != {0}:
        raise ExportError(f"{tag_dir}: has model-parallel ranks {sorted(mp)}; tensor/pipeline-parallel checkpoints "
                          "are not supported by this exporter")
    world = int(state.get("world_size", len(ranks)))
    missing, extra = sorted(set(range(world)) - set(ranks)), sorted(set(ranks) - set(range(world)))
    if missing or extra:
        raise ExportError(f"{tag_dir}: the run had {world} ranks but model-states files for ranks "
                          f"{missing or extra} are {'missing' if missing else 'extra'}; copy exactly that save's files")
    out = []
    for r, f in sorted(ranks.items()):
        name = f.name.replace("_model_states.pt", "_optim_states.pt")
        found = [tag_dir / n for n in (name, "bf16_" + name) if (tag_dir / n).is_file()]  # bf16 runs: bf16_ prefix
        if len(found) != 1:
            raise ExportError(f"{tag_dir}: {name} is {'missing' if not found else 'there twice (also with bf16_)'} "
                              f"(it holds rank {r}'s fp32 weights); copy exactly one save's files")
        out.append(_Rank(r, f, found[0]))
    return out


def _optim_meta(path: Path, file_rank: int) -> dict:
    """Per sub-group: (partition_count, partition_rank) and the flat size; tensors stay on disk."""
    sd = _load(path, mmap=True)
    try:
        osd = sd["optimizer_state_dict"]
        stage = osd.get("zero_stage")
        stage = stage.args[0] if isinstance(stage, _Opaque) and stage.args else stage
        if stage is not None and int(getattr(stage, "value", stage)) != 3:
            raise ExportError(f"{path}: a ZeRO stage {int(stage)} checkpoint; this exporter reads ZeRO stage 3 only")
        flats = osd["fp32_flat_groups"]
        meta = osd.get("ds_zero_partition_groups") or []
        default = (int(osd.get("partition_count", 1)), file_rank)  # DeepSpeed without per-group metadata
        parts = [(int(meta[i]["partition_count"]), int(meta[i]["partition_rank"])) if i < len(meta) else default
                 for i in range(len(flats))]
        return {"sizes": [int(t.numel()) for t in flats], "partitions": parts}
    except ExportError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ExportError(f"{path}: not a ZeRO-3 optimizer-states file ({type(e).__name__}: {e})") from None
    finally:
        del sd
        gc.collect()


# ------------------------------------------------------------------------------------------------ writing


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ExportError(f"--max_shard_size {text!r}: expected a size like 2GB, 500MB or 1000000")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(m.group(1)) * mult)
    if size < 1:
        raise ExportError(f"--max_shard_size {text!r}: must be at least 1 byte")
    return size


def _shards(plan: Plan, max_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    for key, (shape, dt) in plan.keys.items():
        n = _numel(shape) * dt.itemsize
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += n
    if cur:
        shards.append(cur)
    return shards


def _copy_rows(dst, off: int, src) -> None:
    """Write 1-D `src` into the row-major positions [off, off + len) of the 2-D view `dst`."""
    cols = dst.shape[1]
    n, pos = src.numel(), 0
    r, c = divmod(off, cols)
    if c:
        take = min(cols - c, n)
        dst[r, c:c + take].copy_(src[:take])
        pos, r = take, r + 1
    full = (n - pos) // cols
    if full:
        dst[r:r + full].copy_(src[pos:pos + full * cols].view(full, cols))
        pos, r = pos + full * cols, r + full
    if pos < n:
        dst[r, :n - pos].copy_(src[pos:])


def _write(out, frag: _Frag, src, transposed: bool) -> int:
    """Copy one fragment into its output tensor; returns the number of elements written."""
    t = frag.target
    if t.kind == "dense":
        out.view(-1)[frag.start:frag.start + frag.length].copy_(src)
        return frag.length
    # Experts: local [E_local, A, B] in the checkpoint; expert g of the output seen as an [A, B] view.
    if t.kind == "down":  # w2 [hidden, ffn] -> down_proj[g] [hidden, ffn] (transposed: [ffn, hidden])
        view = (lambda g: out[g].t()) if transposed else (lambda g: out[g])
    else:  # w1 / w3 [ffn, hidden] -> first / second half of gate_up_proj[g] [2*ffn, hidden] ([hidden, 2*ffn])
        half = (out.shape[2] if transposed else out.shape[1]) // 2
        sl = slice(0, half) if t.kind == "gate" else slice(half, 2 * half)
        view = (lambda g: out[g][:, sl].t()) if transposed else (lambda g: out[g][sl])
    per = out[0].numel() // (2 if t.kind != "down" else 1)
    written, pos = 0, 0
    while pos < frag.length:
        j, off = divmod(frag.start + pos, per)
        take = min(per - off, frag.length - pos)
        g = t.experts[j]
        if g is not None:
            _copy_rows(view(g), off, src[pos:pos + take])
            written += take
        pos += take
    return written


def write_export(plan: Plan, tmp: Path, max_bytes: int, log=print) -> None:
    import torch

    with torch.no_grad():
        _write_shards(plan, tmp, max_bytes, log)


def _write_shards(plan: Plan, tmp: Path, max_bytes: int, log) -> None:
    import torch
    from safetensors.torch import save_file

    shards = _shards(plan, max_bytes)
    n = len(shards)
    weight_map, total = {}, 0
    for i, keys in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        wanted = set(keys)
        out = {k: torch.empty(plan.keys[k][0], dtype=plan.keys[k][1]) for k in keys}
        done = dict.fromkeys(keys, 0)
        for r in plan.ranks:
            frags = [f for f in r.frags if f.target.key in wanted]
            if not frags:
                continue
            sd = _load(r.optim_file, mmap=True)
            flats = sd["optimizer_state_dict"]["fp32_flat_groups"]
            for f in frags:
                # detach: DeepSpeed saved the masters with requires_grad=True, and an in-place copy from them
                # would record autograd history that keeps the whole mapped file alive.
                src = flats[f.group].detach().narrow(0, f.offset, f.length)
                done[f.target.key] += _write(out[f.target.key], f, src, plan.layout.get(f.target.key, False))
            del sd, flats, src
            gc.collect()
        for k in keys:
            if k in plan.buffers:
                out[k].copy_(plan.buffers[k])
                done[k] = out[k].numel()
        short = [k for k in keys if done[k] != out[k].numel()]
        if short:
            raise ExportError(f"{plan.tag_dir}: {short[0]} got {done[short[0]]} of {out[short[0]].numel()} values "
                              "from the files; the checkpoint is incomplete")
        save_file(out, str(tmp / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update(dict.fromkeys(keys, name))
        log(f"wrote {name} ({len(keys)} tensors)")
        del out
        gc.collect()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def export(checkpoint_dir: str | Path, output_dir: str | Path, tag: str | None = None, dtype: str = "fp32",
           max_shard_size: str = "2GB", force: bool = False, log=print) -> Path:
    """Export; raises ExportError on bad input, leaving OUTPUT_DIR as it was."""
    import torch

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    tag_dir = find_tag_dir(checkpoint_dir, tag).resolve()
    out = Path(output_dir).absolute()
    _check_output(out, tag_dir, force)
    from .checkpoint import damage

    bad = damage(tag_dir, verify_crc=True)  # what --resume checks: manifest sizes and zip CRCs (torch.load skips them)
    if bad:
        raise ExportError(f"checkpoint {tag_dir} is damaged ({bad}): a file is missing, truncated or corrupt; copy "
                          "the checkpoint again, or export an older one with --tag")
    from .pipeline_export import pipeline_stages, plan_pipeline, write_pipeline

    pipeline = pipeline_stages(tag_dir) > 0  # a pipeline-parallel run (ds_configs/pipe.json)
    plan = plan_pipeline(tag_dir, dtype) if pipeline else plan_export(tag_dir, dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (write_pipeline if pipeline else write_export)(plan, tmp, max_bytes, log)
        cfg = plan.hf_config
        cfg.dtype = getattr(torch, DTYPES[dtype])
        cfg.use_cache = True
        cfg.save_pretrained(tmp)
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
        if (tag_dir / "tokenizer").is_dir():
            for f in (tag_dir / "tokenizer").iterdir():
                if f.is_file():
                    shutil.copyfile(f, tmp / f.name)
        else:
            log(f"warning: {tag_dir} has no tokenizer/ folder; the export has none")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)  # safetensors creates its files 0600
        tmp.chmod(0o777 & ~umask)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_output(out: Path, tag_dir: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out}: exists and is not a directory; choose a directory path")
    real = out.resolve()
    if real == tag_dir or real in tag_dir.parents or tag_dir in real.parents:
        raise ExportError(f"output {out}: overlaps the checkpoint {tag_dir}; write the export somewhere else")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output {out}: not empty; pass --force to replace it, or choose an empty directory")


# ---------------------------------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="zero_to_fp32",
        description="Turn a ZeRO-3 + AutoEP checkpoint into a Hugging Face model folder (config.json, sharded "
                    "*.safetensors, tokenizer) that loads with AutoModelForCausalLM.from_pretrained.")
    ap.add_argument("checkpoint_dir", help="RUN_DIR, RUN_DIR/checkpoints (uses `latest`) or one checkpoint folder")
    ap.add_argument("output_dir", help="where to write the Hugging Face model (must be empty unless --force)")
    ap.add_argument("--tag", help="checkpoint to export, e.g. step_00000100 (default: the one `latest` names)")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of the exported weights")
    ap.add_argument("--max_shard_size", default="2GB", help="largest safetensors file, e.g. 2GB, 500MB (default 2GB)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty OUTPUT_DIR")
    ap.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    try:
        out = export(args.checkpoint_dir, args.output_dir, tag=args.tag, dtype=args.dtype,
                     max_shard_size=args.max_shard_size, force=args.force, log=log)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    log(f"exported to {out}")
    return 0

"""ZeRO-3 checkpoints (ds_configs/zero3.json runs) -> the export plan (plan.py).

What a checkpoint holds (DeepSpeed 0.19.8, ZeRO-3 + AutoEP, one file pair per rank r):
  zero_pp_rank_{r}_mp_rank_00_model_states.pt  `param_shapes`: one dict name -> full shape per ZeRO
      sub-group, in flat order; `buffer_names` + `module` (buffers in full, parameters empty);
      `ds_autoep_layers`: per MoE layer and rank, the expert-parallel rank and which global experts it holds.
  zero_pp_rank_{r}_mp_rank_00_optim_states.pt  `fp32_flat_groups[i]`: this rank's fp32 master partition of
      sub-group i: every parameter of param_shapes[i] in order, each taking ceil(numel / partition_count)
      elements (the last partition zero-padded); `ds_zero_partition_groups[i]` gives partition_count and this
      rank's partition_rank. Dense parameters are partitioned over all ranks; AutoEP experts over the ranks
      sharing an expert-parallel rank (expert data parallelism), and each expert-parallel rank stores only
      its own experts, stacked (plan.py).
bf16 runs name the optimizer files bf16_zero_pp_rank_*; their content is the same.

Values written: the fp32 masters; buffers (routing biases) from rank 0's model states. Memory, measured
(tests/test_export.py::test_export_streams_shard_by_shard, 437 MiB fp32 model, one 1.3 GB optimizer file,
--max_shard_size 20MB): peak RSS 246 MiB after imports, 392 MiB once planned (tokenizer, transformers' modeling
code, the model on the meta device: independent of the model's size), 461 MiB at the end; writing adds ~3 shard
sizes (the shard's tensors, safetensors' bytes copy of them, the mapped input pieces). Adam moments are never read.
"""
from __future__ import annotations

import gc
import re
from dataclasses import dataclass
from pathlib import Path

from .plan import Checkpoint, Frag, Source, Target, expert_target, finish, numel, same_shape
from .read import ExportError, Opaque, autoep_names, autoep_namer, hf_keys, load, read_state, recorded_hf_config

MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
FLATS = ("optimizer_state_dict", "fp32_flat_groups")


@dataclass
class _Rank:
    rank: int
    model_file: Path
    optim_file: Path


def plan(tag_dir: Path, dtype: str = "fp32") -> Checkpoint:
    """Read every file's metadata, map every piece to its Hugging Face key, check it all against the config."""
    state = read_state(tag_dir)
    ranks = _rank_files(tag_dir, state)
    models = _read_model_states(ranks)
    optims = {r.rank: _optim_meta(r.optim_file, r.rank) for r in ranks}  # before any slow import: fail fast

    cfg = recorded_hf_config(tag_dir, state)
    names = autoep_names(cfg, tag_dir)
    expected = hf_keys(cfg, dtype)
    keys, transposed = expected[0], expected[1]
    moe_paths, expert_info = _expert_placement(models.autoep)
    hf_name = autoep_namer(moe_paths, names, keys)

    frags = _FragmentMap(tag_dir, expert_info, transposed, models.shared, hf_name)
    sources = [frags.add_rank(r, models.shapes[r.rank], optims[r.rank]) for r in ranks]
    frags.check_complete()

    buffers = Source(ranks[0].model_file)
    for name, shape in models.buffers.items():
        key = hf_name(name)
        same_shape(frags.shapes, key, shape, tag_dir)
        buffers.frags.append(Frag(("module", name), 0, numel(shape), 0, Target(key, "dense")))
    return finish("zero3", tag_dir, cfg, expected, frags.shapes, sources + [buffers], dtype)


@dataclass
class _ModelStates:
    shapes: dict     # rank -> [name -> full shape] per ZeRO sub-group, in flat order
    autoep: dict     # rank -> its ds_autoep_layers
    buffers: dict    # engine name -> shape, in the first rank's `module`
    shared: dict     # DeepSpeed's shared_params (tied parameters): no fragments of their own are mapped


def _read_model_states(ranks: list[_Rank]) -> _ModelStates:
    """Every rank's model-states file: parameter shapes, AutoEP placement, shared parameters; rank 0's buffers."""
    out = _ModelStates({}, {}, {}, {})
    for r in ranks:
        ms = load(r.model_file, mmap=True)
        if not isinstance(ms, dict) or "param_shapes" not in ms:
            raise ExportError(f"{r.model_file}: not a ZeRO-3 model-states file (no param_shapes)")
        if ms.get("frozen_param_shapes"):
            raise ExportError(f"{r.model_file}: has frozen (requires_grad=False) parameters "
                              f"({', '.join(list(ms['frozen_param_shapes'])[:3])}, ...), which this exporter does "
                              "not handle yet")
        out.shapes[r.rank] = [dict(g) for g in ms["param_shapes"]]
        out.autoep[r.rank] = ms.get("ds_autoep_layers") or []
        out.shared.update(ms.get("shared_params") or {})
        if r.rank == ranks[0].rank:
            module = ms.get("module") or {}
            out.buffers = {n: tuple(module[n].shape) for n in ms.get("buffer_names") or [] if n in module}
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


class _FragmentMap:
    """Every parameter's fragments, rank file by rank file, as one Source per optimizer file; the output shapes as
    the checkpoint implies them; and the checks that the files come from one save and miss nothing."""

    def __init__(self, tag_dir: Path, expert_info: dict, transposed: dict, shared: dict, hf_name):
        self.tag_dir, self.expert_info, self.transposed, self.shared = tag_dir, expert_info, transposed, shared
        self.hf_name = hf_name
        self.shapes: dict[str, tuple] = {}
        self.seen: dict[tuple, set] = {}     # (engine name, ep_rank) -> partition ranks seen
        self.counts: dict[tuple, int] = {}   # (engine name, ep_rank) -> partition count
        self.experts_seen: dict[tuple, dict[int, int]] = {}  # (HF key, kind) -> global expert -> ep_rank taken from

    def add_rank(self, r: _Rank, groups: list[dict], optim: dict) -> Source:
        if len(groups) != len(optim["sizes"]):
            raise ExportError(f"{r.optim_file}: has {len(optim['sizes'])} parameter groups but "
                              f"{r.model_file.name} lists {len(groups)}; the files come from different saves")
        src = Source(r.optim_file)
        for g, group in enumerate(groups):
            pcount, prank = optim["partitions"][g]
            offset = 0
            for name, shape in group.items():
                n = numel(shape)
                part = -(-n // pcount)
                if name not in self.shared:
                    length = max(0, min(part, n - prank * part))
                    self._add(src, r, name, shape, Frag((*FLATS, g), offset, length, prank * part, None), pcount,
                              prank)
                offset += part
            if offset > optim["sizes"][g]:
                raise ExportError(f"{r.optim_file}: parameter group {g} holds {optim['sizes'][g]} values but its "
                                  f"parameters need {offset}; the file does not belong to {r.model_file.name}")
        return src

    def _add(self, src: Source, r: _Rank, name: str, shape, frag: Frag, pcount: int, prank: int) -> None:
        """One parameter's piece in rank file `r`: partition `prank` of `pcount`, its target not yet set."""
        if name in self.expert_info:
            frag.target, unit = self._expert_target(r, name, shape)
        else:
            key = self.hf_name(name)
            same_shape(self.shapes, key, tuple(shape), self.tag_dir)
            frag.target, unit = Target(key, "dense"), None
        ident = (name, unit)
        if self.counts.setdefault(ident, pcount) != pcount:
            raise ExportError(f"{self.tag_dir}: {name} is partitioned {self.counts[ident]} ways on one rank and "
                              f"{pcount} on another; the files come from different saves")
        if prank in self.seen.setdefault(ident, set()):
            raise ExportError(f"{self.tag_dir}: two files hold partition {prank} of {name}; the files come from "
                              "different saves")
        self.seen[ident].add(prank)
        if frag.length:
            src.frags.append(frag)

    def _expert_target(self, r: _Rank, name: str, shape) -> tuple[Target, int]:
        """Where rank `r`'s stacked local experts of `name` (`<moe>.experts.w1|w2|w3`) go, and its ep rank."""
        if r.rank not in self.expert_info[name]:
            raise ExportError(f"{r.model_file}: holds {name} but no AutoEP metadata for it "
                              "(ds_autoep_layers); the files come from different saves")
        ep_rank, owned, num = self.expert_info[name][r.rank]
        if len(shape) != 3 or shape[0] != len(owned):
            raise ExportError(f"{r.model_file}: {name} has shape {tuple(shape)} but AutoEP metadata "
                              f"places {len(owned)} experts on expert-parallel rank {ep_rank}")
        key, kind, full = expert_target(name, shape, num, self.hf_name(name.rsplit(".", 1)[0]), self.transposed)
        same_shape(self.shapes, key, full, self.tag_dir)
        owners = self.experts_seen.setdefault((key, kind), {})
        local = []  # global index of each local expert; None where another rank's copy is used
        for ge in owned:
            if not 0 <= ge < num:
                raise ExportError(f"{r.model_file}: AutoEP placement names expert {ge} of {num}")
            local.append(ge if owners.setdefault(ge, ep_rank) == ep_rank else None)
        return Target(key, kind, local), ep_rank

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


def _rank_files(tag_dir: Path, state: dict) -> list[_Rank]:
    ranks, mp = {}, set()
    for f in tag_dir.iterdir():
        m = MODEL_FILE.match(f.name)
        if m:
            ranks[int(m.group(1))] = f
            mp.add(int(m.group(2)))
    if mp != {0}:
        raise ExportError(f"{tag_dir}: has model-parallel ranks {sorted(mp)}; tensor-parallel ZeRO-3 checkpoints "
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
    sd = load(path, mmap=True)
    try:
        osd = sd["optimizer_state_dict"]
        stage = osd.get("zero_stage")
        stage = stage.args[0] if isinstance(stage, Opaque) and stage.args else stage
        if stage is not None and int(getattr(stage, "value", stage)) != 3:
            raise ExportError(f"{path}: a ZeRO stage {int(stage)} optimizer file among ZeRO-3 model-states files; the "
                              "files come from different saves")
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

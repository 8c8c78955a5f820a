"""ZeRO-1/2 checkpoints (ds_configs/zero2.json runs) -> the export plan (plan.py). A pipeline checkpoint is one of
these per stage (pipeline.py plans it through `plan_stages`).

What a checkpoint holds (DeepSpeed 0.19.8, DeepSpeedZeroOptimizer stage 1/2 or BF16_Optimizer, AutoEP; `s` is
the model-parallel rank: 00, or the pipeline stage):
  mp_rank_{s:02d}_model_states.pt  written by data-parallel rank 0: `module`, every weight and buffer in the model
      dtype except AutoEP's routed experts; `param_shapes`, per optimizer parameter group its parameters (the
      experts' group with their local stacks, [local experts, A, B]); `buffer_names`; `ds_autoep_layers`, per MoE
      layer the experts of each expert-parallel rank; `ds_config`. (A pipeline without AutoEP saves `module` None
      and one layer_{i:02d}-model_states.pt per PipelineModule layer instead.)
  layer_{m}_expert_{e}_mp_rank_{s:02d}_model_states.pt  expert e of the m-th MoE layer in the model dtype:
      `<moe>.experts.w1.<e>` (gate, [ffn, hidden]), `w3` (up), `w2` (down, [hidden, ffn]).
  [bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt  data-parallel rank d: per parameter group its
      contiguous slice of the fp32 masters (`single_partition_of_fp32_groups`) and where each parameter's piece
      lies in it (`param_slice_mappings`: name -> start, numel). A parameter's pieces in partition order are the
      whole parameter. Dense groups are partitioned over the data-parallel ranks (partition d); an expert group over
      the ranks of one expert-parallel rank, which hold that rank's experts (see `expert_coords`).
Values written: the fp32 masters, as for ZeRO-3; the model files supply the buffers (routing biases) and, when
there are no optimizer files (a ZeRO stage 0 pipeline), the weights. Read shard by shard (plan.py).
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from .plan import Checkpoint, Frag, Source, Target, expert_target, finish, numel, same_shape
from .read import ExportError, Opaque, autoep_names, autoep_namer, hf_keys, load, read_state, recorded_hf_config

OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)-model_states\.pt$")
MASTERS = ("optimizer_state_dict", "single_partition_of_fp32_groups")


def model_file(tag_dir: Path, stage: int) -> Path:
    return tag_dir / f"mp_rank_{stage:02d}_model_states.pt"


def plan(tag_dir: Path, dtype: str = "fp32") -> Checkpoint:
    return plan_stages(tag_dir, dtype, "zero12", 1, lambda name, cfg: name)


def plan_stages(tag_dir: Path, dtype: str, layout: str, stages: int, rename) -> Checkpoint:
    """Plan a checkpoint of `stages` model-parallel ranks; `rename(name, hf_config)` takes an engine name (AutoEP's
    renamed back) to the Hugging Face key (the identity, or a pipeline's layer index -> the model's)."""
    state = read_state(tag_dir)
    models = [_read_model_states(tag_dir, s) for s in range(stages)]
    optims = _optimizer_files(tag_dir, stages, state)
    masters = [_read_masters(tag_dir, s, optims[s], models[s]) for s in range(stages)]  # before any slow import

    cfg = recorded_hf_config(tag_dir, state)
    expected = hf_keys(cfg, dtype)
    names = autoep_names(cfg, tag_dir)
    moe_paths = [e["module_path"] for m in models for e in m["autoep"]]
    to_hf = autoep_namer(moe_paths, names, expected[0])
    hf_name = lambda name: rename(to_hf(name), cfg)  # noqa: E731
    shapes: dict[str, tuple] = {}
    by_file = {f: Source(f) for s in range(stages) for f in optims[s].values()}
    tensors, params, pieces = {}, {}, {}  # engine names are unique across model-parallel ranks (stages)
    for m, got in zip(models, masters):
        tensors.update(m["tensors"])
        params.update(m["params"])
        pieces.update(got)
    _dense(tag_dir, tensors, params, pieces, hf_name, shapes, by_file)
    for s, m in enumerate(models):
        for layer in m["autoep"]:
            for w in ("w1", "w2", "w3"):
                _experts(tag_dir, s, layer, w, m["params"], masters[s], hf_name, expected[1], shapes, by_file)
    return finish(layout, tag_dir, cfg, expected, shapes, list(by_file.values()), dtype)


def _read_model_states(tag_dir: Path, stage: int) -> dict:
    """One model-parallel rank's model states: its tensors (engine name -> (file, path in it, shape)), parameter
    shapes (name -> local shape; empty without a ZeRO optimizer), buffer names, AutoEP layers, DS config."""
    f = model_file(tag_dir, stage)
    if not f.is_file():
        raise ExportError(f"{tag_dir}: {f.name} is missing; copy every model-parallel rank's (stage's) files")
    ms = load(f, mmap=True)
    if not isinstance(ms, dict):
        raise ExportError(f"{f}: not a DeepSpeed model-states file")
    if ms.get("frozen_param_fragments") or ms.get("frozen_param_shapes"):
        raise ExportError(f"{f}: has frozen (requires_grad=False) parameters, which this exporter does not handle yet")
    params = {n: tuple(shape) for g in ms.get("param_shapes") or [] for n, shape in g.items()}
    buffers = set(ms.get("buffer_names") or [])
    tensors = {}
    if ms.get("module") is not None:
        # param_shapes + buffer_names name each tensor once: `module` also holds aliases (AutoEP's Qwen3 layer exposes
        # its router again as `mlp.gate` for transformers' output recorders).
        tensors = {k: (f, ("module", k), tuple(v.shape)) for k, v in ms["module"].items()
                   if not params or k in params or k in buffers}  # no param_shapes: a stage-0 pipeline
    elif stage == 0:  # a pipeline without AutoEP: one file per PipelineModule layer, keys relative to the layer
        for lf in sorted(tag_dir.iterdir()):
            m = LAYER_FILE.match(lf.name)
            if m:
                layer = int(m.group(1))
                tensors.update({f"{layer}.{k}": (lf, (k,), tuple(v.shape)) for k, v in load(lf, mmap=True).items()})
    autoep = ms.get("ds_autoep_layers") or []
    return {"file": f, "tensors": tensors, "params": params, "buffers": buffers, "autoep": autoep,
            "ds_config": ms.get("ds_config") or {}}


def _optimizer_files(tag_dir: Path, stages: int, state: dict) -> list[dict[int, Path]]:
    """Per model-parallel rank: data-parallel rank -> its optimizer file ({} when there are none: ZeRO stage 0);
    one per data-parallel rank of the run (engine_state.json's world_size / stages)."""
    files: list[dict[int, Path]] = [{} for _ in range(stages)]
    for f in tag_dir.iterdir():
        m = OPTIM_FILE.match(f.name)
        if m:
            d, s = int(m.group(1)), int(m.group(2))
            if s >= stages:
                raise ExportError(f"{tag_dir}: {f.name} is for model-parallel rank {s}, but the checkpoint has "
                                  f"{stages}; the files come from different saves")
            if d in files[s]:
                raise ExportError(f"{tag_dir}: {f.name} is there twice (also with bf16_); copy exactly one save's "
                                  "files")
            files[s][d] = f
    dp = int(state.get("world_size", 0)) // stages  # 0: not recorded
    for s, ranks in enumerate(files):
        want = set(range(dp or max(ranks, default=-1) + 1))
        if ranks and set(ranks) != want:
            missing, extra = sorted(want - set(ranks)), sorted(set(ranks) - want)
            raise ExportError(f"{tag_dir}: the run had {len(want)} data-parallel ranks (mp_rank_{s:02d}) but the "
                              f"optimizer files of ranks {missing or extra} are {'missing' if missing else 'extra'}; "
                              "copy exactly that save's zero_pp_rank_* files")
    return files


def expert_coords(d: int, dp: int, ep: int, data_before_expert: bool) -> tuple[int, int]:
    """(expert-parallel rank, partition in its expert-data-parallel group) of data-parallel rank d, as DeepSpeed's
    groups._create_expert_and_data_parallel places them: expert-data-parallel groups are strided (ranks i, i + ep,
    ...), or contiguous blocks with the DS config's use_data_before_expert_parallelism."""
    return (d // (dp // ep), d % (dp // ep)) if data_before_expert else (d % ep, d // ep)


def _read_masters(tag_dir: Path, stage: int, files: dict[int, Path], model: dict) -> dict:
    """Every fp32 master piece of one model-parallel rank: (engine name, expert-parallel rank) -> [(partition,
    Frag without target)], the partitions in file order; {} without optimizer files."""
    if not files:
        return {}
    if model["autoep"] and model["params"] == {}:
        raise ExportError(f"{model['file']}: has no param_shapes although optimizer files are there; the files come "
                          "from different saves")
    dp, ep = len(files), int(model["autoep"][0]["ep_size"]) if model["autoep"] else 1
    if dp % ep:
        raise ExportError(f"{tag_dir}: {dp} data-parallel optimizer files for mp_rank_{stage:02d} but expert-parallel "
                          f"size {ep}; copy every rank's zero_pp_rank_* files")
    before = bool(model["ds_config"].get("use_data_before_expert_parallelism", False))
    experts = {f"{layer['expert_key_prefix']}.{w}" for layer in model["autoep"] for w in ("w1", "w2", "w3")}
    pieces: dict[tuple, list] = defaultdict(list)
    for d, f in sorted(files.items()):
        sd = load(f, mmap=True)
        try:
            osd = sd["optimizer_state_dict"]
            stage_enum = osd.get("zero_stage")
            zs = stage_enum.args[0] if isinstance(stage_enum, Opaque) and stage_enum.args else stage_enum
            if zs is not None and int(getattr(zs, "value", zs)) not in (1, 2):
                raise ExportError(f"{f}: a ZeRO stage {int(zs)} optimizer file next to {model['file'].name}; the files "
                                  "come from different saves")
            flats, maps = osd[MASTERS[1]], osd["param_slice_mappings"]
            for g, (flat, mapping) in enumerate(zip(flats, maps)):
                for name, addr in mapping.items():  # DeepSpeed's fragment_address dataclass, read as Opaque
                    where = getattr(addr, "state", None) or vars(addr)
                    start, n = int(where["start"]), int(where["numel"])
                    if start + n > flat.numel():
                        raise ExportError(f"{f}: {name} lies past the end of parameter group {g}; the file is corrupt")
                    ep_rank, part = expert_coords(d, dp, ep, before) if name in experts else (0, d)
                    pieces[(name, ep_rank)].append((part, Frag((*MASTERS, g), start, n, 0, None), f))
        except ExportError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ExportError(f"{f}: not a ZeRO-1/2 optimizer-states file ({type(e).__name__}: {e})") from None
        finally:
            del sd
    out = {}
    for ident, got in pieces.items():
        got.sort(key=lambda x: x[0])
        parts = [p for p, _, _ in got]
        if len(set(parts)) != len(parts):
            raise ExportError(f"{tag_dir}: two optimizer files hold the same partition of {ident[0]}; the files come "
                              "from different saves")
        start = 0
        for _, frag, _ in got:
            frag.start, start = start, start + frag.length  # where the piece lies in the whole (local) parameter
        out[ident] = [(frag, f) for _, frag, f in got]
    return out


def _dense(tag_dir: Path, tensors: dict, params: dict, masters: dict, hf_name, shapes: dict, by_file: dict) -> None:
    """Every weight and buffer but the routed experts: from the fp32 masters where there are optimizer files, else
    (buffers; weights of a ZeRO stage 0 pipeline) from the model files."""
    for name, (f, path, shape) in tensors.items():
        key = hf_name(name)
        same_shape(shapes, key, shape, tag_dir)
        if masters and name in params:
            got = masters.get((name, 0), [])
            if sum(frag.length for frag, _ in got) != numel(shape):
                raise ExportError(f"{tag_dir}: the optimizer files hold {sum(frag.length for frag, _ in got)} of the "
                                  f"{numel(shape)} values of {name}; copy every rank's zero_pp_rank_* files of that "
                                  "save")
            for frag, src in got:
                frag.target = Target(key, "dense")
                by_file[src].frags.append(frag)
        else:
            by_file.setdefault(f, Source(f)).frags.append(Frag(path, 0, numel(shape), 0, Target(key, "dense")))
    unknown = [n for n, r in masters if n not in tensors and n not in params]
    if unknown:
        raise ExportError(f"{tag_dir}: the optimizer files hold {unknown[0]}, which the model files do not have; the "
                          "files come from different saves")


def _experts(tag_dir: Path, stage: int, layer: dict, w: str, params: dict, masters: dict, hf_name, transposed: dict,
             shapes: dict, by_file: dict) -> None:
    """One MoE layer's `w` (w1 gate, w3 up, w2 down) of every expert: each expert-parallel rank's stack from the
    masters, or (no optimizer files) each expert from its own file."""
    name = f"{layer['expert_key_prefix']}.{w}"
    num, ep = int(layer["num_experts"]), int(layer["ep_size"])
    ranks = (layer.get("expert_placement") or {}).get("ranks") or [
        {"rank": r, "experts": list(range(r * num // ep, (r + 1) * num // ep))} for r in range(ep)]
    owned = {int(r["rank"]): [int(x) for x in r["experts"]] for r in ranks}
    hf_prefix = hf_name(layer["expert_key_prefix"])
    taken: set[int] = set()
    for r, experts in sorted(owned.items()):
        if any(not 0 <= e < num for e in experts):
            raise ExportError(f"{tag_dir}: AutoEP placement of {layer['module_path']} names experts {experts} of {num}")
        local = [e if e not in taken else None for e in experts]  # None: another rank's copy is used
        taken.update(experts)
        if masters:
            stack = params.get(name)
            if stack is None or len(stack) != 3 or stack[0] != len(experts):
                raise ExportError(f"{tag_dir}: {name} has shape {stack} in param_shapes but AutoEP places "
                                  f"{len(experts)} experts on expert-parallel rank {r}; the files come from different "
                                  "saves")
            got = masters.get((name, r), [])
            if sum(frag.length for frag, _ in got) != numel(stack):
                raise ExportError(f"{tag_dir}: the optimizer files hold {sum(frag.length for frag, _ in got)} of the "
                                  f"{numel(stack)} values of {name} on expert-parallel rank {r}; copy every rank's "
                                  "zero_pp_rank_* files of that save")
            key, kind, full = expert_target(name, stack, num, hf_prefix, transposed)
            for frag, src in got:
                frag.target = Target(key, kind, local)
                by_file[src].frags.append(frag)
        else:
            for e, g in zip(experts, local):
                f, per = _expert_file(tag_dir, stage, layer, w, e)
                key, kind, full = expert_target(name, (1, *per), num, hf_prefix, transposed)
                if g is not None:
                    by_file.setdefault(f, Source(f)).frags.append(Frag((f"{name}.{e}",), 0, numel(per), 0,
                                                                       Target(key, kind, [g])))
        same_shape(shapes, key, full, tag_dir)
    if taken != set(range(num)):
        raise ExportError(f"{tag_dir}: AutoEP placement of {layer['module_path']} leaves experts "
                          f"{sorted(set(range(num)) - taken)} of {num} on no rank; the files come from different saves")


def _expert_file(tag_dir: Path, stage: int, layer: dict, w: str, e: int) -> tuple[Path, tuple]:
    """Expert e's own file and the shape of its `w` ([ffn, hidden], w2 [hidden, ffn])."""
    f = tag_dir / f"layer_{layer['moe_layer_id']}_expert_{e}_mp_rank_{stage:02d}_model_states.pt"
    if not f.is_file():
        raise ExportError(f"{tag_dir}: {f.name} is missing (expert {e} of {layer['module_path']}); copy every expert "
                          "file of the save")
    t = load(f, mmap=True).get(f"{layer['expert_key_prefix']}.{w}.{e}")
    if t is None:
        raise ExportError(f"{f}: has no {layer['expert_key_prefix']}.{w}.{e}; the files come from different saves")
    return f, tuple(t.shape)

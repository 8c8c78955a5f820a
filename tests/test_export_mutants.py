"""engine/export/'s own rules, one a test, each a change to engine/export/*.py (a mutant) that every other fast test
(tests/test_export_pipeline_units.py, the unit tests of tests/test_export.py) let through: the three readers
(ZeRO-3, ZeRO-1/2, pipeline) end to end on small synthetic checkpoints (odd-sized ZeRO-3 partitions, a
non-contiguous expert placement, data-before-expert parallelism, a stage-0 pipeline with per-expert files), the bf16
export's strict-fp32 tensors, the checkpoint folder (`latest`, --tag, RUN_DIR), the layout and the manifest check,
AutoEP's names back to the model's, safe loading, the recorded config, the key check's message, each reader's
refusals of files from different saves, and write.py (shard sizes and names, --max_shard_size, the output folder,
config.json, file modes, the CLI's exit code).

No launcher, no training: each checkpoint is written here with torch.save from a random state dict of a tiny
transformers model (DeepSeek-V3, Qwen3-MoE), shaped as DeepSpeed 0.19.8 writes it (engine/export/zero3.py and
zero12.py's docstrings), its config in init_model/config.json; the export is then compared with that state dict,
tensor for tensor. Expectations are literal values or the state dict the files were cut from, never the code under
test run a second time. The bracket at the end of a docstring says which mutant the test kills."""
from __future__ import annotations

import json
import re
import os
from pathlib import Path

import pytest
import torch

from engine.export import ExportError, find_tag_dir, layout, open_checkpoint
from engine.export.read import check_against_config, hf_keys, load
from engine.export.write import _check_output, _shards, main, parse_args, parse_size, write_shards

F32 = torch.float32


def deepseek_cfg():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=16, hidden_size=8, intermediate_size=16, moe_intermediate_size=3,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=0, kv_lora_rank=4,
                            q_lora_rank=None, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=3, head_dim=2,
                            n_group=1, topk_group=1, tie_word_embeddings=False)


def qwen_cfg(**kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**dict(vocab_size=16, hidden_size=8, intermediate_size=16, moe_intermediate_size=3,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                    num_experts=4, num_experts_per_tok=1, tie_word_embeddings=False), **kw})


MOE = "model.layers.0.mlp"
PREFIX = f"{MOE}.experts"


def random_state(cfg, seed=0) -> dict:
    """A state dict of the right keys and shapes, every value distinct (a misplaced piece shows)."""
    keys = hf_keys(cfg, "fp32")[0]
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) for k, (shape, _) in keys.items()}


def engine_names(want: dict) -> tuple[dict, set, dict]:
    """HF state dict -> (engine dense tensors incl. buffers, buffer names, expert stacks w1/w2/w3 [E, A, B])."""
    dense, buffers = {}, set()
    for k, t in want.items():
        if k.startswith(PREFIX + "."):
            continue
        name = k.replace(f"{MOE}.gate.", f"{MOE}.router.gate.") if k.endswith("gate.weight") and ".mlp.gate." in k \
            else k.replace(f"{MOE}.gate.e_score_correction_bias", f"{MOE}.router.e_score_correction_bias")
        dense[name] = t
        if name.endswith("e_score_correction_bias"):
            buffers.add(name)
    gu, down = want[f"{PREFIX}.gate_up_proj"], want[f"{PREFIX}.down_proj"]
    ffn = gu.shape[1] // 2
    return dense, buffers, {"w1": gu[:, :ffn], "w3": gu[:, ffn:], "w2": down}


def tag_folder(root: Path, cfg, world: int) -> Path:
    tag = root / "run" / "checkpoints" / "step_00000001"
    (tag / "init_model").mkdir(parents=True)
    cfg.save_pretrained(tag / "init_model")
    (tag / "engine_state.json").write_text(json.dumps({"step": 1, "position": 0, "world_size": world,
                                                       "recipe": {"model": {"arch": cfg.model_type}}}))
    (tag.parent / "latest").write_text(tag.name)
    return tag


def cut(values: torch.Tensor, count: int, i: int) -> tuple[torch.Tensor, int]:
    """Partition i of count of flat `values`, ceil-sized, the last zero-padded (ZeRO-3); and the piece size."""
    part = -(-values.numel() // count)
    flat = torch.cat([values.reshape(-1), torch.zeros(part * count - values.numel())])
    return flat[i * part:(i + 1) * part], part


def checkpoint_parts(root: Path, cfg, files: int, ep: int, owned, seed: int):
    """What both checkpoint builders start from: the HF state dict (`want`), its engine-named dense tensors, buffers
    and expert stacks, the expert count, the placement (`owned`, or contiguous blocks per expert-parallel rank), the
    tag folder for `files` ranks, and the dense parameters (buffers left out)."""
    want = random_state(cfg, seed)
    dense, buffers, stacks = engine_names(want)
    num = want[f"{PREFIX}.gate_up_proj"].shape[0]
    owned = owned or {k: list(range(k * num // ep, (k + 1) * num // ep)) for k in range(ep)}
    params = {n: t for n, t in dense.items() if n not in buffers}
    return want, dense, buffers, stacks, num, owned, tag_folder(root, cfg, files), params


def zero3_checkpoint(root: Path, cfg, world=2, ep=2, owned=None, seed=0, extra_model=None, extra_optim=None):
    """A ZeRO-3 + AutoEP checkpoint of `world` ranks, expert-parallel size `ep` (rank r: ep rank r % ep, expert-data
    partition r // ep), expert placement `owned` (ep rank -> global experts); returns (tag folder, HF state dict)."""
    want, dense, buffers, stacks, num, owned, tag, params = checkpoint_parts(root, cfg, world, ep, owned, seed)
    for r in range(world):
        ep_rank, edp = r % ep, r // ep
        local = {f"{PREFIX}.{w}": stacks[w][owned[ep_rank]] for w in ("w1", "w2", "w3")}
        flats, parts = [], []
        for group, count, prank in ((params, world, r), (local, world // ep, edp)):
            flats.append(torch.cat([cut(t, count, prank)[0] for t in group.values()]))
            parts.append({"partition_count": count, "partition_rank": prank})
        layer = {"module_path": MOE, "expert_key_prefix": PREFIX, "num_experts": num, "ep_size": ep,
                 "ep_rank": ep_rank, "moe_layer_id": 0,
                 "expert_placement": {"ranks": [{"rank": k, "experts": v} for k, v in owned.items()]}}
        ms = {"param_shapes": [{n: tuple(t.shape) for n, t in params.items()},
                               {n: tuple(t.shape) for n, t in local.items()}],
              "buffer_names": sorted(buffers), "module": {n: dense[n].clone() for n in buffers},
              "ds_autoep_layers": [layer], **(extra_model or {})}
        torch.save(ms, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        osd = {"zero_stage": 3, "fp32_flat_groups": flats, "ds_zero_partition_groups": parts, **(extra_optim or {})}
        torch.save({"optimizer_state_dict": osd}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return tag, want


def zero12_checkpoint(root: Path, cfg, dp=4, ep=2, before=False, owned=None, seed=0, stage=2, skip=()):
    """A ZeRO-1/2 + AutoEP checkpoint: one mp_rank_00 model file, `dp` optimizer files, each a contiguous slice of
    the flat fp32 dense masters and of its expert-parallel rank's expert masters (DeepSpeed's fragment_address
    mappings); `before`: use_data_before_expert_parallelism. `skip`: optimizer files not written."""
    from deepspeed.utils.tensor_fragment import fragment_address

    from engine.export.zero12 import expert_coords

    want, dense, buffers, stacks, num, owned, tag, params = checkpoint_parts(root, cfg, dp, ep, owned, seed)
    locals_ = {k: {f"{PREFIX}.{w}": stacks[w][owned[k]] for w in ("w1", "w2", "w3")} for k in range(ep)}
    layer = {"module_path": MOE, "expert_key_prefix": PREFIX, "num_experts": num, "ep_size": ep, "moe_layer_id": 0,
             "expert_placement": {"ranks": [{"rank": k, "experts": v} for k, v in owned.items()]}}
    ms = {"module": {n: t.clone() for n, t in dense.items()},
          "param_shapes": [{n: tuple(t.shape) for n, t in params.items()},
                           {n: tuple(t.shape) for n, t in locals_[0].items()}],
          "buffer_names": sorted(buffers), "ds_autoep_layers": [layer],
          "ds_config": {"use_data_before_expert_parallelism": before}}
    torch.save(ms, tag / "mp_rank_00_model_states.pt")

    def slice_of(group: dict, count: int, i: int):
        flat = torch.cat([t.reshape(-1) for t in group.values()])
        size = -(-flat.numel() // count)
        lo, hi = i * size, min((i + 1) * size, flat.numel())
        mapping, pos = {}, 0
        for n, t in group.items():
            a, b = max(lo, pos), min(hi, pos + t.numel())
            if a < b:
                mapping[n] = fragment_address(numel=b - a, start=a - lo)
            pos += t.numel()
        return flat[lo:hi].clone(), mapping

    for d in range(dp):
        if d in skip:
            continue
        ep_rank, part = expert_coords(d, dp, ep, before)
        (f0, m0), (f1, m1) = slice_of(params, dp, d), slice_of(locals_[ep_rank], dp // ep, part)
        osd = {"zero_stage": stage, "single_partition_of_fp32_groups": [f0, f1], "param_slice_mappings": [m0, m1]}
        torch.save({"optimizer_state_dict": osd}, tag / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")
    return tag, want


def exported(tag, dtype="fp32") -> dict:
    ck = open_checkpoint(tag, dtype=dtype, verify=False)
    return ck.read(list(ck.keys))


def same(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ


# ------------------------------------------------------------------------------------ the readers, end to end


def test_zero3_export_is_the_state_dict_the_files_were_cut_from(tmp_path):
    """ZeRO-3, 4 ranks, expert-parallel 2 (each expert stack also split over 2 ranks), experts placed
    non-contiguously ({0: [3, 1], 1: [0, 2]}), odd-sized parameters (padding in the last partition), the routing
    bias a buffer of rank 0's model file: the export is the state dict, every tensor bitwise, the layout "zero3".
    [kills: zero3 partition size floor instead of ceil; a negative piece length for the last partitions kept; the
    padded empty pieces appended; ep_rank always 0; buffers dropped or read from every rank; the shape check of a
    buffer dropped; router/expert names not mapped back (hf_name skipped for expert prefixes); place() half/slice
    swapped; layout dispatch or the `any` of zero_pp files changed]"""
    tag, want = zero3_checkpoint(tmp_path, deepseek_cfg(), world=4, ep=2, owned={0: [3, 1], 1: [0, 2]})
    assert layout(tag) == "zero3"
    same(exported(tag), want)


def test_zero12_export_with_data_before_expert_parallelism(tmp_path):
    """ZeRO-2, 4 data-parallel optimizer files, expert-parallel 2, use_data_before_expert_parallelism in the model
    file's ds_config (files 0-1 hold ep rank 0, files 2-3 ep rank 1), experts placed {0: [2, 0], 1: [3, 1]}, the
    dense masters cut across parameter boundaries: the export is the state dict, bitwise; the buffer comes from the
    model file. [kills: the ds_config flag ignored (strided groups assumed); ep size taken as 1; a piece's start in
    its parameter advanced by 1 instead of its length; partitions not sorted; buffers treated as masters]"""
    tag, want = zero12_checkpoint(tmp_path, deepseek_cfg(), dp=4, ep=2, before=True, owned={0: [2, 0], 1: [3, 1]})
    assert layout(tag) == "zero12"
    same(exported(tag), want)


def test_zero12_export_strided_expert_groups(tmp_path):
    """The same with DeepSpeed's default strided expert-data-parallel groups (file d: ep rank d % 2), Qwen3-MoE (no
    buffers). [kills: the partition order of a parameter's pieces not sorted; a piece's start wrong]"""
    tag, want = zero12_checkpoint(tmp_path, qwen_cfg(), dp=4, ep=2, before=False)
    same(exported(tag), want)


def pipeline_checkpoint(root: Path, cfg, seed=0):
    """A ZeRO stage 0 pipeline of 2 stages (no optimizer files): stage 0 = layer 0 (embedding) and layer 1 (the
    decoder layer, AutoEP experts in per-expert files), stage 1 = layer 2 (norm, head); names `<layer>.<path>`."""
    want = random_state(cfg, seed)
    dense, buffers, stacks = engine_names(want)
    tag = tag_folder(root, cfg, 2)

    def pipe(name):
        if name.startswith("model.embed_tokens."):
            return 0, "0." + name[len("model."):]
        if name.startswith("model.layers.0."):
            return 0, "1.layer." + name[len("model.layers.0."):]
        return 1, "2." + (name if name.startswith("lm_head.") else name[len("model."):])

    modules = [{}, {}]
    for n, t in dense.items():
        s, p = pipe(n)
        modules[s][p] = t.clone()
    prefix = "1.layer.mlp.experts"
    num = stacks["w1"].shape[0]
    layer = {"module_path": "1.layer.mlp", "expert_key_prefix": prefix, "num_experts": num, "ep_size": 1,
             "moe_layer_id": 0}
    for s in range(2):
        torch.save({"module": modules[s], "buffer_names": [pipe(b)[1] for b in buffers if pipe(b)[0] == s],
                    "ds_autoep_layers": [layer] if s == 0 else [], "ds_config": {"pipeline": {"stages": 2}}},
                   tag / f"mp_rank_{s:02d}_model_states.pt")
    for e in range(num):
        torch.save({f"{prefix}.{w}.{e}": stacks[w][e].clone() for w in ("w1", "w2", "w3")},
                   tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
    return tag, want


def test_pipeline_stage0_export(tmp_path):
    """A 2-stage pipeline without optimizer files: layout "pipeline" (ds_config.pipeline.stages 2), weights from the
    model files, experts from their own files, names `<layer>.<path>` back to the model's.
    [kills: stages() defaulting to 1 without a pipeline section (then tested on a ZeRO-1/2 folder); the layout's
    pipeline/zero12 choice swapped or dispatched to zero12; no param_shapes no longer meaning "every module key"]"""
    tag, want = pipeline_checkpoint(tmp_path, deepseek_cfg())
    assert layout(tag) == "pipeline"
    same(exported(tag), want)
    z12, _ = zero12_checkpoint(tmp_path / "z", qwen_cfg(), dp=2, ep=2)
    assert layout(z12) == "zero12"


def test_bf16_export_keeps_the_strict_fp32_tensors_in_fp32(tmp_path):
    """--dtype bf16: every tensor bf16 except transformers' _keep_in_fp32_modules_strict ones (DeepSeek-V3's
    e_score_correction_bias), which stay fp32 with their exact values; fp32 exports are all fp32.
    [kills: the strict set taken for fp32 instead of bf16; strict_fp32 test inverted in finish(); a module name
    matched only against the key's parent names]"""
    tag, want = zero3_checkpoint(tmp_path, deepseek_cfg(), world=2, ep=2)
    ck = open_checkpoint(tag, dtype="bf16", verify=False)
    bias = f"{MOE}.gate.e_score_correction_bias"
    assert {k for k, (_, dt) in ck.keys.items() if dt == F32} == {bias}
    got = ck.read([bias, "lm_head.weight"])
    assert got[bias].dtype == F32 and torch.equal(got[bias], want[bias])
    assert got["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lm_head.weight"], want["lm_head.weight"].to(torch.bfloat16))
    assert {dt for _, dt in open_checkpoint(tag, verify=False).keys.values()} == {F32}


def test_read_of_some_keys_skips_the_pieces_of_others(tmp_path):
    """Checkpoint.read(keys) for one shard: pieces of tensors of other shards in the same files are skipped.
    [kills: read() taking every fragment of a file, not only those of the wanted keys]"""
    tag, want = zero3_checkpoint(tmp_path, qwen_cfg(), world=2, ep=1)
    ck = open_checkpoint(tag, verify=False)
    got = ck.read(["model.norm.weight"])
    assert list(got) == ["model.norm.weight"] and torch.equal(got["model.norm.weight"], want["model.norm.weight"])


# --------------------------------------------------------------------------- the checkpoint folder (__init__.py)


def test_open_checkpoint_refuses_an_unknown_dtype(tmp_path):
    """open_checkpoint(dtype="fp16") is one line naming the choices, before any file is read (transformers would
    otherwise fail with a KeyError deep in hf_keys). [kills: open_checkpoint's dtype check dropped]"""
    tag, _ = zero3_checkpoint(tmp_path, qwen_cfg(), world=1, ep=1)
    with pytest.raises(ExportError) as e:
        open_checkpoint(tag, dtype="fp16", verify=False)
    assert str(e.value) == "--dtype fp16: choose one of fp32, bf16"


def test_open_checkpoint_checks_the_manifest_only_when_asked(tmp_path):
    """verify=True reads manifest.json (engine/checkpoint.py damage): a file whose size is not the recorded one is
    refused as damaged; verify=False plans it anyway; an intact checkpoint passes verify=True.
    [kills: `if verify` inverted; `if bad` inverted]"""
    tag, _ = zero3_checkpoint(tmp_path, qwen_cfg(), world=1, ep=1)
    assert open_checkpoint(tag).layout == "zero3"  # no manifest: every .pt a readable zip
    files = {f.name: {"size": f.stat().st_size + (f.name.endswith("optim_states.pt")), "zip": f.suffix == ".pt"}
             for f in tag.iterdir() if f.is_file()}
    (tag / "manifest.json").write_text(json.dumps({"tag": tag.name, "files": files}))
    with pytest.raises(ExportError, match=r"is damaged \(zero_pp_rank_0_mp_rank_00_optim_states.pt has \d+ bytes"):
        open_checkpoint(tag)
    assert open_checkpoint(tag, verify=False).layout == "zero3"


def test_layout_of_a_folder_without_model_files(tmp_path):
    """A folder with no *_model_states.pt is not a checkpoint: one line, not a ZeRO-1/2 plan of nothing.
    [kills: layout's `if not files` check dropped]"""
    (tmp_path / "optim.pt").write_bytes(b"")
    with pytest.raises(ExportError) as e:
        layout(tmp_path)
    assert str(e.value) == (f"{tmp_path}: no DeepSpeed model-states files (zero_pp_rank_*_model_states.pt or "
                            "mp_rank_*_model_states.pt); not a checkpoint folder")


def ckpt_tree(tmp_path: Path, tags=("step_00000003", "step_00000005"), latest="step_00000005") -> Path:
    ck = tmp_path / "run" / "checkpoints"
    for tag in tags:
        (ck / tag).mkdir(parents=True)
        (ck / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    (ck / "universal").mkdir()  # a folder without model files is no checkpoint
    if latest is not None:
        (ck / "latest").write_text(latest + "\n")
    return ck


def test_find_tag_dir_from_a_run_dir_and_a_tag_folder(tmp_path):
    """RUN_DIR finds RUN_DIR/checkpoints and its `latest`; a tag folder given itself is used as is; --tag with a tag
    folder is refused (the tag folder has no sub-checkpoints). [kills: RUN_DIR/checkpoints not looked into; a tag
    folder returned even when --tag names another checkpoint]"""
    ck = ckpt_tree(tmp_path)
    assert find_tag_dir(tmp_path / "run", None) == ck / "step_00000005"
    assert find_tag_dir(ck / "step_00000003", None) == ck / "step_00000003"
    with pytest.raises(ExportError) as e:
        find_tag_dir(ck / "step_00000003", "step_00000005")
    assert str(e.value) == f"--tag step_00000005: no such checkpoint in {ck / 'step_00000003'} (available: none)"


@pytest.mark.parametrize("tag", ["..", ".", "step_00000003/.."])
def test_find_tag_dir_refuses_a_tag_that_leaves_the_folder(tmp_path, tag):
    """--tag is one folder name: '..', '.' and a path are refused, listing the checkpoints (only folders with model
    files). [kills: the '/' check dropped; the '.'/'..' check dropped; folders without model files listed]"""
    ck = ckpt_tree(tmp_path)
    with pytest.raises(ExportError) as e:
        find_tag_dir(ck, tag)
    assert str(e.value) == f"--tag {tag}: no such checkpoint in {ck} (available: step_00000003, step_00000005)"


def test_find_tag_dir_latest_naming_a_missing_folder(tmp_path):
    """`latest` names a checkpoint that is not there: one line, not a path that does not exist.
    [kills: the check that `latest`'s folder exists dropped]"""
    ck = ckpt_tree(tmp_path, latest="step_00000009")
    with pytest.raises(ExportError) as e:
        find_tag_dir(ck, None)
    assert str(e.value) == (f"checkpoint dir {ck}: `latest` names 'step_00000009', which is not there; pass --tag "
                            "(available: step_00000003, step_00000005)")


def test_find_tag_dir_without_latest(tmp_path):
    """No `latest`: with checkpoints, pass --tag (they are listed); with none, say there are none.
    [kills: the two messages swapped (`if not tags` inverted)]"""
    ck = ckpt_tree(tmp_path, latest=None)
    with pytest.raises(ExportError) as e:
        find_tag_dir(ck, None)
    assert str(e.value) == (f"checkpoint dir {ck}: no `latest` file; pass --tag (available: step_00000003, "
                            "step_00000005)")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError) as e:
        find_tag_dir(empty, None)
    assert str(e.value).startswith(f"checkpoint dir {empty}: no checkpoints in it")


def test_find_tag_dir_sees_mp_rank_files(tmp_path):
    """A ZeRO-1/2 tag folder (mp_rank_00_model_states.pt, no zero_pp_rank model files) is a checkpoint folder.
    [kills: _model_files matching only ZeRO-3 file names]"""
    tag = tmp_path / "step_00000002"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert find_tag_dir(tag, None) == tag


def test_find_tag_dir_of_a_missing_folder(tmp_path):
    """[kills: the 'no such directory' check dropped (iterdir's FileNotFoundError instead)]"""
    with pytest.raises(ExportError) as e:
        find_tag_dir(tmp_path / "nope", None)
    assert str(e.value) == (f"checkpoint dir {tmp_path / 'nope'}: no such directory (give RUN_DIR or "
                            "RUN_DIR/checkpoints)")


# --------------------------------------------------------------------------------------------------- read.py


def test_autoep_names_back_to_qwen3_and_deepseek(tmp_path):
    """AutoEP's router / shared-expert names go back to the model's own: Qwen3-MoE's shared expert is singular
    (`shared_expert`, `shared_expert_gate`), DeepSeek-V3's plural and without a gate (its `shared_experts_gate.*`
    stays as it is), Mixtral's router is `gate`; other names unchanged. [kills: qwen3_moe's names pluralized; the
    `and theirs` guard dropped (a `None` module name); router.gate.'s prefix cut one short; mixtral's router name]"""
    from engine.export.read import AUTOEP_NAMES, autoep_namer

    m = "model.layers.3.mlp"
    qwen = autoep_namer([m], AUTOEP_NAMES["qwen3_moe"], {})
    assert qwen(f"{m}.router.gate.weight") == f"{m}.gate.weight"
    assert qwen(f"{m}.shared_experts.up_proj.weight") == f"{m}.shared_expert.up_proj.weight"
    assert qwen(f"{m}.shared_experts_gate.weight") == f"{m}.shared_expert_gate.weight"
    assert qwen("model.layers.2.mlp.router.gate.weight") == "model.layers.2.mlp.router.gate.weight"  # not a MoE path
    ds = autoep_namer([m], AUTOEP_NAMES["deepseek_v3"], {})
    assert ds(f"{m}.shared_experts.down_proj.weight") == f"{m}.shared_experts.down_proj.weight"
    assert ds(f"{m}.shared_experts_gate.weight") == f"{m}.shared_experts_gate.weight"
    assert autoep_namer([m], AUTOEP_NAMES["mixtral"], {})(f"{m}.router.gate.weight") == f"{m}.gate.weight"


def test_routing_bias_goes_to_the_one_key_the_model_has(tmp_path):
    """router.e_score_correction_bias goes to the model's one `<moe>.*.e_score_correction_bias` key wherever it
    lives; with none (or two) it is `<moe>.<router>.e_score_correction_bias`.
    [kills: the last of several candidates taken; any name ending in e_score_correction_bias remapped]"""
    from engine.export.read import AUTOEP_NAMES, autoep_namer

    m = "model.layers.1.mlp"
    names = AUTOEP_NAMES["deepseek_v3"]
    one = {f"{m}.router_x.e_score_correction_bias": 0, f"{m}.gate.weight": 0}
    assert autoep_namer([m], names, one)(f"{m}.router.e_score_correction_bias") == \
        f"{m}.router_x.e_score_correction_bias"
    two = {f"{m}.a.e_score_correction_bias": 0, f"{m}.b.e_score_correction_bias": 0}
    assert autoep_namer([m], names, two)(f"{m}.router.e_score_correction_bias") == f"{m}.gate.e_score_correction_bias"
    assert autoep_namer([m], names, one)(f"{m}.other.e_score_correction_bias") == f"{m}.other.e_score_correction_bias"


def test_an_unknown_model_type_is_refused(tmp_path):
    """A model type without AutoEP names is refused in one line (guessing would drop its shared experts).
    [kills: autoep_names' None check dropped]"""
    from types import SimpleNamespace

    from engine.export.read import autoep_names

    with pytest.raises(ExportError) as e:
        autoep_names(SimpleNamespace(model_type="llama"), tmp_path)
    assert str(e.value) == (f"{tmp_path}: the recorded model's type 'llama' has no known AutoEP names (known: "
                            "deepseek_v3, deepseek_v2, qwen3_moe, qwen3_5_moe_text, mixtral); it cannot be exported")


class Foreign:
    """Not DeepSpeed's: `load` must refuse to unpickle it."""


def test_load_refuses_foreign_objects_and_names_a_truncated_file(tmp_path):
    """load() unpickles only tensors and deepspeed.* objects: a foreign class is one line naming it; a truncated
    file is one line 'cannot read it ... truncated or corrupt', never a zipfile/pickle traceback.
    [kills: the foreign-globals check dropped; the catch-all turned into a narrower except]"""
    f = tmp_path / "x.pt"
    torch.save({"a": torch.zeros(2), "b": Foreign()}, f)
    with pytest.raises(ExportError) as e:
        load(f)
    assert str(e.value) == (f"{f}: holds objects that are not tensors or DeepSpeed state "
                            f"({__name__}.Foreign); refusing to unpickle it")
    g = tmp_path / "y.pt"
    torch.save({"a": torch.zeros(100)}, g)
    g.write_bytes(g.read_bytes()[:200])
    with pytest.raises(ExportError, match=r"y\.pt: cannot read it \(.*\); the file is truncated or corrupt"):
        load(g)


def test_key_check_message_names_shapes_missing_and_extra(tmp_path):
    """check_against_config: a shape that differs alone is refused; the message shows two shape differences and
    ' ...' only for a third; tensors the checkpoint has but the config lacks are named.
    [kills: shape differences ignored; ' ...' after two; extra tensors ignored]"""
    keys = {"a": ((2,), F32), "b": ((3,), F32), "c": ((4,), F32)}
    with pytest.raises(ExportError) as e:
        check_against_config({"a": (2,), "b": (5,), "c": (6,)}, keys, tmp_path)
    assert str(e.value) == (f"{tmp_path}: checkpoint does not match the model recorded in its engine_state.json: "
                            "shapes differ: b is (5,) in the checkpoint but (3,) in the config, c is (6,) in the "
                            "checkpoint but (4,) in the config (was engine_state.json edited, or are files from "
                            "different runs mixed?)")
    with pytest.raises(ExportError, match=r"checkpoint has 1 tensors the config lacks \(z\)"):
        check_against_config({"a": (2,), "b": (3,), "c": (4,), "z": (1,)}, keys, tmp_path)
    check_against_config({"a": (2,), "b": (3,), "c": (4,)}, keys, tmp_path)


def test_state_file_problems_are_one_line(tmp_path):
    """engine_state.json that is not JSON, or has no recipe.model: one line each.
    [kills: the JSON error not caught; the recipe.model check dropped]"""
    from engine.export.read import read_state

    (tmp_path / "engine_state.json").write_text("{not json")
    with pytest.raises(ExportError, match=r"engine_state.json: unreadable \(JSONDecodeError: "):
        read_state(tmp_path)
    (tmp_path / "engine_state.json").write_text(json.dumps({"step": 1, "position": 0, "recipe": {"data": {}}}))
    with pytest.raises(ExportError) as e:
        read_state(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'engine_state.json'}: not one this engine wrote (it has no recipe.model); "
                            "export the run's own checkpoint folder")


def test_recorded_config_from_init_from_that_is_gone(tmp_path):
    """A run started from model.init_from, saved before init_model/ existed, whose init model is gone: one line
    saying so. [kills: the check that init_from's config.json exists dropped]"""
    from engine.export.read import recorded_hf_config

    gone = tmp_path / "gone_model"
    with pytest.raises(ExportError) as e:
        recorded_hf_config(tmp_path, {"recipe": {"model": {"init_from": str(gone)}}})
    assert str(e.value) == (f"{tmp_path}: the run started from model.init_from={gone}, whose config.json is gone; "
                            "put that model back to export")


def test_recorded_config_with_the_bundled_tokenizer(tmp_path):
    """data.tokenizer 'auto' and no tokenizer/ folder: the config's special ids come from the bundled tokenizer.
    [kills: 'auto' looked up as a folder name instead of the bundled tokenizer]"""
    from transformers import AutoTokenizer

    from engine.config import BUNDLED_TOKENIZER
    from engine.export.read import recorded_hf_config

    tok = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    state = {"recipe": {"model": {"arch": "qwen3_moe", "vocab_size": 512}, "data": {"tokenizer": "auto"}}}
    cfg = recorded_hf_config(tmp_path, state)
    assert (cfg.model_type, cfg.eos_token_id, cfg.pad_token_id) == ("qwen3_moe", tok.eos_token_id, tok.pad_token_id)


def test_hf_keys_records_the_architecture_and_ties_only_tied_models():
    """hf_keys sets config.architectures (config.json's, which from_pretrained reads) and names lm_head.weight as
    tied only for tie_word_embeddings models. [kills: architectures not set; every model treated as tied]"""
    cfg = qwen_cfg()
    keys, transposed, strict, tied = hf_keys(cfg, "fp32")
    assert cfg.architectures == ["Qwen3MoeForCausalLM"]
    assert tied == [] and strict == set() and "lm_head.weight" in keys
    assert transposed == {f"{PREFIX}.gate_up_proj": False, f"{PREFIX}.down_proj": False}


def test_hf_keys_reports_is_transposed_experts():
    """GPT-OSS's fused experts are is_transposed; hf_keys must say so (plan.place writes them transposed).
    [kills: is_transposed not read from the expert modules]"""
    from transformers import GptOssConfig

    cfg = GptOssConfig(vocab_size=16, hidden_size=8, intermediate_size=4, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, num_local_experts=2, num_experts_per_tok=1,
                       layer_types=["full_attention"])
    transposed = hf_keys(cfg, "fp32")[1]
    assert transposed == {f"{PREFIX}.gate_up_proj": True, f"{PREFIX}.down_proj": True}


# --------------------------------------------------------------------------------------------------- write.py


def test_parse_size_units():
    """--max_shard_size: KB/MB/GB decimal, KiB/MiB binary, case-insensitive, fractions scaled before rounding down;
    0 and words refused. [kills: decimal units made binary; int() before multiplying; 0 allowed; case-sensitive]"""
    assert [parse_size(s) for s in ("2GB", "500MB", "1.5KB", "2MiB", "1000000", "3kb", "1.5 GiB")] == \
        [2_000_000_000, 500_000_000, 1500, 2_097_152, 1_000_000, 3000, 1_610_612_736]
    for bad in ("0", "0.4B", "two GB"):
        with pytest.raises(ExportError, match=rf"--max_shard_size {bad!r}: "):
            parse_size(bad)


def test_a_shard_of_exactly_max_bytes_holds_both_tensors():
    """Two 8-byte tensors and max_bytes 16: one shard (at most max_bytes, so equal fits).
    [kills: `size + n > max_bytes` made `>=`]"""
    assert _shards({"a": ((2,), F32), "b": ((2,), F32)}, 16) == [["a", "b"]]
    assert _shards({"a": ((2,), F32), "b": ((2,), F32), "c": ((1,), F32)}, 16) == [["a", "b"], ["c"]]


class _Fake:
    def __init__(self, keys):
        self.keys = keys

    def read(self, keys):
        return {k: torch.ones(self.keys[k][0], dtype=self.keys[k][1]) for k in keys}


def test_shard_files_are_numbered_from_one_of_n(tmp_path):
    """Three shards: model-00001-of-00003 .. model-00003-of-00003 (transformers' names), the index's total_size in
    bytes of the dtypes written. [kills: shards numbered from 0; the count off by one; 4 bytes assumed per value]"""
    ck = _Fake({"a": ((4,), torch.bfloat16), "b": ((4,), F32), "c": ((4,), F32)})
    write_shards(ck, tmp_path, 16, log=lambda *a: None)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(f.name for f in tmp_path.glob("*.safetensors")) == names
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 8 + 16 + 16}, "weight_map": dict(zip("abc", names))}


def test_check_output_refusals(tmp_path):
    """OUTPUT_DIR that is a file, that is the checkpoint folder itself, or that is not empty without --force: one
    line each; an empty folder is fine without --force. [kills: the is-a-file check dropped; `real == tag_dir`
    dropped; any existing folder taken as not empty]"""
    tag = tmp_path / "ck"
    tag.mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="exists and is not a directory"):
        _check_output(tmp_path / "file", tag, force=True)
    with pytest.raises(ExportError, match="overlaps the checkpoint"):
        _check_output(tag, tag, force=True)
    (tmp_path / "empty").mkdir()
    _check_output(tmp_path / "empty", tag, force=False)
    (tmp_path / "empty" / "x").write_text("")
    with pytest.raises(ExportError, match="not empty; pass --force"):
        _check_output(tmp_path / "empty", tag, force=False)


def test_export_writes_configs_tokenizer_and_readable_files(tmp_path, capsys):
    """The whole of export() over a planned synthetic ZeRO-3 checkpoint with a tokenizer/ folder, --dtype bf16,
    --force over an existing folder: the weights are the state dict's in bf16; config.json has dtype bfloat16,
    use_cache true and the architecture; the tokenizer's files are copied; every file is 0666 & ~umask (safetensors
    writes 0600); the old folder's files are gone and no temp folder is left. Without a tokenizer/ folder a warning
    says the export has none. [kills: cfg.dtype left fp32; use_cache not set; tokenizer files not copied; no chmod;
    the old output not moved away or not removed; the warning dropped]"""
    from safetensors.torch import load_file

    from engine.export.write import export

    tag, want = zero3_checkpoint(tmp_path, qwen_cfg(use_cache=False), world=2, ep=2)
    (tag / "tokenizer").mkdir()
    (tag / "tokenizer" / "tokenizer.json").write_text("{}")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("old")
    umask = os.umask(0o022)
    try:
        export(tag, out, dtype="bf16", force=True, log=lambda *a: None)
    finally:
        os.umask(umask)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["dtype"], cfg["use_cache"], cfg["architectures"]) == ("bfloat16", True, ["Qwen3MoeForCausalLM"])
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model-00001-of-00001.safetensors",
                                                     "model.safetensors.index.json", "tokenizer.json"]
    assert {oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {"0o644"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
    got = load_file(out / "model-00001-of-00001.safetensors")
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    (tag / "tokenizer" / "tokenizer.json").unlink()
    (tag / "tokenizer").rmdir()
    logs = []
    export(tag, tmp_path / "hf3", log=logs.append)
    assert f"warning: {tag.resolve()} has no tokenizer/ folder; the export has none" in logs


def test_main_bad_input_is_exit_2_and_one_stderr_line(tmp_path, capsys):
    """main(): ExportError -> 'error: ...' on stderr only, exit status 2; --quiet prints nothing on success; the
    defaults are fp32 and 2GB shards. [kills: exit 1; the error printed to stdout; --quiet inverted; the
    --max_shard_size default changed]"""
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == (f"error: checkpoint dir {tmp_path / 'nope'}: no such directory (give RUN_DIR "
                                         "or RUN_DIR/checkpoints)\n")
    args = parse_args(["a", "b"])
    assert (args.dtype, args.max_shard_size, args.force, args.quiet, args.tag) == ("fp32", "2GB", False, False, None)
    tag, _ = zero3_checkpoint(tmp_path, qwen_cfg(), world=1, ep=1)
    assert main([str(tag), str(tmp_path / "q"), "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert main([str(tag), str(tmp_path / "v")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"exported to {tmp_path / 'v'}"


def test_export_refuses_an_unknown_dtype_before_looking_at_the_folder(tmp_path):
    """export(dtype="fp16") names the dtype first, even for a folder that does not exist.
    [kills: export()'s own dtype check dropped (the missing folder is reported instead)]"""
    from engine.export.write import export

    with pytest.raises(ExportError) as e:
        export(tmp_path / "nope", tmp_path / "out", dtype="fp16")
    assert str(e.value) == "--dtype fp16: choose one of fp32, bf16"


# ------------------------------------------------------------------------- files from different saves: refusals


def edit(f: Path, change) -> None:
    """Rewrite torch file `f` with change(obj) applied (our own test's file: weights_only=False is safe)."""
    obj = torch.load(f, weights_only=False)
    change(obj)
    torch.save(obj, f)


def refused(tag, pattern):
    with pytest.raises(ExportError) as e:
        open_checkpoint(tag, verify=False)
    assert "\n" not in str(e.value)
    assert re.search(pattern, str(e.value)), str(e.value)


def z12_files(tag, d):
    return tag / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt"


def _z12_more_mp(tag):
    (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(z12_files(tag, 0).read_bytes())


def _z12_twice(tag):
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(z12_files(tag, 1).read_bytes())


def _z12_extra(tag):
    state = json.loads((tag / "engine_state.json").read_text())
    (tag / "engine_state.json").write_text(json.dumps({**state, "world_size": 2}))


def _z12_last_missing(tag):
    z12_files(tag, 3).unlink()


def _z12_odd_dp(tag):
    z12_files(tag, 3).unlink()
    state = json.loads((tag / "engine_state.json").read_text())
    del state["world_size"]
    (tag / "engine_state.json").write_text(json.dumps(state))


def _model(change):
    return lambda tag: edit(tag / "mp_rank_00_model_states.pt", change)


def _optim(d, change):
    return lambda tag: edit(z12_files(tag, d), lambda sd: change(sd["optimizer_state_dict"]))


def _placement(ranks):
    return _model(lambda ms: ms["ds_autoep_layers"][0].update(expert_placement={"ranks": ranks}))


def _past_end(osd):
    from deepspeed.utils.tensor_fragment import fragment_address

    name = next(iter(osd["param_slice_mappings"][0]))
    osd["param_slice_mappings"][0][name] = fragment_address(numel=2, start=osd["single_partition_of_fp32_groups"][0]
                                                            .numel() - 1)


Z12_REFUSALS = {
    "mp_rank_01 file": (_z12_more_mp, r"zero_pp_rank_0_mp_rank_01_optim_states.pt is for model-parallel rank 1, but "
                                      r"the checkpoint has 1; the files come from different saves$"),
    "bf16_ and plain": (_z12_twice, r"bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is there twice|"
                                    r"zero_pp_rank_1_mp_rank_00_optim_states.pt is there twice"),
    "extra ranks": (_z12_extra, r"the run had 2 data-parallel ranks \(mp_rank_00\) but the optimizer files of ranks "
                                r"\[2, 3\] are extra"),
    "last rank missing": (_z12_last_missing, r"the run had 4 data-parallel ranks \(mp_rank_00\) but the optimizer "
                                             r"files of ranks \[3\] are missing"),
    "3 files, ep 2": (_z12_odd_dp, r"3 data-parallel optimizer files for mp_rank_00 but expert-parallel size 2"),
    "no param_shapes": (_model(lambda ms: ms.update(param_shapes=None)),
                        r"mp_rank_00_model_states.pt: has no param_shapes although optimizer files are there"),
    "stage 3 optimizer": (_optim(2, lambda osd: osd.update(zero_stage=3)),
                          r"zero_pp_rank_2_mp_rank_00_optim_states.pt: a ZeRO stage 3 optimizer file next to "
                          r"mp_rank_00_model_states.pt"),
    "piece past the end": (_optim(0, _past_end), r"zero_pp_rank_0_mp_rank_00_optim_states.pt: .* lies past the end "
                                                 r"of parameter group 0; the file is corrupt"),
    "frozen fragments": (_model(lambda ms: ms.update(frozen_param_fragments={"x": torch.zeros(1)})),
                         r"has frozen \(requires_grad=False\) parameters"),
    "dense piece lost": (_optim(0, lambda osd: osd["param_slice_mappings"][0].pop("model.embed_tokens.weight")),
                         r"the optimizer files hold \d+ of the 128 values of model.embed_tokens.weight; copy every"),
    "unknown master": (_optim(0, lambda osd: osd["param_slice_mappings"][0].update(
        zzz=osd["param_slice_mappings"][0]["model.embed_tokens.weight"])),
        r"the optimizer files hold zzz, which the model files do not have"),
    "expert 4 of 4": (_placement([{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2, 4]}]),
                      r"AutoEP placement of model.layers.0.mlp names experts \[2, 4\] of 4"),
    "3 experts on rank 0": (_placement([{"rank": 0, "experts": [0, 1, 2]}, {"rank": 1, "experts": [3]}]),
                            r"model.layers.0.mlp.experts.w1 has shape \(2, 3, 8\) in param_shapes but AutoEP places "
                            r"3 experts on expert-parallel rank 0"),
    "expert piece lost": (_optim(1, lambda osd: osd["param_slice_mappings"][1].pop(f"{PREFIX}.w2")),
                          r"the optimizer files hold \d+ of the 48 values of model.layers.0.mlp.experts.w2 on "
                          r"expert-parallel rank 1"),
    "expert on no rank": (_placement([{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2, 2]}]),
                          r"AutoEP placement of model.layers.0.mlp leaves experts \[3\] of 4 on no rank"),
}


@pytest.mark.parametrize("case", list(Z12_REFUSALS))
def test_zero12_refuses_files_from_different_saves(tmp_path, case):
    """A ZeRO-1/2 checkpoint (4 optimizer files, expert-parallel 2, strided) bent one way: one line naming what.
    [kills: `s >= stages` made `>`; the bf16_ duplicate check dropped; extra ranks ignored (`>=` for `!=`); the
    recorded world size ignored; `dp % ep` dropped; the param_shapes check dropped; stage 3 accepted; the past-the-
    end check off by one; frozen_param_fragments ignored; the dense and expert count checks dropped; the unknown-
    master check dropped; `e <= num`; the stack-size check dropped; the every-expert-placed check dropped]"""
    change, pattern = Z12_REFUSALS[case]
    tag, _ = zero12_checkpoint(tmp_path, qwen_cfg(), dp=4, ep=2)
    change(tag)
    refused(tag, pattern)


def z3_model(tag, r):
    return tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"


def z3_optim(tag, r):
    return tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"


def _z3_model(r, change):
    return lambda tag: edit(z3_model(tag, r), change)


def _z3_optim(r, change):
    return lambda tag: edit(z3_optim(tag, r), lambda sd: change(sd["optimizer_state_dict"]))


def _z3_parts(r, g, **kw):
    return _z3_optim(r, lambda osd: osd["ds_zero_partition_groups"][g].update(kw))


def _z3_num(n):
    def change(tag):
        for r in (0, 1):
            edit(z3_model(tag, r), lambda ms: ms["ds_autoep_layers"][0].update(num_experts=n))
    return change


def _z3_mp1(tag):
    z3_model(tag, 0).rename(tag / "zero_pp_rank_0_mp_rank_01_model_states.pt")


def _z3_rank_gone(tag):
    z3_model(tag, 1).unlink()
    z3_optim(tag, 1).unlink()


def _z3_bf16_twice(tag):
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(z3_optim(tag, 1).read_bytes())


Z3_REFUSALS = {
    "no param_shapes": (_z3_model(1, lambda ms: ms.pop("param_shapes")),
                        r"zero_pp_rank_1_mp_rank_00_model_states.pt: not a ZeRO-3 model-states file"),
    "frozen": (_z3_model(0, lambda ms: ms.update(frozen_param_shapes={"x": (2,)})), r"has frozen .*\(x, \.\.\.\)"),
    "3 groups": (_z3_optim(1, lambda osd: osd["fp32_flat_groups"].append(torch.zeros(2))),
                 r"zero_pp_rank_1_mp_rank_00_optim_states.pt: has 3 parameter groups but "
                 r"zero_pp_rank_1_mp_rank_00_model_states.pt lists 2"),
    "short flat": (_z3_optim(0, lambda osd: osd["fp32_flat_groups"].__setitem__(0, osd["fp32_flat_groups"][0][:-1])),
                   r"parameter group 0 holds \d+ values but its parameters need \d+; the file does not belong"),
    "counts differ": (_z3_parts(1, 0, partition_count=4), r"is partitioned 2 ways on one rank and 4 on another"),
    "same partition": (_z3_parts(1, 0, partition_rank=0), r"two files hold partition 0 of model.embed_tokens.weight"),
    "no autoep metadata": (_z3_model(1, lambda ms: ms.update(ds_autoep_layers=[])),
                           r"zero_pp_rank_1_mp_rank_00_model_states.pt: holds model.layers.0.mlp.experts.w1 but no "
                           r"AutoEP metadata"),
    "3 experts placed": (lambda tag: [edit(z3_model(tag, r), lambda ms: ms["ds_autoep_layers"][0].update(
        expert_placement={"ranks": [{"rank": 0, "experts": [0, 1, 2]}, {"rank": 1, "experts": [3]}]}))
        for r in (0, 1)], r"experts.w1 has shape \(2, 3, 8\) but AutoEP metadata places 3 experts on expert-parallel"),
    "expert 4 of 4": (lambda tag: [edit(z3_model(tag, r), lambda ms: ms["ds_autoep_layers"][0].update(
        expert_placement={"ranks": [{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2, 4]}]}))
        for r in (0, 1)], r"AutoEP placement names expert 4 of 4"),
    "partition missing": (lambda tag: [_z3_parts(r, 0, partition_count=3)(tag) for r in (0, 1)],
                          r"partitions \[2\] of model.embed_tokens.weight are missing"),
    "expert in no file": (_z3_num(5), r"experts \[4\] of model.layers.0.mlp.experts.gate_up_proj \(gate\) are in no "
                                      r"file"),
    "mp rank 1": (_z3_mp1, r"has model-parallel ranks \[0, 1\]; tensor-parallel ZeRO-3 checkpoints are not supported"),
    "rank gone": (_z3_rank_gone, r"the run had 2 ranks but model-states files for ranks \[1\] are missing"),
    "bf16_ twice": (_z3_bf16_twice, r"zero_pp_rank_1_mp_rank_00_optim_states.pt is there twice \(also with bf16_\)"),
    "stage 2 optimizer": (_z3_optim(0, lambda osd: osd.update(zero_stage=2)),
                          r"a ZeRO stage 2 optimizer file among ZeRO-3 model-states files"),
}


@pytest.mark.parametrize("case", list(Z3_REFUSALS))
def test_zero3_refuses_files_from_different_saves(tmp_path, case):
    """A ZeRO-3 checkpoint (2 ranks, expert-parallel 2) bent one way: one line naming what.
    [kills: the param_shapes check; frozen parameters accepted; the group-count check; the flat-size check; the
    partition-count and duplicate-partition checks; the AutoEP-metadata check; the stack-size check; the expert
    range check; check_complete's partition and expert checks; the mp-rank check; the recorded world size ignored;
    one of two optimizer files accepted; a ZeRO stage 2 file accepted]"""
    change, pattern = Z3_REFUSALS[case]
    tag, _ = zero3_checkpoint(tmp_path, qwen_cfg(), world=2, ep=2)
    change(tag)
    refused(tag, pattern)


def test_zero3_replicated_expert_is_written_once(tmp_path):
    """ZeRO-3 with an expert on two expert-parallel ranks (3 ranks, ep 3, placement {0: [0, 1], 1: [2, 3],
    2: [3, 0]}): the first rank's copy is written, the replica skipped, the export the state dict.
    [kills: every copy written (the count check then reports too many values)]"""
    tag, want = zero3_checkpoint(tmp_path, qwen_cfg(), world=3, ep=3, owned={0: [0, 1], 1: [2, 3], 2: [3, 0]})
    same(exported(tag), want)


def test_finish_drops_a_tied_key_the_checkpoint_holds(tmp_path):
    """A tied model whose checkpoint holds lm_head.weight anyway (a stage-0 pipeline's `module` lists aliases): the
    tied key is dropped from what the checkpoint holds too, not reported as a tensor the config lacks.
    [kills: finish() no longer popping tied keys from the checkpoint's shapes]"""
    from engine.export.plan import finish

    cfg = qwen_cfg(tie_word_embeddings=True)
    expected = hf_keys(cfg, "fp32")
    got = {k: shape for k, (shape, _) in expected[0].items()}
    assert "lm_head.weight" in got
    ck = finish("pipeline", tmp_path, cfg, expected, got, [], "fp32")
    assert "lm_head.weight" not in ck.keys and "model.embed_tokens.weight" in ck.keys


def test_zero12_module_aliases_are_not_exported_twice(tmp_path):
    """AutoEP's Qwen3 layer exposes its router again as `mlp.gate` in `module` (for transformers' output recorders);
    param_shapes + buffer_names name each tensor once, so the alias is skipped and the export is the state dict.
    [kills: every `module` key taken although param_shapes is there (the router then read twice)]"""
    tag, want = zero12_checkpoint(tmp_path, qwen_cfg(), dp=2, ep=2)
    edit(tag / "mp_rank_00_model_states.pt",
         lambda ms: ms["module"].update({f"{MOE}.gate.weight": ms["module"][f"{MOE}.router.gate.weight"]}))
    same(exported(tag), want)


def test_zero3_last_partitions_of_a_small_parameter_are_empty(tmp_path):
    """A (5,) parameter over 4 ranks takes ceil(5/4) = 2 values per rank: ranks 0-2 hold 2, 2, 1 of its values (rank
    2's second is padding) and rank 3 none (5 - 3*2 < 0: an empty piece, not a negative length).
    [kills: the piece length not clamped at 0 (a negative narrow on rank 3)]"""
    from engine.export.plan import Checkpoint
    from engine.export.zero3 import FLATS, _FragmentMap, _Rank

    flats = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 0.0]), torch.tensor([0.0, 0.0])]
    fm = _FragmentMap(tmp_path, {}, {}, {}, lambda n: n)
    sources = []
    for r in range(4):
        f = tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        torch.save({FLATS[0]: {FLATS[1]: [flats[r]]}}, f)
        rank = _Rank(r, tmp_path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", f)
        sources.append(fm.add_rank(rank, [{"a": (5,)}], {"sizes": [2], "partitions": [(4, r)]}))
    fm.check_complete()
    assert [len(s.frags) for s in sources] == [1, 1, 1, 0]
    ck = Checkpoint("zero3", tmp_path, None, {"a": ((5,), F32)}, {}, sources)
    assert ck.read(["a"])["a"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_layout_without_mp_rank_00_is_zero12(tmp_path):
    """Only mp_rank_01_model_states.pt there (stage 0's file lost): not a pipeline (no stage 0 file to read the
    stage count from), so the ZeRO-1/2 reader says mp_rank_00 is missing, rather than load() failing on it.
    [kills: stages() loading mp_rank_00 without checking it exists]"""
    (tmp_path / "mp_rank_01_model_states.pt").write_bytes(b"")
    assert layout(tmp_path) == "zero12"

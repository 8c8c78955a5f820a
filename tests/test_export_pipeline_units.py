"""The exporter's rules (engine/export/) and the pipeline's loss and coordinates (engine/pipeline.py) outside the
2-rank runs' setup: tied and transposed weights, partly filled tensors, expert placement when data-parallel and
expert-parallel sizes differ or the checkpoint records none, padded ZeRO-3 partitions, shard index sizes, the output
folder, `latest`, data-parallel means and ignored targets. Unit-level: small synthetic state dicts, files and fake
engines; the bracket at the end of a docstring says which bent rule the test fails on."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


# ------------------------------------------------------------------------------------------ engine/export/plan.py


def test_expert_target_swaps_the_last_two_dims_for_is_transposed_models():
    """A model whose fused experts are is_transposed stores gate_up_proj as [experts, hidden, 2*ffn] and down_proj as
    [experts, ffn, hidden]; expert_target must report those full shapes (the plain layout is [E, 2*ffn, hidden] and
    [E, hidden, ffn]), so the shape check and the output tensor match the model.
    [fails if: expert_target no longer swaps the full shape's last two dims for transposed expert keys]"""
    from engine.export.plan import expert_target

    pre = "model.layers.1.mlp.experts"
    E_local, ffn, hidden, num = 2, 3, 5, 4
    plain = {}
    trans = {f"{pre}.gate_up_proj": True, f"{pre}.down_proj": True}
    assert expert_target("x.w1", (E_local, ffn, hidden), num, pre, plain) == (f"{pre}.gate_up_proj", "gate",
                                                                               (num, 2 * ffn, hidden))
    assert expert_target("x.w3", (E_local, ffn, hidden), num, pre, plain)[1:] == ("up", (num, 2 * ffn, hidden))
    assert expert_target("x.w2", (E_local, hidden, ffn), num, pre, plain) == (f"{pre}.down_proj", "down",
                                                                               (num, hidden, ffn))
    assert expert_target("x.w1", (E_local, ffn, hidden), num, pre, trans)[2] == (num, hidden, 2 * ffn)
    assert expert_target("x.w3", (E_local, ffn, hidden), num, pre, trans)[2] == (num, hidden, 2 * ffn)
    assert expert_target("x.w2", (E_local, hidden, ffn), num, pre, trans)[2] == (num, ffn, hidden)


def test_tied_output_embedding_is_left_out_of_the_export(tmp_path):
    """With tie_word_embeddings the checkpoint holds the embedding once (no lm_head.weight of its own): hf_keys names
    lm_head.weight as tied and finish() drops it from the export plan instead of reporting it missing, so a tied model
    exports (from_pretrained re-ties it).
    [fails if: finish() stops dropping the tied keys (tied embeddings are then refused as a missing tensor)]"""
    from transformers import Qwen3MoeConfig

    from engine.export.plan import finish
    from engine.export.read import hf_keys

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=2,
                         num_experts_per_tok=1, tie_word_embeddings=True)
    expected = hf_keys(cfg, "fp32")
    assert "lm_head.weight" in expected[3]
    got = {k: shape for k, (shape, _) in expected[0].items() if k != "lm_head.weight"}  # what the checkpoint holds
    ckpt = finish("zero3", tmp_path, cfg, expected, got, [], "fp32")
    assert "lm_head.weight" not in ckpt.keys and "model.embed_tokens.weight" in ckpt.keys
    assert set(ckpt.keys) == set(got)


def test_read_refuses_a_tensor_the_files_cover_only_in_part(tmp_path):
    """Checkpoint.read counts the values each output tensor received; a tensor that its fragments fill only in part
    (a partition missing) is an ExportError naming the tensor and the count, never a tensor of uninitialized memory.
    [fails if: the completeness check in Checkpoint.read compares the count the wrong way (only too many is caught)]"""
    from engine.export.plan import Checkpoint, Frag, Source, Target
    from engine.export.read import ExportError

    f = tmp_path / "part.pt"
    torch.save({"flat": torch.arange(10, dtype=torch.float32)}, f)

    def ckpt(length):
        src = Source(f, [Frag(("flat",), 2, length, 0, Target("w", "dense"))])
        return Checkpoint("zero12", tmp_path, None, {"w": ((2, 3), torch.float32)}, {}, [src])

    assert torch.equal(ckpt(6).read(["w"])["w"], torch.arange(2, 8, dtype=torch.float32).view(2, 3))
    with pytest.raises(ExportError, match=r"w got 4 of 6 values"):
        ckpt(4).read(["w"])


# ---------------------------------------------------------------------------------------- engine/export/zero12.py


def test_zero12_expert_coords_follow_deepspeeds_expert_data_parallel_groups():
    """DeepSpeed's groups._create_expert_and_data_parallel: by default the expert-parallel groups are contiguous
    blocks of ep ranks and the expert-data-parallel groups strided (rank d: expert-parallel rank d % ep, partition
    d // ep); with use_data_before_expert_parallelism the expert-data-parallel groups are the contiguous blocks of
    dp/ep ranks (expert-parallel rank d // (dp/ep), partition d % (dp/ep)). Only dp > ep tells the two apart.
    [fails if: expert_coords uses the strided rule for use_data_before_expert_parallelism and vice versa]"""
    from engine.export.zero12 import expert_coords

    assert [expert_coords(d, 4, 2, False) for d in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [expert_coords(d, 4, 2, True) for d in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [expert_coords(d, 8, 2, False) for d in range(8)][:3] == [(0, 0), (1, 0), (0, 1)]
    assert [expert_coords(d, 8, 2, True) for d in range(8)][:5] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]


def test_zero12_without_placement_metadata_uses_the_legacy_contiguous_placement(tmp_path):
    """A ZeRO-1/2 checkpoint whose ds_autoep_layers carry no expert_placement (older DeepSpeed) placed experts as
    deepspeed.checkpoint.autoep_affine.legacy_uniform_autoep_placement_descriptor does: expert-parallel rank r holds
    the contiguous experts [r*E/ep, (r+1)*E/ep). Each rank's stacked masters must land on those global experts.
    [fails if: the zero12 default placement is strided (rank r holds r, r+ep, ...) instead of contiguous]"""
    from engine.export.plan import Frag, Source
    from engine.export.zero12 import _experts

    prefix = "model.layers.1.mlp.experts"
    layer = {"expert_key_prefix": prefix, "num_experts": 4, "ep_size": 2, "module_path": "model.layers.1.mlp",
             "moe_layer_id": 0}
    name = f"{prefix}.w1"
    files = [tmp_path / "rank0.pt", tmp_path / "rank1.pt"]
    masters = {(name, r): [(Frag(("flat",), 0, 2 * 3 * 5, 0, None), files[r])] for r in range(2)}
    by_file = {f: Source(f) for f in files}
    shapes = {}
    _experts(tmp_path, 0, layer, "w1", {name: (2, 3, 5)}, masters, lambda n: n, {}, shapes, by_file)
    assert [by_file[f].frags[0].target.experts for f in files] == [[0, 1], [2, 3]]
    assert shapes == {f"{prefix}.gate_up_proj": (4, 6, 5)}


def test_zero12_an_expert_held_by_two_ranks_is_written_once(tmp_path):
    """An AutoEP placement may list an expert on two expert-parallel ranks (a replica): the first rank's copy is the
    one exported, the other is skipped, and the written count is each expert's once. [fails if: every copy is
    written, or place() counts the copies it skips]"""
    from engine.export.plan import Frag, Source, place
    from engine.export.zero12 import _experts

    prefix = "model.layers.1.mlp.experts"
    ranks = [{"rank": 0, "experts": [0, 1]}, {"rank": 1, "experts": [2, 1]}, {"rank": 2, "experts": [3, 0]}]
    layer = {"expert_key_prefix": prefix, "num_experts": 4, "ep_size": 3, "module_path": "model.layers.1.mlp",
             "moe_layer_id": 0, "expert_placement": {"ranks": ranks}}
    name = f"{prefix}.w1"
    files = [tmp_path / f"rank{r}.pt" for r in range(3)]
    masters = {(name, r): [(Frag(("flat",), 0, 2 * 3 * 5, 0, None), files[r])] for r in range(3)}
    by_file = {f: Source(f) for f in files}
    _experts(tmp_path, 0, layer, "w1", {name: (2, 3, 5)}, masters, lambda n: n, {}, {}, by_file)
    assert [by_file[f].frags[0].target.experts for f in files] == [[0, 1], [2, None], [3, None]]
    out = torch.zeros(4, 6, 5)  # gate_up_proj: w1 fills the first half of each expert's rows
    src = [torch.arange(30.0) + 100 * r for r in range(3)]
    written = sum(place(out, by_file[f].frags[0], src[r], False) for r, f in enumerate(files))
    assert written == 4 * 3 * 5
    want = {0: src[0][:15], 1: src[0][15:], 2: src[1][:15], 3: src[2][:15]}
    for e, values in want.items():
        assert torch.equal(out[e, :3], values.view(3, 5)), e
    assert out[:, 3:].abs().sum() == 0


# ----------------------------------------------------------------------------------------- engine/export/zero3.py


def test_zero3_without_placement_metadata_uses_the_legacy_contiguous_placement():
    """As for ZeRO-1/2: without expert_placement in ds_autoep_layers, expert-parallel rank k of a ZeRO-3 checkpoint
    holds experts [k*E/ep, (k+1)*E/ep) (DeepSpeed's legacy uniform placement).
    [fails if: the zero3 default placement is strided (rank k holds k, k+ep, ...) instead of contiguous]"""
    from engine.export.zero3 import _expert_placement

    layer = lambda ep_rank: {"module_path": "model.layers.1.mlp", "expert_key_prefix": "model.layers.1.mlp.experts",
                             "num_experts": 4, "ep_size": 2, "ep_rank": ep_rank}  # noqa: E731
    paths, info = _expert_placement({0: [layer(0)], 1: [layer(1)]})
    assert paths == {"model.layers.1.mlp"}
    assert info["model.layers.1.mlp.experts.w2"] == {0: (0, [0, 1], 4), 1: (1, [2, 3], 4)}


def test_zero3_optimizer_file_without_group_metadata_is_the_files_own_partition(tmp_path):
    """An optimizer file without ds_zero_partition_groups (older DeepSpeed) holds partition `file rank` of
    partition_count for every group: rank 1's file is the second partition, not the first again.
    [fails if: _optim_meta's fallback partition rank is 0 instead of the file's rank]"""
    from engine.export.zero3 import _optim_meta

    f = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"fp32_flat_groups": [torch.zeros(6), torch.zeros(4)],
                                         "partition_count": 2}}, f)
    assert _optim_meta(f, 1) == {"sizes": [6, 4], "partitions": [(2, 1), (2, 1)]}


# ------------------------------------------------------------------------------------------ engine/export/write.py


class _FakeCheckpoint:
    def __init__(self, keys):
        self.keys = keys

    def read(self, keys):
        return {k: torch.ones(self.keys[k][0], dtype=self.keys[k][1]) for k in keys}


def test_shards_never_start_with_an_empty_one():
    """_shards packs keys in order into shards of at most max_bytes; a single tensor larger than max_bytes gets a
    shard of its own, and no shard is ever empty (an empty first shard would be written as a file with no tensors).
    [fails if: _shards closes the current shard even when it is still empty]"""
    from engine.export.write import _shards

    f32 = torch.float32
    assert _shards({"big": ((100,), f32)}, 16) == [["big"]]
    assert _shards({"big": ((100,), f32), "a": ((2,), f32), "b": ((2,), f32)}, 16) == [["big"], ["a", "b"]]
    assert all(_shards({"a": ((8,), f32), "b": ((1,), f32)}, n) for n in (1, 4, 32))


def test_index_total_size_is_in_bytes(tmp_path):
    """model.safetensors.index.json's metadata.total_size is the weights' size in bytes (numel x element size, as
    transformers' save_pretrained writes it): 2-byte bf16 and 4-byte fp32 tensors counted as such.
    [fails if: write_shards sums element counts instead of bytes]"""
    from engine.export.write import write_shards

    ck = _FakeCheckpoint({"a": ((3, 4), torch.bfloat16), "b": ((5,), torch.float32)})
    write_shards(ck, tmp_path, 10**9, log=lambda *a: None)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 12 * 2 + 5 * 4
    assert index["weight_map"] == {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}


def test_output_inside_the_checkpoint_is_refused(tmp_path):
    """The export must not be written inside the checkpoint folder it reads (nor be the folder, nor contain it).
    [fails if: _check_output no longer refuses an OUTPUT_DIR below the checkpoint's tag folder]"""
    from engine.export.read import ExportError
    from engine.export.write import _check_output

    tag = tmp_path / "run" / "checkpoints" / "step_00000005"
    tag.mkdir(parents=True)
    for out in (tag, tmp_path / "run", tag / "hf"):
        with pytest.raises(ExportError, match="overlaps the checkpoint"):
            _check_output(out, tag, force=True)
    _check_output(tmp_path / "elsewhere", tag, force=False)


# --------------------------------------------------------------------------------------- engine/export/__init__.py


def test_latest_names_the_checkpoint_even_when_it_is_not_the_newest(tmp_path):
    """RUN_DIR without --tag exports the checkpoint that `latest` names (after a rewind it may be an older one), not
    the highest tag in the folder.
    [fails if: find_tag_dir picks the last tag in sorted order instead of reading `latest`]"""
    from engine.export import find_tag_dir

    ck = tmp_path / "run" / "checkpoints"
    for tag in ("step_00000003", "step_00000005"):
        (ck / tag).mkdir(parents=True)
        (ck / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (ck / "latest").write_text("step_00000003\n")
    assert find_tag_dir(tmp_path / "run", None) == ck / "step_00000003"
    assert find_tag_dir(ck, "step_00000005") == ck / "step_00000005"


# -------------------------------------------------------------------------------------------- engine/pipeline.py


def test_data_coords_follow_the_pipe_data_parallel_topology():
    """DeepSpeed's PipeDataParallelTopology numbers ranks stage-major (rank = stage * dp + d): with 2 stages of 2
    data-parallel ranks, ranks 0..3 are data-parallel ranks 0, 1, 0, 1 of size 2; without a pipeline the world is the
    data-parallel group.
    [fails if: data_coords divides the rank by the number of stages instead of taking it modulo dp]"""
    from engine.pipeline import data_coords

    pipe = {"pipeline": {"stages": 2}}
    assert [data_coords(pipe, r, 4) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [data_coords(pipe, r, 6) for r in range(6)] == [(0, 3), (1, 3), (2, 3), (0, 3), (1, 3), (2, 3)]
    assert data_coords({}, 3, 4) == (3, 4)


def test_sum_over_stages_counts_each_stage_once_per_replica(monkeypatch):
    """sum_over_stages all-reduces per-rank counts over the whole world, where every stage appears once per
    data-parallel replica, so it divides by the data-parallel size: 2 stages x 2 replicas with 10 and 30 parameters
    per stage give 40, not 80.
    [fails if: sum_over_stages no longer divides the all-reduced sum by the data-parallel size]"""
    from engine import pipeline

    per_rank = [10.0, 10.0, 30.0, 30.0]  # stage 0 on ranks 0-1, stage 1 on ranks 2-3 (dp 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: t.fill_(sum(per_rank)))
    engine = SimpleNamespace(config={"pipeline": {"stages": 2}}, device="cpu",
                             grid=SimpleNamespace(data_parallel_size=2))
    assert pipeline.sum_over_stages(engine, 10.0) == (40.0,)
    assert pipeline.sum_over_stages(SimpleNamespace(config={}), 7.0, 3.0) == (7.0, 3.0)


def test_pipeline_loss_averages_over_the_labelled_tokens_only():
    """Head.loss is transformers' causal LM loss: labels shifted by one, mean over the tokens whose label is not
    -100 (padding / prompt tokens excluded from the denominator as well as from the sum).
    [fails if: Head.loss divides by every target token instead of the ones not equal to -100]"""
    from torch import nn

    from engine.pipeline import Head

    torch.manual_seed(0)
    H, V = 8, 11
    head = Head(nn.LayerNorm(H), nn.Linear(H, V, bias=False), config=SimpleNamespace())
    with torch.no_grad():
        head.lm_head.weight.copy_(torch.randn(V, H))
    hidden = torch.randn(2, 6, H)
    labels = torch.randint(0, V, (2, 6))
    labels[0, 3:] = -100
    labels[1, 1] = -100
    logits = hidden[:, :-1] @ head.lm_head.weight.T
    want = nn.functional.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    got = head.loss(hidden, labels)
    assert torch.allclose(got, want, atol=1e-5), (got, want)


def test_zero12_per_expert_files_are_read_from_their_own_stage(tmp_path):
    """Without optimizer files (a ZeRO stage 0 save) each expert comes from its own file,
    layer_{moe_layer_id}_expert_{e}_mp_rank_{stage}_model_states.pt. In a pipeline every stage numbers its MoE layers
    from 0, so stage 1's experts must be read from the mp_rank_01 files, not stage 0's files of the same name.
    [fails if: _experts looks up the per-expert files of model-parallel rank 0 whatever the stage]"""
    from engine.export.zero12 import _experts

    E, ffn, hidden = 2, 3, 4
    for stage, prefix in ((0, "2.layer.mlp.experts"), (1, "3.layer.mlp.experts")):
        for e in range(E):
            torch.save({f"{prefix}.w1.{e}": torch.randn(ffn, hidden)},
                       tmp_path / f"layer_0_expert_{e}_mp_rank_{stage:02d}_model_states.pt")
    layer = {"expert_key_prefix": "3.layer.mlp.experts", "num_experts": E, "ep_size": 1, "module_path": "3.layer.mlp",
             "moe_layer_id": 0}
    by_file, shapes = {}, {}
    _experts(tmp_path, 1, layer, "w1", {}, {}, lambda n: n, {}, shapes, by_file)
    assert sorted(f.name for f in by_file) == [f"layer_0_expert_{e}_mp_rank_01_model_states.pt" for e in range(E)]
    assert shapes == {"3.layer.mlp.experts.gate_up_proj": (E, 2 * ffn, hidden)}


def test_zero3_partitions_of_odd_sized_parameters_keep_their_padding(tmp_path):
    """ZeRO-3 stores, in each rank's flat fp32 partition, every parameter as ceil(numel / ranks) values, the last
    rank's piece zero-padded: a parameter that follows an odd-sized one starts after the padding. Two ranks, a (3,)
    and b (4,): rank 1's flat is [a2, pad, b2, b3]; the export must give a = a0..a2 and b = b0..b3.
    [fails if: the flat offset advances by the unpadded piece length instead of the padded partition size]"""
    from engine.export.plan import Checkpoint
    from engine.export.zero3 import FLATS, _FragmentMap, _Rank

    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0, 7.0])
    flats = {0: torch.tensor([1.0, 2.0, 4.0, 5.0]), 1: torch.tensor([3.0, 0.0, 6.0, 7.0])}
    fm = _FragmentMap(tmp_path, {}, {}, {}, lambda n: n)
    sources = []
    for r in (0, 1):
        f = tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        torch.save({FLATS[0]: {FLATS[1]: [flats[r]]}}, f)
        rank = _Rank(r, tmp_path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", f)
        sources.append(fm.add_rank(rank, [{"a": (3,), "b": (4,)}], {"sizes": [4], "partitions": [(2, r)]}))
    fm.check_complete()
    ck = Checkpoint("zero3", tmp_path, None, {"a": ((3,), torch.float32), "b": ((4,), torch.float32)}, {}, sources)
    got = ck.read(["a", "b"])
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_export_keeps_the_init_models_generation_config(tmp_path, monkeypatch):
    """A model.init_from run records its init's generation_config.json in the checkpoint (init_model/); the export
    writes that file as is (its EOS ids, sampling defaults), not one rebuilt from the model config.
    [fails if: export() always derives generation_config.json from the model config, ignoring init_model/'s]"""
    from transformers import Qwen3MoeConfig

    from engine.export import write

    tag = tmp_path / "run" / "checkpoints" / "step_00000002"
    (tag / "init_model").mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    gen = {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (tag / "init_model" / "generation_config.json").write_text(json.dumps(gen))
    (tag.parent / "latest").write_text(tag.name)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=2,
                         num_experts_per_tok=1, eos_token_id=2)
    fake = SimpleNamespace(keys={"w": ((2,), torch.float32)}, hf_config=cfg, tokenizer_dir=None,
                           read=lambda keys: {k: torch.zeros(2) for k in keys})
    monkeypatch.setattr(write, "open_checkpoint", lambda tag_dir, dtype: fake)
    out = write.export(tmp_path / "run", tmp_path / "hf", log=lambda *a: None)
    assert json.loads((out / "generation_config.json").read_text()) == gen

"""engine/ds_config.py's own work, one rule a test, each a change to ds_config.py (a mutant) that every other fast
test let through: read_ds_config's one-line refusals (the shipped-file hint, the JSON error's position), the
"auto" values resolve_ds_config writes into the file (ZeRO-3's gather settings on one CUDA rank and elsewhere, the
decoder-layer leaf modules, train_batch_size, the optimizer's torch_adam, combine_impl), the checks it refuses a
file with (the scheduler, ZenFlow, an offload ratio, a missing or unknown optimizer, a stray "auto", pipeline
sections: their stage count, partition, model and init), and the small predicates the engine asks of a file
(stochastic rounding, the compile blockers, zero_stage, uses_expert_parallel). No launcher, no DeepSpeed engine:
plain dicts built from the shipped ds_configs/*.json and the embedded tiny recipe (deepseek_v3, 2 layers, 8
experts, first_dense_layers 0, train.lr 3e-3); every expectation is written out by hand (exact lines, values worked
out in the docstrings)."""
import json
from pathlib import Path

import pytest

import engine
from engine.auto_batch import AutoBatch
from engine.config import ConfigError, load_recipe
from engine.ds_config import read_ds_config, resolve_ds_config

ROOT = Path(engine.__file__).resolve().parents[1]
SHIPPED = ROOT / "ds_configs"


def tiny(**overrides):
    return load_recipe(None, overrides or None)


def ds(name: str, micro: int | None = 2, accum: int | None = 1) -> dict:
    """A shipped file with a written micro-batch and accumulation (none of auto_batch's memory model needed)."""
    raw = read_ds_config(SHIPPED / f"{name}.json")
    if micro is not None:
        raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"] = micro, accum
    return raw


def resolve(raw, recipe=None, world=1, device="cpu", per_node=None, **kw):
    return resolve_ds_config(raw, recipe or tiny(), world_size=world, ranks_per_node=per_node or world, device=device,
                             **kw)


def refused(raw, recipe=None, world=1, device="cpu", **kw) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(raw, recipe, world, device, **kw)
    return str(e.value)


# ------------------------------------------------------------------------------------------------ read_ds_config


def test_a_missing_file_named_like_a_shipped_one_points_at_it(tmp_path, monkeypatch):
    """`zero2.json` given relative to a folder that has none: the line names the shipped ds_configs/zero2.json; the
    same name given as an absolute path (the user meant that very file) names only the shipped folder.
    [fails if: the relative / absolute condition of the hint is inverted]"""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        read_ds_config("zero2.json")
    assert str(e.value) == f"DeepSpeed config zero2.json: no such file (the shipped one is {SHIPPED / 'zero2.json'})"
    with pytest.raises(ConfigError) as e:
        read_ds_config(tmp_path / "zero2.json")
    assert str(e.value) == (f"DeepSpeed config {tmp_path / 'zero2.json'}: no such file (the shipped ones are in "
                            f"{SHIPPED})")


def test_malformed_json_names_its_line_and_column(tmp_path):
    """A trailing comma before the closing brace on line 3: json stops at line 3, column 1 (the `}`), and the line
    says so. [fails if: the line number is replaced by the column (line 1 column 1)]"""
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 1,\n}\n')
    with pytest.raises(ConfigError) as e:
        read_ds_config(path)
    assert str(e.value) == (f"DeepSpeed config {path}: malformed JSON at line 3 column 1: Expecting property name "
                            "enclosed in double quotes")


# ------------------------------------------------------------------------------------------------ ZeRO-3 gather


@pytest.mark.parametrize("world, device, offload, single", [
    (1, "cuda", None, True),  # the one case the single-rank values are for
    (1, "cpu", None, False),  # CPU ranks: DeepSpeed's defaults (measured slower with the single-rank ones)
    (1, "rocm", None, False),  # nothing measured there
    (2, "cuda", None, False),  # several ranks
    (1, "cuda", "cpu", False),  # offloaded parameters would all stay on the GPU
])
def test_zero3_gather_auto_takes_the_single_rank_values_only_on_one_cuda_rank(world, device, offload, single):
    """zero3.json's stage3_max_live_parameters / stage3_max_reuse_distance / stage3_prefetch_bucket_size "auto":
    1e10, 1e10, 5e8 on one CUDA rank without parameter offload; DeepSpeed's 1e9, 1e9, 5e7 on CPU, ROCm, two ranks,
    or with offload_param on the CPU. [fails if: the two columns are swapped, a value is wrong (5e8 written as 5e7),
    the device test becomes `!= "cpu"`, or the world / offload condition is dropped]"""
    raw = ds("zero3")
    if offload:
        raw["zero_optimization"]["offload_param"] = {"device": offload}
    z = resolve(raw, world=world, device=device)["zero_optimization"]
    got = (z["stage3_max_live_parameters"], z["stage3_max_reuse_distance"], z["stage3_prefetch_bucket_size"])
    assert got == ((10_000_000_000, 10_000_000_000, 500_000_000) if single else
                   (1_000_000_000, 1_000_000_000, 50_000_000))


# ------------------------------------------------------------------------------------------------ leaf modules


def test_zero3_leaf_auto_names_every_decoder_layer():
    """The tiny recipe has 2 decoder layers: leaf_module "auto" becomes exactly model.layers.0 and model.layers.1, no
    classes, no suffixes. [fails if: the range is one short]"""
    z = resolve(ds("zero3"))["zero_optimization"]
    assert z["leaf_module"] == {"names": ["model.layers.0", "model.layers.1"], "classes": [], "name_suffixes": []}


def test_leaf_auto_below_zero3_and_a_null_leaf_are_dropped():
    """zero2.json given leaf_module "auto" (as a ZeRO-3 file switched to stage 2 keeps it), and zero3.json given
    leaf_module null: the key is gone from the resolved file (DeepSpeed hooks every module, as without it).
    [fails if: stage 2 counts as ZeRO-3, "auto" is left for DeepSpeed below ZeRO-3, or null is kept]"""
    raw = ds("zero2")
    raw["zero_optimization"]["leaf_module"] = "auto"
    assert "leaf_module" not in resolve(raw)["zero_optimization"]
    raw = ds("zero3")
    raw["zero_optimization"]["leaf_module"] = None
    assert "leaf_module" not in resolve(raw)["zero_optimization"]


def test_a_leaf_module_that_is_neither_auto_nor_an_object_is_refused():
    """leaf_module "all" is one line naming the two forms it may take; an object goes to DeepSpeed as written.
    [fails if: any value is accepted]"""
    raw = ds("zero3")
    raw["zero_optimization"]["leaf_module"] = "all"
    line = refused(raw)
    assert ("zero_optimization.leaf_module ('all') must be \"auto\" (each decoder layer one ZeRO-3 leaf) or an object "
            'such as {"names": ["model.layers.0"]}; remove it for a hook on every module') in line, line
    raw["zero_optimization"]["leaf_module"] = {"names": ["model.layers.1"]}
    assert resolve(raw)["zero_optimization"]["leaf_module"] == {"names": ["model.layers.1"]}


# ------------------------------------------------------------------------------------------------ optimizer


def test_a_scheduler_section_is_refused():
    """The recipe drives the LR schedule: a DeepSpeed scheduler section is one line telling to remove it.
    [fails if: the scheduler refusal is dropped]"""
    raw = {**ds("zero2"), "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    assert refused(raw) == ("DeepSpeed config: scheduler: remove it; the recipe's train.warmup_steps/min_lr_ratio/"
                            "max_steps drive the LR schedule (the optimizer's lr stays in this file)")


def test_zenflow_is_refused():
    """zero_optimization.zenflow (a key DeepSpeed knows, so not a misspelling) is one line naming the working
    alternatives. [fails if: the ZenFlow refusal is dropped]"""
    raw = ds("zero2")
    raw["zero_optimization"]["zenflow"] = {"topk_ratio": 0.1}
    line = refused(raw)
    assert line.startswith("DeepSpeed config: zero_optimization.zenflow: not supported: DeepSpeed 0.19.8's ZenFlow"), line
    assert "remove it and offload with ds_configs/zero3_offload.json (offload_optimizer.ratio)" in line, line


def test_an_offload_ratio_of_0_is_taken_and_a_part_offload_below_zero3_is_refused():
    """ratio is a share in [0, 1]: 0 (everything on the GPU side) passes under ZeRO-3 (zero3_offload.json); 0.5
    under ZeRO-2 is one line (DeepSpeed offloads part of the optimizer under ZeRO-3 only); 1.0 under ZeRO-2 passes.
    [fails if: the lower bound excludes 0, or the ZeRO-3-only check is dropped]"""
    raw = ds("zero3_offload")
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = 0
    assert resolve(raw)["zero_optimization"]["offload_optimizer"]["ratio"] == 0
    raw = ds("zero2")
    raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
    assert refused(raw) == ("DeepSpeed config: zero_optimization.offload_optimizer.ratio (0.5): DeepSpeed offloads "
                            "part of the optimizer under ZeRO-3 only (ZeRO-1/2 offload all of it); remove ratio, or "
                            "use ds_configs/zero3_offload.json")
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = 1.0
    resolve(raw)


def test_a_missing_or_unknown_optimizer_is_refused():
    """No optimizer section: one line with an example; type "Adamm" (neither DeepSpeed's nor torch.optim's): one line
    naming it; type "SGD" (torch.optim's) passes. [fails if: either refusal is dropped]"""
    raw = ds("zero2")
    del raw["optimizer"]
    assert refused(raw) == ('DeepSpeed config: optimizer: missing; add e.g. {"type": "AdamW", "params": {"lr": "auto", '
                            '"weight_decay": 0.1}}')
    raw = ds("zero2")
    raw["optimizer"]["type"] = "Adamm"
    assert refused(raw) == ("DeepSpeed config: optimizer.type: 'Adamm' is neither one of DeepSpeed's optimizers nor "
                            "torch.optim's (e.g. AdamW)")
    raw["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    assert resolve(raw)["optimizer"] == {"type": "SGD", "params": {"lr": 0.1}}


def test_torch_adam_is_added_only_for_a_cpu_adam_without_offload_and_never_over_a_written_one():
    """zero2.json's AdamW on CPU ranks gets torch_adam true; on ROCm ranks (a GPU: FusedAdam) nothing is added; a
    written torch_adam false stays false on the CPU; with the optimizer offloaded (zero3_offload.json, DeepSpeedCPUAdam)
    nothing is added. [fails if: the device test becomes `!= "cuda"`, a written value is overwritten, or the offload
    condition is dropped]"""
    assert resolve(ds("zero2"))["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in resolve(ds("zero2"), device="rocm")["optimizer"]["params"]
    raw = ds("zero2")
    raw["optimizer"]["params"]["torch_adam"] = False
    assert resolve(raw)["optimizer"]["params"]["torch_adam"] is False
    assert "torch_adam" not in resolve(ds("zero3_offload"))["optimizer"]["params"]


# ------------------------------------------------------------------------------------------------ stochastic rounding


def test_stochastic_rounding_blockers_each_name_their_reason():
    """zero2_bf16_states.json rounds (blocker None). bf16 off with bf16_master_weights_and_grads still true: fp32
    master weights, nothing to round. The optimizer offloaded to the CPU: DeepSpeedCPUAdam. A param AdamWSR does not
    take (foreach): named, with the ones it takes sorted (adam_w_mode, betas, eps, lr, weight_decay).
    [fails if: bf16's two conditions are or-ed, the offload or the foreign-param check is dropped]"""
    from engine.ds_config import stochastic_rounding_blocker

    base = ds("zero2_bf16_states")
    assert stochastic_rounding_blocker(base) is None
    raw = ds("zero2_bf16_states")
    raw["bf16"]["enabled"] = False
    assert stochastic_rounding_blocker(raw) == ("the DS config keeps fp32 master weights (nothing to round; "
                                                "bf16.bf16_master_weights_and_grads is off)")
    raw = ds("zero2_bf16_states")
    raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert stochastic_rounding_blocker(raw) == ("the optimizer is offloaded (DeepSpeedCPUAdam updates the weights on "
                                                "the CPU)")
    raw = ds("zero2_bf16_states")
    raw["optimizer"]["params"]["foreach"] = True
    assert stochastic_rounding_blocker(raw) == ("optimizer.params.foreach is not one AdamWSR takes (adam_w_mode, betas, "
                                                "eps, lr, weight_decay)")


# ------------------------------------------------------------------------------------------------ expert parallel


def test_a_disabled_expert_parallel_section_is_left_as_written():
    """enabled false: autoep_size 3 (dividing neither 8 experts nor 2 ranks) is no problem and "auto" is not filled
    in, nor is combine_impl. [fails if: a section with enabled false is resolved and checked]"""
    raw = ds("zero2")
    raw["expert_parallel"] = {"enabled": False, "autoep_size": 3}
    assert resolve(raw, world=2)["expert_parallel"] == {"enabled": False, "autoep_size": 3}
    raw["expert_parallel"] = {"enabled": False, "autoep_size": "auto"}
    assert resolve(raw, world=2)["expert_parallel"] == {"enabled": False, "autoep_size": "auto"}


def test_auto_autoep_size_in_a_pipeline_counts_the_ranks_of_one_stage():
    """pipe.json on 4 ranks of one node, 2 stages: a stage has 4 / 2 = 2 ranks, so "auto" is the largest divisor of
    8 experts and 2: 2 (not 4, which would put an expert group across the two stages); train_batch_size is
    4 x 4 x 2 data-parallel = 32. [fails if: the group is the whole world]"""
    cfg = resolve(ds("pipe", None), world=4)
    assert cfg["expert_parallel"]["autoep_size"] == 2
    assert cfg["train_batch_size"] == 32


def test_an_autoep_size_that_divides_no_experts_or_no_ranks_is_refused():
    """8 experts on 3 ranks with autoep_size 3: 3 does not divide 8, and the only size dividing 8 and 3 is 1. On 2
    ranks autoep_size 4 divides 8 experts but not the world size 2; in a 2-stage pipeline on 4 ranks it must divide
    the 2 ranks of a stage. [fails if: either divisibility check is dropped]"""
    raw = ds("zero2")
    raw["expert_parallel"]["autoep_size"] = 3
    assert refused(raw, world=3) == ("DeepSpeed config: expert_parallel.autoep_size (3) must divide "
                                     "model.num_experts (8); use one of [1] or \"auto\"")
    raw["expert_parallel"]["autoep_size"] = 4
    assert refused(raw, world=2) == ("DeepSpeed config: expert_parallel.autoep_size (4) must divide the world size "
                                     "(2); use \"auto\" to derive it")
    raw = ds("pipe", None)
    raw["expert_parallel"]["autoep_size"] = 4
    assert refused(raw, world=4) == ("DeepSpeed config: expert_parallel.autoep_size (4) must divide the ranks per "
                                     "pipeline stage (4 ranks / 2 stages = 2; experts cannot span pipeline stages); "
                                     "use \"auto\" to derive it")


def test_a_wrong_preset_model_line_suggests_the_recipes_arch():
    """preset_model qwen3_moe for the tiny deepseek_v3 recipe: the line tells to set it to 'deepseek_v3'.
    [fails if: the fix names the preset itself]"""
    raw = ds("zero2")
    raw["expert_parallel"]["preset_model"] = "qwen3_moe"
    assert refused(raw) == ("DeepSpeed config: expert_parallel.preset_model ('qwen3_moe') does not match model.arch "
                            "('deepseek_v3'); set it to 'deepseek_v3' or remove it")


@pytest.mark.parametrize("device, section, value, impl", [
    ("rocm", None, None, "weighted_sum"),  # AutoEP's Triton kernel: CUDA only
    ("cuda", "tensor_parallel", {"autotp_size": 1}, "fused_weighted_sum"),  # autotp 1 is no tensor parallelism
    ("cuda", "expert_parallel", {"expert_tensor_parallel_size": 1}, "fused_weighted_sum"),
])
def test_combine_impl_auto_is_the_fused_kernel_exactly_on_cuda_without_tensor_parallelism(device, section, value,
                                                                                          impl):
    """combine_impl left out on 2 ranks: fused_weighted_sum on CUDA, also with autotp_size 1 or
    expert_tensor_parallel_size 1 written out (sizes of 1 are no parallelism); weighted_sum on ROCm.
    [fails if: ROCm takes the kernel, or a size of 1 blocks it (`> 1` -> `>= 1`)]"""
    raw = ds("zero2")
    if section:
        raw[section] = {**raw.get(section, {}), **value}
    assert resolve(raw, world=2, device=device)["expert_parallel"]["combine_impl"] == impl


def test_uses_expert_parallel_and_ep_size_read_enabled_s_value():
    """enabled false is no expert parallelism (ep_size 1 whatever autoep_size says); enabled true with autoep_size 4
    is 4. [fails if: the key's presence counts instead of its value]"""
    from engine.ds_config import ep_size, uses_expert_parallel

    off = {"expert_parallel": {"enabled": False, "autoep_size": 4}}
    assert not uses_expert_parallel(off) and ep_size(off) == 1
    on = {"expert_parallel": {"enabled": True, "autoep_size": 4}}
    assert uses_expert_parallel(on) and ep_size(on) == 4


def test_a_foreign_key_in_expert_parallel_is_left_alone_unless_it_is_nearly_a_known_one():
    """AutoEP ignores keys it does not read, so only a near miss (difflib ratio >= 0.8) is named: "comment" (0.63 to
    comm_backend) and "notes" pass; "layer_pattern" (0.87 to moe_layer_pattern) is named. [fails if: the cutoff is
    lowered and a user's own note is refused]"""
    raw = ds("zero2")
    raw["expert_parallel"].update(comment="8 experts", notes="x")
    assert resolve(raw)["expert_parallel"]["comment"] == "8 experts"
    raw["expert_parallel"]["layer_pattern"] = "x"
    assert refused(raw) == ("DeepSpeed config: expert_parallel.layer_pattern: not a DeepSpeed setting (AutoEP would "
                            "ignore it); did you mean moe_layer_pattern?")


# ------------------------------------------------------------------------------------------------ compile


def test_compile_auto_asks_deepspeed_to_compile_around_autoep_and_keeps_a_written_choice():
    """zero2.json without its compile section, train.compile auto: compile.autoep_non_moe true is added; train.compile
    false adds nothing; a written autoep_non_moe false stays false. [fails if: only train.compile true adds it, or a
    written value is overwritten]"""
    raw = ds("zero2")
    del raw["compile"]
    assert resolve(raw)["compile"] == {"autoep_non_moe": True}
    assert "compile" not in resolve(raw, tiny(**{"train.compile": False}))
    raw["compile"] = {"autoep_non_moe": False}
    assert resolve(raw)["compile"] == {"autoep_non_moe": False}


def test_compile_blockers_and_zero3_layer_compile_need_their_conditions():
    """zero2.json with the optimizer offloaded cannot compile around AutoEP (the offload named); ZeRO-3 leaves that
    are not all decoder layers (model.layers.0 and model.embed_tokens) are no layer compile; zero3.json without
    AutoEP compiles its layers (leaves) but "auto" does not take it (auto_compiles_layers needs AutoEP there).
    [fails if: the offload blocker is dropped, `all` becomes `any`, or auto's AutoEP condition is dropped]"""
    from engine.ds_config import auto_compiles_layers, compile_blocker, zero3_compiles_layers

    raw = ds("zero2")
    raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert compile_blocker(raw) == "no offload (this config sets zero_optimization.offload_optimizer)"
    cfg = {"zero_optimization": {"stage": 3, "leaf_module": {"names": ["model.layers.0", "model.embed_tokens"]}}}
    assert not zero3_compiles_layers(cfg)
    raw = ds("zero3")
    raw["expert_parallel"]["enabled"] = False
    cfg = resolve(raw)
    assert zero3_compiles_layers(cfg) and not auto_compiles_layers(cfg)


# ------------------------------------------------------------------------------------------------ batch size


def test_train_batch_size_auto_is_micro_times_accumulation_times_data_parallel():
    """micro 2 x accumulation 3 x 2 ranks = 12; accumulation left out is DeepSpeed's 1: micro 3 x 1 x 2 = 6; in
    pipe.json (4 x 4) on 2 ranks / 2 stages the data-parallel size is 1: 16. [fails if: the accumulation is left
    out of the product, a missing one counts as 2, or the pipeline's stages are not divided out]"""
    assert resolve(ds("zero2", 2, 3), world=2)["train_batch_size"] == 12
    raw = ds("zero2", 3, 1)
    del raw["gradient_accumulation_steps"]
    assert resolve(raw, world=2)["train_batch_size"] == 6
    assert resolve(ds("pipe", None), world=2)["train_batch_size"] == 16


def test_a_written_train_batch_size_that_does_not_multiply_out_is_one_line():
    """train_batch_size 10 against 2 x 3 x 2 = 12: one line with the product; 12 passes. [fails if: the mismatch is
    accepted, or the line's product leaves out the accumulation]"""
    raw = {**ds("zero2", 2, 3), "train_batch_size": 10}
    assert refused(raw, world=2) == (
        "DeepSpeed config: train_batch_size (10) != train_micro_batch_size_per_gpu (2) x gradient_accumulation_steps "
        "(3) x data-parallel size (2) = 12; fix one of them or set train_batch_size to \"auto\"")
    raw["train_batch_size"] = 12
    assert resolve(raw, world=2)["train_batch_size"] == 12


def test_stages_that_do_not_divide_the_world_are_one_line():
    """pipe.json (2 stages) on 3 ranks: the line names the 2 stages and the 3 ranks. [fails if: the numbers are
    swapped]"""
    assert "pipeline.stages (2) must divide the world size (3)" in refused(ds("pipe", None), world=3)


def test_auto_batch_is_refused_without_an_auto_batch_and_with_a_pipeline():
    """zero2.json's "auto" micro-batch and accumulation without an AutoBatch (a caller that cannot size them) is one
    line, not an AttributeError; pipe.json given micro "auto" with an AutoBatch is one line too. [fails if: the
    missing-AutoBatch test needs the recipe missing as well, or the pipeline refusal is dropped]"""
    assert refused(ds("zero2", None)) == (
        'DeepSpeed config: train_micro_batch_size_per_gpu "auto" and gradient_accumulation_steps "auto": resolved by '
        "bin/pretrain.py, bin/grpo.py and bin/bench.py only (from the device's memory); write a number here")
    raw = {**ds("pipe", None), "train_micro_batch_size_per_gpu": "auto"}
    assert refused(raw, world=2, auto_batch=AutoBatch()) == (
        'DeepSpeed config: train_micro_batch_size_per_gpu "auto": not supported with a pipeline section (the memory '
        "model covers ZeRO without a pipeline); write a number (ds_configs/pipe.json has 4 x 4)")


def test_auto_where_the_engine_fills_nothing_in_is_refused():
    """A Hugging Face Trainer habit: gradient_clipping "auto" at the top level and optimizer.params.eps "auto" are
    each named in one line listing where "auto" is supported. [fails if: either place is no longer checked]"""
    raw = {**ds("zero2"), "gradient_clipping": "auto"}
    raw["optimizer"]["params"]["eps"] = "auto"
    assert refused(raw) == (
        'DeepSpeed config: gradient_clipping, optimizer.params.eps: "auto" is not supported there (the engine fills in '
        '"auto" only for train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, '
        "optimizer.params.lr, expert_parallel.autoep_size and expert_parallel.combine_impl); write a value")


# ------------------------------------------------------------------------------------------------ pipeline


def test_pipeline_stage_counts_outside_1_to_the_layer_count_are_refused():
    """The tiny recipe has 2 layers: pipeline.stages 0 is no positive integer, 3 is more than the layers, 2 (one
    layer a stage, pipe.json) passes. [fails if: 0 is taken, or stages equal to the layers are refused]"""
    raw = ds("pipe", None)
    raw["pipeline"]["stages"] = 0
    assert ("pipeline.stages (0) must be a positive integer (one stage per node suits slow inter-node links)"
            in refused(raw, world=2))
    raw["pipeline"]["stages"] = 3
    assert ("pipeline.stages (3) is more than model.num_layers (2): every stage needs at least one decoder layer; use "
            "at most 2 stages" in refused(raw, world=3))
    raw["pipeline"]["stages"] = 2
    assert resolve(raw, world=2)["pipeline"]["stages"] == 2


def test_a_partition_neither_uniform_nor_a_type_regex_is_refused():
    """pipeline.partition "parameters" (DeepSpeed's own option, which builds every stage's layers on every rank) is
    one line. [fails if: any string is accepted]"""
    raw = ds("pipe", None)
    raw["pipeline"]["partition"] = "parameters"
    assert ("pipeline.partition ('parameters') must be \"uniform\" or \"type:<layer class regex>\" (default: balance "
            "decoder layers); \"parameters\" would build every stage's layers on every rank") in refused(raw, world=2)


def test_a_pipeline_without_expert_parallel_needs_no_moe_layer_pattern():
    """pipe.json with expert_parallel disabled and no moe_layer_pattern passes (the pattern is AutoEP's).
    [fails if: the pattern is required whatever enabled says]"""
    raw = ds("pipe", None)
    raw["expert_parallel"] = {"enabled": False}
    assert resolve(raw, world=2)["expert_parallel"] == {"enabled": False}


def test_a_pipeline_refuses_init_from_and_other_families():
    """Pipeline mode builds random-init stages of deepseek_v3 and qwen3_moe only: model.init_from set is one line, a
    mixtral model another. [fails if: either refusal is dropped]"""
    r = tiny()
    r.model.init_from = "/models/x"
    assert ("model.init_from (/models/x) is not supported in pipeline mode yet; start from random init, or train with "
            "ds_configs/zero3.json") in refused(ds("pipe", None), r, world=2)
    r = tiny()
    r.model.arch = "mixtral"
    assert ("model.arch mixtral: pipeline mode builds its stages for deepseek_v3 and qwen3_moe only; train it with "
            "ds_configs/zero3.json or zero2.json") in refused(ds("pipe", None), r, world=2)


def test_a_type_partition_matches_layer_classes_ignoring_case():
    """DeepSpeed matches "type:" regexes case-insensitively: type:decoderlayerpipe is the default partition, one
    decoder layer a stage over [Embed, layer 0, layer 1, Head]: (0, 2) and (2, 4). [fails if: IGNORECASE is
    dropped (no class matches: ValueError)]"""
    from engine.ds_config import stage_layout

    got = stage_layout("type:decoderlayerpipe", 2, 2)
    assert [(int(a), int(b)) for a, b in got] == [(0, 2), (2, 4)]


def test_moe_less_stage_counts_the_first_moe_layer_as_moe():
    """3 layers, the first 1 dense, stages [(0, 3), (3, 5)] of [Embed, L0, L1, L2, Head]: stage 0 holds L0 (dense) and
    L1 (MoE: index 1 >= first_dense_layers 1), stage 1 holds L2: none is MoE-less. With 2 dense layers stage 0 holds
    no MoE layer. [fails if: `dense <= layer` becomes `<`]"""
    from engine.ds_config import moe_less_stage

    assert moe_less_stage([(0, 3), (3, 5)], 3, 1) is None
    assert moe_less_stage([(0, 3), (3, 5)], 3, 2) == 0


def test_a_head_only_stage_is_named_with_the_largest_stage_count_that_works():
    """uniform over [Embed, L0, L1, Head] in 3 stages: (0, 2), (2, 3), (3, 4), so stage 2 holds the head only; 2
    stages ((0, 2), (2, 4)) give every stage an MoE layer, so the fix is at most 2. [fails if: the embedding and the
    head are swapped, or the search for the largest stage count stops before the layer count]"""
    from engine.ds_config import check_stage_layout

    assert check_stage_layout("uniform", 3, tiny(), True) == [
        "pipeline: stage 2 of 3 would hold no MoE layer (the head only; partition 'uniform'), and AutoEP needs one on "
        "every stage; use at most 2 stages"]


# ------------------------------------------------------------------------------------------------ small checks


def test_a_zero_section_without_a_stage_is_stage_0_and_refused():
    """zero_optimization without "stage" is DeepSpeed's stage 0, which the engine refuses without a pipeline.
    [fails if: a missing stage defaults to another stage]"""
    raw = ds("zero2")
    del raw["zero_optimization"]["stage"]
    assert "zero_optimization.stage (0) must be 1, 2 or 3" in refused(raw)


def test_an_adam_optimizers_params_are_checked_too():
    """type "Adam" (not only "AdamW") with params.weight_decy: one line naming weight_decay. [fails if: only AdamW's
    params are checked]"""
    raw = ds("zero2")
    raw["optimizer"]["type"] = "Adam"
    raw["optimizer"]["params"]["weight_decy"] = 0.1
    assert ("optimizer.params.weight_decy: not a parameter of DeepSpeed's Adam optimizers; did you mean weight_decay?"
            in refused(raw))


def test_activation_checkpointing_and_checkpoint_must_be_objects():
    """"activation_checkpointing": [] and "checkpoint": null are each named in the one line, before anything reads
    them. [fails if: either is dropped from the sections checked]"""
    raw = {**ds("zero2"), "activation_checkpointing": [], "checkpoint": None}
    assert refused(raw) == ("DeepSpeed config: checkpoint: must be an object ({...}), not null; "
                            "activation_checkpointing: must be an object ({...}), not []")


# ------------------------------------------------------------------------------------------------ bugs the audit found


def test_a_tensor_parallel_section_that_is_not_an_object_is_one_line_on_cuda():
    """"tensor_parallel": 2 (meant as autotp_size 2) on 2 CUDA ranks with combine_impl left to the engine: one
    ConfigError line naming tensor_parallel, like any other section that is not an object. [fails if: tensor_parallel
    is read as an object unchecked (an AttributeError traceback on CUDA)]"""
    raw = {**ds("zero2"), "tensor_parallel": 2}
    assert "tensor_parallel: must be an object ({...}), not 2" in refused(raw, world=2, device="cuda")


def test_a_train_batch_size_written_as_a_string_shows_its_quotes():
    """"train_batch_size": "12" with 2 x 3 x 2 = 12: refused (not an integer), and the line shows '12' quoted so it
    does not read "(12) != ... = 12". [fails if: the line formats the value without its quotes]"""
    raw = {**ds("zero2", 2, 3), "train_batch_size": "12"}
    assert "train_batch_size ('12')" in refused(raw, world=2)


def test_a_data_types_section_that_is_not_an_object_is_one_line_on_cuda():
    """"data_types": "fp32" (meant as grad_accum_dtype fp32) with "auto" batch values on CUDA: one ConfigError line
    naming data_types, before the memory model reads data_types.grad_accum_dtype. [fails if: data_types is read as an
    object unchecked (an AttributeError traceback from auto_batch)]"""
    raw = {**ds("zero2"), "data_types": "fp32"}
    assert "data_types: must be an object ({...}), not \"fp32\"" in refused(raw, world=1, device="cuda")

"""engine/auto_batch.py's memory model and engine/ds_config.py's checks, case by case: each test fails if the rule
its docstring names is dropped or bent (the partition of weights, gradients and optimizer by ZeRO stage, expert
parallelism's split, checkpointing's activations, "auto"'s rounding and boundaries, each refusal)."""
from pathlib import Path

import pytest

import engine
from engine import auto_batch as ab
from engine.auto_batch import AutoBatch, param_counts
from engine.config import RECIPES, ConfigError, load_recipe
from engine.ds_config import (auto_autoep_size, compile_blocker, misspelled_keys, read_ds_config, resolve_ds_config,
                              section_key_problems)

ROOT = Path(engine.__file__).resolve().parents[1]
ZERO2, ZERO3, PIPE = (ROOT / "ds_configs" / n for n in ("zero2.json", "zero3.json", "pipe.json"))
GIB = 2**30


def tiny(**overrides):
    return load_recipe(None, overrides or None)


# ---------------------------------------------------------------- engine/auto_batch.py

def test_fp32_gradient_accumulation_spelled_float32_counts_4_bytes():
    """Each spelling of fp32 gradient accumulation counts 4 bytes a gradient ("float32" too)."""
    for spelling in ("fp32", "float32", "float"):
        cfg = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": spelling}}
        assert ab._bytes_per_param(cfg)[1] == 4, spelling
    assert ab._bytes_per_param({"bf16": {"enabled": True}})[1] == 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_partition_weights_grads_and_optimizer_over_dp(stage):
    """Guards against (weights partitioned from stage 2) and (gradients
    partitioned only from stage 3): ZeRO-1 splits the optimizer, ZeRO-2 also the gradients, ZeRO-3 also the weights."""
    r = tiny()
    total, _ = param_counts(r.model)
    dp = 4
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    w = 2 * (total / dp if stage >= 3 else total)
    g = 2 * (total / dp if stage >= 2 else total)
    o = 12 * total / dp  # fp32 master + two fp32 Adam moments
    assert ab.states_gib(cfg, r, dp) == pytest.approx((w + g + o) / GIB, rel=1e-12)


def test_expert_parallel_splits_the_routed_experts_a_rank_holds_unpartitioned():
    """Guards against (local = total, the experts / autoep_size split dropped): under ZeRO-2 the
    weights are unpartitioned, so with autoep_size 2 a rank holds the dense part and half the routed experts."""
    r = tiny()
    total, experts = param_counts(r.model)
    assert experts > 0
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
           "expert_parallel": {"enabled": True, "autoep_size": 2}}
    dp = 2
    expected = (2 * (total - experts + experts / 2) + 2 * total / dp + 12 * total / dp) / GIB
    assert ab.states_gib(cfg, r, dp) == pytest.approx(expected, rel=1e-12)


def test_activation_checkpointing_keeps_every_layers_input():
    """Guards against ((num_layers - 1) x CKPT): with checkpointing, seq x hidden x (layers x CKPT + A)
    bytes per sample; tiny: 128 x 64 x (2 x 3.09 + 85.33) (plain_eager, MoE width 13 < 17 is not scaled)."""
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}  # no expert_parallel: plain_eager
    ckpt = tiny(**{"train.activation_checkpointing": True})
    plain = tiny(**{"train.activation_checkpointing": False})
    assert ab.per_sample_gib(cfg, ckpt, "cuda") == pytest.approx(128 * 64 * (2 * 3.09 + 85.33) / GIB, rel=1e-9)
    assert ab.per_sample_gib(cfg, plain, "cuda") == pytest.approx(128 * 64 * 2 * 85.33 / GIB, rel=1e-9)


def test_gated_deltanet_term_counts_once_with_activation_checkpointing(monkeypatch):
    """Guards against (the GDN term multiplied by every GDN layer even with checkpointing). With
    checkpointing one layer is recomputed at a time, so the Gated DeltaNet excess is counted once."""
    monkeypatch.setattr(ab, "linear_attention", lambda m: (3, 4096))
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    gdn = 218.0 * 4096 - 36.1 * 64
    ckpt = tiny(**{"train.activation_checkpointing": True})
    plain = tiny(**{"train.activation_checkpointing": False})
    assert ab.per_sample_gib(cfg, ckpt, "cuda") == pytest.approx(
        128 * (64 * (2 * 3.09 + 85.33) + gdn) / GIB, rel=1e-9)
    assert ab.per_sample_gib(cfg, plain, "cuda") == pytest.approx(
        128 * (64 * 2 * 85.33 + 3 * gdn) / GIB, rel=1e-9)


def test_host_offload_without_ratio_offloads_the_whole_optimizer():
    """Guards against (offload_optimizer.ratio defaulting to 0.5 instead of DeepSpeed's 1.0)."""
    r = tiny()
    total = param_counts(r.model)[0]
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert ab.host_offload_gib(cfg, r, 1) == pytest.approx(16 * total / GIB, rel=1e-12)
    assert ab.host_offload_gib(cfg, r, 2) == pytest.approx(8 * total / GIB, rel=1e-12)


def test_a_missing_gradient_accumulation_key_is_deepspeeds_1_not_auto():
    """Guards against (a missing gradient_accumulation_steps treated as "auto"). DeepSpeed's default
    is 1 and resolve_batch_size reads it so; only the literal "auto" is resolved."""
    raw = read_ds_config(ZERO2)
    del raw["gradient_accumulation_steps"]
    auto = AutoBatch(memory_gib=80.0)
    cfg = resolve_ds_config(raw, tiny(), world_size=1, ranks_per_node=1, device="cuda", auto_batch=auto)
    assert cfg.get("gradient_accumulation_steps", 1) == 1
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"]
    assert auto.chosen["grad_accum"] == 1


def test_resume_with_a_non_dividing_written_micro_batch_falls_back_to_autos_accumulation():
    """Guards against (the divisibility check dropped, 16 x 4 // 6 = 10 silently taken). 64 sequences
    are no multiple of 6, so auto's own pick for micro 6 stands: round-half-up(64 / 6) = 11."""
    r = load_recipe(RECIPES / "deepseek_2b6.yaml", {"model.vocab_size": 512})
    raw = {**read_ds_config(ZERO2), "train_micro_batch_size_per_gpu": 6}
    auto = AutoBatch(memory_gib=140.4, recorded={"micro_batch": 16, "grad_accum": 4})
    cfg = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, device="cuda", auto_batch=auto)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (6, 11)
    assert "the checkpoint's" not in auto.note


class _Synthetic(AutoBatch):
    """Predicted peak = micro GiB (or a fixed table)."""
    table: dict | None = None

    def peak_gib(self, cfg, recipe, dp, micro, device):
        return float(micro) if self.table is None else self.table[micro]


def test_a_peak_exactly_at_the_usable_memory_fits():
    """Guards against (peaks[m] <= usable -> <). "Fits" means at most the usable memory."""
    a = _Synthetic(memory_gib=100.0)
    usable = ab.USABLE_FRACTION * a.memory_gib - ab.MARGIN_GIB
    a.table = {m: (usable if m == 16 else usable + 1 if m > 16 else usable - 1) for m in ab.CANDIDATES}
    micro, _, problem = a.pick_micro({}, tiny(), 1, "cuda")
    assert problem is None and micro == 16


def test_the_line_names_the_next_candidate_up():
    """Guards against (bigger[-1] -> bigger[0]): at micro 8 the line says what 16 (the next one up)
    would need, not 32."""
    a = _Synthetic(memory_gib=(10.5 + ab.MARGIN_GIB) / ab.USABLE_FRACTION)  # usable 10.5: 8 fits, 16 does not
    micro, why, problem = a.pick_micro({}, tiny(), 1, "cuda")
    assert (micro, problem) == (8, None)
    assert why.endswith("; 16 would need 16.0"), why


def test_accumulation_rounds_half_up_not_up():
    """Guards against (math.floor(x + 0.5) -> math.ceil(x)): 2253 tokens / (8 x 128) = 2.2 -> 2."""
    r = tiny(**{"train.tokens_per_step_per_gpu": 2253})
    assert AutoBatch().pick_accum(r, 8, "cpu")[0] == 2
    r = tiny(**{"train.tokens_per_step_per_gpu": 2560})  # 2.5 -> 3
    assert AutoBatch().pick_accum(r, 8, "cpu")[0] == 3


def test_near_miss_keys_just_above_the_cutoff_are_named():
    """Guards against (difflib cutoff 0.8 -> 0.9): similarity 0.85-0.88 misspellings are still caught."""
    for key in ("gradient_accumulation", "train_micro_batch_size"):
        [line] = misspelled_keys({key: 4})
        assert line.startswith(f"{key}: not a DeepSpeed setting"), line
    assert misspelled_keys({"gradient_accumulation_steps": 4, "zero_optimization": {}}) == []


def test_auto_autoep_size_divides_the_ranks_per_node():
    """Guards against (`limit % d == 0` dropped): 6 experts, 12 ranks, 8 per node: gcd(12, 8) = 4, so
    3 (which would put one EP group across two nodes) is not allowed; 2 is."""
    assert auto_autoep_size(num_experts=6, world_size=12, ranks_per_node=8) == 2


def _refused(raw, recipe=None, world=1, **kw):
    with pytest.raises(ConfigError) as e:
        resolve_ds_config(raw, recipe or tiny(), world_size=world, ranks_per_node=world, auto_batch=AutoBatch(), **kw)
    return str(e.value)


def test_bf16_and_fp16_together_are_refused():
    """Guards against (the bf16 + fp16 refusal skipped)."""
    raw = {**read_ds_config(ZERO3), "fp16": {"enabled": True}}
    assert "bf16 and fp16 are both enabled; keep one" in _refused(raw)


def test_zero_stage_0_without_a_pipeline_is_refused():
    """Guards against (stage 0 accepted)."""
    raw = read_ds_config(ZERO2)
    raw["zero_optimization"]["stage"] = 0
    assert "zero_optimization.stage (0) must be 1, 2 or 3" in _refused(raw)


def test_cpu_ranks_give_torch_adam_only_to_adam():
    """Guards against (the Adam/AdamW condition dropped: torch_adam added to any optimizer's params,
    which e.g. torch.optim.SGD would reject)."""
    raw = read_ds_config(ZERO2)
    raw["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    cfg = resolve_ds_config(raw, tiny(), world_size=1, ranks_per_node=1, device="cpu", auto_batch=AutoBatch())
    assert "torch_adam" not in cfg["optimizer"]["params"]


def test_a_preset_model_other_than_the_recipes_arch_is_refused():
    """Guards against (the preset_model check skipped)."""
    raw = read_ds_config(ZERO2)
    raw["expert_parallel"]["preset_model"] = "qwen3_moe"
    assert "expert_parallel.preset_model ('qwen3_moe') does not match model.arch ('deepseek_v3')" in _refused(raw)


def test_a_boolean_micro_batch_is_refused():
    """Guards against (isinstance(micro, bool) dropped: true passed as micro-batch 1), for the accumulation too."""
    raw = {**read_ds_config(ZERO2), "train_micro_batch_size_per_gpu": True, "gradient_accumulation_steps": 1}
    assert "train_micro_batch_size_per_gpu (True) must be a positive integer" in _refused(raw)
    raw = {**read_ds_config(ZERO2), "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": True}
    assert "gradient_accumulation_steps (True) must be a positive integer" in _refused(raw)


def test_a_zero_lr_and_a_sequence_past_the_positions_are_refused():
    """train.lr 0 would train nothing; data.seq_len one past model.max_position_embeddings reads positions the model
    has no embedding for. [fails if: lr 0 is taken, or the upper bound of seq_len is off by one]"""
    with pytest.raises(ConfigError, match=r"train.lr: must be > 0, got 0"):
        load_recipe(None, {"train.lr": 0.0})
    with pytest.raises(ConfigError, match=r"data.seq_len \(513\) must be in \[2"):
        load_recipe(None, {"data.seq_len": 513, "model.max_position_embeddings": 512})
    assert load_recipe(None, {"data.seq_len": 512, "model.max_position_embeddings": 512}).data.seq_len == 512


def test_a_pipeline_with_zero_stage_0_is_refused():
    """Guards against (stage 0 accepted with a pipeline section)."""
    raw = read_ds_config(PIPE)
    raw["zero_optimization"]["stage"] = 0
    assert "zero_optimization.stage (0) cannot be combined with a pipeline section" in _refused(raw, world=2)


def test_a_pipeline_without_the_moe_layer_pattern_is_refused():
    """Guards against (the AutoEP moe_layer_pattern check in pipeline mode skipped)."""
    raw = read_ds_config(PIPE)
    del raw["expert_parallel"]["moe_layer_pattern"]
    assert "expert_parallel.moe_layer_pattern (None): in pipeline mode" in _refused(raw, world=2)


def test_zero1_compiles_around_autoep_like_zero2():
    """Guards against (compile_blocker refusing ZeRO-1)."""
    raw = read_ds_config(ZERO2)
    raw["zero_optimization"]["stage"] = 1
    assert compile_blocker(raw) is None
    raw["zero_optimization"]["stage"] = 3
    assert compile_blocker(raw) == "ZeRO stage 1 or 2 (this config has stage 3)"


def test_a_zero_subsection_or_optimizer_params_that_is_not_an_object_is_one_line():
    """offload_optimizer given as a string (or params as a list) is named in one line, not an AttributeError."""
    raw = read_ds_config(ZERO2)
    raw["zero_optimization"]["offload_optimizer"] = "cpu"
    raw["optimizer"]["params"] = ["lr"]
    line = _refused(raw)
    assert 'zero_optimization.offload_optimizer: must be an object ({...}), not "cpu"' in line, line
    assert 'optimizer.params: must be an object ({...}), not ["lr"]' in line, line


def test_a_stage_written_as_a_string_shows_its_quotes():
    """"stage": "3" reads "('3') must be 1, 2 or 3", not the contradictory "(3) must be 1, 2 or 3"."""
    raw = read_ds_config(ZERO2)
    raw["zero_optimization"]["stage"] = "3"
    assert "zero_optimization.stage ('3') must be 1, 2 or 3" in _refused(raw)


@pytest.mark.parametrize("ratio", [1.5, -0.5, "half", True])
def test_an_offload_ratio_outside_0_to_1_is_refused(ratio):
    """offload_optimizer.ratio is a share: outside [0, 1] (or not a number) one line, before DeepSpeed's traceback
    and before the memory model works with it."""
    raw = read_ds_config(ROOT / "ds_configs" / "zero3_offload.json")
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    assert f"zero_optimization.offload_optimizer.ratio ({ratio!r}) must be a number from 0 to 1" in _refused(raw)
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = 0.3
    resolve_ds_config(raw, tiny(), world_size=1, ranks_per_node=1, auto_batch=AutoBatch())


def test_keys_deepspeed_does_not_read_inside_its_sections_are_refused_before_start():
    """A misspelled key inside zero_optimization (and its offload subsection), bf16, fp16, compile, an Adam's
    optimizer.params and expert_parallel is one line naming the nearest known key, before any rank starts; DeepSpeed
    itself stops every rank on the first ones after start-up with a traceback and silently ignores the last (a
    misspelled autoep_size trains without the expert-parallel size asked for). A key far from any known one is
    refused where DeepSpeed would stop on it, and left alone in expert_parallel. Every shipped file passes. [fails
    if: nested sections are not checked, a suggestion is wrong, a subsection's key is checked against its parent's
    names, or a foreign key in expert_parallel is refused]"""
    raw = read_ds_config(ZERO3)
    raw["zero_optimization"]["stage3_prefech_bucket_size"] = 1
    raw["zero_optimization"]["offload_optimizer"] = {"devise": "cpu"}
    raw["bf16"]["enabeld"] = True
    raw["optimizer"]["params"].update(weight_decy=0.1, zzz=1)
    raw["expert_parallel"].update(autoep_sise=2, my_note="x")
    line = _refused(raw)
    for part in ("zero_optimization.stage3_prefech_bucket_size: not a DeepSpeed setting; did you mean "
                 "stage3_prefetch_bucket_size?", "zero_optimization.offload_optimizer.devise: not a DeepSpeed setting; "
                 "did you mean device?", "bf16.enabeld: not a DeepSpeed setting; did you mean enabled?",
                 "optimizer.params.weight_decy: not a parameter of DeepSpeed's Adam optimizers; did you mean "
                 "weight_decay?", "optimizer.params.zzz: not a parameter of DeepSpeed's Adam optimizers; remove it",
                 "expert_parallel.autoep_sise: not a DeepSpeed setting (AutoEP would ignore it); did you mean "
                 "autoep_size?"):
        assert part in line, (part, line)
    assert "my_note" not in line
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        assert section_key_problems(read_ds_config(path)) == [], path
    assert section_key_problems({"fp16": {"enabeld": True}, "compile": {"deepcompil": True}}) == [
        "fp16.enabeld: not a DeepSpeed setting; did you mean enabled?",
        "compile.deepcompil: not a DeepSpeed setting; did you mean deepcompile?"]
    sgd = {"type": "SGD", "params": {"momentum": 0.9}}  # another optimizer's own parameters are its business
    assert section_key_problems({"optimizer": sgd}) == []


def test_an_optimizer_that_leaves_out_its_lr_takes_the_recipes():
    """docs/configs.md: a file that leaves out optimizer.params.lr (or the whole params) gets train.lr, as for "auto";
    a written lr stays. [fails if: only a literal "auto" is filled in (DeepSpeed's AdamW would run at its 1e-3)]"""
    r = tiny(**{"train.lr": 2.5e-4})
    for opt in ({"type": "AdamW", "params": {"weight_decay": 0.1}}, {"type": "AdamW"}):
        raw = {**read_ds_config(ZERO2), "optimizer": opt}
        cfg = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch())
        assert cfg["optimizer"]["params"]["lr"] == 2.5e-4, opt
    raw = {**read_ds_config(ZERO2), "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}
    assert resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch())["optimizer"]["params"][
        "lr"] == 0.5


def test_stochastic_rounding_needs_an_adam_with_decoupled_weight_decay():
    """AdamWSR is AdamW: an Adam written with adam_w_mode false (L2 in the gradient) cannot be replaced by it, so
    train.stochastic_rounding auto stays off there and true is refused; adam_w_mode true (or left out) takes it.
    [fails if: adam_w_mode false is not a blocker]"""
    from types import SimpleNamespace

    from engine.ds_config import stochastic_rounding_blocker, uses_stochastic_rounding

    raw = read_ds_config(ROOT / "ds_configs" / "zero2_bf16_states.json")  # bf16 master weights: rounding applies
    auto = SimpleNamespace(stochastic_rounding="auto")
    assert stochastic_rounding_blocker(raw) is None and uses_stochastic_rounding(raw, auto)
    raw["optimizer"]["params"]["adam_w_mode"] = True
    assert stochastic_rounding_blocker(raw) is None
    raw["optimizer"]["params"]["adam_w_mode"] = False
    assert "only Adam/AdamW with decoupled weight decay" in stochastic_rounding_blocker(raw)
    assert not uses_stochastic_rounding(raw, auto)
    line = _refused(raw, tiny(**{"train.stochastic_rounding": True}))
    assert "train.stochastic_rounding: true, but the optimizer is 'AdamW' (only Adam/AdamW" in line, line


def test_a_negative_pipeline_activation_checkpoint_interval_is_refused():
    """pipeline.activation_checkpoint_interval is a layer count >= 0 (0: none, as pipe.json ships): -1 is one line.
    [fails if: the lower bound is off by one]"""
    raw = read_ds_config(PIPE)
    assert raw["pipeline"]["activation_checkpoint_interval"] == 0
    resolve_ds_config(raw, tiny(), world_size=2, ranks_per_node=2, auto_batch=AutoBatch())  # 0 passes
    raw["pipeline"]["activation_checkpoint_interval"] = -1
    assert "pipeline.activation_checkpoint_interval (-1) must be an integer >= 0" in _refused(raw, world=2)


def test_zero3_layer_compile_is_not_taken_with_offloaded_parameters():
    """train.compile true under ZeRO-3 compiles the decoder-layer leaves in the engine (zero3_compiles_layers), but
    not with parameters offloaded to the host: there it is refused in one line, and zero3_compiles_layers says no.
    An offload_param device "none" is no offload. [fails if: the offload condition is dropped]"""
    from engine.ds_config import zero3_compiles_layers

    r = tiny(**{"train.compile": True})
    cfg = resolve_ds_config(read_ds_config(ZERO3), r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch())
    assert zero3_compiles_layers(cfg)
    for device, ok in (("none", True), ("cpu", False)):
        raw = read_ds_config(ZERO3)
        raw["zero_optimization"]["offload_param"] = {"device": device}
        if ok:
            cfg = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch())
            assert zero3_compiles_layers(cfg)
            continue
        assert "train.compile: true needs" in _refused(raw, r)
        cfg = resolve_ds_config(raw, tiny(), world_size=1, ranks_per_node=1, auto_batch=AutoBatch())  # compile auto
        assert cfg["zero_optimization"]["leaf_module"]["names"] and not zero3_compiles_layers(cfg)


@pytest.mark.parametrize("size", [0, -2])
def test_an_autoep_size_below_1_is_one_line(size):
    """autoep_size 0 or negative is refused naming the key, not a ZeroDivisionError, and -2 (which divides 8 experts
    and 2 ranks as an integer) is not taken. [fails if: the bound is `size < 0`]"""
    raw = read_ds_config(ZERO2)
    raw["expert_parallel"]["autoep_size"] = size
    assert f'expert_parallel.autoep_size ({size}) must be a positive integer or "auto"' in _refused(raw, world=2)


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"zero2"'])
def test_a_ds_config_that_is_not_a_json_object_is_one_line(text, tmp_path):
    """Valid JSON that is not an object at the top level is a ConfigError naming the file, before anything reads it
    as a dict. [fails if: read_ds_config returns it]"""
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"ds.json: expected a JSON object at the top level"):
        read_ds_config(path)


def test_misspellings_of_deepspeeds_own_top_level_keys_are_named_too():
    """The known keys include those of deepspeed.runtime.constants that the engine's list leaves out (e.g.
    gradient_allreduce_op, disable_python_gc): written right they pass, misspelled they are named.
    [fails if: only the engine's own list is known]"""
    assert misspelled_keys({"gradient_allreduce_op": "mean", "disable_python_gc": True}) == []
    [line] = misspelled_keys({"gradient_allreduce_opp": "mean"})
    assert line.endswith("did you mean gradient_allreduce_op?"), line


@pytest.mark.parametrize("section, value", [("expert_parallel", {"comm_backend": "deepep",
                                                                   "comm_max_tokens_per_rank": 4096}),
                                            ("expert_parallel", {"expert_tensor_parallel_size": 2}),
                                            ("tensor_parallel", {"autotp_size": 2})])
def test_the_fused_combine_kernel_is_not_filled_in_where_deepspeed_refuses_it(section, value):
    """combine_impl left to the engine takes AutoEP's fused kernel on CUDA, but not with DeepEP across ranks, expert
    tensor parallelism or folded tensor parallelism, which DeepSpeed's own check refuses with the kernel (telling the
    user to leave combine_impl unset, which they did): the resolved section passes that check on 2 CUDA ranks.
    [fails if: fused_weighted_sum is filled in whatever the rest of the file says]"""
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config

    raw = read_ds_config(ZERO2)
    raw[section] = {**raw.get(section, {}), **value}
    cfg = resolve_ds_config(raw, tiny(), world_size=2, ranks_per_node=2, device="cuda", auto_batch=AutoBatch())
    ep = cfg["expert_parallel"]
    assert ep["autoep_size"] == 2 and ep["combine_impl"] == "weighted_sum"
    tp = (cfg.get("tensor_parallel") or {}).get("autotp_size", 1)
    try:
        validate_autoep_config(parse_autoep_config(ep), 2, 1, tp, 1)
    except ValueError as e:  # only what concerns the combine is the engine's to fill in (ETP 2 on 2 ranks folds not)
        assert "combine_impl" not in str(e), e
    with pytest.raises(ValueError, match="fused_weighted_sum"):  # what the engine's old choice met
        validate_autoep_config(parse_autoep_config({**ep, "combine_impl": "fused_weighted_sum"}), 2, 1, tp, 1)
    plain = resolve_ds_config(read_ds_config(ZERO2), tiny(), world_size=2, ranks_per_node=2, device="cuda",
                              auto_batch=AutoBatch())
    assert plain["expert_parallel"]["combine_impl"] == "fused_weighted_sum"  # the rest of the time, the kernel

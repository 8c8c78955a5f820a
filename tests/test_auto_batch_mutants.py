"""engine/auto_batch.py's own rules, one a test, each a change to auto_batch.py (a mutant) that every other fast test
let through: the parameter count of a model.init_from directory, the bytes per parameter of fp16 and fp32 models, what
a null offload device, offload_param and stage 0 do to the states, the MoE width and the expert-parallel, Gated
DeltaNet and head terms where they do not scale, the fixed overhead of each stage and of a missing accumulation key,
the host memory of offloaded parameters (and /proc/meminfo), the device memory's fraction and LOCAL_RANK, the resume
rules (a recorded accumulation, the checkpointing decided at the checkpoint's micro-batch, "none" where nothing fits),
the accumulation a fit assumes, the refusal's figures, the CPU's fixed values even with a memory given, and GRPO's
candidates, token edge and CPU line. Then the bugs it found (fixed since): a traceback instead of the DS config's
one-line refusal, the refusal's fixes where activations (not states) overflow, the host-memory line for offload_param
alone, and a stage written 3.0.

No launcher, no GPU: the device memory is a parameter (AutoBatch.memory_gib), torch's device query is faked, and
/proc/meminfo is replaced by a string. Expectations are literal values or worked out in the docstrings. The bracket at
the end of a docstring says which mutant the test kills."""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

import engine.auto_batch as ab
from engine.auto_batch import (FIXED_GIB, GIB, AutoBatch, GRPOAutoBatch, fixed_gib, param_counts, predict_peak_gib,
                               settle_checkpointing, states_gib, with_checkpointing)
from engine.config import RECIPES, ConfigError, ModelConfig, load_recipe
from engine.ds_config import read_ds_config, resolve_ds_config

ROOT = Path(__file__).resolve().parent.parent
ZERO2, ZERO3 = ROOT / "ds_configs" / "zero2.json", ROOT / "ds_configs" / "zero3.json"
H200, H200_AT_80GB, H100 = 140.4, 0.5596 * 140.4, 79.2
BF16 = {"enabled": True}


def tiny(**overrides):
    """The default recipe: deepseek_v3, hidden 64, 2 layers, top-2 of 8 experts of width 64 + 1 shared, vocabulary
    512, seq 128; 321,920 parameters of which 196,608 are routed experts."""
    return load_recipe(None, overrides or None)


def recipe(name, **overrides):
    return load_recipe(RECIPES / f"{name}.yaml", {"model.vocab_size": 512, **overrides})


def resolve(ds, r, memory=None, device="cuda", world=1, recorded=None):
    raw = read_ds_config(ds) if not isinstance(ds, dict) else ds
    auto = AutoBatch(memory_gib=memory, recorded=recorded)
    cfg = resolve_ds_config(raw, r, world_size=world, ranks_per_node=min(world, 8), device=device, auto_batch=auto)
    return cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], auto


# ---------------------------------------------------------------------------------------------- parameter counts


def test_an_init_from_directory_is_counted_as_built_with_its_experts_only(tmp_path):
    """model.init_from: the directory's own config is built on the meta device, whatever the ModelConfig's fields
    say (here: tied embeddings, 3 layers, the first dense), and the routed experts are the ".experts." parameters,
    not the shared experts: 180,720 parameters, 98,304 routed (2 MoE layers x 8 experts x 3 x 64 x 32; the analytic
    count of the ModelConfig's own fields would be 321,920 / 196,608, and "experts" anywhere in a name 110,592).
    [fails if: init_from no longer forces the built count, or _built_counts matches "experts" without the dots]"""
    from transformers import DeepseekV3Config

    DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                     n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                     q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                     topk_group=1, tie_word_embeddings=True, max_position_embeddings=256).save_pretrained(tmp_path)
    assert param_counts(ModelConfig(init_from=str(tmp_path))) == (180_720, 98_304)


# ---------------------------------------------------------------------------------------------- bytes per parameter


def test_fp16_and_fp32_models_count_their_own_bytes_per_parameter():
    """fp16 is a half model like bf16: 2-byte weights and gradients, fp32 master + two fp32 moments (12). An fp32
    model (no bf16/fp16 section): 4-byte weights and gradients, the weights are the master (0) + moments 8; 16 bytes
    a parameter either way. [fails if: fp16.enabled is not read, weights or gradients are always 2 bytes, or an fp32
    model gets a master copy]"""
    assert ab._bytes_per_param({"fp16": {"enabled": True}}) == (2, 2, 12)
    assert ab._bytes_per_param({}) == (4, 4, 8)
    assert ab._bytes_per_param({"bf16": {"enabled": False}, "fp16": {"enabled": False}}) == (4, 4, 8)


def test_a_null_offload_device_is_no_offload():
    """"device": null is no offload, as engine/ds_config.py reads it (offload in (None, "none")): the states are
    those of the same file without the section. [fails if: _offload only takes the string "none" as no offload]"""
    r = tiny()
    base = {"bf16": BF16, "zero_optimization": {"stage": 3}}
    null = {"bf16": BF16, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": None},
                                                "offload_param": {"device": None}}}
    assert ab._offload(null, "offload_optimizer") is None and ab._offload(null, "offload_param") is None
    assert states_gib(null, r, 1) == states_gib(base, r, 1) == 321_920 * 16 / GIB


def test_zero3_offload_param_leaves_no_weights_on_the_device_but_zero2_keeps_them():
    """ZeRO-3 with offload_param "cpu": the weights live in host memory, the device holds gradients (2) and optimizer
    (12) of its 1/dp share: 321,920 x 14 / 2 bytes on 2 ranks. ZeRO-2 has no parameter offload: its weights stay
    (2 x 321,920 unpartitioned). [fails if: the weights = 0 rule for offloaded parameters is dropped]"""
    r = tiny()
    z3 = {"bf16": BF16, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert states_gib(z3, r, 2) == pytest.approx(321_920 * 14 / 2 / GIB, rel=1e-12)
    z2 = {"bf16": BF16, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    assert states_gib(z2, r, 2) == pytest.approx((2 * 321_920 + 14 * 321_920 / 2) / GIB, rel=1e-12)


def test_stage_0_keeps_the_expert_parallel_share_of_the_optimizer():
    """No ZeRO (stage 0): nothing is partitioned over the data-parallel ranks, but each rank holds only its
    autoep_size share of the routed experts, optimizer state included: 16 x (321,920 - 196,608 + 196,608 / 2)
    bytes. [fails if: stage 0's optimizer counts the whole model instead of the rank's local share]"""
    cfg = {"bf16": BF16, "zero_optimization": {"stage": 0}, "expert_parallel": {"enabled": True, "autoep_size": 2}}
    assert states_gib(cfg, tiny(), 2) == pytest.approx(16 * (321_920 - 196_608 + 98_304) / GIB, rel=1e-12)


def test_expert_parallel_counts_only_where_it_is_enabled():
    """An expert_parallel section with "enabled": false and autoep_size 2 splits nothing: the same states and the
    same activations as without the section. [fails if: _ep takes autoep_size without uses_expert_parallel]"""
    r = tiny()
    off = {"bf16": BF16, "zero_optimization": {"stage": 2}, "expert_parallel": {"enabled": False, "autoep_size": 2}}
    plain = {"bf16": BF16, "zero_optimization": {"stage": 2}}
    assert ab._ep(off) == 1
    assert states_gib(off, r, 2) == states_gib(plain, r, 2)
    assert ab.per_sample_gib(off, r, "cuda") == ab.per_sample_gib(plain, r, "cuda")


# ---------------------------------------------------------------------------------------------- per sample and head


def test_the_moe_width_counts_each_familys_shared_experts_at_three_expert_widths():
    """Per token, in hidden sizes: top-k x (2 x hidden + 3 x expert width) + shared x 3 x expert width.
    deepseek_2b6 (top-4 of 1024 + 2 shared, hidden 2048): (4 x 7168 + 6144) / 2048 = 17.0, the calibrated width;
    DeepSeek-V2-Lite's shape (top-6 of 1408 + 2 shared): (6 x 8320 + 8448) / 2048 = 28.5; Mixtral (top-2 of 14336,
    hidden 4096, no shared expert): 2 x 51200 / 4096 = 25.0. [fails if: the shared experts count 2 widths, or
    deepseek_v2's shared experts are left out]"""
    assert ab.moe_width(recipe("deepseek_2b6").model) == 17.0
    assert ab.moe_width(recipe("deepseek_v2_lite_l8").model) == 28.5
    assert ab.moe_width(recipe("mixtral_8x7b_l3").model) == 25.0


def test_expert_parallel_buffers_scale_with_top_k():
    """autoep_size 2 adds EP_EXTRA_PER_K = 11.925 bytes per (token x hidden x layer) per routed copy: tiny's top-2
    adds 128 x 64 x 2 layers x 23.85 bytes a sample over autoep_size 1 (the same family otherwise). [fails if: the
    extra is taken at the calibration's top-4 whatever the model's k]"""
    r = tiny()
    ep = lambda size: {"bf16": BF16, "zero_optimization": {"stage": 3},  # noqa: E731
                       "expert_parallel": {"enabled": True, "autoep_size": size}}
    extra = ab.per_sample_gib(ep(2), r, "cpu") - ab.per_sample_gib(ep(1), r, "cpu")
    assert extra == pytest.approx(128 * 64 * 2 * 47.7 / 4 * 2 / GIB, rel=1e-9)


def test_a_narrow_gated_deltanet_layer_adds_nothing_rather_than_less(monkeypatch):
    """The Gated DeltaNet term is what such a layer keeps beyond the calibration's attention (36.1 bytes per token x
    hidden), never below it: value width 8 at hidden 64 (218 x 8 < 36.1 x 64) adds 0, not a negative amount.
    [fails if: the max(0, ...) around the term is dropped]"""
    cfg = {"bf16": BF16, "zero_optimization": {"stage": 2}}
    r = tiny(**{"train.activation_checkpointing": False})
    monkeypatch.setattr(ab, "linear_attention", lambda m: (0, 0))
    plain = ab.per_sample_gib(cfg, r, "cuda")
    monkeypatch.setattr(ab, "linear_attention", lambda m: (3, 8))
    assert ab.per_sample_gib(cfg, r, "cuda") == plain


def test_a_vocabulary_below_the_calibrations_is_not_credited():
    """The head term is what a vocabulary adds beyond the calibration rows' 512; a smaller one (256) takes nothing
    off: 0.0, so the peak is the vocabulary-512 peak minus nothing. [fails if: the max(0, ...) is dropped and a small
    vocabulary lowers the prediction]"""
    assert ab.head_gib(tiny(**{"model.vocab_size": 256}), 8) == 0.0
    assert ab.head_gib(tiny(), 8) == 0.0


# ---------------------------------------------------------------------------------------------- fixed overhead


def test_the_fixed_overhead_of_each_stage_is_as_documented():
    """docs/configs.md: 1.06 GiB under ZeRO-3, 5.40 under ZeRO-1/2 (stage 0 as 1/2), 1.35 under ZeRO-2 with an
    integer accumulation of 1; ZeRO-1 keeps 5.40 at accumulation 1, and True (a bool, not the number 1) is not 1.
    [fails if: ZeRO-1 or stage 0 take another constant, or True counts as one micro-batch per step]"""
    st = lambda s: {"bf16": BF16, "zero_optimization": {"stage": s}}  # noqa: E731
    assert fixed_gib(st(1), 1) == fixed_gib(st(1), 4) == 5.40
    assert fixed_gib(st(0), 1) == fixed_gib({}, 2) == 5.40
    assert fixed_gib(st(3), 1) == 1.06
    assert fixed_gib(st(2), 1) == 1.35 and fixed_gib(st(2), True) == FIXED_GIB[2] == 5.40


def test_a_missing_accumulation_key_is_deepspeeds_1_in_the_prediction():
    """predict_peak_gib without accum reads the DS config's number, and a file without gradient_accumulation_steps
    is DeepSpeed's 1: under ZeRO-2 the 1.35 GiB overhead, 4.05 GiB under the same file at accumulation 2.
    [fails if: the missing key is read as "auto"]"""
    r = tiny()
    cfg = {"bf16": BF16, "zero_optimization": {"stage": 2}}
    assert predict_peak_gib(cfg, r, 1, 8) == pytest.approx(predict_peak_gib(cfg, r, 1, 8, accum=2) - 4.05)


def test_a_stage_outside_1_to_3_is_the_ds_configs_line_not_a_traceback():
    """With "auto" on a GPU the memory model runs before the refusals are raised: a stage of 4 or "3" still gives the
    DS config's one line. [fails if: fixed_gib stops capping the stage at 3, or _stage returns a non-integer]"""
    for stage in (4, "3"):
        raw = read_ds_config(ZERO3)
        raw["zero_optimization"]["stage"] = stage
        with pytest.raises(ConfigError) as e:
            resolve(raw, tiny(), memory=80.0)
        assert str(e.value) == f"DeepSpeed config: zero_optimization.stage ({stage!r}) must be 1, 2 or 3"


# ---------------------------------------------------------------------------------------------- host and device


def test_offloaded_parameters_count_in_host_memory_per_rank():
    """offload_param "cpu" keeps each rank's 1/dp share of the weights in the model's dtype in host memory: 2 bytes
    x 321,920 / 2 on 2 ranks; with offload_optimizer too, 16 bytes of optimizer on top. An NVMe offload is not host
    memory: 0. [fails if: offload_param is not counted, not split over dp, or "nvme" is counted as host memory]"""
    r = tiny()
    z = lambda **sections: {"bf16": BF16, "zero_optimization": {"stage": 3, **sections}}  # noqa: E731
    assert ab.host_offload_gib(z(offload_param={"device": "cpu"}), r, 2) == pytest.approx(321_920 / GIB)
    both = z(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    assert ab.host_offload_gib(both, r, 2) == pytest.approx(18 * 321_920 / 2 / GIB)
    assert ab.host_offload_gib(z(offload_param={"device": "nvme"}, offload_optimizer={"device": "nvme"}), r, 1) == 0.0


def test_host_memory_is_memavailable_in_kib(monkeypatch):
    """/proc/meminfo gives kB: MemAvailable 3145728 kB is 3.0 GiB (MemFree, listed first, is not what is
    available). [fails if: the kB are read as bytes, or MemFree is read]"""
    text = "MemTotal:       8388608 kB\nMemFree:        1048576 kB\nMemAvailable:   3145728 kB\n"
    monkeypatch.setattr(ab, "open", lambda path, *a, **k: io.StringIO(text), raising=False)
    assert ab.host_available_gib() == 3.0


def test_offload_exactly_at_the_available_memory_fits(monkeypatch):
    """zero3_offload.json (half of the 16-byte optimizer on the host): needing exactly what is available is no
    problem; 0.1 GiB less available is the line. [fails if: need <= have becomes need < have]"""
    r = recipe("deepseek_2b6")
    cfg = read_ds_config(ROOT / "ds_configs" / "zero3_offload.json")
    need = ab.host_offload_gib(cfg, r, 1)
    assert need == pytest.approx(2_590_255_104 * 8 / GIB)
    monkeypatch.setattr(ab, "host_available_gib", lambda: need)
    assert ab.host_memory_problem(cfg, r, 1, 1) is None
    monkeypatch.setattr(ab, "host_available_gib", lambda: need - 0.1)
    assert ab.host_memory_problem(cfg, r, 1, 1).startswith("zero_optimization offload: the 1 rank of this node")


def test_device_memory_is_local_ranks_times_the_fraction(monkeypatch):
    """The memory of GPU LOCAL_RANK (3 here), times --memory_fraction: 80 GiB x 0.5 = 40.0; without a fraction 80.0.
    [fails if: the fraction is ignored, or device 0 is always asked]"""
    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: asked.append(i) or SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert ab.device_memory_gib("cuda", 0.5) == 40.0
    assert ab.device_memory_gib("cuda") == 80.0
    assert asked == [3, 3] and ab.device_memory_gib("cpu", 0.5) is None


# ---------------------------------------------------------------------------------------------- resolve and resume


def test_a_recorded_accumulation_wins_over_autos_and_says_so():
    """--resume of a 16 x 8 run on an H200 where "auto" would pick 16 x 4: the checkpoint's 8 is kept and the line says
    what auto would have picked. [fails if: the recorded accumulation is dropped for auto's]"""
    micro, accum, auto = resolve(ZERO2, recipe("deepseek_2b6"), H200, recorded={"micro_batch": 16, "grad_accum": 8})
    assert (micro, accum) == (16, 8)
    assert ("accumulation 8: the checkpoint's, kept for an exact resume; auto would pick 4 here: 64 x 2048 tokens per "
            "step per GPU (default) / (16 x 2048)") in auto.note


def test_a_resume_where_nothing_fits_afresh_says_auto_would_pick_none():
    """deepseek_5b3 under zero3.json at 80 GB fits no micro-batch afresh; the checkpoint's 2 x 32 is kept and the line
    says "auto would pick none here", then the refusal it would have given. [fails if: the line names micro-batch 1
    (fit_micro's placeholder) as auto's pick]"""
    micro, accum, auto = resolve(ZERO3, recipe("deepseek_5b3"), H200_AT_80GB,
                                 recorded={"micro_batch": 2, "grad_accum": 32})
    assert (micro, accum) == (2, 32)
    assert ('micro-batch 2: the checkpoint\'s, kept for an exact resume; auto would pick none here: '
            'train_micro_batch_size_per_gpu "auto": nothing fits this device: predicted peak 81.2 GiB at micro-batch 1'
            ) in auto.note


def test_a_zero_micro_batch_with_auto_accumulation_on_a_gpu_is_one_line():
    """Micro-batch 0 written beside an "auto" accumulation on a GPU: the batch-size line, not a ZeroDivisionError
    from dividing the token target by it. [fails if: resolve stops returning before pick_accum for micro < 1]"""
    raw = {**read_ds_config(ZERO3), "train_micro_batch_size_per_gpu": 0}
    with pytest.raises(ConfigError) as e:
        resolve(raw, tiny(), memory=80.0)
    assert str(e.value) == ('DeepSpeed config: train_micro_batch_size_per_gpu (0) must be a positive integer or '
                            '"auto"')


def test_the_fit_assumes_the_files_own_accumulation():
    """zero2.json with gradient_accumulation_steps 1 written and the micro-batch "auto" on an H200: the fit predicts
    16 at that accumulation (1.35 GiB overhead: 84.4 GiB), not at the 4 auto would give it (88.4); 32 would need
    128.8. [fails if: accum_at ignores the file's number]"""
    raw = {**read_ds_config(ZERO2), "gradient_accumulation_steps": 1}
    micro, accum, auto = resolve(raw, recipe("deepseek_2b6"), H200)
    assert (micro, accum) == (16, 1)
    assert auto.note == ('batch: micro-batch 16 x 1 accumulation per GPU ("auto": micro-batch 16: predicted peak 84.4 '
                         "GiB of 125.4 GiB usable (90% of 140.4 GiB less 1 GiB); 32 would need 128.8)")


def test_accum_at_takes_the_recorded_accumulation_at_the_recorded_micro_batch_only():
    """On --resume of a 16 x 1 run: at micro-batch 16 a fit assumes the checkpoint's 1, at 8 auto's own 64 / 8 = 8.
    [fails if: the recorded accumulation is ignored, or taken at any micro-batch]"""
    a = AutoBatch(memory_gib=H200, recorded={"micro_batch": 16, "grad_accum": 1})
    raw, r = read_ds_config(ZERO2), recipe("deepseek_2b6")
    assert a.accum_at(raw, r, 16, "cuda") == 1
    assert a.accum_at(raw, r, 8, "cuda") == 8


class _Table(AutoBatch):
    """Predicted peak from a table: {checkpointing on?: {micro: GiB}}, whatever the config."""
    table: dict | None = None

    def peak_gib(self, cfg, recipe, dp, micro, device):
        return self.table[recipe.train.activation_checkpointing is True][micro]


USABLE_10 = 11.0 / 0.9  # usable memory 10.0 GiB (90% less 1 GiB); the line shows 12.2


def test_resume_checkpointing_is_off_where_the_recorded_micro_batch_fits_exactly_without_it():
    """--resume at the checkpoint's micro-batch 8 with activation checkpointing "auto": 8 predicted at exactly the
    usable 10.0 GiB without it fits, so it stays off. [fails if: without > usable becomes >=]"""
    a = _Table(memory_gib=USABLE_10, recorded={"micro_batch": 8, "grad_accum": 2})
    a.table = {False: {m: 10.0 if m == 8 else 5.0 if m < 8 else 20.0 for m in ab.CANDIDATES},
               True: {m: 4.0 if m <= 16 else 11.0 for m in ab.CANDIDATES}}
    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto"}
    assert a.resolve(cfg, tiny(), 1, "cuda") == []
    assert cfg["train_micro_batch_size_per_gpu"] == 8 and a.checkpointing is False
    assert a.note.endswith("; activation checkpointing off at micro-batch 8")


def test_resume_keeps_an_explicit_checkpointing_setting():
    """train.activation_checkpointing true or false in the recipe is kept on --resume: deepseek_2b6 under zero3.json
    on an 80 GB card, true at the checkpoint's 4 (which fits without it) stays on, false at 32 (which does not) stays
    off, and the line adds nothing about it. [fails if: the resume rule runs for a setting other than "auto"]"""
    for on, rec in ((True, {"micro_batch": 4, "grad_accum": 16}), (False, {"micro_batch": 32, "grad_accum": 2})):
        r = load_recipe(RECIPES / "deepseek_2b6.yaml", {"train.activation_checkpointing": on})
        micro, _, auto = resolve(ZERO3, r, H100, recorded=rec)
        assert micro == rec["micro_batch"] and auto.checkpointing is on
        assert "activation checkpointing" not in auto.note
        assert settle_checkpointing(r, auto).train.activation_checkpointing is on


def test_settle_keeps_an_explicit_checkpointing_setting():
    """settle_checkpointing replaces only "auto": true stays true with no AutoBatch, false stays false whatever an
    AutoBatch chose. [fails if: true/false are replaced by the AutoBatch's choice]"""
    on, off = with_checkpointing(tiny(), True), with_checkpointing(tiny(), False)
    assert settle_checkpointing(on, None).train.activation_checkpointing is True
    chose = AutoBatch()
    chose.checkpointing = True
    assert settle_checkpointing(off, chose).train.activation_checkpointing is False
    assert settle_checkpointing(tiny(), chose).train.activation_checkpointing is True


def test_checkpointing_taken_for_one_row_says_so_with_the_peak_it_runs_at():
    """Pretraining under ZeRO-3, "auto": without checkpointing only 1 row fits (128 tokens < 16,384), with it 8 (at
    least 4x): on, and the line gives the peak with it (9.5 GiB at 8; 16 would need 11.0) and "1 row" (singular).
    [fails if: the line gives the peak without checkpointing, or says "1 rows"]"""
    a = _Table(memory_gib=USABLE_10)
    a.table = {False: {m: 9.0 if m == 1 else 30.0 for m in ab.CANDIDATES},
               True: {m: 9.5 if m <= 8 else 11.0 for m in ab.CANDIDATES}}
    micro, why, problem = a.pick_micro({"zero_optimization": {"stage": 3}}, tiny(), 1, "cuda")
    assert (micro, problem, a.checkpointing) == (8, None, True)
    assert why == ('predicted peak 9.5 GiB of 10.0 GiB usable (90% of 12.2 GiB less 1 GiB); 16 would need 11.0; '
                   'activation checkpointing on ("auto": 1 row without it)')


def test_the_refusal_gives_the_states_per_rank_on_its_data_parallel_ranks():
    """deepseek_5b3 under zero3.json on 2 ranks of 30 GiB: the refusal gives the states of one rank's 1/2 share
    (39.8 GiB, half of the 79.6 one rank holds) and says "2 data-parallel ranks". [fails if: the states are those of
    one rank]"""
    r = recipe("deepseek_5b3")
    cfg = read_ds_config(ZERO3)
    cfg["expert_parallel"]["autoep_size"] = 1
    micro, why, problem = AutoBatch(memory_gib=30.0).fit_micro(cfg, r, 2, "cuda")
    assert f"{states_gib(cfg, r, 2):.1f}" == "39.8"
    assert "(weights, gradients and optimizer state alone 39.8 GiB per rank on 2 data-parallel ranks)" in problem


def test_the_cpu_keeps_its_fixed_values_even_with_a_memory_given():
    """device "cpu" with a memory_gib (as bench and the tests pass one): still the CPU's 8 x 1, not a fit to the
    memory. [fails if: sized() or fit_micro look only at memory_gib]"""
    micro, accum, auto = resolve(ZERO3, tiny(), memory=80.0, device="cpu")
    assert (micro, accum) == (8, 1)
    assert auto.note == ('batch: micro-batch 8 x 1 accumulation per GPU ("auto": micro-batch 8: the CPU\'s fixed '
                         "value; accumulation 1: the CPU's fixed value)")


# ---------------------------------------------------------------------------------------------- GRPO


def test_grpo_rows_longer_than_the_token_cap_still_have_micro_batch_1():
    """Rows of 70,000 tokens are over 32 x 2048 even one at a time: 1 stays a candidate (the only one), on the CPU
    too. [fails if: the `or m == 1` exception is dropped (no candidate at all)]"""
    a = GRPOAutoBatch(sequences=64, seq_len=70_000, what="test")
    assert a.candidates() == (1,)
    assert a.cpu_micro()[0] == 1


def test_grpo_checkpointing_needs_fewer_than_4096_tokens_without_it():
    """GRPO's rule is strictly fewer than CKPT_BELOW_TOKENS: 16 rows of 256 tokens (4096) do not pay, 15 (3840) do.
    [fails if: < becomes <=]"""
    a = GRPOAutoBatch(sequences=64, seq_len=256, what="test")
    assert not a.checkpointing_pays({}, tiny(), 16, 64)
    assert a.checkpointing_pays({}, tiny(), 15, 60)


def test_grpo_on_the_cpu_prints_the_documented_line():
    """docs/configs.md's CPU line for GRPO, word for word: no "rows of up to ... tokens" prefix, which is for a
    sized device. [fails if: the GPU prefix is added on the CPU]"""
    a = GRPOAutoBatch(sequences=64, seq_len=64, what="8 prompts x 8 completions; default: 64 // 8 prompts")
    assert a.resolve(read_ds_config(ZERO3), tiny(), 1, "cpu") == []
    assert a.note == ('batch: micro-batch 16 x 4 accumulation per GPU ("auto": micro-batch 16: the CPU\'s: the largest '
                      "power of 2 up to 16 dividing it; accumulation 4: 64 sequences per step per GPU (8 prompts x 8 "
                      "completions; default: 64 // 8 prompts) / 16)")


# ---------------------------------------------------------------------------------------------- bugs


def test_a_negative_stage_with_auto_on_a_gpu_is_the_ds_configs_line():
    """zero_optimization.stage -1 with "auto" batch values on a GPU: resolve_ds_config has found the stage line
    already, but the memory model runs first and min(-1, 3) indexes FIXED_GIB[-1]."""
    raw = read_ds_config(ZERO3)
    raw["zero_optimization"]["stage"] = -1
    with pytest.raises(ConfigError) as e:
        resolve(raw, tiny(), memory=80.0)
    assert str(e.value) == "DeepSpeed config: zero_optimization.stage (-1) must be 1, 2 or 3"


@pytest.mark.parametrize("ratio", ["half", None])
def test_a_bad_offload_ratio_with_auto_on_a_gpu_is_the_ds_configs_line(ratio):
    """offload_optimizer.ratio "half" or null: resolve_optimizer has a one-line refusal for it, but with "auto" batch
    values on a GPU the memory model's float(ratio) raises first."""
    raw = read_ds_config(ROOT / "ds_configs" / "zero3_offload.json")
    raw["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
    with pytest.raises(ConfigError) as e:
        resolve(raw, tiny(), memory=80.0)
    assert f"zero_optimization.offload_optimizer.ratio ({ratio!r}) must be a number from 0 to 1" in str(e.value)


def test_a_refusal_caused_by_activations_names_checkpointing_or_a_shorter_sequence():
    """deepseek_2b6 at seq 65,536 with activation checkpointing false on an 80 GB card: the states alone are 46.5 of
    70.3 usable GiB; micro-batch 1's activations (~94 GiB) are what overflows. More GPUs, bf16 states or offload cannot
    make it fit (on 8 GPUs the states are 5.8 GiB and the peak 171 GiB); activation checkpointing does (its "auto"
    fits here), as would a shorter data.seq_len. The line should name them."""
    r = load_recipe(RECIPES / "deepseek_2b6.yaml", {"data.seq_len": 65536, "model.max_position_embeddings": 65536,
                                                    "train.activation_checkpointing": False})
    with pytest.raises(ConfigError) as e:
        resolve(ZERO3, r, H100)
    assert "alone 46.5 GiB per rank" in str(e.value)
    assert "activation_checkpointing" in str(e.value) or "seq_len" in str(e.value), str(e.value)
    assert resolve(ZERO3, with_checkpointing(r, "auto"), H100)[2].checkpointing is True  # the fix that works


def test_the_host_memory_line_for_offloaded_parameters_names_their_fix(monkeypatch):
    """zero3.json with offload_param "cpu" and no optimizer offload: the host keeps the bf16 weights (2 bytes a
    parameter, 10.9 GiB for deepseek_5b3), not "fp32 master weights, gradients and Adam moments", and lowering
    offload_optimizer.ratio cannot help."""
    r = load_recipe(RECIPES / "deepseek_5b3.yaml")
    cfg = read_ds_config(ZERO3)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    assert ab.host_offload_gib(cfg, r, 1) == pytest.approx(param_counts(r.model)[0] * 2 / GIB)
    monkeypatch.setattr(ab, "host_available_gib", lambda: 5.0)
    line = ab.host_memory_problem(cfg, r, 1, 1)
    assert line.startswith("zero_optimization offload: the 1 rank of this node would keep 10.9 GiB")
    assert "offload_optimizer.ratio" not in line and "Adam moments" not in line, line


def test_a_stage_written_as_a_float_is_predicted_as_that_stage():
    """"stage": 3.0 passes resolve_ds_config's check (3.0 in (1, 2, 3)) and DeepSpeed runs ZeRO-3, but the memory
    model counts it as no ZeRO: deepseek_5b3 on 8 ranks predicts 58.9 GiB instead of ZeRO-3's 38.4 at 32 x 2."""
    r = recipe("deepseek_5b3")
    z3 = read_ds_config(ZERO3)
    z3["expert_parallel"]["autoep_size"] = 1
    as_float = {**z3, "zero_optimization": {**z3["zero_optimization"], "stage": 3.0}}
    assert predict_peak_gib(as_float, r, 8, 32) == pytest.approx(predict_peak_gib(z3, r, 8, 32))

"""Unit tests of engine/parallel.py's small rules, in this process and without a process group: the world read from
the launcher's environment, the model dtype, the LR schedule's decay length, which ZeRO optimizers lose their
per-tensor overflow check, the autoep_size=1 log filter, when parameter-free functions are compiled, the stochastic
rounding optimizer built from the DS config, the CPU shared-memory op skip and the two ignored torch deprecations."""
import logging
import os
import warnings
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from engine import parallel


@pytest.fixture
def launcher_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # so that monkeypatch restores (or removes) what init_distributed writes
        monkeypatch.delenv(key)
    return monkeypatch


def test_world_from_env_reads_rank_size_and_ranks_per_node(launcher_env):
    """RANK is the global rank (not LOCAL_RANK); LOCAL_SIZE wins over torchrun's LOCAL_WORLD_SIZE; with neither, all
    ranks are on one node. [fails if: rank comes from LOCAL_RANK, LOCAL_WORLD_SIZE wins, or local_size defaults to 1]"""
    launcher_env.setenv("RANK", "5")
    launcher_env.setenv("LOCAL_RANK", "1")
    launcher_env.setenv("WORLD_SIZE", "8")
    assert parallel.world_from_env() == parallel.World(rank=5, size=8, local_size=8)
    launcher_env.setenv("LOCAL_WORLD_SIZE", "4")
    assert parallel.world_from_env().local_size == 4
    launcher_env.setenv("LOCAL_SIZE", "2")
    assert parallel.world_from_env().local_size == 2


def test_world_from_env_without_a_launcher_is_a_world_of_one(launcher_env):
    """A plain `python` run. [fails if: the defaults for RANK/WORLD_SIZE change]"""
    assert parallel.world_from_env() == parallel.World(rank=0, size=1, local_size=1)


@pytest.mark.parametrize("ds, expect", [
    ({"bf16": {"enabled": True}}, torch.bfloat16),
    ({"fp16": {"enabled": True}}, torch.float16),
    ({"bf16": {"enabled": False}, "fp16": None}, torch.float32),
    ({}, torch.float32),
])
def test_model_dtype_follows_the_enabled_precision_section(ds, expect):
    """[fails if: an enabled bf16 section is not read as bfloat16]"""
    assert parallel.model_dtype(ds) == expect


def test_lr_schedule_decays_over_decay_steps_when_set():
    """A resumed run keeps its saved schedule's length (train.decay_steps), not train.max_steps.
    [fails if: lr_multiplier ignores train.decay_steps]"""
    train = SimpleNamespace(warmup_steps=2, decay_steps=10, max_steps=100, min_lr_ratio=0.1)
    f = parallel.lr_multiplier(train)
    assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert parallel.lr_multiplier(SimpleNamespace(**{**vars(train), "decay_steps": None}))(10) > 0.5


def test_lr_warmup_ends_at_one_then_the_cosine_starts_from_one():
    """Warmup steps 0..w-1 give 1/w..1; step w is the cosine's start (1.0); `total` is where the floor is reached.
    [fails if: the warmup/cosine boundary, the ramp's offset or the cosine's length changes]"""
    f = parallel.warmup_cosine(warmup=4, total=8, min_ratio=0.0)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and f(6) == pytest.approx(0.5) and f(8) == pytest.approx(0.0) and f(20) == pytest.approx(0.0)


def _zero_optimizer(**overrides):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
    attrs = dict(cpu_offload=False, zenflow=False, compute_grad_norm=True, dtype=torch.float32,
                 check_grad_overflow=True, overflow=True)
    for key, value in {**attrs, **overrides}.items():
        object.__setattr__(opt, key, value)
    return opt


@pytest.mark.parametrize("overrides, dropped", [
    ({}, True),
    ({"dtype": torch.bfloat16}, True),
    ({"dtype": torch.float16, "check_grad_overflow": False}, True),  # the check off only counts for bf16
    ({"cpu_offload": True}, False),
    ({"zenflow": True}, False),
    ({"compute_grad_norm": False}, False),
    ({"dtype": torch.bfloat16, "check_grad_overflow": False}, False),
])
def test_one_overflow_check_only_where_the_global_norm_check_runs(overrides, dropped):
    """The per-tensor check goes only where the global norm's check does the same job; where dropped, check_overflow
    reports no overflow. [fails if: offload, no norm or a non-bf16 check_grad_overflow=False change the answer, or the
    replacement sets overflow]"""
    opt = _zero_optimizer(**overrides)
    assert parallel.one_overflow_check(SimpleNamespace(optimizer=opt)) is dropped
    assert ("check_overflow" in vars(opt)) is dropped
    if dropped:
        opt.check_overflow()
        assert opt.overflow is False


def test_one_overflow_check_leaves_other_optimizers_alone():
    """[fails if: a non-ZeRO-1/2 optimizer is patched]"""
    assert parallel.one_overflow_check(SimpleNamespace(optimizer=torch.optim.SGD([torch.zeros(1)], lr=0.1))) is False
    assert parallel.one_overflow_check(SimpleNamespace()) is False


def _record(message):
    return logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, message, None, None)


@pytest.mark.parametrize("ep, quiet", [
    ({"enabled": True, "autoep_size": 1}, True),
    ({"enabled": True, "autoep_size": 2}, False),
    ({"enabled": False, "autoep_size": 1}, False),
])
def test_autoep_size_one_note_is_dropped_only_inside_and_only_for_size_one(ep, quiet):
    """[fails if: the filter stays on the logger after deepspeed.initialize, or applies to another autoep_size]"""
    from deepspeed.utils import logger

    before = list(logger.filters)
    with parallel.autoep_size_one_is_intended({"expert_parallel": ep}):
        assert bool(logger.filter(_record(parallel.AUTOEP_SIZE_ONE + " more"))) is not quiet
        assert logger.filter(_record("another warning"))
    assert logger.filters == before


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))


LAYER_LEAVES = {"leaf_module": {"names": ["model.layers.0", "model.layers.1"]}}
AUTOEP = {"expert_parallel": {"enabled": True}}


@pytest.mark.parametrize("ds, compile_, lengths_vary, expect", [
    ({"zero_optimization": {"stage": 3}}, "auto", False, True),
    ({"zero_optimization": {"stage": 3}}, True, False, True),
    ({"zero_optimization": {"stage": 3}}, False, False, False),
    ({"zero_optimization": {"stage": 2}}, "auto", False, False),
    ({"zero_optimization": {"stage": 1}}, True, False, False),
    ({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}, "auto", False, False),
    ({"zero_optimization": {"stage": 3, **LAYER_LEAVES}}, True, False, False),  # pretrain.compile_layers instead
    ({"zero_optimization": {"stage": 3, **LAYER_LEAVES}}, "auto", False, True),  # no AutoEP: no whole layers
    ({"zero_optimization": {"stage": 3, **LAYER_LEAVES}, **AUTOEP}, "auto", False, False),  # compile_layers instead
    ({"zero_optimization": {"stage": 3, **LAYER_LEAVES}, **AUTOEP}, "auto", True, False),  # GRPO: layers instead
    ({"zero_optimization": {"stage": 3, **LAYER_LEAVES}}, "auto", True, True),  # GRPO, no AutoEP: no whole layers
    ({"zero_optimization": {"stage": 3}}, True, True, False),  # GRPO's policy with compile: true: whole layers
    ({"zero_optimization": {"stage": 3}}, "auto", True, True),
    ({"zero_optimization": {"stage": 2}}, "auto", True, True),  # GRPO's policy under ZeRO-2: lengths vary
    ({"zero_optimization": {"stage": 1}}, "auto", True, True),
    ({"zero_optimization": {"stage": 2}}, True, True, False),
    ({"zero_optimization": {"stage": 2}}, False, True, False),
    ({"zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}}, "auto", True, False),
])
def test_parameter_free_compile_under_zero3_and_for_grpo_on_cuda(on_cuda, ds, compile_, lengths_vary, expect):
    """[fails if: another ZeRO stage, a pipeline, compile "auto", or GRPO's compile: true changes the answer; GRPO's
    policy under ZeRO 1-2 with compile "auto" compiles nothing; "auto" under ZeRO-3 with AutoEP and layer leaves
    (pretraining's or GRPO's) compiles the parameter-free functions instead of the layers]"""
    assert parallel.compiles_parameter_free(ds, SimpleNamespace(compile=compile_), lengths_vary) is expect


def test_parameter_free_compile_never_off_cuda_or_without_training():
    """[fails if: a CPU run or an optimizer-free engine compiles]"""
    assert parallel.compiles_parameter_free({"zero_optimization": {"stage": 3}}, SimpleNamespace(compile=True)) is False
    assert parallel.compiles_parameter_free({"zero_optimization": {"stage": 3}}, None) is False


def test_stochastic_rounding_optimizer_takes_the_ds_optimizer_params_and_leaves_the_callers_config(monkeypatch):
    """The DS config comes back without its optimizer section (the caller's dict keeps it); AdamWSR gets lr, betas,
    eps and weight_decay from it; ZeRO is told AdamWSR is supported. [fails if: a param is dropped, the caller's config
    is changed or AdamWSR is not added to ZeRO's supported optimizers]"""
    from engine.optim import AdamWSR

    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6,
                                                      "weight_decay": 0.3}}, "zero_optimization": {"stage": 1}}
    from deepspeed.runtime.zero import utils as zero_utils

    monkeypatch.setattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS",
                        [o for o in zero_utils.ZERO_SUPPORTED_OPTIMIZERS if o is not AdamWSR])
    out, make = parallel.stochastic_rounding_optimizer(ds, seed=7)
    assert AdamWSR in zero_utils.ZERO_SUPPORTED_OPTIMIZERS  # else ZeRO refuses it (exact type check)
    assert "optimizer" in ds and "optimizer" not in out and out["zero_optimization"] == {"stage": 1}
    opt = make([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    assert isinstance(opt, AdamWSR) and opt.seed == 7
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.8, 0.9), 1e-6, 0.3)


def test_quick_cpu_info_reports_the_kernels_vendor(monkeypatch):
    """Compared with /proc/cpuinfo itself: tests/test_pretrain.py compares with py-cpuinfo, which an earlier in-process
    run (init_distributed) has already replaced by quick_cpu_info's answer. [fails if: vendor_id_raw is not the
    processor's vendor_id]"""
    import platform
    import sys

    import cpuinfo
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or platform.machine() != "x86_64" or sys.platform != "linux":
        pytest.skip("quick_cpu_info only acts on x86-64 Linux CPU ranks")
    first = open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
    vendor = next(line.split(":", 1)[1].strip() for line in first if line.startswith("vendor_id"))
    flags = next(line.split(":", 1)[1].split() for line in first if line.startswith("flags"))
    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # restored after the test
    parallel.quick_cpu_info()
    info = cpuinfo.get_cpu_info()
    assert (info["vendor_id_raw"], info["arch"], info["bits"], info["flags"]) == (vendor, "X86_64", 64, sorted(flags))


@pytest.mark.parametrize("ds", [{}, {"zero_optimization": None}, {"zero_optimization": {"leaf_module": "auto"}},
                                {"zero_optimization": {"leaf_module": {"names": []}}}])
def test_no_leaf_module_names_is_nothing_to_check(ds):
    """ZeRO-1/2 configs and ZeRO-3 without leaves. [fails if: check_leaf_modules checks absent names]"""
    assert parallel.check_leaf_modules(ds, torch.nn.Linear(1, 1)) is None


@pytest.mark.parametrize("timeout_s, kwargs", [(None, {}), (5, {"timeout": timedelta(seconds=5)})])
def test_init_distributed_without_a_launcher_is_a_world_of_one(launcher_env, timeout_s, kwargs):
    """A plain `python` run gets RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_SIZE of a world of one (MASTER_ADDR kept where set);
    `timeout_s` reaches DeepSpeed; `watchdog=False` starts no watchdog. [fails if: the environment filled in for a
    world of one, the timeout or the watchdog switch changes]"""
    import deepspeed

    calls = []
    for name in ("dump_stacks_on_sigusr1", "skip_cpu_shm_op", "quick_cpu_info"):
        launcher_env.setattr(parallel, name, lambda: None)
    launcher_env.setattr(parallel, "start_peer_watchdog", lambda: calls.append("watchdog"))
    launcher_env.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(kw))
    launcher_env.setenv("MASTER_ADDR", "10.0.0.7")
    parallel.init_distributed(watchdog=False, timeout_s=timeout_s)
    assert calls == [kwargs]
    assert {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR")} == dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="10.0.0.7")
    assert 29500 <= int(os.environ["MASTER_PORT"]) < 30500
    assert parallel.world_from_env() == parallel.World(rank=0, size=1, local_size=1)
    launcher_env.setenv("RANK", "3")  # under a launcher, its environment is left as it is
    launcher_env.setenv("LOCAL_SIZE", "4")
    parallel.init_distributed(timeout_s=timeout_s)
    assert calls == [kwargs, kwargs, "watchdog"] and os.environ["RANK"] == "3" and os.environ["LOCAL_SIZE"] == "4"


def test_cpu_ranks_mark_the_shared_memory_op_unusable():
    """[fails if: skip_cpu_shm_op lets DeepSpeed build and load its shm all-reduce op]"""
    import deepspeed.ops

    parallel.skip_cpu_shm_op()
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False


def test_device_kind_is_rocm_only_for_a_cuda_accelerator(monkeypatch):
    """[fails if: a HIP build of torch makes a CPU run report "rocm"]"""
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert parallel.device_kind() == "cpu"
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))
    assert parallel.device_kind() == "rocm"


def test_only_the_two_torch_deprecations_deepspeed_triggers_are_ignored():
    """[fails if: the filters are registered for another warning category, or match other FutureWarnings]"""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parallel.quiet_torch_deprecations_in_deepspeed()
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single`", FutureWarning)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                      "`torch.distributed.reduce_scatter_single`", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]


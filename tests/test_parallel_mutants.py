"""engine/parallel.py's and engine/pipeline.py's behaviour that tests/test_parallel_units.py, tests/test_pipeline_units.py
and tests/test_export_pipeline_units.py let through, one mutant a test (or a few of one kind): init_distributed without
a launcher (which variables it fills in, which it keeps, the four process set-ups it runs) and on a taken rendezvous
port (a one-line ConfigError naming the port; any other error unchanged); the SIGUSR1 stack dump's registration; the
two ignored torch deprecations only as FutureWarnings; the CPU shared-memory op skip leaving DeepSpeed's other probed
ops alone; quick_cpu_info's reading of /proc/cpuinfo (first processor block, no flags, unreadable file); model_dtype
with a null bf16 section; a schedule whose decay is all warmup; build_engine end to end around a fake
deepspeed.initialize (the schedule, the parameters, the leaf check, the stochastic-rounding optimizer, the overflow
check, the parameter-free compile and its rank-0 line); the stochastic-rounding optimizer's MoE parameter groups and a
DS optimizer without params; check_leaf_modules' message (sorted, at most three names); the autoep_size=1 filter
(exact prefix, removed on an exception, a null section); compiles_parameter_free without a ZeRO stage or off CUDA;
the pipeline's Head.loss (shift, ignore_index, mean over labelled tokens, lm_head gradient), use_cache, and the
ZeRO-3-equal initialization of a Qwen3.5-MoE pipeline's first stage (a module with parameters of its own and
children). Pipeline mode refuses Qwen3.5-MoE (it builds stages for deepseek_v3 and qwen3_moe); its later stages
would not match: init_like_zero3 skips the modules it does not own that have no parameters of their own, and
Qwen3_5MoeSparseMoeBlock's init draws for its child gate.weight.
Every expected value is computed in the test from the definition (plain logits and F.cross_entropy, hand-computed
schedule values, the environment as set). Nothing here needs CUDA or a launcher. The docstring's bracket names the
mutant."""
import logging
import os
import signal
import sys
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel
from engine.config import ConfigError
from test_pipeline_units import as_rank, build, hf_state, small_model, zero3_reference  # noqa: F401  (as_rank: a fixture)

LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def launcher_env(monkeypatch):
    for key in LAUNCHER_KEYS:
        monkeypatch.setenv(key, "")  # so that monkeypatch restores (or removes) what init_distributed writes
        monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture
def fake_init(launcher_env):
    """init_distributed with every set-up step recorded instead of run; deepspeed.init_distributed set by the test."""
    import deepspeed

    calls = []
    for name in ("dump_stacks_on_sigusr1", "skip_cpu_shm_op", "quick_cpu_info",
                 "quiet_torch_deprecations_in_deepspeed"):
        launcher_env.setattr(parallel, name, lambda name=name: calls.append(name))
    launcher_env.setattr(parallel, "start_peer_watchdog", lambda: calls.append("watchdog"))
    launcher_env.setattr(deepspeed, "init_distributed", lambda **kw: calls.append("init"))
    return SimpleNamespace(calls=calls, env=launcher_env, deepspeed=deepspeed)


# ------------------------------------------------------------------------------------------------ init_distributed


def test_init_distributed_runs_every_set_up_step_before_joining(fake_init):
    """The stack dump, the shm-op skip, the cpuinfo shortcut and the deprecation filters all run, before DeepSpeed's
    process group starts. [fails if: any of the four calls is dropped from init_distributed]"""
    parallel.init_distributed(watchdog=False)
    assert sorted(fake_init.calls[:4]) == sorted(["dump_stacks_on_sigusr1", "skip_cpu_shm_op", "quick_cpu_info",
                                                  "quiet_torch_deprecations_in_deepspeed"])
    assert fake_init.calls[4:] == ["init"]


def test_without_a_launcher_a_set_master_port_is_kept_and_the_address_defaults_to_localhost(fake_init):
    """A plain `python` run with MASTER_PORT set (e.g. to avoid a taken port) keeps it; MASTER_ADDR unset becomes the
    loopback address. [fails if: MASTER_PORT is overwritten by the pid-derived port, or MASTER_ADDR's default changes]"""
    fake_init.env.setenv("MASTER_PORT", "31234")
    parallel.init_distributed(watchdog=False)
    assert os.environ["MASTER_PORT"] == "31234" and os.environ["MASTER_ADDR"] == "127.0.0.1"


def test_the_pid_derived_port_is_the_one_the_definition_gives(fake_init):
    """Without MASTER_PORT: 29500 + pid mod 1000 (so that two plain runs on one machine rarely collide, and the port
    stays below 30500). [fails if: the modulus or the base changes]"""
    parallel.init_distributed(watchdog=False)
    assert os.environ["MASTER_PORT"] == str(29500 + os.getpid() % 1000)


def test_a_world_size_without_rank_is_still_completed_to_a_world_of_one(fake_init):
    """RANK decides whether a launcher started the process: WORLD_SIZE alone (left in a shell) does not keep RANK,
    LOCAL_RANK and the rest unset. [fails if: init_distributed tests another variable than RANK]"""
    fake_init.env.setenv("WORLD_SIZE", "1")
    parallel.init_distributed(watchdog=False)
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["LOCAL_SIZE"]) == ("0", "0", "1")


def _raise(error):
    def f(**kw):
        raise error
    return f


def test_a_taken_rendezvous_port_becomes_one_config_error_naming_it(fake_init):
    """torch's EADDRINUSE (a RuntimeError) becomes the ConfigError of port_taken_line for the MASTER_PORT in use.
    [fails if: the EADDRINUSE test is negated, the error re-raised as is, or the port not read from MASTER_PORT]"""
    fake_init.env.setenv("RANK", "0")
    fake_init.env.setenv("MASTER_PORT", "29777")
    fake_init.env.setattr(fake_init.deepspeed, "init_distributed",
                          _raise(RuntimeError("The server socket has failed to listen on any local network address. "
                                              "port: 29777, useIpv6: false, code: -98, name: EADDRINUSE")))
    with pytest.raises(ConfigError) as e:
        parallel.init_distributed(watchdog=False)
    assert str(e.value) == parallel.port_taken_line("29777")
    assert isinstance(e.value.__cause__, RuntimeError)


def test_another_rendezvous_error_is_not_turned_into_the_port_line(fake_init):
    """[fails if: every RuntimeError is reported as a taken port]"""
    fake_init.env.setenv("RANK", "0")
    fake_init.env.setattr(fake_init.deepspeed, "init_distributed", _raise(RuntimeError("connection reset by peer")))
    with pytest.raises(RuntimeError, match="connection reset by peer") as e:
        parallel.init_distributed(watchdog=False)
    assert not isinstance(e.value, ConfigError)


def test_port_taken_line_names_the_port_the_host_and_how_to_find_the_holder():
    """[fails if: the port is left out of the line's opening or of the `ss` hint]"""
    import socket

    line = parallel.port_taken_line("29611")
    assert line.startswith(f"--master_port 29611 is taken on {socket.gethostname()}:")
    assert "grep :29611" in line and "--master_port PORT" in line


# ------------------------------------------------------------------------------------------------ SIGUSR1 stack dump


@pytest.fixture
def registrations(monkeypatch):
    import faulthandler

    seen = []
    monkeypatch.setattr(faulthandler, "register", lambda signum, **kw: seen.append((signum, kw)))
    return seen


def test_sigusr1_dump_goes_to_the_process_stderr_for_all_threads(registrations, monkeypatch):
    """Registered with file descriptor 2's stream (sys.__stderr__, not a replaced sys.stderr such as a test's capture)
    and every thread. [fails if: sys.stderr is used, or all_threads is off]"""
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_DFL)
    monkeypatch.setattr(sys, "stderr", open(os.devnull, "w"))
    try:
        parallel.dump_stacks_on_sigusr1()
    finally:
        sys.stderr.close()
    assert registrations == [(signal.SIGUSR1, {"file": sys.__stderr__, "all_threads": True})]


def test_sigusr1_is_left_to_another_handler_and_off_the_main_thread(registrations, monkeypatch):
    """A SIGUSR1 handler someone else installed is kept; signals can only be set from the main thread.
    [fails if: the handler test or the main-thread test is negated]"""
    monkeypatch.setattr(signal, "getsignal", lambda s: (lambda *a: None))
    parallel.dump_stacks_on_sigusr1()
    assert registrations == []
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_DFL)
    t = threading.Thread(target=parallel.dump_stacks_on_sigusr1)
    t.start()
    t.join()
    assert registrations == []
    parallel.dump_stacks_on_sigusr1()
    assert len(registrations) == 1


# ------------------------------------------------------------------------------------------------ process set-up


def test_deprecation_messages_are_ignored_only_as_future_warnings():
    """The same text as another category (e.g. a UserWarning) still shows. [fails if: the filters match any
    Warning subclass]"""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parallel.quiet_torch_deprecations_in_deepspeed()
        text = ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                "`torch.distributed.all_gather_single`")
        warnings.warn(text, FutureWarning)
        warnings.warn(text, UserWarning)
    assert [(w.category, str(w.message)) for w in seen] == [(UserWarning, text)]


def test_shm_skip_keeps_the_other_ops_deepspeed_already_probed(monkeypatch):
    """Where DeepSpeed has already probed its ops, only deepspeed_shm_comm changes. [fails if: the probed dict is
    replaced by a new one]"""
    import deepspeed.ops

    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", {"cpu_adam": True, "fused_adam": False}, raising=False)
    parallel.skip_cpu_shm_op()
    assert deepspeed.ops.__compatible_ops__ == {"cpu_adam": True, "fused_adam": False, "deepspeed_shm_comm": False}


CPUINFO = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: sse2 avx2 fpu\n\n"
           "processor\t: 1\nvendor_id\t: OtherVendor\nflags\t\t: mmx\n\n")


@pytest.fixture
def cpuinfo_text(monkeypatch):
    """quick_cpu_info on an x86-64 Linux CPU rank that reads the text the test sets (a function: raise instead)."""
    import platform

    import cpuinfo
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("quick_cpu_info only acts on CPU ranks")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(sys, "platform", "linux")
    sentinel = lambda: {"from": "py-cpuinfo"}  # noqa: E731
    monkeypatch.setattr(cpuinfo, "get_cpu_info", sentinel)

    def use(text):
        def fake_open(path, *a, **kw):
            assert path == "/proc/cpuinfo"
            if isinstance(text, Exception):
                raise text
            import io
            return io.StringIO(text)
        monkeypatch.setattr(parallel, "open", fake_open, raising=False)
        parallel.quick_cpu_info()
        return cpuinfo.get_cpu_info()
    return use


def test_quick_cpu_info_reads_the_first_processor_block(cpuinfo_text):
    """Flags and vendor of processor 0 (the first block), sorted, stripped. [fails if: another block is read]"""
    info = cpuinfo_text(CPUINFO)
    assert info == {"arch": "X86_64", "bits": 64, "flags": ["avx2", "fpu", "sse2"], "vendor_id_raw": "AuthenticAMD"}


def test_quick_cpu_info_leaves_py_cpuinfo_without_flags_or_without_the_file(cpuinfo_text):
    """No flags line: py-cpuinfo still answers (DeepSpeed needs the flags); /proc/cpuinfo unreadable: the same,
    without an error. [fails if: the no-flags return is dropped, or an OSError escapes]"""
    assert cpuinfo_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n\n") == {"from": "py-cpuinfo"}
    assert cpuinfo_text(PermissionError("no access")) == {"from": "py-cpuinfo"}


def test_model_dtype_with_a_null_bf16_section_reads_fp16():
    """A DS config may hold "bf16": null. [fails if: model_dtype reads the null section as a dict]"""
    assert parallel.model_dtype({"bf16": None, "fp16": {"enabled": True}}) == torch.float16
    assert parallel.model_dtype({"bf16": None}) == torch.float32


def test_a_schedule_that_is_all_warmup_has_a_cosine_of_one_step():
    """total == warmup (a run that is all warmup): the warmup reaches 1 (1/4, 2/4, 3/4, 1); the cosine after it is
    one step long (its length is at least 1), so step 4 is its start (1) and step 5 on is the floor; no division by
    zero. [fails if: the cosine's length is not kept at least 1]"""
    f = parallel.warmup_cosine(warmup=4, total=4, min_ratio=0.2)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(5) == pytest.approx(0.2) and f(9) == pytest.approx(0.2)


# ------------------------------------------------------------------------------------------------ build_engine


def _train(**kw):
    base = dict(warmup_steps=2, decay_steps=4, max_steps=100, min_lr_ratio=0.1, stochastic_rounding=False, seed=5,
                compile=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def fake_ds(monkeypatch):
    """deepspeed.initialize recorded: it returns an engine whose module is the model and whose optimizer is a
    ZeRO-1/2 optimizer (its per-tensor overflow check in place)."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    seen = {}

    def initialize(**kw):
        seen.update(kw)
        opt = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
        for key, value in dict(cpu_offload=False, zenflow=False, compute_grad_norm=True, dtype=torch.float32,
                               check_grad_overflow=True, overflow=True).items():
            object.__setattr__(opt, key, value)
        seen["engine"] = SimpleNamespace(module=kw["model"], optimizer=opt)
        return seen["engine"], opt, None, kw["lr_scheduler"]

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    return seen


def test_build_engine_passes_the_recipes_schedule_and_the_models_parameters(fake_ds):
    """The scheduler DeepSpeed builds is LambdaLR over the recipe's multiplier: warmup 2 then a cosine over
    decay_steps 4 to 0.1 (hand-computed: 0.5, 1, 1, 0.55, 0.1); the model's parameters are what the optimizer gets;
    DeepSpeed builds the optimizer (none passed) when stochastic rounding is off. [fails if: the schedule or the
    parameters are not passed, or an optimizer is passed without stochastic rounding]"""
    model = nn.Linear(3, 2)
    parallel.build_engine(model, {"zero_optimization": {"stage": 1}}, train=_train())
    assert fake_ds["model"] is model and fake_ds["optimizer"] is None
    assert [id(p) for p in fake_ds["model_parameters"]] == [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = fake_ds["lr_scheduler"](opt)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1, 0.1])


def test_build_engine_without_training_has_no_schedule_and_no_parameters(fake_ds):
    """[fails if: an optimizer-free engine gets parameters or a schedule]"""
    parallel.build_engine(nn.Linear(3, 2), {})
    assert fake_ds["lr_scheduler"] is None and fake_ds["model_parameters"] is None and fake_ds["optimizer"] is None


def test_build_engine_refuses_unknown_leaf_module_names_before_deepspeed(fake_ds):
    """[fails if: build_engine does not call check_leaf_modules]"""
    ds = {"zero_optimization": {"stage": 3, "leaf_module": {"names": ["model.layers.9"]}}}
    with pytest.raises(ConfigError, match="model.layers.9"):
        parallel.build_engine(nn.Linear(3, 2), ds, train=_train())
    assert fake_ds == {}


def test_build_engine_drops_the_per_tensor_overflow_check(fake_ds):
    """The engine's ZeRO-1/2 optimizer reports no per-tensor overflow after build_engine. [fails if: build_engine
    does not call one_overflow_check]"""
    engine = parallel.build_engine(nn.Linear(3, 2), {"zero_optimization": {"stage": 2}}, train=_train())
    engine.optimizer.check_overflow()
    assert engine.optimizer.overflow is False


def test_build_engine_hands_deepspeed_the_stochastic_rounding_optimizer(fake_ds, monkeypatch):
    """With bf16 master weights and AdamW, DeepSpeed gets the DS config without its optimizer section and a
    callable building AdamWSR with the config's lr and the recipe's seed. [fails if: stochastic rounding is not
    applied, or its optimizer is not passed]"""
    from deepspeed.runtime.zero import utils as zero_utils

    from engine.optim import AdamWSR

    monkeypatch.setattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", list(zero_utils.ZERO_SUPPORTED_OPTIMIZERS))
    ds = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.02}}}
    parallel.build_engine(nn.Linear(3, 2), ds, train=_train(stochastic_rounding=True))
    assert "optimizer" not in fake_ds["config"] and callable(fake_ds["optimizer"])
    opt = fake_ds["optimizer"]([nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    assert isinstance(opt, AdamWSR) and opt.seed == 5 and opt.param_groups[0]["lr"] == 0.02


@pytest.mark.parametrize("rank, lengths_vary", [(0, False), (0, True), (1, True)])
def test_build_engine_compiles_parameter_free_functions_under_zero3_on_cuda(fake_ds, monkeypatch, capsys, rank,
                                                                             lengths_vary):
    """ZeRO-2 training with lengths_vary (GRPO's policy) and ZeRO-3 training on CUDA compile the parameter-free
    functions, for varying lengths where they vary; rank 0 alone says so. [fails if: lengths_vary is not passed on
    to compiles_parameter_free or compile_parameter_free, or the line is printed on the wrong ranks]"""
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))
    monkeypatch.setenv("RANK", str(rank))
    calls = []
    monkeypatch.setattr(parallel, "compile_parameter_free", lambda m, lv: calls.append((m, lv)) or ["rmsnorm"])
    model = nn.Linear(3, 2)
    stage = 2 if lengths_vary else 3
    parallel.build_engine(model, {"zero_optimization": {"stage": stage}}, train=_train(compile="auto"),
                          lengths_vary=lengths_vary)
    assert calls == [(model, lengths_vary)]
    out = capsys.readouterr().out
    assert ("compile: the layers' parameter-free functions only: rmsnorm" in out) is (rank == 0)


# ------------------------------------------------------------------------------------------------ stochastic rounding


def test_stochastic_rounding_optimizer_puts_expert_parameters_in_their_own_moe_group(monkeypatch):
    """AutoEP's expert parameters (allreduce False, a group name) go into a `moe` group of their expert-data-parallel
    group, the others into the dense group, as DeepSpeed does for the optimizer it builds. [fails if: AdamWSR gets the
    parameters as one plain list]"""
    from deepspeed.runtime.zero import utils as zero_utils

    monkeypatch.setattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", list(zero_utils.ZERO_SUPPORTED_OPTIMIZERS))
    _, make = parallel.stochastic_rounding_optimizer({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, seed=1)
    dense = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    expert = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    expert.allreduce, expert.group_name = False, "ep_size_2"
    groups = make([dense, expert]).param_groups
    by_moe = {bool(g.get("moe")): g for g in groups}
    assert len(groups) == 2 and by_moe[True]["name"] == "ep_size_2"
    assert by_moe[True]["params"] == [expert] and by_moe[False]["params"] == [dense]


def test_stochastic_rounding_optimizer_without_params_uses_adamwsrs_defaults(monkeypatch, capsys):
    """A DS optimizer section without params (or params null): AdamWSR's own defaults; rank 0 says which optimizer
    runs, other ranks say nothing. [fails if: a missing params section raises, or the line goes to the wrong ranks]"""
    from deepspeed.runtime.zero import utils as zero_utils

    monkeypatch.setattr(zero_utils, "ZERO_SUPPORTED_OPTIMIZERS", list(zero_utils.ZERO_SUPPORTED_OPTIMIZERS))
    monkeypatch.setenv("RANK", "0")
    out, make = parallel.stochastic_rounding_optimizer({"optimizer": {"type": "AdamW", "params": None}}, seed=2)
    assert out == {} and "optimizer: AdamW with stochastic rounding" in capsys.readouterr().out
    group = make([nn.Parameter(torch.zeros(1))]).param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    monkeypatch.setenv("RANK", "3")
    parallel.stochastic_rounding_optimizer({"optimizer": {"type": "AdamW"}}, seed=2)
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------------------ leaf modules


def test_missing_leaf_names_are_reported_sorted_and_at_most_three():
    """Five unknown names, given unsorted: the message names the three first in sorted order and no other.
    [fails if: the names are not sorted, or fewer/more than three are listed]"""
    model = nn.Sequential(nn.Linear(1, 1))
    names = ["z.4", "b.1", "0", "d.3", "a.0", "c.2"]
    with pytest.raises(ConfigError) as e:
        parallel.check_leaf_modules({"zero_optimization": {"leaf_module": {"names": names}}}, model)
    want = sorted(set(names) - {"0"})[:3]
    assert f"no module named {', '.join(want)} in this Sequential" in str(e.value)
    assert "d.3" not in str(e.value) and "z.4" not in str(e.value)


# ------------------------------------------------------------------------------------------------ autoep_size=1 filter


def _record(message):
    return logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, message, None, None)


def test_autoep_filter_drops_only_messages_that_start_with_the_note():
    """A message quoting the note elsewhere is another message and is kept. [fails if: the filter matches the note
    anywhere in the message]"""
    from deepspeed.utils import logger

    with parallel.autoep_size_one_is_intended({"expert_parallel": {"enabled": True, "autoep_size": 1}}):
        assert not logger.filter(_record(parallel.AUTOEP_SIZE_ONE))
        assert logger.filter(_record("config check: " + parallel.AUTOEP_SIZE_ONE))


def test_autoep_filter_is_removed_when_deepspeed_initialize_raises():
    """[fails if: the filter is removed outside a finally]"""
    from deepspeed.utils import logger

    before = list(logger.filters)
    with pytest.raises(RuntimeError):
        with parallel.autoep_size_one_is_intended({"expert_parallel": {"enabled": True, "autoep_size": 1}}):
            raise RuntimeError("initialize failed")
    assert logger.filters == before


def test_autoep_filter_with_a_null_expert_parallel_section_does_nothing():
    """[fails if: a null expert_parallel section is read as a dict]"""
    from deepspeed.utils import logger

    before = list(logger.filters)
    with parallel.autoep_size_one_is_intended({"expert_parallel": None}):
        assert logger.filters == before


# ------------------------------------------------------------------------------------------------ compiles_parameter_free


def test_no_parameter_free_compile_without_a_zero_stage_or_on_another_accelerator(monkeypatch):
    """A DS config without zero_optimization.stage is ZeRO-0 (DeepSpeed's default): not ZeRO-3; an accelerator other
    than CUDA (e.g. "xpu") compiles nothing either. [fails if: the stage defaults to 3, or "not cpu" stands for cuda]"""
    train = SimpleNamespace(compile=True)
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda"))
    assert parallel.compiles_parameter_free({"zero_optimization": {}}, train) is False
    assert parallel.compiles_parameter_free({}, train) is False
    assert parallel.compiles_parameter_free({"zero_optimization": {"stage": 3}}, train) is True  # the case differs
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: "xpu"))
    assert parallel.compiles_parameter_free({"zero_optimization": {"stage": 3}}, train) is False


# ------------------------------------------------------------------------------------------------ pipeline Head.loss


def _head(vocab=7, hidden=5, seed=0):
    from engine.pipeline import Head

    g = torch.Generator().manual_seed(seed)
    head = Head(nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False), config=SimpleNamespace())
    with torch.no_grad():
        head.lm_head.weight.copy_(torch.randn(vocab, hidden, generator=g))
    return head, g


def test_pipeline_loss_is_transformers_causal_lm_loss():
    """Position t predicts label t+1; -100 targets are left out; the mean is over labelled targets only. Reference:
    full logits and F.cross_entropy(ignore_index=-100, mean) of the shifted pairs, in float64. The lm_head weight gets
    the reference's gradient (the output layer trains in the last stage). [fails if: the shift is applied to the
    wrong side, the mean counts ignored targets, or lm_head gets no gradient]"""
    head, g = _head()
    hidden = torch.randn(2, 6, 5, generator=g).requires_grad_()
    labels = torch.randint(0, 7, (2, 6), generator=g)
    labels[0, 2] = labels[1, 4] = labels[1, 5] = -100
    loss = head.loss(hidden, labels)
    loss.backward()
    w = head.lm_head.weight.detach().double().requires_grad_()
    logits = hidden.detach()[:, :-1].double() @ w.T
    want = F.cross_entropy(logits.reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert head.lm_head.weight.grad is not None
    assert torch.allclose(head.lm_head.weight.grad.double(), w.grad, atol=1e-5)


# ------------------------------------------------------------------------------------------------ build_pipeline


def test_pipeline_model_config_has_the_kv_cache_off(as_rank):
    """Training stages never keep a KV cache: the stage's config (which the layers share) says use_cache False,
    where transformers' default is True. [fails if: build_pipeline no longer turns use_cache off]"""
    from engine.model import make_hf_config

    assert make_hf_config(small_model()).use_cache is True  # the case differs
    assert build(as_rank).config.use_cache is False


def _qwen3_5_stage_mismatches(as_rank, stages, ranks):
    """Tensors of the given ranks' stages that differ from the ZeRO-3 path's (transformers' initialize_weights_zero3
    over the whole model from the same seed)."""
    m = small_model(arch="qwen3_5_moe")
    as_rank(0, 1)
    want = zero3_reference(m, seed=3).state_dict()
    bad = []
    for rank in ranks:
        got = hf_state(build(as_rank, rank, stages=stages, m=m))
        assert got and set(got) <= set(want)
        bad += [k for k in got if not torch.equal(got[k], want[k])]
    return bad


def test_qwen3_5_first_stage_is_initialized_as_the_zero3_path(as_rank):
    """Qwen3.5-MoE's linear-attention block (Qwen3_5MoeGatedDeltaNet) holds parameters of its own (dt_bias, A_log)
    besides its submodules', unlike the architectures tests/test_pipeline_units.py checks: transformers'
    initialize_weights_zero3 initializes a module after its children, and init_like_zero3 must do the same. The
    whole model on one stage, and the first stage of two, equal the ZeRO-3 path's tensor for tensor.
    [fails if: init_like_zero3 visits a module before its children]"""
    assert _qwen3_5_stage_mismatches(as_rank, 1, [0]) == []
    assert _qwen3_5_stage_mismatches(as_rank, 2, [0]) == []

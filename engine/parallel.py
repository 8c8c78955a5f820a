"""Parallel setup, kept apart from the model: world shape, distributed init, the DeepSpeed engine.

`deepspeed.initialize` does the heavy lifting: with `expert_parallel.enabled` in the DS config it swaps
the model's MoE blocks for AutoEP layers (expert parallelism), then wraps everything in ZeRO.
"""
from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import sys
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .config import ConfigError
from .ds_config import uses_stochastic_rounding
from .model import compile_parameter_free
from .watchdog import start_peer_watchdog


@dataclass
class World:
    rank: int
    size: int
    local_size: int


def world_from_env() -> World:
    """The launcher's world (RANK/WORLD_SIZE/LOCAL_SIZE); a plain `python` run is a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(rank=int(os.environ.get("RANK", "0")), size=size,
                 local_size=int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", size))))


def init_distributed(watchdog: bool = True, timeout_s: float | None = None) -> None:
    """Join the job's other ranks (DeepSpeed's process group on this rank's device); `watchdog`: start the peer
    watchdog too (engine/watchdog.py); `timeout_s`: how long to wait for them (DeepSpeed's default: 10 min)."""
    from datetime import timedelta

    import deepspeed

    if "RANK" not in os.environ:  # one process without a launcher: a world of one on localhost
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(29500 + os.getpid() % 1000)))
    dump_stacks_on_sigusr1()
    skip_cpu_shm_op()
    quick_cpu_info()
    quiet_torch_deprecations_in_deepspeed()
    try:
        deepspeed.init_distributed(**({"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}))
    except RuntimeError as e:  # torch's DistNetworkError
        if "EADDRINUSE" not in str(e):
            raise
        raise ConfigError(port_taken_line(os.environ.get("MASTER_PORT", "?"))) from e
    # DeepSpeed's own process groups wait up to torch's default timeout (10-30 min) on a dead peer; the watchdog
    # ends this rank within MOE_PEER_TIMEOUT s (default 30) instead (docs/multinode.md).
    if watchdog:
        start_peer_watchdog()
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def port_taken_line(port: str) -> str:
    """Rank 0 could not listen on the rendezvous port: what the user sees instead of torch's traceback."""
    import socket

    return (f"--master_port {port} is taken on {socket.gethostname()}: another process listens there (another job, "
            f"or one left over from a stopped one; `ss -ltnp | grep :{port}` names it); start again with a free "
            f"port: deepspeed --master_port PORT ...")


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <rank pid>` prints every thread's Python stack to the rank's stderr (the launcher's log) and the rank
    goes on: where a job that makes no progress waits (docs/multinode.md, Troubleshooting). Left alone when
    something else already handles SIGUSR1."""
    if (hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)):
        try:  # to the process's own stderr (file descriptor 2) even where sys.stderr is replaced (a test's capture)
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
        except (AttributeError, ValueError, OSError):  # no usable stderr (io.UnsupportedOperation is an OSError)
            pass


# torch 2.13 deprecates the two collectives DeepSpeed 0.19.8's ZeRO runs on (deepspeed/comm/torch.py picks them by
# hasattr: get_all_gather_function, get_reduce_scatter_function), and says so on every rank's first ZeRO-3 gather
# and gradient reduce. Nothing this engine can pass or configure avoids the calls, so exactly these two warnings
# are ignored; any other FutureWarning still shows.
TORCH_DEPRECATIONS_IN_DEEPSPEED = (
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated\. Please use `torch\.distributed\.all_gather_single`",
    r"`torch\.distributed\.reduce_scatter_tensor` is deprecated\. Please use `torch\.distributed\.reduce_scatter_single`",
)


def quiet_torch_deprecations_in_deepspeed() -> None:
    for message in TORCH_DEPRECATIONS_IN_DEEPSPEED:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def skip_cpu_shm_op() -> None:
    """On CPU ranks, keep DeepSpeed from building and loading its shared-memory all-reduce op.

    DeepSpeed's TorchBackend loads it whenever a process group starts on the CPU accelerator (a C++ JIT build:
    52 s on a new 2-core machine), but only `inference_all_reduce` (tensor-parallel inference layers, which this
    engine does not use) calls it, and that falls back to torch's all_reduce without it; training's collectives go
    through gloo either way. Without the op no rank creates its 66 MiB /dev/shm buffer, which DeepSpeed never
    removes (tests/test_two_ranks.py checks both). DeepSpeed 0.19.8 reads `deepspeed.ops.__compatible_ops__` (a
    lazily probed dict) for this op only, in `deepspeed.comm.torch.build_shm_op`.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops

    ops = vars(deepspeed.ops).get("__compatible_ops__")
    if ops is None:  # not probed yet: no need to probe (it runs compiler subprocesses) for this one answer
        deepspeed.ops.__compatible_ops__ = ops = {}
    ops["deepspeed_shm_comm"] = False


def quick_cpu_info() -> None:
    """On x86-64 Linux CPU ranks, answer DeepSpeed's CPU-op probe of the processor from /proc/cpuinfo.

    Every load of a CPU op (FusedAdam, DeepSpeedCPUAdam), built or not, computes its compiler flags to find its
    build and asks py-cpuinfo twice for them. py-cpuinfo starts a Python subprocess that sleeps 1 s to time the
    clock: 2.4 s per rank before the first step. DeepSpeed reads only "arch", "flags" (-march, the SIMD width) and
    "vendor_id_raw" (CPUAdam); those come from the same kernel file py-cpuinfo reads on Linux, so the flags and
    therefore the op build found are the same (tests/test_pretrain.py compares them). Elsewhere: nothing changes.
    """
    import platform
    import sys

    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or platform.machine() != "x86_64" or sys.platform != "linux":
        return
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "flags" not in fields:
        return
    info = {"arch": "X86_64", "bits": 64, "flags": sorted(fields["flags"].split()),
            "vendor_id_raw": fields.get("vendor_id", "unknown")}
    import cpuinfo

    cpuinfo.get_cpu_info = lambda: dict(info)


def device_kind() -> str:
    """DeepSpeed's accelerator name ("cuda", "cpu", ...), with a ROCm build of torch reported as "rocm"."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return "rocm" if name == "cuda" and torch.version.hip else name


def model_dtype(ds_config: dict) -> torch.dtype:
    if (ds_config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """LR multiplier: linear warmup to 1, cosine decay to min_ratio at `total` steps."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def lr_multiplier(train):
    """The recipe's LR schedule (train: a TrainConfig): warmup, then cosine over decay_steps (max_steps when unset)."""
    return warmup_cosine(train.warmup_steps, train.decay_steps or train.max_steps, train.min_lr_ratio)


def build_engine(model: torch.nn.Module, ds_config: dict, train=None, lengths_vary: bool = False,
                 layers: bool | None = None):
    """deepspeed.initialize with the recipe's LR schedule; `train` None builds an optimizer-free engine.
    lengths_vary: the batches' sequence length changes from step to step (GRPO's rollouts), so what is compiled is
    compiled for any length at once (model.compile_parameter_free). layers: whether the caller compiles the decoder
    layers whole instead (GRPO's policy; None: compiles_parameter_free's rule)."""
    import deepspeed

    schedule = None
    if train is not None:
        mult = lr_multiplier(train)
        schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, mult)  # noqa: E731
    check_leaf_modules(ds_config, model)
    optimizer = None
    if uses_stochastic_rounding(ds_config, train):
        ds_config, optimizer = stochastic_rounding_optimizer(ds_config, train.seed)
    with autoep_size_one_is_intended(ds_config):
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, lr_scheduler=schedule, optimizer=optimizer,
                                          model_parameters=model.parameters() if train is not None else None)
    one_overflow_check(engine)
    if compiles_parameter_free(ds_config, train, lengths_vary, layers):
        done = compile_parameter_free(engine.module, lengths_vary)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"compile: the layers' parameter-free functions only: {', '.join(done)}", flush=True)
    return engine


def stochastic_rounding_optimizer(ds_config: dict, seed: int):
    """The DS config without its optimizer section, and a callable that deepspeed.initialize turns into that
    optimizer as engine/optim.py's AdamWSR (train.stochastic_rounding). DeepSpeed calls it with the parameters after
    AutoEP has swapped in its expert layers; they are split into DeepSpeed's MoE parameter groups as DeepSpeed does
    for the optimizer it builds itself (ZeRO reduces expert gradients over the expert-data-parallel group only)."""
    from deepspeed.moe.utils import configure_moe_param_groups
    from deepspeed.runtime.zero import utils as zero_utils

    from .optim import AdamWSR

    if AdamWSR not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS:  # ZeRO checks by exact type; DeepSpeed adds Muon so too
        zero_utils.ZERO_SUPPORTED_OPTIMIZERS.append(AdamWSR)
    ds_config = dict(ds_config)
    params = dict(ds_config.pop("optimizer").get("params") or {})
    kwargs = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}
    if int(os.environ.get("RANK", "0")) == 0:
        print("optimizer: AdamW with stochastic rounding of the bf16 master weights (train.stochastic_rounding)",
              flush=True)
    return ds_config, lambda parameters: AdamWSR(configure_moe_param_groups(list(parameters)), seed=seed, **kwargs)


def check_leaf_modules(ds_config: dict, model: torch.nn.Module) -> None:
    """zero_optimization.leaf_module's names must all be modules of the model: DeepSpeed only logs a warning for
    a name it does not find and then hooks that module's children one by one (ds_config.resolve_leaf_modules)."""
    leaf = (ds_config.get("zero_optimization") or {}).get("leaf_module")
    names = leaf.get("names") if isinstance(leaf, dict) else None
    if not names:
        return
    missing = sorted(set(names) - {name for name, _ in model.named_modules()})
    if missing:
        raise ConfigError(f"zero_optimization.leaf_module.names: no module named {', '.join(missing[:3])} in this "
                         f"{type(model).__name__} (its decoder layers are model.layers.<i>)")


def one_overflow_check(engine) -> bool:
    """Drop the ZeRO-1/2 optimizer's per-tensor gradient overflow check where its global norm check does the same job.

    DeepSpeed 0.19.8's `DeepSpeedZeroOptimizer.step` first checks every gradient tensor for inf/NaN (amax, amin,
    isfinite, logical_and per tensor, then an all-reduce and a read on the host: `has_overflow`), then computes the
    global gradient norm for clipping and treats a non-finite norm as an overflow too (`is_invalid_grad_norm`, unless a
    bf16 config turned `check_grad_overflow` off). A non-finite gradient makes the norm non-finite on every rank (it is
    summed over the ranks before DeepSpeed masks it to -1, which stays invalid), so the step is skipped either way, in
    the same way (gradients zeroed, `_global_grad_norm` inf). On one H200 the per-tensor
    check left the device idle for about 30 ms of a 1.33 s GRPO step (docs/benchmarks.md, 2026-12-04 night). Returns
    whether it was dropped: not with offloaded optimizer states (their own overflow path), ZenFlow, no norm, or a bf16
    config that turned the check off (then neither check runs, as DeepSpeed does)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = getattr(engine, "optimizer", None)
    if (not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload or getattr(opt, "zenflow", False)
            or not opt.compute_grad_norm or (opt.dtype == torch.bfloat16 and not opt.check_grad_overflow)):
        return False

    def check_overflow(self, partition_gradients=True):
        self.overflow = False  # the global norm's check in step() catches a non-finite gradient

    opt.check_overflow = check_overflow.__get__(opt)
    return True


AUTOEP_SIZE_ONE = "autoep_size=1 means every rank owns all experts with no AllToAll."


@contextmanager
def autoep_size_one_is_intended(ds_config: dict):
    """Drop DeepSpeed's warning that `expert_parallel.autoep_size` is 1, for this deepspeed.initialize.

    autoep_size 1 (what "auto" gives on one rank, or wherever no larger size divides the experts and the ranks) is
    meant: the MoE blocks still become the same AutoEP layers as on N ranks (the only DeepSpeed MoE that runs under
    ZeRO-3, with the same checkpoint layout), just without the all-to-all. Turning AutoEP off instead would change the
    model's code path and its checkpoints. DeepSpeed (runtime/engine.py -> validate_autoep_config) logs the warning
    on every rank and has no setting for it: this filters exactly that message of DeepSpeed's logger, nothing else.
    """
    from deepspeed.utils import logger

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(AUTOEP_SIZE_ONE)

    ep = ds_config.get("expert_parallel") or {}
    quiet = ep.get("enabled") and ep.get("autoep_size") == 1
    if quiet:
        logger.addFilter(keep)
    try:
        yield
    finally:
        if quiet:
            logger.removeFilter(keep)


def compiles_parameter_free(ds_config: dict, train, lengths_vary: bool = False, layers: bool | None = None) -> bool:
    """ZeRO-3 training on CUDA with train.compile not false: DeepSpeed compiles nothing around AutoEP there, so the
    parameter-free functions of the layers are compiled instead (model.compile_parameter_free; docs/benchmarks.md).
    GRPO's policy (lengths_vary) takes them under every ZeRO stage with compile "auto" where it does not compile its
    layers: its lengths change every step, which DeepSpeed's whole-layer compile of ZeRO 1-2 pretraining does not
    serve. Whole layers instead: pretraining under ZeRO 1-2 (engine/pretrain.py), pretraining under ZeRO-3 with
    decoder-layer leaves (compile true, or "auto" with AutoEP: ds_config.auto_compiles_layers) and GRPO's policy with
    compile true under any stage or "auto" under ZeRO-3 with AutoEP and layer leaves (ds_config.grpo_compiles_layers;
    pretrain.compile_layers; `layers` says it where the caller decides: grpo.policy_compiles_layers). Pipeline stages
    are left as they are."""
    from deepspeed.accelerator import get_accelerator

    from .ds_config import auto_compiles_layers, grpo_compiles_layers, zero3_compiles_layers

    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    compile_ = getattr(train, "compile", False)
    device = get_accelerator().device_name()
    if layers is None and lengths_vary:  # GRPO's policy
        layers = grpo_compiles_layers(compile_, ds_config, device)
    elif layers is None:
        layers = zero3_compiles_layers(ds_config) if compile_ is True else auto_compiles_layers(ds_config)
    return (train is not None and compile_ is not False and (stage == 3 or lengths_vary)
            and not layers and "pipeline" not in ds_config and device == "cuda")

"""Pretraining: preflight checks, then one short loop (batch -> forward -> backward -> step -> metrics).

SIGTERM/SIGINT: the ranks finish the current step, save a checkpoint and exit 0 (the deepspeed launcher itself
then exits 1, its own code after forwarding a signal). `--resume` continues from `latest`, exactly; on another
world size or expert-parallel size it converts `latest` to DeepSpeed's universal format first (rank 0, once).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from . import checkpoint, pipeline
from .auto_batch import AutoBatch, device_memory_gib, host_memory_problem, settle_checkpointing
from .flops import model_flops_per_token, peak_tflops
from .fp8 import can_run_fp8, convert as fp8_convert, convert_experts as fp8_experts, fp8_problems
from .balance import ExpertBalance
from .config import ConfigError, Recipe, load_recipe
from .data import ReadAhead, build_data, load_tokenizer, to_device, vocab_problem
from .data_check import check_corpus
from .ds_config import (compiles_layers, read_ds_config, resolve_ds_config, uses_expert_parallel,
                        zero3_compiles_layers, zero_stage)
from .metrics import Metrics, print0
from .watchdog import PeerTimeoutError, peer_timeout
from .model import build_model
from .parallel import World, build_engine, device_kind, init_distributed, model_dtype, world_from_env
from .proc import print_error


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Pretrain a MoE language model (start it with the deepspeed launcher).")
    ap.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON, e.g. ds_configs/zero3.json")
    ap.add_argument("--config", default=None, help="recipe YAML (default: the embedded tiny recipe)")
    ap.add_argument("--max_steps", type=int, help="override train.max_steps")
    ap.add_argument("--run_dir", help="override run_dir (metrics.jsonl and checkpoints go here)")
    ap.add_argument("--checkpoint_every", type=int, metavar="STEPS", help="override checkpoint.every_steps")
    ap.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest, on any world size "
                    "(another world or expert-parallel size goes through DeepSpeed's universal checkpoint)")
    ap.add_argument("--data", help="override data.path: a local text/jsonl/parquet file or folder, or a hub name")
    ap.add_argument("--memory_fraction", type=float, help="use this fraction of each GPU's memory (torch's per-process "
                    "cap; 0.5596 makes an H200 an 80 GB H100); \"auto\" batch sizes are chosen for the capped memory")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    return ap.parse_args(argv)


def overrides(args: argparse.Namespace) -> dict:
    o = {"train.max_steps": args.max_steps, "run_dir": args.run_dir, "data.path": args.data,
         "checkpoint.every_steps": getattr(args, "checkpoint_every", None)}
    o = {k: v for k, v in o.items() if v is not None}
    if args.resume:
        o["resume"] = True
    return o


def preflight(args: argparse.Namespace, world: World):
    """Everything that can be checked before any rank does work; raises one ConfigError naming every problem.

    The recipe, the DS JSON, the data path and the tokenizer are each checked even when another is broken (the data
    and tokenizer of a recipe with problems elsewhere too); what depends on a broken piece (the DS config against
    the recipe, the resume checks) is checked once it is fixed.
    """
    problems = []
    recipe = raw = ds = tok = None
    data = None  # the recipe's data section, once it is known to be valid
    try:
        recipe = load_recipe(args.config, overrides(args))
        data = recipe.data
    except ConfigError as e:
        problems.append(str(e))
        if getattr(e, "recipe", None) is not None and "data" not in e.sections:
            data = e.recipe.data
    try:
        raw = read_ds_config(args.deepspeed_config)
    except ConfigError as e:
        problems.append(str(e))
    try:
        peer_timeout()  # read again when the watchdog starts; a bad value is bad input like any other
    except PeerTimeoutError as e:
        problems.append(str(e))
    fraction = getattr(args, "memory_fraction", None)
    if fraction is not None and not 0 < fraction <= 1:
        problems.append(f"--memory_fraction ({fraction}) must be in (0, 1], e.g. 0.5596 for 80 GB of an H200")
        fraction = None
    auto = None
    if recipe is not None and raw is not None:
        device = device_kind()
        auto = AutoBatch(memory_gib=device_memory_gib(device, fraction) if auto_wanted(raw) else None,
                         recorded=checkpoint.recorded_batch(recipe.run_dir) if recipe.resume else None)
        try:
            ds = resolve_ds_config(raw, recipe, world.size, world.local_size,
                                   where=f"DeepSpeed config {args.deepspeed_config}", device=device, auto_batch=auto)
        except ConfigError as e:
            problems.append(str(e))
    if data is not None:
        try:
            tok = load_tokenizer(data.tokenizer)
            m = recipe.model if recipe is not None else None  # with init_from: the loaded model's vocabulary
            found = m and vocab_problem(tok, data.tokenizer, m.vocab_size,
                                        m.init_from and f"the model at model.init_from {m.init_from}")
            problems += [found] if found else []
        except ConfigError as e:
            problems.append(str(e))
        batch, dp = (ds["train_batch_size"], pipeline.data_coords(ds, 0, world.size)[1]) if ds else (None, world.size)
        problems += check_corpus(data, tok, batch, dp)  # files, rows, encoding, tokens (a bounded sample)
    if recipe is not None and raw is not None:
        problems += fp8_problems(recipe.train.fp8, raw, device_kind())
        if recipe.train.balance_rate > 0 and not uses_expert_parallel(raw):
            problems.append(f"train.balance_rate ({recipe.train.balance_rate:g}): the routing biases are balanced in "
                            f"DeepSpeed's AutoEP layers, and DeepSpeed config {args.deepspeed_config} has no enabled "
                            "expert_parallel section; use ds_configs/zero2.json or zero3.json, or set "
                            "train.balance_rate: 0")
    if ds is not None and "pipeline" not in ds:  # this machine's memory against what the offload keeps there
        found = host_memory_problem(ds, recipe, world.size, min(world.local_size, world.size))
        problems += [f"DeepSpeed config {args.deepspeed_config}: {found}"] if found else []
    if recipe is not None:
        problems += checkpoint.run_dir_problems(recipe)
    if ds is not None and recipe.resume and not problems:
        found, universal = checkpoint.check_resume(recipe, ds, world.size, world.rank)
        problems += found
        if universal:
            # Saved on another world size or expert-parallel size: load DeepSpeed's universal form. This sets the
            # resolved config in memory (derived, like the "auto" values); the user's JSON file is not rewritten.
            ds.setdefault("checkpoint", {})["load_universal"] = True
    if problems:
        raise ConfigError("; ".join(problems))
    recipe = settle_checkpointing(recipe, auto)  # "auto": decided with the micro-batch (ZeRO-3 on a tight device)
    recipe, schedule_lines = checkpoint.lr_schedule(recipe)
    for line in ([auto.note] if auto.note else []) + schedule_lines:
        print0(line)  # once, before any rank does work: what "auto" chose and why, the LR schedule on a resume
    if recipe.resume and ds.get("checkpoint", {}).get("load_universal") and world.rank == 0:
        checkpoint.to_universal(recipe.run_dir)  # the other ranks wait for rank 0 in init_distributed
    return recipe, ds, tok


def auto_wanted(raw: dict) -> bool:
    """Whether the DS file leaves a batch size to the engine (only then is the device's memory asked for)."""
    return "auto" in (raw.get("train_micro_batch_size_per_gpu"), raw.get("gradient_accumulation_steps"))


def apply_memory_fraction(fraction: float | None) -> None:
    """--memory_fraction: torch's per-process cap on this rank's GPU (after init_distributed set the device)."""
    from deepspeed.accelerator import get_accelerator

    if fraction and get_accelerator().device_name() == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction)


def check_ranks_agree(ds: dict, world: World) -> None:
    """Every rank resolved the same micro-batch and accumulation ("auto" reads each rank's own device; a job whose
    GPUs differ in memory would otherwise hang in DeepSpeed) and the same expert-parallel size ("auto" reads the
    ranks on the rank's own node: a hostfile whose nodes have different slots would hang in DeepSpeed's group
    creation). Raises ConfigError on every rank if they differ."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from .ds_config import ep_size

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1), ep_size(ds),
            world.local_size]
    t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    n = len(mine)
    lo, hi = [-v for v in t[n:].tolist()], t[:n].tolist()
    if lo[:2] != hi[:2]:
        raise ConfigError(f"the ranks chose different batch sizes (micro-batch {lo[0]}-{hi[0]}, accumulation "
                          f"{lo[1]}-{hi[1]}): \"auto\" follows each rank's device memory, and these devices differ; "
                          "write the numbers in the DeepSpeed config")
    if lo[2] != hi[2]:
        nodes = f" (the nodes run {lo[3]} to {hi[3]} ranks: the hostfile's slots differ)" if lo[3] != hi[3] else ""
        raise ConfigError(f"the ranks chose different expert_parallel.autoep_size ({lo[2]}-{hi[2]}){nodes}: \"auto\" "
                          "follows the ranks on each node; give every node the same slots, or write autoep_size as a "
                          "number that divides every node's slots")


def build(recipe: Recipe, ds: dict, tok, world: World):
    """Data for this rank, the model (partitioned from birth), the DeepSpeed engine."""
    torch.manual_seed(recipe.train.seed)
    dp_rank, dp_size = pipeline.data_coords(ds, world.rank, world.size)  # the world itself without a pipeline
    data = build_data(recipe.data, tok, dp_rank, dp_size, recipe.data_seed())
    if pipeline.is_pipeline(ds):
        model = pipeline.build_pipeline(recipe.model, ds, tok, dtype=model_dtype(ds), seed=recipe.train.seed,
                                        activation_checkpointing=recipe.train.activation_checkpointing is True)
    else:
        from deepspeed.accelerator import get_accelerator

        device = None if zero_stage(ds) == 3 else get_accelerator().current_device_name()  # ZeRO-3: zero.Init places it
        plain_linear_for_compiled_layers(ds, wants_compile(recipe, ds))  # read by zero.Init, so before the build
        model = build_model(recipe.model, ds, tok, dtype=model_dtype(ds), device=device)
        kind = get_accelerator().device_name()
        if recipe.train.fp8:
            names = fp8_convert(model, recipe.train.fp8, kind)
        if recipe.train.activation_checkpointing is True:  # "auto" was settled with the batch (settle_checkpointing)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = build_engine(model, ds, recipe.train)
    if recipe.train.fp8:  # the routed experts exist once deepspeed.initialize has swapped in AutoEP's layers
        experts = fp8_experts(engine.module, kind) if recipe.train.fp8 == "all" else []
        what = f" and the routed experts of {len(experts)} MoE layers" if experts else ""
        rest = "the output layer and routers" if experts else "the output layer, routers and routed experts"
        print0(f"fp8: {len(names)} linear layers{what} in FP8 ({'FP8 GEMMs' if can_run_fp8(kind) else 'emulated'}); "
               f"{rest} in the model's dtype")
    if wants_compile(recipe, ds):
        mixers = eager_linear_attention(engine.module) if recipe.train.compile == "auto" else 0
        eager = f"; the linear attention of {mixers} layers eager: train.compile true compiles it" if mixers else ""
        if zero3_compiles_layers(ds):
            done = compile_layers(engine.module)
            shared = sum(name.endswith(".shared_experts") for name in done)
            extra = f" and the shared experts of {shared} MoE blocks" if shared else ""
            print0(f"compile: each decoder layer's forward ({len(done) - shared} layers{extra}; AutoEP and ZeRO-3's "
                   f"hooks eager{eager})")
        else:
            engine.compile()
            done = compile_outside_autoep(engine.module)
            print0(f"compile: the decoder layers around their AutoEP blocks (DeepSpeed; the blocks eager), and "
                   f"{len(done)} more modules (dense layers, shared experts){eager}")
    return engine, data


def wants_compile(recipe: Recipe, ds: dict) -> bool:
    """train.compile: true, or auto on a GPU where the decoder layers can be compiled whole (ds_config.compiles_layers:
    around AutoEP under ZeRO-1/2, each layer under ZeRO-3 with AutoEP and layer leaves)."""
    from deepspeed.accelerator import get_accelerator

    return compiles_layers(recipe.train.compile, ds, get_accelerator().device_name())


def plain_linear_for_compiled_layers(ds: dict, compiled: bool) -> None:
    """Where each decoder layer is compiled under ZeRO-3 (`compiled`: pretraining's train.compile true or "auto" on a
    GPU, GRPO's true), zero.Init leaves torch's linear as it is (zero_optimization.memory_efficient_linear false)
    unless the DS config sets it: DeepSpeed's own linear made dynamo trace every layer on its own (compile_layers).
    zero.Init only ever patches its linear in, for the whole process: where the value is false and an earlier build in
    this process patched it (a rank that runs several jobs, as the test suite's rank pool), torch's comes back."""
    if compiled and zero3_compiles_layers(ds):
        ds["zero_optimization"].setdefault("memory_efficient_linear", False)
    if zero_stage(ds) == 3 and (ds.get("zero_optimization") or {}).get("memory_efficient_linear") is False:
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

        torch.nn.functional.linear = getattr(Init, "linear_bk", torch.nn.functional.linear)  # set by its first patch


def eager_linear_attention(model: torch.nn.Module) -> int:
    """Keep each linear-attention token mixer (Qwen3.5's Gated DeltaNet: a layer's `linear_attn`) out of the compiled
    layer; returns how many. Without the flash-linear-attention kernels transformers runs its chunked recurrence in
    PyTorch, a Python loop over the sequence's 64-token chunks that dynamo unrolls: the compile grows with the
    sequence (one layer on a CPU: 60 s at 128 tokens, 219 s at 2,048), and under ZeRO-3 each layer is traced on its
    own (compile_layers). On an H100 the tiny Qwen3.5 recipe's 20 steps took 130 s compiled against 39 s eager, at no
    better a speed (docs/benchmarks.md). train.compile "auto" leaves these mixers eager, the rest of the layer
    compiled; true compiles them too."""
    n = 0
    for layer in model.get_decoder().layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None and not getattr(mixer.forward, "_torchdynamo_disable", False):
            mixer.forward = torch.compiler.disable(mixer.forward)
            n += 1
    return n


def compile_layers(model: torch.nn.Module, dynamic: bool | None = False) -> list[str]:
    """Each decoder layer's forward compiled, AutoEP's routing, token movement and experts eager (a graph break, as
    DeepSpeed's compile.autoep_non_moe does under ZeRO-1/2), the shared experts inside each AutoEP block compiled on
    their own. Pretraining's train.compile: true under ZeRO-3 with decoder-layer leaves (ds_config.
    zero3_compiles_layers); GRPO's policy with train.compile: true under any ZeRO stage (`dynamic` None: its lengths
    change every step, so one trace per layer kind serves them). The forward function is compiled, not the module's
    call, so DeepSpeed's hooks on the layer (ZeRO-3: gather before, release after, its gradient reduce) stay eager
    around it and see the gathered weights only. The kernels round where the eager code does (Inductor's
    emulate_precision_casts): GRPO's reference and no-grad passes (layers eager) then agree with the compiled policy
    pass to the bit on the same weights (without it GRPO's KL at step 1, policy and reference equal, doubled on one
    H100: docs/benchmarks.md). Under ZeRO-3, DeepSpeed's linear (its memory_efficient_linear, an autograd function
    whose backward reads each weight's ZeRO-3 attributes) makes torch 2.11's dynamo guard on each weight's ds_id: one
    trace per layer, not one for all, so the recompile limit is raised to hold them (at its default of 8 the later
    layers of a 12-layer model ran eager, seen on that H100). Pretraining's build turns that linear off where it
    compiles the layers under ZeRO-3, unless the DS config sets it (docs/benchmarks.md: a shorter first step at the
    same peak memory, speed and losses). Returns what was compiled."""
    import types

    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    def compile_(fn):
        return torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True})

    done = []
    for name, module in model.named_modules():
        if isinstance(module, AutoEPMoELayer) and not getattr(module.forward, "_torchdynamo_disable", False):
            module.forward = torch.compiler.disable(module.forward)
            shared = getattr(module, "shared_experts", None)
            if shared is not None:
                shared.forward = compile_(shared.forward)
                done.append(f"{name}.shared_experts")
    layers = model.get_decoder().layers
    for i, layer in enumerate(layers):
        layer.forward = compile_(types.MethodType(type(layer).forward, layer))
        done.append(f"layers.{i}")
    # a static and a dynamic trace (dynamic None: the second length) per layer, and per block's shared experts
    limit = 2 * len(layers) + 2
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    return done


def compile_outside_autoep(model: torch.nn.Module) -> list[str]:
    """Compile what DeepSpeed's compile.autoep_non_moe leaves eager besides AutoEP's own routing and experts.

    DeepSpeed compiles each module that holds an AutoEP block (a decoder layer) and keeps the block eager. That
    leaves the decoder layers without one (DeepSeek-V3's first dense layers) and the shared experts inside each
    block (a plain MLP) eager too. Compiled here with the same settings; returns what was compiled.
    """
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    done = []
    layers = model.get_decoder().layers
    for i, layer in enumerate(layers):
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(dynamic=False)
            done.append(f"layers.{i}")
    for name, module in model.named_modules():
        shared = getattr(module, "shared_experts", None) if isinstance(module, AutoEPMoELayer) else None
        if shared is not None and getattr(shared, "_compiled_call_impl", None) is None:
            shared.compile(dynamic=False)
            done.append(f"{name}.shared_experts")
    return done


def train(recipe: Recipe, engine, data, tok, world: World) -> list[dict]:
    from deepspeed.accelerator import get_accelerator

    balance = ExpertBalance(engine.module, recipe.train.balance_rate, **pipeline.balance_layout(engine))
    state = (checkpoint.load(engine, recipe.run_dir, recipe.train.lr) if recipe.resume
             else {"step": 0, "position": 0, "tokens": 0})
    step, position, tokens = state["step"], state["position"], state["tokens"]
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * recipe.data.seq_len
    batches = ReadAhead(data.micro_batches(micro, *pipeline.data_coords(engine.config, world.rank, world.size),
                                           start=position), accum)
    train_step = pipeline.train_step if pipeline.is_pipeline(engine.config) else zero_step
    device = engine.device
    # Also: SIGTERM/SIGINT, or RUN_DIR/STOP appearing -> save at the next step boundary and stop.
    saver = checkpoint.Cadence(recipe.checkpoint, device, stop_file=Path(recipe.run_dir) / checkpoint.STOP_FILE)
    if batches.fill():
        saver.fail()
    if saver.agree_failed():  # some rank cannot read the first step's data: every rank stops before it
        saver.close()
        raise DataStop(batches.error, step + 1)
    metrics = Metrics(recipe.run_dir, recipe.train.max_steps, step, engine.monitor)
    ep = (engine.config.get("expert_parallel") or {}).get("autoep_size", 1)
    flops_tok = model_flops_per_token(engine, engine.module.config, recipe.data.seq_len, ep)[0]
    peak = peak_tflops(device)
    if step >= recipe.train.max_steps:
        print0(checkpoint.nothing_to_train(step, f"train.max_steps ({recipe.train.max_steps})"))
    # The rate's window: from the last row to this one, less the time spent saving checkpoints in between.
    rows, t0, loss_sum, logged, saving = [], time.time(), torch.zeros((), device=device), step, 0.0
    while step < recipe.train.max_steps:
        position, loss = train_step(engine, batches, accum, position)
        loss_sum += loss
        step, tokens = step + 1, tokens + tokens_per_step
        balance.after_step()
        metrics.advance()
        if step < recipe.train.max_steps and batches.fill():  # the next step's data, read before agreeing to go on
            saver.fail()
        save, stop = saver.due(step, recipe.train.max_steps)
        if step % recipe.train.log_every == 0 or step == recipe.train.max_steps or stop:
            n = step - logged  # steps since the last row (fewer after a resume or a stop)
            torch.distributed.all_reduce(loss_sum)
            mean_loss = loss_sum.item() / n / world.size  # waits for the device: the window holds all of its work
            elapsed = time.time() - t0 - saving
            per_rank = n * tokens_per_step / elapsed / world.size  # tokens/s
            row = {"step": step, "loss": mean_loss, "lr": engine.get_lr()[0],
                   "tokens_per_s": n * tokens_per_step / elapsed, "tokens_per_s_per_rank": per_rank,
                   "tflops_per_s_per_rank": per_rank * flops_tok / 1e12,
                   **({"mfu": per_rank * flops_tok / 1e12 / peak} if peak else {}),
                   "tokens": tokens, "world_size": world.size, **memory_stats(),
                   **grad_stats(engine), **balance.load_stats()}
            metrics.log(row)
            rows.append(row)
            t0, loss_sum, logged, saving = time.time(), torch.zeros((), device=device), step, 0.0
        if save:
            get_accelerator().synchronize()  # the step's own work stays in the window
            s0 = time.time()
            checkpoint.save(engine, recipe, {"step": step, "position": position, "tokens": tokens}, tok)
            saving += time.time() - s0
        if stop:  # a signal, the stop file, or a rank that cannot read the next step's data (then saved only with at_end)
            if not saver.failed:
                print0(f"stopped by {saver.why()} after step {step}; saved, continue with --resume")
            break
    saver.close()
    metrics.close()
    if saver.failed:
        raise DataStop(batches.error, step + 1, saved=save)
    return rows


def grad_stats(engine) -> dict:
    """The last step's global gradient norm (before clipping; inf when DeepSpeed skipped the step for a non-finite
    gradient) and the steps DeepSpeed has skipped so far: a skipped update is otherwise invisible in the rows."""
    norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    out = {"skipped_steps": int(getattr(engine, "skipped_steps", 0))}
    if norm is not None:
        out["grad_norm"] = float(norm)
    return out


class DataStop(Exception):
    """The run stopped because a rank could not read its data (`error`, None on the ranks that could)."""

    def __init__(self, error: ConfigError | None, step: int, saved: bool = False):
        self.error, self.step, self.saved = error, step, saved
        then = f"; saved step {step - 1}, continue with --resume once it is fixed" if saved else ""
        super().__init__(f"{error} (reading the data of step {step}{then})")


def zero_step(engine, batches, accum: int, position: int) -> tuple[int, torch.Tensor]:
    """One optimizer step over `accum` micro-batches; returns the data position and this rank's mean loss."""
    loss_sum = torch.zeros((), device=engine.device)
    for _ in range(accum):
        position, ids = next(batches)
        ids = to_device(ids, engine.device)  # (micro, seq_len)
        loss = engine(input_ids=ids, labels=ids).loss  # HF shifts labels inside
        engine.backward(loss)
        engine.step()  # DeepSpeed steps the optimizer on the last micro-batch of the accumulation
        loss_sum += loss.detach() / accum
    return position, loss_sum


def start_ranks(world: World, problem: ConfigError | None) -> bool:
    """init_distributed, then whether every rank's preflight passed; when one did not, rank 0 has printed what every
    rank found wrong as one `error:` line and the caller exits 2.

    A rank whose preflight failed joins too (fail_together) when the world has other ranks: its problem can be its own
    (node-local disks: a node without the checkpoint or the corpus), and each node's launcher watches only that node's
    ranks, so a rank that just exited left the other nodes' ranks waiting at the rendezvous for torch's timeout
    (10 min). A world of one with a problem stops before any of it."""
    if problem is None:
        try:
            init_distributed()
        except ConfigError as e:  # the rendezvous port is taken (rank 0; the launcher then stops this node's ranks)
            report_error(e, world)
            return False
        found = gather_problems(world, None)
    else:
        found = fail_together(world, problem) if world.size > 1 else str(problem)
    if found and world.rank == 0:
        print_error(f"error: {found}")
    return not found


FAIL_TOGETHER_S = 120  # how long a refusing rank waits for the others (a node that never started: its own line then)


def fail_together(world: World, problem: ConfigError) -> str:
    """This rank's preflight failed: join the other ranks only to tell them (and to hear theirs); when they do not come
    within FAIL_TOGETHER_S, its own problem."""
    try:
        peer_timeout()
        watchdog = True
    except PeerTimeoutError:  # already in `problem`; the other ranks' watchdogs give up on this one within their timeout
        watchdog = False
    try:
        init_distributed(watchdog=watchdog, timeout_s=FAIL_TOGETHER_S)
        return gather_problems(world, problem)
    except (RuntimeError, TimeoutError, ConfigError):  # torch's DistNetworkError / DistStoreError; a taken port
        return str(problem)


def gather_problems(world: World, problem: ConfigError | None) -> str | None:
    """Every rank's problem (a collective): each distinct one once, with the rank and host of any that is not rank
    0's, joined into one line; None when no rank has one."""
    import socket

    import torch.distributed as dist

    if world.size == 1:
        return None if problem is None else str(problem)
    found = [None] * world.size
    dist.all_gather_object(found, None if problem is None else (socket.gethostname(), str(problem)))
    parts: dict[str, list] = {}  # problem -> [first rank, its host, how many ranks]
    for r, f in enumerate(found):
        if f is not None:
            parts.setdefault(f[1], [r, f[0], 0])[2] += 1
    say = lambda r, host, n: "" if r == 0 else (f"rank {r} on {host}" + (f" (and {n - 1} other ranks)" if n > 1 else "")
                                                + ": ")  # noqa: E731
    return "; ".join(say(r, host, n) + msg for msg, (r, host, n) in parts.items()) or None


def report_error(e: Exception, world: World) -> None:
    """One line on stderr, after the launcher's own lines (engine/proc.py: print_error): from rank 0, and from each
    other node's first rank (node-local disks can differ)."""
    import os
    import socket

    if world.rank == 0:
        print_error(f"error: {e}")
    elif os.environ.get("LOCAL_RANK", "0") == "0":
        print_error(f"error on {socket.gethostname()} (rank {world.rank}): {e}")


def is_out_of_memory(e: BaseException) -> bool:
    """torch's allocator error, or a CUDA library's own failed allocation (cuBLAS, NCCL: a RuntimeError saying so)."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def out_of_memory(e: BaseException, ds: dict, built: bool, levers: str) -> str:
    """One line for a device out-of-memory error: where it happened, what torch could not allocate against what was
    free, the batch that ran, and what to change (`levers`: the command's own, after the batch size)."""
    import re

    msg = str(e)
    tried = re.search(r"Tried to allocate ([\d.]+ \w+)", msg)
    free = re.search(r"total capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", msg)
    said = (f": {tried.group(1)} wanted" if tried else "") + (
        f", {free.group(2)} free of {free.group(1)}" if free and tried else
        f": {free.group(2)} free of {free.group(1)}" if free else "")
    micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps", 1)
    if not built:
        return (f"out of device memory while building the model and its DeepSpeed engine{said}: its weights, gradients "
                "and optimizer states do not fit on this GPU; use a DeepSpeed config that partitions or offloads "
                "them (ds_configs/zero3.json on several GPUs, zero2_bf16_states.json or zero3_offload.json on one; "
                "docs/configs.md), or a smaller model")
    return (f"out of device memory while training at micro-batch {micro} x accumulation {accum}{said} (peak "
            f"{peak_memory_gib():.1f} GiB allocated); lower train_micro_batch_size_per_gpu in the DeepSpeed config "
            f"and raise gradient_accumulation_steps to keep the batch, {levers}")


def peak_memory_gib() -> float:
    """This rank's peak accelerator memory; on the CPU accelerator the process's peak RSS (the kernel's own maximum:
    DeepSpeed's CPU accelerator only samples RSS when asked, and misses what was freed in between)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)  # KiB on Linux
    return round(acc.max_memory_allocated() / 2**30, 3)


def memory_stats() -> dict:
    """The metrics row's memory fields: `peak_mem_gib` (peak_memory_gib), and on CUDA `alloc_retries`, this rank's
    count since start of the caching allocator's retries (an allocation that failed, then succeeded after the
    allocator freed its cached blocks and synchronized the device: a count that grows from row to row means the
    batch fits only just, and each retry costs time)."""
    from deepspeed.accelerator import get_accelerator

    row = {"peak_mem_gib": peak_memory_gib()}
    if get_accelerator().device_name() == "cuda":
        row["alloc_retries"] = int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
    return row


def forget_zero3_for_transformers() -> None:
    """Drop transformers' global DeepSpeed config (engine/model.py: build_model sets it and the model keeps it alive,
    and DeepSpeed keeps the engine): a model built later in the same process (a test, a notebook) would otherwise
    be built under zero.Init too, its parameters empty partitions."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def main(argv=None) -> int:
    args = parse_args(argv)
    world = world_from_env()
    problem = None
    try:
        recipe, ds, tok = preflight(args, world)
    except ConfigError as e:
        problem = e
    if not start_ranks(world, problem):
        return 2
    try:
        apply_memory_fraction(args.memory_fraction)
        check_ranks_agree(ds, world)
        built = False
        engine, data = build(recipe, ds, tok, world)  # map-style data is read and tokenized here, on every rank
        built = True
        rows = train(recipe, engine, data, tok, world)
    except ConfigError as e:  # bad data past preflight's sample, found on every rank
        report_error(e, world)
        return 2
    except DataStop as e:  # bad data found by some ranks while streaming; each of them says what it could not read
        if e.error is not None:
            print_error(f"error: {e}")
        return 1
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        report_error(out_of_memory(e, ds, built, "or set train.activation_checkpointing: true in the recipe"), world)
        return 1
    finally:
        forget_zero3_for_transformers()
    if rows:  # none when resumed at max_steps
        print0(f"done: {rows[-1]['step']} steps, final loss {rows[-1]['loss']:.4f}, run_dir {recipe.run_dir}")
    return 0

#!/usr/bin/env python3
"""Training throughput benchmark: trains a recipe for N steps under a DS config and prints a table.

    deepspeed --num_gpus 1 bin/bench.py --deepspeed_config ds_configs/zero3.json \
        --config engine/recipes/deepseek_2b6.yaml --steps 20 --out bench.jsonl [--no_autoep] [--micro_batch 8]

Each run appends one JSON row to --out and prints the table of every row in that file, so a baseline and
the engine measured one after the other land in one table. Columns:
  tokens/s/GPU   tokens per second per rank, over the timed steps (after --warmup steps)
  MFU            model FLOPs per second per GPU / the GPU's dense bf16 peak (engine/flops.py: 989 TFLOP/s on an
                 H100/H200 SXM, 756 on an H100 PCIe, ...; 989 where the device is not listed). Model FLOPs per token =
                 6 x active non-embedding parameters (every parameter except the input embedding; routed
                 experts counted at experts_per_token / num_experts) + attention: 3 (fwd+bwd) x layers x
                 2 x seq_len x heads x (qk_head_dim + v_head_dim) (no causal discount, as in PaLM)
  fwd/bwd/step   mean milliseconds per optimizer step in forward, backward and optimizer step: device events
                 on GPUs, read once after the timed steps, so nothing inside the timed window waits for the
                 device (the host queues work ahead, as in training); wall clock on the CPU
  peak GiB       peak accelerator memory of rank 0 (peak RSS on CPU)
--plain_head runs transformers' own forward and loss (the whole micro-batch's logits, fp32 for the loss) instead of
the engine's chunked output layer (engine/head.py), to compare the two. --no_autoep drops the DS config's expert_parallel section: the same HF model under plain ZeRO-3 with its
own MoE block (what HF Trainer + DeepSpeed gives). --micro_batch overrides train_micro_batch_size_per_gpu
("auto" in the file, as in the shipped zero2.json/zero3.json, is chosen for the device's memory x --memory_fraction).
--set KEY=VALUE changes the recipe (e.g. train.activation_checkpointing=true), --ds_set KEY=VALUE the DS config
(e.g. zero_optimization.stage=2); values are YAML. --label names the row. --profile N profiles N more steps
with torch.profiler and prints the operators that take the most device time and the time's shares by kind (routed
experts' GEMMs and FP8 casts, attention, dense GEMMs, optimizer, communication, the rest) and, on a GPU, the
gaps where the device waited for the host by host operator (engine/devprof.py); also written to OUT.profile.txt.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import yaml  # noqa: E402

from engine.auto_batch import AutoBatch, device_memory_gib, settle_checkpointing  # noqa: E402
from engine.config import ConfigError, load_recipe  # noqa: E402
from engine.ds_config import read_ds_config, resolve_ds_config  # noqa: E402
from engine.data import load_tokenizer, to_device  # noqa: E402
from engine.devprof import idle_report  # noqa: E402
from engine.metrics import DeviceClock, json_line  # noqa: E402
from engine.parallel import device_kind, world_from_env  # noqa: E402
from engine import pipeline, pretrain  # noqa: E402
from engine.flops import H100_SXM_BF16_TFLOPS, model_flops_per_token, peak_tflops  # noqa: E402
from engine.proc import print_error  # noqa: E402



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--config", default=None, help="recipe YAML (default: the embedded tiny recipe)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="bench.jsonl")
    ap.add_argument("--no_autoep", action="store_true")
    ap.add_argument("--micro_batch", type=int)
    ap.add_argument("--memory_fraction", type=float, help="cap GPU memory (e.g. 80 GB of an H200: 0.56)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    ap.add_argument("--ds_set", action="append", default=[], metavar="KEY=VALUE", help="DS config override")
    ap.add_argument("--plain_head", action="store_true",
                    help="transformers' forward and loss (full logits) instead of engine/head.py's chunked output layer")
    ap.add_argument("--label", default="")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    world = world_from_env()
    try:
        check_args(args)
        recipe = load_recipe(args.config, {**parse_sets(args.set, "--set"),
                                           "train.max_steps": args.warmup + args.steps + args.profile})
        raw = read_ds_config(args.deepspeed_config)
        if args.no_autoep:
            raw.pop("expert_parallel", None)
        if args.micro_batch:
            raw["train_micro_batch_size_per_gpu"] = args.micro_batch
        for dotted, value in parse_sets(args.ds_set, "--ds_set").items():
            *path, key = dotted.split(".")
            node = raw
            for i, part in enumerate(path):
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"--ds_set {dotted}: {'.'.join(path[:i + 1])} is {node!r} in "
                                      f"{args.deepspeed_config}, not a section; set it whole or name a section's key")
            node[key] = value
        wanted = "auto" in (raw.get("train_micro_batch_size_per_gpu"), raw.get("gradient_accumulation_steps"))
        auto = AutoBatch(memory_gib=device_memory_gib(device_kind(), args.memory_fraction) if wanted else None)
        ds = resolve_ds_config(raw, recipe, world.size, world.local_size, device=device_kind(), auto_batch=auto)
        recipe = settle_checkpointing(recipe, auto)
        tok = load_tokenizer(recipe.data.tokenizer)
    except ConfigError as e:
        if world.rank == 0:
            print_error(f"error: {e}")
        return 2
    if auto.note and world.rank == 0:
        print(auto.note, flush=True)
    if not pretrain.start_ranks(world, None):  # init_distributed; a taken rendezvous port is its one error line
        return 2
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if args.memory_fraction and acc.device_name() == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    engine, data = pretrain.build(recipe, ds, tok, world)
    if args.plain_head:
        from engine.head import uninstall

        uninstall(engine.module)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    ep = (ds.get("expert_parallel") or {}).get("autoep_size", 1)
    batches = data.micro_batches(micro, *pipeline.data_coords(ds, world.rank, world.size))
    timer = PhaseTimer(acc)
    losses = []  # mean loss of every optimizer step (a device tensor until the end), warmup included

    def train_step():
        total = 0.0
        for _ in range(accum):
            _, ids = next(batches)
            ids = to_device(ids, engine.device)
            t0 = timer.mark()
            loss = engine(input_ids=ids, labels=ids).loss
            t1 = timer.mark()
            engine.backward(loss)
            t2 = timer.mark()
            engine.step()
            timer.add(t0, t1, t2, timer.mark())
            total = total + loss.detach()
        losses.append(total / accum)
        return loss

    if pipeline.is_pipeline(ds):  # train_batch runs the whole schedule: no separate fwd/bwd/step times
        def train_step():
            loss = pipeline.train_step(engine, batches, accum, 0)[1]
            losses.append(loss)
            return loss

    for _ in range(args.warmup):
        train_step()
    acc.synchronize()
    timer.marks.clear()
    acc.reset_max_memory_allocated()
    t_start = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step()
    acc.synchronize()  # the only wait in the timed window: at its end
    elapsed = time.perf_counter() - t_start
    times = timer.totals()
    peak_gib = pretrain.peak_memory_gib()  # the timed steps' (the profiled ones come after)
    if args.profile:
        profile(train_step, args.profile, acc.device_name(), f"{args.out}.profile.txt", world.rank)
    tokens_per_rank = args.steps * engine.train_batch_size() * recipe.data.seq_len / world.size
    flops_tok, total, active = model_flops_per_token(engine, engine.module.config, recipe.data.seq_len, ep)
    tps = tokens_per_rank / elapsed
    peak = peak_tflops(engine.device) or H100_SXM_BF16_TFLOPS
    row = {"label": args.label, "recipe": Path(args.config or "tiny.yaml").name, "ds_config": Path(args.deepspeed_config).name,
           "autoep": not args.no_autoep and bool(ds.get("expert_parallel")), "ep": ep, "world": world.size, "stages": pipeline.num_stages(ds),
           "micro": micro, "accum": accum, "seq": recipe.data.seq_len, "vocab": engine.module.config.vocab_size,
           "head": "plain" if args.plain_head else "chunked", "device": acc.device_name(),
           "params_m": round(total / 1e6, 3), "active_m": round(active / 1e6, 3),
           "tokens_per_s_per_gpu": round(tps), "mfu": float(f"{tps * flops_tok / (peak * 1e12):.4g}"),
           **{f"{k}_ms": round(1000 * v / args.steps, 1) if v else None for k, v in times.items()},
           "peak_gib": round(peak_gib, 2), "loss": round(loss.item(), 4),
           "losses": [round(float(x), 4) for x in losses[:args.warmup + args.steps]],
           "sets": args.set, "ds_sets": args.ds_set, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if world.rank == 0:
        with open(args.out, "a") as f:
            f.write(json_line(row) + "\n")
        print_table([json.loads(line) for line in open(args.out)])
    return 0


def check_args(args) -> None:
    """The numeric flags and --out, before anything is built: one line naming each problem."""
    p = []
    if args.steps < 1:
        p.append(f"--steps {args.steps}: must be >= 1 (the timed steps)")
    if args.warmup < 0 or args.profile < 0:
        p.append(f"--warmup {args.warmup} / --profile {args.profile}: must be >= 0")
    if args.micro_batch is not None and args.micro_batch < 1:
        p.append(f"--micro_batch {args.micro_batch}: must be >= 1 (leave it out for the DS config's value)")
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        p.append(f"--memory_fraction {args.memory_fraction}: must be in (0, 1], e.g. 0.5596 for 80 GB of an H200")
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
        p.append(f"--out {args.out}: {out_dir} is not a writable directory; create it or name another file")
    if p:
        raise ConfigError("; ".join(p))


def parse_sets(items: list[str], flag: str) -> dict:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} train.lr=1e-4")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"{flag} {item!r}: the value is not YAML ({getattr(e, 'problem', None) or e}); quote "
                              f"it for the shell, e.g. {flag} '{key}=[1, 2]'") from None
    return out


class PhaseTimer:
    """Forward / backward / optimizer-step time without making the host wait for the device: CUDA events
    recorded on the stream and read after the timed window; the wall clock on the CPU accelerator, whose ops
    run as they are called."""

    def __init__(self, acc):
        self.clock = DeviceClock(acc)
        self.mark = self.clock.mark
        self.marks = []  # (start, after forward, after backward, after step) per micro-batch

    def add(self, *marks) -> None:
        self.marks.append(marks)

    def totals(self) -> dict:
        """Seconds in each phase, summed over the marked micro-batches (call after synchronizing)."""
        gap = self.clock.seconds
        out = {"fwd": 0.0, "bwd": 0.0, "step": 0.0}
        for t0, t1, t2, t3 in self.marks:
            out["fwd"] += gap(t0, t1)
            out["bwd"] += gap(t1, t2)
            out["step"] += gap(t2, t3)
        return out


def profile(train_step, steps: int, device: str, path: str, rank: int) -> None:
    """torch.profiler over `steps` training steps; rank 0 prints the top operators by device time, the time's shares
    by kind (by operator, and on a GPU by kernel name too), how busy the device was over the profiled wall time and
    (GPU) the idle gaps between kernels by the host operator behind them (engine/devprof.py)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step()
        sync()
        wall = time.perf_counter() - t0
    if rank == 0:
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        events = prof.key_averages()
        table = events.table(sort_by=key, row_limit=40, max_name_column_width=70)
        table += "\n" + time_shares(events, device) + "\n"
        if device == "cuda":
            table += kernel_shares(events, wall) + "\n"
            table += idle_report(prof.events()) + "\n"  # where the device waited, for which host operator
        Path(path).write_text(table)
        print(table)


# Operator names by what they compute, first match wins (aten ops and the custom ops of torchao and DeepSpeed).
SHARES = (
    ("routed experts: grouped GEMMs", ("_grouped_mm", "group_gemm")),
    # torchao's Triton casts, launched from its autograd function (_Float8GroupedMM) or as its custom ops
    ("routed experts: FP8 casts and scales", ("float8groupedmm", "fp8_rowwise", "fp8_colwise", "fp8_per_group")),
    ("attention", ("attention", "flash", "sdpa")),
    ("dense GEMMs (incl. output layer; FP8 ones too)", ("aten::mm", "aten::addmm", "aten::bmm", "_scaled_mm", "aten::linear")),
    ("optimizer", ("adam", "multi_tensor", "_foreach")),
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "all_to_all", "gloo")),
)
REST = "everything else (elementwise, norms, compiled kernels, copies)"
# Host-side markers that are not operators: a full launch queue is recorded as an event spanning the kernels the host
# waited on (5 s of "device time" in 2 profiled torchtitan steps of 2.4 s each), which would count them twice.
STALLS = ("Command Buffer Full",)


def time_shares(events, device: str) -> str:
    """The profile's self device time (self CPU time on a CPU) of the operators (the host-side events, each holding
    the time of the kernels it launched) summed by SHARES, largest first, as one line each."""
    from torch.autograd import DeviceType

    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    sums = {name: 0.0 for name, _ in SHARES} | {REST: 0.0}
    for e in events:
        if e.device_type != DeviceType.CPU or e.key in STALLS:  # kernels' own rows: their time is their op's too
            continue
        t = float(getattr(e, attr, 0) or 0)
        low = e.key.lower()
        name = next((n for n, keys in SHARES if any(k.lower() in low for k in keys)), REST)
        sums[name] += t
    total = sum(sums.values()) or 1.0
    return "\n".join(["time shares (self " + ("device" if device == "cuda" else "CPU") + f" time, {total / 1e3:.1f} ms):"]
                     + [f"  {100 * t / total:5.1f}%  {n}" for n, t in sorted(sums.items(), key=lambda x: -x[1])])


# Kernel names (the device-side rows) by what they compute, first match wins: a view that does not depend on which
# host-side op launched a kernel (under torch.compile most kernels are launched by one compiled graph).
KERNELS = (
    ("routed experts: grouped GEMMs", ("groupproblemshape", "grouped", "group_gemm")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("dense GEMMs (cuBLAS, CUTLASS, Triton templates)", ("gemm", "nvjet", "xmma", "cutlass", "triton_tem", "splitk")),
    ("optimizer", ("adam", "multi_tensor")),
    ("communication", ("nccl",)),
)


def kernel_shares(events, wall_s: float) -> str:
    """The device kernels' time summed by KERNELS (the rest: elementwise, reductions, norms, copies, fused Triton),
    and the kernels' total against the profiled wall time: how busy the device was."""
    from torch.autograd import DeviceType

    rest = "everything else (elementwise, reductions, norms, copies, fused Triton)"
    sums = {name: 0.0 for name, _ in KERNELS} | {rest: 0.0}
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        low = e.key.lower()
        name = next((n for n, keys in KERNELS if any(k in low for k in keys)), rest)
        sums[name] += float(e.self_device_time_total or 0)
    total = sum(sums.values())
    busy = f", device busy {100 * total / 1e6 / wall_s:.1f}% of {wall_s:.3g} s wall" if wall_s > 0 else ""
    return "\n".join([f"kernel shares (kernel time {total / 1e3:.1f} ms{busy}):"]
                     + [f"  {100 * t / (total or 1):5.1f}%  {n}" for n, t in sorted(sums.items(), key=lambda x: -x[1])])


def print_table(rows: list[dict]) -> None:
    cols = ["label", "recipe", "ds_config", "autoep", "world", "ep", "micro", "seq", "vocab", "head", "params_m", "active_m", "tokens_per_s_per_gpu", "mfu", "fwd_ms",
            "bwd_ms", "step_ms", "peak_gib"]
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(main())

#!/usr/bin/env python3
"""TRL's GRPOTrainer on the engine's GRPO workload, timed per optimizer step: the baseline bin/grpo.py is
compared against (docs/bench/grpo_vs_trl.sh runs both in one device call).

    deepspeed --num_gpus 1 docs/bench/trl_grpo.py --model /tmp/init_2b6 --out trl.jsonl          # GPU, ZeRO-3
    python3 docs/bench/trl_grpo.py --model /tmp/init_tiny --no_deepspeed --max_new_tokens 4 \\
        --steps 2 --fp32 --out trl.jsonl                                                       # CPU smoke test

Workload, as bin/grpo.py runs it with ds_configs/zero3_grpo.json and grpo_2b6.yaml (beta 0.04): per optimizer step
--prompts_per_step (8) prompts x --group_size (8) completions x --max_new_tokens (256) new tokens, temperature 1.0,
top_p 1.0, KL weight beta 0.04 (TRL's KL term is the k3 estimator), one optimizer step per rollout batch
(num_iterations 1; per-device batch 16 x 4 accumulation steps = 64 completions, so TRL's generation batch is 64
and steps_per_generation 4: one generate call per optimizer step, and no old-policy forward, since generation
and optimizer steps line up), lr 1e-6 constant, clipping 0.2 / 0.28 (the engine's clip_low / clip_high), the "grpo"
loss aggregation (the engine's default), group-std scaling, no gradient checkpointing (the engine has none on).
Completions are forced to --max_new_tokens tokens with transformers' `min_new_tokens` (TRL's generation_kwargs:
EOS is masked out of the logits until that many tokens exist), so every step trains 64 full-length sequences;
--no_force_length lets them stop at EOS. Reward: the engine's `numeric` reward (first number vs the answer),
imported from engine.rewards and wrapped as a TRL reward function.

DeepSpeed: --ds_config (default ds_configs/zero3_grpo.json) passed to TRL through GRPOConfig's `deepspeed` arg,
with `expert_parallel` removed (AutoEP is this engine's layer swap; TRL trains the Hugging Face MoE as it is) and
the batch sizes, lr, Adam betas/eps/weight decay, gradient clipping and bf16 set to "auto", filled by
transformers from the same values given as training arguments (read from the file). ZeRO stage and its knobs
are the file's (ZeRO-3 gather settings left "auto" resolved as bin/grpo.py does). TRL gathers the ZeRO-3
parameters once per generate call (ds3_gather_for_generation, default).

Timing: a TrainerCallback takes the wall time from on_step_begin to on_step_end of every optimizer step
(generation, reference and policy forwards, backward, optimizer step), after a device synchronize; the rollout
(TRL's generate call) is timed the same way. One JSON row is printed and appended to --out (rank 0):
{"system": "trl", "ds_config", "steps_s", "median_step_s" (steps 2..N), "rollout_s", "median_rollout_s",
"rollout_tokens_per_s", "completion_len", TRL's logged metrics per step, settings, versions}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="TRL GRPOTrainer on the engine's GRPO workload, timed per step")
    ap.add_argument("--model", required=True, help="Hugging Face model dir (docs/bench/save_random_model.py)")
    ap.add_argument("--prompts", default=os.path.join(ROOT, "engine/assets/arith_train.jsonl"),
                    help="jsonl with `prompt` and `answer` columns")
    ap.add_argument("--out", required=True, help="jsonl file: one row appended")
    ap.add_argument("--label", default="trl")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--prompts_per_step", type=int, default=8)
    ap.add_argument("--group_size", type=int, default=8, help="G: completions per prompt (num_generations)")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--micro_batch", type=int, default=16, help="per_device_train_batch_size")
    ap.add_argument("--grad_accum", type=int, default=4, help="gradient_accumulation_steps")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--loss_type", default="grpo", help="TRL loss_type (TRL's default is dapo; the engine's is grpo)")
    ap.add_argument("--ds_config", default=os.path.join(ROOT, "ds_configs/zero3_grpo.json"))
    ap.add_argument("--no_deepspeed", action="store_true", help="plain Trainer, no DeepSpeed (CPU smoke test)")
    ap.add_argument("--no_force_length", action="store_true", help="let completions stop at EOS")
    ap.add_argument("--gradient_checkpointing", action="store_true", help="TRL's default; off to match the engine")
    ap.add_argument("--cache_implementation", default=None, help="e.g. static (TRL's default: none, dynamic cache)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 (CPU)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--output_dir", default="/tmp/trl_grpo_run", help="TRL's output_dir (nothing is saved there)")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def trl_ds_config(path: str, bf16: bool, world: int, device: str) -> tuple[dict, dict]:
    """The DS config for TRL: the file without expert_parallel, with the values transformers checks against its
    training arguments set to "auto"; and those training arguments, read from the file. ZeRO-3's gather settings
    left "auto" get the numbers bin/grpo.py gives them (engine/ds_config.py ZERO3_GATHER): transformers has no "auto"
    for stage3_max_live_parameters / stage3_max_reuse_distance and refuses the file otherwise."""
    from engine.ds_config import resolve_zero3_gather

    with open(path) as f:
        ds = json.load(f)
    ds.pop("expert_parallel", None)
    resolve_zero3_gather(ds, world, device)
    zero = ds.get("zero_optimization") or {}
    if zero.get("leaf_module") == "auto":  # the engine's own value (decoder-layer leaves); TRL runs as its users
        del zero["leaf_module"]            # would, with DeepSpeed's hook per module (accelerate refuses the "auto")
    targs = {}
    opt = ds.get("optimizer", {}).get("params", {})
    if "betas" in opt and opt["betas"] != "auto":
        targs["adam_beta1"], targs["adam_beta2"] = opt["betas"]
    if "eps" in opt and opt["eps"] != "auto":
        targs["adam_epsilon"] = opt["eps"]
    if "weight_decay" in opt and opt["weight_decay"] != "auto":
        targs["weight_decay"] = opt["weight_decay"]
    for k in ("lr", "betas", "eps", "weight_decay"):
        if k in opt:
            opt[k] = "auto"
    if isinstance(ds.get("gradient_clipping"), (int, float)):
        targs["max_grad_norm"] = ds["gradient_clipping"]
        ds["gradient_clipping"] = "auto"
    for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        ds[k] = "auto"
    if "bf16" in ds or bf16:
        ds["bf16"] = {**ds.get("bf16", {}), "enabled": "auto"}
    ds.pop("fp16", None)
    return ds, targs


def load_prompts(path: str):
    import datasets

    ds = datasets.load_dataset("json", data_files=path, split="train")
    missing = {"prompt", "answer"} - set(ds.column_names)
    if missing:
        raise SystemExit(f"error: {path}: needs `prompt` and `answer` columns (missing {sorted(missing)})")
    return ds


def numeric_reward(prompts, completions, answer, **_):
    """The engine's `numeric` reward (which: first), as a TRL reward function; a failure scores 0.0 as in the engine."""
    from engine.rewards import numeric

    out = []
    for p, c, a in zip(prompts, completions, answer):
        try:
            out.append(numeric(p, c, a, which="first"))
        except Exception:  # noqa: BLE001  (the engine scores a failing sample 0.0)
            out.append(0.0)
    return out


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    n_seq = args.prompts_per_step * args.group_size
    if args.micro_batch * args.grad_accum * world != n_seq:
        raise SystemExit(f"error: micro_batch {args.micro_batch} x grad_accum {args.grad_accum} x world {world} must "
                         f"equal prompts_per_step x group_size = {n_seq} (one optimizer step per rollout batch)")
    bf16 = not args.fp32
    ds_dict, targs = (None, {}) if args.no_deepspeed else trl_ds_config(args.ds_config, bf16, world,
                                                                           "cuda" if torch.cuda.is_available() else "cpu")
    ds_name = "none" if args.no_deepspeed else (os.path.relpath(args.ds_config, ROOT) if args.ds_config.startswith(ROOT)
                                                else args.ds_config) + " (expert_parallel removed)"
    generation_kwargs = None if args.no_force_length else {"min_new_tokens": args.max_new_tokens}
    settings = dict(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        beta=args.beta, num_iterations=1, loss_type=args.loss_type, epsilon=0.2, epsilon_high=0.28,
        scale_rewards="group", learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        gradient_checkpointing=args.gradient_checkpointing, bf16=bf16, fp16=False,
        model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"}, generation_kwargs=generation_kwargs,
        cache_implementation=args.cache_implementation, ds3_gather_for_generation=True,
        use_cpu=not torch.cuda.is_available(), logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=args.seed, **targs)
    config = GRPOConfig(deepspeed=ds_dict, **settings)  # before the model: ZeRO-3 loads it under zero.Init
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    dataset = load_prompts(args.prompts)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.steps, self.logs, self.t_train = None, [], [], None

        def on_train_begin(self, a, state, control, **kw):
            _sync()
            self.t_train = time.perf_counter()

        def on_step_begin(self, a, state, control, **kw):
            _sync()
            self.begin = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            _sync()
            self.steps.append(time.perf_counter() - self.begin)
            if rank == 0:
                print(f"trl step {state.global_step}: {self.steps[-1]:.3f}s", flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs:
                self.logs.append({"step": state.global_step, **logs})

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its generate call timed (nothing else changed)."""
        rollout_s: list = []

        def _generate_single_turn(self, *a, **kw):
            _sync()
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            _sync()
            self.rollout_s.append(time.perf_counter() - t0)
            return out

    timer = StepTimer()
    t0 = time.time()
    trainer = TimedGRPOTrainer(model=args.model, reward_funcs=numeric_reward, args=config, train_dataset=dataset,
                               processing_class=tok, callbacks=[timer])
    setup_s = time.time() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    train_s = time.perf_counter() - timer.t_train

    if rank != 0:
        return 0
    engine = trainer.model_wrapped
    zero_stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    ds_used = plugin.deepspeed_config if plugin is not None else None  # with transformers' "auto" values filled
    steps = timer.steps
    rollouts = TimedGRPOTrainer.rollout_s
    med = lambda xs: statistics.median(xs[1:]) if len(xs) > 1 else (xs[0] if xs else None)  # noqa: E731
    per_step = [l for l in timer.logs if "loss" in l]
    key = lambda name: [l.get(name) for l in per_step]  # noqa: E731
    comp_len = key("completions/mean_length")
    n_tok = [n_seq * c for c in comp_len] if all(c is not None for c in comp_len) and comp_len else None
    roll_tps = ([t / r for t, r in zip(n_tok, rollouts)] if n_tok and len(n_tok) == len(rollouts)
                else [n_seq * args.max_new_tokens / r for r in rollouts])
    row = {
        "system": "trl", "label": args.label, "ds_config": ds_name, "steps": len(steps), "steps_s": steps,
        "median_step_s": med(steps), "rollout_s": rollouts, "median_rollout_s": med(rollouts),
        "rollout_tokens_per_s": med(roll_tps), "gen_ms_per_token_step": (
            med(rollouts) * 1000 / args.max_new_tokens if rollouts else None),
        "completion_len": comp_len, "completion_min_len": key("completions/min_length"),
        "trl_step_time": key("step_time"), "reward": key("reward"), "kl": key("kl"), "loss": key("loss"),
        "setup_s": setup_s, "train_s": train_s,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "workload": {"prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                     "max_new_tokens": args.max_new_tokens, "forced_length": not args.no_force_length,
                     "micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "world": world},
        "trl_settings": {k: v for k, v in settings.items() if k not in ("output_dir", "disable_tqdm", "report_to")},
        "zero_stage": zero_stage, "ds_config_resolved": ds_used, "model": args.model,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "deepspeed": _version("deepspeed")},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "total_s": time.time() - t_start,
    }
    line = json.dumps(_finite(row))
    print(line, flush=True)
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(line + "\n")
    return 0


def _finite(x):
    """JSON without Infinity/NaN (transformers sets steps_per_print to inf)."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _version(name: str):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())

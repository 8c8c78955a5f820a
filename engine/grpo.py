"""GRPO: a second DeepSpeed engine on the partitioned policy.

One step: prompts -> rollouts (G per prompt) -> rewards -> group advantages -> old log-probs (policy) and
reference log-probs (reference engine) -> `iterations` optimizer steps on the clipped surrogate (+ KL).
The reference is a DeepSpeed engine without optimizer whose ZeRO-3 shards are copied one to one from the
policy's (no full gather); with grpo.beta == 0 it is not built.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint
from .config import ConfigError, GRPOConfig, Recipe, load_recipe
from .data import load_tokenizer
from .ds_config import read_ds_config, resolve_ds_config
from .grpo_math import GRPOLossConfig, group_advantages, keep_mask, policy_loss, token_entropy, token_logprobs
from .metrics import Metrics, print0
from .model import build_model
from .pretrain import peak_memory_gib, report_error
from .parallel import World, build_engine, device_kind, init_distributed, model_dtype, world_from_env
from .rewards import build_rewards
from .rollout import build_rollout
from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

DEFAULT_RECIPE = Path(__file__).resolve().parent / "recipes" / "grpo_tiny.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="GRPO on a pretrained MoE (start it with the deepspeed launcher).")
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--config", default=str(DEFAULT_RECIPE), help="recipe YAML with a grpo: section")
    ap.add_argument("--init_from", help="a pretraining run dir or checkpoint dir, or a Hugging Face model dir")
    ap.add_argument("--max_steps", type=int)
    ap.add_argument("--run_dir")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--data", help="prompts: jsonl/parquet with `prompt` and `answer` columns")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def load_prompts(path: str, where: str = "data.path") -> list[dict]:
    """Rows of `prompt` (a string) and `answer` (a string or number); a bad file is one ConfigError naming `where`."""
    from datasets.utils.logging import disable_progress_bar

    from .data import load_documents
    from .data_check import check_prompt_file, row_problem, PROMPT_FIELDS
    from .config import DataConfig

    check_prompt_file(path, where)  # the file's head, before datasets reads it (empty, not text, rows without fields)
    disable_progress_bar()  # preflight: a bad input must be the only line on stderr
    ds = load_documents(DataConfig(path=path, text_field="prompt"))
    if "answer" not in ds.column_names:
        raise ConfigError(f"{where} {path}: needs an `answer` column next to `prompt` (columns: {ds.column_names})")
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in ds]
    bad = [(i, why) for i, why in enumerate(map(lambda r: row_problem(r, PROMPT_FIELDS), rows)) if why]
    if bad:  # past the head checked above: every row is in memory now
        raise ConfigError(f"{where} {path}: row {bad[0][0]} {bad[0][1]} (bad: {len(bad)} of the {len(rows)} rows); "
                          "fix those rows")
    return rows


def resolve_init(init_from: str | None, recipe: Recipe) -> str | None:
    """An HF model dir to load: as given, or exported from a pretraining run/checkpoint (done on rank 0)."""
    if init_from is None:
        return recipe.model.init_from
    p = Path(init_from)
    if (p / "config.json").is_file():
        return str(p)
    if not p.exists():
        raise ConfigError(f"--init_from {init_from}: no such directory (give a pretraining run dir, its "
                          "checkpoints/ dir, a step_* dir, or a Hugging Face model dir)")
    from .export import ExportError, find_tag_dir

    try:
        find_tag_dir(p, None)
    except ExportError as e:
        raise ConfigError(f"--init_from {init_from}: neither a Hugging Face model dir (no config.json) nor a "
                          f"checkpoint: {e}") from None
    return None  # a DeepSpeed checkpoint: exported in main()


def model_context(init_from: str | None, init: str | None, recipe: Recipe) -> int:
    """max_position_embeddings of the model that will be trained: the loaded model's, not the recipe's."""
    if init is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(init).max_position_embeddings
    if init_from is not None:
        from .export import ExportError, find_tag_dir, recorded_hf_config

        tag = find_tag_dir(init_from, None)
        try:
            state = json.loads((tag / checkpoint.STATE_FILE).read_text())
            return recorded_hf_config(tag, state).max_position_embeddings
        except (OSError, ValueError, KeyError, ExportError) as e:
            raise ConfigError(f"--init_from {init_from}: cannot read the model's config from {tag}: {e}") from None
    return recipe.model.max_position_embeddings


def loss_config(g: GRPOConfig) -> GRPOLossConfig:
    """The loss fields of the recipe's grpo section, as the math module takes them."""
    return GRPOLossConfig(clip_low=g.clip_low, clip_high=g.clip_high, beta=g.beta, kl=g.kl, aggregation=g.aggregation,
                          normalize_std=g.normalize_std, max_new_tokens=g.max_new_tokens)


def preflight(args, world: World):
    o = {k: v for k, v in {"train.max_steps": args.max_steps, "run_dir": args.run_dir,
                           "data.path": args.data}.items() if v is not None}
    if args.resume:
        o["resume"] = True
    recipe = load_recipe(args.config, o)
    ds = resolve_ds_config(read_ds_config(args.deepspeed_config), recipe, world.size, world.local_size,
                           where=f"DeepSpeed config {args.deepspeed_config}", device=device_kind())
    g = recipe.grpo
    per_rank = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    problems = loss_config(g).validate()
    if "pipeline" in ds:
        problems.append(f"DeepSpeed config {args.deepspeed_config}: GRPO runs on ZeRO configs (zero3_grpo.json), not "
                        "pipeline stages; a pipeline run's checkpoint can still be its --init_from")
    if per_rank % g.group_size:
        problems.append(f"grpo.group_size ({g.group_size}) must divide train_micro_batch_size_per_gpu x "
                        f"gradient_accumulation_steps ({per_rank}): each rank's batch is whole groups")
    try:
        rewards = build_rewards(g.rewards, where="grpo.rewards")
    except ConfigError as e:
        problems.append(str(e))
        rewards = None
    tok = load_tokenizer(recipe.data.tokenizer)
    prompts = load_prompts(recipe.data.path)
    evals = load_prompts(g.eval_path, "grpo.eval_path") if g.eval_path else []
    init = resolve_init(args.init_from, recipe)
    limit = model_context(args.init_from, init, recipe)
    for name, rows in (("data.path", prompts), ("grpo.eval_path", evals)):
        for i, r in enumerate(rows):
            n = len(tok(r["prompt"])["input_ids"])
            if n + g.max_new_tokens > limit:
                problems.append(f"{name} row {i}: prompt of {n} tokens + grpo.max_new_tokens {g.max_new_tokens} "
                                f"exceeds the context ({limit}); shorten it or lower max_new_tokens")
                break
    if recipe.resume:  # as in pretraining: checked, and converted to the universal format on a new shape
        found, universal = checkpoint.check_resume(recipe, ds, world.size, world.rank)
        problems += found
        if universal:
            ds.setdefault("checkpoint", {})["load_universal"] = True
    if problems:
        raise ConfigError("; ".join(problems))
    if recipe.resume and ds.get("checkpoint", {}).get("load_universal") and world.rank == 0:
        checkpoint.to_universal(recipe.run_dir)  # the other ranks wait for rank 0 in init_distributed
    return recipe, ds, tok, prompts, evals, rewards, init


def left_pad(texts: list[str], tok, device) -> RolloutRequest:
    enc = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):], attn[i, width - len(e):] = torch.tensor(e), 1
    return RolloutRequest(ids.to(device), attn.to(device))


def forward_logps(engine, ids, attn, with_entropy: bool = False):
    """Per-token log-probs of ids[:, 1:] (and entropy) under `engine`; positions follow the left padding."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = engine(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1].float()  # (N, T-1, V)
    logp = token_logprobs(logits, ids[:, 1:])  # (N, T-1)
    return logp, (token_entropy(logits) if with_entropy else None)


def build_reference(policy, recipe: Recipe, ds: dict, tok):
    """An optimizer-free DeepSpeed engine holding a copy of the policy's local ZeRO-3 shards."""
    ref_ds = {k: v for k, v in ds.items() if k != "optimizer"}
    model = build_model(recipe.model, ref_ds, tok, dtype=model_dtype(ds), hf_config=policy.module.config)
    ref = build_engine(model, ref_ds)
    with torch.no_grad():
        pol = dict(policy.module.named_parameters())
        for name, p in ref.module.named_parameters():
            q = pol[name]
            if hasattr(p, "ds_tensor"):
                assert p.ds_tensor.shape == q.ds_tensor.shape, f"ZeRO-3 shards of {name} do not line up"
                p.ds_tensor.copy_(q.ds_tensor)
            if p.data.numel():  # not partitioned, or kept whole (persistence threshold)
                p.data.copy_(q.data)
        pol_b = dict(policy.module.named_buffers())
        for name, b in ref.module.named_buffers():
            b.copy_(pol_b[name])
    ref.eval()
    return ref


def rollout_kind(recipe: Recipe) -> str:
    return "local" if recipe.grpo.rollout == "auto" else recipe.grpo.rollout


def completions(batch, tok) -> list[str]:
    """Response text of each rollout sequence, up to and including its first EOS."""
    p_len = int(batch.response_start_idx[0])
    return tok.batch_decode([s[p_len:][m[p_len:] > 0] for s, m in zip(batch.input_ids, batch.attention_mask)],
                            skip_special_tokens=True)


def evaluate(rollout, evals, rewards, tok, world: World, device, max_new_tokens: int) -> dict:
    """Mean rewards (total and each) of greedy completions of the held-out prompts; each rank scores its share."""
    mine = evals[world.rank::world.size]
    sums = torch.zeros(2 + len(rewards.labels), device=device)  # total, each reward, count
    # A rank without a share still generates (evals[:1], not scored): engine rollouts decode in lockstep.
    batch = rollout.generate(left_pad([r["prompt"] for r in mine or evals[:1]], tok, device),
                             SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0))
    if mine:
        scores = rewards.score([r["prompt"] for r in mine], completions(batch, tok), [r["answer"] for r in mine])
        sums += torch.tensor([float(scores.total.sum())] + [float(scores.per_reward[k].sum()) for k in rewards.labels]
                             + [len(mine)], device=device)
    dist.all_reduce(sums)
    means = (sums[:-1] / sums[-1]).tolist()
    return {"eval_reward": means[0], **{f"eval_reward_{k}": v for k, v in zip(rewards.labels, means[1:])}}


def train(recipe: Recipe, ds: dict, tok, prompts, evals, rewards, init: str | None, world: World) -> list[dict]:
    g = recipe.grpo
    recipe = replace(recipe, model=replace(recipe.model, init_from=init))  # checkpoints record the real source
    loss_cfg = loss_config(g)
    torch.manual_seed(recipe.train.seed + world.rank)  # different samples on each rank
    model = build_model(recipe.model, ds, tok, dtype=model_dtype(ds))
    schedule = replace(recipe.train, max_steps=recipe.train.max_steps * g.iterations,
                       warmup_steps=recipe.train.warmup_steps * g.iterations)
    policy = build_engine(model, ds, schedule)
    ref = build_reference(policy, recipe, ds, tok) if g.beta > 0 else None
    rollout = build_rollout(rollout_kind(recipe), policy, tok, recipe.grpo.decode_experts)
    state = checkpoint.load(policy, recipe.run_dir) if recipe.resume else {"step": 0, "position": 0, "tokens": 0}
    step = state["step"]
    device, micro = policy.device, policy.train_micro_batch_size_per_gpu()
    n_seq = micro * policy.gradient_accumulation_steps()  # sequences per rank per step
    n_prompts = n_seq // g.group_size
    # The data position counts micro-batches per rank, as in pretraining, so checkpoint.load converts it to this
    # world size; here it becomes prompts consumed over all ranks.
    done = state["position"] * micro * world.size // g.group_size
    order = np.random.default_rng(recipe.train.seed).permutation(len(prompts))
    metrics = Metrics(recipe.run_dir, recipe.train.max_steps, step, policy.monitor)
    saver = checkpoint.Cadence(recipe.checkpoint, device)  # also: SIGTERM/SIGINT -> save at the next step, stop
    sampling = SamplingConfig(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                              n_samples_per_prompt=g.group_size)
    rows = []
    if evals:
        rollout.sync_weights(step)
        row = {"step": step, **evaluate(rollout, evals, rewards, tok, world, device, g.max_new_tokens)}
        rollout.shutdown()
        metrics.log(row)
        rows.append(row)
    while step < recipe.train.max_steps:
        # 1. Prompts for this rank: global positions done + rank*P + [0, P); one global order on any world size.
        start = done + world.rank * n_prompts
        done += n_prompts * world.size
        batch_rows = [prompts[order[(start + i) % len(prompts)]] for i in range(n_prompts)]
        t0 = time.time()
        rollout.sync_weights(step)
        out = rollout.generate(left_pad([r["prompt"] for r in batch_rows], tok, device), sampling)
        rollout.shutdown()  # free the local copy before training
        t_roll = time.time() - t0
        ids, attn = out.input_ids, out.attention_mask  # (N, T), N = n_prompts * G
        p_len = int(out.response_start_idx[0])
        resp_mask = attn[:, 1:].clone()  # targets ids[:, 1:]; response targets start at p_len
        resp_mask[:, : p_len - 1] = 0
        texts = completions(out, tok)
        # 2. Rewards and group advantages.
        scores = rewards.score([r["prompt"] for r in batch_rows for _ in range(g.group_size)], texts,
                               [r["answer"] for r in batch_rows for _ in range(g.group_size)])
        for label, msg in scores.first_error.items():
            print(f"warning: step {step + 1}, rank {world.rank}: reward {label} failed on {scores.failures[label]} of "
                  f"{len(texts)} samples (scored 0); first error: {msg}", file=sys.stderr, flush=True)
        reward = torch.as_tensor(scores.total, dtype=torch.float32, device=device)  # (N,)
        adv = group_advantages(reward, g.group_size, normalize_std=g.normalize_std)
        if g.dynamic_sampling:
            resp_mask = resp_mask * keep_mask(reward, g.group_size).repeat_interleave(g.group_size)[:, None]
        # 3. Old policy and reference log-probs (no grad), micro-batch by micro-batch.
        t1 = time.time()
        with torch.no_grad():
            old = torch.cat([forward_logps(policy, ids[i:i + micro], attn[i:i + micro])[0] for i in range(0, len(ids), micro)])
            refl = (torch.cat([forward_logps(ref, ids[i:i + micro], attn[i:i + micro])[0]
                               for i in range(0, len(ids), micro)]) if ref is not None else None)
        count = resp_mask.sum().float()
        dist.all_reduce(count)
        normalizer = count.item() / (world.size * (n_seq // micro))  # dapo: global token mean
        # 4. `iterations` optimizer steps on the clipped surrogate.
        stats_sum: dict[str, float] = {}
        for _ in range(g.iterations):
            for i in range(0, len(ids), micro):
                sl = slice(i, i + micro)
                logp, ent = forward_logps(policy, ids[sl], attn[sl], with_entropy=True)
                loss, stats = policy_loss(logp, old[sl], adv[sl], resp_mask[sl], loss_cfg,
                                          ref_logp=None if refl is None else refl[sl], entropy=ent,
                                          token_normalizer=normalizer if g.aggregation == "dapo" else None)
                policy.backward(loss)
                policy.step()
                for k, v in {"loss": loss.detach(), **stats}.items():
                    stats_sum[k] = stats_sum.get(k, 0.0) + float(v)
        t_train = time.time() - t1
        step += 1
        metrics.advance()
        n_micro = g.iterations * (len(ids) // micro)
        row = {"step": step, "reward": _mean_all(reward.mean()), "reward_std": _mean_all(reward.std()),
               "lr": policy.get_lr()[0], "response_len": _mean_all(attn[:, p_len:].sum(1).float().mean()),
               "rollout_tokens_per_s": _sum_all(float(attn[:, p_len:].sum())) / max(t_roll, 1e-9),
               "train_tokens_per_s": _sum_all(float(attn.sum()) * (1 + g.iterations + (ref is not None))) / max(t_train, 1e-9),
               "rollout_s": t_roll, "train_s": t_train, "step_s": time.time() - t0, "peak_mem_gib": peak_memory_gib(),
               **{k: _mean_all(v / n_micro) for k, v in stats_sum.items()}}
        row["kl"] = row.pop("kl_mean", 0.0)
        row["entropy"] = row.pop("entropy_mean", 0.0)
        for label, vals in scores.per_reward.items():
            row[f"reward_{label}"] = _mean_all(float(vals.mean()))
        for label, n in scores.failures.items():
            row[f"reward_{label}_failures"] = _sum_all(float(n))
        if evals and (step % g.eval_every == 0 or step == recipe.train.max_steps):
            rollout.sync_weights(step)
            row.update(evaluate(rollout, evals, rewards, tok, world, device, g.max_new_tokens))
            rollout.shutdown()
        metrics.log(row)
        rows.append(row)
        save, stop = saver.due(step, recipe.train.max_steps)
        if save:
            checkpoint.save(policy, recipe, {"step": step, "position": done * g.group_size // (micro * world.size),
                                             "tokens": 0}, tok)
        if stop:
            print0(f"stopped by signal {saver.signal} after step {step}; saved, continue with --resume")
            break
    saver.close()
    metrics.close()
    return rows


def _mean_all(x) -> float:
    t = torch.tensor(float(x), dtype=torch.float64)
    if dist.is_initialized():
        t = t.to(_device())
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def _sum_all(x) -> float:
    t = torch.tensor(float(x), dtype=torch.float64)
    if dist.is_initialized():
        t = t.to(_device())
        dist.all_reduce(t)
    return t.item()


def _device():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def main(argv=None) -> int:
    args = parse_args(argv)
    world = world_from_env()
    try:
        recipe, ds, tok, prompts, evals, rewards, init = preflight(args, world)
    except ConfigError as e:
        report_error(e, world)
        return 2
    init_distributed()
    if init is None and args.init_from:
        init = str(Path(recipe.run_dir) / "init_hf")
        if world.rank == 0:
            from .export import export

            export(args.init_from, init, dtype="fp32", force=True)
        dist.barrier()
    rows = train(recipe, ds, tok, prompts, evals, rewards, init, world)
    last = rows[-1]
    print0(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()}))
    return 0

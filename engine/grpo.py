"""GRPO: a second DeepSpeed engine on the partitioned policy.

One step: prompts -> rollouts (G per prompt) -> rewards -> group advantages -> old log-probs (policy) and
reference log-probs (reference engine) -> `iterations` optimizer steps on the clipped surrogate (+ KL).
The reference is a DeepSpeed engine without optimizer whose ZeRO-3 shards are copied one to one from the
policy's (no full gather); with grpo.beta == 0 it is not built.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import checkpoint, curriculum
from .config import (ConfigError, GRPOConfig, Recipe, hf_tokenizer, hf_weights_problems, load_recipe,
                     model_from_hf_dir)
from .data import load_tokenizer, vocab_problem
from .devprof import idle_report
from .auto_batch import SEQUENCES_PER_STEP, GRPOAutoBatch, host_memory_problem, settle_checkpointing
from .ds_config import (BATCH_KEYS, grpo_compiles_layers, read_ds_config, resolve_ds_config, whole_model_on_one_gpu,
                        zero_stage)
from .grpo_math import GRPOLossConfig, group_advantages, keep_mask, kl_k3, policy_loss
from .metrics import DeviceClock, Metrics, print0
from .model import build_model, compile_parameter_free, make_hf_config
from .pretrain import (check_ranks_agree, compile_layers, eager_linear_attention, forget_zero3_for_transformers,
                       is_out_of_memory, memory_stats, out_of_memory, plain_linear_for_compiled_layers, report_error,
                       start_ranks)
from .parallel import World, build_engine, device_kind, model_dtype, world_from_env
from .rewards import build_rewards
from .routing import Router, agreement, has_moe
from .rollout import build_rollout, local_copy
from .watchdog import PeerTimeoutError, peer_timeout
from .tree import advantages as tree_advantages, cache_tokens, group_problems as tree_problems, tree_rollouts
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
    ap.add_argument("--profile_step", type=int, metavar="N",
                    help="run step N under torch.profiler; rank 0 writes the top operators to RUN_DIR/profile_step_N.txt")
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
        raise ConfigError(f"{where} {path}: row {bad[0][0] + 1} {bad[0][1]} (bad: {len(bad)} of the {len(rows)} rows); "
                          "fix those rows")
    return rows


def resumed_init(init_from: str | None, recipe: Recipe) -> tuple[str | None, str | None]:
    """(--init_from to use, problem). A resumed run rebuilds its reference policy from the model the run started
    from, which its checkpoint records (for a checkpoint source: the export in run_dir/init_hf), so --init_from may
    be left out; another source than the recorded one is refused (the reference would change mid-run)."""
    saved = checkpoint.saved_state(recipe.run_dir) if recipe.resume else None
    if saved is None or "recipe" not in saved:  # not resuming, or check_resume reports what is wrong
        return init_from, None
    start, source = saved["recipe"].get("model", {}).get("init_from"), saved.get("init_source")
    where = f"checkpoint {checkpoint.ckpt_dir(recipe.run_dir) / checkpoint.latest(recipe.run_dir)}"
    if start is None:
        if init_from is not None:
            return None, (f"--init_from {init_from}: the run in {recipe.run_dir} started from a random init ({where}), "
                          "which is its reference policy; resume without --init_from, or start a new run_dir")
        return None, None
    if init_from is not None and source is not None and Path(init_from).resolve() != Path(source).resolve():
        return None, (f"--init_from {init_from}: the run in {recipe.run_dir} started from {source} ({where}), its "
                      "reference policy; resume without --init_from (the recorded model is used), or start a new run_dir")
    if not (Path(start) / "config.json").is_file():
        return None, (f"--resume: the run started from {start} ({where}), which is gone, and the reference policy is "
                      "rebuilt from it; restore it there, or start a new run_dir")
    if init_from is not None and source is None and Path(init_from).resolve() != Path(start).resolve():
        print0(f"note: --init_from {init_from} is not used: the run in {recipe.run_dir} resumes from the model it "
               f"started from, {start} ({where}, which does not record what that was exported from)")
    return start, None


def auto_tokenizer(recipe: Recipe, init_from: str | None) -> str:
    """data.tokenizer auto in GRPO: on --resume the tokenizer the checkpoint recorded (the path it resolved to at the
    start, while it is there: the run goes on with what it trained with, and the resume sees no data change), else
    the one saved with --init_from's model (model_tokenizer), else "auto" (the bundled one)."""
    saved = checkpoint.saved_state(recipe.run_dir) if recipe.resume else None
    recorded = (((saved or {}).get("recipe") or {}).get("data") or {}).get("tokenizer")
    if isinstance(recorded, str) and recorded != "auto" and Path(recorded).is_dir():
        return recorded
    found = model_tokenizer(init_from)
    return str(Path(found).resolve()) if found else "auto"  # absolute: a resume from elsewhere finds it


def names_tokenizer(config: str | None) -> bool:
    """Whether the recipe file sets data.tokenizer to a tokenizer (not auto). load_recipe fills auto from
    model.init_from's directory; GRPO's --init_from, where given, is the model the run starts from instead."""
    import yaml

    data = (yaml.safe_load(Path(config).read_text()) or {}).get("data") if config else None
    return isinstance(data, dict) and data.get("tokenizer") not in (None, "auto")


def model_tokenizer(init_from: str | None) -> str | None:
    """The tokenizer saved with --init_from's model: a Hugging Face directory's own files, or the tokenizer/ of a
    pretraining run's, checkpoints/ dir's or step dir's checkpoint (its latest tag); None where there is none."""
    if not init_from or (Path(init_from) / "config.json").is_file():
        return hf_tokenizer(init_from)
    from .export import ExportError, find_tag_dir

    try:
        tag = find_tag_dir(init_from, None)
    except (ExportError, OSError):
        return None
    return str(tag / "tokenizer") if (tag / "tokenizer" / "tokenizer_config.json").is_file() else None


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


def model_config(init_from: str | None, init: str | None, recipe: Recipe, tok):
    """The Hugging Face config of the model that will be trained: the loaded model's, not the recipe's."""
    if init is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(init)
    if init_from is not None:  # a checkpoint (resolve_init found it): planned as the export in main() will read it
        from .checkpoint import damage
        from .export import ExportError, find_tag_dir, open_checkpoint

        try:
            tag_dir = find_tag_dir(init_from, None).resolve()
            bad = damage(tag_dir, verify_crc=True)  # as --resume checks a checkpoint: before any rank exports it
            if bad:
                raise ConfigError(f"--init_from {init_from}: checkpoint {tag_dir} is damaged ({bad}): a file is "
                                  "missing, truncated or corrupt; copy it again, or pass an older step_* dir of it")
            return open_checkpoint(init_from, verify=False).hf_config
        except ExportError as e:
            raise ConfigError(f"--init_from {init_from}: cannot be read as a model: {e}") from None
    return make_hf_config(recipe.model, tok)


def decoder_fit_problem(hf_config, dtype: torch.dtype, batch: int, cache_len: int, device_bytes: int) -> str | None:
    """Why the local rollout decoder (a whole copy of the model plus its KV cache on every device) cannot take
    more than half of a device's memory next to the training state, or None when it fits."""
    weights, cache = decoder_bytes(hf_config, dtype, batch, cache_len)
    if weights + cache <= device_bytes / 2:
        return None
    gib = 2**30
    return (f"grpo.rollout: local keeps a whole copy of the model on every device ({weights / gib:.1f} GiB of weights "
            f"+ {cache / gib:.1f} GiB of KV cache for {batch} sequences x {cache_len} slots), more than half of the "
            f"device's {device_bytes / gib:.0f} GiB; set grpo.rollout: engine (generation through the ZeRO-3 engine, "
            "for models that do not fit one device) or use fewer sequences per rank")


def decoder_bytes(hf_config, dtype: torch.dtype, batch: int, cache_len: int) -> tuple[int, int]:
    """(weights, KV cache) of the local rollout decoder, bytes: a whole copy of the model, and a cache of `batch`
    sequences x `cache_len` slots."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
    size = torch.empty((), dtype=dtype).element_size()
    if hasattr(hf_config, "kv_lora_rank"):  # MLA caches one latent per token, shared by the heads
        per_token = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
    else:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        per_token = 2 * hf_config.num_key_value_heads * head_dim
    return n_params * size, hf_config.num_hidden_layers * batch * cache_len * per_token * size


DECODER_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral")  # the families the local rollout decoder takes


def decoder_family_problem(hf_config) -> str | None:
    """Why the local rollout decoder cannot take this model family, or None when it can."""
    kind = hf_config.model_type
    if kind in DECODER_MODEL_TYPES:
        return None
    if "linear_attention" in (getattr(hf_config, "layer_types", None) or []):
        why = ("its Gated DeltaNet (linear attention) layers keep a recurrent state that the decoder's static KV cache "
               "does not hold")
    else:
        why = f"the decoder is built and tested for {', '.join(DECODER_MODEL_TYPES)} only"
    return (f"grpo.rollout: local (the persistent rollout decoder) cannot take a {kind} model: {why}; set "
            "grpo.rollout: engine (generation through the DeepSpeed engine)")


def loss_config(g: GRPOConfig) -> GRPOLossConfig:
    """The loss fields of the recipe's grpo section, as the math module takes them."""
    return GRPOLossConfig(clip_low=g.clip_low, clip_high=g.clip_high, beta=g.beta, kl=g.kl, aggregation=g.aggregation,
                          normalize_std=g.normalize_std, max_new_tokens=g.max_new_tokens,
                          rollout_correction=g.rollout_correction, rollout_correction_cap=g.rollout_correction_cap)


def preflight(args, world: World):
    o = {k: v for k, v in {"train.max_steps": args.max_steps, "run_dir": args.run_dir,
                           "data.path": args.data}.items() if v is not None}
    if args.resume:
        o["resume"] = True
    recipe = load_recipe(args.config, o)
    raw = read_ds_config(args.deepspeed_config)
    where = f"DeepSpeed config {args.deepspeed_config}"
    if "pipeline" in raw:  # before the file's pipeline section is checked against this world
        raise ConfigError(f"{where}: GRPO runs on ZeRO configs (zero3_grpo.json), not pipeline stages; a pipeline "
                          "run's checkpoint can still be its --init_from")
    g = recipe.grpo
    batch = grpo_batch(raw, g, where)  # (sequences per GPU, how) with an "auto" batch; None: the file's numbers
    if batch is None:
        ds = resolve_ds_config(raw, recipe, world.size, world.local_size, where=where, device=device_kind())
        per_rank = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    else:  # resolved below, once the model and the prompts are known; the rest of the file is checked now
        resolve_ds_config({**raw, BATCH_KEYS[0]: 1, BATCH_KEYS[1]: batch[0]}, recipe, world.size, world.local_size,
                          where=where, device=device_kind())
        ds, per_rank = None, batch[0]
    problems = loss_config(g).validate()
    if recipe.train.fp8:
        problems.append(f"train.fp8 ({recipe.train.fp8}): bin/pretrain.py only so far; GRPO trains in the DS config's "
                        "precision (set train.fp8: false in the GRPO recipe)")
    if recipe.train.balance_rate > 0:
        problems.append(f"train.balance_rate ({recipe.train.balance_rate:g}): GRPO keeps the routing biases the policy "
                        "was trained with (bin/pretrain.py adapts them); set train.balance_rate: 0 in the GRPO recipe")
    if batch is None and g.prompts_per_step_per_gpu is not None and \
            g.prompts_per_step_per_gpu * group_of(g) != per_rank:
        problems.append(f"grpo.prompts_per_step_per_gpu ({g.prompts_per_step_per_gpu}) x "
                        f"{'the tree leaves' if g.tree.enabled else 'grpo.group_size'} ({group_of(g)}) != "
                        f"train_micro_batch_size_per_gpu x gradient_accumulation_steps ({per_rank}) of {where}: "
                        "set one to agree, or leave both batch values \"auto\" there")
    if args.profile_step is not None and not 1 <= args.profile_step <= recipe.train.max_steps:
        problems.append(f"--profile_step {args.profile_step}: must be a step of this run (1..{recipe.train.max_steps})")
    try:
        peer_timeout()  # read again when the watchdog starts; a bad value is bad input like any other
    except PeerTimeoutError as e:
        problems.append(str(e))
    problems += tree_problems(g, per_rank, g.rollout)
    if g.tree.enabled:  # a prompt's tree leaves are its group; grpo.group_size is not used
        recipe = replace(recipe, grpo=replace(g, group_size=g.tree.leaves()))
        g = recipe.grpo
    elif per_rank % g.group_size:
        problems.append(f"grpo.group_size ({g.group_size}) must divide train_micro_batch_size_per_gpu x "
                        f"gradient_accumulation_steps ({per_rank}): each rank's batch is whole groups")
    try:
        rewards = build_rewards(g.rewards, where="grpo.rewards")
    except ConfigError as e:
        problems.append(str(e))
        rewards = None
    init_from, problem = resumed_init(args.init_from, recipe)
    if problem:
        raise ConfigError("; ".join(problems + [problem]))
    init = resolve_init(init_from, recipe)
    if args.init_from and recipe.model.init_from and not names_tokenizer(args.config):
        recipe = replace(recipe, data=replace(recipe.data, tokenizer="auto"))  # auto: --init_from's, not model.init_from's
    if recipe.data.tokenizer == "auto":  # the tokenizer saved with the policy --init_from loads
        recipe = replace(recipe, data=replace(recipe.data, tokenizer=auto_tokenizer(recipe, init_from)))
    tok = load_tokenizer(recipe.data.tokenizer)
    if tok.pad_token_id is None and tok.eos_token_id is None:
        problems.append(f"data.tokenizer {recipe.data.tokenizer}: has neither a pad nor an EOS token; GRPO pads "
                        "prompts and ends completions with them: add an EOS token to the tokenizer")
    elif tok.pad_token_id is None:  # prompt padding is masked out and completions end at the first EOS anyway
        print0(f"note: data.tokenizer {recipe.data.tokenizer} has no pad token; padding with its EOS token "
               f"{tok.eos_token!r}")
        tok.pad_token = tok.eos_token
    if g.top_p < 1:
        print0(f"note: grpo.top_p {g.top_p:g} samples from the nucleus; the loss, the KL term and rollout correction "
               "score the whole softmax (top_p 1 samples and scores one distribution)")
    prompts = load_prompts(recipe.data.path)
    evals = load_prompts(g.eval_path, "grpo.eval_path") if g.eval_path else []
    if init is None and init_from is None and not g.allow_random_init:
        problems.append("no --init_from (nor model.init_from): GRPO would train a randomly initialised policy, which "
                        "earns no reward; pass --init_from a pretraining run dir, a checkpoint or a Hugging Face "
                        "model dir (or set grpo.allow_random_init: true, e.g. for benchmarks)")
    found = (model_from_hf_dir(replace(recipe.model, init_from=init)) or hf_weights_problems(init)
             if init is not None else [])
    if found:  # a Hugging Face dir of a family the engine does not train
        raise ConfigError("; ".join(problems + [f.replace("model.init_from", "--init_from", 1) for f in found]))
    hf_config = model_config(init_from, init, recipe, tok)
    source = init_from or init  # a loaded policy's vocabulary is fixed; a random one's is the recipe's
    found = vocab_problem(tok, recipe.data.tokenizer, hf_config.get_text_config().vocab_size,
                          source and f"the policy --init_from {source}")
    problems += [found] if found else []
    limit = hf_config.max_position_embeddings
    for name, rows in (("data.path", prompts), ("grpo.eval_path", evals)):
        for i, r in enumerate(rows):
            n = r["n_tokens"] = len(tok(r["prompt"])["input_ids"])  # also sizes the rollout decoder's cache
            if n + g.max_new_tokens > limit:
                problems.append(f"{name} row {i + 1}: prompt of {n} tokens + grpo.max_new_tokens {g.max_new_tokens} "
                                f"exceeds the context ({limit}); shorten it or lower max_new_tokens")
                break
    if g.routing_replay == "r3" and not has_moe(hf_config):
        problems.append(f"grpo.routing_replay r3: the {hf_config.model_type} model has no MoE layer, so there are no "
                        "expert choices to replay; set grpo.routing_replay: off")
    needs_local = next((why for on, why in ((g.tree.enabled, "grpo.tree"),
                                            (g.routing_replay == "r3", "grpo.routing_replay r3"),
                                            (g.rollout_correction != "none", f"grpo.rollout_correction "
                                                                             f"{g.rollout_correction}"),
                                            (g.min_new_tokens > 0, "grpo.min_new_tokens")) if on), None)
    problem = decoder_family_problem(hf_config)
    if problem and (g.rollout == "local" or needs_local):
        problems.append(problem if g.rollout == "local" else f"{problem} ({needs_local} needs the local decoder)")
    elif problem and g.rollout == "auto":
        print0(f"note: {problem.split(';')[0]}: grpo.rollout auto picks engine")
        recipe = replace(recipe, grpo=replace(g, rollout="engine"))
        g = recipe.grpo
    if batch is not None and not problems:  # "auto": fitted to the device now that the model and prompts are known
        auto = grpo_auto_batch(batch, raw, recipe, hf_config, prompts + evals, world)
        ds = resolve_ds_config(raw, auto.memory_recipe, world.size, world.local_size, where=where,
                               device=device_kind(), auto_batch=auto)
        batch_note = auto.note
        recipe = settle_checkpointing(recipe, auto)  # "auto" resolved with the micro-batch
        got = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
        if got != per_rank:  # --resume keeps the checkpoint's values
            problems.append(f"{where}: \"auto\" kept the checkpoint's batch ({ds['train_micro_batch_size_per_gpu']} x "
                            f"{ds['gradient_accumulation_steps']} = {got} sequences per GPU) for an exact resume, but "
                            f"the recipe now asks for {per_rank} ({batch[1]}); resume with the batch the run started "
                            "with, or start a new run_dir")
    found = host_memory_problem(ds, recipe, world.size, min(world.local_size, world.size)) if ds else None
    problems += [f"{where}: {found}"] if found else []
    if problems:
        raise ConfigError("; ".join(problems))
    if g.rollout != "engine" and device_kind() == "cuda":
        cache_len = decoder_cache_len(prompts + evals, cache_tokens(g))
        problem = decoder_fit_problem(hf_config, model_dtype(ds), per_rank, cache_len,
                                      torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory)
        if problem and (g.rollout == "local" or needs_local):
            problems.append(problem if g.rollout == "local" else f"{problem} ({needs_local} needs the local decoder)")
        elif problem:  # auto: generate through the engine instead
            print0(f"note: {problem.split(';')[0]}: grpo.rollout auto picks engine")
            recipe = replace(recipe, grpo=replace(g, rollout="engine"))
    if g.decode_attention == "triton" and recipe.grpo.rollout != "engine":  # after the fit may have picked the engine
        from .decoder import decode_attention_problem

        found = decode_attention_problem(hf_config, "cuda" if device_kind() == "cuda" else "cpu")
        problems += [found] if found else []
    problems += checkpoint.run_dir_problems(recipe)
    if recipe.resume and not problems:  # as in pretraining: checked, and converted to the universal format on a new shape
        found, universal = checkpoint.check_resume(recipe, ds, world.size, world.rank)
        problems += found + curriculum.resume_problems(recipe.run_dir, g.curriculum, len(prompts))
        if universal:
            ds.setdefault("checkpoint", {})["load_universal"] = True
    if problems:
        raise ConfigError("; ".join(problems))
    recipe = settle_checkpointing(recipe, None)  # still "auto": the file's numbers, or no device memory to fit: off
    recipe, schedule_lines = checkpoint.lr_schedule(recipe)
    for line in ([batch_note] if batch is not None else []) + schedule_lines:
        print0(line)  # once, before any rank does work: what "auto" chose and why, the LR schedule on a resume
    if recipe.resume and ds.get("checkpoint", {}).get("load_universal") and world.rank == 0:
        checkpoint.to_universal(recipe.run_dir)  # the other ranks wait for rank 0 in init_distributed
    return recipe, ds, tok, prompts, evals, rewards, init


def group_of(g: GRPOConfig) -> int:
    """Sequences per prompt: grpo.group_size, or a tree's leaves."""
    return g.tree.leaves() if g.tree.enabled else g.group_size


def grpo_batch(raw: dict, g: GRPOConfig, where: str) -> tuple[int, str] | None:
    """The rollout batch per GPU when the DS config leaves the batch to the engine ("auto", as zero2.json and
    zero3.json do): (sequences, how they were set); None when the file has numbers."""
    autos = [k for k in BATCH_KEYS if raw.get(k) == "auto"]
    if not autos:
        return None
    if len(autos) == 1:
        raise ConfigError(f'{where}: {autos[0]} "auto" with a number for the other batch value: for GRPO leave both '
                          "train_micro_batch_size_per_gpu and gradient_accumulation_steps \"auto\" (the micro-batch "
                          "fitted to the device, the accumulation making up the rollout batch) or write both")
    G, what = group_of(g), "completions" if not g.tree.enabled else "tree leaves"
    if g.prompts_per_step_per_gpu is not None:
        return (g.prompts_per_step_per_gpu * G,
                f"grpo.prompts_per_step_per_gpu {g.prompts_per_step_per_gpu} x {G} {what}")
    prompts = max(1, SEQUENCES_PER_STEP // G)
    floor = "" if SEQUENCES_PER_STEP >= G else ", at least 1"
    return (prompts * G, f"{prompts} prompt{'s' if prompts > 1 else ''} x {G} {what}; default: {SEQUENCES_PER_STEP} // "
                         f"{G} prompts{floor}")


def grpo_auto_batch(batch: tuple[int, str], raw: dict, recipe: Recipe, hf_config, rows: list[dict],
                    world: World) -> GRPOAutoBatch:
    """engine/auto_batch.GRPOAutoBatch for this run: the model as it will be loaded (`hf_config`, written to a
    temporary dir the memory model reads), training rows of the longest prompt + max_new_tokens, and beside the
    policy the reference (ZeRO-3: its shard of the weights; else a whole copy) and the local decoder (weights + KV
    cache of the whole rollout batch)."""
    import tempfile

    from .auto_batch import GIB, device_memory_gib, param_counts

    g = recipe.grpo
    tmp = tempfile.TemporaryDirectory(prefix="grpo_model_config_")
    hf_config.save_pretrained(tmp.name)
    m = replace(recipe.model, init_from=tmp.name)
    model_from_hf_dir(m)  # its family and sizes (the checks ran on the real source already)
    sequences, what = batch
    dtype = model_dtype(raw)
    size = torch.empty((), dtype=dtype).element_size()
    total = param_counts(m)[0]
    extra = size * (total / world.size if zero_stage(raw) == 3 else total)  # the reference policy (build_reference)
    if g.rollout != "engine":
        extra += sum(decoder_bytes(hf_config, dtype, sequences, decoder_cache_len(rows, cache_tokens(g))))
    auto = GRPOAutoBatch(memory_gib=device_memory_gib(device_kind()),
                         recorded=checkpoint.recorded_batch(recipe.run_dir) if recipe.resume else None,
                         sequences=sequences, seq_len=decoder_cache_len(rows, g.max_new_tokens),
                         extra_gib=extra / GIB, what=what)
    auto.memory_recipe, auto.tmp = replace(recipe, model=m), tmp  # the dir lives as long as the object
    return auto


def left_pad(texts: list[str], tok, device) -> RolloutRequest:
    enc = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):], attn[i, width - len(e):] = torch.tensor(e), 1
    return RolloutRequest(ids.to(device), attn.to(device))


def forward_logps(engine, ids, attn, temperature: float, with_entropy: bool = False):
    """Per-token log-probs of ids[:, 1:] under `engine`'s logits / temperature (the distribution the rollout sampled
    from; with grad when enabled), and their entropy (no grad), fp32. Positions follow the left padding. The
    vocabulary's logits are never held for the whole micro-batch (engine/head.py)."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = engine(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False, logprob_targets=ids[:, 1:],
                 temperature=temperature, with_entropy=with_entropy)  # engine/head.py: a chunk of tokens at a time
    return out.logprobs, out.entropy  # (N, T-1) each


def build_reference(policy, recipe: Recipe, ds: dict, tok, world_size: int):
    """The frozen reference policy. ZeRO-3 on several ranks: an optimizer-free DeepSpeed engine holding a copy of the
    policy's local shards (no full gather). ZeRO 0-2 hold every dense weight on every rank anyway (and DeepSpeed
    builds no optimizer-free engine for them with AutoEP), and so does ZeRO-3 on one rank with its parameters on the
    device (its "shards" are whole tensors): a plain Hugging Face copy on this rank's device, the same bytes without
    ZeRO-3's per-module hooks, which made the reference forward on one H200 3x as long as ZeRO-2's
    (docs/benchmarks.md, GRPO sections). That one-rank copy is for GPU ranks: a copy computes the experts
    through transformers' kernels, not AutoEP's, so in bf16 its log-probs differ from the policy's at step 1 (k3 KL
    3.5e-5 in the CPU demo, where the engine's reference gives 0); on a CPU rank the reference stays the engine, with
    the policy's numbers (the copy's speed-up was measured on a GPU only)."""
    if reference_is_copy(ds, world_size, policy.device):
        ref = local_copy(policy.module, policy.device, decode_experts="grouped_mm")
        if reference_compiles(ds, recipe.train):
            compile_parameter_free(ref, lengths_vary=True)
        return ref
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


def reference_compiles(ds: dict, train) -> bool:
    """Whether the reference copy's parameter-free functions are compiled: wherever the policy compiles anything on
    CUDA outside pipeline mode, its parameter-free functions or its whole decoder layers (ds_config.
    grpo_compiles_layers; pretrain.compile_layers, which the copy does not take: not measured on it). Left eager
    beside a policy compiled by layers, the copy's pass was slower (docs/benchmarks.md, GRPO against TRL with
    train.compile: true)."""
    if train is None or getattr(train, "compile", False) is False:
        return False
    from deepspeed.accelerator import get_accelerator

    return "pipeline" not in ds and get_accelerator().device_name() == "cuda"


def reference_is_copy(ds: dict, world_size: int, device) -> bool:
    """build_reference's choice: a plain copy under ZeRO 0-2, and under ZeRO-3 where the whole model sits on one GPU
    rank (ds_config.whole_model_on_one_gpu); else an optimizer-free DeepSpeed engine on the policy's shards."""
    return zero_stage(ds) < 3 or whole_model_on_one_gpu(ds, world_size, torch.device(device).type)


def _build_device(ds: dict):
    """Where a new model is built: ZeRO-3's zero.Init places it; under ZeRO 0-2 straight on this rank's device."""
    from deepspeed.accelerator import get_accelerator

    return None if zero_stage(ds) == 3 else get_accelerator().current_device_name()


def rollout_kind(recipe: Recipe) -> str:
    return "local" if recipe.grpo.rollout == "auto" else recipe.grpo.rollout


def completions(batch, tok) -> list[str]:
    """Response text of each rollout sequence, up to and including its first EOS."""
    p_len = int(batch.response_start_idx[0])
    ids, mask = batch.input_ids[:, p_len:].cpu(), batch.attention_mask[:, p_len:].cpu()  # one copy, not one per row
    return tok.batch_decode([s[m > 0] for s, m in zip(ids, mask)], skip_special_tokens=True)


def evaluate(run: "Run", evals) -> dict:
    """Mean rewards (total and each) of greedy completions of the held-out prompts; each rank scores its share."""
    world, device = run.world, run.device
    mine = evals[world.rank::world.size]
    n = len(run.rewards.labels)
    sums = torch.zeros(2 + 2 * n, device=device)  # total, each reward, each reward's failures, count
    # A rank without a share still generates (evals[:1], not scored): engine rollouts decode in lockstep.
    run.rollout.sync_weights(0)
    batch = run.rollout.generate(left_pad([r["prompt"] for r in mine or evals[:1]], run.tok, device),
                                 SamplingConfig(max_new_tokens=run.g.max_new_tokens, temperature=0.0))
    run.rollout.shutdown()
    if mine:
        scores = run.rewards.score([r["prompt"] for r in mine], completions(batch, run.tok), [r["answer"] for r in mine])
        warn_reward_failures(scores, f"held-out evaluation, rank {world.rank}", f"{len(mine)} prompts")
        sums += torch.tensor([float(scores.total.sum())] + [float(scores.per_reward[k].sum()) for k in run.rewards.labels]
                             + [float(scores.failures.get(k, 0)) for k in run.rewards.labels] + [len(mine)], device=device)
    dist.all_reduce(sums)
    means = (sums[:1 + n] / sums[-1]).tolist()
    failed = sums[1 + n:-1].tolist()
    return {"eval_reward": means[0], **{f"eval_reward_{k}": v for k, v in zip(run.rewards.labels, means[1:])},
            **{f"eval_reward_{k}_failures": f for k, f in zip(run.rewards.labels, failed) if f}}


@dataclass
class Run:
    """What every GRPO step uses: the engines, the rollout, the scoring and the batch shape (per rank)."""
    policy: object
    ref: object  # None when beta == 0
    rollout: object
    tok: object
    rewards: object
    g: GRPOConfig
    loss_cfg: GRPOLossConfig
    world: World
    micro: int  # sequences per micro-batch
    n_seq: int  # sequences per rank per step (micro x accumulation)
    last_reward: object = None  # the last step's rewards, one per completion, prompt-major (grpo.curriculum reads them)
    router: object = None  # engine/routing.Router on the policy when the decoder records expert choices

    @property
    def device(self):
        return self.policy.device


@dataclass
class Rollouts:
    ids: torch.Tensor  # (N, T) prompt + response tokens, N = prompts x G
    attn: torch.Tensor  # (N, T)
    resp_mask: torch.Tensor  # (N, T-1): 1 on response targets of ids[:, 1:]
    texts: list[str]
    p_len: int
    seconds: float
    tree: object = None  # grpo.tree: the rollout's tree structure (engine/tree.py TreeInfo)
    rollout_logp: torch.Tensor | None = None  # (N, T-1): the decoder's log p of each response target (chains)
    routes: torch.Tensor | None = None  # (N, T, L, k): the decoder's expert ids per token and MoE layer
    _micros: tuple | None = field(default=None, repr=False)  # (micro, micro_batches(attn, micro)), made once

    def micro_batches(self, micro: int) -> list["Micro"]:
        """This batch's packed training micro-batches (micro_batches), made once: the reference, old-log-prob and
        policy passes all use them."""
        if self._micros is None or self._micros[0] != micro:
            self._micros = (micro, micro_batches(self.attn, micro))
        return self._micros[1]

    def replay(self, m: "Micro", run: "Run") -> torch.Tensor | None:
        """The routes the policy's forwards replay for micro-batch `m` (None: its routers choose)."""
        return m.tokens(self.routes) if run.g.routing_replay == "r3" else None


@dataclass
class Micro:
    """A training micro-batch of a rollout batch: some of its rows, and the columns [lo, hi) that hold their tokens."""
    rows: torch.Tensor  # (B,) long
    lo: int
    hi: int

    def tokens(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token tensors (N, T, ...) -> (B, hi - lo, ...)."""
        return None if t is None else t[self.rows, self.lo:self.hi]

    def targets(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Per-target tensors (N, T-1) (target ids[:, j + 1] at j) -> (B, hi - lo - 1); per-sequence (N,) -> (B,)."""
        if t is None:
            return None
        return t[self.rows] if t.dim() == 1 else t[self.rows, self.lo:self.hi - 1]


def micro_batches(attn: torch.Tensor, micro: int, pack: bool = True) -> list[Micro]:
    """The rollout batch's training micro-batches, `micro` rows each. pack: the rows sorted by where their tokens end
    (then begin), longest first, and each micro-batch cut to the columns its rows use, so no forward runs on a column
    that is padding in every row of it (completions end at EOS at different lengths). The loss is unchanged: every
    micro-batch keeps `micro` rows, each aggregation is a sum over rows or tokens that does not depend on which rows
    share a micro-batch, and a row's positions follow its own attention mask. pack=False: consecutive rows, every
    column (as the rollouts came)."""
    N, T = attn.shape
    if not pack:
        return [Micro(torch.arange(i, min(i + micro, N), device=attn.device), 0, T) for i in range(0, N, micro)]
    real = attn.bool()
    first = real.int().argmax(1)  # left padding
    end = T - real.flip(1).int().argmax(1)  # one past the last real token
    order = torch.argsort(end * (T + 1) + (T - first), descending=True, stable=True)
    first, end, order_l = first.tolist(), end.tolist(), order.tolist()  # one wait per step
    out = []
    for i in range(0, N, micro):
        rows = order_l[i:i + micro]
        out.append(Micro(order[i:i + micro], min(first[r] for r in rows), max(end[r] for r in rows)))
    return out


def generate_rollouts(run: Run, rows: list[dict], sampling: SamplingConfig) -> Rollouts:
    t0 = time.time()
    run.rollout.sync_weights(0)  # the persistent decoder takes the policy's weights in place
    request = left_pad([r["prompt"] for r in rows], run.tok, run.device)
    if run.g.tree.enabled:
        out, tree = tree_rollouts(run.rollout, request, sampling, run.g.tree)
    else:
        out, tree = run.rollout.generate(request, sampling), None
    run.rollout.shutdown()
    p_len = int(out.response_start_idx[0])
    resp_mask = out.attention_mask[:, 1:].clone()  # targets ids[:, 1:]; response targets start at p_len
    resp_mask[:, : p_len - 1] = 0
    rl = getattr(run.rollout, "last_logps", None) if tree is None else None
    if rl is not None:  # response token j sits at ids[:, p_len + j], the target of position p_len - 1 + j
        rl = torch.nn.functional.pad(rl, (p_len - 1, 0))[:, : out.input_ids.shape[1] - 1]
    routes = getattr(run.rollout, "last_routes", None)
    return Rollouts(out.input_ids, out.attention_mask, resp_mask, completions(out, run.tok), p_len, time.time() - t0,
                    tree, rl, routes)


def warn_reward_failures(scores, where: str, of: str) -> None:
    """One warning line per reward that failed on some samples (they are counted and scored 0): how many, the first
    error."""
    for label, msg in scores.first_error.items():
        print(f"warning: {where}: reward {label} failed on {scores.failures[label]} of {of} (scored 0); first error: "
              f"{msg}", file=sys.stderr, flush=True)


def score(run: Run, rows: list[dict], r: Rollouts, step: int):
    """Rewards of each completion and the group advantages; DAPO's dynamic sampling masks flat groups out."""
    G = run.g.group_size
    scores = run.rewards.score([x["prompt"] for x in rows for _ in range(G)], r.texts,
                               [x["answer"] for x in rows for _ in range(G)])
    warn_reward_failures(scores, f"step {step}, rank {run.world.rank}", f"{len(r.texts)} samples")
    reward = torch.as_tensor(scores.total, dtype=torch.float32, device=run.device)  # (N,)
    if r.tree is not None:  # per token, from the tree's node values: (N, T-1)
        adv = tree_advantages(r.tree, reward, r.p_len, r.resp_mask.shape[1], run.g.normalize_std)
    else:
        adv = group_advantages(reward, G, normalize_std=run.g.normalize_std)  # (N,)
    if run.g.dynamic_sampling:
        r.resp_mask = r.resp_mask * keep_mask(reward, G).repeat_interleave(G)[:, None]
    return scores, reward, adv


@torch.no_grad()
def batched_logps(engine, r: Rollouts, micro: int, temperature: float, run: Run | None = None) -> torch.Tensor:
    """(N, T-1) log-probs under `engine` at the sampling temperature, micro-batch by micro-batch, no grad. With
    `run`: the policy's, its routers replaying the rollout's routes when grpo.routing_replay is r3."""
    out = torch.zeros(r.attn.shape[0], r.attn.shape[1] - 1, dtype=torch.float32, device=r.attn.device)
    for m in r.micro_batches(micro):
        with routed(run, r, m):
            out[m.rows, m.lo:m.hi - 1] = forward_logps(engine, m.tokens(r.ids), m.tokens(r.attn), temperature)[0].float()
    return out  # 0 where no micro-batch had a column: padding, never a response target


def routed(run: Run | None, r: Rollouts, m: Micro, record: bool = False):
    """The policy's routers for micro-batch `m`: replaying (r3) and/or recording; a no-op without a Router."""
    if run is None or run.router is None or r.routes is None:
        return contextlib.nullcontext()
    return run.router.use(r.replay(m, run), record)


def old_logps(run: Run, r: Rollouts) -> torch.Tensor | None:
    """The rollout policy's log-probs, for the ratio. With one optimizer step per rollout batch the policy at
    each micro-batch's forward *is* the rollout policy, so its own detached log-probs serve (None here)."""
    return batched_logps(run.policy, r, run.micro, run.g.temperature, run) if run.g.iterations > 1 else None


def response_tokens(r: Rollouts) -> float:
    """Response tokens that count in the loss, summed over ranks (dynamic sampling zeroes flat groups' tokens)."""
    count = r.resp_mask.sum().float()
    dist.all_reduce(count)
    return count.item()


def skip_update(run: Run) -> None:
    """No optimizer step for this GRPO step (nothing to learn from on any rank); the LR schedule still advances
    by the step's `iterations` optimizer steps, so it stays a function of the GRPO step. torch warns when a
    scheduler steps before its optimizer ever has (a first step skipped): intended here, so that warning alone is
    not shown."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before "
                                r"`optimizer\.step\(\)`")
        for _ in range(run.g.iterations):
            run.policy.lr_scheduler.step()


def policy_update(run: Run, r: Rollouts, adv, old, refl, count: float) -> tuple[dict[str, float], dict[str, float]]:
    """`iterations` passes over the batch on the clipped surrogate (+ KL); returns the loss stats summed over the
    micro-batches (the loss; the others weighted by response tokens, with their count: loss_stats) and the
    rollout/train mismatch of the first pass (mismatch_metrics; empty without the decoder's log-probs).
    `count`: the response tokens of all ranks (response_tokens), > 0."""
    normalizer = count / (run.world.size * (run.n_seq // run.micro))  # dapo: global token mean
    stats_sum: dict[str, torch.Tensor] = {}
    mismatch = []  # the first pass's rollout/train log-prob differences (the decoder's log-probs, chains only)
    routes = []  # the first pass's routing agreement with the decoder (when it records expert choices)
    micros = r.micro_batches(run.micro)
    for it in range(run.g.iterations):
        for m in micros:
            with routed(run, r, m, record=it == 0):  # held through backward: a checkpointed recompute replays too
                logp, ent = forward_logps(run.policy, m.tokens(r.ids), m.tokens(r.attn), run.g.temperature,
                                          with_entropy=True)
                if it == 0 and run.router is not None and r.routes is not None:
                    routes.append(routing_agreement(run.router, r, m))
                mask = m.targets(r.resp_mask)
                loss, stats = policy_loss(logp, logp.detach() if old is None else m.targets(old), m.targets(adv), mask,
                                          run.loss_cfg, ref_logp=m.targets(refl), entropy=ent,
                                          token_normalizer=normalizer if run.g.aggregation == "dapo" else None,
                                          rollout_logp=m.targets(r.rollout_logp))
                run.policy.backward(loss)
            run.policy.step()
            n = mask.sum().float()  # the statistics are token means: kept weighted by the micro-batch's tokens
            for k, v in {"loss": loss.detach(), "tokens": n, **{k: v * n for k, v in stats.items()}}.items():
                stats_sum[k] = stats_sum[k] + v if k in stats_sum else v  # device tensors: no host wait per micro-batch
            if it == 0 and r.rollout_logp is not None:
                mismatch.append(rollout_mismatch(logp.detach(), m.targets(r.rollout_logp), mask))
    stats = dict(zip(stats_sum, torch.stack(list(stats_sum.values())).float().tolist()))  # one wait
    cols = sum(len(m.rows) * (m.hi - m.lo) for m in micros)  # the train passes' tokens, padding included
    return stats, {"train_padding_frac": _mean_all(1 - float(r.attn.sum()) / cols),
                   **(mismatch_metrics(torch.stack(mismatch)) if mismatch else {}),
                   **(routing_metrics(torch.stack(routes), run.g.routing_replay == "r3") if routes else {})}


def routing_agreement(router: Router, r: Rollouts, m: Micro) -> torch.Tensor:
    """[choices equal, tokens all equal, tokens] x (dispatched, live) for micro-batch `m`: the experts the policy's
    forward dispatched to and those its live routers chose, against the decoder's, over the tokens whose outputs
    the loss reads (every real token but each row's last: prompt and response)."""
    used, live = router.recorded()  # (B*S, L, k)
    attn = m.tokens(r.attn)
    mask = torch.nn.functional.pad(attn[:, :-1] * attn[:, 1:], (0, 1)).reshape(-1)
    want = m.tokens(r.routes).reshape(used.shape)
    return torch.stack([agreement(used, want, mask), agreement(live, want, mask)])


def routing_metrics(parts: torch.Tensor, replayed: bool) -> dict[str, float]:
    """The step's routing agreement over every rank's micro-batches: parts (micro-batches, 2, 3) from
    routing_agreement. routing_agree_*: the experts the training forward used; routing_live_agree_*: those its
    routers would have chosen (the same without replay, so only reported with it)."""
    sums = parts.sum(0)
    if dist.is_initialized():
        dist.all_reduce(sums)
    n = sums[:, 2].clamp(min=1)
    (used_c, used_t), (live_c, live_t) = (sums[:, :2] / n[:, None]).tolist()
    row = {"routing_agree_choice": used_c, "routing_agree_token": used_t}
    if replayed:
        row |= {"routing_live_agree_choice": live_c, "routing_live_agree_token": live_t}
    return row


def rollout_mismatch(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum |d|, max |d|, sum k3, tokens] over the response tokens of a micro-batch, d = log p_train - log p_rollout
    per sampled token; k3 = exp(d) - 1 - d estimates KL(rollout || train) from the rollout's own samples."""
    m = mask.bool()
    d = (train - rollout)[m]
    if d.numel() == 0:
        return torch.zeros(4, device=train.device)
    k3 = kl_k3(rollout[m], train[m])  # e^(train - rollout) - (train - rollout) - 1
    return torch.stack([d.abs().sum(), d.abs().max(), k3.sum(), torch.tensor(float(d.numel()), device=d.device)])


def mismatch_metrics(parts: torch.Tensor) -> dict[str, float]:
    """The rollout/train mismatch of a step over every rank's micro-batches: parts (micro-batches, 4) from
    rollout_mismatch."""
    sums, top = parts[:, [0, 2, 3]].sum(0), parts[:, 1].max()
    if dist.is_initialized():
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    n = max(float(sums[2]), 1.0)
    return {"rollout_logp_diff_mean": float(sums[0]) / n, "rollout_logp_diff_max": float(top),
            "rollout_kl_k3": float(sums[1]) / n}


class Timer:
    """Time per named phase without stopping the host. On CUDA an event is recorded on the stream at each lap and all
    are read once, by phases() after the step's last lap; the host never waits between phases or micro-batches, so it
    queues ahead as ZeRO-3's per-module hooks (host work) need. A phase's time is the stream's time between its two
    laps: its kernels and any time the device waited for the host. Elsewhere the wall clock (a CPU runs each op as
    it is called)."""

    def __init__(self):
        self.clock = DeviceClock()
        self.names, self.marks = [], [self.clock.mark()]

    def lap(self, name: str) -> None:
        self.names.append(name)
        self.marks.append(self.clock.mark())

    def phases(self) -> dict:
        """Seconds per phase (one wait on CUDA: for the last lap's event)."""
        self.clock.wait(self.marks[-1])
        out = {}
        for name, a, b in zip(self.names, self.marks, self.marks[1:]):
            out[name] = out.get(name, 0.0) + self.clock.seconds(a, b)
        return out


PHASES = ("grpo.rollout", "grpo.ref", "grpo.old", "grpo.policy")  # grpo_step's profiler annotations


def grpo_step(run: Run, rows: list[dict], sampling: SamplingConfig, step: int) -> dict:
    """One GRPO step on this rank's prompts: rollouts -> rewards -> advantages -> reference (and old) log-probs
    -> optimizer step(s). Returns the metrics row."""
    t0 = time.time()
    with record_function("grpo.rollout"):
        r = generate_rollouts(run, rows, sampling)
        scores, reward, adv = score(run, rows, r, step)
    run.last_reward = reward
    timer = Timer()
    count = response_tokens(r)
    if count == 0:  # dynamic sampling dropped every group on every rank: the loss would be 0/0, the update NaN
        skip_update(run)
        return metrics_row(run, r, scores, reward, {}, timer.phases(), 0, step, time.time() - t0, skipped=True)
    with record_function("grpo.ref"):
        refl = batched_logps(run.ref, r, run.micro, run.g.temperature) if run.ref is not None else None
    timer.lap("ref_s")
    with record_function("grpo.old"):
        old = old_logps(run, r)
    timer.lap("old_s")
    with record_function("grpo.policy"):
        stats, mismatch = policy_update(run, r, adv, old, refl, count)
    timer.lap("policy_s")
    forwards = run.g.iterations + (old is not None) + (run.ref is not None)
    return {**metrics_row(run, r, scores, reward, stats, timer.phases(), forwards, step, time.time() - t0), **mismatch}


def metrics_row(run: Run, r: Rollouts, scores, reward, stats: dict, phases: dict, forwards: int, step: int,
                step_s: float, skipped: bool = False) -> dict:
    """The step's metrics, averaged (or summed) over ranks. skipped: no update was made (update_skipped 1, loss 0;
    no kl, entropy or clip statistics, as no forward ran)."""
    train_s = sum(phases.values())
    n_micro = run.g.iterations * (len(r.ids) // run.micro)
    new_tokens = _sum_all(r.tree.generated_tokens if r.tree is not None else r.attn[:, r.p_len:].sum())  # shared prefixes once
    row = {"step": step, "reward": _mean_all(reward.mean()), "reward_std": _std_all(reward),
           "lr": run.policy.get_lr()[0], "response_len": _mean_all(r.attn[:, r.p_len:].sum(1).float().mean()),
           "generated_tokens": new_tokens, "rollout_tokens_per_s": new_tokens / max(r.seconds, 1e-9),
           "train_tokens_per_s": _sum_all(float(r.attn.sum()) * forwards) / max(train_s, 1e-9),
           "rollout_s": r.seconds, "train_s": train_s, **phases, "step_s": step_s, **memory_stats(),
           **loss_stats(stats, n_micro)}
    if getattr(run.rollout, "decode_steps", 0):
        row["decode_ms_per_step"] = 1000 * run.rollout.decode_s / run.rollout.decode_steps
    elif r.tree is None:  # another rollout engine: its whole generate call per step of the longest completion
        longest = _sum_all(r.attn[:, r.p_len:].sum(1).max(), dist.ReduceOp.MAX)
        row["rollout_ms_per_step"] = 1000 * r.seconds / max(longest, 1.0)
    if hasattr(run.rollout, "memory_bytes"):
        row["decoder_mem_gib"] = round(run.rollout.memory_bytes() / 2**30, 3)
    row["update_skipped"] = int(skipped)
    if skipped:
        row["loss"] = 0.0
    else:
        kl = row.pop("kl_mean", 0.0)
        if run.g.beta > 0:  # with beta 0 there is no reference: no KL is computed, so none is reported
            row["kl"] = kl
        row["entropy"] = row.pop("entropy_mean", 0.0)
    for label, vals in scores.per_reward.items():
        row[f"reward_{label}"] = _mean_all(float(vals.mean()))
    for label, n in scores.failures.items():
        row[f"reward_{label}_failures"] = _sum_all(float(n))
    return row


def no_dropout(model: torch.nn.Module) -> None:
    """Dropout off in the policy, which trains in training mode (activation checkpointing runs only there): the
    old-log-prob, reference and policy passes must compute one function of the weights for the ratio and the KL."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "dropout"):  # transformers' attention reads its rate from the module
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    for name in ("attention_dropout", "hidden_dropout", "dropout"):
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)


def setup(recipe: Recipe, ds: dict, tok, rewards, prompts, evals, world: World) -> Run:
    """The policy engine, the reference engine (beta > 0) and the rollout engine."""
    g = recipe.grpo
    # One init on every rank, as in pretraining: with a random init (grpo.allow_random_init) each rank's AutoEP
    # experts are then its slice of the same model (under ZeRO-1/2 DeepSpeed broadcasts experts only within an
    # expert's data-parallel group; ZeRO-3's zero.Init broadcasts every weight from rank 0).
    torch.manual_seed(recipe.train.seed)
    layers = policy_compiles_layers(recipe, ds)
    plain_linear_for_compiled_layers(ds, layers)  # read by zero.Init (the reference's too)
    model = build_model(recipe.model, ds, tok, dtype=model_dtype(ds), device=_build_device(ds))
    no_dropout(model)
    if recipe.train.activation_checkpointing:  # as in pretraining; a replayed forward's recompute replays too
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    t = recipe.train  # one schedule step per optimizer step: `iterations` per GRPO step
    schedule = replace(t, max_steps=t.max_steps * g.iterations, warmup_steps=t.warmup_steps * g.iterations,
                       decay_steps=t.decay_steps and t.decay_steps * g.iterations)
    policy = build_engine(model, ds, schedule, lengths_vary=True, layers=layers)
    if world.rank:  # different samples on each rank (rank 0 draws on from the build's stream)
        torch.manual_seed(recipe.train.seed + world.rank)
    if layers:
        mixers = eager_linear_attention(policy.module) if recipe.train.compile == "auto" else 0
        done = compile_layers(policy.module, dynamic=None)
        eager = f"; the linear attention of {mixers} layers eager: train.compile true compiles it" if mixers else ""
        print0(f"compile: the policy's decoder layers and shared experts ({len(done)} functions; AutoEP eager{eager}), "
               "any length")
    ref = build_reference(policy, recipe, ds, tok, world.size) if g.beta > 0 else None
    micro = policy.train_micro_batch_size_per_gpu()
    n_seq = micro * policy.gradient_accumulation_steps()
    cache_len = decoder_cache_len(prompts + evals, cache_tokens(g))
    # the decoder keeps its expert choices: for replay and the routing agreement metric
    record = rollout_kind(recipe) == "local" and has_moe(policy.module.config)
    rollout = build_rollout(rollout_kind(recipe), policy, tok, n_seq, cache_len, g.decode_experts, g.min_new_tokens,
                            record_routes=record, decode_attention=g.decode_attention)
    router = Router(policy.module) if record else None
    return Run(policy, ref, rollout, tok, rewards, g, loss_config(g), world, micro, n_seq, router=router)


def policy_compiles_layers(recipe: Recipe, ds: dict) -> bool:
    """Whether the policy's decoder layers are compiled whole (pretrain.compile_layers, one trace for any length):
    train.compile true, or "auto" where ds_config.grpo_compiles_layers says so and the rollout decodes on its own
    copy (grpo.rollout local). With grpo.rollout engine, generation runs through the policy's own layers a token at a
    time, which compiled layers were not measured at: "auto" keeps to the parameter-free functions there."""
    layers = grpo_compiles_layers(recipe.train.compile, ds, device_kind())
    return layers and (recipe.train.compile is True or rollout_kind(recipe) == "local")


def decoder_cache_len(rows: list[dict], max_new_tokens: int) -> int:
    """KV-cache slots of the rollout decoder: the run's longest prompt (counted in preflight) + the new tokens,
    rounded up to a multiple of 16. Fixed for the run, so the compiled decode step never sees a new shape."""
    need = max(r["n_tokens"] for r in rows) + max_new_tokens
    return -(-need // 16) * 16


def train(recipe: Recipe, ds: dict, tok, prompts, evals, rewards, init: str | None, world: World,
          source: str | None = None, profile_step: int | None = None) -> list[dict]:
    """`init`: the Hugging Face dir the policy and reference start from (None: random); `source`: the --init_from it
    came from, recorded in checkpoints (a resume compares it)."""
    g = recipe.grpo
    recipe = replace(recipe, model=replace(recipe.model, init_from=init))  # checkpoints record the real source
    try:
        run = setup(recipe, ds, tok, rewards, prompts, evals, world)
    except RuntimeError as e:
        if is_out_of_memory(e):
            e.building = True  # main's error line: the engines did not fit, not the batch
        raise
    state = (checkpoint.load(run.policy, recipe.run_dir, recipe.train.lr) if recipe.resume
             else {"step": 0, "position": 0, "tokens": 0})
    step, n_prompts = state["step"], run.n_seq // g.group_size
    generated = state["tokens"]  # GRPO's checkpoints count generated tokens (over ranks) in "tokens"
    # Prompts consumed over all ranks; checkpoints before prompts_done existed hold only the data position
    # (micro-batches per rank, as in pretraining, converted to this world size by checkpoint.load).
    done = state.get("prompts_done", state["position"] * run.micro * world.size // g.group_size)
    order = np.random.default_rng(recipe.data_seed()).permutation(len(prompts))
    cur = curriculum.for_run(g.curriculum, len(prompts), n_prompts * world.size, recipe.data_seed(),
                             state.get("curriculum"))  # None unless grpo.curriculum.enabled
    metrics = Metrics(recipe.run_dir, recipe.train.max_steps, step, run.policy.monitor)
    saver = checkpoint.Cadence(recipe.checkpoint, run.device, stop_file=Path(recipe.run_dir) / checkpoint.STOP_FILE)
    sampling = SamplingConfig(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                              n_samples_per_prompt=g.group_size)
    rows = []
    finished = step >= recipe.train.max_steps or budget_spent(generated, g)  # by the checkpoint resumed: a note says so
    if finished:
        print0(checkpoint.nothing_to_train(step, f"train.max_steps ({recipe.train.max_steps})"
                                           if step >= recipe.train.max_steps
                                           else f"grpo.max_generated_tokens ({g.max_generated_tokens})"))
    elif evals and step == 0:  # the starting point (a resumed run's step was evaluated, if due, before it was saved)
        rows.append({"step": step, **evaluate(run, evals)})
        metrics.log(rows[-1])
    while step < recipe.train.max_steps and not budget_spent(generated, g):
        # This rank's prompts: global positions done + rank*P + [0, P); one global order on any world size.
        start = done + world.rank * n_prompts
        done += n_prompts * world.size
        batch_rows = [prompts[order[(start + i) % len(prompts)]] for i in range(n_prompts)]
        step += 1
        if cur is not None:  # by pass rates so far: one global draw per step, this rank's slice of it
            mine, cur_row = cur.rank_draw(step, world.rank, n_prompts)
            batch_rows = [prompts[i] for i in mine]
        with profiled(step == profile_step, Path(recipe.run_dir) / f"profile_step_{step}.txt", world.rank):
            row = grpo_step(run, batch_rows, sampling, step)
        if cur is not None:
            cur.update_from_ranks(mine, run.last_reward)  # every rank's rewards: the same statistics everywhere
            row.update(cur_row)
        metrics.advance()
        generated += row["generated_tokens"]  # the same sum on every rank
        row["generated_tokens_total"] = generated
        last = step == recipe.train.max_steps or budget_spent(generated, g)
        if evals and (step % g.eval_every == 0 or last):
            row.update(evaluate(run, evals))
        metrics.log(row)
        rows.append(row)
        save, stop = saver.due(step, step if last else recipe.train.max_steps)  # at_end: the budget's last step too
        if save:
            checkpoint.save(run.policy, recipe, {"step": step, "tokens": int(generated), "init_source": source,
                                                 "prompts_done": done,
                                                 "position": done * g.group_size // (run.micro * world.size),
                                                 **({"curriculum": cur.state_dict()} if cur else {})}, tok)
        if stop:
            print0(f"stopped by {saver.why()} after step {step}; saved, continue with --resume")
            break
    if budget_spent(generated, g) and not finished:
        print0(f"grpo.max_generated_tokens {g.max_generated_tokens} reached after step {step}: {generated:.0f} "
               "tokens generated")
    saver.close()
    metrics.close()
    return rows


@contextlib.contextmanager
def profiled(on: bool, path: Path, rank: int):
    """torch.profiler around the block when `on`; rank 0 writes to `path` the operators with the most device time and
    the most host time (ZeRO-3's hooks are host time) and, on a GPU, the device's idle time per phase of grpo_step and
    the host operators it waited for (engine/devprof.py)."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
    if rank == 0:
        avg = prof.key_averages()
        tables = [f"== by {key}\n" + avg.table(sort_by=key, row_limit=40, max_name_column_width=70)
                  for key in (["self_cuda_time_total"] if cuda else []) + ["cpu_time_total"]]
        if cuda:  # where the device waited for the host, per phase and by host operator (engine/devprof.py)
            tables.insert(0, idle_report(prof.events(), PHASES))
        path.write_text("\n".join(tables))
        print0(f"profile of this step: {path}")


def done_line(rows: list[dict], run_dir: str) -> str:
    """The run's last line: its last step, reward, KL and latest held-out reward, and where every row is."""
    last = rows[-1]
    held = next((r for r in reversed(rows) if "eval_reward" in r), None)
    parts = [f"done: {last['step']} steps"] + ([f"reward {last['reward']:.4g} at the last step"] if "reward" in last
                                               else [])
    if "kl" in last:
        parts.append(f"kl {last['kl']:.4g}")
    if held is not None:
        parts.append(f"held-out reward {held['eval_reward']:.4g} at step {held['step']}")
    return ", ".join(parts) + f"; every step's row in {Path(run_dir) / 'metrics.jsonl'}"


def budget_spent(generated: float, g: GRPOConfig) -> bool:
    """Whether grpo.max_generated_tokens (when set) has been reached by the run's generated tokens."""
    return g.max_generated_tokens is not None and generated >= g.max_generated_tokens


def loss_stats(stats: dict, n_micro: int) -> dict[str, float]:
    """policy_update's sums over every rank: the loss as the mean of the micro-batches' (what the gradient averages),
    the other statistics (clip fractions, ratio, KL, entropy, rollout_corrected_frac) as means over all response
    tokens, so a short micro-batch, or one that dynamic sampling left empty, weighs by its tokens."""
    tokens = _sum_all(stats.get("tokens", 0.0))
    return {k: _mean_all(v / n_micro) if k == "loss" else _sum_all(v) / max(tokens, 1.0)
            for k, v in stats.items() if k != "tokens"}


def _mean_all(x) -> float:
    t = torch.tensor(float(x), dtype=torch.float64)
    if dist.is_initialized():
        t = t.to(_device())
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()


def _std_all(x: torch.Tensor) -> float:
    """The standard deviation (n - 1) of x's values over all ranks, as one batch: a mean of the ranks' own standard
    deviations is lower wherever the ranks' means differ."""
    x = x.detach().double()
    n, s, s2 = _sum_all(x.numel()), _sum_all(x.sum()), _sum_all((x * x).sum())
    return max(s2 - s * s / n, 0.0) ** 0.5 / max(n - 1, 1) ** 0.5 if n else 0.0


def _sum_all(x, op=None) -> float:
    """x summed over the ranks (or reduced with `op`: dist.ReduceOp.MAX)."""
    t = torch.tensor(float(x), dtype=torch.float64)
    if dist.is_initialized():
        t = t.to(_device())
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.item()


def _device():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def main(argv=None) -> int:
    args = parse_args(argv)
    world = world_from_env()
    problem = None
    try:
        recipe, ds, tok, prompts, evals, rewards, init = preflight(args, world)
    except ConfigError as e:
        problem = e
    if not start_ranks(world, problem):
        return 2
    try:
        check_ranks_agree(ds, world)  # "auto" follows each rank's device
    except ConfigError as e:
        report_error(e, world)
        return 2
    source = checkpoint.saved_state(recipe.run_dir).get("init_source") if recipe.resume else None
    source = source or (str(Path(args.init_from).resolve()) if args.init_from else init)
    if init is None and args.init_from:
        init = str(Path(recipe.run_dir) / "init_hf")
        if world.rank == 0:
            from .export.write import export

            export(args.init_from, init, dtype="fp32", force=True,
                   log=lambda m: print(f"the starting checkpoint as a Hugging Face model in {init}: {m}"))
        dist.barrier()
    try:
        rows = train(recipe, ds, tok, prompts, evals, rewards, init, world, source, args.profile_step)
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        levers = "set train.activation_checkpointing: true in the recipe, or lower grpo.max_new_tokens"
        report_error(out_of_memory(e, ds, not getattr(e, "building", False), levers), world)
        return 1
    finally:
        forget_zero3_for_transformers()
    if rows:  # none when a resumed run had already reached max_steps or its token budget (a note said so)
        print0(done_line(rows, recipe.run_dir))
    return 0

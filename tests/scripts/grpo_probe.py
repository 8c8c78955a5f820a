"""GRPO test probe, started by the real `deepspeed` launcher. It runs GRPO exactly as bin/grpo.py does
(engine.grpo.preflight, then engine.grpo.train, which calls build_reference and build_rollout) and wraps two of
its functions to record what the tests check, per rank, in OUT/rank{r}.json:
  - logits of the policy engine, the reference engine and a local rollout copy (engine.rollout.local_copy) on one
    fixed input, right after the reference is built (before the first update) and again after training (the
    policy's own logits both times)
  - the largest difference between the reference's and the policy's local ZeRO-3 shards, before and after (a
    reference engine: several ranks), and the reference's class
  - every rollout: greedy or sampled, how many decode steps it ran, each completion's length, and the
    torch.distributed collectives called during it
  - the metric rows train() returned, and this rank's rewards of each step
  - at the first update: the log-probs the loss received (policy and reference) against those of the sampling
    distribution (a plain copy's logits / grpo.temperature) at the sampled tokens
  - local rollouts: greedy tokens of the persistent decoder against transformers' generate on a plain copy of the
    same weights, at the first rollout (before any update) and after training; decoders built; whether each
    step skipped the old-log-prob forward
--copy_only: build the policy engine only (as train() does) and compare local_copy's logits with it.
--force_old_logps: run the old-log-prob forward even with iterations 1 (the path before it was skipped).
--no_pack: train on consecutive full-width micro-batches (engine/grpo.py micro_batches with pack=False).
usage: deepspeed --num_gpus N tests/scripts/grpo_probe.py --out DIR [--copy_only] [--force_old_logps]
       --deepspeed_config ... [grpo args]
"""
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine import grpo  # noqa: E402
from engine.model import build_model  # noqa: E402
from engine.parallel import build_engine, init_distributed, model_dtype, world_from_env  # noqa: E402
from engine.decoder import Decoder  # noqa: E402
from engine.rollout import local_copy  # noqa: E402

# One input, the same on every rank: two texts of different lengths, left-padded as rollouts are.
TEXTS = ["Q: 20 + 36 = ? A: 56", "Gus went to the harbor with 9 pens. Ada gave Gus"]


@torch.no_grad()
def logits(model, req) -> torch.Tensor:
    """Logits as engine.grpo.forward_logps computes them (positions follow the left padding)."""
    ids, attn = req.prompt_ids, req.prompt_attention_mask
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    return out[attn.bool()]  # real tokens only: (tokens, V)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def shard_diff(policy, ref) -> float:
    """Largest difference between the reference's and the policy's local shards (no collectives)."""
    pol = dict(policy.module.named_parameters())
    worst = 0.0
    for name, p in ref.module.named_parameters():
        q = pol[name]
        a, b = (p.ds_tensor, q.ds_tensor) if hasattr(p, "ds_tensor") else (p.data, q.data)
        if a.numel():
            worst = max(worst, diff(a.float(), b.float()))
    return worst


def local_copy_check(policy, req) -> dict:
    copy = local_copy(policy.module, policy.device)
    full = {n: list(t.shape) for n, t in copy.named_parameters() if ".experts." in n}
    pol = logits(policy, req)
    d = diff(logits(copy, req), pol)
    with torch.no_grad():  # negative control: experts 0 and 7 of layer 0 swapped (as a wrong gather order would)
        for w in (copy.model.layers[0].mlp.experts.gate_up_proj, copy.model.layers[0].mlp.experts.down_proj):
            w[[0, 7]] = w[[7, 0]].clone()
    swapped = diff(logits(copy, req), pol)
    del copy
    return {"copy_vs_policy": d, "swapped_experts_vs_policy": swapped, "copy_expert_shapes": full}


def same_samples(policy, rollout, tok, prompts: list[str]) -> dict:
    """Greedy tokens of the rollout decoder and of transformers' generate on a plain copy of the policy's weights."""
    req = grpo.left_pad(prompts, tok, policy.device)
    ours = rollout.decoder.generate(req.prompt_ids, req.prompt_attention_mask, 8, tok.eos_token_id, tok.pad_token_id,
                                    temperature=0.0)
    plain = local_copy(policy.module, policy.device)
    theirs = plain.generate(req.prompt_ids, attention_mask=req.prompt_attention_mask, max_new_tokens=8,
                            do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            synced_gpus=False)
    return {"decoder": ours.tolist(), "generate": theirs.tolist(), "prompt_width": req.prompt_ids.shape[1]}


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single", "barrier")


@contextlib.contextmanager
def counting_collectives():
    """Counts calls of torch.distributed collectives looked up at call time (transformers' synced_gpus flag,
    AutoEP's all-to-all; not ZeRO-3's gathers, whose function DeepSpeed caches at start)."""
    calls: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name, fn):
        def f(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)
        return f

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def ep_sizes(policy) -> list[int]:
    return [m.ep_size for m in policy.module.modules() if getattr(m, "_is_autoep_layer", False)]


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    copy_only = "--copy_only" in sys.argv
    force_old = "--force_old_logps" in sys.argv
    if "--no_pack" in sys.argv:  # the train passes on consecutive full-width micro-batches, as before packing
        micro_batches = grpo.micro_batches
        grpo.micro_batches = lambda attn, micro, pack=True: micro_batches(attn, micro, pack=False)
    flags = ("--out", "--copy_only", "--force_old_logps", "--no_pack")
    argv = [a for i, a in enumerate(sys.argv[1:]) if a not in flags and sys.argv[i] != "--out"]
    args = grpo.parse_args(argv)
    world = world_from_env()
    recipe, ds, tok, prompts, evals, rewards, init = grpo.preflight(args, world)
    init_distributed()
    info: dict = {"rank": world.rank, "world": world.size}
    out.mkdir(parents=True, exist_ok=True)

    if copy_only:
        model = build_model(replace(recipe.model, init_from=init), ds, tok, dtype=model_dtype(ds))
        policy = build_engine(model, ds, recipe.train)
        req = grpo.left_pad(TEXTS, tok, policy.device)
        info["ep_size"] = ep_sizes(policy)
        info.update(local_copy_check(policy, req))
        (out / f"rank{world.rank}.json").write_text(json.dumps(info))
        return

    seen: dict = {}
    rollouts: list[dict] = []
    build_reference, build_rollout, old_logps = grpo.build_reference, grpo.build_rollout, grpo.old_logps
    texts = [r["prompt"] for r in prompts]
    info["old_logps"] = []  # per step: True where the old-log-prob forward ran

    def old_logps_recorded(run, r):
        old = grpo.batched_logps(run.policy, r, run.micro, run.g.temperature, run) if force_old else old_logps(run, r)
        info["old_logps"].append(old is not None)
        return old

    def build_reference_recorded(policy, *a, **k):
        ref = build_reference(policy, *a, **k)
        seen.update(policy=policy, ref=ref)
        info["ep_size"] = ep_sizes(policy)
        # the policy's decoder layers whose forward is compiled (train.compile: true: pretrain.compile_layers)
        info["compiled_layers"] = sum(hasattr(layer.forward, "_torchdynamo_orig_callable")
                                      for layer in policy.module.get_decoder().layers)
        from deepspeed.runtime.zero.linear import zero3_linear_wrap  # zero.Init's linear (memory_efficient_linear)

        info["deepspeed_linear"] = torch.nn.functional.linear is zero3_linear_wrap
        r = grpo.left_pad(TEXTS, tok, policy.device)
        seen["policy_before"], seen["ref_before"] = logits(policy, r), logits(ref, r)
        info["ref_vs_policy_before"] = diff(seen["ref_before"], seen["policy_before"])
        info["policy_before"] = seen["policy_before"].tolist()
        engine_ref = hasattr(ref, "module")  # ZeRO-3 on several ranks; else a plain copy (grpo.build_reference)
        info["ref_kind"] = type(ref).__name__
        info["shards_before"] = shard_diff(policy, ref) if engine_ref else None
        info["before"] = local_copy_check(policy, r)
        info["ref_training"] = (ref.module if engine_ref else ref).training
        return ref

    def build_rollout_recorded(kind, engine, tokenizer, *a, **k):
        rollout = build_rollout(kind, engine, tokenizer, *a, **k)
        seen.setdefault("policy", engine)
        info["rollout_class"] = type(rollout).__name__
        generate = rollout.generate

        def generate_recorded(request, sampling):
            if "samples_before" not in info and hasattr(rollout, "decoder"):  # first rollout: nothing trained yet
                info["samples_before"] = same_samples(seen["policy"], rollout, tok, texts)
            t0 = time.time()
            with counting_collectives() as calls:
                batch = generate(request, sampling)
            p_len = int(batch.response_start_idx[0])
            rollouts.append({"greedy": sampling.temperature <= 0, "prompts": request.prompt_ids.shape[0],
                             "decode_steps": batch.input_ids.shape[1] - p_len,
                             "completion_lens": batch.attention_mask[:, p_len:].sum(1).tolist(), "collectives": calls,
                             "seconds": time.time() - t0})
            return batch

        rollout.generate = generate_recorded
        seen["rollout"] = rollout
        return rollout

    policy_loss, policy_update = grpo.policy_loss, grpo.policy_update
    loss_inputs: list = []

    def policy_loss_recorded(logp, old_logp, adv, mask, cfg, ref_logp=None, **k):
        loss_inputs.append((logp.detach().clone(), None if ref_logp is None else ref_logp.clone(), mask.clone()))
        return policy_loss(logp, old_logp, adv, mask, cfg, ref_logp=ref_logp, **k)

    def policy_update_recorded(run, r, *args):
        if "sampling_vs_train_logp" in info:
            return policy_update(run, r, *args)
        # The first update: the policy is still the one that sampled. Its log-probs of the sampled tokens, from a
        # plain copy at the sampling temperature, against those the loss received (collective: every rank here).
        with torch.no_grad():
            copy = local_copy(run.policy.module, run.policy.device)
            pos = (r.attn.cumsum(-1) - 1).clamp(min=0)
            lg = copy(input_ids=r.ids, attention_mask=r.attn, position_ids=pos).logits[:, :-1].float()  # (N, T-1, V)
            del copy
        pick = lambda x: torch.log_softmax(x, -1).gather(-1, r.ids[:, 1:, None]).squeeze(-1)  # noqa: E731
        want, at_one = pick(lg / run.g.temperature), pick(lg)
        n0 = len(loss_inputs)
        out = policy_update(run, r, *args)
        logp, ref_logp, mask = loss_inputs[n0]  # the first micro-batch: its rows and columns as the loss got them
        first = grpo.micro_batches(r.attn, run.micro)[0]
        want, at_one = first.targets(want), first.targets(at_one)
        m = mask.bool()
        info.update(temperature=run.g.temperature, sampling_vs_train_logp=diff(logp[m], want[m]),
                    sampling_vs_ref_logp=diff(ref_logp[m], want[m]), untempered_vs_sampling_logp=diff(at_one[m], want[m]))
        return out

    grpo_step, rewards_seen = grpo.grpo_step, []

    def grpo_step_recorded(run, *args):  # this rank's rewards of each step, for the metrics row's reward_std
        row = grpo_step(run, *args)
        rewards_seen.append(run.last_reward.tolist())
        return row

    grpo.grpo_step = grpo_step_recorded
    grpo.build_reference, grpo.build_rollout = build_reference_recorded, build_rollout_recorded
    grpo.old_logps, grpo.policy_loss, grpo.policy_update = old_logps_recorded, policy_loss_recorded, policy_update_recorded
    builds = Decoder.builds  # a process-wide count: this process may have run other jobs (tests/scripts/pool.py)
    try:
        rows = grpo.train(recipe, ds, tok, prompts, evals, rewards, init, world)
    finally:
        grpo.build_reference, grpo.build_rollout, grpo.old_logps = build_reference, build_rollout, old_logps
        grpo.policy_loss, grpo.policy_update, grpo.grpo_step = policy_loss, policy_update, grpo_step
    info["decoder_builds"] = Decoder.builds - builds
    if hasattr(seen["rollout"], "decoder"):  # after the last optimizer step: refresh, then compare again
        seen["rollout"].sync_weights(0)
        info["samples_after"] = same_samples(seen["policy"], seen["rollout"], tok, texts)

    policy, ref = seen["policy"], seen["ref"]
    r = grpo.left_pad(TEXTS, tok, policy.device)
    pol_after, ref_after = logits(policy, r), logits(ref, r)
    info.update(rows=rows, rollouts=rollouts, step_rewards=rewards_seen,
                ref_after_vs_before=diff(ref_after, seen["ref_before"]),
                policy_after_vs_before=diff(pol_after, seen["policy_before"]), policy_after=pol_after.tolist(),
                ref_vs_policy_after=diff(ref_after, pol_after),
                shards_after=shard_diff(policy, ref) if hasattr(ref, "module") else None,
                after=local_copy_check(policy, r))
    (out / f"rank{world.rank}.json").write_text(json.dumps(info))
    torch.distributed.barrier()


if __name__ == "__main__":
    from engine.proc import exit_now  # skips the interpreter's slow teardown
    exit_now(main())

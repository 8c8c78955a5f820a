"""Routing replay probe (grpo.routing_replay r3), started by the real `deepspeed` launcher on 1 or 2 CPU ranks.

Builds what engine.grpo.setup builds (the policy engine with AutoEP and ZeRO-3, the recording rollout decoder, the
Router on the policy's routers), samples the same 8 rollouts on every rank (the same seed: the decoder is a local
copy, no collectives), and trains on this rank's share (all of them on 1 rank, 4 each on 2):
  - `real`: a forward replaying the decoder's recorded routes: the experts it dispatched to vs the recording;
  - `foreign`: the recorded routes with every expert id moved to the next expert (so they differ from what the
    live routers choose), replayed in a forward + backward of loss = -sum(log p of the response tokens) / (all
    ranks' response tokens) x world: each router's full gradient (safe_get_full_grad, before the step);
  - the GRPO step's old-log-prob pass (grpo.old_logps, iterations 2) on the foreign routes, replay on and off;
  - the same loss and routes by hand: a plain Hugging Face fp32 copy of the policy whose routers return the
    foreign ids with transformers' own routing arithmetic, gradients averaged over ranks as DeepSpeed does.
OUT/rank{r}.json holds the checks; the test compares runs (1, 2 and 4 ranks, activation checkpointing off and on).
usage: deepspeed --num_gpus N tests/scripts/replay_probe.py --out DIR --deepspeed_config ... [grpo args]
"""
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine import grpo  # noqa: E402
from engine.parallel import init_distributed, world_from_env  # noqa: E402
from engine.rollout import local_copy  # noqa: E402
from deepspeed.runtime.rollout import SamplingConfig  # noqa: E402


def response_mask(out, p_len):
    m = out.attention_mask[:, 1:].clone().float()
    m[:, : p_len - 1] = 0
    return m


def fixed_router_forward(ids):
    """A transformers DeepSeek-V3 router that returns `ids` (T, k) as its choice, with its own arithmetic for the
    weights (sigmoid scores of the chosen experts, normalised, scaled)."""
    def forward(self, hidden_states):
        h = hidden_states.view(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h.float(), self.weight.float())
        w = logits.sigmoid().gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, ids
    return forward


def main() -> None:
    out_dir = Path(sys.argv[sys.argv.index("--out") + 1])
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--out" and sys.argv[i] != "--out"]
    args = grpo.parse_args(argv)
    world = world_from_env()
    recipe, ds, tok, prompts, evals, rewards, init = grpo.preflight(args, world)
    init_distributed()
    from dataclasses import replace
    recipe = replace(recipe, model=replace(recipe.model, init_from=init))
    run = grpo.setup(recipe, ds, tok, rewards, prompts, evals, world)
    policy, router = run.policy, run.router
    info = {"rank": world.rank, "world": world.size, "ep_size": router.layers[0].ep_size,
            "checkpointing": bool(getattr(policy.module, "is_gradient_checkpointing", False))  # and it runs: the
            and all(m.training for m in policy.module.modules() if getattr(m, "gradient_checkpointing", False))}

    torch.manual_seed(0)  # the same rollouts on every rank
    run.rollout.sync_weights(0)
    req = grpo.left_pad([r["prompt"] for r in prompts], tok, policy.device)
    batch = run.rollout.generate(req, SamplingConfig(max_new_tokens=8, temperature=1.0, n_samples_per_prompt=4))
    routes = run.rollout.last_routes  # (8, T, L, k)
    ids, attn, p_len = batch.input_ids, batch.attention_mask, int(batch.response_start_idx[0])
    mask = response_mask(batch, p_len)
    n_total = mask.sum()
    share = len(ids) // world.size
    mine = slice(world.rank * share, (world.rank + 1) * share)
    keep = torch.nn.functional.pad(attn[mine, :-1] * attn[mine, 1:], (0, 1)).reshape(-1).bool()
    E = router.layers[0].router.num_experts
    foreign = (routes + 1) % E

    with torch.no_grad(), router.use(routes[mine], record=True):
        grpo.forward_logps(policy, ids[mine], attn[mine], 1.0)
        used, live = router.recorded()
    want = routes[mine].reshape(used.shape).long()
    info["real_used_equal"] = bool((used == want)[keep].all())
    info["real_live_agree"] = float((live.sort(-1).values == want.sort(-1).values).all(-1)[keep].float().mean())

    with router.use(foreign[mine], record=True):
        logp = grpo.forward_logps(policy, ids[mine], attn[mine], 1.0)[0]
        used, live = router.recorded()
        loss = -(logp * mask[mine]).sum() / n_total * world.size
        policy.backward(loss)
    # The GRPO step's own wiring (Rollouts.replay -> routed -> batched_logps), here its old-log-prob pass (iterations
    # 2): with r3 it replays the foreign routes as the forward above did; with replay off its routers choose.
    r_f = grpo.Rollouts(ids[mine], attn[mine], mask[mine], [], p_len, 0.0, routes=foreign[mine])
    for mode in ("r3", "off"):
        run2 = replace(run, g=replace(run.g, iterations=2, temperature=1.0, routing_replay=mode))
        old = grpo.old_logps(run2, r_f)
        info[f"old_logp_{mode}_vs_foreign"] = float((old - logp.detach())[mask[mine].bool()].abs().max())
    fwant = foreign[mine].reshape(used.shape).long()
    info["foreign_used_equal"] = bool((used == fwant)[keep].all())
    info["foreign_live_equal"] = float((live.sort(-1).values == fwant.sort(-1).values).all(-1)[keep].float().mean())
    from deepspeed.utils import safe_get_full_grad
    info["loss"] = float(loss.detach())
    info["grads"] = [safe_get_full_grad(layer.router.gate.weight).flatten().tolist() for layer in router.layers]

    # by hand: transformers' own model on the same weights, its routers returning the foreign ids
    copy = local_copy(policy.module, policy.device).float()
    copy.requires_grad_(False)
    gates = [layer.mlp.gate for layer in copy.model.layers if hasattr(layer.mlp, "experts")]
    f = foreign[mine].long()
    for slot, g in enumerate(gates):
        g.weight.requires_grad_(True)
        g.forward = types.MethodType(fixed_router_forward(f[:, :, slot].reshape(-1, f.shape[-1])), g)
    hand = grpo.forward_logps(copy, ids[mine], attn[mine], 1.0)[0]
    (-(hand * mask[mine]).sum() / n_total * world.size).backward()
    grads = [g.weight.grad.clone() for g in gates]
    for gr in grads:
        dist.all_reduce(gr)
        gr /= world.size
    info["hand_grads"] = [gr.flatten().tolist() for gr in grads]
    info["hand_logp_vs_engine"] = float((hand.detach() - logp.detach()).abs().max())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{world.rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()

"""Test job for the rank pool (conftest.run_ranks(2, ...)): engine.grpo.policy_update on each rank's own rollout
batch, through a fake engine that treats the loss as DeepSpeed does (backward of loss / gradient_accumulation_steps,
the gradients averaged over the data-parallel ranks at the accumulation boundary), for each aggregation (grpo, dapo,
dr_grpo). The ranks' batches hold different numbers of response tokens. Every rank also computes, by hand, the
aggregation's loss over the whole batch of both ranks in one piece (engine/grpo_math.py's definitions) and its
gradient, and the entropy's mean over all response tokens (the micro-batches hold 12, 11, 3 and 4: a mean of their
means differs); rank 0 writes both, with what policy_update gave, to OUT (JSON).
usage: deepspeed --num_gpus 2 tests/scripts/grpo_norm_ranks.py OUT
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine import grpo  # noqa: E402
from engine.config import GRPOConfig  # noqa: E402
from engine.parallel import init_distributed, world_from_env  # noqa: E402

V, P, R = 16, 3, 6  # vocabulary, prompt length, max_new_tokens
N_SEQ, MICRO = 4, 2  # sequences per rank, per micro-batch: 2 accumulation steps
RESPONSE_LENGTHS = [[6, 6, 5, 6], [1, 2, 1, 3]]  # per rank: 23 and 7 response tokens


class TinyLM(torch.nn.Module):
    """Logits from the token and its position; answers forward_logps's call as engine/head.py's model does."""

    def __init__(self):
        super().__init__()
        self.emb, self.pos, self.out = torch.nn.Embedding(V, 8), torch.nn.Embedding(P + R, 8), torch.nn.Linear(8, V)

    def forward(self, input_ids, attention_mask, position_ids, logprob_targets, temperature, with_entropy=False,
                use_cache=False):
        logits = self.out(torch.tanh(self.emb(input_ids) + self.pos(position_ids)))[:, :-1] / temperature
        logp = torch.log_softmax(logits.float(), -1)
        ent = -(logp.exp() * logp).sum(-1).detach() if with_entropy else None
        return SimpleNamespace(logprobs=logp.gather(-1, logprob_targets[..., None]).squeeze(-1), entropy=ent)


class DeepSpeedLike:
    """The loss as a DeepSpeed engine takes it: backward(loss) runs (loss / gas).backward(); step() at each
    accumulation boundary averages the gradients over the data-parallel ranks (all-reduce / world size), keeps them
    in `averaged` and zeroes them (no parameter update: every pass's gradient is at the same weights)."""

    def __init__(self, module, gas: int):
        self.module, self.gas, self.device = module, gas, torch.device("cpu")
        self.micro_steps, self.scaled_loss, self.averaged = 0, 0.0, None

    def __call__(self, **kw):
        return self.module(**kw)

    def backward(self, loss):
        self.scaled_loss += float(loss.detach()) / self.gas
        (loss / self.gas).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return
        grads = [p.grad for p in self.module.parameters()]
        for g in grads:
            dist.all_reduce(g)
            g /= dist.get_world_size()
        self.averaged = [g.clone() for g in grads]
        self.module.zero_grad()


def batch(rank: int):
    """Rank `rank`'s rollouts (left-padded prompts, completions of RESPONSE_LENGTHS) and advantages: the same on every
    rank for the same `rank`."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, V, (N_SEQ, P + R), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 0] = 0  # a left-padded prompt
    for i, n in enumerate(RESPONSE_LENGTHS[rank]):
        attn[i, P + n:] = 0
    resp = attn[:, 1:].clone()
    resp[:, :P - 1] = 0  # response targets start at ids[:, P]
    return grpo.Rollouts(ids, attn, resp, [], P, 0.0), torch.randn(N_SEQ, generator=g)


def whole_batch_loss(model, aggregation: str, batches) -> torch.Tensor:
    """engine/grpo_math.py's loss over the rows of every rank in one batch, by hand: with old log-probs = log-probs
    (one optimizer step per rollout batch) the ratio is 1 with gradient d logp, and each token's loss is
    -A exp(logp - logp.detach()). grpo: the mean over sequences of each one's token mean; dapo: the mean over all
    tokens; dr_grpo: the sum over tokens / (sequences x max_new_tokens)."""
    ids = torch.cat([r.ids for r, _ in batches])
    attn = torch.cat([r.attn for r, _ in batches])
    mask = torch.cat([r.resp_mask for r, _ in batches]).float()
    adv = torch.cat([a for _, a in batches])
    logp = grpo.forward_logps(model, ids, attn, 1.0)[0]
    tok = -adv[:, None] * torch.exp(logp - logp.detach()) * mask
    if aggregation == "grpo":
        return (tok.sum(1) / mask.sum(1)).mean()
    if aggregation == "dapo":
        return tok.sum() / mask.sum()
    return tok.sum() / (ids.shape[0] * R)


def whole_batch_entropy(model, batches) -> float:
    """The mean of the policy's entropy over every response token of both ranks, by hand."""
    ids = torch.cat([r.ids for r, _ in batches])
    attn = torch.cat([r.attn for r, _ in batches])
    mask = torch.cat([r.resp_mask for r, _ in batches]).float()
    with torch.no_grad():
        _, ent = grpo.forward_logps(model, ids, attn, 1.0, with_entropy=True)
    return float((ent * mask).sum() / mask.sum())


def main(out: Path) -> None:
    if not dist.is_initialized():
        init_distributed(watchdog=False)
    world = world_from_env()
    assert world.size == 2, world
    batches = [batch(r) for r in range(world.size)]
    torch.manual_seed(0)
    model = TinyLM()
    results = {"tokens": [int(r.resp_mask.sum()) for r, _ in batches]}
    for aggregation in ("grpo", "dapo", "dr_grpo"):
        g = GRPOConfig(aggregation=aggregation, max_new_tokens=R, normalize_std=aggregation != "dr_grpo")
        engine = DeepSpeedLike(model, N_SEQ // MICRO)
        run = grpo.Run(engine, None, None, None, None, g, grpo.loss_config(g), world, MICRO, N_SEQ)
        r, adv = batch(world.rank)
        model.zero_grad()
        stats, _ = grpo.policy_update(run, r, adv, None, None, grpo.response_tokens(r))
        entropy = grpo.loss_stats(stats, N_SEQ // MICRO)["entropy_mean"]
        total = torch.tensor(engine.scaled_loss, dtype=torch.float64)
        dist.all_reduce(total)  # the loss whose gradient the averaged one is: the mean over ranks
        want = whole_batch_loss(model, aggregation, batches)
        want_grad = torch.autograd.grad(want, list(model.parameters()))
        results[aggregation] = {
            "loss": float(total) / world.size, "want_loss": float(want),
            "entropy": entropy, "want_entropy": whole_batch_entropy(model, batches),
            "grad_err": max(float((a - b).abs().max()) for a, b in zip(engine.averaged, want_grad)),
            "grad_max": max(float(b.abs().max()) for b in want_grad),
            "ratio": float(sum((a * b).sum() for a, b in zip(engine.averaged, want_grad))
                           / sum((b * b).sum() for b in want_grad)),  # got / want along want's direction
        }
    if world.rank == 0:
        out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

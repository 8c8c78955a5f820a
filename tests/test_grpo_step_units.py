"""engine/grpo.py's step around the loss, in this process on the CPU: the held-out evaluation, the packed micro-batches,
the rollouts' tensors, the scoring, the log-prob passes, the policy update's side metrics (padding, rollout/train
mismatch, routing agreement), the step's metrics row and the run's small helpers. The policy is a tiny
token-and-position model behind a fake engine; torch.distributed is a stand-in where a helper reduces over ranks
(TwinRanks: ranks that hold the same numbers, so a sum over them doubles and a mean or a max does not)."""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT  # noqa: F401  (puts the project on sys.path)
from engine.config import GRPOConfig
from engine.parallel import World

V, P, R = 16, 3, 3  # vocabulary, prompt width, max_new_tokens
# Left-padded prompts of width P and completions of 3, 1, 2 and 1 tokens (T = P + R = 6).
ATTN = torch.tensor([[1, 1, 1, 1, 1, 1],
                     [0, 0, 1, 1, 0, 0],
                     [0, 0, 1, 1, 1, 0],
                     [0, 1, 1, 1, 0, 0]])


class TwinRanks:
    """torch.distributed as engine/grpo.py uses it, on `size` ranks holding the same numbers: all_reduce SUM
    multiplies by the size, MAX keeps the value."""

    class ReduceOp:
        SUM, MAX = "sum", "max"

    def __init__(self, size: int = 2):
        self.size = size

    def is_initialized(self):
        return True

    def get_world_size(self):
        return self.size

    def all_reduce(self, t, op="sum"):
        if op == "sum":
            t.mul_(self.size)


def twin_ranks(monkeypatch, size: int = 2):
    import engine.grpo as grpo

    monkeypatch.setattr(grpo, "dist", TwinRanks(size))
    monkeypatch.setattr(grpo, "_device", lambda: "cpu")


class TinyLM(torch.nn.Module):
    """Logits from the token and its position; answers forward_logps's call as engine/head.py's model does. Keeps
    the last forward's input ids (`seen`) for a fake router."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos, self.out = torch.nn.Embedding(V, 8), torch.nn.Embedding(P + R, 8), torch.nn.Linear(8, V)
        self.seen = None

    def forward(self, input_ids, attention_mask, position_ids, logprob_targets, temperature, with_entropy=False,
                use_cache=False):
        self.seen = input_ids
        logits = self.out(torch.tanh(self.emb(input_ids) + self.pos(position_ids)))[:, :-1] / temperature
        logp = torch.log_softmax(logits.float(), -1)
        ent = -(logp.exp() * logp).sum(-1).detach() if with_entropy else None
        return SimpleNamespace(logprobs=logp.gather(-1, logprob_targets[..., None]).squeeze(-1), entropy=ent)


class Engine:
    """The engine calls policy_update and grpo_step make: backward, step (as DeepSpeed: an optimizer step, plain SGD
    at `lr`, only at each accumulation boundary of `gas` micro-batches; lr 0 keeps the weights), the LR schedule
    (counted) and get_lr."""

    def __init__(self, module, lr: float = 0.0, gas: int = 2):
        self.module, self.device, self.lr, self.gas, self.micro_steps = module, torch.device("cpu"), lr, gas, 0
        self.opt = torch.optim.SGD(module.parameters(), lr=lr)
        self.lr_scheduler = SimpleNamespace(steps=0)
        self.lr_scheduler.step = lambda: setattr(self.lr_scheduler, "steps", self.lr_scheduler.steps + 1)

    def __call__(self, **kw):
        return self.module(**kw)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return
        self.opt.step()
        self.opt.zero_grad()

    def get_lr(self):
        return [self.lr]


class CharTok:
    """A tokenizer of one id per character (id = code - 96: 'a' -> 1), pad 0."""
    pad_token_id = 0

    def __call__(self, text):
        return {"input_ids": [ord(c) - 96 for c in text]}

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(96 + int(i)) for i in s if int(i) > 0) for s in seqs]


def rollouts(**kw):
    from engine.grpo import Rollouts

    torch.manual_seed(1)
    ids = torch.randint(1, V, ATTN.shape)
    resp = ATTN[:, 1:].clone()
    resp[:, :P - 1] = 0
    return Rollouts(ids, ATTN.clone(), resp, [], P, 2.0, **kw)


def make_run(g: GRPOConfig, engine, **kw):
    from engine.grpo import Run, loss_config

    return Run(engine, None, kw.pop("rollout", None), kw.pop("tok", None), kw.pop("rewards", None), g, loss_config(g),
               World(rank=0, size=1, local_size=1), 2, 4, **kw)


def test_evaluate_scores_this_ranks_share_greedily_and_names_each_rewards_mean(monkeypatch):
    """evaluate on rank 1 of 2: it generates (greedy: temperature 0) and scores evals[1::2] only, divides the
    all-reduced sums by the all-reduced count of scored prompts, and maps each reward's mean to its label (total
    first). Rank 1 holds prompts bb and d: exact match 1 and 0 (mean 0.5), length penalty -2 and -3 (mean -2.5).
    [fails if: a rank scores evals[rank:] or all evals, the count is len(evals), the eval samples at the training
    temperature, or the per-reward means are shifted against their labels]"""
    from engine.grpo import evaluate
    from engine.rewards import build_rewards

    twin_ranks(monkeypatch)
    answers = {"a": "a", "bb": "bb", "c": "x", "d": "ddd"}  # completion per prompt
    seen = {}

    def generate(request, sampling):
        seen["prompts"] = CharTok().batch_decode(request.prompt_ids)
        seen["temperature"] = sampling.temperature
        resp = [CharTok()(answers[p])["input_ids"] for p in seen["prompts"]]
        width = max(map(len, resp))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in resp])
        return SimpleNamespace(input_ids=torch.cat([request.prompt_ids, ids], 1),
                               attention_mask=torch.cat([request.prompt_attention_mask, (ids > 0).long()], 1),
                               response_start_idx=torch.full((len(resp),), request.prompt_ids.shape[1]))

    rollout = SimpleNamespace(sync_weights=lambda *a: None, generate=generate, shutdown=lambda: None)
    g = GRPOConfig(temperature=0.7, max_new_tokens=4)
    rewards = build_rewards([{"name": "exact_match"}, {"name": "length_penalty", "target": 0, "scale": 1.0}])
    run = SimpleNamespace(world=World(rank=1, size=2, local_size=2), device="cpu", rollout=rollout, tok=CharTok(),
                          rewards=rewards, g=g)
    evals = [{"prompt": p, "answer": a} for p, a in [("a", "a"), ("bb", "bb"), ("c", "c"), ("d", "d")]]
    got = evaluate(run, evals)
    assert seen == {"prompts": ["bb", "d"], "temperature": 0.0}
    assert got == pytest.approx({"eval_reward": -2.0, "eval_reward_exact_match": 0.5,
                                 "eval_reward_length_penalty": -2.5})


def test_evaluate_counts_a_reward_that_fails_and_says_so(monkeypatch, capsys):
    """A reward that raises on a held-out prompt is scored 0, as in training, and now also counted
    (eval_reward_picky_failures, summed over ranks: 2 ranks of 1 failure each) and said on stderr; a reward that never fails gets no failures key. It was silently 0. [fails if: failures are not
    summed over ranks, are shifted against their labels, or the warning is not printed]"""
    from engine.grpo import evaluate
    from engine.rewards import build_rewards

    twin_ranks(monkeypatch)

    def generate(request, sampling):
        ids = torch.tensor([CharTok()("ab")["input_ids"]] * request.prompt_ids.shape[0])
        return SimpleNamespace(input_ids=torch.cat([request.prompt_ids, ids], 1),
                               attention_mask=torch.cat([request.prompt_attention_mask, torch.ones_like(ids)], 1),
                               response_start_idx=torch.full((ids.shape[0],), request.prompt_ids.shape[1]))

    rollout = SimpleNamespace(sync_weights=lambda *a: None, generate=generate, shutdown=lambda: None)
    rewards = build_rewards([{"name": "exact_match"}, {"name": "test_grpo_step_units:fails_on_c", "label": "picky"}])
    run = SimpleNamespace(world=World(rank=0, size=2, local_size=2), device="cpu", rollout=rollout, tok=CharTok(),
                          rewards=rewards, g=GRPOConfig(max_new_tokens=4))
    evals = [{"prompt": "a", "answer": "ab"}, {"prompt": "b", "answer": "x"}, {"prompt": "c", "answer": "abc"},
             {"prompt": "d", "answer": "y"}]  # rank 0 scores a and c: "ab" matches a's answer; picky fails on c
    got = evaluate(run, evals)
    assert got == pytest.approx({"eval_reward": 1.0, "eval_reward_exact_match": 0.5, "eval_reward_picky": 0.5,
                                 "eval_reward_picky_failures": 2.0})
    err = capsys.readouterr().err
    assert "warning: held-out evaluation, rank 0: reward picky failed on 1 of 2 prompts (scored 0)" in err, err


def fails_on_c(prompt, completion, answer):
    """A reward function for the test above: 1 for every prompt but "c", on which it raises."""
    if prompt == "c":
        raise ValueError("no score for c")
    return 1.0


def test_rollout_micro_batches_are_packed_longest_first_and_remade_for_another_size():
    """Rollouts.micro_batches packs by default: rows sorted by where their tokens end, longest first, each
    micro-batch cut to the columns its rows use (rows 0 and 2 span columns 0-5; rows 3 and 1 start at column 1 and
    end before column 4). Asked for another size it makes them again; micro_batches(pack=False) gives consecutive
    rows over every column, the last micro-batch short.
    [fails if: packing is off by default, the sort is ascending, rows that end together are not longest first, a
    micro-batch starts at its rows' latest first token or ends one column early, the cached micro-batches are reused for another size, or unpacked ones are cut]"""
    from engine.grpo import micro_batches

    r = rollouts()
    shape = [(set(m.rows.tolist()), m.lo, m.hi) for m in r.micro_batches(2)]
    assert shape == [({0, 2}, 0, 6), ({1, 3}, 1, 4)]
    assert [(set(m.rows.tolist()), m.lo, m.hi) for m in r.micro_batches(4)] == [({0, 1, 2, 3}, 0, 6)]
    assert [(set(m.rows.tolist()), m.lo, m.hi) for m in r.micro_batches(2)] == shape
    plain = micro_batches(ATTN[:3], 2, pack=False)
    assert [(m.rows.tolist(), m.lo, m.hi) for m in plain] == [([0, 1], 0, 6), ([2], 0, 6)]
    # rows ending at the same column: the earliest-starting (longest) first, so the late starters share a micro-batch
    same_end = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1]])
    assert [(set(m.rows.tolist()), m.lo, m.hi) for m in micro_batches(same_end, 2)] == [({1, 3}, 0, 4), ({0, 2}, 2, 4)]


def test_a_packed_micro_batch_starts_at_the_earliest_first_token_of_any_of_its_rows():
    """Packing sorts by where rows end: the row that ends last (row 0, tokens in columns 2-5) leads the micro-batch,
    but row 1 (columns 0-2) starts earlier, so the micro-batch spans columns 0-6 and each row's log-probs are those
    of the unpacked batch. [fails if: a micro-batch starts at its leading row's first token, cutting another row's
    head off]"""
    from engine.grpo import Rollouts, batched_logps

    attn = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    ids = torch.tensor([[0, 0, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]])
    r = Rollouts(ids, attn, attn[:, 1:].clone(), [], 2, 0.0)
    assert [(m.rows.tolist(), m.lo, m.hi) for m in r.micro_batches(2)] == [([0, 1], 0, 6)]
    engine = Engine(TinyLM())
    with torch.no_grad():
        whole = engine(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                       logprob_targets=ids[:, 1:], temperature=1.0).logprobs
    got = batched_logps(engine, r, 2, 1.0)
    assert torch.allclose(got * attn[:, 1:], whole * attn[:, 1:])


def test_replay_and_targets_of_a_micro_batch():
    """Micro.tokens/targets cut a micro-batch's rows and columns (targets one column fewer; a per-sequence tensor by
    row only), and Rollouts.replay gives the routes of those tokens only under grpo.routing_replay r3.
    [fails if: replay is given without r3 (or withheld with it), or a per-sequence tensor is cut by columns]"""
    from engine.grpo import Micro

    routes = torch.arange(4 * 6 * 2).reshape(4, 6, 1, 2)
    r = rollouts(routes=routes)
    m = Micro(torch.tensor([3, 1]), 1, 4)
    assert torch.equal(r.replay(m, SimpleNamespace(g=GRPOConfig(routing_replay="r3"))), routes[[3, 1], 1:4])
    assert r.replay(m, SimpleNamespace(g=GRPOConfig())) is None
    assert m.targets(torch.tensor([10.0, 11.0, 12.0, 13.0])).tolist() == [13.0, 11.0]
    assert torch.equal(m.targets(r.resp_mask), r.resp_mask[[3, 1], 1:3])


def test_the_decoders_log_probs_line_up_with_the_targets():
    """generate_rollouts: the decoder's log-prob of response token j (ids[:, p_len + j]) is kept at target position
    p_len - 1 + j of the (N, T-1) tensor, zeros before; its expert choices pass through.
    [fails if: the log-probs are shifted by a position, or the prompt mask covers the first response target]"""
    from engine.grpo import generate_rollouts

    out = SimpleNamespace(input_ids=torch.randint(1, V, (2, 6)), attention_mask=torch.ones(2, 6, dtype=torch.long),
                          response_start_idx=torch.tensor([3, 3]))
    logps = torch.tensor([[-0.1, -0.2, -0.3], [-1.1, -1.2, -1.3]])
    routes = torch.zeros(2, 6, 1, 2, dtype=torch.long)
    rollout = SimpleNamespace(sync_weights=lambda *a: None, generate=lambda request, sampling: out,
                              shutdown=lambda: None, last_logps=logps, last_routes=routes)
    run = SimpleNamespace(rollout=rollout, tok=CharTok(), device="cpu", g=GRPOConfig())
    r = generate_rollouts(run, [{"prompt": "abc"}, {"prompt": "def"}], None)
    assert torch.equal(r.rollout_logp, torch.tensor([[0.0, 0.0, -0.1, -0.2, -0.3], [0.0, 0.0, -1.1, -1.2, -1.3]]))
    assert r.resp_mask.tolist() == [[0, 0, 1, 1, 1]] * 2
    assert r.routes is routes


def test_score_pairs_each_completion_with_its_prompts_answer_and_drops_flat_groups():
    """score with 2 prompts x G = 2 (prompt-major): completions 0-1 answer prompt p (answer 1), 2-3 prompt q
    (answer 2). Rewards 1, 1, 1, 0: under dynamic sampling the flat first group's rows lose their response mask, the
    second group's keep it.
    [fails if: the answers are repeated group-major (1, 2, 1, 2), or the keep mask is tiled (repeat) instead of
    repeated per row (repeat_interleave)]"""
    from engine.grpo import score
    from engine.rewards import build_rewards

    g = GRPOConfig(group_size=2, dynamic_sampling=True, rewards=[{"name": "exact_match"}])
    run = SimpleNamespace(g=g, rewards=build_rewards(g.rewards), device="cpu", world=SimpleNamespace(rank=0))
    r = SimpleNamespace(texts=["1", "1", "2", "x"], tree=None, resp_mask=torch.ones(4, 3))
    _, reward, adv = score(run, [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "2"}], r, 1)
    assert reward.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert r.resp_mask.sum(1).tolist() == [0.0, 0.0, 3.0, 3.0]
    assert adv[:2].tolist() == [0.0, 0.0] and adv[2] > 0 > adv[3]


def test_old_log_probs_are_the_tempered_policys_and_only_for_several_iterations():
    """old_logps: with iterations 2, batched_logps over the packed micro-batches gives, at every target of a real
    token, the log-probs one full-width forward gives at the sampling temperature (0.7); with iterations 1 none
    (the policy's own detached log-probs serve).
    [fails if: the passes score at temperature 1, or the old log-probs are computed with one iteration]"""
    from engine.grpo import forward_logps, old_logps

    model = TinyLM()
    r = rollouts()
    run = make_run(GRPOConfig(iterations=2, temperature=0.7, max_new_tokens=R), Engine(model))
    got = old_logps(run, r)
    want = forward_logps(model, r.ids, r.attn, 0.7)[0].detach()
    real = (r.attn[:, :-1] * r.attn[:, 1:]).bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-6)
    assert old_logps(make_run(GRPOConfig(iterations=1, temperature=0.7), Engine(model)), r) is None


def test_response_tokens_are_summed_over_ranks(monkeypatch):
    """response_tokens: this rank's 7 response targets, all-reduced (2 ranks with the same batch: 14).
    [fails if: the count is rank-local]"""
    from engine.grpo import response_tokens

    twin_ranks(monkeypatch)
    assert response_tokens(rollouts()) == 14.0


def test_a_skipped_update_still_advances_the_lr_schedule_by_each_iteration():
    """skip_update: no optimizer step, but the LR schedule steps `iterations` (3) times.
    [fails if: the schedule steps once per GRPO step]"""
    from engine.grpo import skip_update

    engine = Engine(TinyLM())
    skip_update(make_run(GRPOConfig(iterations=3), engine))
    assert engine.lr_scheduler.steps == 3


class FakeRouter:
    """engine/routing.Router's calls: use(replay, record) (recorded), and recorded() giving the experts the forward
    dispatched to (those of the rollout: route_of its input ids) and the live routers' (each id + 1 mod 4: never the
    same choice)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    @contextlib.contextmanager
    def use(self, replay, record):
        self.calls.append((replay is not None, record))
        yield

    def recorded(self):
        used = route_of(self.model.seen).reshape(-1, 1, 2)
        return used, (used + 1) % 4


def route_of(ids):
    """(B, S) -> (B, S, 1 layer, 2 experts) of 4."""
    return torch.stack([ids % 4, (ids // 4) % 4], -1)[:, :, None]


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_policy_update_sums_token_weighted_stats_and_reports_padding_and_routing(replay):
    """policy_update, 2 iterations over the packed micro-batches of ATTN at unchanged weights (lr 0), old log-probs
    = the policy's: the loss stat is the sum of the 4 micro-batch losses (ratio 1: each pass -1/2 x the sum of the
    advantages), the other stats are weighted by response tokens (entropy / tokens = the token mean over the batch),
    train_padding_frac is 1 - 14 real tokens / 18 packed columns, the routers record on the first pass only and
    replay only under r3; the forward used the rollout's experts (agreement 1), and the live routers' (agreement 0)
    are reported only with replay.
    [fails if: stats are not weighted by tokens, the padding fraction is the real fraction, the routers record on
    every pass, replay is passed without r3, or live agreement is reported without replay]"""
    from engine.grpo import forward_logps, loss_stats, old_logps, policy_update

    model = TinyLM()
    r = rollouts()
    r.routes = route_of(r.ids)
    g = GRPOConfig(iterations=2, max_new_tokens=R, routing_replay=replay)
    run = make_run(g, Engine(model), router=FakeRouter(model))
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    old = old_logps(run, r)
    assert run.router.calls == [(replay == "r3", False)] * 2  # the old log-probs' pass replays too, records nothing
    run.router.calls.clear()
    stats, extra = policy_update(run, r, adv, old, None, float(r.resp_mask.sum()))
    _, ent = forward_logps(model, r.ids, r.attn, 1.0, with_entropy=True)
    mask = r.resp_mask.float()
    assert stats["tokens"] == 14.0
    assert stats["loss"] == pytest.approx(-float(adv.sum()), abs=1e-5)
    assert loss_stats(stats, 4)["entropy_mean"] == pytest.approx(float((ent * mask).sum() / mask.sum()), rel=1e-6)
    assert extra["train_padding_frac"] == pytest.approx(1 - 14 / 18)
    assert run.router.calls == [(replay == "r3", True)] * 2 + [(replay == "r3", False)] * 2
    want = {"routing_agree_choice": 1.0, "routing_agree_token": 1.0}
    if replay == "r3":
        want |= {"routing_live_agree_choice": 0.0, "routing_live_agree_token": 0.0}
    assert {k: v for k, v in extra.items() if k.startswith("routing")} == want


def test_the_rollout_train_mismatch_is_the_first_passes():
    """policy_update with 2 iterations and SGD at lr 1 at each accumulation boundary (the second pass sees moved
    weights): the mismatch metrics compare the decoder's log-probs with the first pass's only. The decoder's are the
    initial policy's minus known offsets o on the 7 response targets, so d = o: the mean and max of |o| and the mean
    of e^o - o - 1.
    [fails if: the later passes' log-probs enter the mismatch, or the ratios ignore the old log-probs]"""
    from engine.grpo import forward_logps, old_logps, policy_update

    model = TinyLM()
    r = rollouts()
    mask = r.resp_mask.bool()
    o = torch.zeros(mask.shape)
    o[mask] = torch.tensor([0.3, -0.5, 0.1, 0.6, -0.2, 0.4, -0.05])
    r.rollout_logp = forward_logps(model, r.ids, r.attn, 1.0)[0].detach() - o
    run = make_run(GRPOConfig(iterations=2, max_new_tokens=R), Engine(model, lr=1.0))
    old = old_logps(run, r)
    stats, extra = policy_update(run, r, torch.tensor([1.0, -2.0, 0.5, 3.0]), old, None, float(mask.sum()))
    # the ratios are against `old`: 1 in the first pass (the weights that scored it), not 1 in the second (moved)
    assert stats["tokens"] == 14 and abs(stats["ratio_mean"] - stats["tokens"]) > 1.0, stats
    d = o[mask]
    assert extra["rollout_logp_diff_mean"] == pytest.approx(float(d.abs().mean()), abs=1e-6)
    assert extra["rollout_logp_diff_max"] == pytest.approx(0.6, abs=1e-6)
    assert extra["rollout_kl_k3"] == pytest.approx(float((d.exp() - d - 1).mean()), abs=1e-6)


def test_routing_agreement_reads_every_real_token_but_each_rows_last():
    """routing_agreement over micro-batch rows [1, 2], columns 2-4 of ATTN: the tokens whose outputs the loss reads
    are those followed by a real token (row 1: column 2; row 2: columns 2 and 3). The dispatched experts differ from
    the decoder's at row 2 column 3 in one of 2 experts; the live ones differ at row 1 column 2 in both, and at the
    rows' last real tokens (not read).
    [fails if: each row's last real token is counted, or the dispatched and live rows are swapped]"""
    from engine.grpo import Micro, routing_agreement

    routes = torch.zeros(4, 6, 1, 2, dtype=torch.long)
    routes[..., 1] = 1
    r = rollouts(routes=routes)
    m = Micro(torch.tensor([1, 2]), 2, 5)
    used = routes[[1, 2], 2:5].clone()
    used[1, 1, 0, 0] = 3  # row 2, column 3: one expert of two
    live = routes[[1, 2], 2:5].clone()
    live[0, 0, 0] = torch.tensor([2, 3])  # row 1, column 2: both
    live[0, 1, 0, 0] = 3  # row 1, column 3: its last real token
    live[1, 2, 0, 0] = 3  # row 2, column 4: its last real token
    router = SimpleNamespace(recorded=lambda: (used.reshape(-1, 1, 2), live.reshape(-1, 1, 2)))
    got = routing_agreement(router, r, m)
    assert got.tolist() == [[2.0, 2.0, 3.0], [2.0, 2.0, 3.0]]
    used[1, 1, 0, 0] = 0
    used[1, 1, 0, 1] = 3
    live[0, 0, 0] = torch.tensor([0, 1])
    assert routing_agreement(router, r, m).tolist() == [[2.0, 2.0, 3.0], [3.0, 3.0, 3.0]]
    used[:] = routes[[1, 2], 2:5]
    live[0, 0, 0] = torch.tensor([1, 2])
    assert routing_agreement(router, r, m).tolist() == [[3.0, 3.0, 3.0], [2.0, 2.0, 3.0]]


def test_routing_metrics_are_ratios_of_the_summed_counts(monkeypatch):
    """routing_metrics: the micro-batches' [choices, tokens, count] are summed (over ranks too: 2 identical ones)
    before dividing; the live routers' agreement only when replayed.
    [fails if: choice and token agreement are swapped, or live agreement shows without replay (or not with it)]"""
    from engine.grpo import routing_metrics

    twin_ranks(monkeypatch)
    parts = torch.tensor([[[3.0, 1.0, 4.0], [2.0, 0.0, 4.0]], [[1.0, 1.0, 2.0], [1.0, 1.0, 2.0]]])
    assert routing_metrics(parts, True) == pytest.approx({
        "routing_agree_choice": 4 / 6, "routing_agree_token": 2 / 6,
        "routing_live_agree_choice": 3 / 6, "routing_live_agree_token": 1 / 6})
    assert routing_metrics(parts, False) == pytest.approx({"routing_agree_choice": 4 / 6, "routing_agree_token": 2 / 6})


def test_rollout_mismatch_of_a_micro_batch():
    """rollout_mismatch over the masked targets, d = train - rollout = 0.5, -1.0, 0.2 (a masked-out target 5 off):
    [sum |d|, max |d|, sum e^d - d - 1, 3]; a micro-batch without response tokens (dynamic sampling) gives zeros.
    [fails if: the max is of d not |d|, k3 takes its arguments the other way round (e^-d + d - 1), every target is
    counted, or an empty mask is not handled]"""
    from engine.grpo import rollout_mismatch

    train = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.7, -5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    d = torch.tensor([0.5, -1.0, 0.2])
    want = [1.7, 1.0, float((d.exp() - d - 1).sum()), 3.0]
    assert rollout_mismatch(train, rollout, mask).tolist() == pytest.approx(want, abs=1e-6)
    assert rollout_mismatch(train, rollout, torch.zeros_like(mask)).tolist() == [0.0] * 4


def test_mismatch_metrics_divide_summed_sums_by_summed_tokens_and_take_the_max(monkeypatch):
    """mismatch_metrics over micro-batches [1.7, 1.0, 0.3, 3] and [0.5, 2.0, 0.1, 2] on 2 identical ranks: mean |d|
    2 x 2.2 / (2 x 5), max 2.0 (a max over ranks), k3 2 x 0.4 / (2 x 5).
    [fails if: the max is summed over micro-batches or ranks, or k3 is not divided by the tokens]"""
    from engine.grpo import mismatch_metrics

    twin_ranks(monkeypatch)
    parts = torch.tensor([[1.7, 1.0, 0.3, 3.0], [0.5, 2.0, 0.1, 2.0]])
    assert mismatch_metrics(parts) == pytest.approx({"rollout_logp_diff_mean": 0.44, "rollout_logp_diff_max": 2.0,
                                                     "rollout_kl_k3": 0.08})


def metrics_args(**kw):
    """metrics_row's arguments for ATTN on 2 identical ranks: 7 response tokens per rank (longest 3), rewards
    1, 0, 1, 1 (one reward failure), 2 s of rollout, phases 0.5 + 1.5 s, 3 forwards, iterations 2 x 2 micro-batches."""
    engine = Engine(TinyLM(), lr=0.1)
    run = make_run(GRPOConfig(iterations=2, beta=0.04), engine, rollout=kw.pop("rollout", SimpleNamespace()))
    reward = torch.tensor([1.0, 0.0, 1.0, 1.0])
    scores = SimpleNamespace(per_reward={"exact_match": reward}, failures={"exact_match": 1})
    stats = {"loss": 1.2, "tokens": 7.0, "kl_mean": 0.35, "entropy_mean": 2.1, "clip_frac": 0.7}
    return dict(run=run, r=rollouts(**kw), scores=scores, reward=reward, stats=stats,
                phases={"ref_s": 0.5, "policy_s": 1.5}, forwards=3, step=7, step_s=5.0)


def test_the_metrics_row_sums_counts_and_averages_means_over_ranks(monkeypatch):
    """metrics_row on 2 identical ranks: generated tokens 2 x 7 (from the response columns), their rate over 2 s,
    train tokens 2 x 14 x 3 forwards over 2 s, the response length 7 / 4, the longest completion 3 (a max over
    ranks) over the rollout's 2 s; the loss is the mean of the 2 x 2 micro-batch losses, the others token means over
    2 x 7 tokens; reward failures summed over ranks; reward_std that of the 8 rewards together (0.463, where each
    rank's own is 0.5).
    [fails if: iterations are left out of the micro-batch count, the last prompt column counts as generated, the
    forwards are left out, the longest completion is summed over ranks, failures are averaged, the token stats are
    averaged over ranks, a mean over ranks is not divided by their number, kl_mean is not renamed kl, or reward_std
    averages the ranks' own]"""
    from engine.grpo import metrics_row

    twin_ranks(monkeypatch)
    row = metrics_row(**metrics_args())
    peak = row.pop("peak_mem_gib")
    assert peak > 0
    assert row == pytest.approx({
        "step": 7, "reward": 0.75, "reward_std": (1.5 / 7) ** 0.5, "lr": 0.1, "response_len": 1.75, "generated_tokens": 14.0,
        "rollout_tokens_per_s": 7.0, "train_tokens_per_s": 42.0, "rollout_s": 2.0, "train_s": 2.0, "ref_s": 0.5,
        "policy_s": 1.5, "step_s": 5.0, "loss": 0.3, "clip_frac": 0.1, "kl": 0.05, "entropy": 0.3,
        "rollout_ms_per_step": 2000 / 3, "update_skipped": 0, "reward_exact_match": 0.75,
        "reward_exact_match_failures": 2.0})


def test_the_metrics_row_of_the_decoder_a_tree_and_a_skipped_update(monkeypatch):
    """metrics_row: the local decoder reports its ms per decode step (20 ms over 4 steps) and its memory, not the
    rollout's ms per step; tree rollouts count the tree's generated tokens (shared prefixes once) and report no ms
    per step; a skipped update has update_skipped 1, loss 0 and no kl or entropy; with beta 0 a row has no kl.
    [fails if: the decode time is not in ms, tree rollouts report the ms per step of chains, a skipped row has
    no loss, or a run without a reference reports a kl]"""
    from engine.grpo import metrics_row

    twin_ranks(monkeypatch)
    decoder = SimpleNamespace(decode_steps=4, decode_s=0.02, memory_bytes=lambda: 3 * 2 ** 30)
    row = metrics_row(**metrics_args(rollout=decoder))
    assert row["decode_ms_per_step"] == pytest.approx(5.0) and row["decoder_mem_gib"] == 3.0
    assert "rollout_ms_per_step" not in row
    row = metrics_row(**metrics_args(tree=SimpleNamespace(generated_tokens=5)))
    assert row["generated_tokens"] == 10.0 and "rollout_ms_per_step" not in row
    args = metrics_args()
    row = metrics_row(**{**args, "stats": {}, "phases": {}, "forwards": 0}, skipped=True)
    assert row["update_skipped"] == 1 and row["loss"] == 0.0
    assert not {"kl", "entropy", "kl_mean", "entropy_mean"} & set(row)
    args["run"].g = GRPOConfig(iterations=2, beta=0.0)  # no reference: no KL to report (it read 0.0 every step)
    row = metrics_row(**args)
    assert not {"kl", "kl_mean"} & set(row) and row["entropy"] == pytest.approx(0.3)


def step_run(dynamic: bool):
    """A Run for grpo_step: 2 prompts x G = 2 from a stub rollout (ATTN's rows, ids 1-15 decoded a-o), exact-match
    rewards, TinyLM at lr 0, iterations 2, micro-batches of 2."""
    from engine.rewards import build_rewards

    torch.manual_seed(1)
    ids = torch.randint(1, V, ATTN.shape)
    out = SimpleNamespace(input_ids=ids, attention_mask=ATTN.clone(), response_start_idx=torch.full((4,), P))
    rollout = SimpleNamespace(sync_weights=lambda *a: None, generate=lambda request, sampling: out,
                              shutdown=lambda: None)
    g = GRPOConfig(group_size=2, iterations=2, max_new_tokens=R, dynamic_sampling=dynamic,
                   rewards=[{"name": "exact_match"}])
    texts = CharTok().batch_decode([s[P:][m[P:] > 0] for s, m in zip(ids, ATTN)])
    rows = [{"prompt": "ab", "answer": "zz"}, {"prompt": "cd", "answer": texts[2] if not dynamic else "zz"}]
    return make_run(g, Engine(TinyLM()), rollout=rollout, tok=CharTok(), rewards=build_rewards(g.rewards)), rows


def test_grpo_step_skips_the_update_when_no_group_is_left(monkeypatch):
    """grpo_step with dynamic sampling and every completion wrong: every group is flat, no response token is left on
    any rank, so no forward runs (the model never sees a batch), the LR schedule advances by the 2 iterations and the
    row says update_skipped 1, loss 0.
    [fails if: the update runs on zero tokens]"""
    from engine.grpo import grpo_step

    twin_ranks(monkeypatch, 1)
    run, rows = step_run(dynamic=True)
    row = grpo_step(run, rows, None, 1)
    assert run.policy.module.seen is None
    assert run.policy.lr_scheduler.steps == 2
    assert row["update_skipped"] == 1 and row["loss"] == 0.0 and row["reward"] == 0.0


def test_grpo_step_counts_the_old_log_prob_forward_in_the_train_tokens(monkeypatch):
    """grpo_step with 2 iterations and no reference: 3 forwards over the batch's 14 real tokens (the 2 policy passes
    and the old log-probs), so train_tokens_per_s x train_s = 42; one group has different rewards, so the update
    runs (update_skipped 0).
    [fails if: the old log-prob pass is left out of the forwards]"""
    from engine.grpo import grpo_step

    twin_ranks(monkeypatch, 1)
    run, rows = step_run(dynamic=False)
    row = grpo_step(run, rows, None, 1)
    assert row["update_skipped"] == 0 and row["reward"] == 0.25
    assert row["train_tokens_per_s"] * row["train_s"] == pytest.approx(42.0, rel=1e-6)


def test_grpo_step_counts_the_reference_forward_in_the_train_tokens(monkeypatch):
    """grpo_step with 2 iterations and a reference (beta > 0): 4 forwards over the batch's 14 real tokens (2 policy
    passes, the old log-probs and the reference's), so train_tokens_per_s x train_s = 56, and the row reports a kl.
    [fails if: the reference pass is left out of the forwards]"""
    from dataclasses import replace

    from engine.grpo import grpo_step, loss_config

    twin_ranks(monkeypatch, 1)
    run, rows = step_run(dynamic=False)
    run.g = replace(run.g, beta=0.04)
    run.loss_cfg, run.ref = loss_config(run.g), Engine(TinyLM())
    row = grpo_step(run, rows, None, 1)
    assert run.ref.module.seen is not None and row["update_skipped"] == 0 and "kl" in row
    assert row["train_tokens_per_s"] * row["train_s"] == pytest.approx(56.0, rel=1e-6)


def test_no_dropout_zeroes_the_modules_and_the_configs_rates():
    """no_dropout: every nn.Dropout's p, a module's float attention_dropout / dropout, and the model config's
    attention_dropout, hidden_dropout and dropout (what a model built from this config, the reference, inherits)
    become 0; other floats stay.
    [fails if: the config's rates are left]"""
    from engine.grpo import no_dropout

    attn = torch.nn.Module()
    attn.attention_dropout, attn.scaling = 0.1, 0.125
    model = torch.nn.Sequential(torch.nn.Dropout(0.2), attn)
    model.config = SimpleNamespace(attention_dropout=0.1, hidden_dropout=0.2, dropout=0.3, initializer_range=0.02)
    no_dropout(model)
    assert model[0].p == 0.0 and (attn.attention_dropout, attn.scaling) == (0.0, 0.125)
    assert vars(model.config) == {"attention_dropout": 0.0, "hidden_dropout": 0.0, "dropout": 0.0,
                                  "initializer_range": 0.02}


def test_decoder_cache_len_rounds_the_longest_prompt_plus_new_tokens_up_to_16():
    """decoder_cache_len: 20 + 12 = 32 slots stay 32; 21 + 12 = 33 become 48.
    [fails if: it rounds down, or always adds a block]"""
    from engine.grpo import decoder_cache_len

    assert decoder_cache_len([{"n_tokens": 10}, {"n_tokens": 20}], 12) == 32
    assert decoder_cache_len([{"n_tokens": 21}, {"n_tokens": 3}], 12) == 48


def test_the_token_budget_is_spent_at_the_limit():
    """budget_spent: grpo.max_generated_tokens 100 is reached at 100 tokens, not at 99; without it, never.
    [fails if: the comparison is strict]"""
    from engine.grpo import budget_spent

    g = GRPOConfig(max_generated_tokens=100)
    assert budget_spent(100, g) and not budget_spent(99, g)
    assert not budget_spent(10 ** 12, GRPOConfig())


def test_the_done_line_names_the_last_step_and_the_latest_held_out_reward():
    """done_line: the last row's step, reward and kl, and the held-out reward of the latest row that has one; a last
    row without kl (a skipped update) names none.
    [fails if: the first held-out reward is named, or kl is named only when absent]"""
    from engine.grpo import done_line

    rows = [{"step": 0, "eval_reward": 0.1}, {"step": 1, "reward": 0.5, "kl": 0.01},
            {"step": 2, "reward": 0.6, "kl": 0.02, "eval_reward": 0.3}, {"step": 3, "reward": 0.7, "kl": 0.03}]
    assert done_line(rows, "runs/x") == ("done: 3 steps, reward 0.7 at the last step, kl 0.03, held-out reward 0.3 "
                                         "at step 2; every step's row in runs/x/metrics.jsonl")
    assert done_line(rows[:1] + [{"step": 1, "reward": 0.0}], "r") == (
        "done: 1 steps, reward 0 at the last step, held-out reward 0.1 at step 0; every step's row in r/metrics.jsonl")


def test_reductions_over_ranks(monkeypatch):
    """_mean_all divides the all-reduced sum by the world size, _sum_all sums or takes the given op (MAX) over ranks.
    [fails if: the mean is not divided, or _sum_all ignores its op]"""
    import engine.grpo as grpo

    twin_ranks(monkeypatch)
    assert grpo._mean_all(1.5) == 1.5 and grpo._sum_all(1.5) == 3.0
    assert grpo._sum_all(1.5, grpo.dist.ReduceOp.MAX) == 1.5
    assert math.isclose(grpo.loss_stats({"loss": 2.0, "tokens": 5.0, "kl_mean": 1.0}, 4)["kl_mean"], 0.2)


def test_a_first_step_skipped_advances_a_real_schedule_without_torchs_warning():
    """skip_update on a real LambdaLR whose optimizer never stepped (dynamic sampling left nothing at step 1): the
    schedule advances by the iterations, and torch's "lr_scheduler.step() before optimizer.step()" warning, printed
    on every such run, is not shown; other warnings still are. [fails if: the filter is dropped or the schedule
    does not advance]"""
    import warnings

    from engine.grpo import skip_update

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    def schedule(s):  # a warning raised inside skip_update, by the schedule itself: still shown
        if s == 2:
            warnings.warn("another warning")
        return 1.0 / (1 + s)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    run = SimpleNamespace(g=GRPOConfig(iterations=2), policy=SimpleNamespace(lr_scheduler=sched))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        skip_update(run)
    assert [str(w.message) for w in seen] == ["another warning"]
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(1 / 3)

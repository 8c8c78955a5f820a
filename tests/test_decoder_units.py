"""The rollout decoder's rules that the other unit tests leave open (engine/decoder.py, engine/rollout.py), on tiny
random models on the CPU, eagerly: the top-p nucleus (sample, and the tree path's continue_rows), the tree path's
entropies at temperature 1, a cache filled to its last slot, a decoder reused after other calls, EOS handling against
transformers' generate, and DecoderRollout's turns (more rows than its batch), its sample grouping, its log-probs and
routes beside the responses, min_new_tokens left out of greedy rollouts, and the response attention mask."""
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT  # noqa: F401  (ROOT puts the project on sys.path)
from test_grpo_units import tiny_model
from test_rollout import no_zero3_from_earlier_tests  # noqa: F401  (autouse: plain models stay unpartitioned)
from test_routing import loss_positions, model_routes, same_sets
from test_tree import full_forward_entropy, prompts, tiny


def plain_logps(model, ids, attn, width: int, temperature: float) -> torch.Tensor:
    """(N, T - width) log p of each response token under softmax(logits / T) from one plain forward (no cache)."""
    with torch.no_grad():
        logits = model(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits.float()
    return (logits[:, width - 1:-1] / temperature).log_softmax(-1).gather(-1, ids[:, width:, None])[..., 0]


def test_top_p_keeps_the_smallest_prefix_reaching_top_p_after_the_temperature():
    """Probabilities 0.5, 0.3, 0.15, 0.05 (shuffled in the vocabulary): top_p 0.7 keeps 0.5 and 0.3 (0.5 alone does
    not reach 0.7) and draws them 5:3. At temperature 2 (0.38, 0.29, 0.21, 0.12) the nucleus is three tokens: the
    temperature applies before the nucleus is cut. (tests/test_grpo_units.py's top-p case has a one-token nucleus.)
    [fails if: the nucleus drops the token whose mass crosses top_p, or top-p is cut before the temperature]"""
    from engine.decoder import draw, sample

    logits = torch.tensor([0.05, 0.3, 0.15, 0.5]).log()
    torch.manual_seed(0)
    tok = sample(logits.expand(8000, -1), 1.0, 0.7)
    assert set(tok.unique().tolist()) == {1, 3}
    assert abs(float((tok == 3).float().mean()) - 0.5 / 0.8) < 0.03
    tok = draw(logits.expand(8000, -1), None, 1.0, 0.7)[0]  # generate's path
    assert set(tok.unique().tolist()) == {1, 3}
    assert set(sample(logits.expand(8000, -1), 2.0, 0.7).unique().tolist()) == {1, 2, 3}


def test_tree_rows_sample_from_the_top_p_nucleus():
    """continue_rows (tree rollouts) and generate with a nucleus of one token (top_p 1e-6) at temperature 1 take the
    argmax at every step: the greedy tokens; without top-p the same seed samples others.
    [fails if: continue_rows samples without top_p]"""
    from engine.decoder import Decoder

    model = tiny()
    ids, mask = prompts()
    dec = Decoder(model, "cpu", batch_size=2, cache_len=7 + 8)

    def tree(temperature, top_p):
        dec.prefill(ids, mask)
        torch.manual_seed(0)
        return dec.continue_rows([0, 1], [8, 8], eos_id=-1, pad_id=0, temperature=temperature, top_p=top_p)[0]

    greedy = tree(0.0, 1.0)
    assert torch.equal(tree(1.0, 1e-6), greedy)
    assert not torch.equal(tree(1.0, 1.0), greedy)  # not vacuous: sampling differs from the argmax here
    torch.manual_seed(0)
    assert torch.equal(dec.generate(ids, mask, 8, -1, 0, temperature=1.0, top_p=1e-6)[:, 7:], greedy)


def test_tree_entropies_are_those_of_temperature_one():
    """continue_rows returns the entropy of each sampled token's distribution at temperature 1 (its docstring; the
    tree's branch points rank by it) also when sampling at temperature 1.5: a plain forward's entropy of the
    prompt + tokens. [fails if: the entropies are taken at the sampling temperature]"""
    from engine.decoder import Decoder
    from engine.grpo_math import token_entropy

    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # far from uniform: the entropy moves with the temperature
    ids, mask = prompts()
    dec = Decoder(model, "cpu", batch_size=2, cache_len=7 + 8)
    dec.prefill(ids, mask)
    hot = dec.logits / 1.5
    torch.manual_seed(0)
    toks, ents, lengths, _ = dec.continue_rows([0, 1], [8, 8], eos_id=-1, pad_id=0, temperature=1.5)
    assert lengths.tolist() == [8, 8]
    assert (token_entropy(hot) - ents[:, 0]).abs().min() > 0.05  # not vacuous: temperature 1.5 gives other values
    for r in range(2):
        real = mask[r] > 0
        want = full_forward_entropy(model, ids[r][real], mask[r][real], toks[r].tolist())
        torch.testing.assert_close(ents[r], want, rtol=0, atol=1e-4)


def test_a_generate_that_fills_the_cache_to_its_last_slot_runs():
    """width + max_new_tokens == cache_len fits (the last sampled token is never fed): GRPO's cache_len is the longest
    prompt + max_new_tokens rounded up to 16, which can be exact. Greedy tokens equal transformers' generate.
    [fails if: an exactly fitting generate is refused]"""
    from engine.decoder import Decoder

    model = tiny()
    model.generation_config.eos_token_id = None
    ids, mask = prompts()
    dec = Decoder(model, "cpu", batch_size=2, cache_len=7 + 10)
    got = dec.generate(ids, mask, 10, eos_id=-1, pad_id=0, temperature=0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert got.shape == want.shape == (2, 17) and torch.equal(got, want)


def test_a_reused_decoder_samples_as_a_fresh_one():
    """The persistent decoder after a generate of wider, left-padded prompts and a tree rollout (which hides the
    response slots): a generate of narrower prompts samples the same tokens and log-probs as a fresh decoder.
    [fails if: the (N, cache_len) mask is not reset past the prompt between calls]"""
    from engine.decoder import Decoder

    model = tiny_model()
    ids, mask = torch.randint(3, 512, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    wide, wide_mask = torch.randint(3, 512, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    wide_mask[0, :6] = 0

    def sampled(dec):
        torch.manual_seed(5)
        out = dec.generate(ids, mask, 8, eos_id=-1, pad_id=0, temperature=1.0)
        return out, dec.last_logps

    fresh = sampled(Decoder(model, "cpu", 2, 32))
    used = Decoder(model, "cpu", 2, 32)
    used.generate(wide, wide_mask, 8, eos_id=-1, pad_id=0, temperature=1.0)
    used.prefill(ids, mask)
    used.continue_rows([0, 1], [4, 4], eos_id=-1, pad_id=0)
    again = sampled(used)
    assert torch.equal(again[0], fresh[0])
    torch.testing.assert_close(again[1], fresh[1], rtol=0, atol=1e-6)


def test_rows_ending_at_different_eos_steps_decode_as_transformers_generate():
    """Greedy with an EOS that one row emits at its third token and the other not: the same tokens as transformers'
    generate, pad after the EOS, and decoding goes on until every row has ended.
    [fails if: tokens after a row's EOS are kept, or decoding stops when the first row ends]"""
    from engine.decoder import Decoder

    model = tiny()
    model.generation_config.eos_token_id = None
    ids, mask = prompts()
    dec = Decoder(model, "cpu", batch_size=3, cache_len=7 + 12)
    free = dec.generate(ids, mask, 12, eos_id=-1, pad_id=0, temperature=0)
    eos = int(free[1, 7 + 2])
    assert eos not in free[0, 7:].tolist() and eos not in free[1, 7:9].tolist()  # row 0 never ends, row 1 at 3
    got = dec.generate(ids, mask, 12, eos_id=eos, pad_id=0, temperature=0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              eos_token_id=eos)
    assert got.shape == want.shape == (2, 19) and torch.equal(got, want)
    assert got[1, 10:].tolist() == [0] * 9


def rollout_of(policy, eos: int, **kw):
    from engine.rollout import DecoderRollout

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=eos)
    return DecoderRollout(SimpleNamespace(module=policy, device=torch.device("cpu")), tok, batch_size=4, cache_len=32,
                          **kw)


def test_rollouts_of_more_rows_than_the_batch_keep_their_groups_log_probs_and_routes():
    """DecoderRollout with 3 prompts x 3 samples on a batch of 4 rows: three turns (4, 4, 1 rows), the last ending at
    its first token (a narrower turn). Each prompt's samples are consecutive rows; every response token's recorded
    log-prob equals a plain forward's at its own position, and the recorded expert ids equal the model's own routing,
    for every turn. [fails if: a turn takes another turn's prompt mask, samples are not grouped per prompt, or a
    narrower turn's log-probs or routes are padded on the wrong side]"""
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

    policy = tiny_model()
    g = torch.Generator().manual_seed(4)
    ids, mask = torch.randint(3, 512, (3, 6), generator=g), torch.ones(3, 6, dtype=torch.long)
    mask[0, :3] = 0  # three prompt masks, all different
    mask[1, :1] = 0
    request, sampling = RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=8, n_samples_per_prompt=3)
    torch.manual_seed(0)
    eos = int(rollout_of(policy, -1).generate(request, sampling).input_ids[8, 6])  # the last turn's first token
    rollout = rollout_of(policy, eos, record_routes=True)
    torch.manual_seed(0)
    out = rollout.generate(request, sampling)
    assert out.input_ids.shape == (9, 14) and out.input_ids[8, 6] == eos  # the third turn is one token wide
    assert torch.equal(out.input_ids[:, :6], ids.repeat_interleave(3, 0))
    assert torch.equal(out.attention_mask[:, :6], mask.repeat_interleave(3, 0))
    attn, resp = out.attention_mask, out.attention_mask[:, 6:].bool()
    assert rollout.last_logps.shape == (9, 8)
    diff = (rollout.last_logps - plain_logps(policy, out.input_ids, attn, 6, 1.0)).abs()[resp]
    assert diff.max() < 1e-4, diff.max()
    assert rollout.last_routes.shape == (9, 14, 2, 2)
    same = same_sets(rollout.last_routes.long(), model_routes(policy, out.input_ids, attn))[loss_positions(attn)]
    assert same.all(), f"{(~same).sum()} of {same.numel()} choices differ"


def test_min_new_tokens_holds_sampled_rollouts_and_not_greedy_ones():
    """grpo.min_new_tokens on DecoderRollout, with a model that always prefers EOS: sampled rollouts write 3 tokens
    and then EOS; greedy ones (evaluation) stop at the first token. [fails if: greedy rollouts get min_new_tokens]"""
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

    eos = 1
    rollout = rollout_of(tiny_model(), eos, min_new_tokens=3)
    rollout.sync_weights(0)
    rollout.decoder.model.lm_head.register_forward_hook(
        lambda mod, args, out: out.index_fill(-1, torch.tensor([eos]), 1e4))
    request = RolloutRequest(torch.randint(3, 512, (2, 5)), torch.ones(2, 5, dtype=torch.long))
    greedy = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert greedy.input_ids[:, 5:].tolist() == [[eos], [eos]]
    sampled = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=1.0)).input_ids[:, 5:]
    assert sampled.shape == (2, 4) and (sampled[:, :3] != eos).all() and (sampled[:, 3] == eos).all()


def test_the_response_attention_covers_each_response_up_to_its_first_eos():
    """response_attention: the prompt's mask, then 1 up to and including the first EOS, 0 after (pad = EOS too).
    [fails if: the EOS itself is left out of the mask]"""
    from engine.rollout import response_attention

    eos = 2
    out = torch.tensor([[0, 7, 5, 2, 2, 2], [7, 7, 5, 6, 2, 9], [0, 7, 5, 6, 4, 3]])
    prompt = torch.tensor([[0, 1], [1, 1], [0, 1]])
    got = response_attention(out, prompt, 2, SimpleNamespace(eos_token_id=eos))
    assert got.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]


def test_topk_by_rank_chooses_what_torch_topk_does_largest_first_ties_to_the_lower_index():
    """[fails if: the decode router's counted top-k chooses other experts than torch.topk, orders them otherwise
    than largest first, or breaks a tie other than to the lower index (a repeated or missing expert)]"""
    from engine.decoder import topk_by_rank

    g = torch.Generator().manual_seed(0)
    for dtype, (T, E, k) in [(torch.float32, (64, 32, 4)), (torch.float32, (5, 8, 3)), (torch.bfloat16, (16, 32, 8))]:
        x = torch.randn(T, E, generator=g).to(dtype)
        got = topk_by_rank(x, k)
        want = torch.topk(x.float(), k, dim=-1).indices
        assert got.shape == (T, k) and got.dtype == torch.long
        assert torch.equal(x.gather(1, got), x.gather(1, want))  # largest first: the same values in the same order
        if dtype == torch.float32:  # no ties among these values: the same experts
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    x = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.9], [1.0, 1.0, 1.0, 1.0, 1.0], [0.0, -1.0, 2.0, 2.0, -3.0]])
    assert topk_by_rank(x, 2).tolist() == [[1, 2], [0, 1], [2, 3]]
    assert topk_by_rank(x, 4).tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [2, 3, 0, 1]]


def test_a_decoder_with_the_counted_top_k_decodes_and_routes_as_torch_topk(monkeypatch):
    """[fails if: the decoder's topk="rank" is not wired to its routers (or "torch" calls it), or chooses other experts
    or tokens than the torch.topk decoder (greedy, fp32, the same weights; recorded expert ids compared as sets)]"""
    from transformers import AutoModelForCausalLM

    import engine.decoder
    from engine.config import ModelConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config

    calls = []
    counted = engine.decoder.topk_by_rank
    monkeypatch.setattr(engine.decoder, "topk_by_rank", lambda x, k: calls.append(k) or counted(x, k))

    torch.manual_seed(0)
    mc = ModelConfig(q_lora_rank=48, num_shared_experts=2, first_dense_layers=1, num_layers=3, num_experts=8,
                     experts_per_token=3)
    model = AutoModelForCausalLM.from_config(make_hf_config(mc)).eval()
    ids = torch.randint(1, 512, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out, routes = {}, {}
    for topk in ("torch", "rank"):
        dec = Decoder(model, "cpu", batch_size=4, cache_len=32, decode_experts="dense", record_routes=True, topk=topk)
        routers = [m for m in dec.model.modules() if hasattr(m, "_topk_by_rank")]
        assert len(routers) == 2 and all(m._topk_by_rank == (topk == "rank") for m in routers)
        calls.clear()
        out[topk] = dec.generate(ids, mask, 8, eos_id=-1, pad_id=0, temperature=0)
        routes[topk] = dec.last_routes(3, out[topk].shape[1])
        assert (len(calls) > 0) == (topk == "rank"), (topk, len(calls))
    assert torch.equal(out["torch"], out["rank"])
    assert routes["rank"].any() and torch.equal(routes["torch"].sort(-1).values, routes["rank"].sort(-1).values)
    with pytest.raises(ValueError, match="topk 'radix' is not torch or rank"):
        Decoder(model, "cpu", batch_size=4, cache_len=32, topk="radix")


@pytest.mark.parametrize("topk", ["rank", "torch"])
def test_the_decode_router_chooses_by_score_plus_bias_and_weighs_by_score(topk):
    """The decoder's DeepSeek-V3 router with one expert group (v3_router_forward) against transformers' own
    router, with a routing bias that changes the choices (as train.balance_rate leaves it after training; a fresh
    model's bias is 0, where dropping it changes nothing): experts chosen by sigmoid score + bias, weighted by the
    score alone, normalized and scaled. [fails if: the decode router leaves the bias out of the choice, or weighs by
    score + bias]"""
    import copy
    import types

    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from engine.decoder import v3_router_forward

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(0)
    hf = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 16, generator=g))
        hf.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))
    x = torch.randn(40, 16, generator=g)
    logits_hf, w_hf, i_hf = hf(x)
    unbiased = torch.topk(logits_hf.sigmoid(), 3, dim=-1).indices
    assert not torch.equal(unbiased.sort(-1).values, i_hf.sort(-1).values)  # the bias moves some choices
    dec = copy.deepcopy(hf)
    dec.forward, dec._topk_by_rank = types.MethodType(v3_router_forward, dec), topk == "rank"
    logits, w, i = dec(x)
    torch.testing.assert_close(logits, logits_hf, atol=0, rtol=0)
    order, order_hf = i.sort(-1), i_hf.sort(-1)
    assert torch.equal(order.values, order_hf.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_hf.gather(1, order_hf.indices), atol=1e-6, rtol=0)


def greedy_by_hand(model, ids, steps: int) -> torch.Tensor:
    """Greedy continuation of unpadded prompts by full forwards (no cache): each step appends the last position's
    argmax."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_a_first_turn_narrower_than_a_later_one_is_padded_and_responses_start_after_the_prompt():
    """DecoderRollout with 2 prompts on a decoder batch of 1 row: two turns. EOS is prompt 0's first greedy token,
    which prompt 1 never emits in 6: turn 0 is one token wide, turn 1 six. The batch is as wide as the widest turn
    (row 1 whole, as a plain greedy loop gives it), row 0 is filled with the pad id after its EOS, the mask ends at
    row 0's EOS, and every row's response starts at the prompt width (5). [fails if: the width is the first
    turn's, a narrow turn is padded with EOS, or response_start_idx is off by one]"""
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

    from engine.rollout import DecoderRollout

    policy = tiny_model()
    ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(1))
    free = greedy_by_hand(policy, ids, 6)
    eos = int(free[0, 5])
    assert eos != 0 and eos not in free[1, 5:].tolist()  # the case this seed gives
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=eos)
    rollout = DecoderRollout(SimpleNamespace(module=policy, device=torch.device("cpu")), tok, batch_size=1,
                             cache_len=16)
    out = rollout.generate(RolloutRequest(ids, torch.ones(2, 5, dtype=torch.long)),
                           SamplingConfig(max_new_tokens=6, temperature=0.0))
    assert out.input_ids.shape == (2, 11)
    assert torch.equal(out.input_ids[1], free[1])
    assert out.input_ids[0].tolist() == ids[0].tolist() + [eos] + [0] * 5
    assert out.attention_mask.tolist() == [[1] * 6 + [0] * 5, [1] * 11]
    assert out.response_start_idx.tolist() == [5, 5]


def test_a_rollout_after_sync_weights_follows_the_policys_new_weights():
    """Greedy rollouts are a plain greedy loop over the policy's weights, before and after the policy's weights all
    change and sync_weights runs again (the persistent decoder refreshed in place). [fails if: sync_weights keeps
    the first weights, or generate ignores temperature 0]"""
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

    policy = tiny_model()
    ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(2))
    request, greedy = RolloutRequest(ids, torch.ones(2, 5, dtype=torch.long)), SamplingConfig(max_new_tokens=6,
                                                                                               temperature=0.0)
    rollout = rollout_of(policy, -1)
    rollout.sync_weights(0)
    before = rollout.generate(request, greedy).input_ids
    assert torch.equal(before, greedy_by_hand(policy, ids, 6))
    policy.load_state_dict(tiny_model(seed=1).state_dict())
    rollout.sync_weights(1)
    want = greedy_by_hand(policy, ids, 6)
    assert not torch.equal(want, before)
    assert torch.equal(rollout.generate(request, greedy).input_ids, want)


def test_rollout_sampling_takes_the_requests_top_p_and_temperature():
    """top_p 1e-6 keeps only the most likely token: sampled at temperature 1 the rollout is the greedy loop's. At
    temperature 2 the recorded log-probs are softmax(logits / 2)'s of a plain forward (not temperature 1's).
    [fails if: generate passes the decoder another top_p or temperature than the request's]"""
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig

    policy = tiny_model()
    ids = torch.randint(3, 512, (2, 5), generator=torch.Generator().manual_seed(3))
    request, rollout = RolloutRequest(ids, torch.ones(2, 5, dtype=torch.long)), rollout_of(policy, -1)
    torch.manual_seed(0)
    nucleus = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=1e-6)).input_ids
    assert torch.equal(nucleus, greedy_by_hand(policy, ids, 6))
    torch.manual_seed(0)
    out = rollout.generate(request, SamplingConfig(max_new_tokens=6, temperature=2.0))
    assert out.input_ids.shape == (2, 11) and rollout.last_logps.shape == (2, 6)
    assert (rollout.last_logps - plain_logps(policy, out.input_ids, out.attention_mask, 5, 2.0)).abs().max() < 1e-4
    assert (rollout.last_logps - plain_logps(policy, out.input_ids, out.attention_mask, 5, 1.0)).abs().max() > 1e-2


def test_the_rollout_prints_what_its_decoder_was_built_as_once(capsys):
    """GRPO's first sync builds the decoder and prints one line with its batch, cache, experts and attention kernel
    (which one "auto" took is otherwise not in the log); a refresh prints nothing. [fails if: the line is missing,
    names the requested "auto" instead of the resolved kernel, or repeats at every sync]"""
    from engine.rollout import DecoderRollout

    model = tiny()
    engine = SimpleNamespace(module=model, device=torch.device("cpu"))
    r = DecoderRollout(engine, None, batch_size=2, cache_len=16)
    r.sync_weights(0)
    r.sync_weights(1)
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout")]
    assert out == ["rollout decoder: 2 rows x 16 cache slots, experts grouped_mm, attention torch, decode step eager"]


def _ds_router(weight: torch.Tensor, bias: torch.Tensor | None, *, softmax: bool, top_k: int, groups=None,
               limited=None, group_score="top2_sum", norm: bool, scale: float):
    """DeepSpeed's AutoEP router (what a policy trains through) with the given gate weight and correction bias."""
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    r = TokenChoiceTopKRouter(dim=weight.shape[1], num_experts=weight.shape[0], num_expert_groups=groups,
                              num_limited_groups=limited, top_k=top_k, score_func="softmax" if softmax else "sigmoid",
                              route_norm=norm, route_scale=scale, gate_bias=False, group_score_func=group_score)
    r = r.to(weight.dtype)
    with torch.no_grad():
        r.gate.weight.copy_(weight)
    r.e_score_correction_bias = bias
    return r


@pytest.mark.parametrize("kind", ["v3", "v3_grouped", "v2", "v2_grouped"])
def test_the_decode_router_rounds_its_logits_as_the_autoep_router_does(kind):
    """In bf16 AutoEP's router (the trainer's) multiplies its gate in bf16 and upcasts; transformers' DeepSeek routers
    multiply in fp32. With `_gate_dtype` (a decoder built from an AutoEP policy) the decoder's router picks, for every
    one of 4,000 tokens, the experts AutoEP's picks, with the same weights; the fp32 logits pick others for some
    tokens (near-ties that bf16 rounding orders differently). V3 (sigmoid + correction bias, with and without expert
    groups) and V2 (softmax, greedy and group-limited). [fails if: the decoder's router multiplies in fp32 under an
    AutoEP policy, or its grouped / V2 forwards differ from AutoEP's routing]"""
    import types

    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from engine.decoder import DEEPSEEK_ROUTERS

    E, H, k = 16, 64, 4
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    x = torch.randn(4000, H, generator=g).to(torch.bfloat16)
    grouped = kind.endswith("grouped")
    if kind.startswith("v3"):
        cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, n_group=4 if grouped else 1,
                               topk_group=2 if grouped else 1, norm_topk_prob=True, routed_scaling_factor=2.5)
        dec = DeepseekV3TopkRouter(cfg)
        bias = (0.02 * torch.randn(E, generator=g)).float()
        dec.e_score_correction_bias = bias.clone()
        ds = _ds_router(w, bias, softmax=False, top_k=k, groups=4 if grouped else None, limited=2 if grouped else None,
                        norm=True, scale=2.5)
        forward = DEEPSEEK_ROUTERS["DeepseekV3TopkRouter"]
    else:
        cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, n_group=4, topk_group=2,
                               topk_method="group_limited_greedy" if grouped else "greedy", routed_scaling_factor=1.5)
        dec = DeepseekV2TopkRouter(cfg)
        ds = _ds_router(w, None, softmax=True, top_k=k, groups=4 if grouped else None, limited=2 if grouped else None,
                        group_score="max", norm=False, scale=1.5)
        forward = DEEPSEEK_ROUTERS["DeepseekV2TopkRouter"]
    dec = dec.to(torch.bfloat16)
    if kind.startswith("v3"):
        dec.e_score_correction_bias = bias.clone()  # kept in fp32, as the decoder keeps the policy's buffers
    with torch.no_grad():
        dec.weight.copy_(w)
    dec.forward, dec._topk_by_rank = types.MethodType(forward, dec), False
    want_w, want_i, _ = ds(x)
    picks = {}
    for gate_dtype in (True, False):
        dec._gate_dtype = gate_dtype
        _, got_w, got_i = dec(x)
        order, want_order = got_i.sort(-1), want_i.sort(-1)
        picks[gate_dtype] = (order.values == want_order.values).all(-1)
        if gate_dtype:
            assert picks[True].all()
            torch.testing.assert_close(got_w.gather(1, order.indices), want_w.float().gather(1, want_order.indices),
                                       atol=1e-6, rtol=0)
    assert not picks[False].all()  # fp32 logits choose other experts for some tokens: what the rounding decides

"""engine/decoder.py's rules that the other fast tests (tests/test_decoder_units.py, tests/test_tree.py,
tests/test_routing.py, tests/test_rollout.py, tests/test_grpo_units.py) let through, one mutant a test: the refusal of
unknown `topk` / `logits` settings; generate's cache-fit refusal and its stop (CPU checks every step, only the n real rows count) and its counts;
the draws that min_new_tokens masks; draw's log-prob over the whole vocabulary with EOS masked, its greedy EOS mask
and the eager draw's whole-vocabulary random stream; vocab_split's piece counts; the race with zero noise on an
excluded token; the tree path's fit checks, prefill counts, fork_rows (mask before `upto`, routes, fork count),
continue_rows' single use of prefill's logits, its stop, its decode-step count and the zero entropies of ended rows;
last_routes as a copy, and the slot of a never-fed token holding zeros after an earlier, longer call; Decoder.builds;
memory_bytes; top-p's nucleus where a prefix reaches top_p exactly; copy_weights (transposed layout, missing weights); policy_buffers' AutoEP names; dense decoding folding
DeepSeek's shared experts; a decoder of an AutoEP policy rounding its router logits as AutoEP does. Expected values come from the docstrings' definitions: plain log_softmax, torch's
exponential noise drawn from the same seed, hand-derived counts and names, with the decoder's draw / sample
replaced by scripted ones where a test needs EOS at chosen steps. Tiny random models on the CPU, eager. The
docstring's bracket names the mutant."""
import types

import pytest
import torch

from test_tree import prompts, tiny


@pytest.fixture(autouse=True)
def no_zero3_from_earlier_tests(monkeypatch):
    """As in tests/test_tree.py: a DeepSpeed engine trained earlier in this process keeps transformers' ZeRO-3 flag
    alive; the plain models built here must not be partitioned by it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)


@pytest.fixture(scope="module")
def qwen():
    return tiny("qwen3_moe")


def _decoder(model, batch_size=4, cache_len=7 + 12, **kw):
    from engine.decoder import Decoder

    return Decoder(model, "cpu", batch_size=batch_size, cache_len=cache_len, **kw)


def _scripted_draw(script, calls):
    """A draw_fn that records whether EOS was masked (no_eos) at each call and returns token 5 for every row, except
    script[t] = {row: token} at call t; log-probs 0."""
    def draw(logits, no_eos, temperature, top_p):  # noqa: ARG001
        t = len(calls)
        calls.append(no_eos is not None)
        tok = torch.full((logits.shape[0],), 5, dtype=torch.long)
        for row, token in script.get(t, {}).items():
            tok[row] = token
        return tok, torch.zeros(logits.shape[0])
    return draw


def test_unknown_topk_and_logits_settings_are_refused(qwen):
    """`topk` is torch or rank and `logits` bf16 or fp32: anything else is a ValueError, not a silent default.
    [fails if: the topk check or the logits check is dropped]"""
    with pytest.raises(ValueError, match="topk 'heap'"):
        _decoder(qwen, topk="heap")
    with pytest.raises(ValueError, match="logits 'fp16'"):
        _decoder(qwen, logits="fp16")


def test_generate_stops_once_every_real_row_has_ended_and_counts_its_work(qwen):
    """Batch 4, two prompts (one left-padded): row 0 draws EOS at its 2nd token, row 1 at its 4th, the two idle
    copies never. On the CPU the stop is checked after every draw and only the n real rows count, so decoding
    stops right after row 1's EOS: 3 decode steps (tokens 0-2 fed), 4 forwards, and the counts are the prompt
    tokens (mask sum), 2 + 4 sampled tokens and 6 - 2 fed back. Row 0 gets pad after its EOS.
    [fails if: the CPU checks every 16 steps, the idle rows hold the stop, or forwards / prefill_tokens /
    decoded_tokens are miscounted]"""
    ids, mask = prompts()
    dec = _decoder(qwen)
    calls = []
    dec.draw_fn = _scripted_draw({1: {0: 7}, 3: {1: 7}}, calls)
    out = dec.generate(ids, mask, 10, eos_id=7, pad_id=0, temperature=1.0)
    assert out[:, 7:].tolist() == [[5, 7, 0, 0], [5, 5, 5, 7]]
    assert len(calls) == 4 and dec.decode_steps == 3
    assert dec.counts == {"forwards": 4, "prefill_tokens": int(mask.sum()), "decoded_tokens": 4,
                          "sampled_tokens": 6, "forks": 0}
    assert int(mask.sum()) < mask.numel()  # not vacuous: the padding is not counted


def test_min_new_tokens_masks_eos_in_exactly_the_first_draws(qwen):
    """min_new_tokens=3: EOS is masked in draws 0, 1 and 2 and in none after (the docstring: EOS is never sampled
    before min_new_tokens). [fails if: the mask is off by one draw either way]"""
    ids, mask = prompts()
    dec = _decoder(qwen)
    calls = []
    dec.draw_fn = _scripted_draw({}, calls)
    dec.generate(ids, mask, 6, eos_id=2, pad_id=0, temperature=1.0, min_new_tokens=3)
    assert calls == [True, True, True, False, False, False]


def test_draw_with_eos_masked_scores_the_whole_vocabulary_at_the_temperature():
    """draw's log-prob is log softmax(logits / T) of the drawn token over the whole vocabulary, EOS included (the
    trainer's distribution), while EOS itself is never drawn; T=0.7. A plain log_softmax is the reference.
    [fails if: the normaliser leaves EOS out, the sample ignores the EOS mask, or the temperature is not applied]"""
    from engine.decoder import draw

    torch.manual_seed(0)
    logits = torch.randn(4000, 6) * 2
    logits[:, 3] += 2.0  # EOS (3) likely enough that a sample ignoring the mask would draw it
    tok, logp = draw(logits, torch.tensor([3]), 0.7, 1.0)
    assert not (tok == 3).any()
    want = (logits / 0.7).log_softmax(-1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)


def test_greedy_draw_with_eos_masked_takes_the_best_other_token():
    """Greedy (T=0) with EOS masked: the argmax of the other tokens, no log-prob.
    [fails if: the greedy path ignores no_eos]"""
    from engine.decoder import draw

    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [3.0, 0.5, 4.0, -1.0]])
    tok, logp = draw(logits, torch.tensor([2]), 0, 1.0)
    assert tok.tolist() == [3, 0] and logp is None


def test_the_eager_draw_keeps_the_whole_vocabulary_race():
    """The eager draw (CPU; by_piece False) samples with one exponential race over the whole vocabulary: from the
    same seed, argmax(logits - log E) with E drawn by torch's exponential_ over the (N, V) logits. V=2048 splits
    into 4 pieces, so race_by_piece's stream would differ.
    [fails if: the eager draw samples by piece]"""
    from engine.decoder import draw

    logits = torch.randn(8, 2048, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(11)
    noise = torch.empty(8, 2048).exponential_()
    want = (logits - noise.log()).argmax(-1)
    torch.manual_seed(11)
    assert torch.equal(draw(logits, None, 1.0, 1.0)[0], want)


def test_vocab_split_counts_the_most_pieces_of_at_least_512():
    """The most pieces, up to 256, that divide V into pieces of at least 512: 1024 -> 2 (two of exactly 512),
    1536 -> 3, 131072 -> 256 (the cap, pieces of exactly 512), 129280 = 2^8 * 5 * 101 -> 202 (256 leaves 505), below
    1024 -> 1. [fails if: a piece of exactly 512 is refused, or 256 pieces are out of range]"""
    from engine.decoder import vocab_split

    assert [vocab_split(v) for v in (511, 512, 1000, 1024, 1536, 131072, 129280)] == [1, 1, 1, 2, 3, 256, 202]


def test_the_race_never_picks_an_excluded_token_whose_noise_is_zero():
    """An excluded token (-inf logit) whose exponential noise came out exactly 0: -inf - log 0 must not become a
    NaN that max picks; the race takes the argmax of logits - log noise over the allowed tokens.
    [fails if: the noise is not clamped away from 0]"""
    from engine.decoder import race

    logits = torch.tensor([[float("-inf"), 0.0, 1.0, 0.5], [0.2, float("-inf"), 0.1, 0.0]])
    noise = torch.tensor([[0.0, 1.0, 2.0, 0.5], [1.0, 0.0, 0.3, 3.0]])
    assert race(logits, noise).tolist() == [3, 2]  # 0 - log 1, 1 - log 2, 0.5 - log 0.5; 0.2, 0.1 - log 0.3, -log 3


def test_generate_refuses_more_new_tokens_than_the_cache_holds(qwen):
    """A generate whose prompt width + max_new_tokens passes cache_len is refused before any work (a static cache
    cannot grow), one slot over as well. [fails if: generate's cache check is dropped]"""
    ids, mask = prompts()
    dec = _decoder(qwen, batch_size=2, cache_len=7 + 4)
    with pytest.raises(ValueError, match="do not fit"):
        dec.generate(ids, mask, 5, eos_id=-1, pad_id=0, temperature=0)
    assert dec.counts["forwards"] == 0


def test_the_tree_prefill_and_continue_rows_fit_checks(qwen):
    """prefill refuses a prompt as wide as the cache (no slot left to decode) and continue_rows takes W decode
    steps that end exactly at the cache's last slot. [fails if: the prefill check lets width == cache_len through,
    or an exactly fitting continue_rows is refused]"""
    ids, mask = prompts()
    dec = _decoder(qwen, batch_size=2, cache_len=7)
    with pytest.raises(ValueError, match="do not fit"):
        dec.prefill(ids, mask)
    dec = _decoder(qwen, batch_size=2, cache_len=7 + 4)
    dec.prefill(ids, mask)
    toks, _, lengths, first = dec.continue_rows([0, 1], [4, 4], eos_id=-1, pad_id=0, temperature=0)
    assert first == 7 and lengths.tolist() == [4, 4] and toks.shape == (2, 4)


def test_prefill_counts_the_prompt_tokens_of_the_useful_rows_only(qwen):
    """prefill(rows=[1]) counts row 1's real prompt tokens (4 of 7, left-padded), not every row's.
    [fails if: `rows` is ignored]"""
    ids, mask = prompts()
    dec = _decoder(qwen, batch_size=2)
    dec.prefill(ids, mask, rows=[1])
    assert dec.counts["prefill_tokens"] == int(mask[1].sum()) == 4 and dec.counts["forwards"] == 1


def test_fork_rows_copies_the_mask_before_upto_and_the_routes(qwen):
    """After row 0 samples 3 tokens (the first two fed at slots 7 and 8, visible to it alone), fork_rows([0, 0], [1, 2], [9, 8]): row 1 sees
    exactly row 0's slots before 9, row 2 before 8 (row 0's mask times arange < upto), both take row 0's routes, and
    2 forks are counted. [fails if: the slot at upto stays visible, the mask is not cut, the routes stay, or the
    forks are counted as one]"""
    ids, mask = prompts()
    ids3, mask3 = torch.cat([ids, ids[1:]]), torch.cat([mask, mask[1:]])
    dec = _decoder(qwen, batch_size=3, record_routes=True)
    dec.prefill(ids3, mask3)
    dec.continue_rows([0], [3], eos_id=-1, pad_id=0, temperature=0)
    src_mask, src_routes = dec.mask[0].clone(), dec.routes[0].clone()
    assert src_mask[7:10].tolist() == [1, 1, 0] and not torch.equal(dec.routes[1], src_routes)  # not vacuous
    dec.fork_rows([0, 0], [1, 2], [9, 8])
    slots = torch.arange(dec.cache_len)
    assert torch.equal(dec.mask[1], src_mask * (slots < 9)) and torch.equal(dec.mask[2], src_mask * (slots < 8))
    assert torch.equal(dec.routes[1], src_routes) and torch.equal(dec.routes[2], src_routes)
    assert dec.counts["forks"] == 2


def test_continue_rows_uses_prefills_logits_once(qwen):
    """feed=None samples from prefill()'s logits, which the rows then advance past: a second continue_rows(feed=None)
    without a new prefill is refused. [fails if: the logits are kept after use]"""
    ids, mask = prompts()
    dec = _decoder(qwen, batch_size=2)
    dec.prefill(ids, mask)
    dec.continue_rows([0, 1], [2, 2], eos_id=-1, pad_id=0, temperature=0)
    with pytest.raises(ValueError, match="call prefill"):
        dec.continue_rows([0, 1], [2, 2], eos_id=-1, pad_id=0, temperature=0)


def test_continue_rows_stops_when_every_row_has_ended_and_zeroes_ended_rows_entropies(qwen, monkeypatch):
    """Scripted samples: row 0 draws EOS at its 2nd token, row 1 at its 3rd, limits 8. On the CPU the stop is checked
    every step: 2 decode steps (tokens 0 and 1 fed), lengths 2 and 3, row 0's entropy after its EOS is 0 (an ended
    row's draws are not distributions it samples from) while its live entropies are not.
    [fails if: the CPU checks every 16 steps, decode steps go uncounted, or ended rows keep entropies]"""
    import engine.decoder as decoder

    ids, mask = prompts()
    dec = _decoder(qwen, batch_size=2)
    dec.prefill(ids, mask)
    calls = []

    def scripted(logits, temperature, top_p):  # noqa: ARG001
        t = len(calls)
        calls.append(t)
        tok = torch.full((logits.shape[0],), 5, dtype=torch.long)
        if t == 1:
            tok[0] = 7
        if t == 2:
            tok[1] = 7
        return tok

    monkeypatch.setattr(decoder, "sample", scripted)
    toks, ents, lengths, _ = dec.continue_rows([0, 1], [8, 8], eos_id=7, pad_id=0)
    assert lengths.tolist() == [2, 3] and toks.tolist() == [[5, 7, 0], [5, 5, 7]]
    assert len(calls) == 3 and dec.decode_steps == 2 and dec.counts["forwards"] == 1 + 2
    assert ents[0, 2] == 0 and (ents[0, :2] > 0).all() and (ents[1] > 0).all()


def test_last_routes_is_a_copy_and_a_never_fed_slot_holds_zeros(qwen):
    """last_routes returns a copy: a later generate leaves it as it was. After a 6-token generate, a 2-token one
    never feeds its last token (slot 8), so that slot holds 0s, not the earlier call's expert ids (the buffer is
    zeroed at each prefill). [fails if: last_routes returns a view, or the route buffer is not zeroed at prefill]"""
    ids, mask = prompts()
    dec = _decoder(qwen, batch_size=2, record_routes=True)
    dec.generate(ids, mask, 6, eos_id=-1, pad_id=0, temperature=0)
    first = dec.last_routes(2, 13)
    kept = first.clone()
    assert first[:, 8].any()  # not vacuous: the longer call fed a token at slot 8
    dec.generate(ids.flip(0), mask.flip(0), 2, eos_id=-1, pad_id=0, temperature=0)
    assert torch.equal(first, kept)
    assert not dec.last_routes(2, 9)[:, 8].any()


def test_each_decoder_built_adds_one_to_builds(qwen):
    """Decoder.builds counts the decoders built in the process (GRPO's one-per-run check reads it).
    [fails if: the counter is not incremented]"""
    from engine.decoder import Decoder

    before = Decoder.builds
    _decoder(qwen, batch_size=2)
    assert Decoder.builds == before + 1


def test_memory_bytes_counts_weights_buffers_and_the_allocated_cache(qwen):
    """memory_bytes = parameter bytes + buffer bytes + the K/V cache's bytes once a rollout allocated it.
    [fails if: the buffers or the allocated cache are left out]"""
    ids, mask = prompts()
    dec = _decoder(qwen, batch_size=2)
    dec.generate(ids, mask, 2, eos_id=-1, pad_id=0, temperature=0)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    want = size(dec.model.parameters()) + size(dec.model.buffers())
    want += sum(size([layer.keys, layer.values]) for layer in dec.cache.layers)
    assert size(dec.model.buffers()) > 0 and dec.memory_bytes() == want


def test_copy_weights_fills_a_transposed_expert_layout_and_refuses_missing_weights():
    """copy_weights writes a policy's (E, 2F, H) experts into a decoder tensor kept (E, H, 2F) transposed, and a
    decoder tensor no policy weight fills is an error. [fails if: the transposed layout is not transposed, or a
    missing weight passes silently]"""
    from engine.decoder import copy_weights

    policy, model = tiny("qwen3_moe"), tiny("qwen3_moe")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    experts = model.model.layers[0].mlp.experts
    src = policy.model.layers[0].mlp.experts.gate_up_proj
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(src.shape[0], src.shape[2], src.shape[1]))
    copy_weights(model, policy)
    assert torch.equal(experts.gate_up_proj, src.transpose(1, 2))
    assert torch.equal(model.lm_head.weight, policy.lm_head.weight)
    model.model.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="no policy weights for"):
        copy_weights(model, policy)


def test_policy_buffers_rename_autoep_buffers_and_drop_the_expert_counters():
    """An AutoEP layer's buffers under Hugging Face's names (AUTOEP_NAMES: the router is `gate`), its
    tokens_per_expert counter left out, other buffers as they are; _rename_autoep maps the router's gate and the
    shared experts. [fails if: a name keeps a character of the AutoEP prefix, or the counters are kept and the
    routing bias dropped]"""
    from engine.decoder import _rename_autoep, policy_buffers
    from engine.export.read import AUTOEP_NAMES

    layer = torch.nn.Module()
    layer._is_autoep_layer = True
    layer.router = torch.nn.Module()
    layer.router.register_buffer("e_score_correction_bias", torch.zeros(4))
    layer.register_buffer("tokens_per_expert", torch.zeros(4))
    module = torch.nn.Module()
    module.config = types.SimpleNamespace(model_type="deepseek_v3")
    module.model = torch.nn.Module()
    module.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    module.model.layers[0].mlp = layer
    module.model.register_buffer("inv_freq", torch.ones(2))
    assert sorted(n for n, _ in policy_buffers(module)) == ["model.inv_freq",
                                                            "model.layers.0.mlp.gate.e_score_correction_bias"]
    assert _rename_autoep("m.mlp", "router.gate.weight", AUTOEP_NAMES["deepseek_v3"]) == "m.mlp.gate.weight"
    assert (_rename_autoep("m.mlp", "shared_experts.up_proj.weight", AUTOEP_NAMES["qwen3_moe"])
            == "m.mlp.shared_expert.up_proj.weight")


def test_dense_decoding_folds_deepseeks_shared_experts():
    """With dense experts and fold_shared (the default), every DeepSeek-V3 MoE block runs folded_moe_forward (its
    shared experts as extra GEMM columns); fold_shared=False leaves them apart. Greedy tokens equal transformers'
    generate either way. [fails if: the default dense decoder does not fold]"""
    from engine.decoder import folded_moe_forward

    model = tiny("deepseek_v3")
    model.generation_config.eos_token_id = None
    ids, mask = prompts()
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    for fold in (True, False):
        dec = _decoder(model, batch_size=2, decode_experts="dense", fold_shared=fold)
        moe = [m for m in dec.model.modules() if type(m).__name__ == "DeepseekV3MoE"]
        assert moe and all((getattr(m.forward, "__func__", None) is folded_moe_forward) == fold for m in moe)
        assert torch.equal(dec.generate(ids, mask, 4, eos_id=-1, pad_id=0, temperature=0), want)


def test_a_decoder_of_an_autoep_policy_rounds_its_router_logits_as_autoep_does():
    """A bf16 DeepSeek-V3 policy with an AutoEP layer (`_is_autoep_layer`): the decoder's routers compute their logits
    as AutoEP's router does, the GEMM in bf16 then upcast (router_logits' docstring), which is not the fp32 product
    transformers' router takes; without AutoEP layers, the fp32 product. [fails if: the decoder does not tell its
    routers that the policy routes through AutoEP]"""
    import torch.nn.functional as F

    from engine.decoder import Decoder

    policy = tiny("deepseek_v3").to(torch.bfloat16)
    x = torch.randn(16, policy.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for autoep in (False, True):
        policy.model.layers[0].mlp._is_autoep_layer = autoep
        dec = Decoder(policy, "cpu", batch_size=2, cache_len=16)
        gates = [m for m in dec.model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        assert gates
        for g in gates:
            bf16, fp32 = F.linear(x, g.weight).float(), F.linear(x.float(), g.weight.float())
            assert not torch.equal(bf16, fp32)  # not vacuous: the two roundings differ here
            assert torch.equal(g(x)[0], bf16 if autoep else fp32)


def test_top_p_keeps_the_smallest_prefix_that_reaches_it_exactly():
    """sample's nucleus is the smallest prefix of the sorted probabilities whose mass reaches top_p: where the first
    tokens' mass equals top_p exactly, the next token is out (as transformers' TopPLogitsWarper). Equal logits make
    the masses exact in float: two at top_p 0.5 draw one token; four (0.25 each) at top_p 0.5 draw two, and three
    once top_p is a little above 0.5. [fails if: the cut keeps a token whose preceding mass equals top_p (`>` for
    `>=`)]"""
    from engine.decoder import sample

    torch.manual_seed(0)
    assert sample(torch.zeros(2000, 2), 1.0, 0.5).unique().numel() == 1
    assert sample(torch.zeros(2000, 4), 1.0, 0.5).unique().numel() == 2
    assert sample(torch.zeros(2000, 4), 1.0, 0.501).unique().numel() == 3

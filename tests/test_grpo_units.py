"""GRPO's pieces in this process, on a tiny plain Hugging Face DeepSeek-V3 (no engine, no launcher): the log-probs
at the sampling temperature, the rollout copies' fp32 buffers, the decoder under flex attention, the recipe's sampling
fields, and a tokenizer without a pad token."""
import json
import shutil

import pytest
import torch

from conftest import ROOT

ASSETS = ROOT / "engine" / "assets"


def tiny_model(dtype=torch.float32, attn="sdpa", seed=0):
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.data import load_tokenizer
    from engine.model import make_hf_config

    m = ModelConfig(arch="deepseek_v3", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                    moe_intermediate_size=64, num_experts=8, experts_per_token=2, vocab_size=512,
                    max_position_embeddings=64)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_hf_config(m, load_tokenizer(str(ASSETS / "tokenizer"))), dtype=dtype,
                                             attn_implementation=attn)
    return model.eval()


def test_a_loaded_model_trains_in_training_mode_and_grpo_turns_its_dropout_off(tmp_path):
    """build_model with model.init_from (from_pretrained, which leaves a model in eval mode) returns it in training
    mode, as a new model is: activation checkpointing runs only there. GRPO's policy then has no dropout, so its
    passes compute one function: with attention dropout 0.5 two training-mode forwards differ, after no_dropout they
    are equal. [fails if: a loaded model stays in eval mode (train.activation_checkpointing silently off), or
    no_dropout leaves the attention's rate]"""
    from engine.config import ModelConfig
    from engine.grpo import no_dropout
    from engine.model import build_model

    src = tiny_model()
    src.config.attention_dropout = 0.5
    src.save_pretrained(tmp_path / "hf")
    model = build_model(ModelConfig(init_from=str(tmp_path / "hf")), {"zero_optimization": {"stage": 0}})
    assert model.training and all(m.training for m in model.modules())
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout is there to be turned off
        no_dropout(model)
        assert model.training and torch.equal(model(ids).logits, model(ids).logits)


def test_forward_logps_are_those_of_the_sampling_distribution():
    from engine.grpo import forward_logps
    from engine.head import install

    model = install(tiny_model())  # as engine.model.build_model returns it
    ids = torch.randint(0, 512, (3, 10))
    attn = torch.ones_like(ids)
    attn[0, :4] = 0  # left padding
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, :-1].float()
        for t in (0.7, 1.0, 1.3):
            logp, ent = forward_logps(model, ids, attn, t, with_entropy=True)
            want = torch.log_softmax(logits / t, -1)
            torch.testing.assert_close(logp, want.gather(-1, ids[:, 1:, None]).squeeze(-1), atol=1e-6, rtol=0)
            torch.testing.assert_close(ent, -(want.exp() * want).sum(-1), atol=1e-5, rtol=0)
        # At another temperature the same tokens score differently: the comparison above can fail.
        assert (forward_logps(model, ids, attn, 0.7)[0] - forward_logps(model, ids, attn, 1.0)[0]).abs().max() > 0.1


def test_rollout_copies_keep_the_routing_bias_in_fp32():
    """A bf16 policy keeps DeepSeek-V3's routing bias in fp32 (as from_pretrained and train.balance_rate do): the
    rollout decoder and the plain copy (ZeRO 0-2's reference) hold the same fp32 values, so they route as it does.
    Rounded to bf16, 0.5007 became 0.5 and 0.2001 / 0.2003 one value."""
    from engine.decoder import Decoder
    from engine.rollout import local_copy

    policy = tiny_model(torch.bfloat16)
    values = torch.tensor([0.5007, 0.2001, 0.2003, -0.1234567, 0.0, 0.3, 0.70001, -0.5])
    for layer in policy.model.layers:
        layer.mlp.gate.e_score_correction_bias = values.clone()  # fp32
    assert values.to(torch.bfloat16).float().unique().numel() < values.numel()  # bf16 would merge some
    copies = {"local_copy": local_copy(policy, "cpu"), "decoder": Decoder(policy, "cpu", 2, 32).model}
    for name, copy in copies.items():
        for layer in copy.model.layers:
            bias = layer.mlp.gate.e_score_correction_bias
            assert bias.dtype == torch.float32, (name, bias.dtype)
            assert torch.equal(bias, values), (name, bias)
        assert copy.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16  # weights stay as the policy's


def test_decoder_under_flex_attention_samples_as_under_sdpa():
    """model.attn_implementation: flex_attention trains with flex attention; the rollout decoder (static cache,
    absorbed MLA) decodes with sdpa's masks: the same greedy tokens as a decoder built from an sdpa policy."""
    from engine.decoder import Decoder

    flex, sdpa = tiny_model(attn="flex_attention"), tiny_model(attn="sdpa")
    assert flex.config._attn_implementation == "flex_attention"
    ids = torch.randint(3, 512, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    out = [Decoder(m, "cpu", 2, 32, compile=False).generate(ids, mask, 8, eos_id=1, pad_id=0, temperature=0.0)
           for m in (flex, sdpa)]
    assert torch.equal(out[0], out[1]) and out[0].shape[1] > ids.shape[1]
    assert flex.config._attn_implementation == "flex_attention"  # the policy itself is left as it was


@pytest.mark.parametrize("field, value, expect", [
    ("temperature", 0.0, "grpo.temperature (0.0) must be > 0"),
    ("temperature", -1.0, "grpo.temperature (-1.0) must be > 0: rollouts sample from softmax(logits / temperature) "
                          "(a negative one favours the least likely tokens)"),
    ("top_p", 0.0, "grpo.top_p (0.0) must be in (0, 1]"),
    ("top_p", 5.0, "grpo.top_p (5.0) must be in (0, 1]"),
    ("min_new_tokens", 99, "grpo.min_new_tokens (99) must be in [0, grpo.max_new_tokens"),
])
def test_sampling_fields_are_validated(field, value, expect):
    from engine.config import ConfigError, load_recipe

    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "engine" / "recipes" / "grpo_tiny.yaml", {f"grpo.{field}": value})
    assert expect in str(e.value) and "\n" not in str(e.value)
    load_recipe(ROOT / "engine" / "recipes" / "grpo_tiny.yaml", {"grpo.temperature": 0.7, "grpo.top_p": 1.0})


@pytest.mark.parametrize("overrides, expect", [
    ({"grpo.rollout_correction": "tis", "grpo.rollout": "engine"},
     "grpo.rollout_correction tis needs the rollout decoder's log-probs, which only the local decoder's chain rollouts "
     "record; set it to none with grpo.rollout: engine"),
    ({"grpo.rollout_correction": "mis", "grpo.tree": {"enabled": True}}, "set it to none with grpo.tree"),
    ({"grpo.min_new_tokens": 2, "grpo.rollout": "engine"}, "grpo.min_new_tokens works with the local decoder's chain"),
])
def test_what_needs_the_decoders_chains_is_refused_without_them(overrides, expect):
    from engine.config import ConfigError, load_recipe

    with pytest.raises(ConfigError) as e:
        load_recipe(ROOT / "engine" / "recipes" / "grpo_tiny.yaml", overrides)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_min_new_tokens_masks_eos_until_then():
    """grpo.min_new_tokens (equal-length benchmarks): a model that always prefers EOS still writes min_new_tokens
    tokens before it, then stops at once; without it, it stops at the first token."""
    from engine.decoder import Decoder

    eos = 1
    ids, mask = torch.randint(3, 512, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    dec = Decoder(tiny_model(), "cpu", 2, 32, compile=False)
    dec.model.lm_head.register_forward_hook(lambda mod, args, out: out.index_fill(-1, torch.tensor([eos]), 1e4))
    for temperature in (0.0, 1.0):
        plain = dec.generate(ids, mask, 8, eos_id=eos, pad_id=0, temperature=temperature)
        assert plain[:, 6:].tolist() == [[eos], [eos]]
        held = dec.generate(ids, mask, 8, eos_id=eos, pad_id=0, temperature=temperature, min_new_tokens=5)
        assert held.shape[1] == 6 + 6 and (held[:, 6:11] != eos).all() and (held[:, 11] == eos).all(), held


def test_the_decoder_records_the_log_probs_the_trainer_computes():
    """Sampled rollouts: the decoder's log p of every generated token equals the training forward's (the model's
    logits / T, whole vocabulary, at the token's position) on the finished sequences; greedy ones record none."""
    from engine.decoder import Decoder
    from engine.grpo import forward_logps
    from engine.head import install

    model = tiny_model()
    torch.manual_seed(0)
    ids, mask = torch.randint(3, 512, (3, 6)), torch.ones(3, 6, dtype=torch.long)
    mask[2, :2] = 0  # left padding
    dec = Decoder(model, "cpu", 4, 32, compile=False)
    T = 0.7
    out = dec.generate(ids, mask, 7, eos_id=1, pad_id=0, temperature=T, top_p=0.9)
    rec = dec.last_logps  # (3, T_r)
    assert rec.shape == (3, out.shape[1] - 6)
    attn = torch.cat([mask, torch.ones_like(out[:, 6:])], dim=1)
    with torch.no_grad():
        train, _ = forward_logps(install(model), out, attn, T)  # (3, T-1): target t + 1 from position t
    want = train[:, 5:]  # the response tokens' targets
    assert torch.allclose(rec, want, atol=1e-4), (rec - want).abs().max()
    assert (rec - want).abs().max() < 0.01 * want.abs().mean()  # not both ~0: a misaligned column is nats off
    dec.generate(ids, mask, 7, eos_id=1, pad_id=0, temperature=0.0)
    assert dec.last_logps is None


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tmp_path, capsys):
    """GRPO left-pads prompts with the pad token: a tokenizer without one gets its EOS token (noted once), and a
    batch of prompts of different lengths pads."""
    from engine.grpo import left_pad, parse_args, preflight
    from engine.parallel import World

    tok_dir = tmp_path / "tok"
    shutil.copytree(ASSETS / "tokenizer", tok_dir)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del cfg["pad_token"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    recipe = (ROOT / "engine" / "recipes" / "grpo_tiny.yaml").read_text().replace("engine/assets/", f"{ASSETS}/")
    recipe = recipe.replace("data:\n", f"data:\n  tokenizer: {tok_dir}\n").replace("grpo:\n", "grpo:\n  allow_random_init: true\n")
    (tmp_path / "r.yaml").write_text(recipe)
    args = parse_args(["--deepspeed_config", str(ROOT / "ds_configs" / "zero3_grpo.json"), "--config",
                       str(tmp_path / "r.yaml"), "--run_dir", str(tmp_path / "run")])
    tok = preflight(args, World(rank=0, size=1, local_size=1))[2]
    assert tok.pad_token_id == tok.eos_token_id is not None
    assert f"has no pad token; padding with its EOS token '{tok.eos_token}'" in capsys.readouterr().out
    req = left_pad(["Q: 1 + 2 = ? A:", "Gus went to the harbor with 9 pens. Q: 10 + 20 = ? A:"], tok, "cpu")
    assert req.prompt_ids[0, 0] == tok.eos_token_id and req.prompt_attention_mask[0, 0] == 0


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
def test_packed_micro_batches_give_the_same_loss_and_gradient(aggregation):
    """engine/grpo.py micro_batches: rows sorted by length and each micro-batch cut to the columns its rows use give
    the loss and gradient of consecutive full-width micro-batches (a sum over micro-batches of policy_loss / their
    number, as DeepSpeed averages them), on left-padded prompts and completions of different lengths; and they run
    the forwards on fewer columns."""
    from engine.grpo import forward_logps, micro_batches
    from engine.grpo_math import GRPOLossConfig, policy_loss
    from engine.head import install

    model = install(tiny_model())
    torch.manual_seed(3)
    N, P, R = 8, 6, 12
    ids = torch.randint(3, 512, (N, P + R))
    attn = torch.ones_like(ids)
    attn[::3, :2] = 0  # left padding of some prompts
    ends = [2, 12, 5, 3, 9, 12, 1, 4]  # response lengths
    for i, n in enumerate(ends):
        attn[i, P + n:] = 0
    resp = attn[:, 1:].clone()
    resp[:, :P - 1] = 0
    adv = torch.randn(N)
    ref = torch.randn(N, P + R - 1) * 0.1 - 3
    cfg = GRPOLossConfig(aggregation=aggregation, beta=0.04, max_new_tokens=R)
    count = float(resp.sum())

    def total(pack):
        model.zero_grad()
        micros = micro_batches(attn, 2, pack=pack)
        loss_sum = 0.0
        for m in micros:
            logp, _ = forward_logps(model, m.tokens(ids), m.tokens(attn), 0.9)
            loss, _ = policy_loss(logp, logp.detach(), m.targets(adv), m.targets(resp), cfg,
                                  ref_logp=m.targets(ref), token_normalizer=count / len(micros) if aggregation == "dapo" else None)
            (loss / len(micros)).backward()
            loss_sum += float(loss.detach()) / len(micros)
        cols = sum(len(m.rows) * (m.hi - m.lo) for m in micros)
        return loss_sum, [p.grad.clone() for p in model.parameters() if p.grad is not None], cols

    plain, packed = total(False), total(True)
    assert abs(plain[0] - packed[0]) < 1e-5 * max(1.0, abs(plain[0])), (plain[0], packed[0])
    assert len(plain[1]) == len(packed[1])
    for a, b in zip(plain[1], packed[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert max(a.abs().max() for a in plain[1]) > 1e-4  # not vacuous
    assert packed[2] < 0.75 * plain[2], (packed[2], plain[2])  # padding columns skipped


def test_phase_timer_sums_each_phase_from_consecutive_laps(monkeypatch):
    """engine.grpo.Timer on the CPU (wall clock): a phase's time runs from the previous lap to its own, repeated
    phases add up, and phases() reads them without changing them (on CUDA the same arithmetic over events)."""
    import engine.grpo as grpo
    import engine.metrics as metrics

    clock = iter([10.0, 11.0, 13.0, 16.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))  # engine.metrics.DeviceClock
    t = grpo.Timer()
    t.lap("ref_s")
    t.lap("policy_s")
    t.lap("ref_s")
    assert t.phases() == {"ref_s": 1.0 + 3.0, "policy_s": 2.0}
    assert t.phases() == {"ref_s": 4.0, "policy_s": 2.0}
    assert list(t.phases()) == ["ref_s", "policy_s"]


@pytest.mark.parametrize("vocab", [1009, 5120, 129280])
def test_the_split_race_draws_what_the_whole_vocabulary_race_draws(vocab):
    """The decoder's sampler reduces the vocabulary in vocab_split pieces (1009 is prime: one piece; 5120: 10 pieces
    of 512; 129,280: 202 of 640) and in log space: given the same Exp(1) noise it picks the token argmax p_i / E_i
    picks over the whole row, and its log-probs are log_softmax's; draw never picks EOS under min_new_tokens."""
    from engine.decoder import draw, race, split_logsumexp, vocab_split

    assert (vocab_split(1009), vocab_split(5120), vocab_split(129280)) == (1, 10, 202)
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=g) * 4
    logits[1, 7] = float("-inf")  # excluded tokens stay excluded
    for _ in range(5):
        noise = torch.empty_like(logits).exponential_(generator=g)
        want = (logits.softmax(-1) / noise).argmax(-1)
        assert torch.equal(race(logits, noise), want)
    torch.testing.assert_close(split_logsumexp(logits), torch.logsumexp(logits, -1), atol=1e-5, rtol=0)
    noise = torch.ones_like(logits)
    noise[1, 7] = 0.0  # a draw of exactly 0 on an excluded token does not pick it
    assert int(race(logits, noise)[1]) != 7
    eos = torch.tensor([int(logits[0].argmax())])  # the likeliest token of row 0
    for t in (0.7, 1.0):
        tok, logp = draw(logits, eos, t, 1.0)
        assert not (tok == eos).any()
        want = torch.log_softmax(logits.double() / t, -1).gather(-1, tok[:, None]).squeeze(-1)
        torch.testing.assert_close(logp.double(), want, atol=4e-6, rtol=0)  # fp32: 2 ulps of a logsumexp near 25


def test_the_race_samples_the_softmax():
    """40,000 draws of a 6-token row (top_p 1 and 0.8, temperature 0.5): each token's frequency is its probability
    (within 0.01; the standard error is at most 0.0025), and the nucleus keeps the smallest prefix reaching 0.8."""
    from engine.decoder import sample

    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = (logits / 0.5).softmax(-1)
    got = torch.bincount(sample(logits.expand(40000, -1), 0.5, 1.0), minlength=6).float() / 40000
    torch.testing.assert_close(got, p, atol=0.01, rtol=0)
    keep = (p.cumsum(-1) - p) <= 0.8  # p is sorted: 0.84, 0.11, ... -> the first two tokens
    nucleus = torch.where(keep, p, 0.0) / torch.where(keep, p, 0.0).sum()
    got = torch.bincount(sample(logits.expand(40000, -1), 0.5, 0.8), minlength=6).float() / 40000
    torch.testing.assert_close(got, nucleus, atol=0.01, rtol=0)


def test_sampling_by_piece_draws_the_softmax():
    """The compiled decoder's sampler (race_by_piece: a vocab_split piece by its logsumexp, then a token within it)
    draws from the same softmax as the whole-vocabulary race. 40,000 draws of a 2,048-token row (4 pieces of 512)
    whose mass sits on 10 tokens in all 4 pieces, at temperature 0.7: each frequency within 0.01 of its probability
    (standard error at most 0.0025), with the EOS excluded and without; excluded and -inf tokens are never drawn;
    the log-probs are log_softmax's."""
    from engine.decoder import draw, vocab_split

    assert vocab_split(2048) == 4
    torch.manual_seed(0)
    logits = torch.full((2048,), float("-inf"))
    # piece 3 holds 5 likely tokens and the EOS: its weight is their sum, far above its largest token's
    where = torch.tensor([3, 600, 601, 1100, 1600, 1601, 1602, 1603, 1604, 2047])
    logits[where] = torch.tensor([1.0, 0.5, 0.5, 0.0, 0.3, 0.3, 2.0, 0.3, 0.3, -1.0])
    for eos in (torch.tensor([1602]), None):  # with EOS excluded, and without (the pieces' logsumexps shared)
        p = (logits / 0.7 if eos is None else (logits / 0.7).index_fill(0, eos, float("-inf"))).softmax(-1)
        counts = torch.zeros(2048)
        for _ in range(10):
            tok, logp = draw(logits.expand(4000, -1), eos, 0.7, 1.0, by_piece=True)
            counts += torch.bincount(tok, minlength=2048).float()
            want = torch.log_softmax(logits / 0.7, -1)[tok]
            torch.testing.assert_close(logp, want, atol=1e-5, rtol=0)
        assert counts.sum() == 40000 and counts[p == 0].sum() == 0
        torch.testing.assert_close(counts / 40000, p, atol=0.01, rtol=0)


def test_sampling_by_piece_keeps_the_top_p_nucleus():
    """With top_p < 1 the compiled decoder's draw (by_piece=True) samples the top-p nucleus as `sample` does (the
    piece race is for the whole softmax only): 40,000 draws at temperature 0.7, top_p 0.6, each frequency within 0.01
    of the nucleus's probability, no token outside it. [fails if: by_piece skips the nucleus]"""
    from engine.decoder import draw

    torch.manual_seed(0)
    logits = torch.full((2048,), float("-inf"))
    where = torch.tensor([3, 600, 601, 1100, 1600, 1601, 1602, 1603, 1604, 2047])
    logits[where] = torch.tensor([1.0, 0.5, 0.5, 0.0, 0.3, 0.3, 2.0, 0.3, 0.3, -1.0])
    p = (logits / 0.7).softmax(-1)
    sorted_p, order = p.sort(descending=True)
    keep = torch.zeros(2048, dtype=torch.bool)
    keep[order[(sorted_p.cumsum(-1) - sorted_p) <= 0.6]] = True  # the smallest prefix reaching 0.6
    assert 1 < int(keep.sum()) < 10
    nucleus = torch.where(keep, p, 0.0) / torch.where(keep, p, 0.0).sum()
    counts = torch.zeros(2048)
    for _ in range(10):
        tok, _ = draw(logits.expand(4000, -1), None, 0.7, 0.6, by_piece=True)
        counts += torch.bincount(tok, minlength=2048).float()
    assert counts[~keep].sum() == 0
    torch.testing.assert_close(counts / 40000, nucleus, atol=0.01, rtol=0)


def test_the_reference_is_a_copy_where_zero3_hooks_would_cost_and_numbers_allow():
    """grpo.reference_is_copy: ZeRO 0-2 always a plain copy; ZeRO-3 a copy only on one GPU rank with its
    parameters on it (the whole model is local there); on several ranks, with offloaded parameters, or on a CPU rank
    the optimizer-free engine on the policy's shards (on a CPU: the policy's own numbers, KL 0 at step 1)."""
    from engine.grpo import reference_is_copy

    z3 = {"zero_optimization": {"stage": 3}}
    off = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    z2 = {"zero_optimization": {"stage": 2}}
    assert reference_is_copy(z3, 1, "cuda:0") and reference_is_copy(z3, 1, torch.device("cuda", 0))
    assert not reference_is_copy(z3, 2, "cuda:0") and not reference_is_copy(off, 1, "cuda:0")
    assert not reference_is_copy(z3, 1, "cpu")
    assert all(reference_is_copy(z2, n, d) for n in (1, 2) for d in ("cpu", "cuda:0"))


def test_the_tests_written_batch_copy_is_the_shipped_grpo_config():
    """The shipped GRPO configs leave the batch to the engine ("auto": the micro-batch fitted to the device; 16 x 4
    for the CPU demo); tests/zero3_grpo_16x4.json, which the written-batch tests use, is zero3_grpo.json with 16 x 4
    written and nothing else changed."""
    import json

    for name in ("zero3_grpo.json", "zero2_grpo.json"):
        shipped = json.loads((ROOT / "ds_configs" / name).read_text())
        assert shipped["train_micro_batch_size_per_gpu"] == shipped["gradient_accumulation_steps"] == "auto", name
    shipped = json.loads((ROOT / "ds_configs" / "zero3_grpo.json").read_text())
    copy = json.loads((ROOT / "tests" / "zero3_grpo_16x4.json").read_text())
    assert copy == {**shipped, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 4}


def _tiny_compiled_parameter_free(monkeypatch, lengths_vary: bool):
    """(model config, a tiny DeepSeek-V3 model with compile_parameter_free applied, the real torch.compile): torch.compile
    patched to Dynamo's eager backend (tracing and guards, not inductor's kernels), the module-wide rotary patch
    restored after the test."""
    from transformers import AutoModelForCausalLM

    from engine.config import load_recipe
    from engine.model import compile_parameter_free, make_hf_config

    m = load_recipe(None, {"model.hidden_size": 32, "model.intermediate_size": 64, "model.moe_intermediate_size": 16,
                           "model.num_layers": 2, "model.first_dense_layers": 1}).model
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_hf_config(m))
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, options=None, **kw: real(fn, backend="eager", **kw))
    hf_module = __import__("sys").modules[type(model).__module__]
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):
        if hasattr(hf_module, name):
            monkeypatch.setattr(hf_module, name, getattr(hf_module, name))
    assert compile_parameter_free(model, lengths_vary=lengths_vary)
    return m, model, real


@pytest.mark.parametrize("lengths_vary", [False, True])
def test_parameter_free_functions_compiled_for_varying_lengths_trace_once(monkeypatch, lengths_vary):
    """GRPO's rows change length every step. engine/model.compile_parameter_free(lengths_vary=True) (GRPO's policy
    under ZeRO-3 on CUDA: build_engine(lengths_vary=True)) traces each function once for any length; without it
    (pretraining's fixed shapes) the second length traces again (on one H200 that recompile made GRPO's step 2 0.6-0.9
    s longer).
    Dynamo with the eager backend here: the tracing and its guards are what is checked, not inductor's kernels."""
    from torch._dynamo.utils import counters

    m, model, _ = _tiny_compiled_parameter_free(monkeypatch, lengths_vary)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for length in (12, 20, 28):
        x = torch.randint(0, m.vocab_size, (2, length))
        model(x, labels=x).loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs[0] >= 3, graphs  # norm, silu(gate) * up, rotary
    if lengths_vary:
        assert graphs[2] == graphs[0], graphs
    else:
        assert graphs[1] > graphs[0], graphs  # what lengths_vary saves


@pytest.mark.parametrize("lengths_vary", [False, True])
def test_no_grad_passes_use_the_compiled_functions_in_grpo_only(monkeypatch, lengths_vary):
    """GRPO (lengths_vary) runs its no-grad passes (the reference, the old log-probs) through the compiled
    parameter-free functions too; pretraining's evaluation (no_grad, shapes of its own) stays eager; a call inside
    another compile (the decoder's step) runs the eager code in both. [fails if: GRPO's no-grad calls skip the
    compiled code, or pretraining's take it]"""
    from torch._dynamo.utils import counters

    m, model, real = _tiny_compiled_parameter_free(monkeypatch, lengths_vary)
    torch._dynamo.reset()
    counters.clear()
    x = torch.randint(0, m.vocab_size, (2, 12))
    with torch.no_grad():
        model(x)
    traced = counters["stats"]["unique_graphs"]
    outer = real(lambda ids: model(ids).logits, backend="eager", fullgraph=False)
    counters.clear()
    with torch.no_grad():
        outer(x)
    inside = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert (traced >= 3) if lengths_vary else (traced == 0), traced  # norm, silu(gate) * up, rotary
    assert inside >= 1  # the outer compile traced the model (the wrappers' eager branch inside it)


@pytest.mark.parametrize("compile_, stage, pipeline, cuda, expect", [
    ("auto", 2, False, True, True),   # the policy's parameter-free functions compiled: the copy's too
    ("auto", 3, False, True, True),
    (True, 2, False, True, True),     # the policy compiled by whole layers: the copy still takes its functions
    (True, 3, False, True, True),
    (False, 2, False, True, False),   # nothing compiled anywhere
    (False, 3, False, True, False),
    (True, 2, True, True, False),     # pipeline stages are left as they are
    ("auto", 2, False, False, False),  # CPU ranks stay eager
])
def test_grpo_reference_copy_compiles_wherever_the_policy_compiles(monkeypatch, compile_, stage, pipeline, cuda,
                                                                    expect):
    """build_reference's plain copy (ZeRO 0-2, or ZeRO-3 on one GPU) compiles its parameter-free functions wherever
    the policy compiles anything, with train.compile "auto" or true, on CUDA; never with compile false, a pipeline or
    on a CPU. [fails if: the copy stays eager beside a policy compiled by whole layers, or compiles where the
    policy compiles nothing]"""
    from types import SimpleNamespace

    from engine import grpo
    from engine.config import TrainConfig

    seen = []
    device = "cuda" if cuda else "cpu"
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(device_name=lambda: device))
    monkeypatch.setattr(grpo, "reference_is_copy", lambda *a: True)
    monkeypatch.setattr(grpo, "local_copy", lambda module, device, decode_experts: f"copy of {module}")
    monkeypatch.setattr(grpo, "compile_parameter_free", lambda model, lengths_vary: seen.append((model, lengths_vary)))
    policy = SimpleNamespace(module="policy", device=f"{device}:0")
    train = TrainConfig(compile=compile_)
    ds = {"zero_optimization": {"stage": stage}, **({"pipeline": {"stages": 2}} if pipeline else {})}
    assert grpo.build_reference(policy, SimpleNamespace(train=train), ds, None, 1) == "copy of policy"
    assert seen == ([("copy of policy", True)] if expect else [])
    assert train.compile == compile_  # the recipe itself is left as it was


GRPO_AUTO_COMPILE = {  # shipped file -> what GRPO's train.compile "auto" compiles on CUDA: the policy, its reference copy
    "zero3_grpo.json": ("layers", "parameter-free"), "zero3.json": ("layers", "parameter-free"),
    "zero2_grpo.json": ("parameter-free", "parameter-free"), "zero2.json": ("parameter-free", "parameter-free")}


@pytest.mark.parametrize("name", list(GRPO_AUTO_COMPILE))
@pytest.mark.parametrize("device, rollout", [("cuda", "local"), ("cpu", "local"), ("cuda", "engine")])
def test_grpo_auto_compiles_the_policy_layers_under_zero3_with_autoep_on_a_gpu(monkeypatch, name, device, rollout):
    """GRPO's setup with train.compile "auto", per shipped file: on CUDA under ZeRO-3 with AutoEP and decoder-layer
    leaves the policy's layers are compiled whole (compile_layers, built with torch's linear, linear-attention mixers
    left eager first) and not its parameter-free functions; under ZeRO-2, or where the rollout generates through the
    policy itself (grpo.rollout engine), the parameter-free functions only; the one-GPU reference copy takes its
    parameter-free functions either way; a CPU run compiles nothing and keeps DeepSpeed's defaults. [fails if: setup
    keeps compiling layers only for train.compile true, "auto" compiles layers under ZeRO-2, on a CPU or for the
    engine rollout, the policy compiles both or neither, the fill of torch's linear does not follow the layers, the
    mixers are compiled, or the copy stays eager beside compiled layers]"""
    from pathlib import Path
    from types import SimpleNamespace

    from engine import grpo, parallel
    from engine.auto_batch import AutoBatch
    from engine.config import load_recipe
    from engine.ds_config import read_ds_config, resolve_ds_config

    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: SimpleNamespace(
        device_name=lambda: device, current_device_name=lambda: device))
    monkeypatch.setattr(parallel.torch.version, "hip", None)
    r = load_recipe(None, {"train.compile": "auto", "grpo.beta": 0.04, "grpo.rollout": rollout,
                           "train.activation_checkpointing": False})
    raw = read_ds_config(Path(__file__).parents[1] / "ds_configs" / name)
    ds = resolve_ds_config(raw, r, world_size=1, ranks_per_node=1, auto_batch=AutoBatch(), device=device)
    seen, module = {}, SimpleNamespace(config=None)  # the policy's module

    def engine(model, ds_, schedule, lengths_vary, layers):
        seen["parameter_free"] = parallel.compiles_parameter_free(ds_, schedule, lengths_vary, layers)
        seen["linear"] = ds_["zero_optimization"].get("memory_efficient_linear")
        return SimpleNamespace(module=module, device=device, train_micro_batch_size_per_gpu=lambda: 2,
                               gradient_accumulation_steps=lambda: 1)

    monkeypatch.setattr(grpo, "build_model", lambda *a, **k: torch.nn.Linear(1, 1))
    monkeypatch.setattr(grpo, "no_dropout", lambda model: None)
    monkeypatch.setattr(grpo, "build_engine", engine)
    monkeypatch.setattr(grpo, "eager_linear_attention", lambda module: seen.setdefault("order", []).append("mixers"))
    monkeypatch.setattr(grpo, "compile_layers", lambda module, dynamic: seen.setdefault("layers", []).append(module)
                        or seen.setdefault("order", []).append("layers") or ["layers.0"])
    monkeypatch.setattr(grpo, "reference_is_copy", lambda *a: True)
    monkeypatch.setattr(grpo, "local_copy", lambda module, device, decode_experts: "copy")
    monkeypatch.setattr(grpo, "compile_parameter_free", lambda model, lengths_vary: seen.setdefault("copy", model))
    monkeypatch.setattr(grpo, "build_rollout", lambda *a, **k: None)
    monkeypatch.setattr(grpo, "print0", lambda *a: None)
    run = grpo.setup(r, ds, None, None, [{"n_tokens": 8}], [], SimpleNamespace(rank=0, size=1))
    assert run.ref == "copy"
    policy, copy = GRPO_AUTO_COMPILE[name] if device == "cuda" else ("none", "none")
    if rollout == "engine" and policy == "layers":
        policy = "parameter-free"
    assert seen.get("layers") == ([module] if policy == "layers" else None)
    assert seen.get("order") == (["mixers", "layers"] if policy == "layers" else None)
    assert seen["parameter_free"] is (policy == "parameter-free")
    assert seen["linear"] is (False if policy == "layers" else None)  # torch's linear: one trace per layer kind
    assert seen.get("copy") == ("copy" if copy == "parameter-free" else None)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(
    torch.__version__ < (2, 13), reason="torch 2.11's CPU Inductor rounds differently (seen on the GPU image); the "
    "pinned 2.13 and CUDA do not"))] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_parameter_free_functions_give_the_eager_forward_to_the_bit(monkeypatch, device):
    """GRPO's policy pass runs the compiled functions (with autograd), its reference and old-log-prob passes the eager
    ones (no_grad): in bf16 the two forwards must be equal to the bit, or the first iteration's ratio is not 1 and the
    KL against an identical reference is not 0. Inductor's C++ kernels here, as its Triton ones on CUDA."""
    from transformers import AutoModelForCausalLM

    from engine.config import load_recipe
    from engine.model import compile_parameter_free, make_hf_config

    m = load_recipe(None, {"model.hidden_size": 64, "model.intermediate_size": 128, "model.moe_intermediate_size": 32,
                           "model.num_layers": 2, "model.first_dense_layers": 1}).model
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_hf_config(m), dtype=torch.bfloat16).to(device)
    hf_module = __import__("sys").modules[type(model).__module__]
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):  # patched module-wide: restored after
        if hasattr(hf_module, name):
            monkeypatch.setattr(hf_module, name, getattr(hf_module, name))
    x = torch.randint(0, m.vocab_size, (2, 24), device=device)
    with torch.no_grad():
        eager = model(x).logits
    torch._dynamo.reset()
    done = compile_parameter_free(model, lengths_vary=True)
    assert any("norm" in d for d in done) and any("rotary" in d for d in done), done
    compiled = model(x).logits  # autograd on: the compiled functions
    with torch.no_grad():  # GRPO's no-grad passes (reference, old log-probs) compiled too: an inference graph
        compiled_no_grad = model(x).logits
    torch._dynamo.reset()
    assert compiled.requires_grad and torch.equal(compiled, eager)
    assert torch.equal(compiled_no_grad, eager)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(
    torch.__version__ < (2, 13), reason="torch 2.11's CPU Inductor rounds differently"))]
    + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_layers_give_the_eager_forward_to_the_bit(monkeypatch, device):
    """train.compile: true compiles each decoder layer whole (pretrain.compile_layers; GRPO's policy, ZeRO-3
    pretraining). In bf16 its forward must equal the eager one to the bit, as the parameter-free functions' does, or
    GRPO's KL against an identical eager reference is not 0 (on one H100 it doubled). It also makes room for one
    trace per layer (ZeRO-3's ds_id guard on torch 2.11). [fails if: the layers compile without
    emulate_precision_casts (68% of the logits differ), or the recompile limit stays at its default 8]"""
    from transformers import AutoModelForCausalLM

    from engine.config import load_recipe
    from engine.model import make_hf_config
    from engine.pretrain import compile_layers

    m = load_recipe(None, {"model.hidden_size": 64, "model.intermediate_size": 128, "model.moe_intermediate_size": 32,
                           "model.num_layers": 5, "model.first_dense_layers": 1}).model
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_hf_config(m), dtype=torch.bfloat16).to(device)
    x = torch.randint(0, m.vocab_size, (2, 24), device=device)
    with torch.no_grad():
        eager = model(x).logits
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # restored after the test
    torch._dynamo.reset()
    assert compile_layers(model, dynamic=None) == [f"layers.{i}" for i in range(5)]
    assert torch._dynamo.config.recompile_limit >= 2 * 5 + 2
    compiled = model(x).logits
    torch._dynamo.reset()
    assert compiled.requires_grad and torch.equal(compiled, eager)


def test_compiled_layers_trace_every_layer_when_each_needs_its_own(monkeypatch):
    """Under ZeRO-3 DeepSpeed's linear reads an int attribute of each weight (ds_id), and dynamo (torch 2.11) guards on
    its value: one trace per layer, where the default recompile limit of 8 left the later layers of a 12-layer model
    eager (one H100). Here a linear that reads an int of each weight as DeepSpeed's does, on 11 layers (10 dense, one
    MoE): every layer is traced. [fails if: compile_layers leaves the recompile limit at 8 (8 traces)]"""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from engine.config import load_recipe
    from engine.model import make_hf_config
    from engine.pretrain import compile_layers

    m = load_recipe(None, {"model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 11,
                           "model.first_dense_layers": 10, "model.moe_intermediate_size": 16}).model
    model = AutoModelForCausalLM.from_config(make_hf_config(m))
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
    real = F.linear

    def linear(x, weight, bias=None):  # as deepspeed/runtime/zero/linear.py reads its weight's ds_id
        assert weight.ds_id >= 0
        return real(x, weight, bias)

    traces = []

    def backend(gm, example_inputs):
        traces.append(gm)
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(F, "linear", linear)
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, options=None: compile_(fn, backend=backend,
                                                                                           dynamic=dynamic))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # restored after the test
    torch._dynamo.reset()
    compile_layers(model, dynamic=None)
    model(torch.randint(0, m.vocab_size, (2, 16)))
    torch._dynamo.reset()
    assert len(traces) >= 11, len(traces)  # a graph per layer at least (the MoE layer's breaks into more): 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU arithmetic on the 2-rank pool, which a 1-GPU machine "
                    "cannot start (rank 1 has no device)")
def test_policy_update_on_two_ranks_gives_each_aggregations_whole_batch_loss(tmp_path):
    """engine/grpo.py policy_update on the rank pool's 2 CPU ranks (tests/scripts/grpo_norm_ranks.py), through a fake
    engine that takes the loss as DeepSpeed does (backward of loss / gradient_accumulation_steps, the gradients
    averaged over the ranks), on per-rank batches of 23 and 7 response tokens: for grpo, dapo and dr_grpo the ranks'
    averaged gradient and effective loss are those of the aggregation's loss over both ranks' rows in one batch
    (engine/grpo_math.py's definitions, computed by hand). Dropping run.world.size from the DAPO normalizer halves
    dapo's; a rank-local token count (no all-reduce in response_tokens) gives each rank's token mean, not the global
    one. The statistics of the metrics row (loss_stats) are token means over both ranks too."""
    from conftest import run_ranks

    out = tmp_path / "norm.json"
    run_ranks(2, ROOT / "tests" / "scripts" / "grpo_norm_ranks.py", out, cwd=tmp_path, timeout=300)
    got = json.loads(out.read_text())
    assert got["tokens"] == [23, 7], got["tokens"]
    wants = [got[a]["want_loss"] for a in ("grpo", "dapo", "dr_grpo")]
    assert len({round(w, 6) for w in wants}) == 3, wants  # three different losses: each comparison can fail
    for aggregation in ("grpo", "dapo", "dr_grpo"):
        g = got[aggregation]
        assert abs(g["loss"] - g["want_loss"]) <= 1e-5 * max(1.0, abs(g["want_loss"])), (aggregation, g)
        assert g["grad_err"] <= 1e-5 * g["grad_max"] and g["grad_max"] > 1e-3, (aggregation, g)
        # the row's statistics are token means over both ranks (micro-batches of 12, 11, 3, 4 response tokens)
        assert abs(g["entropy"] - g["want_entropy"]) <= 1e-6 * g["want_entropy"], (aggregation, g)


@pytest.mark.parametrize("memory, ds, expect, without", [
    (79.2, "zero3_grpo", (64, 1, True), 8),   # one H100 80GB: 8 rows of 272 tokens without it
    (79.2, "zero2_grpo", (64, 1, True), 4),   # 4 rows without it; 64 x 1 with it (ZeRO-2 keeps no gradient sum at 1)
    (139.8, "zero3_grpo", (64, 1, False), None),  # one H200: the whole rollout batch fits without it
    (None, "zero3_grpo", (16, 4, False), None),  # the CPU: no device memory to fit, off
])
def test_grpo_resolves_auto_checkpointing_with_the_batch(tmp_path, monkeypatch, memory, ds, expect, without):
    """train.activation_checkpointing "auto" (the default) in GRPO: preflight hands setup a recipe whose checkpointing
    is true or false, decided with the "auto" micro-batch: on where without it a micro-batch of grpo_2b6's rows of 272
    tokens holds a few rows and with it 8-16 times more, off where everything fits without it, on the CPU, or with the
    DS config's own batch numbers; an explicit false keeps it off at the smaller micro-batch. [fails if: the resolved
    value is not passed on to setup ("auto" reaching gradient_checkpointing_enable's truthiness check, or false after
    choosing a micro-batch that only fits with it; "auto" left as it is with the file's batch numbers), or the rule
    turns it on where it buys nothing]"""
    import engine.auto_batch as ab
    import engine.grpo as grpo
    from engine.parallel import World

    class Props:
        total_memory = 80 * 2**30
    if memory is not None:
        monkeypatch.setattr(grpo, "device_kind", lambda: "cuda")
        monkeypatch.setattr(ab, "device_memory_gib", lambda device, fraction=None: memory)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    recipe = (ROOT / "engine" / "recipes" / "grpo_2b6.yaml").read_text().replace("engine/assets/", f"{ASSETS}/")
    (tmp_path / "r.yaml").write_text(recipe.replace("grpo:\n", "grpo:\n  allow_random_init: true\n"))

    def run(ds_file):
        args = grpo.parse_args(["--deepspeed_config", str(ds_file), "--config", str(tmp_path / "r.yaml"), "--run_dir",
                                str(tmp_path / "run")])
        r, cfg = grpo.preflight(args, World(rank=0, size=1, local_size=1))[:2]
        return cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], r.train.activation_checkpointing

    shipped = ROOT / "ds_configs" / f"{ds}.json"
    assert run(shipped) == expect
    numbers = {**json.loads(shipped.read_text()), "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 8}
    (tmp_path / "numbers.json").write_text(json.dumps(numbers))
    assert run(tmp_path / "numbers.json") == (8, 8, False)  # the file's batch: nothing decides, off
    if expect[2]:
        (tmp_path / "r.yaml").write_text((tmp_path / "r.yaml").read_text().replace(
            "train:\n", "train:\n  activation_checkpointing: false\n"))
        micro, accum, on = run(shipped)
        assert on is False and micro == without and micro * accum == 64

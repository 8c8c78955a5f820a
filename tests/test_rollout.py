"""The rollout decoder decodes with a KV cache (one new token per forward after the prompt) and leaves the
policy's config alone. Without both, an H200 ran out of memory: generate re-ran the whole sequence at every
token, and the training model's config was switched to use_cache=True by the rollout."""
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, check_decoder_follows_generate  # noqa: F401  (ROOT puts the project on sys.path)


@pytest.fixture(autouse=True)
def no_zero3_from_earlier_tests(monkeypatch):
    """A DeepSpeed engine trained earlier in this process (tests/test_pretrain.py) keeps transformers' ZeRO-3
    flag alive; the plain models built here must not be partitioned by it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)


def test_local_copy_decodes_with_a_cache_and_leaves_the_policy_config_alone():
    from deepspeed.runtime.rollout import SamplingConfig
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.data import load_tokenizer
    from engine.grpo import left_pad
    from engine.model import make_hf_config
    from engine.rollout import DecoderRollout

    tok = load_tokenizer(str(ROOT / "engine" / "assets" / "tokenizer"))
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(make_hf_config(ModelConfig(), tok))
    policy.config.use_cache = False  # as engine/model.py builds it for training
    rollout = DecoderRollout(SimpleNamespace(module=policy, device=torch.device("cpu")), tok, batch_size=4,
                             cache_len=32)
    rollout.sync_weights(0)
    widths = []
    rollout.decoder.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    request = left_pad(["12 + 7 =", "3 * 4 ="], tok, torch.device("cpu"))
    out = rollout.generate(request, SamplingConfig(max_new_tokens=8, temperature=0.0, n_samples_per_prompt=2))

    prompt_len = request.prompt_ids.shape[1]
    new = out.input_ids.shape[1] - prompt_len
    assert new > 1, "generation stopped at once; the test sees no decode step"
    assert widths[0] == prompt_len
    assert widths[1:] == [1] * (new - 1), widths  # one new token per forward: the cache is used
    assert policy.config.use_cache is False
    assert rollout.decoder.model.config is not policy.config


def test_decoding_keeps_grouped_mm_experts():
    """transformers' generate swaps grouped_mm experts for batched_mm while decoding on GPUs; the rollout copy
    registers the same kernel under its own name so the swap does not happen (one H200: 16.0 -> 11.9 s per
    rollout of 64 x 256 tokens, docs/benchmarks.md). The renamed kernel must compute what grouped_mm does."""
    from transformers import AutoModelForCausalLM

    from engine.config import ConfigError, ModelConfig, load_recipe
    from engine.model import make_hf_config
    from engine.decoder import DECODE_GROUPED_MM, experts_for_decode

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_hf_config(ModelConfig()))
    ids = torch.randint(0, 512, (2, 12))
    assert model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        ref = model(ids).logits
        model.set_experts_implementation(experts_for_decode("grouped_mm"))
        impl = model.get_experts_implementation()
        assert "grouped_mm" not in impl.values(), impl  # what generate's swap looks for
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
        # The bitwise comparison sees which kernel ran: batched_mm (what generate swaps in) gives other bits on
        # this model (measured: 82% of the logits, up to 1.8e-7), and so did batched_mm registered under the
        # decode name (a deliberate bug in experts_for_decode). A rename that did not take effect would leave
        # grouped_mm running and pass the line above, so the model must also run the kernel named in its config:
        model.set_experts_implementation("batched_mm")
        assert not torch.equal(model(ids).logits, ref), "batched_mm gave grouped_mm's bits: no kernel is told apart"
        model.set_experts_implementation(DECODE_GROUPED_MM)
        assert torch.equal(model(ids).logits, ref)
    assert experts_for_decode("batched_mm") == "batched_mm"
    with pytest.raises(ConfigError, match="grpo.decode_experts: 'fast' is not one of auto, grouped_mm, dense, batched_mm, eager"):
        load_recipe(None, {"grpo.decode_experts": "fast"})


def test_dense_decode_experts_compute_what_grouped_mm_does():
    """grpo.decode_experts: dense runs every expert on every token and weights the outputs by the routing (zero
    off the top-k): the same numbers as the grouped kernel, in fp32 to rounding."""
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.decoder import experts_for_decode
    from engine.model import make_hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_hf_config(ModelConfig()))
    ids = torch.randint(0, 512, (3, 12))
    with torch.no_grad():
        ref = model(ids).logits
        model.set_experts_implementation(experts_for_decode("dense"))
        assert set(model.get_experts_implementation().values()) == {"dense_decode"}
        got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert (got - ref).abs().max() < 1e-5 and ref.abs().max() > 1e-2


def test_a_decoder_too_large_for_the_device_is_refused_naming_the_engine_rollout():
    """The local decoder holds the whole model and its KV cache on every device; past half a device it is refused
    (grpo.rollout: local) in one line that names the way out."""
    from engine.config import ModelConfig
    from engine.grpo import decoder_fit_problem
    from engine.model import make_hf_config

    cfg = make_hf_config(ModelConfig())
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    cache = cfg.num_hidden_layers * 64 * 272 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2  # bf16 latent cache
    need = n * 2 + cache
    assert decoder_fit_problem(cfg, torch.bfloat16, 64, 272, device_bytes=2 * need) is None
    problem = decoder_fit_problem(cfg, torch.bfloat16, 64, 272, device_bytes=2 * need - 2)
    assert problem is not None and "grpo.rollout: engine" in problem and "\n" not in problem, problem


@pytest.mark.parametrize("experts", ["grouped_mm", "dense"])
def test_the_fused_decoder_layout_samples_as_generate_before_and_after_a_refresh(experts):
    """The decoder stacks gate/up and MLA's q_a/kv_a projections into shared storages (parameters become views
    into them) and, with dense experts, stores the down projections (H, E, F) for one GEMM over all experts.
    Greedy tokens equal transformers' generate on the same weights, with q_lora (the GPU recipes' MLA: the
    tiny default has none), and again after every weight changed and the decoder was refreshed in place."""
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config

    torch.manual_seed(0)
    mc = ModelConfig(q_lora_rank=48, kv_lora_rank=32)
    model = AutoModelForCausalLM.from_config(make_hf_config(mc)).eval()
    ids = torch.randint(1, 512, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    dec = Decoder(model, "cpu", batch_size=4, cache_len=32, decode_experts=experts)
    # with dense experts, each MoE block's shared experts are folded into its experts' storages (_gate_up_all)
    fused = [m for m in dec.model.modules() if hasattr(m, "_qkv_a") or hasattr(m, "_gate_up") or hasattr(m, "_gate_up_all")]
    assert len(fused) >= 3, "no fused storages: the test would not exercise them"
    for m in fused:
        w = m._qkv_a if hasattr(m, "_qkv_a") else m._gate_up if hasattr(m, "_gate_up") else m._gate_up_all
        first = (m.q_a_proj.weight if hasattr(m, "_qkv_a") else m.gate_proj.weight if hasattr(m, "_gate_up")
                 else m.experts.gate_up_proj)
        assert first.data_ptr() == w.data_ptr()
    check_decoder_follows_generate(model, dec, ids, mask)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_shared_experts_folded_into_the_dense_experts_gemms_decode_as_generate(arch):
    """With dense decode experts, a DeepSeek MoE block's shared experts become extra rows of the routed experts'
    gate/up GEMM and extra columns of their down GEMM (every weight a view into the two storages, so a refresh
    fills them). Greedy tokens and sampled log-probs follow transformers' generate before and after refreshes, and
    the recorded expert ids equal an unfolded decoder's."""
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config

    torch.manual_seed(0)
    mc = ModelConfig(arch=arch, q_lora_rank=48, num_shared_experts=2, first_dense_layers=1, num_layers=3)
    model = AutoModelForCausalLM.from_config(make_hf_config(mc)).eval()
    ids = torch.randint(1, 512, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    folded = Decoder(model, "cpu", batch_size=4, cache_len=32, decode_experts="dense", record_routes=True)
    blocks = [m for m in folded.model.modules() if hasattr(m, "_gate_up_all")]
    assert len(blocks) == 2, "the two MoE layers were not folded: the test would not exercise the fold"
    for m in blocks:
        start, end = m._gate_up_all.data_ptr(), m._gate_up_all.data_ptr() + m._gate_up_all.nbytes
        for w in (m.experts.gate_up_proj, m.shared_experts.gate_proj.weight, m.shared_experts.up_proj.weight):
            assert start <= w.data_ptr() < end
        S = m.shared_experts.down_proj.weight.shape[1]
        assert m.shared_experts.down_proj.weight.data_ptr() == m._down_all[:, -S:].data_ptr()
    plain = Decoder(model, "cpu", batch_size=4, cache_len=32, decode_experts="dense", record_routes=True,
                    fold_shared=False)
    assert not any(hasattr(m, "_gate_up_all") for m in plain.model.modules())
    a = folded.generate(ids, mask, 8, eos_id=-1, pad_id=0, temperature=0)
    b = plain.generate(ids, mask, 8, eos_id=-1, pad_id=0, temperature=0)
    assert torch.equal(a, b)
    assert torch.equal(folded.last_routes(3, a.shape[1]), plain.last_routes(3, b.shape[1]))
    assert folded.last_routes(3, a.shape[1]).any()
    check_decoder_follows_generate(model, folded, ids, mask)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned flag and CUDA event: on a GPU only"))])
@pytest.mark.parametrize("check_every", [1, 3])
def test_a_late_stop_check_samples_the_same_tokens(check_every, device):
    """On CUDA generate reads its all-rows-ended check one decode step late (`stop_late`: the device runs that step
    meanwhile instead of idling). Against reading it at once: the same tokens, log-probs and random stream after
    the call; one more decode step (its output unused) when the rows ended before max_new_tokens, none otherwise.
    On CUDA the step is left uncompiled here (the flag's copy and event are what is checked)."""
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_hf_config(ModelConfig())).eval().to(device)
    dec = Decoder(model, device, batch_size=2, cache_len=40, compile=False)
    assert dec.stop_late == (device == "cuda")
    ids = torch.randint(1, 512, (1, 5), device=device)
    mask = torch.ones(1, 5, dtype=torch.long, device=device)
    rng = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state

    def run(late: bool, eos: int):
        dec.stop_late = late
        torch.manual_seed(1)
        out = dec.generate(ids, mask, 12, eos, 0, temperature=1.0, check_every=check_every)
        return out.cpu(), dec.last_logps.cpu(), dec.decode_steps, rng()

    free = run(False, -1)[0][0, 5:]  # no EOS: 12 sampled tokens
    eos = int(free[3])  # an EOS the row samples at step 3 (or earlier): it ends well before 12
    for eos_id, extra in ((eos, 1), (-1, 0)):
        now, late = run(False, eos_id), run(True, eos_id)
        assert torch.equal(now[0], late[0]) and torch.equal(now[1], late[1]) and torch.equal(now[3], late[3])
        assert late[2] == now[2] + extra, (late[2], now[2])
        assert (now[0].shape[1] - 5 < 12) == (eos_id == eos)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled, CUDA-graphed decode step runs on CUDA only")
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_the_compiled_decoder_on_cuda_matches_generate_and_the_eager_decoder(attention):
    """The path GPU rollouts take: Decoder(compile=True) (the decode step compiled and CUDA-graphed) on an fp32
    3-layer DeepSeek-V3, prompts of three widths with left padding and part-filled batches, before and after a
    refresh with new weights: greedy tokens equal transformers' generate (with an EOS too, stopping where it stops)
    and the eager decoder's, with the same recorded routes; sampled tokens' log-probs equal a plain forward's; a
    tree rollout equals the eager decoder's."""
    if attention == "triton":
        pytest.importorskip("triton")
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig, TreeConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config
    from engine.tree import generate_tree

    torch.manual_seed(0)
    m = ModelConfig(q_lora_rank=48, num_layers=3, first_dense_layers=1)
    model = AutoModelForCausalLM.from_config(make_hf_config(m)).eval().cuda()
    model.generation_config.eos_token_id = None
    fast = Decoder(model, "cuda", batch_size=8, cache_len=64, compile=True, record_routes=True, attention=attention)
    slow = Decoder(model, "cuda", batch_size=8, cache_len=64, compile=False, record_routes=True, attention="torch")
    for refresh in range(2):
        for width, n in ((9, 5), (13, 8), (4, 3)):
            g = torch.Generator().manual_seed(10 * width + refresh)
            ids = torch.randint(3, 512, (n, width), generator=g).cuda()
            mask = torch.ones_like(ids)
            mask[0, : width // 2] = 0
            mask[-1, :1] = 0
            got = fast.generate(ids, mask, 12, -1, 0, temperature=0)
            with torch.no_grad():
                want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
            eager = slow.generate(ids, mask, 12, -1, 0, temperature=0)
            case = (attention, refresh, width)
            assert torch.equal(got, want) and torch.equal(got, eager), case
            assert torch.equal(fast.last_routes(n, got.shape[1]), slow.last_routes(n, eager.shape[1])), case
            eos = int(got[1, width + 2])  # row 1's third token ends it
            got = fast.generate(ids, mask, 12, eos, 0, temperature=0)
            with torch.no_grad():
                want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                      eos_token_id=eos)
            assert got.shape == want.shape and torch.equal(got, want), case
            torch.manual_seed(7)
            sampled = fast.generate(ids, mask, 12, eos, 0, temperature=0.7)
            resp = sampled[:, width:]
            ended = (resp == eos).long()
            live = (ended.cumsum(1) - ended) == 0  # up to and including the EOS
            full = torch.cat([mask, live.long()], 1)
            with torch.no_grad():
                logits = model(sampled, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits
            ref = (logits.float()[:, width - 1:-1] / 0.7).log_softmax(-1).gather(-1, resp[..., None])[..., 0]
            assert ((fast.last_logps - ref).abs() * live).max().item() < 1e-4, case
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        fast.refresh(model)
        slow.refresh(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 512, (2, 7), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    tree = TreeConfig(enabled=True, trees=1, branch_points=1, branches=1, iterations=1)
    leaves = tree.leaves()
    outs = [generate_tree(Decoder(model, "cuda", batch_size=2 * leaves, cache_len=7 + 16, compile=c,
                                  attention=attention if c else "torch"), ids, mask, tree, 8, eos_id=-1, pad_id=0,
                          temperature=0)[0] for c in (True, False)]
    assert torch.equal(*outs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-result GEMM is the CUDA path")
@pytest.mark.parametrize("compile", [False, True])
def test_the_decoders_logits_on_cuda_are_the_trainers_fp32_product_not_bf16_logits(compile):
    """With logits="fp32", on CUDA a bf16 model's rollout logits come from the output layer's GEMM with an fp32
    result, as the trainer's log-probs (engine/head.py), not from bf16 logits upcast (a logit near 30 would move by up
    to 1/16): the prefill (eager) and a decode step (compiled and CUDA-graphed with compile) alike, close to fp32
    logits of the same hidden states."""
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.decoder import Decoder
    from engine.model import make_hf_config

    torch.manual_seed(0)
    m = ModelConfig(q_lora_rank=48, num_layers=3, first_dense_layers=1)
    model = AutoModelForCausalLM.from_config(make_hf_config(m), dtype=torch.bfloat16).eval().cuda()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # logits of a few units, where bf16's step is 1/64 or more
    dec = Decoder(model, "cuda", batch_size=4, cache_len=32, compile=compile, logits="fp32")
    ids = torch.randint(3, 512, (4, 9), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    with torch.no_grad():  # as generate and the tree calls run it
        first, pos = dec._prefill(ids, mask, response_visible=True)
        first = first.clone()
        tok = first.argmax(-1)
        second = dec._step(tok, pos, torch.ones(4, dtype=torch.bool, device="cuda")).clone()
        seq = torch.cat([ids, tok[:, None]], 1)
        hidden = model.model(seq).last_hidden_state.float()
        want = hidden @ model.lm_head.weight.float().t()  # (4, 10, V): fp32 logits of transformers' hidden states
    for got, ref in ((first, want[:, -2]), (second, want[:, -1])):
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert (got != got.bfloat16().float()).float().mean() > 0.5  # not bf16 values upcast
        assert ref.abs().max() > 2 and (got - ref).abs().max() < 0.05 * ref.abs().max(), (got - ref).abs().max()

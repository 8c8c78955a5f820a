"""Unit checks of engine/head.py and engine/fp8.py that tests/test_head.py and tests/test_fp8.py leave open, each in
this process and fast: the chunk size rule and an empty batch; bf16 inputs (fp32 logits and an fp32 weight-gradient
accumulator, as the training run has them); a non-default ignore_index; a biased output layer; the mean loss of a
batch whose labels are all ignored; install / uninstall run twice; the train.fp8 refusals of configs that can run, of
the use_grouped_mm and pipeline cases, a missing torchao prototype and a GPU without FP8 (its capability
monkeypatched, so no CUDA is needed); which linears and experts convert (ZeRO-3's full shapes, the token-group
alignment, the GEMM chosen per device); and the emulated FP8 rounding's exact values and output dtype."""
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from test_grpo_units import tiny_model

V, H = 1000, 24


@pytest.fixture
def small_chunks(monkeypatch):
    """3 tokens per chunk at V 1000 (as tests/test_head.py)."""
    import engine.head

    monkeypatch.setattr(engine.head, "CHUNK_ELEMENTS", 3500)


def leaves(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    t = torch.randint(0, V, (n,), generator=g)
    return h, w, t


def rel64(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- engine/head.py


def test_chunk_tokens_takes_the_fewest_chunks_of_the_most_even_size(small_chunks):
    """At most CHUNK_ELEMENTS // V (3) tokens a chunk, as few chunks as that allows, and of those the most even
    split (37 tokens: 13 chunks of 3, not 19 of 2); a total within one chunk is that chunk, none is 1.
    [fails if: the chunk size is rounded down (more chunks than needed), or 0 tokens give a chunk size of 0]"""
    from engine.head import chunk_tokens

    assert chunk_tokens(V) == 3
    assert [chunk_tokens(V, n) for n in (0, 1, 2, 3)] == [1, 1, 2, 3]
    for n in range(4, 60):
        step = chunk_tokens(V, n)
        fewest = -(-n // 3)
        assert step <= 3 and -(-n // step) == fewest, (n, step)
        assert -(-n // (step - 1)) > fewest, (n, step)  # one token less a chunk would take more chunks


def test_an_empty_batch_has_a_zero_loss_and_no_logprobs(small_chunks):
    """No tokens (a micro-batch of one-token sequences: no next token to predict): the loss sum is 0 with zero
    gradients, and the log-probs are empty. [fails if: chunk_tokens gives 0 for 0 tokens (range step 0)]"""
    from engine.head import cross_entropy, token_logprobs

    h, w, t = leaves(0)
    loss = cross_entropy(h, w, t)
    assert loss.item() == 0.0
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert gh.shape == (0, H) and not gw.any()
    logp, ent = token_logprobs(h, w, t, 0.7, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)


def test_bf16_inputs_give_the_loss_and_logprobs_of_the_fp32_product(monkeypatch):
    """A bf16 model (the DS configs' precision): each chunk's logits are the product as fp32 before the softmax (as
    transformers' loss upcasts its logits), so the loss, the log-probs and the hidden states' gradient are those of
    F.cross_entropy / log_softmax on F.linear(h, w).float(), not of bf16 logits.
    [fails if: _mm32 leaves the CPU product in bf16, or the logits' gradient stays fp32 against a bf16 weight]"""
    import engine.head
    from engine.head import cross_entropy, token_logprobs

    monkeypatch.setattr(engine.head, "CHUNK_ELEMENTS", V)  # one token a chunk
    h, w, t = leaves(64, torch.bfloat16)
    logits = F.linear(h, w).float()
    want = F.cross_entropy(logits, t, reduction="sum")
    got = cross_entropy(h, w, t)
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 2e-6 * want.item(), (got.item(), want.item())
    torch.testing.assert_close(torch.autograd.grad(got, h)[0].float(), torch.autograd.grad(want, h)[0].float(),
                               atol=0, rtol=0)
    logp, _ = token_logprobs(h, w, t, 0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, t[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)


def test_bf16_weight_gradient_is_accumulated_over_chunks_in_fp32(monkeypatch):
    """Over 256 chunks of one token the output weight's gradient (loss and log-probs alike) is summed in an fp32
    buffer and rounded to bf16 once: its distance from the fp64 gradient stays that of autograd's own bf16 gradient
    (a bf16 running sum is ~5x / ~3x farther). [fails if: the weight-gradient accumulator is in the weight's dtype]"""
    import engine.head
    from engine.head import cross_entropy, token_logprobs

    monkeypatch.setattr(engine.head, "CHUNK_ELEMENTS", V)
    h, w, t = leaves(256, torch.bfloat16)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    up = torch.randn(256, generator=torch.Generator().manual_seed(9))
    logp64 = torch.log_softmax(F.linear(h64, w64), -1).gather(-1, t[:, None]).squeeze(-1)
    logp_bf = torch.log_softmax(F.linear(h, w).float(), -1).gather(-1, t[:, None]).squeeze(-1)
    cases = (
        (cross_entropy(h, w, t), F.cross_entropy(F.linear(h, w).float(), t, reduction="sum"),
         F.cross_entropy(F.linear(h64, w64), t, reduction="sum")),
        ((token_logprobs(h, w, t)[0] * up).sum(), (logp_bf * up).sum(), (logp64 * up.double()).sum()),
    )
    for ours, autograd_bf16, exact in cases:
        gw, = torch.autograd.grad(ours, w)
        ref_bf16, = torch.autograd.grad(autograd_bf16, w)
        ref, = torch.autograd.grad(exact, w64)
        assert gw.dtype == torch.bfloat16
        assert rel64(gw, ref) < 1.6 * rel64(ref_bf16, ref), (rel64(gw, ref), rel64(ref_bf16, ref))


@pytest.mark.parametrize("grad", [True, False])
def test_cross_entropy_honours_another_ignore_index(grad, small_chunks):
    """ignore_index other than -100 (a pad token id, 7): those targets count neither in the loss nor the
    gradients, with and without autograd. [fails if: ignore_index is not passed on, or rows are ignored by t < 0]"""
    from engine.head import cross_entropy

    h, w, t = leaves(37, seed=2)
    t[[0, 4, 36]] = 7
    want = F.cross_entropy(F.linear(h, w), t, ignore_index=7, reduction="sum")
    with torch.set_grad_enabled(grad):
        got = cross_entropy(h, w, t, ignore_index=7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    if grad:
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_a_biased_output_layer_keeps_its_bias_in_logits_and_refuses_targets():
    """head_forward on an nn.Linear with a bias: without targets the logits are nn.Linear's (bias added, as for
    generation); with targets it raises rather than drop the bias from the loss.
    [fails if: the plain logits leave out the bias, or a biased layer's loss is computed without it]"""
    from engine.head import head_forward

    torch.manual_seed(0)
    lin = torch.nn.Linear(H, 64)
    lin.forward = head_forward.__get__(lin)
    x = torch.randn(5, H)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=0, rtol=0)
    with pytest.raises(ValueError, match="the chunked output layer has no bias term"):
        lin(x, targets=torch.zeros(5, dtype=torch.long))


def test_a_batch_whose_labels_are_all_ignored_has_loss_zero():
    """model(ids, labels=...) divides the loss sum by the labelled tokens, at least 1: labels all -100 (a padded
    micro-batch) give 0 and zero gradients, not 0/0. [fails if: the denominator is not clamped to 1]"""
    from engine.head import install

    model = install(tiny_model())
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert all(not p.grad.any() for p in model.parameters() if p.grad is not None)


def test_install_twice_and_reinstall_after_uninstall():
    """install on an installed model changes nothing (the plain forward stays transformers', no recursion); after
    uninstall the model gives full logits again, and install after that routes it through the chunked layer again.
    [fails if: install does not check for an earlier install, or uninstall leaves _plain_forward set]"""
    from engine.head import install, uninstall

    model = tiny_model()
    plain = model.forward
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(1))
    install(install(model))
    assert model._plain_forward == plain
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (2, 6, 512)
        assert model(input_ids=ids, labels=ids).logits is None
        uninstall(model)
        assert model(input_ids=ids, labels=ids).logits.shape == (2, 6, 512)
        install(model)
        assert model(input_ids=ids, labels=ids).logits is None


# ---------------------------------------------------------------- engine/fp8.py


def ds(name):
    from engine.ds_config import read_ds_config

    return read_ds_config(ROOT / "ds_configs" / name)


def test_fp8_problems_pass_the_configs_that_can_run():
    """train.fp8 off is never refused (pipe.json included); all and dense pass zero2.json / zero3.json as written
    (no comm_backend, no use_grouped_mm: AutoEP's defaults, the comm backend and the grouped GEMM).
    [fails if: fp8 off is checked, a missing comm_backend or use_grouped_mm counts as refused]"""
    from engine.fp8 import fp8_problems

    assert fp8_problems(False, ds("pipe.json"), "cpu") == []
    for name in ("zero2.json", "zero3.json"):
        for mode in ("dense", "all"):
            assert fp8_problems(mode, ds(name), "cpu") == [], (name, mode)


def test_fp8_problems_refuse_use_grouped_mm_false_and_list_every_problem():
    """use_grouped_mm false under fp8 all is refused in one line; fp8 all with a pipeline section and no
    expert_parallel gets both problems. [fails if: use_grouped_mm is not checked, or the pipeline check is skipped
    once an expert_parallel problem is found]"""
    from engine.fp8 import fp8_problems

    raw = ds("zero3.json")
    raw["expert_parallel"]["use_grouped_mm"] = False
    p = fp8_problems("all", raw, "cpu")
    assert len(p) == 1 and p[0].startswith("train.fp8: all needs AutoEP's grouped GEMM"), p
    assert fp8_problems("dense", raw, "cpu") == []
    pipe = ds("pipe.json")
    pipe.pop("expert_parallel", None)
    p = fp8_problems("all", pipe, "cpu")
    assert len(p) == 2 and "no enabled expert_parallel section" in p[0] and "pipeline section" in p[1], p


def test_fp8_problems_need_the_torchao_prototype_for_all_only(monkeypatch):
    """Without torchao.prototype.moe_training (the grouped GEMM) fp8 all is refused with the install line; dense
    needs only torchao.float8. [fails if: dense also requires the prototype module]"""
    from engine.fp8 import fp8_problems

    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training", None)  # import raises ImportError
    assert fp8_problems("all", ds("zero3.json"), "cpu") == ['train.fp8: needs torchao, which is not installed: '
                                                            'pip install -e ".[fp8]"']
    assert fp8_problems("dense", ds("zero3.json"), "cpu") == []


def test_fp8_problems_check_this_ranks_gpu_capability(monkeypatch):
    """On CUDA the local rank's GPU needs compute capability 8.9+: 8.9 and 9.0 pass, 8.6 is refused naming it; the
    capability asked is LOCAL_RANK's device (torch.cuda monkeypatched: no GPU needed).
    [fails if: 8.9 is refused (<= for <), or device 0 is asked instead of LOCAL_RANK's]"""
    from engine.fp8 import fp8_problems

    asked = []
    cap = [(8, 9)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or cap[0])
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert fp8_problems("dense", ds("zero3.json"), "cuda") == [] and asked == [3]
    cap[0] = (9, 0)
    assert fp8_problems("dense", ds("zero3.json"), "cuda") == []
    cap[0] = (8, 6)
    p = fp8_problems("dense", ds("zero3.json"), "cuda")
    assert len(p) == 1 and p[0].startswith("train.fp8: this GPU (compute capability 8.6) has no FP8 tensor cores"), p


def test_can_run_fp8_needs_cuda_with_capability_8_9(monkeypatch):
    """Real FP8 GEMMs on CUDA at 8.9 (Ada) and up; emulated below, and on any other device whatever CUDA reports.
    [fails if: 8.9 is excluded (> for >=), or a device other than cpu (xpu) asks torch.cuda]"""
    from engine.fp8 import can_run_fp8

    cap = [(8, 9)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap[0])
    assert can_run_fp8("cuda") and not can_run_fp8("cpu") and not can_run_fp8("xpu")
    cap[0] = (8, 6)
    assert not can_run_fp8("cuda")


class LinearSubclass(torch.nn.Linear):
    pass


def test_convertible_excludes_routers_gates_subclasses_and_odd_dimensions():
    """Only plain nn.Linear with both dimensions multiples of 16, and not a router, gate or the output layer.
    [fails if: `router` is dropped from the names, one dimension suffices, or Linear subclasses are converted]"""
    from engine.fp8 import convertible

    lin = torch.nn.Linear
    assert convertible("model.layers.0.self_attn.q_proj", lin(32, 48))
    for name, mod in (("model.layers.1.mlp.router", lin(32, 32)), ("model.layers.1.mlp.gate", lin(32, 32)),
                      ("lm_head", lin(32, 64)), ("model.layers.0.self_attn.q_proj", lin(24, 32)),
                      ("model.layers.0.self_attn.q_proj", lin(32, 24)),
                      ("model.layers.0.mlp.up_proj", LinearSubclass(32, 32))):
        assert not convertible(name, mod), (name, mod)


def test_convert_swaps_exactly_the_convertible_linears_and_emulates_off_fp8_hardware(monkeypatch):
    """The Float8Linear modules after convert are exactly the names it returns (not a gate or an odd-sized linear
    torchao would take too), emulated where no FP8 GEMMs run (CPU) and not where they do.
    [fails if: torchao's filter converts more than `convertible` allows, or emulate ignores the device]"""
    import engine.fp8
    from engine.fp8 import convert

    def model():
        return torch.nn.ModuleDict({"q_proj": torch.nn.Linear(32, 32), "gate": torch.nn.Linear(32, 32),
                                    "odd": torch.nn.Linear(24, 32), "lm_head": torch.nn.Linear(32, 64)})

    m = model()
    assert convert(m, "dense", "cpu") == ["q_proj"]
    assert {n for n, mod in m.named_modules() if type(mod).__name__ == "Float8Linear"} == {"q_proj"}
    assert m["q_proj"].config.emulate is True
    monkeypatch.setattr(engine.fp8, "can_run_fp8", lambda device: True)
    m = model()
    convert(m, "dense", "cuda")
    assert m["q_proj"].config.emulate is False


def test_convert_experts_uses_zero3_full_shapes_keeps_a_larger_alignment_and_picks_the_gemm(monkeypatch):
    """Experts convert only with dim and ffn multiples of 16, read from ZeRO-3's ds_shape where the local weight is
    a partition; an alignment above 16 is kept; the grouped GEMM is torchao's where FP8 GEMMs run (capability
    monkeypatched), the emulation elsewhere. [fails if: ffn is not checked, ds_shape is ignored, the alignment is set
    to 16 rather than raised to it, or the emulation is always chosen]"""
    from deepspeed.moe import ep_kernels
    from deepspeed.moe.ep_experts import GroupedExperts

    from engine.fp8 import convert_experts, emulated_grouped_mm, fp8_grouped_mm

    monkeypatch.setattr(ep_kernels, "TOKEN_GROUP_ALIGN_SIZE_M", 32)
    parted = GroupedExperts(32, 48, 5)
    parted.w2 = torch.nn.Parameter(torch.empty(0))  # ZeRO-3: this rank's partition
    parted.w2.ds_shape = torch.Size([5, 32, 48])
    parted_odd = GroupedExperts(32, 48, 5)
    parted_odd.w2.ds_shape = torch.Size([5, 32, 40])
    model = torch.nn.ModuleDict({"ok": GroupedExperts(32, 48, 5), "odd_ffn": GroupedExperts(32, 24, 5),
                                 "parted": parted, "parted_odd": parted_odd})
    assert convert_experts(model, "cpu") == ["ok", "parted"]
    assert ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M == 32
    assert model["ok"]._fp8_grouped_mm is emulated_grouped_mm
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    gpu = torch.nn.ModuleDict({"ok": GroupedExperts(32, 48, 5)})
    assert convert_experts(gpu, "cuda") == ["ok"]
    assert gpu["ok"]._fp8_grouped_mm is fp8_grouped_mm


def test_fp8_round_has_power_of_2_scales_per_slice():
    """x through e4m3 with scale 448 / amax rounded down to a power of 2 per slice: amax 2.2 gets 128, so 2.2 ->
    288 / 128, -0.3 -> -40 / 128, 0.01 -> 1.25 / 128; each row (dim -1) or column (dim 0) its own scale; and scaling
    x by 2^-20 (a gradient's size) scales the result exactly. [fails if: the scale is 448 / amax unrounded, or amax
    is floored far above 1e-12]"""
    from engine.fp8 import _fp8_round

    x = torch.tensor([[2.2, 1.0, -0.3, 0.01], [0.022, 0.01, -0.003, 0.0001]])
    want = torch.tensor([[288 / 128, 1.0, -40 / 128, 1.25 / 128]])
    rows = _fp8_round(x, -1)
    assert torch.equal(rows[0], want[0])
    assert torch.equal(rows[1], torch.tensor([352, 160, -48, 1.625]) / 2**14)  # amax 0.022: its own scale 2^14
    cols = _fp8_round(x, 0)
    assert cols[1, 0].item() == 2.75 / 128  # column 0's amax 2.2
    assert torch.equal(cols, _fp8_round(x.t().contiguous(), -1).t())
    for dim in (-1, 0):
        assert torch.equal(_fp8_round(x * 2.0**-20, dim), _fp8_round(x, dim) * 2.0**-20)


def test_emulated_grouped_mm_returns_out_dtype():
    """The emulated FP8 grouped GEMM returns out_dtype (bf16 here, as torchao's kernel): its fp32 result rounded
    once, and bf16 gradients. [fails if: out_dtype is ignored in the forward]"""
    from engine.fp8 import emulated_grouped_mm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 32, generator=g).bfloat16().requires_grad_()
    b_t = torch.randn(3, 16, 32, generator=g).bfloat16().transpose(-2, -1).detach().requires_grad_()
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)
    out = emulated_grouped_mm(a, b_t, offs, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, emulated_grouped_mm(a.float(), b_t.float(), offs, torch.float32).bfloat16())
    out.float().sum().backward()
    assert a.grad.dtype == b_t.grad.dtype == torch.bfloat16


def test_fp8_problems_refuse_all_with_an_expert_parallel_section_that_is_off():
    """fp8 all needs AutoEP's grouped GEMM: an expert_parallel section written with enabled false is as good as
    none (refused naming it); dense does not need it. [fails if: only a missing section is refused]"""
    from engine.fp8 import fp8_problems

    raw = ds("zero3.json")
    raw["expert_parallel"]["enabled"] = False
    p = fp8_problems("all", raw, "cpu")
    assert len(p) == 1 and "no enabled expert_parallel section" in p[0], p
    assert fp8_problems("dense", raw, "cpu") == []


def test_emulated_grouped_mm_by_hand_with_a_one_row_group():
    """Two experts, offs [1, 3]: expert 0 gets one row. The values are e4m3 ones (exact under any power-of-2
    scale), so forward and gradients are the exact grouped GEMM, but for two 1.06s (a[0, 0] and g[0, 0]): each is
    its row's amax, scale 2^floor(log2(448 / 1.06)) = 256, 271.36 -> e4m3 256, so it counts as 1.0, in the forward
    and grad_a, and alone in its column of expert 0's one row it rounds the same way in the weight gradient. By
    hand: out rows [0.75, 2.5], [-1.625, 1.25], [1.5, 1.875]; grad_a [2, 0], [-2, -0.5], [-0.375, 1];
    grad_b_t[0] = outer([1, -0.5], [1, 0.5]), grad_b_t[1] = a[1:]^T @ g[1:].
    [fails if: the forward's input or grad_a's output gradient is not rounded to FP8, or a one-row group gets no
    weight gradient]"""
    from engine.fp8 import emulated_grouped_mm

    a = torch.tensor([[1.06, -0.5], [2.0, 0.25], [0.75, 1.5]], requires_grad=True)
    b_t = torch.tensor([[[1.0, 2.0], [0.5, -1.0]], [[-1.0, 0.5], [1.5, 1.0]]], requires_grad=True)  # (E, K, N)
    offs = torch.tensor([1, 3], dtype=torch.int32)
    g = torch.tensor([[1.06, 0.5], [1.0, -2.0], [0.5, 0.25]])
    out = emulated_grouped_mm(a, b_t, offs, torch.float32)
    assert out.tolist() == [[0.75, 2.5], [-1.625, 1.25], [1.5, 1.875]]
    out.backward(g)
    assert a.grad.tolist() == [[2.0, 0.0], [-2.0, -0.5], [-0.375, 1.0]]
    assert b_t.grad[0].tolist() == [[1.0, 0.5], [-0.5, -0.25]]
    assert b_t.grad[1].tolist() == [[2.375, -3.8125], [1.0, -0.125]]

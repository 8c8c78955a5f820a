"""The chunked output layer (engine/head.py) against the plain one: losses, log-probs, entropies and gradients equal
in fp32, with chunks that do not divide the tokens (CHUNK_ELEMENTS made small) and a vocabulary of no round size."""
import pytest
import torch
import torch.nn.functional as F

V, H, N = 1000, 24, 37  # 37 tokens in chunks of 3 (CHUNK_ELEMENTS 3500 // 1000): 12 full chunks and one of 1


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    import engine.head

    monkeypatch.setattr(engine.head, "CHUNK_ELEMENTS", 3500)
    assert engine.head.chunk_tokens(V) == 3 and N % 3


def leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g)).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    return h, w, t


def grads(loss, *xs):
    return torch.autograd.grad(loss, xs)


def test_cross_entropy_equals_the_plain_loss_and_gradients():
    from engine.head import cross_entropy

    h, w, t = leaves()
    t[[0, 5, 36]] = -100  # ignored targets (transformers' label padding) in the first, a middle and the last chunk
    got = cross_entropy(h, w, t)
    want = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    scale = torch.tensor(0.37)  # an upstream gradient other than 1 (DeepSpeed scales by 1/accumulation)
    for a, b in zip(grads(got * scale, h, w), grads(want * scale, h, w)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # a wrong target changes the loss: the comparison can fail
    t2 = t.clone()
    t2[10] = (t2[10] + 1) % V
    assert (cross_entropy(h, w, t2) - want).abs() > 1e-3


def test_cross_entropy_without_autograd_computes_no_gradient(monkeypatch):
    """Under no_grad (an evaluation loss) the loss is the plain one, ignored targets included, and no gradient is
    computed: autograd still reports a Parameter as needing one there, and the gradient pass would allocate a
    (V, H) fp32 buffer (5.5 GB at V 129,280, H 7,168) and run two GEMMs per chunk."""
    import engine.head
    from engine.head import cross_entropy

    h, w, t = leaves(3)
    t[[1, 20]] = -100
    w = torch.nn.Parameter(w.detach())
    want = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum").detach()

    def no_gradient_pass(device):
        raise AssertionError("the gradient pass ran under no_grad")

    monkeypatch.setattr(engine.head, "_loss_and_grad_fn", no_gradient_pass)
    with torch.no_grad():
        got = cross_entropy(h, w, t)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_cross_entropy_into_a_frozen_output_layer_sends_the_trunk_its_gradient():
    """Only the hidden states need a gradient (a frozen output layer): theirs is the plain one, none for the weight;
    and the other way round."""
    from engine.head import cross_entropy

    h, w, t = leaves(4)
    want = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
    frozen = w.detach()
    torch.testing.assert_close(grads(cross_entropy(h, frozen, t), h)[0], grads(want, h)[0], atol=1e-6, rtol=1e-6)
    fixed = h.detach()
    want = F.cross_entropy(F.linear(fixed, w).float(), t, reduction="sum")
    torch.testing.assert_close(grads(cross_entropy(fixed, w, t), w)[0], grads(want, w)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_equal_the_plain_ones(temperature):
    from engine.head import token_logprobs

    h, w, t = leaves(1)
    logp, ent = token_logprobs(h, w, t, temperature, with_entropy=True)
    full = torch.log_softmax(F.linear(h, w).float() / temperature, -1)  # (N, V)
    want = full.gather(-1, t[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=1e-5)
    assert not ent.requires_grad
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(2))  # as the clipped surrogate would send
    for a, b in zip(grads((logp * upstream).sum(), h, w), grads((want * upstream).sum(), h, w)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert token_logprobs(h, w, t, temperature)[1] is None


def test_an_installed_model_gives_transformers_loss_gradients_and_logprobs():
    """A tiny DeepSeek-V3 through engine.head.install: model(ids, labels=ids).loss and its gradients equal
    transformers' own forward (full logits, its causal LM loss); logprob_targets equal log_softmax of its logits."""
    from test_grpo_units import tiny_model

    from engine.head import install

    model = install(tiny_model())
    ids = torch.randint(0, 512, (3, 11))
    labels = ids.clone()
    labels[0, 7:] = -100  # padded labels: the mean is over the others, as transformers' loss
    labels[2, 1] = -100
    for lab in (ids, labels):
        ours = model(input_ids=ids, labels=lab)
        theirs = model._plain_forward(input_ids=ids, labels=lab)
        assert ours.logits is None and theirs.logits.shape == (3, 11, 512)
        torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-6, rtol=1e-6)
        params = [p for p in model.parameters() if p.requires_grad]
        for a, b in zip(grads(ours.loss, *params), grads(theirs.loss, *params)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        out = model(input_ids=ids, logprob_targets=ids[:, 1:], temperature=0.7, with_entropy=True)
        full = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float() / 0.7, -1)
    torch.testing.assert_close(out.logprobs, full.gather(-1, ids[:, 1:, None]).squeeze(-1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.entropy, -(full.exp() * full).sum(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chunk passes run on CUDA only")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compiled_token_logprobs_on_cuda_equal_the_plain_ones(temperature):
    """On CUDA the chunk passes are compiled (dynamic in the token count): two token counts in a row, each against
    the plain log-softmax, log-probs, entropies and both gradients."""
    from engine.head import token_logprobs

    for n in (N, N + 8):
        g = torch.Generator().manual_seed(n)
        h = torch.randn(n, H, generator=g).cuda().requires_grad_()
        w = (0.3 * torch.randn(V, H, generator=g)).cuda().requires_grad_()
        t = torch.randint(0, V, (n,), generator=g).cuda()
        logp, ent = token_logprobs(h, w, t, temperature, with_entropy=True)
        full = torch.log_softmax(F.linear(h, w).float() / temperature, -1)
        want = full.gather(-1, t[:, None]).squeeze(-1)
        torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, -(full.exp() * full).sum(-1).detach(), atol=1e-4, rtol=1e-4)
        upstream = torch.randn(n, generator=g).cuda()
        for a, b in zip(grads((logp * upstream).sum(), h, w), grads((want * upstream).sum(), h, w)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chunk passes run on CUDA only")
def test_compiled_cross_entropy_on_cuda_equals_the_plain_loss():
    """On CUDA the loss's chunk pass is compiled (a fixed token count) and its GEMMs give fp32 results from bf16
    inputs (torch.mm out_dtype): in fp32 the loss and both gradients equal the plain ones; in bf16 the loss is within
    bf16's rounding of the fp32 loss on the same (rounded) inputs."""
    from engine.head import cross_entropy

    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, H, generator=g).cuda().requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g)).cuda().requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).cuda()
    t[[0, 20]] = -100
    got = cross_entropy(h, w, t)
    want = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    for a, b in zip(grads(got, h, w), grads(want, h, w)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    got = cross_entropy(hb, wb, t)
    want = F.cross_entropy(F.linear(hb.float(), wb.float()), t, ignore_index=-100, reduction="sum")
    assert abs(got.item() - want.item()) <= 1e-3 * abs(want.item())

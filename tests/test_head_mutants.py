"""engine/head.py's behaviour that tests/test_head.py and tests/test_head_fp8_units.py let through, one mutant a test
(or a few of one kind): how each pass cuts the tokens into chunks (at most CHUNK_ELEMENTS // V tokens a chunk, split
evenly by chunk_tokens(V, N): the loss, the log-probs' forward and their backward alike); no weight-gradient pass for
a frozen output layer (loss and log-probs) and the log-probs' gradient of the hidden states alone or the weight alone;
the loss's gradients held from forward to backward in the model's dtype (bf16, not fp32); an ignore_index outside the
vocabulary; int16 token ids; the installed model's log-probs of fewer (or more) targets than the input's length - 1,
and without a temperature (1). Every expected value is the plain computation in the test: full logits, log_softmax /
F.cross_entropy, in float64 where it matters, with chunk sizes that do not divide the token count. Nothing here needs
CUDA or a launcher. The docstring's bracket names the mutant."""
import pytest
import torch
import torch.nn.functional as F

V, H = 1000, 24


@pytest.fixture
def chunks_of_5(monkeypatch):
    """At most 5 tokens a chunk at V 1000 (CHUNK_ELEMENTS not a multiple of V): 11 tokens are cut 4, 4, 3 (the even
    split), not 5, 5, 1."""
    import engine.head

    monkeypatch.setattr(engine.head, "CHUNK_ELEMENTS", 5 * V + 3)
    assert engine.head.chunk_tokens(V) == 5 and engine.head.chunk_tokens(V, 11) == 4


@pytest.fixture
def chunks_of_3(monkeypatch):
    """3 tokens a chunk at V 1000, as tests/test_head.py."""
    import engine.head

    monkeypatch.setattr(engine.head, "CHUNK_ELEMENTS", 3500)


def leaves(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g)).requires_grad_()
    t = torch.randint(0, V, (n,), generator=g)
    return h, w, t


def plain_logp(h, w, t, temperature):
    """log p(t) per token from the full (N, V) logits in float64."""
    return torch.log_softmax(F.linear(h.double(), w.double()) / temperature, -1).gather(-1, t[:, None]).squeeze(-1)


def spy(monkeypatch, name):
    """Record the tokens of each call of engine.head.<name>: _mm32(h, w.t()) and _add_mm32(gw, g.t(), h), h (n, H) the
    chunk's hidden states (the chunk loops look the helper up at every call, so the patch sees every chunk)."""
    import engine.head

    real, rows = getattr(engine.head, name), []

    def recording(*args):
        rows.append(args[-2 if name == "_mm32" else -1].shape[0])
        return real(*args)

    monkeypatch.setattr(engine.head, name, recording)
    return rows


# ------------------------------------------------------------------------------------------------- the chunks

def test_cross_entropy_cuts_its_tokens_into_even_chunks_of_at_most_chunk_elements(chunks_of_5, monkeypatch):
    """11 tokens at 5 a chunk: each logits product covers 4, 4, then 3 tokens (chunk_tokens(V, N)), with and
    without autograd, and the loss and both gradients are the plain ones. [kills: the loop's step is
    chunk_tokens(V) without the total (5, 5, 1); chunk_tokens is given the hidden size for the vocabulary (one chunk
    of 11 x 1000 logits, over CHUNK_ELEMENTS)]"""
    from engine.head import cross_entropy

    h, w, t = leaves(11, seed=1)
    t[[3, 10]] = -100
    rows = spy(monkeypatch, "_mm32")
    with torch.no_grad():
        assert cross_entropy(h, w, t).item() == pytest.approx(
            F.cross_entropy(F.linear(h.double(), w.double()), t, reduction="sum").item(), rel=1e-6)
    assert rows == [4, 4, 3]
    rows.clear()
    got = cross_entropy(h, w, t)
    assert rows == [4, 4, 3]
    want = F.cross_entropy(F.linear(h.double(), w.double()), t, reduction="sum")
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for a, b in zip(torch.autograd.grad(got * 0.5, (h, w)), torch.autograd.grad(want * 0.5, (h, w))):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-6, rtol=1e-5)


def test_token_logprobs_cut_forward_and_backward_into_even_chunks_of_at_most_chunk_elements(chunks_of_5,
                                                                                           monkeypatch):
    """The log-probs' forward and their backward (which computes each chunk's logits again) both go through 11
    tokens as 4, 4, 3, and the weight's gradient is accumulated over the same three chunks; log-probs and gradients
    are the plain float64 ones at T 0.7. [kills: the forward's or the backward's step is chunk_tokens(V) without the
    total, all tokens in one chunk (max(N, 1)), or chunk_tokens given the hidden size for the vocabulary]"""
    from engine.head import token_logprobs

    h, w, t = leaves(11, seed=2)
    rows, acc = spy(monkeypatch, "_mm32"), spy(monkeypatch, "_add_mm32")
    logp, _ = token_logprobs(h, w, t, 0.7)
    assert rows == [4, 4, 3]
    rows.clear()
    up = torch.randn(11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    gh, gw = torch.autograd.grad((logp * up.float()).sum(), (h, w))
    assert rows == [4, 4, 3] and acc == [4, 4, 3]
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = plain_logp(h64, w64, t, 0.7)
    torch.testing.assert_close(logp.double(), want.detach(), atol=1e-6, rtol=1e-6)
    for a, b in zip((gh, gw), torch.autograd.grad((want * up).sum(), (h64, w64))):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------ frozen output layer or trunk

def test_token_logprobs_into_a_frozen_output_layer_send_only_the_hidden_states_their_gradient(chunks_of_3,
                                                                                              monkeypatch):
    """A frozen output layer (weight without requires_grad): the backward gives the hidden states the plain
    gradient of sum(g * log p) at T 0.7 and runs no weight-gradient pass (a (V, H) fp32 buffer and one GEMM a
    chunk, 5.5 GB at V 129,280, H 7,168). And the other way round: fixed hidden states, the weight's gradient is
    the plain one. [kills: need_h / need_w swapped in the backward; the weight's accumulator allocated (and
    handed back, which autograd drops) or accumulated whether the weight needs a gradient or not]"""
    from engine.head import token_logprobs

    h, w, t = leaves(37, seed=4)
    up = torch.randn(37, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    frozen = w.detach()
    acc = spy(monkeypatch, "_add_mm32")
    logp, _ = token_logprobs(h, frozen, t, 0.7)
    backward = logp.grad_fn.apply(up.float(), torch.zeros(0))  # the Function's backward as autograd calls it
    assert backward[0].shape == (37, H) and backward[1] is None  # no (V, H) buffer for the frozen weight
    acc.clear()
    gh, = torch.autograd.grad((logp * up.float()).sum(), h)
    assert acc == []  # no weight-gradient pass
    h64 = h.detach().double().requires_grad_()
    want, = torch.autograd.grad((plain_logp(h64, frozen, t, 0.7) * up).sum(), h64)
    torch.testing.assert_close(gh.double(), want, atol=1e-6, rtol=1e-5)

    fixed = h.detach()
    logp, _ = token_logprobs(fixed, w, t, 0.7)
    gw, = torch.autograd.grad((logp * up.float()).sum(), w)
    w64 = w.detach().double().requires_grad_()
    want, = torch.autograd.grad((plain_logp(fixed, w64, t, 0.7) * up).sum(), w64)
    torch.testing.assert_close(gw.double(), want, atol=1e-6, rtol=1e-5)


def test_cross_entropy_into_a_frozen_output_layer_runs_no_weight_gradient_pass(chunks_of_3, monkeypatch):
    """Only the hidden states need a gradient: the forward accumulates no weight gradient (test_head.py checks the
    values, this the work), and the hidden states' gradient is the plain one.
    [kills: the weight's gradient is computed when the hidden states need one (grad_w = grad_w or grad_h)]"""
    from engine.head import cross_entropy

    h, w, t = leaves(37, seed=6)
    acc = spy(monkeypatch, "_add_mm32")
    got = cross_entropy(h, w.detach(), t)
    assert acc == []
    want = F.cross_entropy(F.linear(h.double(), w.detach().double()), t, reduction="sum")
    torch.testing.assert_close(torch.autograd.grad(got, h)[0].double(), torch.autograd.grad(want, h)[0].double(),
                               atol=1e-6, rtol=1e-5)


def test_cross_entropy_holds_its_gradients_in_the_models_dtype_until_the_backward():
    """The loss's gradients are computed in the forward and held until the backward: for a bf16 model in bf16 (the
    weight's fp32 accumulator rounded once, at the end of the forward), not fp32, which would hold twice the
    weight's size (2.75 GB more at V 129,280, H 7,168) through the rest of the forward and the backward.
    [kills: the fp32 weight-gradient accumulator is saved for the backward as it is]"""
    from engine.head import cross_entropy

    h, w, t = leaves(7, seed=11)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    loss = cross_entropy(hb, wb, t)
    assert [x.dtype for x in loss.grad_fn.saved_tensors] == [torch.bfloat16, torch.bfloat16]
    gh, gw = torch.autograd.grad(loss, (hb, wb))
    want = torch.autograd.grad(F.cross_entropy(F.linear(hb, wb).float(), t, reduction="sum"), (hb, wb))
    torch.testing.assert_close(gh, want[0], atol=0, rtol=0)  # as tests/test_head_fp8_units.py: autograd's bits
    assert gw.dtype == torch.bfloat16 and (gw.float() - want[1].float()).abs().max() <= 2e-2 * want[1].abs().max()


# ------------------------------------------------------------------------------------------------- the targets

@pytest.mark.parametrize("grad", [True, False])
def test_cross_entropy_ignores_an_ignore_index_outside_the_vocabulary(grad, chunks_of_3):
    """ignore_index V (a pad id past the output layer's rows, which F.cross_entropy accepts): those targets count
    neither in the loss nor the gradients, in the first, a middle and the last (partial) chunk.
    [kills: ignored targets replaced by t.clamp(min=0) instead of a valid 0 (the gather reads row V)]"""
    from engine.head import cross_entropy

    h, w, t = leaves(37, seed=7)
    t[[0, 17, 36]] = V
    want = F.cross_entropy(F.linear(h.double(), w.double()), t, ignore_index=V, reduction="sum")
    with torch.set_grad_enabled(grad):
        got = cross_entropy(h, w, t, ignore_index=V)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    if grad:
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
            torch.testing.assert_close(a.double(), b.double(), atol=1e-6, rtol=1e-5)


def test_token_logprobs_take_int16_targets(chunks_of_3):
    """Token ids held in a narrow integer dtype (int16 fits a vocabulary under 32,768) give the same log-probs and
    gradient as int64 ones (gather takes only int32 / int64 indices, so the targets are widened first).
    [kills: token_logprobs passes the targets on without .long()]"""
    from engine.head import token_logprobs

    h, w, t = leaves(37, seed=8)
    logp, _ = token_logprobs(h, w, t.to(torch.int16), 1.0)
    torch.testing.assert_close(logp.double(), plain_logp(h, w, t, 1.0).detach(), atol=1e-6, rtol=1e-6)
    want, = torch.autograd.grad(token_logprobs(h, w, t, 1.0)[0].sum(), h)
    torch.testing.assert_close(torch.autograd.grad(logp.sum(), h)[0], want, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ the installed model

def test_an_installed_model_scores_the_first_t_positions_whatever_t_is():
    """logprob_targets (B, T) are the targets of the first T positions: T 6 of an 11-token input (positions 0-5, not
    the last 6 nor the first 10) and T 11 (every position, the last one's target an arbitrary token), against
    log_softmax of the full logits' first T positions at T 0.7.
    [kills: the hidden states are cut as [:, :-1] (the next-token case) instead of [:, :T]]"""
    from test_grpo_units import tiny_model

    from engine.head import install

    model = install(tiny_model())
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 512, (3, 11), generator=g)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits.double() / 0.7, -1)  # (3, 11, 512)
        for targets in (ids[:, 1:7], torch.randint(0, 512, (3, 11), generator=g)):
            T = targets.shape[1]
            out = model(input_ids=ids, logprob_targets=targets, temperature=0.7, with_entropy=True)
            want = full[:, :T].gather(-1, targets[..., None]).squeeze(-1)
            assert out.logprobs.shape == out.entropy.shape == (3, T)
            torch.testing.assert_close(out.logprobs.double(), want, atol=1e-5, rtol=1e-6)
            torch.testing.assert_close(out.entropy.double(), -(full[:, :T].exp() * full[:, :T]).sum(-1),
                                       atol=1e-5, rtol=1e-5)


def test_an_installed_model_without_a_temperature_gives_the_logprobs_at_temperature_1():
    """model(ids, logprob_targets=...) without temperature: the log-probs under softmax(logits) (temperature 1, the
    documented default), not the loss path (temperature None reaches head_forward as 'no log-probs').
    [kills: causal_lm_forward's temperature defaults to None]"""
    from test_grpo_units import tiny_model

    from engine.head import install

    model = install(tiny_model())
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        out = model(input_ids=ids, logprob_targets=ids[:, 1:])
        full = torch.log_softmax(model(input_ids=ids).logits[:, :-1].double(), -1)
    assert out.entropy is None
    torch.testing.assert_close(out.logprobs.double(), full.gather(-1, ids[:, 1:, None]).squeeze(-1),
                               atol=1e-5, rtol=1e-6)

"""The output layer without (tokens x vocabulary) logits.

A real vocabulary makes the logits the largest activation of a step: 16 x 2048 tokens x 129,280 values are 8.5 GB in
bf16 and twice that in fp32 for the loss. Both uses of the output layer go through the vocabulary a chunk of tokens
at a time instead, each chunk's logits (at most CHUNK_ELEMENTS values, fp32) freed before the next:

  cross_entropy(hidden, weight, targets)    pretraining's loss: the sum over tokens of -log p(target). The gradients
                                            of hidden and weight are computed in the same pass (the chunk's softmax
                                            minus one-hot is its logits' gradient) and handed to autograd in
                                            backward, so nothing is recomputed: the same three GEMMs as the plain
                                            path.
  token_logprobs(hidden, weight, targets, T) GRPO's per-token log p(target) under softmax(logits / T) (and the
                                            entropy, no gradient). The loss around them is not known yet, so
                                            backward computes each chunk's logits again (one more GEMM).

`install(model)` routes a Hugging Face causal LM through them: `model(input_ids, labels=...)` returns the mean loss
(transformers' causal LM loss, shifted inside), `model(input_ids, logprob_targets=..., temperature=T)` the
log-probs of each target; without either the model runs as transformers wrote it (logits, generation). The
output layer is called as a module (`lm_head(hidden, targets=...)`), so ZeRO-3 gathers its weight as for any call.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

CHUNK_ELEMENTS = 2**28  # logits per chunk: 1 GiB in fp32; 2,076 tokens at a vocabulary of 129,280


def chunk_tokens(vocab: int, tokens: int | None = None) -> int:
    """Tokens per chunk: at most CHUNK_ELEMENTS logits, and (given the total) chunks of equal size, so that a
    compiled kernel sees at most two shapes."""
    most = max(1, CHUNK_ELEMENTS // vocab)
    if tokens is None or tokens <= most:
        return most if tokens is None else max(tokens, 1)
    return -(-tokens // -(-tokens // most))


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32: on CUDA one bf16/fp16 GEMM with an fp32 result (no rounding to the inputs' dtype and no
    separate upcast pass); elsewhere the product upcast."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _add_mm32(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c + a @ b into the fp32 accumulator c (returned; CUDA: the GEMM adds in fp32)."""
    if a.dtype == torch.float32:
        return c.addmm_(a, b)
    if a.is_cuda:
        return torch.addmm(c, a, b, out_dtype=torch.float32)
    return c.add_(a @ b)


def _loss_and_grad(logits: torch.Tensor, t: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype):
    """A chunk's cross-entropy sum and its logits' gradient (softmax - one_hot, zero on ignored rows) in `dtype`:
    logits (n, V) fp32, t / valid (n,). On CUDA compiled into two passes over the logits (logsumexp, then the
    gradient); eager elsewhere."""
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    loss = torch.where(valid, lse - logits.gather(-1, t[:, None]).squeeze(-1), 0.0).sum()
    hit = torch.arange(logits.shape[1], device=logits.device)[None, :] == t[:, None]  # (n, V) one-hot
    g = (torch.exp(logits - lse[:, None]) - hit.to(logits.dtype)) * valid[:, None].to(logits.dtype)
    return loss, g.to(dtype)


def _logp_stats(logits: torch.Tensor, t: torch.Tensor, temperature: float, with_entropy: bool):
    """A chunk's (log p(target), logsumexp, entropy or (0,)) under softmax(logits / temperature): logits (n, V) fp32
    (not changed), t (n,). On CUDA compiled into one or two passes over the logits; eager elsewhere."""
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, t[:, None]).squeeze(-1) - lse
    ent = lse - (torch.softmax(logits, -1) * logits).sum(-1) if with_entropy else lse.new_empty(0)
    return logp, lse, ent


def _logp_grad(logits: torch.Tensor, lse: torch.Tensor, t: torch.Tensor, g: torch.Tensor, temperature: float,
               dtype: torch.dtype) -> torch.Tensor:
    """The logits' gradient of sum(g * log p(target)): g * (one_hot - softmax(logits / T)) / T, in `dtype`; logits
    (n, V) fp32 as the forward had them (before / T), lse (n,) from _logp_stats. One pass on CUDA (compiled)."""
    p = torch.exp(logits / temperature - lse[:, None]) if temperature != 1.0 else torch.exp(logits - lse[:, None])
    hit = torch.arange(logits.shape[1], device=logits.device)[None, :] == t[:, None]
    d = (hit.to(logits.dtype) - p) * g[:, None]
    return (d / temperature if temperature != 1.0 else d).to(dtype)


_compiled = {}


def _on(device: torch.device, name: str, fn, dynamic: bool | None):
    """fn compiled once per process on CUDA (the chunk loops call it per chunk); eager elsewhere."""
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=dynamic)
    return _compiled[name]


def _loss_and_grad_fn(device: torch.device):
    return _on(device, "loss_and_grad", _loss_and_grad, dynamic=False)  # pretraining: a fixed number of tokens


def _logp_fns(device: torch.device):
    """GRPO's micro-batches change their token count step to step: traced for any count (dynamic) once the second
    count is seen, instead of once per count."""
    return _on(device, "logp_stats", _logp_stats, None), _on(device, "logp_grad", _logp_grad, None)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, grad_enabled: bool):
        """hidden (N, H), weight (V, H), targets (N,) -> the fp32 sum of -log softmax(hidden @ weight.T)[target] over
        the targets that are not ignore_index. grad_enabled: autograd was on at the call (needs_input_grad says True
        for a Parameter under no_grad too; the gradients are computed here, in the forward)."""
        grad_h, grad_w = (need and grad_enabled for need in ctx.needs_input_grad[:2])
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        gh = torch.empty_like(hidden) if grad_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_w else None
        step = chunk_tokens(weight.shape[0], hidden.shape[0])
        fused = _loss_and_grad_fn(hidden.device) if grad_h or grad_w else None
        wt = weight.t()
        for s in range(0, hidden.shape[0], step):
            h, t = hidden[s:s + step], targets[s:s + step]
            logits = _mm32(h, wt)  # (n, V) fp32
            valid = t != ignore_index
            t = torch.where(valid, t, 0)
            if grad_h or grad_w:  # d(sum)/d(logits) = softmax - one_hot, zero on ignored rows
                loss, g = fused(logits, t, valid, hidden.dtype)  # g (n, V) in the model's dtype, as autograd's
                del logits
                if grad_h:
                    gh[s:s + step] = g @ weight  # (n, H)
                if grad_w:
                    gw = _add_mm32(gw, g.t(), h)  # (V, H), accumulated in fp32
                del g
            else:
                lse = torch.logsumexp(logits, dim=-1)
                loss = torch.where(valid, lse - logits.gather(-1, t[:, None]).squeeze(-1), 0.0).sum()
                del logits
            total += loss
        ctx.save_for_backward(gh, None if gw is None else gw.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw = ctx.saved_tensors
        return (None if gh is None else gh * grad_out.to(gh.dtype),
                None if gw is None else gw * grad_out.to(gw.dtype), None, None, None)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool):
        """hidden (N, H), weight (V, H), targets (N,) -> (log p(target) (N,), entropy (N,) or (0,)), fp32, under
        softmax(hidden @ weight.T / temperature)."""
        N, step = hidden.shape[0], chunk_tokens(weight.shape[0], hidden.shape[0])
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(N if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        stats = _logp_fns(hidden.device)[0]
        for s in range(0, N, step):
            logits = _mm32(hidden[s:s + step], weight.t())  # (n, V) fp32
            lp, ls, en = stats(logits, targets[s:s + step], temperature, with_entropy)
            logp[s:s + step], lse[s:s + step] = lp, ls
            if with_entropy:  # H = lse - sum(p * logits / T)
                ent[s:s + step] = en
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):  # noqa: ARG004  (the entropy has no gradient)
        hidden, weight, targets, lse = ctx.saved_tensors
        T, step = ctx.temperature, chunk_tokens(weight.shape[0], hidden.shape[0])
        need_h, need_w = ctx.needs_input_grad[:2]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad = _logp_fns(hidden.device)[1]
        for s in range(0, hidden.shape[0], step):
            h, t, g = hidden[s:s + step], targets[s:s + step], grad_logp[s:s + step]
            logits = _mm32(h, weight.t())
            d = grad(logits, lse[s:s + step], t, g, T, hidden.dtype)  # (one_hot - softmax) / T times each row's g
            if need_h:
                gh[s:s + step] = d @ weight
            if need_w:
                gw = _add_mm32(gw, d.t(), h)
            del logits, d
        return gh, None if gw is None else gw.to(weight.dtype), None, None, None


def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of hidden @ weight.T against targets; hidden (N, H), targets (N,)."""
    return _CrossEntropy.apply(hidden, weight, targets, ignore_index, torch.is_grad_enabled())


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy or None) per token under softmax(hidden @ weight.T / temperature), fp32, (N,) each."""
    logp, ent = _TokenLogprobs.apply(hidden, weight, targets.long(), float(temperature), with_entropy)
    return logp, ent if with_entropy else None


def head_forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, temperature: float | None = None,
                 with_entropy: bool = False):
    """The output layer's forward: logits as nn.Linear without targets; with them the loss sum (temperature None)
    or (log-probs, entropy) of hidden (N, H) against targets (N,)."""
    if targets is None:
        return F.linear(hidden, self.weight, self.bias)
    if self.bias is not None:
        raise ValueError("the chunked output layer has no bias term; this model's lm_head has one")
    if temperature is None:
        return cross_entropy(hidden, self.weight, targets)
    return token_logprobs(hidden, self.weight, targets, temperature, with_entropy)


@dataclass
class HeadOutput(ModelOutput):
    """What the chunked forward returns. A transformers ModelOutput (a dict as well), so that ZeRO-3 finds the tensors
    in it and hooks them like any model output; as a plain object it warned on every ZeRO-3 run that its backward
    hooks "may not get triggered properly"."""

    loss: torch.Tensor | None = None  # mean cross-entropy (labels)
    logprobs: torch.Tensor | None = None  # (B, T) log p(logprob_targets), fp32
    entropy: torch.Tensor | None = None  # (B, T), fp32, no gradient (with_entropy)
    logits = None  # never materialised


def causal_lm_forward(self, input_ids=None, labels=None, logprob_targets=None, temperature: float = 1.0,
                      with_entropy: bool = False, **kwargs):
    """A causal LM's forward through the chunked output layer when labels (the mean loss of labels[:, 1:] predicted
    from positions [:-1], as transformers' loss) or logprob_targets ((B, T): the target of each of the first T
    positions) are given; transformers' own forward otherwise."""
    if labels is None and logprob_targets is None:
        return self._plain_forward(input_ids=input_ids, **kwargs)
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state  # (B, T, H)
    H = hidden.shape[-1]
    if labels is not None:
        targets = labels[:, 1:].reshape(-1)
        total = self.lm_head(hidden[:, :-1].reshape(-1, H), targets=targets)
        return HeadOutput(loss=total / (targets != -100).sum().clamp(min=1))
    B, T = logprob_targets.shape  # the first T positions' targets (T = the input's length - 1 for next tokens)
    logp, ent = self.lm_head(hidden[:, :T].reshape(-1, H), targets=logprob_targets.reshape(-1),
                             temperature=temperature, with_entropy=with_entropy)
    return HeadOutput(logprobs=logp.view(B, T), entropy=None if ent is None else ent.view(B, T))


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Route `model` (a transformers causal LM with `.model` and `.lm_head`) through the chunked output layer."""
    if getattr(model, "_plain_forward", None) is None:
        model._plain_forward = model.forward
        model.forward = types.MethodType(causal_lm_forward, model)
        model.lm_head.forward = types.MethodType(head_forward, model.lm_head)
    return model


def uninstall(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' own forward and output layer again (full logits): for comparing against the plain path."""
    if getattr(model, "_plain_forward", None) is not None:
        model.forward = model._plain_forward
        del model.lm_head.forward  # the class's nn.Linear.forward
        model._plain_forward = None
    return model

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

CHUNK_ELEMENTS = 2**27  # logits per chunk: 0.5 GiB in fp32; 1,038 tokens at a vocabulary of 129,280


def chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int):
        """hidden (N, H), weight (V, H), targets (N,) -> the fp32 sum of -log softmax(hidden @ weight.T)[target] over
        the targets that are not ignore_index."""
        grad_h, grad_w = ctx.needs_input_grad[:2]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        gh = torch.empty_like(hidden) if grad_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_w else None
        step = chunk_tokens(weight.shape[0])
        for s in range(0, hidden.shape[0], step):
            h, t = hidden[s:s + step], targets[s:s + step]
            logits = F.linear(h, weight).float()  # (n, V), in the model's dtype then fp32, as transformers' loss
            valid = t != ignore_index
            t = torch.where(valid, t, 0)
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            total += torch.where(valid, lse - logits.gather(-1, t[:, None]).squeeze(-1), 0.0).sum()
            if grad_h or grad_w:  # d(sum)/d(logits) = softmax - one_hot, zero on ignored rows; in place of the logits
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(len(t), device=g.device), t] -= 1.0
                g = g.mul_(valid[:, None]).to(hidden.dtype)  # (n, V), as the plain path's linear backward sees it
                if grad_h:
                    gh[s:s + step] = g @ weight  # (n, H)
                if grad_w:
                    gw += g.t() @ h  # (V, H)
            del logits
        ctx.save_for_backward(gh, None if gw is None else gw.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw = ctx.saved_tensors
        return (None if gh is None else gh * grad_out.to(gh.dtype),
                None if gw is None else gw * grad_out.to(gw.dtype), None, None)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, with_entropy: bool):
        """hidden (N, H), weight (V, H), targets (N,) -> (log p(target) (N,), entropy (N,) or (0,)), fp32, under
        softmax(hidden @ weight.T / temperature)."""
        N, step = hidden.shape[0], chunk_tokens(weight.shape[0])
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(N if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, step):
            logits = F.linear(hidden[s:s + step], weight).float()  # (n, V)
            if temperature != 1.0:
                logits /= temperature
            lse[s:s + step] = torch.logsumexp(logits, dim=-1)
            logp[s:s + step] = logits.gather(-1, targets[s:s + step, None]).squeeze(-1) - lse[s:s + step]
            if with_entropy:  # H = lse - sum(p * logits)
                ent[s:s + step] = lse[s:s + step] - (torch.softmax(logits, -1) * logits).sum(-1)
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):  # noqa: ARG004  (the entropy has no gradient)
        hidden, weight, targets, lse = ctx.saved_tensors
        T, step = ctx.temperature, chunk_tokens(weight.shape[0])
        need_h, need_w = ctx.needs_input_grad[:2]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], step):
            h, t, g = hidden[s:s + step], targets[s:s + step], grad_logp[s:s + step]
            logits = F.linear(h, weight).float()
            if T != 1.0:
                logits /= T
            # d logp / d logits = (one_hot - softmax) / T, times the incoming gradient per row; in place of the logits
            d = logits.sub_(lse[s:s + step, None]).exp_().mul_(-g[:, None])
            d[torch.arange(len(t), device=d.device), t] += g
            d = (d / T if T != 1.0 else d).to(hidden.dtype)
            if need_h:
                gh[s:s + step] = d @ weight
            if need_w:
                gw += d.t() @ h
            del logits, d
        return gh, None if gw is None else gw.to(weight.dtype), None, None, None


def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of hidden @ weight.T against targets; hidden (N, H), targets (N,)."""
    return _CrossEntropy.apply(hidden, weight, targets, ignore_index)


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
class HeadOutput:
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

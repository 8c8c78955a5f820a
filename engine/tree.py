"""Tree rollouts for GRPO (`grpo.tree`): TreeRL's entropy-guided tree search (EPTree, arXiv 2506.11902) on the
persistent rollout decoder, with TreeRL's process-level advantages.

Per prompt, `trees` (M) chains are sampled. Then, `iterations` (T) times, each tree picks its `branch_points` (N)
highest-entropy tokens among the tokens its paths generated themselves (never a path's last token, never a token
already branched from; iteration t only in response offsets [(t-1) L, t L) when `segment_len` L is set), and from
each, `branches` (B) new paths resample that token and continue to EOS or max_new_tokens. A new path gets its own
decoder row: the source row's KV cache is forked into it (Decoder.fork_rows), the last prefix token is fed once
more (the fork copies the K/V before it; feeding it gives the logits to resample from) and only the new tokens
are decoded. Every path is a leaf: a prompt has M x (1 + T x N x B) of them, its group, and they are the
sequences the loss trains on (prompt + the path's tokens).

Advantages (TreeRL section 3.3): a tree node is a run of tokens shared by the same set of leaves; its value V is
the mean outcome reward of those leaves. The root is the prompt (all of its leaves, over the M trees). For a token
in node s with parent node p:
    global  GA(s) = V(s) - V(root)        local  LA(s) = V(s) - V(p)
    A(token) = (GA(s) + LA(s)) / sqrt(|leaves(s)|)
The sqrt is TreeRL's reweighting: a node's tokens appear in every one of its |leaves(s)| leaf sequences, so
without it the shared early tokens would weigh |leaves(s)| times in the loss. With grpo.normalize_std the
advantages are also divided by the std of the prompt's leaf rewards (+ 1e-6), as chains' are, so a learning rate
means the same for both; normalize_std: false keeps reward units. A chain that was never branched from gets
2 (r - mean) (/ std): its only node's parent is the root.

The bookkeeping (`pick_branch_points`, `shared_leaves`, `token_advantages`) is pure Python on lists, testable by
hand; `generate_tree` drives the decoder; `tree_rollouts` is what engine/grpo.py calls.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch


def cache_tokens(g) -> int:
    """Cache slots a rollout needs beyond the prompt: max_new_tokens for chains; with grpo.tree, one
    max_new_tokens per decoding phase (the chains, then each iteration), since every decode step of the fixed
    batch writes a new slot shared by all rows."""
    t = g.tree
    return g.max_new_tokens * (1 + t.iterations) if t.enabled else g.max_new_tokens


def group_problems(g, per_rank: int, rollout: str) -> list[str]:
    """Preflight problems of grpo.tree against the DS config's batch and the rollout kind (empty when off)."""
    t = g.tree
    if not t.enabled:
        return []
    p, leaves = [], t.leaves()
    shape = (f"{t.trees} trees x (1 + {t.iterations} iterations x {t.branch_points} branch_points x {t.branches} "
             f"branches) = {leaves} leaves per prompt")
    if leaves > per_rank:
        p.append(f"grpo.tree: {shape} exceed the rollout decoder's batch of {per_rank} sequences per rank "
                 "(train_micro_batch_size_per_gpu x gradient_accumulation_steps of the DS config), which holds a "
                 "prompt's whole tree; raise those, or lower grpo.tree's trees, iterations, branch_points or branches")
    elif per_rank % leaves:
        p.append(f"grpo.tree: {shape} must divide train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                 f"({per_rank}): each rank's batch is whole trees")
    if rollout == "engine":
        p.append("grpo.tree needs grpo.rollout local or auto (tree rollouts fork rows of the local decoder's KV "
                 "cache), not engine")
    return p


# ------------------------------------------------------------------------------------------- bookkeeping

def pick_branch_points(entropy: list[list[float]], starts: list[int], n: int, branched: set,
                       window: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """The n highest-entropy branch points (path, offset) of one tree.

    entropy[i][k]: entropy of the distribution path i's response token k was drawn from (k < len(path i));
    starts[i]: path i's first own token (tokens before it are its source's, counted there). Candidates: own
    tokens, not a path's last one, not in `branched`, inside `window` [lo, hi) when given. Ties: the earlier
    path, then the earlier offset. Fewer than n candidates: all of them."""
    lo, hi = window if window is not None else (0, math.inf)
    cands = [(i, k) for i, (ent, s) in enumerate(zip(entropy, starts))
             for k in range(max(s, lo), min(len(ent) - 1, hi)) if (i, k) not in branched]
    cands.sort(key=lambda c: (-entropy[c[0]][c[1]], c[0], c[1]))
    return cands[:n]


def shared_leaves(parents: list[int], starts: list[int], lengths: list[int]) -> list[list[int]]:
    """For each leaf i and response offset k < lengths[i]: the set (a bitmask over the group's leaves) of leaves that
    share that token, i.e. the leaves below its tree node.

    parents[i]: the leaf that path i branched from (-1: a chain from the prompt); starts[i]: the offset of its
    first own token (it shares its source's tokens before it); a path only branches from its source's own tokens,
    so starts[i] >= starts[parents[i]], and sources come before their branches."""
    G = len(parents)
    children = [[] for _ in range(G)]
    for c, p in enumerate(parents):
        if p >= 0:
            if not (p < c and starts[c] >= starts[p]):
                raise ValueError(f"leaf {c} branches from leaf {p} at offset {starts[c]}: a source must come first and "
                                 "a branch start at or after its source's own tokens")
            children[p].append(c)
    below = [1 << i for i in range(G)]  # each leaf's subtree, itself included
    for c in range(G - 1, -1, -1):
        if parents[c] >= 0:
            below[parents[c]] |= below[c]
    sets = []
    for i in range(G):
        row = []
        for k in range(lengths[i]):
            x = i
            while k < starts[x]:  # the token is inherited: its owner is up the lineage
                x = parents[x]
            s = 1 << x
            for c in children[x]:
                if starts[c] > k:  # branched after this token: shares it
                    s |= below[c]
            row.append(s)
        sets.append(row)
    return sets


def token_advantages(parents: list[int], starts: list[int], lengths: list[int], rewards: list[float],
                     normalize_std: bool = False, eps: float = 1e-6) -> list[list[float]]:
    """Per leaf, per response token: (GA + LA) / sqrt(|leaves below its node|), see the module docstring.
    One group (one prompt's leaves); rewards[i] is leaf i's outcome reward."""
    G = len(rewards)
    root = (1 << G) - 1
    means: dict[int, float] = {}

    def value(s: int) -> float:
        if s not in means:
            members = [rewards[i] for i in range(G) if s >> i & 1]
            means[s] = sum(members) / len(members)
        return means[s]

    scale = 1.0
    if normalize_std:
        mu = sum(rewards) / G
        std = math.sqrt(sum((r - mu) ** 2 for r in rewards) / (G - 1)) if G > 1 else 0.0
        scale = 1.0 / (std + eps)
    out = []
    for row in shared_leaves(parents, starts, lengths):
        adv, node, parent = [], None, root
        for s in row:
            if s != node:  # a new node on this path; the one before it is its parent
                parent, node = (root if node is None else node), s
            size = bin(node).count("1")
            adv.append(((value(node) - value(root)) + (value(node) - value(parent))) / math.sqrt(size) * scale)
        out.append(adv)
    return out


# ------------------------------------------------------------------------------------------- decoding

@dataclass
class Path:
    """One leaf of a tree, on its own decoder row."""
    row: int
    tree: int
    parent: int  # the row it branched from; -1 for a tree's first chain
    start: int  # offset of its first own token
    tokens: list[int]  # its whole response, the inherited prefix included
    entropy: list[float]
    slots: list[int] = field(default_factory=list)  # slots[k + 1]: the cache slot where token k was fed (k = -1: the prompt's last)


@dataclass
class TreeInfo:
    """A tree rollout's structure, row-aligned with its sequences (G consecutive rows per prompt)."""
    group: int  # leaves per prompt
    parents: list[int]  # within the group; -1 for a chain from the prompt
    starts: list[int]
    lengths: list[int]
    branch_points: list[tuple[int, int]]  # (row, offset) branched from, in order
    counts: dict  # the decoder's counters over this rollout
    generated_tokens: int  # tokens sampled (shared prefixes once)
    entropy: list[list[float]]  # per row, per response token: the entropy of the distribution it was drawn from
    routes: object = None  # decoder recording routes: (rows, width + R, L, k) expert ids of each row's tokens


def generate_tree(decoder, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cfg, max_new_tokens: int,
                  eos_id: int, pad_id: int, temperature: float = 1.0, top_p: float = 1.0, pick=pick_branch_points):
    """Tree rollouts of P left-padded prompts on `decoder` (P x leaves <= its batch). Returns (ids (P G, width + R)
    of prompt + response, left-padded prompts and right-padded responses; TreeInfo). `pick`: how a tree's branch
    points are chosen, pick_branch_points's signature (tests pass their own)."""
    P, width = prompt_ids.shape
    G, M = cfg.leaves(), cfg.trees
    if P * G > decoder.batch_size:
        raise ValueError(f"grpo.tree: {P} prompts x {G} leaves do not fit the rollout decoder's batch of "
                         f"{decoder.batch_size}")
    decoder.reset_counts()
    ids = prompt_ids.repeat_interleave(G, dim=0)  # row j*G + i: prompt j's leaf i
    chain_rows = [j * G + m for j in range(P) for m in range(M)]
    decoder.prefill(ids, prompt_mask.repeat_interleave(G, dim=0), rows=chain_rows)
    first_pos = decoder.next_pos.tolist()
    last_prompt_tok = prompt_ids[:, -1].tolist()
    steps, seconds = 0, 0.0

    def decode(rows, limits, feed=None):
        nonlocal steps, seconds
        toks, ents, lens, first = decoder.continue_rows(rows, limits, eos_id, pad_id, temperature, top_p, feed=feed)
        steps, seconds = steps + decoder.decode_steps, seconds + decoder.decode_s
        lens = lens.tolist()
        return [t[:n] for t, n in zip(toks.tolist(), lens)], [e[:n] for e, n in zip(ents.tolist(), lens)], first

    paths: dict[int, Path] = {}
    toks, ents, first = decode(chain_rows, [max_new_tokens] * len(chain_rows))
    for row, t, e in zip(chain_rows, toks, ents):
        paths[row] = Path(row, row % G, -1, 0, t, e, [width - 1] + [first + k for k in range(len(t))])
    free = [j * G + M for j in range(P)]  # the next unused row of each prompt's block
    branched: set[tuple[int, int]] = set()
    points = []
    for it in range(cfg.iterations):
        window = None if cfg.segment_len is None else (it * cfg.segment_len, (it + 1) * cfg.segment_len)
        src, dst, upto, feed_tok, feed_pos, limits, starts = [], [], [], [], [], [], []
        for j in range(P):
            for m in range(M):
                tree = [paths[r] for r in sorted(paths) if r // G == j and paths[r].tree == m]
                picks = pick([p.entropy for p in tree], [p.start for p in tree], cfg.branch_points,
                                           {(i, k) for i, p in enumerate(tree) for k in range(len(p.tokens))
                                            if (p.row, k) in branched}, window)
                picks = [(tree[i].row, k) for i, k in picks]
                # Fewer candidates than branch_points (paths ended early, or none reach the window): the rest start
                # from the prompt, i.e. new chains of this tree (offset 0 of its first path, which shares nothing).
                picks += [(tree[0].row, 0)] * (cfg.branch_points - len(picks))
                for row, k in picks:
                    branched.add((row, k))
                    points.append((row, k))
                    s = paths[row]
                    for _ in range(cfg.branches):
                        d = free[j]
                        free[j] += 1
                        src.append(row), dst.append(d), upto.append(s.slots[k])  # slots before token k-1's
                        feed_tok.append(s.tokens[k - 1] if k > 0 else last_prompt_tok[j])
                        feed_pos.append(first_pos[d] + k - 1)
                        limits.append(max_new_tokens - k)
                        starts.append(k)
                        branched.add((d, k))  # its first token resamples an already branched distribution
        decoder.fork_rows(src, dst, upto)
        toks, ents, first = decode(dst, limits, feed=(feed_tok, feed_pos))
        for s_row, d, k, t, e in zip(src, dst, starts, toks, ents):
            s = paths[s_row]
            paths[d] = Path(d, s.tree, s_row, k, s.tokens[:k] + t, s.entropy[:k] + e,
                            s.slots[:k] + [first] + [first + 1 + n for n in range(len(t))])
    assert sorted(paths) == list(range(P * G)), "every row of the batch is a leaf"
    decoder.decode_steps, decoder.decode_s = steps, seconds
    leaves = [paths[r] for r in range(P * G)]
    R = max(len(p.tokens) for p in leaves)
    resp = torch.full((P * G, R), pad_id, dtype=torch.long)
    for p in leaves:
        resp[p.row, : len(p.tokens)] = torch.tensor(p.tokens, dtype=torch.long)
    info = TreeInfo(G, [p.parent % G if p.parent >= 0 else -1 for p in leaves], [p.start for p in leaves],
                    [len(p.tokens) for p in leaves], points, dict(decoder.counts), decoder.counts["sampled_tokens"],
                    [p.entropy for p in leaves])
    if getattr(decoder, "routes", None) is not None:  # each leaf's tokens' expert ids, from the slots they were fed at
        slots = torch.zeros((P * G, width + R), dtype=torch.long)
        slots[:, :width] = torch.arange(width)
        for p in leaves:  # token k was fed at slots[k + 1] (the last one never is: its slot's ids are unused)
            fed = p.slots[1:len(p.tokens) + 1]
            slots[p.row, width:width + len(fed)] = torch.tensor(fed, dtype=torch.long)
        slots = slots.to(decoder.routes.device)[..., None, None].expand(-1, -1, *decoder.routes.shape[2:])
        info.routes = decoder.routes[:P * G].gather(1, slots)
    return torch.cat([ids, resp.to(ids.device)], dim=1), info


def tree_rollouts(rollout, request, sampling, cfg):
    """engine/grpo.py's entry: tree rollouts of a RolloutRequest on a DecoderRollout's decoder (built and refreshed
    by sync_weights). Returns (RolloutBatch, TreeInfo); sets rollout.decode_steps / decode_s as generate does."""
    from deepspeed.runtime.rollout import RolloutBatch

    from .rollout import response_attention

    if getattr(rollout, "decoder", None) is None:
        raise ValueError("grpo.tree needs the local rollout decoder (grpo.rollout local or auto)")
    tok = rollout.tokenizer
    t0 = time.perf_counter()
    out, info = generate_tree(rollout.decoder, request.prompt_ids, request.prompt_attention_mask, cfg,
                              sampling.max_new_tokens, tok.eos_token_id, tok.pad_token_id, sampling.temperature,
                              sampling.top_p)
    rollout.decode_steps, rollout.decode_s = rollout.decoder.decode_steps, rollout.decoder.decode_s
    rollout.last_routes = info.routes
    info.counts["seconds"] = time.perf_counter() - t0
    width = request.prompt_ids.shape[1]
    attn = response_attention(out, request.prompt_attention_mask.repeat_interleave(info.group, dim=0), width, tok)
    return RolloutBatch(input_ids=out, attention_mask=attn,
                        response_start_idx=torch.full((out.shape[0],), width, device=out.device)), info


def advantages(info: TreeInfo, rewards: torch.Tensor, p_len: int, width: int, normalize_std: bool) -> torch.Tensor:
    """(N,) leaf rewards -> (N, width) per-token advantages aligned with the loss's targets ids[:, 1:] (response
    token k of a row is target p_len - 1 + k); 0 off the response."""
    G, N = info.group, len(info.parents)
    r = rewards.detach().float().cpu().tolist()
    adv = torch.zeros((N, width), dtype=torch.float32)
    for j in range(0, N, G):
        per_leaf = token_advantages(info.parents[j:j + G], info.starts[j:j + G], info.lengths[j:j + G], r[j:j + G],
                                    normalize_std)
        for i, a in enumerate(per_leaf):
            adv[j + i, p_len - 1: p_len - 1 + len(a)] = torch.tensor(a)
    return adv.to(rewards.device)

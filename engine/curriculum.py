"""Curricula: which GRPO prompts a step draws (grpo.curriculum), and the order of pretraining documents
(data.curriculum).

GRPO (PromptCurriculum). Per prompt it keeps attempts, passes (completions whose total reward >= pass_threshold)
and the reward sum. Step s draws the step's global batch of B prompts with a generator seeded by (seed, s):

- unseen_share x B prompts (rounded half up) never tried, uniformly (fewer when fewer are left);
- the rest from the tried prompts, without replacement, with weight 1 when the pass rate estimate
  (passes / attempts) lies in `band` (inclusive) and `outside_weight` when it does not: prompts always or never
  solved lose priority but keep a chance every step, so a prompt the policy has learnt since (or forgotten) is
  found again. When fewer prompts are tried than that, the rest comes from the unseen ones; a batch larger than
  the prompt set is drawn in rounds of at most every prompt once.

The draw is a function of the seed, the step and the statistics, never of the world size: every rank draws the
same global batch and takes its slice (rank r: [r x P, (r+1) x P)), as the plain prompt order does. After the
step the statistics are updated with every rank's rewards (all-gathered in rank order, so every rank holds the
same numbers); on a new draw of a prompt its earlier counts are first multiplied by `decay`. The statistics are
saved in the checkpoint (engine_state.json, exact: JSON keeps a float64 exactly) and restored by --resume, so a
resumed run draws what the uninterrupted one draws.

Pretraining (document_order): the documents sorted by a key (length in tokens, or a score column), ties in a
seeded random order. engine/data.py packs them in that order and reads the first epoch's windows in it; the
windows are then sharded by global position as always, so the ranks stay disjoint and the position stays one
integer (exact resume).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .config import ConfigError, CurriculumConfig, DataCurriculumConfig

_SALT = 0x6375  # keeps the draw's generator apart from the plain prompt order's (seeded by the seed alone)


class PromptCurriculum:
    """Pass-rate statistics of `n_prompts` prompts and the draw of `batch` prompts per step (see the module doc)."""

    def __init__(self, c: CurriculumConfig, n_prompts: int, batch: int, seed: int):
        if n_prompts < 1 or batch < 1:
            raise ValueError(f"a curriculum needs prompts and a batch (got {n_prompts} prompts, batch {batch})")
        self.c, self.n, self.batch, self.seed = c, n_prompts, batch, seed
        self.attempts = np.zeros(n_prompts)  # float64: decayed counts
        self.passes = np.zeros(n_prompts)
        self.reward_sum = np.zeros(n_prompts)

    # ------------------------------------------------------------------------------------------- the draw

    def pass_rate(self) -> np.ndarray:
        """passes / attempts of each prompt; NaN for a prompt never tried."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.attempts > 0, self.passes / self.attempts, np.nan)

    def in_band(self) -> np.ndarray:
        rate, (lo, hi) = self.pass_rate(), self.c.band
        return (self.attempts > 0) & (rate >= lo) & (rate <= hi)

    def draw(self, step: int) -> np.ndarray:
        """The global batch of step `step`: `batch` prompt indices. Changes no state."""
        rng = np.random.default_rng([self.seed, _SALT, step])
        parts, need = [], self.batch
        while need:
            k = min(need, self.n)
            parts.append(self._pick(rng, k))
            need -= k
        return np.concatenate(parts)

    def _pick(self, rng: np.random.Generator, k: int) -> np.ndarray:
        """k distinct prompts (k <= n) by the rule, in a random order (so no rank always gets the unseen ones)."""
        unseen = np.flatnonzero(self.attempts == 0)
        seen = np.flatnonzero(self.attempts > 0)
        n_new = min(len(unseen), math.floor(self.c.unseen_share * k + 0.5))
        n_old = min(len(seen), k - n_new)
        n_new = k - n_old  # too few tried prompts: the rest comes from the unseen ones
        new = rng.choice(unseen, n_new, replace=False) if n_new else np.zeros(0, np.int64)
        old = np.zeros(0, np.int64)
        if n_old:
            w = np.where(self.in_band()[seen], 1.0, self.c.outside_weight)
            old = rng.choice(seen, n_old, replace=False, p=w / w.sum())
        return rng.permutation(np.concatenate([new, old]).astype(np.int64))

    def rank_draw(self, step: int, rank: int, per_rank: int) -> tuple[np.ndarray, dict]:
        """This rank's slice of step `step`'s global draw, and the draw's metrics (the same on every rank)."""
        ids = self.draw(step)
        return ids[rank * per_rank:(rank + 1) * per_rank], self.describe(ids)

    def describe(self, ids: np.ndarray) -> dict[str, float]:
        """Metrics of a draw against the statistics it was drawn from: the shares of the drawn prompts that were
        unseen and in the band, the share of all prompts tried so far, and how many are in the band now."""
        band = self.in_band()
        return {"curriculum_unseen": float(np.mean(self.attempts[ids] == 0)),
                "curriculum_in_band": float(np.mean(band[ids])),
                "curriculum_tried": float(np.mean(self.attempts > 0)),
                "curriculum_band_prompts": int(band.sum())}

    # ------------------------------------------------------------------------------------------- statistics

    def update(self, prompt_ids, rewards) -> None:
        """Add one reward per completion; prompt_ids[i] is completion i's prompt (all ranks', in one order)."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        r = np.asarray(rewards, dtype=np.float64)
        if ids.shape != r.shape:
            raise ValueError(f"{len(ids)} prompt ids for {len(r)} rewards")
        drawn = np.unique(ids)
        for a in (self.attempts, self.passes, self.reward_sum):
            a[drawn] *= self.c.decay
        np.add.at(self.attempts, ids, 1.0)
        np.add.at(self.passes, ids, (r >= self.c.pass_threshold).astype(np.float64))
        np.add.at(self.reward_sum, ids, r)

    def update_from_ranks(self, mine, rewards) -> None:
        """Update from every rank's completions: `mine` is this rank's prompt indices, `rewards` one reward per
        completion, prompt-major (each prompt's completions together, the same count per prompt). All-gathered in
        rank order, so every rank applies the same update."""
        import torch.distributed as dist

        local = local_part(mine, rewards)
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, local)
        else:
            parts = [local]
        self.update(*merge(parts))

    def state_dict(self) -> dict:
        """JSON-ready and exact (a Python float is a float64; JSON writes it so that it reads back the same)."""
        return {"n_prompts": self.n, "attempts": self.attempts.tolist(), "passes": self.passes.tolist(),
                "reward_sum": self.reward_sum.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if state["n_prompts"] != self.n:
            raise ConfigError(resume_mismatch(state["n_prompts"], self.n))
        for k in ("attempts", "passes", "reward_sum"):
            setattr(self, k, np.asarray(state[k], dtype=np.float64).copy())


def local_part(mine, rewards) -> tuple[list[int], list[float]]:
    """One rank's completions as (prompt index, reward) lists: `rewards` (a tensor or array, one per completion,
    prompt-major) against the rank's prompts `mine`."""
    r = rewards.detach().double().cpu().numpy() if hasattr(rewards, "detach") else np.asarray(rewards, np.float64)
    mine = np.asarray(mine, dtype=np.int64)
    if not len(mine) or len(r) % len(mine):
        raise ValueError(f"{len(r)} rewards for {len(mine)} prompts: not the same count per prompt")
    return np.repeat(mine, len(r) // len(mine)).tolist(), r.tolist()


def merge(parts: list) -> tuple[list[int], list[float]]:
    """The ranks' local_part()s, in rank order, as one update."""
    return [i for p in parts for i in p[0]], [x for p in parts for x in p[1]]


def resume_mismatch(saved: int, now: int) -> str:
    return (f"--resume: the checkpoint's grpo.curriculum statistics are for {saved} prompts but data.path has {now}; "
            "resume with the prompts file the run started with")


def for_run(c: CurriculumConfig, n_prompts: int, batch: int, seed: int, saved: dict | None) -> PromptCurriculum | None:
    """The run's curriculum (None when grpo.curriculum is off), with the checkpoint's statistics when resuming
    (a checkpoint saved without the curriculum starts it with empty statistics)."""
    if not c.enabled:
        return None
    cur = PromptCurriculum(c, n_prompts, batch, seed)
    if saved is not None:
        cur.load_state_dict(saved)
    return cur


def resume_problems(run_dir: str, c: CurriculumConfig, n_prompts: int) -> list[str]:
    """Preflight of --resume: the latest checkpoint's curriculum statistics must be for this many prompts."""
    from . import checkpoint

    if not c.enabled:
        return []
    saved = (checkpoint.saved_state(run_dir) or {}).get("curriculum")  # None: check_resume reports what is wrong
    if saved is not None and saved.get("n_prompts") != n_prompts:
        return [resume_mismatch(saved.get("n_prompts"), n_prompts)]
    return []


# ----------------------------------------------------------------------------------------------- pretraining


def document_order(keys, seed: int, reverse: bool = False) -> np.ndarray:
    """Document indices sorted by `keys` (ascending, or descending with reverse), ties in a seeded random order."""
    keys = np.asarray(keys, dtype=np.float64)
    perm = np.random.default_rng([seed, _SALT]).permutation(len(keys))
    k = -keys[perm] if reverse else keys[perm]
    return perm[np.argsort(k, kind="stable")]


def document_keys(c: DataCurriculumConfig, docs, token_ids: list, path: str) -> np.ndarray | None:
    """The sort key of every document: its length in tokens, or its score_column value (each must be a finite
    number: a bad one is a ConfigError naming the row). None when data.curriculum is off."""
    if c.mode == "none":
        return None
    if c.mode == "length":
        return np.fromiter(map(len, token_ids), dtype=np.float64, count=len(token_ids))
    if c.score_column not in docs.column_names:
        raise ConfigError(missing_column(c.score_column, path, docs.column_names))
    scores = docs[c.score_column]
    for i, v in enumerate(scores):
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"data.curriculum.score_column {c.score_column!r}: row {i + 1} of {path} has {v!r:.40}, not "
                              "a finite number; fix that row")
    return np.asarray(scores, dtype=np.float64)


def missing_column(column: str, where: str, columns) -> str:
    return (f"data.curriculum.score_column {column!r} is not a column of {where} (columns: {list(columns)}); name a "
            "numeric column, or set data.curriculum.mode: length")

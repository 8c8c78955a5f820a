"""Rewards: built-ins and user functions, weighted, scored so that one bad sample never stops a batch.

A reward is a function (prompt, completion, answer, **params) -> float. A recipe lists them:

    rewards:
      - {name: numeric, weight: 1.0, tolerance: 1.0e-6}
      - {name: format, weight: 0.2, pattern: "<answer>.*</answer>"}
      - {name: "my_pkg.rewards:brevity", weight: 0.5, label: brevity}

`name` is a built-in (BUILTINS) or "module.path:function" (imported with importlib); `weight` defaults
to 1.0; `label` names the reward in logs (default: name; required to tell two uses of one name apart);
every other key is passed to the function as a keyword argument. All problems are found when the list
is built and reported in one ConfigError line. While scoring, a reward that raises or returns NaN, inf
or a non-number scores 0.0 for that sample, and the failure is counted under the reward's label.
"""
from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .config import ConfigError

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def _numbers(text: str) -> list[float]:
    return [float(m.replace(",", "")) for m in _NUMBER.findall(text)]


def exact_match(prompt: str, completion: str, answer: Any) -> float:
    """1.0 when the completion, stripped, equals the answer, stripped; else 0.0."""
    return float(completion.strip() == str(answer).strip())


def numeric(prompt: str, completion: str, answer: Any, tolerance: float = 1e-6, which: str = "last") -> float:
    """1.0 when the first or last number in the completion (commas allowed: 1,234.5) is within
    `tolerance` (absolute) of the numeric answer; 0.0 when it is not, or the completion has no number.
    A string answer that is not a number is read as the last number in it (e.g. GSM8K's "... #### 42")."""
    found = _numbers(completion)
    if not found:
        return 0.0
    if isinstance(answer, numbers.Real):
        target = float(answer)
    else:
        in_answer = _numbers(str(answer))
        if not in_answer:
            raise ValueError(f"answer {answer!r} has no number in it")
        target = in_answer[-1]
    got = found[0] if which == "first" else found[-1]
    return float(abs(got - target) <= tolerance)


def regex(prompt: str, completion: str, answer: Any, pattern: str, full: bool = False) -> float:
    """1.0 when the pattern is found in the completion (the whole completion with full=True); `.`
    matches newlines too, so "<think>.*</think>" spans lines. Registered as "regex" and "format"."""
    compiled = re.compile(pattern, re.DOTALL)  # re caches compiled patterns
    return float((compiled.fullmatch if full else compiled.search)(completion) is not None)


def length_penalty(prompt: str, completion: str, answer: Any, target: int, scale: float = 1e-3) -> float:
    """-scale x (characters beyond `target`); 0.0 up to `target` characters."""
    return -scale * max(0, len(completion) - target)


BUILTINS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "regex": regex,
    "format": regex,
    "length_penalty": length_penalty,
}
_RESERVED = ("name", "weight", "label")


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    """A number a float holds finitely (an int of 400 digits is none: math.isfinite raises on it)."""
    try:
        return _is_number(x) and math.isfinite(x)
    except OverflowError:
        return False


def _check_builtin(fn: Callable, params: dict, where: str) -> list[str]:
    """Value checks for built-in parameters, so a typo fails at build time, not as a failure count."""
    p = []
    if fn is numeric:
        tol = params.get("tolerance", 0.0)
        if not _is_number(tol) or not tol >= 0:
            p.append(f"{where}.tolerance: must be a number >= 0, got {tol!r}")
        if params.get("which", "last") not in ("first", "last"):
            p.append(f"{where}.which: must be 'first' or 'last', got {params['which']!r}")
    elif fn is regex and "pattern" in params:
        if not isinstance(params.get("full", False), bool):
            p.append(f"{where}.full: must be true or false, got {params['full']!r}")
        if not isinstance(params["pattern"], str):
            p.append(f"{where}.pattern: must be a string, got {params['pattern']!r}")
        else:
            try:
                re.compile(params["pattern"])
            except re.error as e:
                p.append(f"{where}.pattern: not a valid regular expression ({e})")
    elif fn is length_penalty:
        t = params.get("target", 0)
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            p.append(f"{where}.target: must be an integer >= 0 (characters), got {params['target']!r}")
        scale = params.get("scale", 0.0)
        if not _is_number(scale) or not scale >= 0:
            p.append(f"{where}.scale: must be a number >= 0, got {scale!r}")
    return p


def _resolve(name: str, where: str) -> tuple[Callable | None, str | None]:
    """A reward function from its name, or (None, the problem)."""
    if name in BUILTINS:
        return BUILTINS[name], None
    if ":" not in name:
        return None, (f"{where}.name: unknown reward {name!r} (built-ins: {', '.join(sorted(BUILTINS))}; "
                      "or 'module.path:function' for your own)")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time error is the user's module's, reported as such
        return None, f"{where}.name: cannot import module {module_name!r} ({type(e).__name__}: {e}); is it on PYTHONPATH?"
    fn = getattr(module, attr, None)
    if not callable(fn):
        return None, f"{where}.name: module {module_name!r} has no function {attr!r}"
    return fn, None


@dataclass
class Reward:
    label: str
    fn: Callable[..., float]
    weight: float = 1.0
    params: dict = field(default_factory=dict)


@dataclass
class RewardScores:
    per_reward: dict[str, torch.Tensor]
    """label -> (N,) float32 scores (0.0 where the reward failed), for logging each reward's mean/std."""
    total: torch.Tensor
    """(N,) float32: sum of weight x score over rewards; what group_advantages takes."""
    failures: dict[str, int]
    """label -> how many samples that reward failed on (raised, or returned NaN/inf/a non-number)."""
    first_error: dict[str, str]
    """label -> the first failure's message, for rewards with failures."""


class RewardSet:
    def __init__(self, rewards: list[Reward]):
        self.rewards = rewards

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.rewards]

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[Any]) -> RewardScores:
        """Score N (prompt, completion, answer) triples with every reward. Never raises for a reward's
        failure; only for mismatched input lengths (a caller bug)."""
        n = len(completions)
        if len(prompts) != n or len(answers) != n:
            raise ValueError(f"score: got {len(prompts)} prompts, {len(completions)} completions and "
                             f"{len(answers)} answers; expected one of each per sample")
        per_reward, failures, first_error = {}, {}, {}
        total = torch.zeros(n, dtype=torch.float32)
        for r in self.rewards:
            values, failed = [], 0
            for prompt, completion, answer in zip(prompts, completions, answers):
                try:
                    v = r.fn(prompt, completion, answer, **r.params)
                    if not (isinstance(v, numbers.Real) or hasattr(type(v), "__float__")):
                        raise TypeError(f"returned {type(v).__name__} {v!r:.60}, not a number")
                    v = float(v)
                    if not math.isfinite(v):
                        raise ValueError(f"returned {v}")
                except Exception as e:  # a reward must not stop the batch; count it instead
                    failed += 1
                    first_error.setdefault(r.label, f"{type(e).__name__}: {e}")
                    v = 0.0
                values.append(v)
            per_reward[r.label] = torch.tensor(values, dtype=torch.float32)
            failures[r.label] = failed
            total += r.weight * per_reward[r.label]
        return RewardScores(per_reward, total, failures, first_error)


def build_rewards(specs: list[dict], where: str = "rewards") -> RewardSet:
    """A RewardSet from a recipe-style list of dicts; every problem reported in one ConfigError."""
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"{where}: expected a non-empty list like [{{name: numeric, weight: 1.0}}], got {specs!r}")
    problems: list[str] = []
    rewards: list[Reward] = []
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            problems.append(f"{at}: expected a mapping with a 'name' string, got {spec!r}")
            continue
        name = spec["name"]
        weight = spec.get("weight", 1.0)
        label = spec.get("label", name)
        params = {k: v for k, v in spec.items() if k not in _RESERVED}
        if not _is_finite(weight):
            problems.append(f"{at}.weight: must be a finite number, got {weight!r}")
        if not isinstance(label, str) or not label:
            problems.append(f"{at}.label: must be a non-empty string, got {label!r}")
        elif label in seen:
            problems.append(f"{at}: label {label!r} is used twice; give each a distinct 'label'")
        if isinstance(label, str):
            seen.add(label)
        fn, problem = _resolve(name, at)
        if problem:
            problems.append(problem)
            continue
        try:
            inspect.signature(fn).bind("prompt", "completion", "answer", **params)
        except TypeError as e:
            problems.append(f"{at}: {name} cannot be called as (prompt, completion, answer"
                            f"{''.join(', ' + k + '=...' for k in params)}): {e}")
            continue
        except ValueError:
            pass  # no introspectable signature (a C function); trust it
        problems += _check_builtin(fn, params, at)
        if _is_finite(weight):
            rewards.append(Reward(label, fn, float(weight), params))
    if not problems and all(r.weight == 0 for r in rewards):
        problems.append(f"{where}: every weight is 0, so every completion's reward is 0 and GRPO learns nothing; "
                        "give at least one reward a non-zero weight")
    if problems:
        raise ConfigError("; ".join(problems))
    return RewardSet(rewards)

"""Rewards: each built-in, weights, a user module:function, failures counted as zeros, bad specs."""
import math

import pytest

from engine.config import ConfigError
from engine.rewards import BUILTINS, build_rewards, exact_match, length_penalty, numeric, regex


def score(specs, completions, answers):
    return build_rewards(specs).score(["prompt"] * len(completions), completions, answers)


def test_exact_match_strips_whitespace():
    assert exact_match("p", "  Paris\n", "Paris") == 1.0
    assert exact_match("p", "paris", "Paris") == 0.0  # case matters
    assert exact_match("p", "42", 42) == 1.0  # answer compared as a string


def test_numeric_first_or_last_number_within_tolerance():
    text = "Start with 3 apples, buy 1,234.5 more, total is -7."
    assert numeric("p", text, -7) == 1.0  # last number by default; the final "." is not part of it
    assert numeric("p", text, "3", which="first") == 1.0
    assert numeric("p", text, 1234.5) == 0.0  # the middle number is neither first nor last
    assert numeric("p", "x = 0.1000004", 0.1, tolerance=1e-6) == 1.0  # off by 4e-7
    assert numeric("p", "x = 0.100002", 0.1, tolerance=1e-6) == 0.0  # off by 2e-6
    assert numeric("p", "so #### 72", "Natalia sold 48/2 = 24 clips ... #### 72") == 1.0  # GSM8K-style answer
    assert numeric("p", "no digits here", 5) == 0.0


def test_regex_format():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    good = "<think>step 1\nstep 2</think>\n<answer>4</answer>"  # `.` spans the newline
    assert regex("p", good, None, pattern=pattern) == 1.0
    assert regex("p", "<answer>4</answer>", None, pattern=pattern) == 0.0
    assert regex("p", good + " trailing", None, pattern=pattern) == 1.0  # search
    assert regex("p", good + " trailing", None, pattern=pattern, full=True) == 0.0  # whole completion


def test_length_penalty_beyond_target():
    assert length_penalty("p", "x" * 10, None, target=10, scale=0.5) == 0.0  # at the target: no penalty
    assert length_penalty("p", "x" * 3, None, target=10, scale=0.5) == 0.0
    assert length_penalty("p", "x" * 14, None, target=10, scale=0.5) == -2.0  # 4 chars over x 0.5


def test_weighted_total_and_per_reward_arrays():
    specs = [{"name": "numeric", "weight": 1.0, "tolerance": 1e-6},
             {"name": "format", "weight": 0.5, "pattern": r"^Answer: "},
             {"name": "length_penalty", "weight": 2.0, "target": 10, "scale": 0.1}]
    completions = ["Answer: 4",          # numeric 1, format 1, length 9 -> 0       total 1 + 0.5      = 1.5
                   "I think 5",          # numeric 0, format 0, length 9 -> 0       total 0
                   "Answer: 4 (2 + 2)"]  # last number 2 -> 0, format 1, 17 chars: 7 over x 0.1 = -0.7
    #                                                                          total 0.5 + 2 x -0.7 = -0.9
    s = score(specs, completions, [4, 4, 4])
    assert list(s.per_reward) == ["numeric", "format", "length_penalty"]
    assert s.per_reward["numeric"].tolist() == [1.0, 0.0, 0.0]
    assert s.per_reward["format"].tolist() == [1.0, 0.0, 1.0]
    assert s.per_reward["length_penalty"].tolist() == pytest.approx([0.0, 0.0, -0.7])
    assert s.total.tolist() == pytest.approx([1.5, 0.0, -0.9])
    assert s.failures == {"numeric": 0, "format": 0, "length_penalty": 0} and s.first_error == {}


def test_user_function_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def shouting(prompt, completion, answer, bonus=1.0):\n"
        "    return bonus if completion.isupper() else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = score([{"name": "my_rewards:shouting", "weight": 0.5, "bonus": 3.0}], ["YES", "no"], [None, None])
    assert s.per_reward["my_rewards:shouting"].tolist() == [3.0, 0.0]
    assert s.total.tolist() == [1.5, 0.0]  # 0.5 x 3.0


def test_raising_and_nan_rewards_score_zero_and_are_counted(tmp_path, monkeypatch):
    (tmp_path / "flaky_rewards.py").write_text(
        "def picky(prompt, completion, answer):\n"
        "    if completion == 'boom':\n"
        "        raise RuntimeError('cannot parse')\n"
        "    return 1.0\n"
        "def nan_on_empty(prompt, completion, answer):\n"
        "    return float('nan') if not completion else 2.0\n"
        "def wrong_type(prompt, completion, answer):\n"
        "    return {'inf': float('inf'), 'str': '1.0'}.get(completion, True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = [{"name": "flaky_rewards:picky", "label": "picky"},
             {"name": "flaky_rewards:nan_on_empty", "label": "nan", "weight": 0.5},
             {"name": "flaky_rewards:wrong_type", "label": "typed"}]
    completions = ["ok", "boom", "", "inf", "str"]
    s = score(specs, completions, [None] * 5)
    assert s.per_reward["picky"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]  # the raise -> 0
    assert s.per_reward["nan"].tolist() == [2.0, 2.0, 0.0, 2.0, 2.0]  # NaN -> 0
    assert s.per_reward["typed"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # True -> 1; inf and "1.0" -> 0
    assert s.failures == {"picky": 1, "nan": 1, "typed": 2}
    assert "cannot parse" in s.first_error["picky"] and "nan" in s.first_error["nan"]
    assert s.first_error["typed"] == "ValueError: returned inf"  # the first of its two failures
    # totals, picky + 0.5 x nan + typed: 1+1+1, 0+1+1, 1+0+1, 1+1+0, 1+1+0
    assert s.total.tolist() == [3.0, 2.0, 2.0, 2.0, 2.0]
    assert all(math.isfinite(x) for x in s.total.tolist())


def test_numeric_with_an_answer_without_a_number_is_a_counted_failure():
    s = score([{"name": "numeric"}], ["42", "42"], ["42", "unknown"])
    assert s.per_reward["numeric"].tolist() == [1.0, 0.0]
    assert s.failures == {"numeric": 1} and "no number" in s.first_error["numeric"]


def test_unknown_name_is_one_clear_line():
    with pytest.raises(ValueError) as e:
        build_rewards([{"name": "numeric"}, {"name": "accuracy"}])
    msg = str(e.value)
    assert "\n" not in msg and "rewards[1].name: unknown reward 'accuracy'" in msg
    for valid in ("exact_match", "format", "length_penalty", "numeric", "regex", "module.path:function"):
        assert valid in msg


def test_bad_specs_all_reported_at_build_time():
    specs = [{"name": "regex"},                                   # pattern missing
             {"name": "format", "pattern": "("},                  # does not compile
             {"name": "numeric", "tolerance": -1, "weight": "x"},
             {"name": "numeric", "tolrance": 1e-3, "label": "n2"},  # typo'd parameter
             {"name": "no_such_module_xyz:f"},
             {"name": "math:no_such_function"},
             {"name": "exact_match"}, {"name": "exact_match"},    # same label twice
             {"name": "numeric", "tolerance": float("nan"), "label": "n3"},  # NaN passes a `< 0` check: scores 0
             {"name": "length_penalty", "target": 100, "scale": float("nan")}]
    with pytest.raises(ConfigError) as e:
        build_rewards(specs)
    msg = str(e.value)
    for expected in ("rewards[0]: regex cannot be called", "'pattern'",
                     "rewards[1].pattern: not a valid regular expression",
                     "rewards[2].weight", "rewards[2].tolerance",
                     "rewards[3]: numeric cannot be called", "'tolrance'",
                     "rewards[4].name: cannot import module 'no_such_module_xyz'",
                     "rewards[5].name: module 'math' has no function 'no_such_function'",
                     "rewards[7]: label 'exact_match' is used twice",
                     "rewards[8].tolerance: must be a number >= 0, got nan",
                     "rewards[9].scale: must be a number >= 0, got nan"):
        assert expected in msg, (expected, msg)
    with pytest.raises(ConfigError, match="non-empty list"):
        build_rewards([])


def test_mismatched_batch_lengths_raise():
    rs = build_rewards([{"name": "exact_match"}])
    with pytest.raises(ValueError, match="2 prompts, 3 completions and 3 answers"):
        rs.score(["a", "b"], ["a", "b", "c"], ["a", "b", "c"])
    assert rs.labels == ["exact_match"]
    assert BUILTINS["format"] is regex  # "format" is the regex reward under its recipe name


def test_rewards_whose_weights_are_all_zero_are_refused():
    """Every weight 0: every total is 0, so every advantage is 0 and nothing is learned; the run went on silently.
    One zero weight beside a non-zero one is fine (a reward logged but not trained on). [fails if: all-zero weights
    pass, or a single zero weight is refused]"""
    with pytest.raises(ConfigError, match=r"grpo.rewards: every weight is 0, so every completion's reward is 0"):
        build_rewards([{"name": "numeric", "weight": 0}, {"name": "exact_match", "weight": 0.0}], where="grpo.rewards")
    assert [r.weight for r in build_rewards([{"name": "numeric", "weight": 0}, {"name": "exact_match"}]).rewards] == \
        [0.0, 1.0]


def test_numeric_reads_the_common_number_formats_and_its_tolerance_is_inclusive():
    """Thousands groups, exponents and a leading dot are numbers; a difference equal to the tolerance passes, so
    tolerance 0 is an exact match; exact_match strips the answer as it strips the completion. [fails if: a format is
    dropped from the number pattern (the reward says 0 without notice), or the tolerance is exclusive]"""
    assert numeric("p", "total is 1,234.5", 1234.5) == 1.0
    assert numeric("p", "about 1.5e3", 1500) == 1.0
    assert numeric("p", "x = .5", 0.5) == 1.0
    assert numeric("p", "5", 4, tolerance=1.0) == 1.0
    assert numeric("p", "42", 42, tolerance=0) == 1.0 and numeric("p", "42", 43, tolerance=0) == 0.0
    assert exact_match("p", "Paris", " Paris\n") == 1.0


@pytest.mark.parametrize("spec, key", [
    ({"name": "numeric", "which": "frist"}, "which"),
    ({"name": "numeric", "weight": float("nan")}, "weight"),
    ({"name": "numeric", "weight": float("inf")}, "weight"),
    ({"name": "length_penalty", "target": "100"}, "target"),
    ({"name": "regex", "pattern": 5}, "pattern"),
])
def test_a_bad_reward_option_is_refused_by_name(spec, key):
    """A misspelled `which`, a weight that is not finite (every total would be NaN), a target or a pattern of the
    wrong type: one ConfigError naming the option, at build time (not a TypeError on the first completion)."""
    with pytest.raises(ConfigError, match=rf"rewards\[0\].{key}"):
        build_rewards([spec])


def test_a_length_target_of_zero_is_allowed():
    assert build_rewards([{"name": "length_penalty", "target": 0}])

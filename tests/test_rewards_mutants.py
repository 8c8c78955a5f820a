"""engine/rewards.py's own work, one rule a test, each a change to rewards.py (a mutant) that every other fast test
let through: the number pattern (three-digit leading groups, long plain numbers, signed exponents, a signed leading
dot), numeric's default tolerance, format/regex searching anywhere, the spec checks refusing values of the wrong type
in the one ConfigError line (not a TypeError), a non-list spec, a C function without a signature, all-negative
weights, and the all-zero-weights line kept out of a list that has other problems. No launcher, no model: the reward
functions and build_rewards called directly; every expectation is written out by hand."""
import pytest

from engine.config import ConfigError
from engine.rewards import build_rewards, numeric, regex

UNKNOWN = ("rewards[1].name: unknown reward 'accuracy' (built-ins: exact_match, format, length_penalty, numeric, "
           "regex; or 'module.path:function' for your own)")


def test_numbers_with_three_digit_leads_long_plain_digits_signed_exponents_and_a_signed_leading_dot():
    """"123,456" is 123456 (its leading group has 3 digits), "2024" is one number, "2.5e-3" is 0.0025 and "-.5" is
    -0.5; each is the last number of its completion, so numeric scores 1.0 against that value. [fails if: the leading
    group is cut to 1-2 digits (123 then 456), the comma groups become optional (2024 read as 202 then 4), the
    exponent's sign is dropped (2.5 then -3), or the leading-dot alternative loses its sign (0.5)]"""
    assert numeric("p", "paid 123,456 in all", 123456) == 1.0
    assert numeric("p", "the year 2024", 2024) == 1.0
    assert numeric("p", "rate 2.5e-3", 0.0025) == 1.0
    assert numeric("p", "x = -.5", -0.5) == 1.0


def test_numeric_default_tolerance_is_one_millionth():
    """Without `tolerance`, 0.1000004 is within 1e-6 of 0.1 (off by 4e-7) and 0.100002 is not (off by 2e-6); the
    same through build_rewards with no tolerance key. [fails if: the default tolerance is 0 or 1e-3]"""
    assert numeric("p", "x = 0.1000004", 0.1) == 1.0
    assert numeric("p", "x = 0.100002", 0.1) == 0.0
    s = build_rewards([{"name": "numeric"}]).score(["p", "p"], ["0.1000004", "0.100002"], [0.1, 0.1])
    assert s.per_reward["numeric"].tolist() == [1.0, 0.0]


def test_format_finds_the_pattern_anywhere_in_the_completion():
    """full=False searches: a completion that starts with other text still has its <answer> tag found (1.0).
    [fails if: search is replaced by match (anchored at the start: 0.0)]"""
    assert regex("p", "Sure. <answer>4</answer>", None, pattern="<answer>.*</answer>") == 1.0
    assert regex("p", "Sure. no tag", None, pattern="<answer>.*</answer>") == 0.0


def test_values_of_the_wrong_type_are_one_config_error_line():
    """A string tolerance, a `which` of None, a string scale and a None pattern: each named in the one ConfigError,
    the problems joined by "; " on one line (no TypeError from comparing a string with 0). [fails if: the tolerance's
    or the scale's number check is dropped (TypeError escapes), None is let through as `which`, the pattern check is
    skipped for a falsy pattern, or the problems are joined by newlines]"""
    specs = [{"name": "numeric", "tolerance": "1e-3"},
             {"name": "numeric", "which": None, "label": "n2"},
             {"name": "length_penalty", "target": 10, "scale": "0.1"},
             {"name": "regex", "pattern": None}]
    with pytest.raises(ConfigError) as e:
        build_rewards(specs)
    assert str(e.value) == ("rewards[0].tolerance: must be a number >= 0, got '1e-3'; "
                            "rewards[1].which: must be 'first' or 'last', got None; "
                            "rewards[2].scale: must be a number >= 0, got '0.1'; "
                            "rewards[3].pattern: must be a string, got None")


def test_a_mapping_instead_of_a_list_is_refused_as_such():
    """A single spec written as a mapping (the list's dash forgotten) is refused with the list message, not iterated
    as its keys. [fails if: only emptiness is checked (the keys give "expected a mapping ..., got 'name'")]"""
    with pytest.raises(ConfigError) as e:
        build_rewards({"name": "numeric"})
    assert str(e.value) == ("rewards: expected a non-empty list like [{name: numeric, weight: 1.0}], got "
                            "{'name': 'numeric'}")


def test_a_function_without_a_signature_is_trusted_at_build_time():
    """math.hypot has no introspectable signature (inspect raises ValueError): it is built, and its failure on string
    arguments is counted at scoring, not raised. [fails if: the ValueError of inspect.signature is not caught]"""
    rs = build_rewards([{"name": "math:hypot"}])
    s = rs.score(["p"], ["c"], ["a"])
    assert rs.labels == ["math:hypot"] and s.per_reward["math:hypot"].tolist() == [0.0]
    assert s.failures == {"math:hypot": 1} and s.first_error["math:hypot"].startswith("TypeError: ")


def test_rewards_whose_weights_are_all_negative_are_allowed():
    """A penalty alone (weight -2 on length_penalty) still ranks completions, so it is not the all-zero case:
    8 characters, 3 over the target 5, x 0.5 = -1.5, x -2 = 3.0. [fails if: the all-zero check is `<= 0`]"""
    s = build_rewards([{"name": "length_penalty", "target": 5, "scale": 0.5, "weight": -2}]).score(
        ["p"], ["x" * 8], [None])
    assert s.total.tolist() == [3.0]


def test_the_all_zero_line_is_not_added_beside_another_problem():
    """[numeric at weight 0, an unknown name]: the unknown reward would have weight 1, so "every weight is 0" would
    be false; the message is the unknown name alone. [fails if: the all-zero check runs when there are problems]"""
    with pytest.raises(ConfigError) as e:
        build_rewards([{"name": "numeric", "weight": 0}, {"name": "accuracy"}])
    assert str(e.value) == UNKNOWN


def test_a_boolean_length_target_is_refused():
    """`target: true` (YAML) is a bool, not a character count: refused like a bool weight is (it built, and a
    3-character completion scored -1e-3 x 2 = -0.002). [fails if: isinstance(target, int) alone admits bools]"""
    with pytest.raises(ConfigError) as e:
        build_rewards([{"name": "length_penalty", "target": True}])
    assert str(e.value) == "rewards[0].target: must be an integer >= 0 (characters), got True"


def test_a_weight_too_large_for_a_float_is_one_config_error():
    """weight 10**400 (a YAML integer of 401 digits) is not a finite float: refused as one, not an OverflowError out
    of math.isfinite. [fails if: the finiteness check lets OverflowError escape]"""
    with pytest.raises(ConfigError) as e:
        build_rewards([{"name": "numeric", "weight": 10 ** 400}])
    assert str(e.value).startswith("rewards[0].weight: must be a finite number, got 1000")


def test_regex_full_must_be_a_boolean():
    """`full: "no"` (a quoted YAML string) would be truthy and match the whole completion: refused in the build's one
    line. [fails if: full is not type-checked]"""
    with pytest.raises(ConfigError) as e:
        build_rewards([{"name": "regex", "pattern": "x", "full": "no"}])
    assert str(e.value) == "rewards[0].full: must be true or false, got 'no'"
    build_rewards([{"name": "regex", "pattern": "x", "full": True}])

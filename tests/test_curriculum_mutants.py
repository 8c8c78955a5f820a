"""engine/curriculum.py's own work, one rule a test, each a change to curriculum.py (a mutant) that every other fast
test let through: update()'s length check before any count changes, negative rewards summed with their sign,
state_dict carrying the reward sum itself, load_state_dict refusing a larger prompt count, and document_keys refusing
a bool score. No launcher: PromptCurriculum and document_keys called directly (a two-column stand-in for the
dataset); every expectation is written out by hand."""
import json

import numpy as np
import pytest

from engine.config import ConfigError, CurriculumConfig, DataCurriculumConfig
from engine.curriculum import PromptCurriculum, document_keys


def _cur(n=4) -> PromptCurriculum:
    return PromptCurriculum(CurriculumConfig(enabled=True), n, 2, 0)


def test_more_prompt_ids_than_rewards_is_refused_before_any_count_changes():
    """update([0, 1, 2], [1.0, 0.0]) raises "3 prompt ids for 2 rewards" and leaves every count as it was (attempts
    [2, 0, 0, 0]). [fails if: the check only catches fewer ids than rewards (the decay and the attempts are applied,
    then numpy's broadcast error)]"""
    cur = _cur()
    cur.update([0, 0], [1.0, 0.0])
    with pytest.raises(ValueError) as e:
        cur.update([0, 1, 2], [1.0, 0.0])
    assert str(e.value) == "3 prompt ids for 2 rewards"
    assert cur.attempts.tolist() == [2.0, 0.0, 0.0, 0.0] and cur.passes.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_the_reward_sum_keeps_the_sign_of_each_reward():
    """Rewards -1.0 and 2.0 for prompt 0 sum to 1.0; -0.5 for prompt 1 is -0.5. [fails if: rewards are added as
    magnitudes (3.0, 0.5)]"""
    cur = _cur()
    cur.update([0, 0, 1], [-1.0, 2.0, -0.5])
    assert cur.reward_sum.tolist() == [1.0, -0.5, 0.0, 0.0]


def test_state_dict_round_trips_the_reward_sum_itself():
    """After rewards [1.0, 0.25] on prompt 0 (threshold 1.0: one pass), the saved reward_sum is [1.25, 0, 0, 0], not
    the passes [1, 0, 0, 0], and a curriculum loaded from its JSON holds the same three arrays. [fails if: state_dict
    writes another array under reward_sum]"""
    cur = _cur()
    cur.update([0, 0], [1.0, 0.25])
    state = json.loads(json.dumps(cur.state_dict()))
    assert state == {"n_prompts": 4, "attempts": [2.0, 0.0, 0.0, 0.0], "passes": [1.0, 0.0, 0.0, 0.0],
                     "reward_sum": [1.25, 0.0, 0.0, 0.0]}
    back = _cur()
    back.load_state_dict(state)
    assert back.reward_sum.tolist() == [1.25, 0.0, 0.0, 0.0] and back.passes.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_statistics_for_more_prompts_are_refused():
    """Statistics saved for 5 prompts do not load into a curriculum of 4 (nor 3 into 4): the resume line names both.
    [fails if: only a smaller saved count is refused]"""
    for saved in (5, 3):
        state = {"n_prompts": saved, "attempts": [0.0] * saved, "passes": [0.0] * saved, "reward_sum": [0.0] * saved}
        with pytest.raises(ConfigError) as e:
            _cur().load_state_dict(state)
        assert str(e.value) == (f"--resume: the checkpoint's grpo.curriculum statistics are for {saved} prompts but "
                                "data.path has 4; resume with the prompts file the run started with")


class Docs(dict):
    """A dataset as document_keys sees it: column_names and docs[column]."""

    @property
    def column_names(self):
        return list(self)


def test_a_boolean_score_is_named_by_its_row():
    """A score column [0.5, true, 2] (JSON true): row 2 is refused as not a number, as weights are. [fails if: bool
    is let through as a number (True sorts as 1.0)]"""
    c = DataCurriculumConfig(mode="score", score_column="level")
    with pytest.raises(ConfigError) as e:
        document_keys(c, Docs(text=["a", "b", "c"], level=[0.5, True, 2]), [[1], [2], [3]], "d.jsonl")
    assert str(e.value) == ("data.curriculum.score_column 'level': row 2 of d.jsonl has True, not a finite number; "
                            "fix that row")
    assert document_keys(c, Docs(text=["a", "b"], level=[0.5, 2]), [[1], [2]], "d.jsonl").tolist() == [0.5, 2.0]

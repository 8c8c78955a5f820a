"""Curricula (engine/curriculum.py): the GRPO prompt draw by pass rate, and the pretraining document order.

Unit level, no launches: the draw against synthetic pass-rate tables, world sizes 1 and 2 by slicing one global draw
(as train() does) and merging the ranks' rewards (as the all-gather does), the state_dict round trip, the data
curriculum through engine/data.py's own functions, and the bad-input lines through the entry points' main() in this
process. The 2-rank launch (a resumed run with the curriculum equals the uninterrupted one bitwise) is
tests/test_grpo.py::test_resumed_grpo_equals_an_uninterrupted_run[curriculum], which shares that file's pretrained
model.
"""
import json
import re

import numpy as np
import pytest

from conftest import ROOT, run_in_process
from engine.config import ConfigError, CurriculumConfig, DataConfig, DataCurriculumConfig, load_recipe
from engine.curriculum import PromptCurriculum, document_order, local_part, merge

TOKENIZER = str(ROOT / "engine" / "assets" / "tokenizer")


def table(c: CurriculumConfig, batch: int = 64, seed: int = 7) -> PromptCurriculum:
    """1000 prompts: 0-299 unseen, 300-599 in the band (4 of 8), 600-799 never solved, 800-999 always solved."""
    cur = PromptCurriculum(c, 1000, batch, seed)
    cur.attempts[300:] = 8
    cur.passes[300:600], cur.passes[600:800], cur.passes[800:] = 4, 0, 8
    return cur


def test_draw_respects_the_band_and_the_unseen_share():
    cur = table(CurriculumConfig(enabled=True))  # band [0.2, 0.8], unseen 0.25, outside weight 0.1
    count, in_band = np.zeros(1000), []
    for step in range(1, 2001):
        ids = cur.draw(step)
        assert len(ids) == 64 and len(set(ids.tolist())) == 64  # distinct within a step
        assert (ids < 300).sum() == 16  # round(0.25 x 64) unseen, every step
        seen = ids[ids >= 300]
        in_band.append(np.mean(seen < 600))
        np.add.at(count, ids, 1)
    # Weights 1 (300 prompts) against 0.1 (400): 300 / 340 = 0.88 of the tried draws, a little less without
    # replacement (the band's prompts run out within a step first).
    assert 0.85 <= np.mean(in_band) <= 0.89
    per_in, per_out = count[300:600].mean(), count[600:].mean()
    assert 8 <= per_in / per_out <= 10.5  # each in-band prompt about 1 / outside_weight times as often
    assert count[600:].min() > 0  # always and never solved: less often, never starved
    assert count[:300].mean() == pytest.approx(16 * 2000 / 300)


def test_draw_with_a_narrow_band_and_other_shares():
    rates = np.repeat(np.linspace(0, 1, 11), 50)  # 550 prompts tried 10 times, pass rates 0, 0.1, ..., 1
    cur = PromptCurriculum(CurriculumConfig(enabled=True, band=[0.4, 0.6], unseen_share=0.0, outside_weight=0.01),
                           len(rates), 32, 3)
    cur.attempts[:], cur.passes[:] = 10, rates * 10
    drawn = np.concatenate([cur.draw(s) for s in range(1, 501)])
    band = (cur.pass_rate()[drawn] >= 0.4) & (cur.pass_rate()[drawn] <= 0.6)
    assert band.mean() > 0.9  # 150 prompts at weight 1 against 400 at 0.01
    # unseen_share 1: all unseen while there are enough; 0 unseen left -> all tried
    fresh = table(CurriculumConfig(enabled=True, unseen_share=1.0))
    assert all((fresh.draw(s) < 300).all() for s in range(1, 50))
    fresh.attempts[:300] = 8
    assert fresh.draw(1).min() >= 0 and len(fresh.draw(1)) == 64
    # nothing tried yet: the whole batch is unseen; a batch larger than the prompt set comes in rounds
    start = PromptCurriculum(CurriculumConfig(enabled=True), 5, 12, 0)
    ids = start.draw(1)
    assert len(ids) == 12 and sorted(ids[:5]) == list(range(5)) and sorted(ids[5:10]) == list(range(5))
    assert start.draw(1).tolist() == ids.tolist() and start.draw(2).tolist() != ids.tolist()  # a function of the step


def test_update_counts_passes_at_the_threshold_and_decays():
    cur = PromptCurriculum(CurriculumConfig(enabled=True, pass_threshold=1.0, decay=0.5), 3, 2, 0)
    cur.update([0, 0, 0, 0, 1, 1, 1, 1], [1.0, 1.5, 0.5, 0.999, 0.0, 0.0, 0.0, 1.0])
    assert cur.attempts.tolist() == [4, 4, 0] and cur.passes.tolist() == [2, 1, 0]
    assert cur.reward_sum[0] == 3.999 and np.isnan(cur.pass_rate()[2])
    cur.update([0, 0], [1.0, 1.0])  # drawn again: the earlier counts weigh half
    assert cur.attempts[0] == 4 and cur.passes[0] == 3 and cur.attempts[1] == 4
    assert local_part([5, 2], np.array([1.0, 0.0, 0.5, 1.0])) == ([5, 5, 2, 2], [1.0, 0.0, 0.5, 1.0])
    with pytest.raises(ValueError):
        local_part([5, 2], np.zeros(3))


def rewards_of(ids: np.ndarray, step: int, G: int, skill: np.ndarray) -> np.ndarray:
    """G synthetic rewards per prompt, prompt-major: 1.0 with the prompt's probability `skill`, else 0 or 0.5."""
    rng = np.random.default_rng([step, 99])
    u = rng.random((len(skill), G))[ids]  # the same numbers for a prompt whichever rank scores it
    return np.where(u < skill[ids, None], 1.0, np.where(u > 0.9, 0.5, 0.0)).ravel()


def run_world(world: int, steps: int, per_rank: int, G: int = 4, cur_state: dict | None = None, start: int = 0):
    """`world` ranks each holding a curriculum, as train() runs them: draw, take the rank's slice, score, merge every
    rank's rewards in rank order (the all-gather), update. Returns the global draws and the ranks' curricula."""
    skill = np.linspace(0, 1, 40)
    c = CurriculumConfig(enabled=True)
    curs = [PromptCurriculum(c, 40, per_rank * world, 11) for _ in range(world)]
    if cur_state is not None:
        for cur in curs:
            cur.load_state_dict(json.loads(json.dumps(cur_state)))  # as through engine_state.json
    draws = []
    for step in range(start + 1, start + steps + 1):
        mine = [cur.rank_draw(step, r, per_rank)[0] for r, cur in enumerate(curs)]
        draws.append(np.concatenate(mine).tolist())
        parts = [local_part(m, rewards_of(m, step, G, skill)) for m in mine]
        for cur in curs:
            cur.update(*merge(parts))
    return draws, curs


def test_same_global_draw_and_statistics_on_one_rank_and_two():
    one, (c1,) = run_world(1, 30, 8)
    two, (c2a, c2b) = run_world(2, 30, 4)
    assert one == two  # every step's global batch; rank r took [4r, 4r + 4)
    for c in (c2a, c2b):  # bitwise, on both ranks
        assert c.state_dict() == c1.state_dict()
    assert c1.describe(np.array(one[-1]))["curriculum_tried"] == 1.0


def test_state_dict_round_trip_gives_the_same_future_draws():
    straight, (full,) = run_world(1, 20, 8)
    first, (half,) = run_world(1, 10, 8)
    state = half.state_dict()
    assert json.loads(json.dumps(state)) == state  # exact through JSON (engine_state.json)
    rest, (resumed,) = run_world(1, 10, 8, cur_state=state, start=10)
    assert first + rest == straight
    assert resumed.state_dict() == full.state_dict()
    fresh = PromptCurriculum(CurriculumConfig(enabled=True), 40, 8, 11)  # without the statistics: another draw
    assert fresh.draw(11).tolist() != straight[10]
    with pytest.raises(ConfigError, match="statistics are for 40 prompts but data.path has 41"):
        PromptCurriculum(CurriculumConfig(enabled=True), 41, 8, 11).load_state_dict(state)


# ----------------------------------------------------------------------------------------------- pretraining

def test_document_order_sorts_and_breaks_ties_by_the_seed():
    keys = [3, 1, 2, 1, 3, 1]
    order = document_order(keys, seed=0)
    assert [keys[i] for i in order] == [1, 1, 1, 2, 3, 3]
    assert [keys[i] for i in document_order(keys, 0, reverse=True)] == [3, 3, 2, 1, 1, 1]
    assert document_order(keys, 0).tolist() == order.tolist()
    assert {tuple(document_order(keys, s)[:3]) for s in range(20)} != {tuple(order[:3])}  # ties: seeded, not file order


def test_document_order_keeps_the_seeds_tie_order_whatever_the_other_keys_and_the_direction():
    """The ties' order is the seed's alone: among documents with equal keys it is the same ascending, descending,
    and with every key equal (the sort moves keys, it never reorders ties). [fails if: an unstable sort (numpy's
    default argsort, SIMD-dispatched per CPU) orders ties by the other keys, the direction, or the host]"""
    keys = np.random.default_rng(0).integers(0, 4, 300).astype(float)  # 300 documents, 4 distinct keys
    up, down, flat = document_order(keys, 1), document_order(keys, 1, reverse=True), document_order(np.zeros(300), 1)
    for v in range(4):
        tied = [int(i) for i in flat if keys[i] == v]
        assert [int(i) for i in up if keys[i] == v] == tied
        assert [int(i) for i in down if keys[i] == v] == tied


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 documents of 1-60 words in a shuffled order, with a score column that runs against the length."""
    tmp = tmp_path_factory.mktemp("curriculum")
    n = np.random.default_rng(0).permutation(60) + 1
    rows = [{"text": " ".join(["ab"] * int(k)), "difficulty": float(100 - k)} for k in n]
    (tmp / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp / "docs.jsonl", rows


def build(path, mode: str, column=None, seq_len: int = 16):
    from engine.data import build_data, load_tokenizer

    d = DataConfig(path=str(path), tokenizer=TOKENIZER, seq_len=seq_len,
                   curriculum=DataCurriculumConfig(mode=mode, score_column=column))
    tok = load_tokenizer(TOKENIZER)
    return build_data(d, tok, 0, 1, seed=5), tok


def global_stream(data, micro: int, world: int, steps: int, start: int = 0):
    """{global position: window} read through every rank's micro_batches, as pretrain.train reads them."""
    seen = {}
    for rank in range(world):
        it = data.micro_batches(micro, rank, world, start=start)
        for _ in range(steps):
            j, ids = next(it)
            for pos, row in zip(data.rank_positions(j - 1, micro, rank, world), ids.tolist()):
                assert pos not in seen  # disjoint ranks
                seen[pos] = row
    return seen


@pytest.mark.parametrize("mode, column", [("length", None), ("score", "difficulty")])
def test_data_curriculum_keeps_ranks_disjoint_covers_the_set_and_orders(corpus, mode, column):
    from engine.data import pack

    path, rows = corpus
    data, tok = build(path, mode, column)
    n = len(data)
    assert data.ordered
    steps = n // 4  # micro 2 x world 2: the whole first epoch
    one = global_stream(data, 4, 1, steps)
    two = global_stream(data, 2, 2, steps)
    assert one == two  # the same global batches on 1 rank and on 2
    assert sorted(two) == list(range(4 * steps))  # the ranks cover every window once
    # In global position order the windows are the documents packed short to long (score: 100 - length, low first:
    # long to short).
    lengths = [len(r["text"].split()) for r in rows]
    keys = lengths if mode == "length" else [r["difficulty"] for r in rows]
    ids = tok([rows[i]["text"] for i in document_order(keys, 5)])["input_ids"]
    assert [two[p] for p in range(4 * steps)] == pack(ids, tok.eos_token_id, 16)[:4 * steps].tolist()
    sorted_lengths = [lengths[i] for i in document_order(keys, 5)]
    assert sorted_lengths == (sorted(lengths) if mode == "length" else sorted(lengths, reverse=True))
    # the second epoch is shuffled as without a curriculum
    assert [data.global_index(n + i) for i in range(n)] != list(range(n))


def test_data_curriculum_resumes_exactly(corpus):
    data, _ = build(corpus[0], "length")
    straight = global_stream(data, 2, 2, 12)
    resumed = global_stream(data, 2, 2, 7, start=5)  # a run restarted at data position 5 (micro-batches per rank)
    assert {p: straight[p] for p in range(20, 48)} == resumed


def test_no_curriculum_is_the_shuffled_order(corpus):
    data, _ = build(corpus[0], "none")
    assert not data.ordered and [data.global_index(i) for i in range(len(data))] != list(range(len(data)))


def test_a_score_that_is_not_a_number_is_named_where_the_data_is_loaded(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a b", "difficulty": 1}\n{"text": "c d", "difficulty": "hard"}\n')
    with pytest.raises(ConfigError) as e:
        build(tmp_path / "d.jsonl", "score", "difficulty")
    assert str(e.value) == (f"data.curriculum.score_column 'difficulty': row 2 of {tmp_path / 'd.jsonl'} has 'hard', "
                            "not a finite number; fix that row")


# ----------------------------------------------------------------------------------------------- bad input

RECIPE_LINES = {
    "band_outside": ("grpo: {curriculum: {enabled: true, band: [-0.1, 0.8]}}",
                     "grpo.curriculum.band [-0.1, 0.8]: both ends must be in [0, 1] (pass rates), e.g. [0.2, 0.8]"),
    "band_above_one": ("grpo: {curriculum: {band: [0.2, 1.5]}}",
                       "grpo.curriculum.band [0.2, 1.5]: both ends must be in [0, 1] (pass rates), e.g. [0.2, 0.8]"),
    "band_inverted": ("grpo: {curriculum: {enabled: true, band: [0.8, 0.2]}}",
                      "grpo.curriculum.band [0.8, 0.2]: low must be <= high (inverted); write [0.2, 0.8]"),
    "band_not_a_pair": ("grpo: {curriculum: {band: [0.5]}}",
                        "grpo.curriculum.band: expected [low, high], two pass rates, got [0.5]"),
    "unseen_share": ("grpo: {curriculum: {enabled: true, unseen_share: 1.5}}",
                     "grpo.curriculum.unseen_share (1.5) must be in [0, 1]: the share of each step's prompts drawn "
                     "from prompts not tried yet"),
    "unseen_share_negative": ("grpo: {curriculum: {unseen_share: -0.25}}",
                              "grpo.curriculum.unseen_share (-0.25) must be in [0, 1]: the share of each step's "
                              "prompts drawn from prompts not tried yet"),
    "outside_weight": ("grpo: {curriculum: {outside_weight: 0}}",
                       "grpo.curriculum.outside_weight (0.0) must be in (0, 1]: prompts outside the band are drawn "
                       "less often than those inside it, but never starved"),
    "data_mode": ("data: {curriculum: {mode: lenght}}",
                  "data.curriculum.mode: 'lenght' is not one of none, length, score"),
    "data_score_without_column": ("data: {curriculum: {mode: score}}",
                                  "data.curriculum.mode score needs data.curriculum.score_column: a numeric column of "
                                  "data.path"),
    "data_streaming": ("data: {streaming: true, curriculum: {mode: length}}",
                       "data.curriculum.mode length needs map-style data (ordering sees every document first); set "
                       "data.streaming: false, or data.curriculum.mode: none"),
}


@pytest.mark.parametrize("case", RECIPE_LINES)
def test_bad_curriculum_settings_are_one_exact_problem(tmp_path, case):
    yaml_text, expect = RECIPE_LINES[case]
    (tmp_path / "r.yaml").write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(tmp_path / "r.yaml")
    assert str(e.value) == f"recipe {tmp_path / 'r.yaml'}: {expect}"


def test_defaults_turn_on_with_enabled_alone(tmp_path):
    (tmp_path / "r.yaml").write_text("grpo: {curriculum: {enabled: true}}\ndata: {curriculum: {mode: length}}\n")
    r = load_recipe(tmp_path / "r.yaml")
    assert r.grpo.curriculum == CurriculumConfig(enabled=True, band=[0.2, 0.8], unseen_share=0.25, outside_weight=0.1,
                                                 pass_threshold=1.0, decay=0.5)
    assert r.data.curriculum.mode == "length" and not load_recipe().grpo.curriculum.enabled


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet"])
def test_a_missing_score_column_is_found_in_preflight(tmp_path, kind):
    from engine.data_check import check_corpus

    rows = [{"text": f"doc {i} " * 20, "level": i} for i in range(50)]
    f = tmp_path / f"d.{kind}"
    if kind == "jsonl":
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "txt":
        f.write_text("".join(r["text"] + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), f)
    d = DataConfig(path=str(f), curriculum=DataCurriculumConfig(mode="score", score_column="difficulty"))
    columns = "['text']" if kind == "txt" else "['level', 'text']" if kind == "jsonl" else "['text', 'level']"
    tail = " (.txt files have one column)" if kind == "txt" else ""
    assert check_corpus(d, None, None, 1) == [
        f"data.curriculum.score_column 'difficulty' is not a column of {f} (columns: {columns}); name a numeric "
        f"column, or set data.curriculum.mode: length{tail}"]
    if kind != "txt":
        ok = DataConfig(path=str(f), curriculum=DataCurriculumConfig(mode="score", score_column="level"))
        assert check_corpus(ok, None, None, 1) == []


def test_bad_input_from_the_entry_points_is_one_line_and_exit_2(tmp_path, capfd, monkeypatch):
    """bin/pretrain.py with a missing score column and bin/grpo.py with an inverted band: main() in this process
    (conftest.run_in_process; init_distributed made to fail, so nothing past preflight runs)."""
    import engine.grpo
    import engine.pretrain

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(40)))
    (tmp_path / "p.yaml").write_text(f"data:\n  path: {tmp_path / 'd.jsonl'}\n"
                                     "  curriculum: {mode: score, score_column: difficulty}\n")
    p = run_in_process(engine.pretrain.main, ["--deepspeed_config", ROOT / "ds_configs" / "zero3.json", "--config",
                                              tmp_path / "p.yaml", "--run_dir", tmp_path / "run"], capfd, monkeypatch,
                       RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_SIZE=1)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and lines == [
        f"error: data.curriculum.score_column 'difficulty' is not a column of {tmp_path / 'd.jsonl'} (columns: "
        "['text']); name a numeric column, or set data.curriculum.mode: length"], p.stderr

    tiny = (ROOT / "engine" / "recipes" / "grpo_tiny.yaml").read_text()
    bad = tiny.replace("  eval_every: 20\n", "  eval_every: 20\n  curriculum: {enabled: true, band: [0.9, 0.1]}\n")
    assert bad != tiny
    (tmp_path / "g.yaml").write_text(bad)
    p = run_in_process(engine.grpo.main, ["--deepspeed_config", ROOT / "ds_configs" / "zero3_grpo.json", "--config",
                                          tmp_path / "g.yaml", "--run_dir", tmp_path / "run"], capfd, monkeypatch,
                       cwd=ROOT, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_SIZE=1)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and lines == [
        f"error: recipe {tmp_path / 'g.yaml'}: grpo.curriculum.band [0.9, 0.1]: low must be <= high (inverted); "
        "write [0.1, 0.9]"], p.stderr
    assert not (tmp_path / "run").exists()


def test_the_unseen_share_rounds_half_up_and_the_band_holds_its_edges():
    """A batch of 10 with unseen_fraction 0.25 draws 3 unseen prompts (2.5 rounded half up, not to even), and a pass
    rate exactly at the band's edges (0.2, 0.8) is in the band. [fails if: round() to even, or an edge excluded]"""
    cur = PromptCurriculum(CurriculumConfig(enabled=True), 1000, 10, 7)
    cur.attempts[300:] = 8
    cur.passes[300:] = 4  # seen, in the band: prompts 0-299 are the unseen ones
    assert all((cur.draw(step) < 300).sum() == 3 for step in range(1, 20))
    cur = PromptCurriculum(CurriculumConfig(enabled=True), 4, 2, 0)
    cur.attempts[:] = 5
    cur.passes[:] = [1, 4, 0, 5]  # pass rates 0.2, 0.8, 0, 1
    assert cur.in_band().tolist() == [True, True, False, False]

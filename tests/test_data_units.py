"""engine/data.py against values worked out by hand: packing, the order of later epochs, streamed sequences and their
resume position, how a streamed file count that does not divide the ranks is split, the packed cache's key, and the
data curriculum's scores. Each case was a change to the code that every other test let through (they compare the
engine's data with itself)."""
import itertools
import json
import math
import re
import shutil

import numpy as np
import pytest

from engine.config import ConfigError, DataConfig, DataCurriculumConfig
from engine.data import PackedSequences, StreamedSequences, build_data, load_documents, load_tokenizer, pack

STORY = "Gus went to the harbor with 9 pens. Ada gave Gus 17 more. Now Gus has 26 pens."


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pack_joins_documents_with_eos_and_drops_the_tail():
    # joined: 1 2 EOS 3 EOS -> windows [1 2] [0 3]; the last EOS alone is shorter than a window: dropped
    assert pack([[1, 2], [3]], eos=0, seq_len=2).tolist() == [[1, 2], [0, 3]]
    assert pack([[5, 6, 7], [8]], eos=9, seq_len=3).tolist() == [[5, 6, 7], [9, 8, 9]]


def test_every_epoch_is_a_new_order_of_all_sequences():
    data = PackedSequences(np.arange(40).reshape(20, 2), seed=5)
    epochs = [[data.global_index(e * 20 + i) for i in range(20)] for e in range(3)]
    assert all(sorted(e) == list(range(20)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != epochs[2]
    other_seed = PackedSequences(np.arange(40).reshape(20, 2), seed=6)
    assert [other_seed.global_index(i) for i in range(20)] != epochs[0]


def test_streamed_sequences_are_the_rows_tokens_in_order_and_resume_where_they_were(tmp_path):
    """Rank 0 of 2 on one file: its 16-token sequences laid end to end are its rows' tokens, each row followed by EOS;
    a resume at micro-batch 3 (of 2 sequences) reads what the 4th micro-batch of a fresh stream is."""
    f = jsonl(tmp_path / "c.jsonl", [{"text": f"{STORY} {i}"} for i in range(10)])
    d = DataConfig(path=f, streaming=True, seq_len=16)
    tok = load_tokenizer(d.tokenizer)
    s = StreamedSequences(load_documents(d), tok, d, 0, 2, 0)
    want = list(itertools.chain.from_iterable(tok(r["text"])["input_ids"] + [tok.eos_token_id] for r in s.rows(0)))
    got = np.concatenate(list(itertools.islice(s.sequences(), 4))).tolist()
    assert len(want) >= 64 and got == want[:64]
    fresh = s.micro_batches(2, 0, 2)
    fourth = [next(fresh) for _ in range(4)][-1]
    step, batch = next(StreamedSequences(load_documents(d), tok, d, 0, 2, 0).micro_batches(2, 0, 2, start=3))
    assert step == 4 == fourth[0] and batch.equal(fourth[1])


def test_three_streamed_files_on_two_ranks_split_by_rows(tmp_path):
    """Files that are not a multiple of the ranks are read row by row (every other row), not dealt out 2 : 1."""
    (tmp_path / "d").mkdir()
    for name in "abc":
        jsonl(tmp_path / "d" / f"{name}.jsonl", [{"text": f"{name}{i}"} for i in range(10)])
    d = DataConfig(path=str(tmp_path / "d"), streaming=True)
    tok = load_tokenizer(d.tokenizer)
    sizes = [len(list(StreamedSequences(load_documents(d), tok, d, rank, 2, 0).rows(0))) for rank in (0, 1)]
    assert sizes == [15, 15]


def test_the_packed_cache_is_keyed_by_seq_len_and_the_curriculums_seed(tmp_path, monkeypatch):
    """Another seq_len packs again (not the cached windows of the old length); a length curriculum's ties are ordered
    by data.seed, so two seeds give two orders, and the cache returns each seed its own."""
    f = jsonl(tmp_path / "c.jsonl", [{"text": f"{STORY} {'x ' * (i % 3)}{i % 2}"} for i in range(40)])
    tok = load_tokenizer(DataConfig().tokenizer)
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "cache"))
    assert build_data(DataConfig(path=f, seq_len=16), tok, 0, 1, 3).sequences.shape[1] == 16
    assert build_data(DataConfig(path=f, seq_len=32), tok, 0, 1, 3).sequences.shape[1] == 32
    length = DataConfig(path=f, seq_len=16, curriculum=DataCurriculumConfig(mode="length"))
    monkeypatch.setenv("MOE_ENGINE_CACHE", "off")
    fresh = {seed: build_data(length, tok, 0, 1, seed).sequences for seed in (3, 4)}
    assert not np.array_equal(fresh[3], fresh[4])  # ties (equal lengths) in a seeded order
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "cache"))
    for seed in (3, 4, 3):
        assert np.array_equal(build_data(length, tok, 0, 1, seed).sequences, fresh[seed]), seed


@pytest.mark.parametrize("value, shown", [(True, "True"), (math.nan, "nan")])
def test_a_score_that_is_a_boolean_or_nan_is_refused(tmp_path, value, shown):
    """data.curriculum score column: true is not a number (JSON booleans are ints to Python), and NaN would sort
    last without a word."""
    import datasets

    rows = [{"text": "a b", "difficulty": 1.0}, {"text": "c d", "difficulty": value}]
    if isinstance(value, bool):  # JSON's true
        path = tmp_path / "d.jsonl"
        jsonl(path, rows)
    else:  # JSON has no NaN: a parquet file's float column
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    d = DataConfig(path=str(path), seq_len=4,
                   curriculum=DataCurriculumConfig(mode="score", score_column="difficulty"))
    with pytest.raises(ConfigError, match=rf"row 2 of {path} has {shown}, not a finite number"):
        build_data(d, load_tokenizer(d.tokenizer), 0, 1, 5)


def test_a_tokenizer_path_that_is_not_a_tokenizer_says_which(tmp_path, monkeypatch):
    """data.tokenizer as a path: one that does not exist, a file, and a directory without tokenizer files each get
    a line saying so and how to fix it (they said transformers' "Repo id must be in the form 'repo_name'" or
    "Couldn't instantiate the backend tokenizer from one of:"); the bundled directory and auto still load, as does a
    copy of it named from the home directory. [fails if: a missing path reaches transformers, a relative or home path
    is not checked, or a real tokenizer directory is refused]"""
    from engine.data import BUNDLED_TOKENIZER

    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    cases = {tmp_path / "nope": "no such directory", tmp_path / "file.txt": "not a directory",
             tmp_path / "empty": "the directory has no tokenizer files"}
    for path, says in cases.items():
        with pytest.raises(ConfigError) as e:
            load_tokenizer(str(path))
        assert str(e.value).startswith(f"data.tokenizer {path}: {says}"), str(e.value)
        assert "save_pretrained" in str(e.value)
    assert load_tokenizer(str(BUNDLED_TOKENIZER)).eos_token_id is not None
    assert load_tokenizer("auto").eos_token_id is not None
    # relative and home paths: checked as paths too; a home path loads (transformers alone took "~/tok" for a hub name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, says in (("./nope", "no such directory"), ("~/nope", "no such directory"), ("~/empty", "the directory")):
        with pytest.raises(ConfigError, match=f"^data.tokenizer {re.escape(name)}: {says}"):
            load_tokenizer(name)
    shutil.copytree(BUNDLED_TOKENIZER, tmp_path / "tok")
    assert len(load_tokenizer("~/tok")) == len(load_tokenizer("./tok")) == len(load_tokenizer(str(BUNDLED_TOKENIZER)))
    (tmp_path / "bpe").mkdir()  # a slow BPE tokenizer's files alone: past the check (transformers decides)
    (tmp_path / "bpe" / "vocab.json").write_text("{}")
    (tmp_path / "bpe" / "merges.txt").write_text("")
    with pytest.raises(ConfigError) as e:
        load_tokenizer("./bpe")
    assert "no tokenizer files" not in str(e.value)


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_streamed_micro_batches_are_the_streams_sequences_in_order(tmp_path):
    """A streamed rank's micro-batch k holds its sequences k x micro ... (k + 1) x micro - 1, from the start and on a
    resume at start k. [fails if: a resume skips one sequence too many or too few]"""
    d = DataConfig(path=_jsonl(tmp_path / "c.jsonl", [{"text": f"{STORY} {i}"} for i in range(10)]), streaming=True,
                   seq_len=16)
    tok = load_tokenizer(d.tokenizer)

    def stream():
        return StreamedSequences(load_documents(d), tok, d, 0, 2, 0)

    seqs = [s.tolist() for s in itertools.islice(stream().sequences(), 8)]
    step, batch = next(stream().micro_batches(2, 0, 2))
    assert step == 1 and batch.tolist() == seqs[0:2]
    step, batch = next(stream().micro_batches(2, 0, 2, start=3))
    assert step == 4 and batch.tolist() == seqs[6:8]


@pytest.mark.parametrize("files", [1, 2])
def test_streaming_follows_the_data_seed(tmp_path, files):
    """data.seed orders a streamed dataset: two seeds give a rank the same rows in another order, with one file on one
    rank and with two files on two ranks (a file each). [fails if: either shuffle ignores the seed]"""
    (tmp_path / "d").mkdir()
    for n in "ab"[:files]:
        _jsonl(tmp_path / "d" / f"{n}.jsonl", [{"text": f"{n}{i}"} for i in range(40)])
    d = DataConfig(path=str(tmp_path / "d"), streaming=True)
    tok = load_tokenizer(d.tokenizer)
    rows = {seed: [r["text"] for r in StreamedSequences(load_documents(d), tok, d, 0, files, seed).rows(0)]
            for seed in (1, 2)}
    assert rows[1] and sorted(rows[1]) == sorted(rows[2]) and rows[1] != rows[2]

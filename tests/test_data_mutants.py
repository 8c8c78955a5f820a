"""engine/data.py's own rules, one a test, each a change to data.py (a mutant) that every other fast test let
through: load_tokenizer's checks of a tokenizer directory and its one-line load error, vocab_problem's bound and
lines, which paths count as local and which files a folder gives (sorted, recursive, one format), cause() and
as_text's one-line messages, pack's int64 windows, PackedSequences' seeded epoch orders and its rank striding (a
global batch is the same sequences on 1 rank or N, and resume is exact), to_device on the CPU, StreamedSequences'
epochs, its row-numbered errors, a sequence yielded as soon as it is full, and four files dealt to two ranks,
ReadAhead's one step of look-ahead, cache_dir, and the packed cache (its key follows the file's bytes, the text
field and the tokenizer; a tokenizer without a backend is not cached; an unwritable cache or a damaged entry does
not stop a run; the entry's lock is exclusive).

No launcher, no model: a fake tokenizer that reads whitespace-separated integers (EOS 0), so every packed window
is worked out by hand in the docstrings; fake `datasets` streams where a test needs a row that raises; a real
`datasets` load only where the files themselves are the point. Expectations are literal values, never the code
under test run a second time."""
import fcntl
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import data
from engine.config import ConfigError, DataConfig
from engine.data import (PackedSequences, ReadAhead, StreamedSequences, as_text, build_data, cache_dir, cause,
                         data_files, load_tokenizer, looks_local, pack, packed_cache_key, to_device, vocab_problem)


# ------------------------------------------------------------------------------------------------ fakes


class Backend:
    def __init__(self, content: str):
        self.content = content

    def to_str(self) -> str:
        return self.content


class Tok:
    """A tokenizer that reads integers: "1 2" -> [1 + add, 2 + add]; EOS is 0. `backend`: the tokenizer.json text a
    fast tokenizer has (None: a slow tokenizer, which has no backend_tokenizer)."""

    eos_token_id = 0

    def __init__(self, add: int = 0, backend: str | None = "fake-v1"):
        self.add = add
        if backend is not None:
            self.backend_tokenizer = Backend(backend)

    def __call__(self, text):
        one = lambda t: [int(w) + self.add for w in t.split()]  # noqa: E731
        return {"input_ids": [one(t) for t in text] if isinstance(text, list) else one(text)}


class Docs:
    """A streamed dataset as StreamedSequences sees it: set_epoch, then iteration; `epochs(e)` gives epoch e's rows
    (a generator, so it may raise part way)."""

    def __init__(self, epochs):
        self.epochs, self.epoch, self.set = epochs, None, []

    def set_epoch(self, e):
        self.epoch = e
        self.set.append(e)

    def __iter__(self):
        return iter(self.epochs(self.epoch))


def streamed(epochs, seq_len=3, rank=1, world=2) -> StreamedSequences:
    """Rank 1 of 2's StreamedSequences over the fake rows (its __init__ needs real files; the rows are the point)."""
    s = object.__new__(StreamedSequences)
    s.docs, s.tok, s.rank, s.world = Docs(epochs), Tok(), rank, world
    s.d = DataConfig(path="corpus.jsonl", streaming=True, seq_len=seq_len)
    return s


def jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------------------ tokenizer


def test_a_tokenizer_directory_of_vocab_or_sentencepiece_files_is_loaded(tmp_path, monkeypatch):
    """A directory holding only vocab.txt (a WordPiece tokenizer) or only spiece.model (SentencePiece) has tokenizer
    files: it goes to transformers as the directory's path, and what transformers gives back is returned.
    [fails if: vocab.* or *.model is left out of the tokenizer-file patterns]"""
    import transformers

    asked = []
    fake = Tok()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name: asked.append(name) or fake)
    for name in ("vocab.txt", "spiece.model"):
        (tmp_path / name).mkdir()
        (tmp_path / name / name).write_text("x")
        assert load_tokenizer(str(tmp_path / name)) is fake
    assert asked == [str(tmp_path / "vocab.txt"), str(tmp_path / "spiece.model")]


def test_a_tokenizer_that_cannot_load_is_one_line_with_the_first_line_of_the_cause(monkeypatch):
    """transformers' error for a hub name it cannot load spans lines; the ConfigError keeps its first line only:
    "data.tokenizer org/nothing: cannot load (OSError: first line); point it at a tokenizer directory".
    [fails if: the whole multi-line message is kept]"""
    import transformers

    def fail(name):
        raise OSError("first line\nsecond line\nthird line")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(ConfigError) as e:
        load_tokenizer("org/nothing")
    assert str(e.value) == "data.tokenizer org/nothing: cannot load (OSError: first line); point it at a tokenizer " \
                           "directory"


def test_vocab_problem_allows_a_tokenizer_as_large_as_the_vocabulary_and_names_the_fix():
    """512 tokens fit 512 embeddings (None); 513 do not: against the recipe's vocab_size the line says to raise it to
    at least 513; against a loaded model it names the tokenizer, the model and the first id without an embedding.
    [fails if: the bound is < instead of <=, the line asks for the vocab size instead of the tokenizer's size, or
    the two lines are swapped]"""
    class Sized:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    assert vocab_problem(Sized(512), "auto", 512) is None
    assert vocab_problem(Sized(512), "auto", 512, model="m") is None
    assert vocab_problem(Sized(513), "auto", 512) == ("data.tokenizer has 513 tokens but model.vocab_size is 512; "
                                                      "raise model.vocab_size to at least 513")
    assert vocab_problem(Sized(513), "tok", 512, model="runs/m") == (
        "data.tokenizer tok has 513 tokens but runs/m has a vocabulary of 512: ids from 512 on have no embedding; "
        "set data.tokenizer to the tokenizer the model was trained with")


# ------------------------------------------------------------------------------------------------ files and lines


def test_what_counts_as_a_local_path(tmp_path, monkeypatch):
    """A name with a data suffix (corpus.jsonl, even not there yet), a home path and a relative path are local; a hub
    name (org/set) is not. [fails if: the suffix rule or the ~ prefix is dropped]"""
    monkeypatch.chdir(tmp_path)
    assert looks_local("corpus.jsonl") and looks_local("notes.txt") and looks_local("~/corpus")
    assert looks_local("./corpus") and not looks_local("org/set")


def test_a_folder_gives_its_files_sorted_and_recursively_and_one_format_only(tmp_path):
    """Files made in the order z, m, sub/b, a come back a, m, sub/b, z (sorted by path, subfolders included); a .csv
    file is refused with its name; a folder of .jsonl and .txt is refused as mixing json and text.
    [fails if: the files are not sorted, subfolders are not read, an unknown suffix passes, or two formats pass]"""
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    for name in ("z.jsonl", "m.jsonl", "sub/b.jsonl", "a.jsonl"):
        (d / name).write_text('{"text": "1"}\n')
    assert data_files(str(d)) == ("json", [str(d / "a.jsonl"), str(d / "m.jsonl"), str(d / "sub" / "b.jsonl"),
                                           str(d / "z.jsonl")])
    (tmp_path / "x.csv").write_text("text\n1\n")
    with pytest.raises(ConfigError) as e:
        data_files(str(tmp_path / "x.csv"))
    assert str(e.value) == f"data.path {tmp_path / 'x.csv'}: expected .jsonl/.json/.parquet/.txt files, found ['x.csv']"
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.jsonl").write_text('{"text": "1"}\n')
    (tmp_path / "two" / "b.txt").write_text("1\n")
    with pytest.raises(ConfigError) as e:
        data_files(str(tmp_path / "two"))
    assert str(e.value) == f"data.path {tmp_path / 'two'}: mixes formats ['json', 'text']; keep one format per folder"


def test_cause_is_the_innermost_error_in_one_line_of_at_most_300_characters():
    """An error raised while handling another: the inner one (KeyError 'inner'); one raised `from None`: itself; its
    whitespace runs become one space and its text stops at 300 characters ("x" * 400 -> "x" * 300).
    [fails if: implicit contexts are not followed, a suppressed context is followed, or the cut is shorter]"""
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("outer")
    except ValueError as e:
        assert cause(e) == "KeyError: 'inner'"
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("outer\n   line") from None
    except ValueError as e:
        assert cause(e) == "ValueError: outer line"
    assert cause(RuntimeError("x" * 400)) == "RuntimeError: " + "x" * 300


def test_a_row_whose_text_is_a_long_list_is_named_in_40_characters():
    """text = [0, 1, ..., 29] shows as its repr's first 40 characters: "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1"
    (1 + 10 x 3 for "[" and the one-digit items, + 4 + 4 for "10, " and "11, ", + "1"). [fails if: the value is not
    cut]"""
    d = DataConfig(path="c.jsonl")
    with pytest.raises(ConfigError) as e:
        as_text(list(range(30)), d, "row 3")
    assert str(e.value) == ("data.path c.jsonl: row 3 has text = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, not a "
                            "string; fix that row (preflight checks only the head of a big corpus: docs/data.md)")


class HubSet:
    """What datasets.load_dataset returns, as load_documents looks at it: column_names (None for some streamed
    sets, whose first row then names the columns) and iteration."""

    def __init__(self, column_names, rows):
        self.column_names, self.rows = column_names, rows

    def __iter__(self):
        return iter(self.rows)


def test_a_hub_dataset_is_loaded_with_its_configuration_split_and_streaming(monkeypatch):
    """data.path org/set with data.name wiki-raw and data.split validation: load_dataset("org/set", "wiki-raw",
    split="validation", streaming=False); load_documents(d, streaming=True) streams it whatever data.streaming says.
    [fails if: data.name or data.split is not passed, or the streaming argument is ignored]"""
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: calls.append((a, k)) or HubSet(["text"], [{"text": "1"}]))
    d = DataConfig(path="org/set", name="wiki-raw", split="validation")
    data.load_documents(d)
    data.load_documents(d, streaming=True)
    assert calls == [(("org/set", "wiki-raw"), {"split": "validation", "streaming": False}),
                     (("org/set", "wiki-raw"), {"split": "validation", "streaming": True})]


def test_a_stream_without_column_names_is_checked_on_its_first_row(monkeypatch):
    """A streamed set whose column_names is None: its first row {"text": "1", "id": 7} names the columns, so
    text_field text is found and the set is returned; text_field body is refused listing ['text', 'id'].
    [fails if: None column names count as no columns]"""
    import datasets

    ds = HubSet(None, [{"text": "1", "id": 7}])
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: ds)
    assert data.load_documents(DataConfig(path="org/set", streaming=True)) is ds
    with pytest.raises(ConfigError) as e:
        data.load_documents(DataConfig(path="org/set", streaming=True, text_field="body"))
    assert str(e.value) == ("data.text_field 'body' is not a column of org/set (columns: ['text', 'id']); set "
                            "data.text_field")


def test_a_missing_file_and_a_row_without_text_are_their_own_lines_not_wrapped(tmp_path):
    """data.path that does not exist: data_files' line as it is, not inside "cannot load (ConfigError: ...)"; a
    map-style row 2 with text null: as_text's line naming row 2, not inside "cannot read every row (...)".
    [fails if: either function's `except ConfigError: raise` is dropped]"""
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError) as e:
        data.load_documents(DataConfig(path=missing))
    assert str(e.value) == (f"data.path {missing}: no such file or folder (give a .jsonl/.json/.parquet/.txt file, a "
                            "folder of them, or a hub dataset name)")
    f = jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}, {"text": None}])
    with pytest.raises(ConfigError) as e:
        data.pack_corpus(DataConfig(path=f, seq_len=2), Tok(), 0, None, None)
    assert str(e.value) == (f"data.path {f}: row 2 has text = None, not a string; fix that row (preflight checks only "
                            "the head of a big corpus: docs/data.md)")


# ------------------------------------------------------------------------------------------------ map-style


def test_packed_windows_and_micro_batches_are_int64():
    """Token ids are int64 (torch's embedding and cross-entropy labels take long): pack's array and the micro-batch
    tensor. [fails if: pack uses int32]"""
    windows = pack([[1, 2], [3]], eos=0, seq_len=2)
    assert windows.dtype == np.int64
    _, batch = next(PackedSequences(windows, seed=0).micro_batches(1, 0, 1))
    assert batch.dtype == torch.int64


def test_zero_windows_are_refused_when_built():
    """A corpus that packs into no window (shape (0, 4)) is one ConfigError at once, not a division by zero at the
    first read. [fails if: the empty check never fires]"""
    with pytest.raises(ConfigError) as e:
        PackedSequences(np.zeros((0, 4), dtype=np.int64), seed=0)
    assert str(e.value) == "data: the dataset packs into zero sequences; use more text or a smaller data.seq_len"


def test_epoch_orders_are_numpys_permutation_of_seed_then_epoch():
    """10 windows, seed 5: epoch e reads default_rng([5, e]).permutation(10); written out, epoch 0 is
    7 6 1 3 2 4 0 9 5 8 and epoch 1 is 6 7 4 2 5 0 9 8 3 1 (the order a checkpoint's data position was saved under:
    another rule reads other data after a resume). [fails if: the seed and epoch are swapped, summed, or the epoch
    is left out]"""
    d = PackedSequences(np.arange(10).reshape(10, 1), seed=5)
    assert [d.global_index(p) for p in range(10)] == [7, 6, 1, 3, 2, 4, 0, 9, 5, 8]
    assert [d.global_index(p) for p in range(10, 20)] == [6, 7, 4, 2, 5, 0, 9, 8, 3, 1]
    assert [d.global_index(p) for p in range(10)] == [7, 6, 1, 3, 2, 4, 0, 9, 5, 8]  # back to epoch 0


def test_micro_batch_j_of_rank_r_holds_positions_j_micro_world_plus_r_micro():
    """8 windows [2k, 2k+1] read in order (a curriculum's first epoch), micro 2 on 2 ranks: micro-batch 0 of rank 1
    is positions 2, 3 (windows [4 5] [6 7]); micro-batch 1 of rank 0 is positions 4, 5 ([8 9] [10 11]); a resume of
    rank 1 at micro-batch 1 starts at positions 6, 7 ([12 13] [14 15]), numbered step 2. So step 1 of the two ranks
    is positions 0-3, as one rank with micro 4 reads it. [fails if: ranks stride rank-major (j*micro +
    r*micro*world): disjoint and covering, but another global batch]"""
    d = PackedSequences(np.arange(16).reshape(8, 2), seed=0, ordered=True)
    step, batch = next(d.micro_batches(2, 1, 2))
    assert step == 1 and batch.tolist() == [[4, 5], [6, 7]]
    r0 = d.micro_batches(2, 0, 2)
    assert [b.tolist() for _, b in (next(r0), next(r0))] == [[[0, 1], [2, 3]], [[8, 9], [10, 11]]]
    step, batch = next(d.micro_batches(2, 1, 2, start=1))
    assert step == 2 and batch.tolist() == [[12, 13], [14, 15]]


def test_to_device_on_the_cpu_is_a_plain_copy():
    """On the CPU a batch goes over as it is (pinned memory is for CUDA only: without an accelerator pin_memory
    raises). [fails if: the cuda test is inverted]"""
    got = to_device(torch.tensor([[1, 2]]), "cpu")
    assert got.device.type == "cpu" and got.tolist() == [[1, 2]]


# ------------------------------------------------------------------------------------------------ streaming


def test_every_epoch_of_a_stream_is_set_before_it_is_read():
    """Epoch 0 holds "1 2" and "3", epoch 1 holds "4 5 6", later epochs "7": with EOS 0 and seq_len 3 the stream is
    [1 2 0] [3 0 4] [5 6 0] [7 0 7], int64 like the packed windows; set_epoch is called with 0, 1, 2, ... (datasets reshuffles by it).
    [fails if: set_epoch is not told the epoch, or the sequences are int32]"""
    rows = {0: ["1 2", "3"], 1: ["4 5 6"]}
    s = streamed(lambda e: ({"text": t} for t in rows.get(e, ["7"])))
    it = s.sequences()
    first = next(it)
    assert first.dtype == np.int64 and first.tolist() == [1, 2, 0]
    assert [next(it).tolist() for _ in range(3)] == [[3, 0, 4], [5, 6, 0], [7, 0, 7]]
    assert s.docs.set[:3] == [0, 1, 2]


def test_a_rank_whose_share_is_empty_is_refused_not_looped_on():
    """Rank 1 of 2 gets no rows in an epoch: one ConfigError naming the rank and the fix (before: sequences() would
    start epoch after empty epoch forever). [fails if: an empty share is let through]"""
    s = streamed(lambda e: iter([]))
    with pytest.raises(ConfigError) as e:
        list(s.rows(0))
    assert str(e.value) == ("data.path corpus.jsonl: rank 1 of 2 got no rows to stream; add rows, or files in a "
                            "multiple of the data-parallel ranks")


def test_a_full_sequence_is_yielded_before_the_next_row_is_read():
    """Row "1 2" plus EOS fills a 3-token sequence exactly: [1 2 0] comes out before row 2 (text null) is read, and
    only the next sequence raises (ReadAhead then stops the run a step later, not a step early).
    [fails if: a sequence waits for more than seq_len tokens]"""
    s = streamed(lambda e: iter([{"text": "1 2"}, {"text": None}]))
    it = s.sequences()
    assert next(it).tolist() == [1, 2, 0]
    with pytest.raises(ConfigError) as e:
        next(it)
    assert str(e.value) == ('data.path corpus.jsonl: the row {"text": null} (row 2 of rank 1\'s shuffled share) has '
                            "text = None, not a string; fix that row (preflight checks only the head of a big corpus: "
                            "docs/data.md)")


def test_a_row_that_cannot_be_read_is_named_by_its_number_and_epoch():
    """Epoch 0 reads "1 2" and "3"; epoch 1 reads "4" and then its second row raises ValueError("bad bytes"): the
    stream gives [1 2 0] [3 0 4], then the line names row 2 of rank 1's share in epoch 1.
    [fails if: the row is counted from 0, or the epoch is shown off by one]"""
    def epochs(e):
        yield from ({"text": t} for t in (["1 2", "3"] if e == 0 else ["4"]))
        if e == 1:
            raise ValueError("bad bytes")

    it = streamed(epochs).sequences()
    assert [next(it).tolist() for _ in range(2)] == [[1, 2, 0], [3, 0, 4]]
    with pytest.raises(ConfigError) as e:
        next(it)
    assert str(e.value) == ("data.path corpus.jsonl: cannot read row 2 of rank 1's share (epoch 1): ValueError: bad "
                            "bytes; fix the file")


def test_four_streamed_files_on_two_ranks_give_each_rank_every_other_file(tmp_path):
    """Files a, b, c, d (three rows each) on 2 ranks: rank 0 reads a and c, rank 1 b and d, all their rows.
    [fails if: a rank keeps one file only]"""
    (tmp_path / "d").mkdir()
    for name in "abcd":
        jsonl(tmp_path / "d" / f"{name}.jsonl", [{"text": f"{name}{i}"} for i in range(3)])
    d = DataConfig(path=str(tmp_path / "d"), streaming=True)
    got = [sorted(r["text"] for r in StreamedSequences(data.load_documents(d), Tok(), d, rank, 2, 0).rows(0))
           for rank in (0, 1)]
    assert got == [["a0", "a1", "a2", "c0", "c1", "c2"], ["b0", "b1", "b2", "d0", "d1", "d2"]]


# ------------------------------------------------------------------------------------------------ ReadAhead


def test_read_ahead_reads_one_step_and_keeps_its_order():
    """Micro-batches 1, 2, then a ConfigError at the third; 2 per step: fill() reads 1 and 2 and reports nothing (the
    error belongs to the next step), next() gives 1 then 2; the next fill() returns the error.
    [fails if: fill reads per_step + 1, the ready batches come out last-first, or fill returns None on an
    error]"""
    def batches():
        yield 1
        yield 2
        raise ConfigError("row 3 is bad")

    ra = ReadAhead(batches(), 2)
    assert ra.fill() is None
    assert [next(ra), next(ra)] == [1, 2]
    err = ra.fill()
    assert isinstance(err, ConfigError) and str(err) == "row 3 is bad" and ra.error is err


def test_read_ahead_lets_an_error_that_is_not_a_config_error_through():
    """A bug in reading (a RuntimeError) is raised by fill(), not kept as a data error to stop at a step boundary.
    [fails if: fill catches every exception]"""
    def batches():
        raise RuntimeError("a bug")
        yield

    with pytest.raises(RuntimeError, match="a bug"):
        ReadAhead(batches(), 2).fill()


# ------------------------------------------------------------------------------------------------ packed cache


def test_cache_dir_default_home_and_off(monkeypatch, tmp_path):
    """Unset: $HOME/.cache/moe_engine/packed; "~/c": $HOME/c; "OFF" and "None" (any case) disable it.
    [fails if: the default folder changes or "off" is matched case-sensitively]"""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MOE_ENGINE_CACHE", raising=False)
    assert cache_dir() == tmp_path / ".cache" / "moe_engine" / "packed"
    monkeypatch.setenv("MOE_ENGINE_CACHE", "~/c")
    assert cache_dir() == tmp_path / "c"
    for off in ("OFF", "None", "off"):
        monkeypatch.setenv("MOE_ENGINE_CACHE", off)
        assert cache_dir() is None


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_file_rewritten_with_its_size_kept_is_packed_again(tmp_path, cache):
    """Rows "1 2" and "3" pack (EOS 0, seq_len 2) into [1 2] [0 3]. Rewritten as "1 4" (the same size, a later
    mtime): [1 4] [0 3], read afresh, not the cached windows of the old bytes. [fails if: the key leaves out the
    mtime]"""
    f = tmp_path / "c.jsonl"
    d = DataConfig(path=jsonl(f, [{"text": "1 2"}, {"text": "3"}]), seq_len=2)
    os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    assert build_data(d, Tok(), 0, 1, 0).sequences.tolist() == [[1, 2], [0, 3]]
    jsonl(f, [{"text": "1 4"}, {"text": "3"}])
    os.utime(f, ns=(2_000_000_000, 2_000_000_000))
    assert build_data(d, Tok(), 0, 1, 0).sequences.tolist() == [[1, 4], [0, 3]]


def test_the_cache_key_follows_the_text_field_and_the_tokenizer(tmp_path, cache):
    """Rows {text "1 2", body "5 6"} and {text "3", body "7"}, seq_len 2: text gives [1 2] [0 3], body [5 6] [0 7];
    a tokenizer that adds 10 to every id (another tokenizer.json) gives [11 12] [0 13]. [fails if: the key leaves
    out the text field or the tokenizer's content]"""
    f = jsonl(tmp_path / "c.jsonl", [{"text": "1 2", "body": "5 6"}, {"text": "3", "body": "7"}])
    assert build_data(DataConfig(path=f, seq_len=2), Tok(), 0, 1, 0).sequences.tolist() == [[1, 2], [0, 3]]
    body = DataConfig(path=f, seq_len=2, text_field="body")
    assert build_data(body, Tok(), 0, 1, 0).sequences.tolist() == [[5, 6], [0, 7]]
    other = Tok(add=10, backend="fake-v2")
    assert build_data(DataConfig(path=f, seq_len=2), other, 0, 1, 0).sequences.tolist() == [[11, 12], [0, 13]]


def test_without_a_curriculum_two_seeds_share_one_cache_entry(tmp_path, cache):
    """The windows [1 2] [0 3] do not depend on the seed without a curriculum (it only shuffles them when read):
    seeds 1 and 2 write one entry between them. [fails if: the seed is in every key]"""
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}, {"text": "3"}]), seq_len=2)
    for seed in (1, 2):
        assert build_data(d, Tok(), 0, 1, seed).sequences.tolist() == [[1, 2], [0, 3]]
    assert len(list(cache.glob("*.npz"))) == 1


def test_a_reversed_length_curriculum_packs_long_to_short(tmp_path, cache):
    """Documents "1 2 3", "4", "5 6" (3, 1, 2 tokens), length curriculum reversed: long to short, "1 2 3", "5 6",
    "4", so with EOS 0 and seq_len 3 the windows are [1 2 3] [0 5 6] [0 4 0], read in that order.
    [fails if: data.curriculum.reverse is not passed on]"""
    from engine.config import DataCurriculumConfig

    f = jsonl(tmp_path / "c.jsonl", [{"text": "1 2 3"}, {"text": "4"}, {"text": "5 6"}])
    d = DataConfig(path=f, seq_len=3, curriculum=DataCurriculumConfig(mode="length", reverse=True))
    got = build_data(d, Tok(), 0, 1, 0)
    assert got.ordered and got.sequences.tolist() == [[1, 2, 3], [0, 5, 6], [0, 4, 0]]


def test_a_tokenizer_without_a_backend_is_not_cached(tmp_path, cache):
    """A slow tokenizer (no backend_tokenizer: its content cannot be hashed) has no key, packs without a cache and
    writes nothing: [1 2] [0 3]. [fails if: a key is made without the backend]"""
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}, {"text": "3"}]), seq_len=2)
    assert packed_cache_key(d, Tok(backend=None), 0) is None
    assert build_data(d, Tok(backend=None), 0, 1, 0).sequences.tolist() == [[1, 2], [0, 3]]
    assert not cache.exists() or not list(cache.iterdir())


def test_a_cache_that_cannot_be_written_does_not_stop_the_run(tmp_path, monkeypatch):
    """MOE_ENGINE_CACHE names a plain file (no folder can be made there): the data is packed and returned, [1 2]
    [0 3]. [fails if: an OSError from writing the cache escapes]"""
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "file"))
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}, {"text": "3"}]), seq_len=2)
    assert build_data(d, Tok(), 0, 1, 0).sequences.tolist() == [[1, 2], [0, 3]]


def test_a_cache_entry_that_is_not_an_npz_is_packed_again(tmp_path, cache):
    """The entry overwritten with text (np.load: ValueError, it would need pickle): the corpus is packed again,
    [1 2] [0 3]. [fails if: only OSError is taken for a damaged entry]"""
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}, {"text": "3"}]), seq_len=2)
    build_data(d, Tok(), 0, 1, 0)
    [entry] = cache.glob("*.npz")
    entry.write_bytes(b"not an npz file")
    assert build_data(d, Tok(), 0, 1, 0).sequences.tolist() == [[1, 2], [0, 3]]


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut short"], ids=["empty", "truncated-zip"])
def test_an_empty_or_cut_short_cache_entry_is_packed_again(tmp_path, cache, content):
    """An entry left empty or cut short (a crash between os.replace and the data reaching the disk, before the
    entry was fsynced; or a copy cut short) is packed again, [1 2] [0 3]: np.load raises EOFError and
    zipfile.BadZipFile for these. [fails if: only OSError, ValueError and KeyError are taken for damage]"""
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}, {"text": "3"}]), seq_len=2)
    build_data(d, Tok(), 0, 1, 0)
    [entry] = cache.glob("*.npz")
    entry.write_bytes(content)
    assert build_data(d, Tok(), 0, 1, 0).sequences.tolist() == [[1, 2], [0, 3]]


def test_the_cache_entry_is_locked_exclusively_while_it_is_packed(tmp_path, cache, monkeypatch):
    """While pack_corpus runs, another open file of the entry's .lock cannot take even a shared lock (flock
    LOCK_SH | LOCK_NB: BlockingIOError), so a second rank waits rather than reading a half-made entry.
    [fails if: the lock is shared, or build_data packs without it]"""
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}, {"text": "3"}]), seq_len=2)
    key = packed_cache_key(d, Tok(), 0)
    real, seen = data.pack_corpus, []

    def probe(*a, **k):
        with open(cache / f"{key}.lock", "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
                seen.append("free")
            except BlockingIOError:
                seen.append("held")
        return real(*a, **k)

    monkeypatch.setattr(data, "pack_corpus", probe)
    assert build_data(d, Tok(), 0, 1, 0).sequences.tolist() == [[1, 2], [0, 3]]
    assert seen == ["held"]

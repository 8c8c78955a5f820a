"""engine/data_check.py's own rules, one a test, each a change to data_check.py (a mutant) that every other fast test
let through: streaming's refusals (which empty file, how many; Parquet shards without rows), when the token check
runs and how much it tokenizes, the score column named per file, the messages for a folder (all files empty, columns
the first file has not, three bad files and the count of the rest), the sampled head (a file of exactly the sample,
a cut mid-line, a cut inside a character, a long first row's tokens, a .txt file's rows), JSON that is not JSON
lines, the GRPO/pretraining hints, Parquet's schema checks, the hub checks with datasets' builder faked, and
reachable()'s probe. Last, the bugs the audit found (fixed since), each a test of the right behaviour.

No launcher, no network, no model: a tokenizer stand-in that gives one token per text (check_tokens adds one EOS per
document), files written in tmp_path, SAMPLE_BYTES made small where a test needs a file bigger than the sample.
Expectations are literal values worked out in the docstrings, never the code under test run a second time."""
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import data_check
from engine.config import ConfigError, DataConfig, DataCurriculumConfig
from engine.data_check import check_corpus, check_prompt_file, reachable


def one_id_per_text(texts):
    """One token per text; with its EOS, 2 tokens a document."""
    return {"input_ids": [[7] for _ in texts]}


def jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def parquet(path: Path, columns: dict, **kw) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, **kw)
    return str(path)


def folder(tmp_path: Path, name: str = "d") -> Path:
    (tmp_path / name).mkdir()
    return tmp_path / name


STEP_4 = "one step needs {need} tokens ({batch} sequences: the DS config's train_batch_size); add text, or lower " \
         "data.seq_len or the batch"


# ------------------------------------------------------------------------------------------------ streaming


def test_streaming_names_the_first_empty_file_and_counts_them(tmp_path):
    """Four files streamed, a.jsonl and c.jsonl empty: the line names the first (a.jsonl) and counts 2.
    [fails if: the last empty file is named, or the count of empty files is not len(empty)]"""
    d = folder(tmp_path)
    for name in "abcd":
        (d / f"{name}.jsonl").write_text("" if name in "ac" else '{"text": "x"}\n')
    assert check_corpus(DataConfig(path=str(d), streaming=True), None, None, 2) == [
        f"data.path {d}: {d / 'a.jsonl'} is empty (2 empty file(s)); streaming hands whole files to ranks, so remove "
        "the empty ones"]


def test_streaming_parquet_shards_without_rows_split_rows_when_the_files_do_not_divide(tmp_path):
    """Three Parquet files (two written with no rows: not empty on disk) on 2 ranks: 3 is no multiple of 2, so the
    ranks split rows, and the one row leaves rank 1 none. [fails if: rows are split only when there are fewer files
    than ranks (len(files) < ranks instead of len(files) % ranks)]"""
    import pyarrow as pa

    d = folder(tmp_path)
    for name in ("a", "b"):
        parquet(d / f"{name}.parquet", {"text": pa.array([], type=pa.string())})
    parquet(d / "c.parquet", {"text": ["one row"]})
    assert check_corpus(DataConfig(path=str(d), streaming=True), None, None, 2) == [
        f"data.path {d}: 1 rows in 3 file(s); streaming on 2 data-parallel ranks splits rows (rank r reads rows r, "
        "r + ranks, ...), so some rank would get none; add rows, or files in a multiple of the ranks (each rank then "
        "reads its own files)"]


def test_streaming_a_txt_file_counts_its_lines_as_rows(tmp_path):
    """A .txt file's lines are its rows: 2 lines stream on 2 ranks; 1 line on 2 ranks is refused with its count.
    [fails if: a .txt file's lines are not added to the row count]"""
    (tmp_path / "two.txt").write_text("a b\nc d\n")
    (tmp_path / "one.txt").write_text("a b\n")
    assert check_corpus(DataConfig(path=str(tmp_path / "two.txt"), streaming=True), None, None, 2) == []
    assert check_corpus(DataConfig(path=str(tmp_path / "one.txt"), streaming=True), None, None, 2)[0].startswith(
        f"data.path {tmp_path / 'one.txt'}: 1 rows in 1 file(s); streaming on 2 data-parallel ranks splits rows")


# ------------------------------------------------------------------------------------------------ the token check


def test_the_token_check_needs_both_a_batch_and_a_tokenizer(tmp_path):
    """batch None (a broken DS config, reported on its own) or no tokenizer: no token check, no error. [fails if:
    the token check runs without a batch (None * seq_len) or without a tokenizer (None called)]"""
    f = jsonl(tmp_path / "c.jsonl", [{"text": "a"}])

    def tok(texts):
        raise AssertionError("tokenized without a batch")

    assert check_corpus(DataConfig(path=f), tok, None, 1) == []
    assert check_corpus(DataConfig(path=f), None, 8, 1) == []


def test_tokenizing_stops_once_one_steps_tokens_are_seen(tmp_path):
    """1000 one-word lines and a step of 1 x 4 tokens: one call of 256 texts (512 tokens) is enough; the other 744
    lines are never tokenized. [fails if: every text is tokenized whatever the need, or texts go to the tokenizer
    one at a time]"""
    (tmp_path / "c.txt").write_text("w\n" * 1000)
    calls = []
    assert check_corpus(DataConfig(path=str(tmp_path / "c.txt"), seq_len=4),
                        lambda texts: calls.append(len(texts)) or one_id_per_text(texts), 1, 1) == []
    assert calls == [256]


def test_an_estimate_from_a_sample_without_bytes_is_zero_tokens_not_a_crash(tmp_path):
    """17 Parquet files without rows: 9 are sampled (every 2nd), none gives a row, so 0 bytes of rows are read; the
    estimate is 0 tokens and the line says so. [fails if: the tokens per byte divide by the bytes read unguarded
    (ZeroDivisionError)]"""
    import pyarrow as pa

    d = folder(tmp_path)
    for i in range(17):
        parquet(d / f"{i:02d}.parquet", {"text": pa.array([], type=pa.string())})
    assert check_corpus(DataConfig(path=str(d), seq_len=4), one_id_per_text, 1, 1) == [
        f"data.path {d}: about 0 tokens (estimated from its first 0 bytes), 0 sequences of data.seq_len 4; "
        + STEP_4.format(need=4, batch=1)]


def test_parquet_files_past_the_sample_are_estimated_not_counted(tmp_path):
    """17 Parquet files of one row "abc" (the same size s each): 9 sampled, each read whole (2 tokens each, 18 in
    9 x s bytes); the 8 others are not read, so the count is an estimate, 18 / 9s x 17s = 34, not 18 counted.
    [fails if: a wholly read Parquet file marks the sample complete though files were left out]"""
    d = folder(tmp_path)
    for i in range(17):
        parquet(d / f"{i:02d}.parquet", {"text": ["abc"]})
    size = os.path.getsize(d / "00.parquet")
    assert {os.path.getsize(f) for f in d.iterdir()} == {size}
    assert check_corpus(DataConfig(path=str(d), seq_len=4), one_id_per_text, 100, 1) == [
        f"data.path {d}: about 34 tokens (estimated from its first {9 * size} bytes), 8 sequences of data.seq_len 4; "
        + STEP_4.format(need=400, batch=100)]


# ------------------------------------------------------------------------------------------------ score column


def test_a_missing_score_column_in_a_folder_names_the_file(tmp_path):
    """A folder of two JSON-lines files (and one of two Parquet files) whose second lacks the score column: the line
    names that file, not the folder. [fails if: a folder's missing score column names data.path instead of the
    file (JSON or Parquet)]"""
    score = DataCurriculumConfig(mode="score", score_column="level")
    j = folder(tmp_path, "j")
    jsonl(j / "a.jsonl", [{"text": "x", "level": 1}])
    jsonl(j / "b.jsonl", [{"text": "y"}])
    assert check_corpus(DataConfig(path=str(j), curriculum=score), None, None, 1) == [
        f"data.curriculum.score_column 'level' is not a column of {j / 'b.jsonl'} (columns: ['text']); name a numeric "
        "column, or set data.curriculum.mode: length"]
    p = folder(tmp_path, "p")
    parquet(p / "a.parquet", {"text": ["x"], "level": [1]})
    parquet(p / "b.parquet", {"text": ["y"]})
    assert check_corpus(DataConfig(path=str(p), curriculum=score), None, None, 1) == [
        f"data.curriculum.score_column 'level' is not a column of {p / 'b.parquet'} (columns: ['text']); name a "
        "numeric column, or set data.curriculum.mode: length"]


def test_a_single_parquet_file_missing_the_score_column_is_named_as_given(tmp_path, monkeypatch):
    """One file given as ./d.parquet: the line names data.path as the user wrote it (./d.parquet), not the resolved
    file name. [fails if: a single Parquet file's missing score column names the listed file instead of data.path]"""
    monkeypatch.chdir(tmp_path)
    parquet(tmp_path / "d.parquet", {"text": ["x"]})
    d = DataConfig(path="./d.parquet", curriculum=DataCurriculumConfig(mode="score", score_column="level"))
    assert check_corpus(d, None, None, 1) == [
        "data.curriculum.score_column 'level' is not a column of ./d.parquet (columns: ['text']); name a numeric "
        "column, or set data.curriculum.mode: length"]


def test_an_unreadable_parquet_file_does_not_end_the_score_column_check(tmp_path):
    """17 Parquet files (every 2nd sampled): 01.parquet, not sampled, is not Parquet (refused where it is loaded);
    03.parquet, not sampled either, lacks the score column and is still named. [fails if: the schema check stops at
    the first file it cannot read]"""
    d = folder(tmp_path)
    for i in range(17):
        parquet(d / f"{i:02d}.parquet", {"text": ["x"], "level": [1]} if i != 3 else {"text": ["x"]})
    (d / "01.parquet").write_bytes(b"not parquet")
    d_cfg = DataConfig(path=str(d), curriculum=DataCurriculumConfig(mode="score", score_column="level"))
    assert check_corpus(d_cfg, None, None, 1) == [
        f"data.curriculum.score_column 'level' is not a column of {d / '03.parquet'} (columns: ['text']); name a "
        "numeric column, or set data.curriculum.mode: length"]


# ------------------------------------------------------------------------------------------------ a folder's lines


def test_a_folder_of_empty_files_says_all_are_empty(tmp_path):
    """Two files of 0 bytes: "all 2 files are empty", not "the file is empty". [fails if: the one-file wording is
    used for any number of files]"""
    d = folder(tmp_path)
    (d / "a.jsonl").write_text("")
    (d / "b.jsonl").write_text("")
    assert check_corpus(DataConfig(path=str(d)), None, None, 1) == [
        f"data.path {d}: all 2 files are empty (0 bytes); put the data in it or point data.path at it"]


def test_files_with_columns_the_first_has_not_are_named_and_counted(tmp_path):
    """a.jsonl has text; b.jsonl also lang, c.jsonl also src: the line names b (the first such file) and counts 2.
    [fails if: the last such file is named, or the count is not the number of such files]"""
    d = folder(tmp_path)
    jsonl(d / "a.jsonl", [{"text": "x"}])
    jsonl(d / "b.jsonl", [{"text": "x", "lang": "en"}])
    jsonl(d / "c.jsonl", [{"text": "x", "src": "web"}])
    assert check_corpus(DataConfig(path=str(d)), None, None, 1) == [
        f"data.path {d}: {d / 'b.jsonl'} has the column(s) ['lang'] that the first file {d / 'a.jsonl'} has not (2 "
        "such files); datasets reads every file with the first one's columns: give every file the same columns"]


def test_three_bad_files_are_named_and_the_rest_counted(tmp_path):
    """Four files of five with a null text: three named, "and 1 more of the 5 files checked"; three bad files of four: all three
    named and no count. [fails if: two are named, the rest is counted from two, the count says `more` at exactly 3,
    or the files checked are counted as the bad ones]"""
    bad = "row 1 has no 'text' (null) (bad: 1 of the 1 rows); fix those rows or set data.text_field"
    five = folder(tmp_path, "five")
    for name in "abcd":
        jsonl(five / f"{name}.jsonl", [{"text": None}])
    jsonl(five / "e.jsonl", [{"text": "x"}])
    assert check_corpus(DataConfig(path=str(five)), None, None, 1) == [
        f"data.path {five}: " + "; ".join(f"{five / n}.jsonl: {bad}" for n in "abc")
        + "; and 1 more of the 5 files checked"]
    four = folder(tmp_path, "four")
    for name in "abc":
        jsonl(four / f"{name}.jsonl", [{"text": None}])
    jsonl(four / "d.jsonl", [{"text": "x"}])
    assert check_corpus(DataConfig(path=str(four)), None, None, 1) == [
        f"data.path {four}: " + "; ".join(f"{four / n}.jsonl: {bad}" for n in "abc")]


def test_a_missing_folder_is_its_line_not_a_traceback(tmp_path):
    """data.path that does not exist: data_files' ConfigError becomes the line. [fails if: check_corpus lets the
    ConfigError out]"""
    assert check_corpus(DataConfig(path=str(tmp_path / "gone.jsonl")), None, None, 1) == [
        f"data.path {tmp_path / 'gone.jsonl'}: no such file or folder (give a .jsonl/.json/.parquet/.txt file, a "
        "folder of them, or a hub dataset name)"]


# ------------------------------------------------------------------------------------------------ the sampled head


def test_a_file_of_exactly_the_sample_is_read_whole(tmp_path, monkeypatch):
    """SAMPLE_BYTES 64 and a file of 4 rows of 16 bytes (64 bytes): read whole, so its 8 tokens are counted, not
    estimated. [fails if: a file of exactly the sample's size is taken as cut (len(raw) < limit)]"""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 64)
    f = jsonl(tmp_path / "c.jsonl", [{"text": "abc"}] * 4)
    assert os.path.getsize(f) == 64
    assert check_corpus(DataConfig(path=f, seq_len=4), one_id_per_text, 3, 1) == [
        f"data.path {f}: 8 tokens, 2 sequences of data.seq_len 4; " + STEP_4.format(need=12, batch=3)]


def test_a_head_cut_mid_line_counts_the_bytes_of_whole_lines_only(tmp_path, monkeypatch):
    """SAMPLE_BYTES 100, 4 rows of 40 bytes (160): the head is cut back to 2 whole rows (80 bytes, 4 tokens), so the
    estimate is 4 / 80 x 160 = 8, exact: a step of 2 x 4 passes and 3 x 4 is refused with it. [fails if: the head is
    not cut back to whole lines (the cut row's bytes counted: 4 / 100 x 160 = 6)]"""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 100)
    f = jsonl(tmp_path / "c.jsonl", [{"text": "x" * 27}] * 4)
    assert os.path.getsize(f) == 160
    assert check_corpus(DataConfig(path=f, seq_len=4), one_id_per_text, 2, 1) == []
    assert check_corpus(DataConfig(path=f, seq_len=4), one_id_per_text, 3, 1) == [
        f"data.path {f}: about 8 tokens (estimated from its first 80 bytes), 2 sequences of data.seq_len 4; "
        + STEP_4.format(need=12, batch=3)]


def test_a_long_first_row_cut_inside_a_character_is_utf8(tmp_path, monkeypatch):
    """SAMPLE_BYTES 51 and a first row '{"text": "' + 100 x 'é' (2 bytes each): byte 51 cuts the 21st 'é' in half; the
    head is decoded as the start of a stream, not refused as not UTF-8. [fails if: a cut head is decoded as
    final]"""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 51)
    f = jsonl(tmp_path / "c.jsonl", ['{"text": "' + "é" * 100 + '"}', {"text": "b"}])
    assert check_corpus(DataConfig(path=f), None, None, 1) == []


def test_a_file_ending_in_half_a_character_is_not_utf8(tmp_path):
    """A whole file whose last byte starts a 2-byte character (0xc3) and ends: not UTF-8, naming that byte.
    [fails if: a whole file is decoded as an unfinished stream (its cut character silently dropped)]"""
    (tmp_path / "c.txt").write_bytes(b"abc\n\xc3")
    assert check_corpus(DataConfig(path=str(tmp_path / "c.txt")), None, None, 1) == [
        f"data.path {tmp_path / 'c.txt'}: not UTF-8 text (byte 0xc3 at offset 4); convert it to UTF-8 (iconv -t "
        "UTF-8) or point at the text file"]


def test_a_long_first_rows_head_counts_towards_the_tokens(tmp_path, monkeypatch):
    """SAMPLE_BYTES 64 and a first row of 200 bytes: no row is checkable, but its head is one text (2 tokens), which
    is a step of 1 x 2. [fails if: the head of a row longer than the sample is not added to the texts]"""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 64)
    f = jsonl(tmp_path / "c.jsonl", [{"text": "x" * 190}, {"text": "b"}])
    assert check_corpus(DataConfig(path=f, seq_len=2), one_id_per_text, 1, 1) == []


def test_a_head_of_blank_lines_is_not_a_file_without_rows(tmp_path, monkeypatch):
    """SAMPLE_BYTES 128 over two files (64 each): b.jsonl starts with 100 blank lines, then rows. Its head is blank
    but the file is not: no "holds no rows". [fails if: a cut head of blank lines marks the file rowless]"""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 128)
    d = folder(tmp_path)
    jsonl(d / "a.jsonl", [{"text": "x"}])
    (d / "b.jsonl").write_text("\n" * 100 + '{"text": "y"}\n')
    assert check_corpus(DataConfig(path=str(d)), None, None, 1) == []


def test_a_bad_row_in_a_cut_head_is_counted_among_the_first_rows(tmp_path, monkeypatch):
    """SAMPLE_BYTES 64 and 10 rows of 16 bytes, row 2 without text: the head holds 4 whole rows, and the line says
    "of the 4 first rows" (the file has more). [fails if: a cut head's count is worded as all the file's rows]"""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 64)
    rows = [{"text": "abc"}] * 10
    rows[1] = {"body": "ab"}
    f = jsonl(tmp_path / "c.jsonl", rows)
    assert check_corpus(DataConfig(path=f), None, None, 1) == [
        f"data.path {f}: row 2 has no 'text' (keys: ['body']) (bad: 1 of the 4 first rows); fix those rows or set "
        "data.text_field"]


# ------------------------------------------------------------------------------------------------ JSON shapes


def test_json_lines_whose_rows_are_not_objects(tmp_path):
    """A .jsonl file of JSON lists: each row is named as a list, with the fields an object needs (the prompt file's
    two). [fails if: a non-object row is looked up like a dict, a .jsonl file is parsed as one document, or the line
    does not name the fields]"""
    f = jsonl(tmp_path / "c.jsonl", ["[1, 2]", "[3]"])
    assert check_corpus(DataConfig(path=f), None, None, 1) == [
        f"data.path {f}: row 1 is a JSON list, not an object with 'text' (bad: 2 of the 2 rows); fix those rows or "
        "set data.text_field"]
    with pytest.raises(ConfigError) as e:
        check_prompt_file(f, "data.path")
    assert str(e.value) == (f"data.path {f}: row 1 is a JSON list, not an object with 'prompt' and 'answer' (bad: 2 "
                            "of the 2 rows); fix those rows")


def test_a_json_file_that_is_neither_lines_nor_one_document(tmp_path):
    """A .json array cut short: neither JSON lines nor a document, with json's reason. [fails if: the document's
    parse error is not reported as such]"""
    (tmp_path / "c.json").write_text('[{"text": "a"},\n{"text": "b"')
    assert check_corpus(DataConfig(path=str(tmp_path / "c.json")), None, None, 1) == [
        f"data.path {tmp_path / 'c.json'}: is neither JSON lines nor one JSON document (Expecting ',' delimiter: line "
        "2 column 13 (char 28))"]


def test_a_big_json_document_is_not_checked_from_its_head(tmp_path, monkeypatch):
    """SAMPLE_BYTES 256 and an indented .json array of 50 rows: its head is no whole document, so it is not parsed
    (datasets reads it whole when loading). [fails if: the cut head of one JSON document is parsed and refused]"""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 256)
    (tmp_path / "c.json").write_text(json.dumps([{"text": f"doc {i}"} for i in range(50)], indent=1))
    assert check_corpus(DataConfig(path=str(tmp_path / "c.json")), None, None, 1) == []


def test_an_empty_json_array_after_the_first_file_is_no_blank_file(tmp_path):
    """b.json holds `[]` (no rows, but not blank): datasets loads the folder (the first file's columns win), so it
    passes, and is not called "blank lines only". [fails if: any whole file without rows is taken as blank]"""
    d = folder(tmp_path)
    (d / "a.json").write_text(json.dumps([{"text": "x"}, {"text": "y"}], indent=1))
    (d / "b.json").write_text("[]")
    assert check_corpus(DataConfig(path=str(d)), None, None, 1) == []


# ------------------------------------------------------------------------------------------------ hints, prompts


def test_pretraining_on_prompt_rows_and_grpo_on_documents_name_the_other_script(tmp_path):
    """Rows of prompt + answer given to pretraining point at bin/grpo.py; rows of text given to GRPO point at
    bin/pretrain.py; rows of question + answer (neither) get no hint. [fails if: either hint is dropped, or the
    pretraining hint is given to rows without text]"""
    prompts = jsonl(tmp_path / "p.jsonl", [{"prompt": "Q", "answer": "1"}])
    assert check_corpus(DataConfig(path=prompts), None, None, 1) == [
        f"data.path {prompts}: row 1 has no 'text' (keys: ['answer', 'prompt']) (bad: 1 of the 1 rows); fix those "
        "rows or set data.text_field (its rows are GRPO prompts with answers: bin/grpo.py trains on them)"]
    docs = jsonl(tmp_path / "d.jsonl", [{"text": "a b"}])
    with pytest.raises(ConfigError) as e:
        check_prompt_file(docs, "data.path")
    assert str(e.value) == (f"data.path {docs}: row 1 has no 'prompt' (keys: ['text']) (bad: 1 of the 1 rows); fix "
                            "those rows (its rows are documents for pretraining: bin/pretrain.py trains on them; GRPO "
                            "reads prompt/answer rows)")
    questions = jsonl(tmp_path / "q.jsonl", [{"question": "Q", "answer": "1"}])
    with pytest.raises(ConfigError) as e:
        check_prompt_file(questions, "data.path")
    assert str(e.value) == (f"data.path {questions}: row 1 has no 'prompt' (keys: ['answer', 'question']) (bad: 1 "
                            "of the 1 rows); fix those rows")


def test_a_missing_prompt_file_names_the_setting_it_came_from(tmp_path):
    """grpo.eval_path naming no file: the line starts with grpo.eval_path, not data.path. [fails if: data_files'
    "data.path" is not replaced with the setting's name]"""
    with pytest.raises(ConfigError) as e:
        check_prompt_file(str(tmp_path / "gone.jsonl"), "grpo.eval_path")
    assert str(e.value) == (f"grpo.eval_path {tmp_path / 'gone.jsonl'}: no such file or folder (give a "
                            ".jsonl/.json/.parquet/.txt file, a folder of them, or a hub dataset name)")


def test_one_good_prompt_row_passes_and_an_empty_file_is_one_problem(tmp_path):
    """A prompt file of one good row passes; an empty one is its one line, with no "no rows" added. [fails if: one
    row counts as none, or "no rows" is added to another problem]"""
    assert check_prompt_file(jsonl(tmp_path / "one.jsonl", [{"prompt": "Q", "answer": 1}]), "data.path") is None
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError) as e:
        check_prompt_file(str(tmp_path / "empty.jsonl"), "data.path")
    assert str(e.value) == (f"data.path {tmp_path / 'empty.jsonl'}: the file is empty (0 bytes); put the data in it "
                            "or point data.path at it")


# ------------------------------------------------------------------------------------------------ Parquet


def test_a_file_that_is_not_parquet_is_named_as_such(tmp_path):
    """A .parquet file of other bytes: one line, "not a Parquet file" with pyarrow's reason's first line.
    [fails if: pyarrow's error escapes]"""
    (tmp_path / "c.parquet").write_bytes(b"not parquet at all")
    (line,) = check_corpus(DataConfig(path=str(tmp_path / "c.parquet")), None, None, 1)
    assert line.startswith(f"data.path {tmp_path / 'c.parquet'}: not a Parquet file (ArrowInvalid: "), line
    assert "\n" not in line


def test_parquet_columns_missing_are_named_with_the_fix(tmp_path):
    """A Parquet corpus without `text`: its columns and "set data.text_field"; a prompt file without `answer`: "add
    it". [fails if: a missing column is not checked (KeyError from the schema), or the two fixes are swapped]"""
    f = parquet(tmp_path / "c.parquet", {"body": ["x"]})
    assert check_corpus(DataConfig(path=f), None, None, 1) == [
        f"data.path {f}: has no column 'text' (columns: ['body']); set data.text_field"]
    p = parquet(tmp_path / "p.parquet", {"prompt": ["Q"]})
    with pytest.raises(ConfigError) as e:
        check_prompt_file(p, "data.path")
    assert str(e.value) == f"data.path {p}: has no column 'answer' (columns: ['prompt']); add it"


def test_parquet_column_types(tmp_path):
    """large_string text is text; an int64 answer is a number (rewards read it as one); a bool answer is neither,
    and the line says what an answer may be. [fails if: large_string is refused, numeric answers are refused, or the
    answer's line says only "strings"]"""
    import pyarrow as pa

    big = parquet(tmp_path / "big.parquet", {"text": pa.array(["a b"], type=pa.large_string())})
    assert check_corpus(DataConfig(path=big), None, None, 1) == []
    assert check_prompt_file(parquet(tmp_path / "n.parquet", {"prompt": ["Q"], "answer": [2]}), "data.path") is None
    b = parquet(tmp_path / "b.parquet", {"prompt": ["Q"], "answer": [True]})
    with pytest.raises(ConfigError) as e:
        check_prompt_file(b, "data.path")
    assert str(e.value) == f"data.path {b}: column 'answer' holds bool, not strings or numbers"


def test_parquet_nulls_outside_the_fields_are_no_problem(tmp_path):
    """A null in a column the check does not read (source) is fine. [fails if: nulls are counted over every
    column]"""
    f = parquet(tmp_path / "c.parquet", {"text": ["a", "b"], "source": ["web", None]})
    assert check_corpus(DataConfig(path=f), None, None, 1) == []


# ------------------------------------------------------------------------------------------------ hub datasets


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """datasets' builder faked: `hub.info` is what it returns, `hub.error` what it raises; offline through
    HF_DATASETS_OFFLINE (no probe); tmp_path as the working directory, so org/set is no local path."""
    import datasets

    state = SimpleNamespace(info=SimpleNamespace(features={"text": None, "id": None}, splits={"train": None}),
                            error=None, seen=[])

    def builder(path, name=None, **kw):
        state.seen.append((datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()))
        if state.error is not None:
            raise state.error
        return SimpleNamespace(info=state.info)

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return state


def test_a_hub_datasets_text_field_score_column_and_split_are_all_reported(hub):
    """text_field body, a score column `level` and split test, none of them there: three problems, in that order;
    features or splits unknown (None) are not checked. [fails if: any of the three is not checked, only the first is
    returned, or None features/splits are looked into]"""
    d = DataConfig(path="org/set", text_field="body", split="test",
                   curriculum=DataCurriculumConfig(mode="score", score_column="level"))
    assert check_corpus(d, None, None, 1) == [
        "data.text_field 'body' is not a column of org/set (columns: ['text', 'id']); set data.text_field",
        "data.curriculum.score_column 'level' is not a column of org/set (columns: ['text', 'id']); name a numeric "
        "column, or set data.curriculum.mode: length",
        "data.split 'test' is not a split of org/set (splits: ['train']); set data.split"]
    hub.info = SimpleNamespace(features=None, splits=None)
    assert check_corpus(d, None, None, 1) == []


def test_a_missing_builder_config_and_a_missing_dataset(hub, monkeypatch):
    """datasets' "BuilderConfig 'x' not found" asks for data.name; a dataset that is not there is "in the cache"
    offline and "on the Hub" online (the probe faked as reachable). [fails if: the BuilderConfig message is not
    matched, or the two places are swapped]"""
    from huggingface_hub import constants

    hub.error = ValueError("BuilderConfig 'x' not found. Available: ['en', 'fr']")
    assert check_corpus(DataConfig(path="org/set", name="x"), None, None, 1) == [
        "data.path org/set: ValueError: BuilderConfig 'x' not found. Available: ['en', 'fr']; set data.name to one of "
        "them"]
    hub.error = FileNotFoundError("Dataset 'org/set' doesn't exist")
    tail = "(FileNotFoundError: Dataset 'org/set' doesn't exist); check the name, or give a local path"
    (offline,) = check_corpus(DataConfig(path="org/set"), None, None, 1)
    assert offline.startswith(f"data.path org/set: cannot find it in the cache (HF_HUB_OFFLINE is set) {tail}")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(data_check, "reachable", lambda url: True)
    (online,) = check_corpus(DataConfig(path="org/set"), None, None, 1)
    assert online.startswith(f"data.path org/set: cannot find it on the Hub {tail}")


def test_the_hub_check_is_quiet_and_puts_datasets_logging_back(hub):
    """While the builder runs datasets logs errors only and shows no progress bars; afterwards its verbosity and
    progress bars are as they were, enabled or disabled. [fails if: the verbosity is not lowered or not restored, or
    the bars are always or never turned back on]"""
    import datasets

    level, bars_off = datasets.logging.get_verbosity(), datasets.utils.are_progress_bars_disabled()
    try:
        for before_off in (False, True):
            datasets.logging.set_verbosity(datasets.logging.INFO)
            (datasets.disable_progress_bars if before_off else datasets.enable_progress_bars)()
            hub.seen.clear()
            assert check_corpus(DataConfig(path="org/set"), None, None, 1) == []
            assert hub.seen == [(datasets.logging.ERROR, True)]
            assert datasets.logging.get_verbosity() == datasets.logging.INFO
            assert datasets.utils.are_progress_bars_disabled() == before_off
    finally:
        datasets.logging.set_verbosity(level)
        (datasets.disable_progress_bars if bars_off else datasets.enable_progress_bars)()


def test_reachable_probes_the_endpoints_port_with_a_short_timeout(monkeypatch):
    """https without a port is 443, http 80, an explicit port is kept; the probe waits 3 s, and a refused connection
    is False. [fails if: the default ports are swapped, the URL's port is ignored, or the timeout is longer]"""
    asked = []

    def connect(address, timeout):
        asked.append((address, timeout))
        if address[1] == 9:
            raise ConnectionRefusedError
        return SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(socket, "create_connection", connect)
    assert reachable("https://hub.example") and reachable("http://hub.example") and reachable("http://h.example:8080")
    assert not reachable("http://h.example:9")
    assert asked == [(("hub.example", 443), 3.0), (("hub.example", 80), 3.0), (("h.example", 8080), 3.0),
                     (("h.example", 9), 3.0)]


# ------------------------------------------------------------------------------------------------ bugs found (fixed)


def test_a_big_json_document_is_not_refused_for_tokens(tmp_path, monkeypatch):
    """An indented .json array bigger than the sample (datasets loads it whole) holds 100 tokens; its head is not
    checkable, so preflight cannot count them, and must not refuse it. Now: its head's bytes count towards the
    estimate with no text, so the estimate is 0 tokens and the corpus is refused ("add text"). The same with the real
    1 MiB sample and a 3.5 MB array of 30000 documents."""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 256)
    (tmp_path / "c.json").write_text(json.dumps([{"text": f"doc {i}"} for i in range(50)], indent=1))
    assert check_corpus(DataConfig(path=str(tmp_path / "c.json"), seq_len=4), one_id_per_text, 2, 1) == []


def test_a_txt_head_estimate_keeps_its_last_whole_line(tmp_path, monkeypatch):
    """SAMPLE_BYTES 100 and 4 lines of 40 bytes (2 tokens each, 8 in all): the head is cut back to 2 whole lines (80
    bytes), so the estimate is 4 / 80 x 160 = 8 and a step of 2 x 4 passes, as it does for the same rows as JSON
    lines. Now: splitlines() has no cut tail, yet lines[:-1] drops the 2nd whole line: 2 / 80 x 160 = 4 tokens."""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 100)
    (tmp_path / "c.txt").write_text(("x" * 39 + "\n") * 4)
    assert check_corpus(DataConfig(path=str(tmp_path / "c.txt"), seq_len=4), one_id_per_text, 2, 1) == []


def test_a_head_of_one_whole_row_checks_it(tmp_path, monkeypatch):
    """SAMPLE_BYTES 100: row 1 (76 bytes, no `text`) is whole in the head, row 2 is cut. Row 1 must be checked like
    any. Now: one line left after dropping the cut one is taken for "one row longer than the sample", so row 1 is
    neither parsed nor checked, and the file passes preflight (it fails after the ranks start)."""
    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 100)
    f = jsonl(tmp_path / "c.jsonl", [{"body": "x" * 60}, {"text": "y" * 80}])
    assert check_corpus(DataConfig(path=f), None, None, 1) == [
        f"data.path {f}: row 1 has no 'text' (keys: ['body']) (bad: 1 of the 1 first rows); fix those rows or set "
        "data.text_field"]


def test_a_bad_byte_after_a_bom_is_named_at_its_offset(tmp_path):
    """BOM (3 bytes), "ab", then 0xff at offset 5 of the file. Now: the decoder's offset is past the BOM, so the line
    says byte 0xbf (the BOM's last) at offset 2."""
    (tmp_path / "c.txt").write_bytes(b"\xef\xbb\xbfab\xffcd\n")
    assert check_corpus(DataConfig(path=str(tmp_path / "c.txt")), None, None, 1) == [
        f"data.path {tmp_path / 'c.txt'}: not UTF-8 text (byte 0xff at offset 5); convert it to UTF-8 (iconv -t "
        "UTF-8) or point at the text file"]


def test_a_sliced_hub_split_is_accepted(hub):
    """datasets.load_dataset takes split="train[:10%]" (and "train+validation"): engine/data.py passes data.split
    through, so preflight must check the split names in it. Now: the whole string is looked up in info.splits."""
    hub.info = SimpleNamespace(features={"text": None}, splits={"train": None, "validation": None})
    assert check_corpus(DataConfig(path="org/set", split="train[:10%]"), None, None, 1) == []
    assert check_corpus(DataConfig(path="org/set", split="train+validation"), None, None, 1) == []

"""Bad data gets one clear line before any rank works (issue 17): bin/pretrain.py's data and bin/grpo.py's prompt
files are checked in preflight (engine/data_check.py); what only shows later (a streamed row past the checked
head) stops every rank at a step boundary with one line naming the file and the step.

Most cases call the entry points' main() in this process as the launcher's rank 0 would run it (the same code as
`python bin/pretrain.py`, without paying the imports again); the CLI tests run the real scripts."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEEPSPEED, ROOT, ZERO3, env, free_port, read_metrics, write_ds

from engine.config import RECIPES

ZERO3_GRPO = ROOT / "tests" / "zero3_grpo_16x4.json"  # the shipped zero3_grpo.json with its batch written: 16 x 4
SMALL_SAMPLE = ROOT / "tests" / "scripts" / "pretrain_small_sample.py"
GRPO_TINY = (RECIPES / "grpo_tiny.yaml").read_text()
TINY = (RECIPES / "tiny.yaml").read_text()
STORY = "Gus went to the harbor with 9 pens. Ada gave Gus 17 more. Now Gus has 26 pens."


def jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def as_rank0(monkeypatch, world: int = 1):
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_SIZE": str(world)}.items():
        monkeypatch.setenv(k, v)


def refused(main, argv, capfd, run) -> str:
    """main(argv) exits 2 with one `error:` line and no traceback, and writes nothing; returns that line."""
    rc = main([*map(str, argv), "--run_dir", str(run)])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err[-3000:])
    assert "Traceback" not in err
    assert not run.exists()  # nothing started, nothing written
    return lines[0]


def pretrain_refuses(tmp_path, monkeypatch, capfd, data, world: int = 1, recipe: str | None = None, ds=ZERO3) -> str:
    import engine.pretrain
    from engine.pretrain import main

    as_rank0(monkeypatch, world)
    # Rank 0 of `world` alone: no other rank to tell (as conftest.run_in_process; before, a world of 2 passed only
    # where an earlier test of the same worker had left a process group behind).
    monkeypatch.setattr(engine.pretrain, "fail_together", lambda world, problem: str(problem))
    argv = ["--deepspeed_config", ds, "--data", data, "--max_steps", "1"]
    if recipe is not None:
        (tmp_path / "recipe.yaml").write_text(recipe)
        argv += ["--config", tmp_path / "recipe.yaml"]
    return refused(main, argv, capfd, tmp_path / "run")


# The issue's table, row by row: each names the file (or the hub name) and a fix.
def test_empty_txt(tmp_path, monkeypatch, capfd):
    (tmp_path / "empty.txt").write_text("")
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "empty.txt")
    assert f"data.path {tmp_path}/empty.txt: the file is empty (0 bytes); put the data in it" in line


def test_one_line_txt_says_how_many_tokens_it_has_and_one_step_needs(tmp_path, monkeypatch, capfd):
    (tmp_path / "one.txt").write_text("one line of text\n")
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "one.txt")
    assert f"data.path {tmp_path}/one.txt: 15 tokens, 0 sequences of data.seq_len 128; one step needs 1024 tokens " \
           "(8 sequences: the DS config's train_batch_size); add text, or lower data.seq_len" in line


def test_jsonl_row_without_text_names_the_first_bad_row_and_counts_them(tmp_path, monkeypatch, capfd):
    f = jsonl(tmp_path / "c.jsonl", [{"text": STORY}, {"body": STORY}, {"text": None}, {"text": 5}, {"text": STORY}])
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, f)
    assert f"data.path {f}: row 2 has no 'text' (keys: ['body']) (bad: 3 of the 5 rows); fix those rows or " \
           "set data.text_field" in line


def test_random_bytes_are_not_text(tmp_path, monkeypatch, capfd):
    (tmp_path / "r.txt").write_bytes(bytes([0x8a, 0xff]) + os.urandom(20_000))
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "r.txt")
    assert f"data.path {tmp_path}/r.txt: not UTF-8 text (byte 0x8a at offset 0); convert it to UTF-8" in line


def test_unreachable_hub_names_the_fix(tmp_path, monkeypatch, capfd):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # no network: nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, "roneneldan/TinyStories")
    assert "data.path roneneldan/TinyStories: not a local file or folder, and the Hugging Face Hub " \
           "(http://127.0.0.1:9) cannot be reached; give a local path" in line
    assert "set HF_HUB_OFFLINE=1 to use the cache" in line


# Beyond the table.
def test_a_hub_dataset_with_configurations_takes_data_name(tmp_path, monkeypatch):
    """A hub dataset with several configurations (wikitext, c4, ...) needs datasets' `name`: without data.name the
    line lists them and names the key; with it, the builder gets it. data.name with local data is refused."""
    from types import SimpleNamespace

    import datasets

    from engine.config import DataConfig
    from engine.data_check import check_corpus

    calls = []

    def builder(path, name=None, **kw):
        calls.append((path, name))
        if name is None:
            raise ValueError("Config name is missing.\nPlease pick one among the available configs: "
                             "['wikitext-103-raw-v1', 'wikitext-2-raw-v1']")
        return SimpleNamespace(info=SimpleNamespace(features={"text": None}, splits={"train": None}))

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # no reachability probe
    monkeypatch.chdir(tmp_path)  # "wikitext" is no local path here
    found = check_corpus(DataConfig(path="wikitext"), None, None, 1)
    assert len(found) == 1 and "wikitext-103-raw-v1" in found[0] and found[0].endswith("set data.name to one of them")
    assert check_corpus(DataConfig(path="wikitext", name="wikitext-103-raw-v1"), None, None, 1) == []
    assert calls[-1] == ("wikitext", "wikitext-103-raw-v1")
    assert check_corpus(DataConfig(name="x"), None, None, 1) == [
        f"data.name 'x': a hub dataset's configuration, and data.path {DataConfig().path} is local; remove it"]


def test_the_token_count_is_for_this_world_size(tmp_path, monkeypatch, capfd):
    """1100 tokens are a step on 1 rank (8 x 128 = 1024) but not on 2 (16 x 128)."""
    from engine.pretrain import parse_args, preflight
    from engine.parallel import World

    f = jsonl(tmp_path / "c.jsonl", [{"text": STORY}] * 50)
    preflight(parse_args(["--deepspeed_config", str(ZERO3), "--data", f, "--run_dir", str(tmp_path / "ok")]),
              World(0, 1, 1))  # passes (its own run_dir: the default runs/tiny of a checkout may hold a run)
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, f, world=2)
    assert "1100 tokens, 8 sequences of data.seq_len 128; one step needs 2048 tokens (16 sequences" in line


def test_a_bad_file_in_a_folder_is_named_with_the_other_problems(tmp_path, monkeypatch, capfd):
    (tmp_path / "docs").mkdir()
    jsonl(tmp_path / "docs" / "a.jsonl", [{"text": STORY}] * 100)
    jsonl(tmp_path / "docs" / "b.jsonl", [{"text": STORY}, '{"text": "cut', {"text": STORY}])
    jsonl(tmp_path / "docs" / "c.jsonl", [{"text": STORY, "source": "web"}] * 100)  # datasets would fail on it
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "docs",
                            ds=write_ds(tmp_path / "ds.json", train_batch_size=10))
    assert "train_batch_size (10) != " in line  # the DS config's problem, in the same line
    assert f"data.path {tmp_path}/docs: {tmp_path}/docs/b.jsonl: row 2 is not valid JSON (" in line
    assert "(bad: 1 of the 3 rows)" in line
    assert f"; {tmp_path}/docs/c.jsonl has the column(s) ['source'] that the first file {tmp_path}/docs/a.jsonl has " \
           "not (1 such files); datasets reads every file with the first one's columns" in line


def test_parquet_without_string_text(tmp_path, monkeypatch, capfd):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [STORY, None, STORY]}), tmp_path / "nulls.parquet")
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "nulls.parquet")
    assert f"data.path {tmp_path}/nulls.parquet: 1 rows have no 'text' (null); fix those rows" in line
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "ints.parquet")
    assert "column 'text' holds int64, not strings" in line


def test_parquet_nulls_without_statistics_bom_and_string_view(tmp_path, monkeypatch, capfd):
    """A Parquet file written without column statistics shows its nulls only in its rows: still one line naming the
    row. A UTF-8 BOM before a JSON line and a Parquet string_view column are text (datasets reads both): accepted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.data_check import check_corpus
    from engine.config import DataConfig

    pq.write_table(pa.table({"text": [STORY, STORY, None]}), tmp_path / "n.parquet", write_statistics=False)
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "n.parquet")
    assert f"data.path {tmp_path}/n.parquet: row 3 has no 'text' (null); fix that row" in line
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"text": STORY}) + "\n"
                                                                   for _ in range(50)).encode())
    pq.write_table(pa.table({"text": pa.array([STORY] * 50, type=pa.string_view())}), tmp_path / "view.parquet")
    for f in ("bom.jsonl", "view.parquet"):
        assert check_corpus(DataConfig(path=str(tmp_path / f), seq_len=16), None, None, 1) == [], f


def test_streaming_an_empty_file_is_refused(tmp_path, monkeypatch, capfd):
    """Streaming hands whole files to ranks: with 2 files on 2 ranks, an empty one would leave a rank nothing to
    read after it had started (it passed preflight: the file count is a multiple of the ranks)."""
    (tmp_path / "d").mkdir()
    jsonl(tmp_path / "d" / "a.jsonl", [{"text": f"{STORY} {i}"} for i in range(200)])
    (tmp_path / "d" / "b.jsonl").write_text("")
    recipe = TINY.replace("seq_len: 128", "seq_len: 128\n  streaming: true")
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "d", world=2, recipe=recipe)
    assert f"data.path {tmp_path / 'd'}: {tmp_path / 'd' / 'b.jsonl'} is empty (1 empty file(s))" in line


@pytest.mark.parametrize("streaming", [True, False])
def test_a_file_of_blank_lines_only_is_refused_by_name(tmp_path, monkeypatch, capfd, streaming):
    """A file with bytes but no row (blank lines only) is named before any rank starts, streaming or not. Streaming,
    the rank handed it failed after start with "data.text_field 'text' is not a column"; read whole, datasets fails
    on it as the folder's first file (its empty schema cast to the others'), as checked here too; before, preflight
    passed it (streaming) or said the other files had columns it has not (read whole)."""
    from datasets import load_dataset

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("\n\n")
    jsonl(tmp_path / "d" / "b.jsonl", [{"text": f"{STORY} {i}"} for i in range(200)])
    with pytest.raises(Exception):  # the premise: datasets cannot load this folder
        load_dataset("json", data_files=sorted(map(str, (tmp_path / "d").iterdir())), split="train",
                     cache_dir=str(tmp_path / "cache"))
    capfd.readouterr()  # datasets' progress lines
    recipe = TINY.replace("seq_len: 128", "seq_len: 128\n  streaming: true") if streaming else None
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, tmp_path / "d", world=2 if streaming else 1, recipe=recipe)
    assert line.endswith(f"data.path {tmp_path / 'd'}: {tmp_path / 'd' / 'a.jsonl'}: holds no rows (blank lines only);"
                         " remove the file or put rows in it"), line


def test_streaming_one_file_with_fewer_rows_than_ranks_is_refused(tmp_path, monkeypatch, capfd):
    f = jsonl(tmp_path / "c.jsonl", [{"text": STORY * 40}])
    recipe = TINY.replace("seq_len: 128", "seq_len: 128\n  streaming: true")
    assert recipe != TINY
    line = pretrain_refuses(tmp_path, monkeypatch, capfd, f, world=2, recipe=recipe)
    assert f"data.path {f}: 1 rows in 1 file(s); streaming on 2 data-parallel ranks splits rows" in line


def test_streaming_one_file_on_two_ranks_splits_its_rows(tmp_path):
    """Fewer files than ranks: each rank reads every other row (datasets' split_dataset_by_node), disjoint."""
    from engine.config import DataConfig
    from engine.data import StreamedSequences, load_documents, load_tokenizer

    f = jsonl(tmp_path / "c.jsonl", [{"text": f"{STORY} {i}"} for i in range(10)])
    d = DataConfig(path=f, streaming=True)
    shares = [[r["text"] for r in StreamedSequences(load_documents(d), load_tokenizer(d.tokenizer), d, rank, 2, 0)
               .rows(0)] for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 5 and not set(shares[0]) & set(shares[1])


def test_streaming_ranks_keep_their_own_files_in_every_epoch(tmp_path):
    """Two files of 400 and 20 rows on 2 ranks: each rank streams one file, the same one in every epoch, so the ranks
    never read a file at once (datasets' split_dataset_by_node dealt the files out anew per epoch: a rank that had
    finished more epochs read the file another rank was still reading)."""
    from engine.config import DataConfig
    from engine.data import StreamedSequences, load_documents, load_tokenizer

    (tmp_path / "d").mkdir()
    jsonl(tmp_path / "d" / "a.jsonl", [{"text": f"a{i}"} for i in range(400)])
    jsonl(tmp_path / "d" / "b.jsonl", [{"text": f"b{i}"} for i in range(20)])
    d = DataConfig(path=str(tmp_path / "d"), streaming=True)
    tok = load_tokenizer(d.tokenizer)
    per_epoch = []
    for rank in (0, 1):
        s = StreamedSequences(load_documents(d), tok, d, rank, 2, 0)
        per_epoch.append([{r["text"][0] for r in s.rows(epoch)} for epoch in range(5)])
    assert per_epoch == [[{"a"}] * 5, [{"b"}] * 5], per_epoch
    first = [r["text"] for r in StreamedSequences(load_documents(d), tok, d, 1, 2, 0).rows(0)]
    second = [r["text"] for r in StreamedSequences(load_documents(d), tok, d, 1, 2, 0).rows(1)]
    assert sorted(first) == sorted(second) and first != second  # every epoch all of the rank's rows, reshuffled


def test_map_style_rows_past_the_checked_head_are_named_when_tokenized(tmp_path):
    """Map-style data is read whole by every rank before the model is built: a row without text past preflight's
    sample is one ConfigError naming the row (main() reports it in one line, exit 2), not the tokenizer's TypeError."""
    from engine.config import ConfigError, DataConfig
    from engine.data import build_data, load_tokenizer

    rows = [{"text": f"{STORY} {i}"} for i in range(40)]
    rows[33] = {"text": None}
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", rows), seq_len=32)
    with pytest.raises(ConfigError, match=r"data.path .*c.jsonl: row 34 has text = None, not a string; fix that row"):
        build_data(d, load_tokenizer(d.tokenizer), 0, 1, 0)


def test_bytes_that_are_not_utf8_past_the_checked_head_are_one_config_error(tmp_path):
    """The JSON reader passes a Latin-1 byte through; the text column's decode fails inside the tokenizing map. That
    is one ConfigError naming the file (main() reports it in one line, exit 2), not a UnicodeDecodeError traceback."""
    from engine.config import ConfigError, DataConfig
    from engine.data import build_data, load_tokenizer

    f = tmp_path / "c.jsonl"
    f.write_bytes("".join(json.dumps({"text": f"{STORY} {i}"}) + "\n" for i in range(40)).encode()
                  + b'{"text": "caf\xe9"}\n')
    d = DataConfig(path=str(f), seq_len=32)
    with pytest.raises(ConfigError, match=r"data.path .*c.jsonl: cannot read every row \(.*preflight checks the "):
        build_data(d, load_tokenizer(d.tokenizer), 0, 1, 0)


def test_the_first_rank_packs_and_the_others_load_its_cache(tmp_path, monkeypatch):
    """Two ranks of a launch building the same corpus at once: one reads and packs it, the other waits on the cache
    entry's lock and loads what the first wrote (before: every rank packed the whole corpus)."""
    import threading

    import engine.data as data
    from engine.config import DataConfig

    monkeypatch.setenv("MOE_ENGINE_CACHE", str(tmp_path / "cache"))
    d = DataConfig(path=jsonl(tmp_path / "c.jsonl", [{"text": f"{STORY} {i}"} for i in range(40)]), seq_len=16)
    tok = data.load_tokenizer(d.tokenizer)
    packed, real = [], data.pack_corpus

    def counted(*a, **k):
        packed.append(threading.get_ident())
        out = real(*a, **k)
        threading.Event().wait(0.5)  # still holding the lock when the other rank asks
        return out

    monkeypatch.setattr(data, "pack_corpus", counted)
    got = [None, None]
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, data.build_data(d, tok, r, 2, 0)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(packed) == 1 and np.array_equal(got[0].sequences, got[1].sequences) and len(got[0].sequences) > 0


def test_packed_corpus_is_cached_and_a_changed_file_is_packed_again(tmp_path, monkeypatch):
    """build_data keeps the packed windows (engine/data.py: cache_dir) and a second build reads them: the same
    sequences and order as packing afresh (cache off), the curriculum's order included; a file that changed is a new
    key, not the old windows."""
    from engine.config import DataConfig, DataCurriculumConfig
    from engine.data import build_data, load_tokenizer

    f = jsonl(tmp_path / "c.jsonl", [{"text": f"{STORY} {' '.join(['x'] * (i % 7))} {i}"} for i in range(40)])
    tok = load_tokenizer(DataConfig().tokenizer)
    cache = tmp_path / "cache"
    for curriculum in (DataCurriculumConfig(), DataCurriculumConfig(mode="length")):
        d = DataConfig(path=f, seq_len=16, curriculum=curriculum)
        monkeypatch.setenv("MOE_ENGINE_CACHE", "off")
        fresh = build_data(d, tok, 0, 1, 3)
        monkeypatch.setenv("MOE_ENGINE_CACHE", str(cache))
        before = set(cache.glob("*.npz"))
        first = build_data(d, tok, 0, 1, 3)
        written = set(cache.glob("*.npz")) - before
        assert len(written) == 1
        with monkeypatch.context() as m:  # only this patch is undone: the cache setting stays for what follows
            m.setattr("engine.data.load_documents", lambda *a, **k: pytest.fail("read the documents again"))
            second = build_data(d, tok, 0, 1, 3)
        for data in (first, second):
            assert np.array_equal(data.sequences, fresh.sequences) and data.ordered == fresh.ordered
            assert [data.global_index(p) for p in range(60)] == [fresh.global_index(p) for p in range(60)]
    assert len(list(cache.glob("*.npz"))) == 2  # the curriculum's order is its own entry
    # Without a curriculum the windows do not depend on the seed (it shuffles them afterwards): another seed reads
    # the same entry, and still gets its own order.
    assert os.environ["MOE_ENGINE_CACHE"] == str(cache)
    seed3, seed4 = (build_data(DataConfig(path=f, seq_len=16), tok, 0, 1, seed) for seed in (3, 4))
    assert len(list(cache.glob("*.npz"))) == 2 and np.array_equal(seed3.sequences, seed4.sequences)
    assert [seed3.global_index(p) for p in range(60)] != [seed4.global_index(p) for p in range(60)]
    monkeypatch.setenv("MOE_ENGINE_CACHE", str(cache))
    with open(f, "a") as fh:
        fh.write(json.dumps({"text": "a new document at the end of the file"}) + "\n")
    d = DataConfig(path=f, seq_len=16)
    changed = build_data(d, tok, 0, 1, 3)
    monkeypatch.setenv("MOE_ENGINE_CACHE", "off")
    assert np.array_equal(changed.sequences, build_data(d, tok, 0, 1, 3).sequences)
    assert len(list(cache.glob("*.npz"))) == 3


# GRPO prompt files: data.path and grpo.eval_path.
@pytest.mark.parametrize("case, expect", [
    ("empty", "data.path {f}: the file is empty (0 bytes)"),
    ("no_answer", "data.path {f}: row 2 has no 'answer' (keys: ['prompt']) (bad: 1 of the 2 rows); fix those"),
    ("no_prompt", "data.path {f}: row 1 has no 'prompt' (keys: ['answer', 'question'])"),
    ("null_answer", "data.path {f}: row 1 has no 'answer' (null)"),
    ("list_prompt", "data.path {f}: row 2 has 'prompt' = [\"Q: 1 + 1\"], a list, not a string"),
    ("dict_answer", "data.path {f}: row 1 has 'answer' = {{\"value\": 2}}, a dict, not a string or number"),
    ("empty_eval", "grpo.eval_path {f}: the file is empty (0 bytes); put the data in it or point grpo.eval_path"),
    ("eval_no_answer", "grpo.eval_path {f}: row 1 has no 'answer'"),
])
def test_bad_prompt_files_are_one_line(tmp_path, monkeypatch, capfd, case, expect):
    from engine.grpo import main

    good = {"prompt": "Q: 1 + 1 = ? A:", "answer": "2"}
    f = {"empty": lambda p: jsonl(p, []),
         "no_answer": lambda p: jsonl(p, [good, {"prompt": "Q: 2 + 2 = ? A:"}]),
         "no_prompt": lambda p: jsonl(p, [{"question": "Q: 2 + 2 = ? A:", "answer": "4"}]),
         "null_answer": lambda p: jsonl(p, [{"prompt": "Q: 2 + 2 = ? A:", "answer": None}]),
         "list_prompt": lambda p: jsonl(p, [good, {"prompt": ["Q: 1 + 1"], "answer": "2"}]),
         "dict_answer": lambda p: jsonl(p, [{"prompt": "Q: 1 + 1 = ? A:", "answer": {"value": 2}}]),
         "empty_eval": lambda p: jsonl(p, []),
         "eval_no_answer": lambda p: jsonl(p, [{"prompt": "Q: 1 + 1 = ? A:"}])}[case](tmp_path / "p.jsonl")
    argv = ["--deepspeed_config", ZERO3_GRPO]
    if "eval" in case:
        (tmp_path / "r.yaml").write_text(GRPO_TINY.replace("engine/assets/arith_eval.jsonl", f))
        argv += ["--config", tmp_path / "r.yaml"]
    else:
        argv += ["--data", f]
    as_rank0(monkeypatch)
    monkeypatch.chdir(ROOT)  # the shipped recipe's relative paths
    assert expect.format(f=f) in refused(main, argv, capfd, tmp_path / "run")


def test_prompts_past_the_checked_head_are_checked_once_loaded(tmp_path, monkeypatch):
    """A prompts file bigger than the preflight sample: every row is checked after loading; numbers are answers."""
    from engine import data_check
    from engine.config import ConfigError
    from engine.grpo import load_prompts

    monkeypatch.setattr(data_check, "SAMPLE_BYTES", 256)
    rows = [{"prompt": f"Q: {i} + 1 = ? A:", "answer": i + 1} for i in range(40)]
    assert load_prompts(jsonl(tmp_path / "ok.jsonl", rows))[5] == {"prompt": "Q: 5 + 1 = ? A:", "answer": 6}
    rows[30] = {"prompt": None, "answer": 1}
    with pytest.raises(ConfigError, match=r"data.path .*bad.jsonl: row 31 has no 'prompt' .* \(bad: 1 of the 40 rows\)"):
        load_prompts(jsonl(tmp_path / "bad.jsonl", rows))


# The real entry points, as the launcher starts rank 0 (a fresh process: nothing cached, no import-time state).
def cli(tmp_path, script, *args, **extra) -> subprocess.CompletedProcess:
    e = env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", **extra)
    cmd = [sys.executable, str(ROOT / "bin" / script), *map(str, args), "--run_dir", str(tmp_path / "run")]
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("case", ["pretrain_hub_offline_not_cached", "grpo_empty_prompts"])
def test_cli_bad_data_is_one_line_and_exit_2(tmp_path, case):
    if case == "pretrain_hub_offline_not_cached":
        p = cli(tmp_path, "pretrain.py", "--deepspeed_config", ZERO3, "--data", "roneneldan/TinyStories",
                HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
        expect = ("data.path roneneldan/TinyStories: cannot find it in the cache (HF_HUB_OFFLINE is set) "
                  "(ConnectionError: ")
    else:
        f = jsonl(tmp_path / "p.jsonl", [])
        p = cli(tmp_path, "grpo.py", "--deepspeed_config", ZERO3_GRPO, "--data", f)
        expect = f"data.path {f}: the file is empty"
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and lines and lines[0].startswith("error: ") and expect in lines[0], p.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_bad_streamed_row_on_one_of_two_ranks_stops_both_at_a_step_with_a_checkpoint(tmp_path):
    """Two ranks through the real launcher, streaming one file each; one file has a row without text past the
    checked head. Both ranks stop at the same step boundary (no hang), the checkpoint of the last step is saved,
    the rank that read the row prints the one line, and the launcher exits non-zero."""
    (tmp_path / "docs").mkdir()
    good = [{"text": f"{STORY} {i}"} for i in range(60)]
    jsonl(tmp_path / "docs" / "a.jsonl", good)
    jsonl(tmp_path / "docs" / "b.jsonl", good[:30] + [{"text": None}] + good[30:])  # the same columns: a null
    (tmp_path / "recipe.yaml").write_text(TINY.replace("seq_len: 128", "seq_len: 32\n  streaming: true"))
    e = env(SAMPLE_BYTES="1024")
    cmd = [DEEPSPEED, "--master_port", str(free_port()), "--num_gpus", "2", str(SMALL_SAMPLE),
           "--deepspeed_config", str(ZERO3), "--config", str(tmp_path / "recipe.yaml"), "--data", str(tmp_path / "docs"),
           "--max_steps", "100", "--run_dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if "error: " in line]
    assert p.returncode != 0 and len(errors) == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    step = int((tmp_path / "run" / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert 0 < step < 100 and read_metrics(tmp_path / "run")[-1]["step"] == step
    assert f"error: data.path {tmp_path}/docs: the row {{\"text\": null}} (" in errors[0], errors[0]
    assert f"(reading the data of step {step + 1}; saved step {step}, continue with --resume" in errors[0]


def test_data_seed_orders_the_data_apart_from_the_init_seed():
    """data.seed changes the order of the windows and nothing else; unset, train.seed orders them as before."""
    from engine.config import ConfigError, load_recipe
    from engine.data import build_data, load_tokenizer

    base = load_recipe(None, {"train.seed": 5})
    other = load_recipe(None, {"train.seed": 5, "data.seed": 6})
    assert (base.data_seed(), other.data_seed()) == (5, 6)
    tok = load_tokenizer(base.data.tokenizer)
    a, b = (build_data(r.data, tok, 0, 1, r.data_seed()) for r in (base, other))
    order = lambda d: [tuple(d.sequences[d.global_index(i)]) for i in range(len(d))]  # noqa: E731
    assert order(a) != order(b) and sorted(order(a)) == sorted(order(b))
    with pytest.raises(ConfigError, match="data.seed"):
        load_recipe(None, {"data.seed": "six"})


def test_a_first_row_longer_than_the_sample_is_not_called_invalid_json(tmp_path):
    """A JSON-lines file whose first row is longer than the preflight's sample of it (1 MiB for one file, 64 KiB each
    for 16 or more) is valid data that datasets loads: the head holds no whole row to check, and the corpus is not
    refused. [fails if: the cut first row is parsed as a row ("row 1 is not valid JSON")]"""
    import json

    from engine.config import DataConfig
    from engine.data_check import SAMPLE_FILES, check_corpus

    one = tmp_path / "book.jsonl"
    one.write_text(json.dumps({"text": "word " * 250_000}) + "\n" + json.dumps({"text": "short"}) + "\n")
    assert check_corpus(DataConfig(path=str(one)), None, None, 1) == []
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(SAMPLE_FILES):
        (shards / f"{i:02d}.jsonl").write_text(json.dumps({"text": "word " * 14_000}) + "\n"
                                               + json.dumps({"text": "short"}) + "\n")
    assert check_corpus(DataConfig(path=str(shards)), None, None, 1) == []

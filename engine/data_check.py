"""Preflight checks of data files: what can be known before any rank starts, at a bounded cost.

Every file's size is looked at; the heads of at most SAMPLE_FILES files, SAMPLE_BYTES in all, are decoded,
parsed and checked row by row, and tokenized until one step's worth of tokens is seen. A corpus no bigger than
the sample is thus checked exactly; a bigger one by its sample, with its token count estimated from the bytes.
What lies deeper in a big file is checked where it is read (engine/data.py) and reported in one line then.
"""
from __future__ import annotations

import codecs
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from .config import ConfigError, DataConfig
from .data import cause, data_files, looks_local

SAMPLE_FILES = 16
SAMPLE_BYTES = 1 << 20
PROMPT_FIELDS = {"prompt": (str,), "answer": (str, int, float)}  # rewards read numeric answers as numbers
HUB_FIX = ("give a local path (--data FILE or data.path), or download it once where the Hub is reachable and set "
           "HF_HUB_OFFLINE=1 to use the cache")


@dataclass
class Sample:
    """What the heads of the sampled files hold."""
    texts: list = field(default_factory=list)  # the good rows' text, in file order
    rows: int = 0  # rows read, good or bad
    bytes_read: int = 0  # bytes of the files those rows came from
    total_bytes: int = 0  # bytes of all the files
    complete: bool = True  # every file was read to its end
    problems: list = field(default_factory=list)
    columns: dict = field(default_factory=dict)  # file -> the keys of its rows (JSON files)
    rowless: list = field(default_factory=list)  # JSON files read whole that hold no row, only blank lines
    documents: int = 0  # files whose head gave no text: one JSON document longer than the sample (counted when loaded)


def check_corpus(d: DataConfig, tok, batch: int | None, data_parallel: int) -> list[str]:
    """Problems with the pretraining data, each naming data.path (and the file), the value and the fix.

    `batch` is the global batch in sequences (train_batch_size; None when the DS config is broken) and
    `data_parallel` the number of ranks that read different data."""
    if not looks_local(d.path):
        return check_hub(d)
    if d.name:
        return [f"data.name {d.name!r}: a hub dataset's configuration, and data.path {d.path} is local; remove it"]
    try:
        builder, files = data_files(d.path)
    except ConfigError as e:
        return [str(e)]
    if builder == "text" and d.text_field != "text":
        return [f"data.text_field {d.text_field!r}: .txt files have one column, 'text'; set data.text_field: text"]
    s = sample_files(files, {d.text_field: (str,)}, d.path)
    if s.problems:
        return s.problems
    if d.curriculum.mode == "score":
        problem = check_score_column(d.curriculum.score_column, builder, files, s, d.path)
        if problem:
            return [problem]
    empty = [f for f in files if os.path.getsize(f) == 0]
    if d.streaming and empty:  # a rank whose files are all empty would stream nothing
        return [f"data.path {d.path}: {empty[0]} is empty ({len(empty)} empty file(s)); streaming hands whole files "
                "to ranks, so remove the empty ones"]
    split_rows = d.streaming and len(files) % data_parallel  # split_dataset_by_node: every world-th row per rank
    if split_rows and s.complete and s.rows < data_parallel:
        return [f"data.path {d.path}: {s.rows} rows in {len(files)} file(s); streaming on {data_parallel} "
                "data-parallel ranks splits rows (rank r reads rows r, r + ranks, ...), so some rank would get none; "
                "add rows, or files in a multiple of the ranks (each rank then reads its own files)"]
    return check_tokens(d, tok, s, batch) if batch and tok is not None else []


def check_score_column(column: str, builder: str, files: list[str], s: "Sample", path: str) -> str | None:
    """data.curriculum.mode score: the column is in every sampled JSON file's rows, every Parquet file's schema
    (metadata only); a .txt file has none. Its values are checked where the documents are loaded (engine/data.py)."""
    from .curriculum import missing_column

    if builder == "text":
        return missing_column(column, path, ["text"]) + " (.txt files have one column)"
    if builder == "parquet":
        import pyarrow.parquet as pq

        for f in files:
            try:
                names = pq.ParquetFile(f).schema_arrow.names
            except Exception:  # noqa: BLE001  (not sampled and not Parquet: refused where it is loaded)
                continue
            if column not in names:
                return missing_column(column, f if len(files) > 1 else path, names)
        return None
    for f, keys in s.columns.items():
        if column not in keys:
            return missing_column(column, f if len(files) > 1 else path, sorted(keys))
    return None


def check_tokens(d: DataConfig, tok, s: Sample, batch: int) -> list[str]:
    """The corpus must pack into at least one global batch of data.seq_len windows."""
    need, tokens, done = batch * d.seq_len, 0, 0
    while done < len(s.texts) and tokens < need:  # tokenize only until one step's worth is seen
        chunk = s.texts[done:done + 256]
        tokens += sum(len(ids) + 1 for ids in tok(chunk)["input_ids"])  # +1: the EOS that joins documents
        done += len(chunk)
    if tokens >= need:
        return []
    if s.complete:
        what = f"{tokens} tokens"
    elif s.documents and not s.bytes_read:  # every head read was one big JSON document: counted when loaded
        return []
    else:  # scaled from the sample: tokens per byte of file read, times all the bytes
        tokens = int(tokens / max(s.bytes_read, 1) * s.total_bytes)
        if tokens >= need:
            return []
        what = f"about {tokens} tokens (estimated from its first {s.bytes_read} bytes)"
    return [f"data.path {d.path}: {what}, {tokens // d.seq_len} sequences of data.seq_len {d.seq_len}; one step needs "
            f"{need} tokens ({batch} sequences: the DS config's train_batch_size); add text, or lower data.seq_len "
            "or the batch"]


def check_prompt_file(path: str, where: str) -> None:
    """GRPO prompts (and eval prompts): every row needs string `prompt` and `answer`. Raises one ConfigError."""
    try:
        builder, files = data_files(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("data.path", where, 1)) from None
    if builder == "text":
        raise ConfigError(f"{where} {path}: a .txt file has one column, text; prompts need `prompt` and `answer` "
                          "columns (a .jsonl or .parquet file)")
    s = sample_files(files, PROMPT_FIELDS, path, where)
    if not s.problems and s.complete and s.rows == 0:
        s.problems.append(f"{where} {path}: no rows; it needs rows with `prompt` and `answer`")
    if s.problems:
        raise ConfigError("; ".join(s.problems))


def sample_files(files: list[str], fields: dict, path: str, where: str = "data.path") -> Sample:
    s = Sample()
    sizes = {f: os.path.getsize(f) for f in files}
    s.total_bytes = sum(sizes.values())
    if s.total_bytes == 0:
        what = "the file is empty" if len(files) == 1 else f"all {len(files)} files are empty"
        s.problems.append(f"{where} {path}: {what} (0 bytes); put the data in it or point {where} at it")
        return s
    picked = [f for f in files if sizes[f]]
    picked = picked[:: -(-len(picked) // SAMPLE_FILES)][:SAMPLE_FILES]  # spread over the list
    s.complete = len(picked) == len([f for f in files if sizes[f]])
    bad = []
    for f in picked:
        problem = read_rows(f, fields, SAMPLE_BYTES // len(picked), s)
        if problem:
            bad.append(problem if Path(path).is_file() else f"{f}: {problem}")
    if s.rowless and not Path(path).is_file():  # one of several: datasets casts its empty schema to the others' and
        # fails where it comes first; a streaming rank handed it fails after start. (One file alone: "no rows" below.)
        bad += [f"{f}: holds no rows (blank lines only); remove the file or put rows in it" for f in s.rowless]
    first = next(iter(s.columns), None)
    extra = {f: sorted(keys - s.columns[first]) for f, keys in s.columns.items() if keys - s.columns[first]}
    if extra:  # datasets reads every file with the first one's columns: a file with more fails to load
        f, keys = next(iter(extra.items()))
        bad.append(f"{f} has the column(s) {keys} that the first file {first} has not ({len(extra)} such files); "
                   "datasets reads every file with the first one's columns: give every file the same columns")
    if bad:  # a few files by name, the count of the rest
        more = f"; and {len(bad) - 3} more of the {len(picked)} files checked" if len(bad) > 3 else ""
        s.problems.append(f"{where} {path}: " + "; ".join(bad[:3]) + more)
    return s


def read_rows(f: str, fields: dict, limit: int, s: Sample) -> str | None:
    """Add the head of file `f` (at most `limit` bytes) to the sample; the first problem found, if any."""
    if f.endswith(".parquet"):
        return read_parquet(f, fields, limit, s)
    with open(f, "rb") as fh:
        raw = fh.read(limit + 1)
    whole = len(raw) <= limit
    if not whole:
        raw = raw[:limit]
        raw = raw[: raw.rfind(b"\n") + 1] or raw  # whole lines only, unless one line is longer than the sample
        s.complete = False
    try:
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(raw, final=whole)  # a leading BOM is no text
    except UnicodeDecodeError as e:
        at = e.start + (len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0)
        return (f"not UTF-8 text (byte 0x{raw[at]:02x} at offset {at}); convert it to UTF-8 "
                "(iconv -t UTF-8) or point at the text file")
    if "\x00" in text:
        return f"holds NUL bytes at offset {text.index(chr(0))}: a binary file, not text"
    lines = text.splitlines() if f.endswith(".txt") else text.split("\n")
    s.bytes_read += len(raw)
    if not whole and len(lines) == 1 and not f.endswith(".txt"):  # one row longer than the sample: not checkable
        s.texts.append(text)  # from its head, but its bytes still count towards the token estimate
        return None
    if f.endswith(".txt"):
        s.texts += lines
        s.rows += len(lines)
        return None
    # rows count from 1, as datasets reads them (blank lines are no rows): row N is the N-th non-blank line
    numbered = [(f"row {i}", _parse(line)) for i, line in enumerate((ln for ln in lines if ln.strip()), 1)]
    if f.endswith(".json") and numbered and not isinstance(numbered[0][1], dict):  # not JSON lines: one document
        if not whole:  # one big JSON document is not checkable from its head; checked when loaded
            s.bytes_read -= len(raw)  # and no part of the token estimate: it gave no text
            s.total_bytes -= os.path.getsize(f)
            s.documents += 1
            return None
        doc = _parse(text)
        if isinstance(doc, ValueError):
            return f"is neither JSON lines nor one JSON document ({doc})"
        if isinstance(doc, dict) and all(isinstance(v, list) for v in doc.values()):  # columns of values
            doc = [dict(zip(doc, r)) for r in zip(*doc.values())]
        numbered = [(f"row {i}", r) for i, r in enumerate(doc if isinstance(doc, list) else [doc], 1)]
    if whole and not numbered and text.strip() == "":  # bytes but no row (blank lines only)
        s.rowless.append(f)
        return None
    unit = "rows"
    s.columns[f] = {k for _, row in numbered if isinstance(row, dict) for k in row}
    return check_rows(numbered, fields, s, unit if whole else f"first {unit}")


def _parse(line: str):
    try:
        return json.loads(line)
    except ValueError as e:
        return e


def check_rows(rows, fields: dict, s: Sample, unit: str) -> str | None:
    first, bad, n, keys = None, 0, 0, set()
    for n, (name, row) in enumerate(rows, 1):
        keys |= set(row) if isinstance(row, dict) else set()
        why = row_problem(row, fields)
        if why:
            bad += 1
            first = first or f"{name} {why}"
        else:
            s.texts.append(row[next(iter(fields))])
    s.rows += n
    if not bad:
        return None
    hint = ""
    if set(PROMPT_FIELDS) <= keys and "prompt" not in fields:
        hint = " (its rows are GRPO prompts with answers: bin/grpo.py trains on them)"
    elif "prompt" in fields and "prompt" not in keys and "text" in keys:
        hint = (" (its rows are documents for pretraining: bin/pretrain.py trains on them; GRPO reads prompt/answer "
                "rows)")
    return (f"{first} (bad: {bad} of the {n} {unit}); fix those rows" + (" or set data.text_field" * (len(fields) == 1))
            + hint)


def row_problem(row, fields: dict) -> str | None:
    if isinstance(row, ValueError):
        return f"is not valid JSON ({row})"
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, not an object with {' and '.join(map(repr, fields))}"
    for k, kinds in fields.items():
        if k not in row:
            return f"has no {k!r} (keys: {sorted(row)})"
        if row[k] is None:
            return f"has no {k!r} (null)"
        if not isinstance(row[k], kinds) or isinstance(row[k], bool):
            return (f"has {k!r} = {json.dumps(row[k])[:40]}, a {type(row[k]).__name__}, not a "
                    + " or ".join("string" if t is str else "number" for t in kinds[:2]))
    return None


def read_parquet(f: str, fields: dict, limit: int, s: Sample) -> str | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # noqa: BLE001  (pyarrow raises several kinds)
        return f"not a Parquet file ({type(e).__name__}: {str(e).splitlines()[0]})"
    schema = pf.schema_arrow
    for k in fields:
        if k not in schema.names:
            return f"has no column {k!r} (columns: {schema.names}); " + ("set data.text_field" if len(fields) == 1 else
                                                                          "add it")
        t = schema.field(k).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
                or (float in fields[k] and (pa.types.is_integer(t) or pa.types.is_floating(t)))):
            return f"column {k!r} holds {t}, not " + ("strings or numbers" if float in fields[k] else "strings")
    meta = pf.metadata
    nulls = sum((c.statistics.null_count or 0) if c.statistics is not None and c.statistics.has_null_count else 0
                for g in range(meta.num_row_groups) for c in map(meta.row_group(g).column, range(meta.num_columns))
                if c.path_in_schema in fields)
    if nulls:
        return f"{nulls} rows have no {' or '.join(map(repr, fields))} (null); fix those rows"
    rows = chars = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[next(iter(fields))]):
        texts = batch.column(0).to_pylist()
        if None in texts:  # a file written without statistics: the nulls only show in the rows
            return (f"row {rows + texts.index(None) + 1} has no {next(iter(fields))!r} (null); fix that row "
                    "(and any other null one)")
        s.texts += texts
        rows, chars = rows + len(texts), chars + sum(map(len, texts))
        if chars > limit:
            break
    s.rows += rows
    s.bytes_read += os.path.getsize(f) * min(rows, meta.num_rows) // max(meta.num_rows, 1)
    s.complete = s.complete and rows >= meta.num_rows
    return None


def check_hub(d: DataConfig) -> list[str]:
    """A hub name: reachable (or in the cache when HF_HUB_OFFLINE=1), with the text field and split it needs."""
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    if not offline and not reachable(constants.ENDPOINT):
        return [f"data.path {d.path}: not a local file or folder, and the Hugging Face Hub ({constants.ENDPOINT}) "
                f"cannot be reached; {HUB_FIX}"]
    import datasets

    level, bars = datasets.logging.get_verbosity(), not datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity_error()  # a refusal must be the only line on stderr
    datasets.disable_progress_bars()
    try:
        info = datasets.load_dataset_builder(d.path, d.name).info
    except Exception as e:  # noqa: BLE001  (datasets raises many kinds)
        if "Config name is missing" in str(e) or "BuilderConfig" in str(e):  # the message lists the configurations
            return [f"data.path {d.path}: {cause(e)}; set data.name to one of them"]
        where = "in the cache (HF_HUB_OFFLINE is set)" if offline else "on the Hub"
        return [f"data.path {d.path}: cannot find it {where} ({cause(e)}); check the name, or {HUB_FIX}"]
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()
    p = []
    if info.features is not None and d.text_field not in info.features:
        p.append(f"data.text_field {d.text_field!r} is not a column of {d.path} (columns: {list(info.features)}); "
                 "set data.text_field")
    if d.curriculum.mode == "score" and info.features is not None and d.curriculum.score_column not in info.features:
        from .curriculum import missing_column

        p.append(missing_column(d.curriculum.score_column, d.path, list(info.features)))
    names = {part.split("[")[0].strip() for part in d.split.split("+")}  # datasets' "train[:10%]+validation"
    if info.splits and not names <= set(info.splits):
        p.append(f"data.split {d.split!r} is not a split of {d.path} (splits: {list(info.splits)}); set data.split")
    return p


def reachable(url: str, timeout: float = 3.0) -> bool:
    """A TCP connection to the endpoint opens (quick: huggingface_hub itself retries for about 30 s)."""
    u = urlparse(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False

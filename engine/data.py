"""Data: documents through `datasets`, tokenized and packed into fixed-length sequences, sharded by rank.

Map-style (default): every document is tokenized once, joined with EOS and cut into `seq_len` windows;
the windows are shuffled by the seed (the same order whatever the world size). Micro-batch j of rank r
holds global positions  j*micro*world + r*micro + [0, micro): the ranks' shards are disjoint, together
they cover the set, and a global batch is the same sequences on 1 rank or on N. The data position is
just j, so resuming is exact. With `data.curriculum` (length, or a score column) the documents are sorted before
packing and the first epoch reads the windows in that order instead of shuffled: ordering is a step before
sharding, so the shards stay disjoint and the position one integer (engine/curriculum.py).

Streaming (`data.streaming: true`): `datasets.distributed.split_dataset_by_node` gives each rank its own
files (or every world-th example), tokenized and packed on the fly; the stream repeats epochs forever so
no rank runs dry first. The position is the number of sequences consumed (skipped again on resume).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import tempfile
import zipfile
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .config import BUNDLED_TOKENIZER, ConfigError, DataConfig
from .curriculum import document_keys, document_order

PACK_VERSION = 1  # bump when packing changes, so old cache files are not read
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_tokenizer(name: str):
    """data.tokenizer's tokenizer ("auto" that found none with the model: the bundled one)."""
    from transformers import AutoTokenizer

    name = BUNDLED_TOKENIZER if name == "auto" else name
    where = Path(name).expanduser()
    if name.startswith(("/", ".", "~")) and not where.is_dir():
        raise ConfigError(f"data.tokenizer {name}: {'not a directory' if where.exists() else 'no such directory'}; "
                          "point it at a directory saved with save_pretrained (tokenizer.json and its config), a "
                          "Hugging Face hub name, or auto (the model's own, else the bundled one)")
    if where.is_dir() and not any(any(where.glob(g)) for g in ("tokenizer*", "*.model", "vocab.*", "merges.txt")):
        raise ConfigError(f"data.tokenizer {name}: the directory has no tokenizer files (tokenizer.json, "
                          "tokenizer_config.json, ...); point it at a directory saved with save_pretrained, or auto")
    try:
        tok = AutoTokenizer.from_pretrained(str(where) if where.is_dir() else name)  # transformers does not expand ~
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds)
        raise ConfigError(f"data.tokenizer {name}: cannot load ({type(e).__name__}: {str(e).splitlines()[0]}); "
                          "point it at a tokenizer directory") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer {name}: has no EOS token, which packing needs to separate documents")
    return tok


def vocab_problem(tok, tokenizer: str, vocab: int, model: str | None = None) -> str | None:
    """Why a model with `vocab` embeddings cannot take every id of `tok` (data.tokenizer `tokenizer`), or None.
    `model` names a loaded model (its vocabulary is fixed); None: the recipe's model.vocab_size."""
    if len(tok) <= vocab:
        return None
    if model is None:
        return (f"data.tokenizer has {len(tok)} tokens but model.vocab_size is {vocab}; raise model.vocab_size to at "
                f"least {len(tok)}")
    return (f"data.tokenizer {tokenizer} has {len(tok)} tokens but {model} has a vocabulary of {vocab}: ids from "
            f"{vocab} on have no embedding; set data.tokenizer to the tokenizer the model was trained with")


def looks_local(path: str) -> bool:
    return Path(path).exists() or path.startswith(("/", ".", "~")) or Path(path).suffix in FORMATS


def data_files(path: str) -> tuple[str, list[str]]:
    """The `datasets` builder name and the files of a local file or folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data.path {path}: no such file or folder (give a .jsonl/.json/.parquet/.txt file, "
                          "a folder of them, or a hub dataset name)")
    files = sorted(f for f in p.rglob("*") if f.suffix in FORMATS) if p.is_dir() else [p]
    kinds = {FORMATS.get(f.suffix) for f in files}
    if not files or None in kinds:
        raise ConfigError(f"data.path {path}: expected {'/'.join(FORMATS)} files, found "
                          f"{[f.name for f in files][:5] or 'none'}")
    if len(kinds) > 1:
        raise ConfigError(f"data.path {path}: mixes formats {sorted(kinds)}; keep one format per folder")
    return kinds.pop(), [str(f) for f in files]


def load_documents(d: DataConfig, streaming: bool | None = None, files: list[str] | None = None):
    """data.path's documents (`files`: only these of its local files)."""
    import datasets

    streaming = d.streaming if streaming is None else streaming
    try:
        if looks_local(d.path):
            builder, found = data_files(d.path)
            ds = datasets.load_dataset(builder, data_files=files or found, split="train", streaming=streaming)
        else:
            ds = datasets.load_dataset(d.path, d.name, split=d.split, streaming=streaming)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"data.path {d.path}: cannot load ({cause(e)})") from None
    columns = ds.column_names if ds.column_names is not None else list(next(iter(ds)).keys())
    if d.text_field not in columns:
        raise ConfigError(f"data.text_field {d.text_field!r} is not a column of {d.path} (columns: {columns}); "
                          "set data.text_field")
    return ds


def cause(e: BaseException) -> str:
    """The innermost cause of an error, in a line: datasets wraps the telling one ("An error occurred while
    generating the dataset")."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def as_text(text, d: DataConfig, where: str) -> str:
    """A row's text field; a row without text (null, a number, a list) is one ConfigError naming it."""
    if not isinstance(text, str):
        raise ConfigError(f"data.path {d.path}: {where} has {d.text_field} = {text!r:.40}, not a string; fix that row "
                          "(preflight checks only the head of a big corpus: docs/data.md)")
    return text


def pack(token_lists, eos: int, seq_len: int) -> np.ndarray:
    """Join documents with EOS and cut into (N, seq_len) windows; the tail shorter than seq_len is dropped."""
    flat = np.fromiter(itertools.chain.from_iterable(ids + [eos] for ids in token_lists), dtype=np.int64)
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len)


class PackedSequences:
    """Map-style: all sequences in memory, global order fixed by the seed. `ordered`: the first epoch reads them as
    they are (a curriculum packed them in its order); later epochs are shuffled."""

    def __init__(self, sequences: np.ndarray, seed: int, ordered: bool = False):
        if len(sequences) == 0:
            raise ConfigError("data: the dataset packs into zero sequences; use more text or a smaller data.seq_len")
        self.sequences, self.seed, self.ordered = sequences, seed, ordered
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def global_index(self, position: int) -> int:
        """The sequence at global position `position` (epochs follow each other, each reshuffled)."""
        epoch, i = divmod(position, len(self))
        if epoch == 0 and self.ordered:
            return i
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self))}
        return int(self._orders[epoch][i])

    def rank_positions(self, j: int, micro: int, rank: int, world: int) -> range:
        start = j * micro * world + rank * micro
        return range(start, start + micro)

    def micro_batches(self, micro: int, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        for j in itertools.count(start):
            ids = [self.global_index(g) for g in self.rank_positions(j, micro, rank, world)]
            yield j + 1, torch.from_numpy(self.sequences[ids])  # (micro, seq_len)


def to_device(ids: torch.Tensor, device) -> torch.Tensor:
    """A host batch onto the training device. On GPUs through pinned memory with an asynchronous copy: a plain
    `.to("cuda")` from pageable memory waits for every kernel already queued, so the host could not queue the
    next micro-batch while the device still runs the last one."""
    if torch.device(device).type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


class StreamedSequences:
    """Streaming: this rank's part of the stream, packed on the fly, repeated forever.

    A row that cannot be read or holds no text, or an epoch with no rows for this rank, raises one ConfigError
    (never a hang: the stream would otherwise loop forever on an empty share)."""

    def __init__(self, docs, tokenizer, d: DataConfig, rank: int, world: int, seed: int):
        from datasets.distributed import split_dataset_by_node

        files = data_files(d.path)[1] if looks_local(d.path) else []
        if world > 1 and files and len(files) % world == 0:
            # Local files in a multiple of the ranks: rank r keeps files r, r + world, ... for every epoch (datasets'
            # split_dataset_by_node deals the files out anew each epoch, and ranks whose shares differ in size count
            # epochs apart, so two ranks could read one file at once while another went unread).
            self.docs = load_documents(d, files=files[rank::world]).shuffle(seed=seed, buffer_size=1000)
        else:  # fewer files than ranks (every rank reads every world-th row), or a hub dataset's shards
            self.docs = split_dataset_by_node(docs.shuffle(seed=seed, buffer_size=1000), rank=rank, world_size=world)
        self.tok, self.d, self.rank, self.world = tokenizer, d, rank, world

    def rows(self, epoch: int) -> Iterator[dict]:
        self.docs.set_epoch(epoch)
        it, i = iter(self.docs), 0
        while True:
            try:
                row = next(it)
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001  (datasets and pyarrow raise many kinds)
                raise ConfigError(f"data.path {self.d.path}: cannot read row {i + 1} of rank {self.rank}'s share "
                                  f"(epoch {epoch}): {cause(e)}; fix the file") from None
            yield row
            i += 1
        if i == 0:
            raise ConfigError(f"data.path {self.d.path}: rank {self.rank} of {self.world} got no rows to stream; add "
                              "rows, or files in a multiple of the data-parallel ranks")

    def sequences(self) -> Iterator[np.ndarray]:
        eos, n = self.tok.eos_token_id, self.d.seq_len
        buf: list[int] = []
        for epoch in itertools.count():
            for i, row in enumerate(self.rows(epoch)):
                where = f"the row {json.dumps(row, default=str)[:80]} (row {i + 1} of rank {self.rank}'s shuffled share)"
                text = as_text(row.get(self.d.text_field), self.d, where)
                buf += self.tok(text)["input_ids"] + [eos]
                while len(buf) >= n:
                    yield np.asarray(buf[:n], dtype=np.int64)
                    buf = buf[n:]

    def micro_batches(self, micro: int, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        it = itertools.islice(self.sequences(), start * micro, None)
        for j in itertools.count(start):
            yield j + 1, torch.from_numpy(np.stack([next(it) for _ in range(micro)]))


class ReadAhead:
    """The next step's micro-batches, read before the step starts: a rank that cannot read them says so at a step
    boundary (checkpoint.Cadence.fail), where every rank can stop together, instead of dying inside a collective."""

    def __init__(self, batches: Iterator, per_step: int):
        self.batches, self.per_step, self.ready, self.error = batches, per_step, deque(), None

    def fill(self) -> ConfigError | None:
        try:
            while len(self.ready) < self.per_step:
                self.ready.append(next(self.batches))
        except ConfigError as e:
            self.error = e
        return self.error

    def __iter__(self):
        return self

    def __next__(self):
        return self.ready.popleft() if self.ready else next(self.batches)


def cache_dir() -> Path | None:
    """Where packed corpora are kept ($MOE_ENGINE_CACHE, default ~/.cache/moe_engine/packed; "off" disables)."""
    v = os.environ.get("MOE_ENGINE_CACHE", "")
    if v.lower() in ("off", "0", "false", "none"):
        return None
    return Path(v).expanduser() if v else Path.home() / ".cache" / "moe_engine" / "packed"


def packed_cache_key(d: DataConfig, tokenizer, seed: int) -> str | None:
    """A key naming exactly what `build_data` packs: the local files (path, size, mtime), the tokenizer's content,
    the text field, seq_len and a curriculum with the seed (which orders its ties; without a curriculum the packed
    windows do not depend on the seed, which shuffles them later). None: not cacheable (hub data)."""
    if not looks_local(d.path) or not Path(d.path).expanduser().exists():
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.sha256()
    for f in data_files(d.path)[1]:
        st = Path(f).stat()
        h.update(f"{Path(f).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(backend.to_str().encode())
    ordering = (d.curriculum, seed) if d.curriculum.mode != "none" else None  # the seed orders only a curriculum's ties
    h.update(repr((tokenizer.eos_token_id, d.text_field, d.seq_len, ordering, PACK_VERSION)).encode())
    return h.hexdigest()[:32]


def build_data(d: DataConfig, tokenizer, rank: int, world: int, seed: int):
    """The training sequences for this rank: PackedSequences or StreamedSequences.

    Map-style data is packed once per corpus, tokenizer and seq_len and kept in `cache_dir()` (a launch's ranks and
    later runs load it instead of reading and tokenizing every document again); a changed file changes the key."""
    key = None if d.streaming else packed_cache_key(d, tokenizer, seed)
    root = cache_dir()
    if d.streaming:
        return StreamedSequences(load_documents(d), tokenizer, d, rank, world, seed)
    with cache_lock(root, key):  # the first rank (of every launch on this machine) packs; the others wait, then load
        if key and root and (root / f"{key}.npz").is_file():
            try:
                with np.load(root / f"{key}.npz") as z:
                    return PackedSequences(z["sequences"], seed, ordered=bool(z["ordered"]))
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                pass  # a damaged cache file (empty, cut short, not an npz) is rebuilt below
        return pack_corpus(d, tokenizer, seed, root, key)


@contextlib.contextmanager
def cache_lock(root: Path | None, key: str | None):
    """An exclusive lock on the cache entry `key` for as long as the block runs (none without a cache, or where the
    file system has no locks)."""
    if not key or not root:
        yield
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        f = open(root / f"{key}.lock", "w")
    except OSError:
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def pack_corpus(d: DataConfig, tokenizer, seed: int, root: Path | None, key: str | None) -> "PackedSequences":
    """Read, tokenize and pack map-style data (and keep it in the cache under `key`)."""
    docs = load_documents(d)

    def tokenize(batch: dict, rows: list[int]) -> dict:
        texts = [as_text(t, d, f"row {i + 1}") for i, t in zip(rows, batch[d.text_field])]
        return {"ids": tokenizer(texts)["input_ids"]}

    try:
        tokenized = docs.map(tokenize, batched=True, with_indices=True, remove_columns=docs.column_names,
                             desc="tokenizing")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (what a row past the checked head can raise: bad bytes, bad types)
        raise ConfigError(f"data.path {d.path}: cannot read every row ({cause(e)}); preflight checks the files' "
                          "heads only: fix the file") from None
    ids = tokenized["ids"]
    keys = document_keys(d.curriculum, docs, ids, d.path)  # data.curriculum: None when off
    if keys is not None:
        ids = [ids[i] for i in document_order(keys, seed, d.curriculum.reverse)]
    sequences = pack(ids, tokenizer.eos_token_id, d.seq_len)
    if key and root and len(sequences):
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=root, suffix=".tmp", delete=False) as f:
                np.savez(f, sequences=sequences, ordered=np.array(keys is not None))
                f.flush()
                os.fsync(f.fileno())  # on disk before its name is: a power cut leaves no empty entry
            os.replace(f.name, root / f"{key}.npz")  # atomic: a rank reading it sees all of it or none
        except OSError:
            pass  # a read-only or full cache only costs the next run its tokenizing
    return PackedSequences(sequences, seed, ordered=keys is not None)

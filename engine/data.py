"""Data: documents through `datasets`, tokenized and packed into fixed-length sequences, sharded by rank.

Map-style (default): every document is tokenized once, joined with EOS and cut into `seq_len` windows;
the windows are shuffled by the seed (the same order whatever the world size). Micro-batch j of rank r
holds global positions  j*micro*world + r*micro + [0, micro): the ranks' shards are disjoint, together
they cover the set, and a global batch is the same sequences on 1 rank or on N. The data position is
just j, so resuming is exact.

Streaming (`data.streaming: true`): `datasets.distributed.split_dataset_by_node` gives each rank its own
files (or every world-th example), tokenized and packed on the fly; the stream repeats epochs forever so
no rank runs dry first. The position is the number of sequences consumed (skipped again on resume).
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .config import ConfigError, DataConfig

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds)
        raise ConfigError(f"data.tokenizer {name}: cannot load ({type(e).__name__}: {str(e).splitlines()[0]}); "
                          "point it at a tokenizer directory") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer {name}: has no EOS token, which packing needs to separate documents")
    return tok


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


def load_documents(d: DataConfig, streaming: bool | None = None):
    import datasets

    streaming = d.streaming if streaming is None else streaming
    try:
        if looks_local(d.path):
            builder, files = data_files(d.path)
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming)
        else:
            ds = datasets.load_dataset(d.path, split=d.split, streaming=streaming)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"data.path {d.path}: cannot load ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    columns = ds.column_names if ds.column_names is not None else list(next(iter(ds)).keys())
    if d.text_field not in columns:
        raise ConfigError(f"data.text_field {d.text_field!r} is not a column of {d.path} (columns: {columns}); "
                          "set data.text_field")
    return ds


def pack(token_lists, eos: int, seq_len: int) -> np.ndarray:
    """Join documents with EOS and cut into (N, seq_len) windows; the tail shorter than seq_len is dropped."""
    flat = np.fromiter(itertools.chain.from_iterable(ids + [eos] for ids in token_lists), dtype=np.int64)
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len)


class PackedSequences:
    """Map-style: all sequences in memory, global order fixed by the seed."""

    def __init__(self, sequences: np.ndarray, seed: int):
        if len(sequences) == 0:
            raise ConfigError("data: the dataset packs into zero sequences; use more text or a smaller data.seq_len")
        self.sequences, self.seed = sequences, seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def global_index(self, position: int) -> int:
        """The sequence at global position `position` (epochs follow each other, each reshuffled)."""
        epoch, i = divmod(position, len(self))
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
    """Streaming: this rank's part of the stream, packed on the fly, repeated forever."""

    def __init__(self, docs, tokenizer, d: DataConfig, rank: int, world: int, seed: int):
        from datasets.distributed import split_dataset_by_node

        self.docs = split_dataset_by_node(docs.shuffle(seed=seed, buffer_size=1000), rank=rank, world_size=world)
        self.tok, self.d = tokenizer, d

    def sequences(self) -> Iterator[np.ndarray]:
        eos, n = self.tok.eos_token_id, self.d.seq_len
        buf: list[int] = []
        for epoch in itertools.count():
            self.docs.set_epoch(epoch)
            for row in self.docs:
                buf += self.tok(row[self.d.text_field])["input_ids"] + [eos]
                while len(buf) >= n:
                    yield np.asarray(buf[:n], dtype=np.int64)
                    buf = buf[n:]

    def micro_batches(self, micro: int, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
        it = itertools.islice(self.sequences(), start * micro, None)
        for j in itertools.count(start):
            yield j + 1, torch.from_numpy(np.stack([next(it) for _ in range(micro)]))


def build_data(d: DataConfig, tokenizer, rank: int, world: int, seed: int):
    """The training sequences for this rank: PackedSequences or StreamedSequences."""
    docs = load_documents(d)
    if d.streaming:
        return StreamedSequences(docs, tokenizer, d, rank, world, seed)
    tokenized = docs.map(lambda b: {"ids": tokenizer(b[d.text_field])["input_ids"]}, batched=True,
                         remove_columns=docs.column_names, desc="tokenizing")
    return PackedSequences(pack(tokenized["ids"], tokenizer.eos_token_id, d.seq_len), seed)

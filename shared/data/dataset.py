"""Tokenized training data: a memory-mapped Arrow dataset, length buckets and a deterministic batch plan.

File format (written by ``launch.py prepare``, see ``cli/prepare.py`` and ``shared/data/encode.py``): one Arrow IPC
*file* with the columns ``input_ids: list<int32>``, ``loss_mask: list<uint8>`` (same length as ``input_ids`` in every
row), ``source_file: int32`` (index into the sidecar's ``inputs`` list) and ``source_row: int64`` (line number, 1-based,
for JSONL; row number, 0-based, for Parquet; chunk number for the demo corpus). The file may hold several record batches
(``prepare`` flushes every few thousand rows so it never holds the whole dataset). Next to it lives a JSON sidecar,
``sidecar_path(path)`` (``train.arrow`` -> ``train.json``), with the tokenizer's name, vocab size and pad id, counts and
token statistics.

What is guaranteed:

* ``TokenDataset`` maps the file and never copies token data: opening it costs O(number of record
  batches) plus one pass over the offsets to build ``lengths`` (4 bytes per sample). Rows are numpy views
  into the mapping.
* ``BatchPlan.epoch(e)`` is a pure function of (lengths, dataset fingerprint, bucket edges, token budget,
  seed, epoch). It uses only integer arithmetic (a splitmix64 hash, no floating point, no numpy random
  generator whose stream could change between numpy versions), so two processes on any machine get the
  same batches in the same order.
* Every sample appears in exactly one batch per epoch; ``len(batch) * batch.pad_to <= max_tokens`` for
  every batch except a batch of a single sample longer than ``max_tokens``, which is a batch by itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
BATCH_ID_STRIDE = 10**9   # batch_id = epoch * BATCH_ID_STRIDE + position of the batch in its epoch
REQUIRED_COLUMNS = ("input_ids", "loss_mask")


def sidecar_path(path: str | Path) -> Path:
    """The JSON sidecar of an Arrow data file: same name, suffix ``.json`` (``train.arrow`` -> ``train.json``)."""
    return Path(path).with_suffix(".json")


class TokenDataset:
    """A read-only, memory-mapped view of a tokenized Arrow IPC file.

    ``len(ds)`` samples; ``ds.lengths``: ``[N] int32`` tokens per sample; ``ds[i]`` ->
    ``(input_ids [L] int32, loss_mask [L] uint8)``, both numpy views into the mapping (read-only; copy before
    changing them). ``ds.fingerprint``: a hex string that changes when the samples' lengths or (when the
    sidecar records it) their content change. ``ds.vocab_size`` / ``ds.pad_id``: from the sidecar, ``None``
    when there is none. ``ds.meta``: the whole sidecar (``{}`` when absent).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the column for a file that is
    not in this format (missing column, wrong type, nulls, ``loss_mask`` row lengths that differ from
    ``input_ids``).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"dataset file not found: {self.path}")
        self._mmap = pa.memory_map(str(self.path), "r")
        reader = ipc.open_file(self._mmap)
        self.schema = reader.schema
        for name in REQUIRED_COLUMNS:
            if name not in self.schema.names:
                raise ValueError(f"{self.path}: column {name!r} missing (columns: {self.schema.names})")
        self._check_type("input_ids", pa.int32())
        self._check_type("loss_mask", pa.uint8())
        ids_col = self.schema.get_field_index("input_ids")
        mask_col = self.schema.get_field_index("loss_mask")
        self._ids_offsets: list[np.ndarray] = []
        self._ids_values: list[np.ndarray] = []
        self._mask_offsets: list[np.ndarray] = []
        self._mask_values: list[np.ndarray] = []
        self._chunk_batch: list[int] = []   # record batch index of each non-empty chunk
        lengths = []
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            if batch.num_rows == 0:
                continue
            ids, mask = batch.column(ids_col), batch.column(mask_col)
            if ids.null_count or mask.null_count:
                raise ValueError(f"{self.path}: null rows in record batch {b}")
            io, iv = _list_views(ids)
            mo, mv = _list_views(mask)
            ilen, mlen = np.diff(io), np.diff(mo)
            if not np.array_equal(ilen, mlen):
                row = int(np.nonzero(ilen != mlen)[0][0]) + sum(len(x) for x in lengths)
                raise ValueError(f"{self.path}: row {row}: loss_mask length differs from input_ids length")
            self._ids_offsets.append(io)
            self._ids_values.append(iv)
            self._mask_offsets.append(mo)
            self._mask_values.append(mv)
            self._chunk_batch.append(b)
            lengths.append(ilen.astype(np.int32))
        self.lengths: np.ndarray = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
        self.lengths.setflags(write=False)
        sizes = np.array([len(x) for x in lengths], dtype=np.int64)
        self._chunk_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._columns = set(self.schema.names)
        self._reader = reader
        side = sidecar_path(self.path)
        self.meta: dict = json.loads(side.read_text()) if side.is_file() else {}
        self.vocab_size: int | None = self.meta.get("vocab_size")
        self.pad_id: int | None = self.meta.get("pad_id")
        self.fingerprint: str = self._fingerprint()

    def _check_type(self, name: str, value_type: pa.DataType) -> None:
        t = self.schema.field(name).type
        if not (pa.types.is_list(t) and t.value_type == value_type):
            raise ValueError(f"{self.path}: column {name!r} must be list<{value_type}>, got {t}")

    def _fingerprint(self) -> str:
        h = hashlib.sha1(f"specring-data-v{FORMAT_VERSION}|{len(self)}|".encode())
        h.update(self.lengths.astype("<i8").tobytes())
        h.update(str(self.meta.get("content_sha1", "")).encode())
        return h.hexdigest()

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def _locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n} samples ({self.path})")
        i = i % n if i < 0 else i
        if len(self._chunk_starts) == 2:
            return 0, i
        c = int(np.searchsorted(self._chunk_starts, i, side="right")) - 1
        return c, i - int(self._chunk_starts[c])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        c, j = self._locate(int(i))
        a, b = self._ids_offsets[c][j], self._ids_offsets[c][j + 1]
        ma, mb = self._mask_offsets[c][j], self._mask_offsets[c][j + 1]
        return self._ids_values[c][a:b], self._mask_values[c][ma:mb]

    def source(self, i: int) -> tuple[int, int]:
        """``(source_file index, source_row)`` of sample ``i`` (``(-1, i)`` when the file has no such columns)."""
        if "source_row" not in self._columns:
            return -1, int(i)
        c, j = self._locate(int(i))
        batch = self._reader.get_batch(self._chunk_batch[c])
        f = batch.column("source_file")[j].as_py() if "source_file" in self._columns else -1
        return int(f), int(batch.column("source_row")[j].as_py())

    def content_digest(self) -> str:
        """``"sha256:<hex>"`` of what training reads: the sample lengths (int64 LE), then every token id
        (int32 LE), then every loss-mask byte, in sample order. Independent of record-batch boundaries, the
        sidecar and the ``source_*`` columns; any changed, added, removed or reordered token or mask value
        changes it. Streams the memory-mapped buffers once (about 1-2 s per GB)."""
        h = hashlib.sha256(b"specring-data-content-v1|")
        h.update(self.lengths.astype("<i8").tobytes())
        for offsets, values in ((self._ids_offsets, self._ids_values), (self._mask_offsets, self._mask_values)):
            for o, v in zip(offsets, values):
                part = np.ascontiguousarray(v[int(o[0]):int(o[-1])])
                h.update(memoryview(part.astype(part.dtype.newbyteorder("<"), copy=False)).cast("B"))
        return "sha256:" + h.hexdigest()

    def samples_without_anchor(self) -> np.ndarray:
        """Indices ``[K] int64`` (ascending) of the samples that cannot give a single DFlash anchor
        (``has_anchor``): every step of a batch made only of them trains nothing. One vectorised pass over
        the memory-mapped ``loss_mask`` values."""
        parts = [anchorless_rows(o, v) + int(start)
                 for o, v, start in zip(self._mask_offsets, self._mask_values, self._chunk_starts)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def loss_token_counts(self, vocab_size: int) -> np.ndarray:
        """``[vocab_size] int64``: how often each token id occurs where ``loss_mask`` is set (the counts an
        EAGLE-3 draft vocabulary is chosen from, ``shared.drafters.draft_vocab``). One vectorised pass over the
        memory-mapped columns. Raises ``ValueError`` for an id outside ``[0, vocab_size)``."""
        counts = np.zeros(int(vocab_size), dtype=np.int64)
        for (io, iv), (mo, mv) in zip(zip(self._ids_offsets, self._ids_values),
                                      zip(self._mask_offsets, self._mask_values)):
            ids = np.asarray(iv[int(io[0]):int(io[-1])], dtype=np.int64)
            mask = np.asarray(mv[int(mo[0]):int(mo[-1])]) != 0
            picked = ids[mask]
            if picked.size and (picked.min() < 0 or picked.max() >= vocab_size):
                raise ValueError(f"{self.path}: token ids outside 0..{vocab_size - 1} (min {picked.min()}, "
                                 f"max {picked.max()})")
            counts += np.bincount(picked, minlength=int(vocab_size))
        return counts

    @property
    def num_tokens(self) -> int:
        """Total tokens in the dataset."""
        return int(self.lengths.sum(dtype=np.int64))

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, samples={len(self)}, tokens={self.num_tokens})"


def has_anchor(loss_mask: np.ndarray | Sequence[int]) -> bool:
    """Whether one sample's ``loss_mask [L]`` allows a DFlash anchor: a position ``p`` with
    ``loss_mask[p] == loss_mask[p+1] == 1`` (the rule of ``shared.drafters.dflash_blocks.eligible_anchors`` for one
    sequence; slot 1 of the anchor's block then has a label). A sample without one trains nothing."""
    m = np.asarray(loss_mask) != 0
    return bool((m[:-1] & m[1:]).any())


def anchorless_rows(offsets: np.ndarray, mask_values: np.ndarray) -> np.ndarray:
    """Row indices ``[K] int64`` of a list column (``offsets [N+1]`` into ``mask_values``) whose loss mask
    has no anchor (``has_anchor``), vectorised: a cumulative count of adjacent loss pairs, read per row."""
    o = np.asarray(offsets, dtype=np.int64) - int(offsets[0])
    m = np.asarray(mask_values)[int(offsets[0]):int(offsets[0]) + int(o[-1])] != 0
    pairs = np.concatenate([[0], np.cumsum(m[:-1] & m[1:], dtype=np.int64)]) if len(m) else np.zeros(1, np.int64)
    start, end = o[:-1], np.maximum(o[1:] - 1, o[:-1])   # pairs (p, p+1) with start <= p < end
    return np.flatnonzero(pairs[end] - pairs[start] == 0).astype(np.int64)


def _list_views(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n+1], values) of a list array as zero-copy numpy views; offsets index into values."""
    offsets = arr.offsets.to_numpy(zero_copy_only=True)
    values = arr.values.to_numpy(zero_copy_only=True)
    return offsets, values


# ---------------------------------------------------------------------------------------------------------
# Batch plan


@dataclass(frozen=True)
class Batch:
    """One batch of the plan.

    ``batch_id = epoch * BATCH_ID_STRIDE + position`` (``position`` = index of the batch in its epoch's
    order), so ids are stable for a given plan and unique across epochs. ``sample_ids``: dataset row
    indices. ``pad_to``: the padded length, the longest sample of this batch (not the bucket's upper
    edge), so ``len(sample_ids) * pad_to`` is the padded token count that the budget bounds.
    """
    batch_id: int
    epoch: int
    sample_ids: tuple[int, ...]
    pad_to: int

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_padded_tokens(self) -> int:
        return len(self.sample_ids) * self.pad_to


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (Steele, Lea & Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014; constants from Vigna's public-domain splitmix64.c). Wraps modulo 2**64."""
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def _permutation(n: int, key: int) -> np.ndarray:
    """A permutation of ``range(n)`` that depends only on ``(n, key)``: sort by splitmix64 hashes."""
    keys = _mix64(np.arange(n, dtype=np.uint64) ^ np.uint64(key & 0xFFFFFFFFFFFFFFFF))
    return np.argsort(keys, kind="stable")


class BatchPlan:
    """Length buckets cut into batches under a padded-token budget; one deterministic plan per epoch.

    Args:
        lengths: ``[N]`` tokens per sample (``TokenDataset.lengths``); every length must be >= 1.
        max_tokens: budget of *padded* tokens per batch, ``len(batch) * pad_to``.
        max_batch_size: at most this many sequences per batch.
        bucket_edges: increasing lengths ``e0 < e1 < ...``; bucket ``k`` holds lengths in
            ``[e_k, e_{k+1})``. ``0`` is prepended when ``e0`` exceeds the shortest sample and
            ``max(lengths)+1`` appended when the last edge is not above the longest, so every sample has a
            bucket. ``None``: ``num_buckets`` buckets at the length quantiles (equal sample counts, fewer
            when lengths repeat).
        seed, fingerprint: mixed into every epoch's order (``TokenDataset.fingerprint``).

    Cutting (the per-bucket batch size of TensorFlow's ``bucket_by_sequence_length``, with fairseq's
    padded-token budget, ``fairseq/data/data_utils_fast.pyx`` ``batch_by_size``): bucket ``k`` with
    longest sample ``m_k`` gets batches of ``max(1, min(max_batch_size, max_tokens // m_k))`` samples, in
    an order shuffled per epoch; the last batch of a bucket may be smaller. Then all batches of the epoch
    are shuffled together. A sample longer than ``max_tokens`` makes its bucket's batch size 1, so it is a
    batch alone (the only case where the budget is exceeded). ``pad_to`` is the longest sample of the batch.

    Raises ``ValueError`` naming the argument for a bad budget, edges or lengths.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, *, max_tokens: int, max_batch_size: int,
                 bucket_edges: Sequence[int] | None = None, num_buckets: int = 8, seed: int = 0,
                 fingerprint: str = ""):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {self.lengths.shape}")
        if len(self.lengths) and int(self.lengths.min()) < 1:
            raise ValueError(f"lengths: sample {int(np.argmin(self.lengths))} has length "
                             f"{int(self.lengths.min())} (< 1)")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.max_tokens, self.max_batch_size = int(max_tokens), int(max_batch_size)
        self.seed, self.fingerprint = int(seed), str(fingerprint)
        self.edges = self._edges(bucket_edges, num_buckets)
        self._bucket_of = (np.searchsorted(np.asarray(self.edges, dtype=np.int64), self.lengths, side="right") - 1)
        self._bucket_members = [np.nonzero(self._bucket_of == k)[0] for k in range(len(self.edges) - 1)]
        self.bucket_batch_size = []
        for members in self._bucket_members:
            longest = int(self.lengths[members].max()) if len(members) else 1
            self.bucket_batch_size.append(max(1, min(self.max_batch_size, self.max_tokens // longest)))
        self._base_key = int.from_bytes(hashlib.sha1(
            f"{self.fingerprint}|{self.seed}|{self.edges}|{self.max_tokens}|{self.max_batch_size}".encode()
        ).digest()[:8], "little")

    def _edges(self, given: Sequence[int] | None, num_buckets: int) -> list[int]:
        n = len(self.lengths)
        lo = int(self.lengths.min()) if n else 1
        hi = int(self.lengths.max()) + 1 if n else 2
        if given is not None:
            e = [int(x) for x in given]
            if not e or any(a >= b for a, b in zip(e, e[1:])):
                raise ValueError(f"bucket_edges must be a non-empty increasing list, got {list(given)}")
            if e[0] > lo:
                e = [0] + e
            if e[-1] < hi:
                e = e + [hi]
            return e
        s = np.sort(self.lengths)
        picks = [int(s[(k * n) // num_buckets]) for k in range(1, num_buckets)] if n else []
        return sorted(set([lo] + picks + [hi]))

    @property
    def num_samples(self) -> int:
        return int(len(self.lengths))

    def _epoch_key(self, epoch: int, salt: int) -> int:
        x = _mix64(np.array([(self._base_key ^ (epoch * 0x9E3779B1 + salt)) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
        return int(x[0])

    def epoch(self, epoch: int) -> list[Batch]:
        """The batches of ``epoch`` (>= 0) in training order; see the class docstring for how they are cut."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        groups: list[np.ndarray] = []
        for k, members in enumerate(self._bucket_members):
            if not len(members):
                continue
            order = members[_permutation(len(members), self._epoch_key(epoch, 2 * k + 1))]
            bs = self.bucket_batch_size[k]
            groups.extend(order[i:i + bs] for i in range(0, len(order), bs))
        perm = _permutation(len(groups), self._epoch_key(epoch, 0))
        if len(groups) >= BATCH_ID_STRIDE:
            raise ValueError(f"{len(groups)} batches per epoch exceed the batch id stride {BATCH_ID_STRIDE}")
        out = []
        for pos, g in enumerate(perm):
            ids = groups[int(g)]
            out.append(Batch(batch_id=epoch * BATCH_ID_STRIDE + pos, epoch=epoch,
                             sample_ids=tuple(ids.tolist()), pad_to=int(self.lengths[ids].max())))
        return out

    def num_batches(self, epoch: int = 0) -> int:
        """Batches per epoch (the same for every epoch: buckets and their batch sizes do not change)."""
        return sum(-(-len(m) // bs) for m, bs in zip(self._bucket_members, self.bucket_batch_size))

    def summary(self, epoch: int = 0) -> str:
        """Human-readable summary: samples, batches per epoch, sequences per batch, padding, one line per bucket."""
        batches = self.epoch(epoch)
        sizes = np.array([len(b) for b in batches], dtype=np.int64) if batches else np.zeros(1, np.int64)
        real = int(self.lengths.sum())
        padded = sum(b.num_padded_tokens for b in batches)
        lines = [
            f"samples: {self.num_samples}  tokens: {real}",
            f"batches per epoch: {len(batches)}  sequences per batch: min {int(sizes.min())} "
            f"max {int(sizes.max())} avg {sizes.mean():.1f}  (max_tokens={self.max_tokens}, "
            f"max_batch_size={self.max_batch_size})",
            f"padding: {padded} padded tokens for {real} real ({100.0 * real / max(padded, 1):.1f}% real)",
            "buckets:",
        ]
        total = max(len(batches), 1)
        for k in range(len(self.edges) - 1):
            nb = -(-len(self._bucket_members[k]) // self.bucket_batch_size[k])
            lines.append(f"  [{self.edges[k]}, {self.edges[k + 1]}): {nb} batches ({100.0 * nb / total:.1f}%)"
                         f"  {len(self._bucket_members[k])} samples, batch size {self.bucket_batch_size[k]}")
        return "\n".join(lines)


def collate(ds: TokenDataset, sample_ids: Sequence[int], pad_to: int, pad_id: int):
    """Right-padded tensors of the samples ``sample_ids`` of ``ds``.

    Returns ``(input_ids [B, pad_to] int64, attention_mask [B, pad_to] int64 (1 on real tokens),
    loss_mask [B, pad_to] uint8 (0 on padding), lengths [B] int64)`` as torch CPU tensors.
    Raises ``ValueError`` naming the sample when one is longer than ``pad_to``.
    """
    import torch

    b = len(sample_ids)
    ids = np.full((b, pad_to), pad_id, dtype=np.int64)
    attn = np.zeros((b, pad_to), dtype=np.int64)
    mask = np.zeros((b, pad_to), dtype=np.uint8)
    lengths = np.zeros(b, dtype=np.int64)
    for r, s in enumerate(sample_ids):
        x, m = ds[int(s)]
        n = len(x)
        if n > pad_to:
            raise ValueError(f"sample {int(s)} has {n} tokens, more than pad_to={pad_to}")
        ids[r, :n] = x
        attn[r, :n] = 1
        mask[r, :n] = m
        lengths[r] = n
    return (torch.from_numpy(ids), torch.from_numpy(attn), torch.from_numpy(mask), torch.from_numpy(lengths))

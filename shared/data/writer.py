"""Samples into an Arrow file: ``ArrowSink`` (record batches to a temporary name, renamed at commit, with its
JSON sidecar), ``write_dataset`` (a ``Runner``'s results into a sink, with progress and the bad-row report).

The file format is ``specring.shared.data.dataset``'s.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from specring.shared.data.encode import (
    BAD_KINDS,
    EXAMPLES_PER_KIND,
    ChunkResult,
    EncoderConfig,
    Runner,
    StrictError,
    Task,
)

FLUSH_ROWS = 16384                   # rows per Arrow record batch ...


FLUSH_TOKENS = 1 << 24               # ... or tokens (list<int32> offsets must stay < 2**31 per batch)


class ArrowSink:
    """Appends ``ChunkResult`` samples to ``<path>.tmp`` in record batches; ``commit()`` renames it."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.ipc as ipc

        self.pa = pa
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                                 ("source_file", pa.int32()), ("source_row", pa.int64())])
        self._writer = ipc.new_file(str(self.tmp), self.schema)
        self._buf: list[ChunkResult] = []
        self._buf_rows = self._buf_tokens = 0
        self.sha1 = hashlib.sha1()
        self.lengths: list[np.ndarray] = []
        self.loss_tokens = 0

    def add(self, r: ChunkResult) -> None:
        if not len(r.lengths):
            return
        self._buf.append(r)
        self._buf_rows += len(r.lengths)
        self._buf_tokens += len(r.ids)
        self.sha1.update(r.lengths.astype("<i4").tobytes())
        self.sha1.update(r.ids.astype("<i4").tobytes())
        self.sha1.update(r.mask.tobytes())
        self.lengths.append(r.lengths)
        self.loss_tokens += int(r.mask.sum(dtype=np.int64))
        if self._buf_rows >= FLUSH_ROWS or self._buf_tokens >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        pa = self.pa
        lengths = np.concatenate([r.lengths for r in self._buf])
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))
        ids = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([r.ids for r in self._buf])))
        mask = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([r.mask for r in self._buf])))
        self._writer.write_batch(pa.record_batch([
            ids, mask, pa.array(np.concatenate([r.source_file for r in self._buf])),
            pa.array(np.concatenate([r.source_row for r in self._buf]))], schema=self.schema))
        self._buf, self._buf_rows, self._buf_tokens = [], 0, 0

    def stats(self) -> dict:
        """Sample and token statistics of everything added so far."""
        lens = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        out = {"num_samples": int(len(lens)), "num_tokens": int(lens.sum(dtype=np.int64)),
               "num_loss_tokens": self.loss_tokens}
        if len(lens):
            p = np.percentile(lens, [50, 90, 99])
            out["length"] = {"min": int(lens.min()), "max": int(lens.max()), "mean": round(float(lens.mean()), 2),
                             "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}
        return out

    def commit(self, sidecar: dict) -> None:
        from specring.shared.data.dataset import sidecar_path

        self._flush()
        self._writer.close()
        side = sidecar_path(self.path)
        tmp_side = side.with_name(side.name + ".tmp")
        tmp_side.write_text(json.dumps(sidecar, indent=1) + "\n")
        os.replace(self.tmp, self.path)
        os.replace(tmp_side, side)

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass
        self.tmp.unlink(missing_ok=True)


def write_dataset(runner: Runner, tasks: Iterable[Task], output: Path, *, inputs: list[str], total_rows: int,
                  strict: bool, progress: bool, meta: dict) -> dict:
    """Run ``tasks`` through ``runner`` into ``output`` (+ sidecar); returns the sidecar dict.

    ``inputs``: the file names that ``Task.file_index`` indexes (stored in the sidecar). Raises
    ``StrictError`` at the first bad row when ``strict`` (nothing is written then), ``ValueError`` when
    no row gave a sample.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    sink = ArrowSink(output)
    counts: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    rows_read = 0
    try:
        with tqdm(total=total_rows or None, unit="row", desc=f"prepare {output.name}", disable=not progress,
                  file=sys.stderr, dynamic_ncols=True, mininterval=0.5) as bar:
            for res in runner.map(tasks):
                for kind, fi, where, detail in res.bad:
                    if strict:
                        raise StrictError(f"{inputs[fi]} {where}: {kind}: {detail} (--strict)")
                    if len(examples[kind]) < EXAMPLES_PER_KIND:
                        examples[kind].append(f"{inputs[fi]} {where}: {detail}")
                counts.update(res.counts)
                rows_read += res.rows_read
                sink.add(res)
                bar.update(res.rows_read)
        stats = sink.stats()
        if stats["num_samples"] == 0:
            raise ValueError(f"{output}: no sample was produced from {rows_read} rows "
                             f"(bad rows: {dict(sorted(_bad_counts(counts).items()))})")
        sidecar = dict(meta, format_version=1, inputs=inputs, rows_read=rows_read,
                       truncated=counts.get("truncated", 0), dropped_overlong=counts.get("dropped_overlong", 0),
                       bad_rows=dict(sorted(_bad_counts(counts).items())), bad_examples=dict(examples),
                       content_sha1=sink.sha1.hexdigest(), time_s=round(time.perf_counter() - t0, 2), **stats)
        sink.commit(sidecar)
        return sidecar
    except BaseException:
        sink.abort()
        raise


def _bad_counts(counts: collections.Counter) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k in BAD_KINDS}


def report(sidecar: dict, output: Path) -> str:
    """Human-readable lines about one written dataset: counts, bad rows with their first examples."""
    lines = [f"wrote {output}: {sidecar['num_samples']} samples, {sidecar['num_tokens']} tokens "
             f"({sidecar['num_loss_tokens']} with loss) from {sidecar['rows_read']} rows in {sidecar['time_s']} s"]
    if "length" in sidecar:
        s = sidecar["length"]
        lines.append(f"  length: min {s['min']} p50 {s['p50']:.0f} p90 {s['p90']:.0f} p99 {s['p99']:.0f} "
                     f"max {s['max']} mean {s['mean']}")
    lines.append(f"  over --max-length {sidecar['max_length']}: truncated {sidecar['truncated']}, "
                 f"dropped {sidecar['dropped_overlong']}")
    bad = sidecar.get("bad_rows", {})
    lines.append(f"  bad rows skipped: {sum(bad.values())}" + (f" {bad}" if bad else ""))
    for kind, ex in sidecar.get("bad_examples", {}).items():
        for e in ex:
            lines.append(f"    {kind}: {e}")
    return "\n".join(lines)


def _tokenizer_meta(tokenizer: Path, tok, cfg: EncoderConfig, overlong: str) -> dict:
    return {"tokenizer": Path(tokenizer).resolve().name, "tokenizer_path": str(Path(tokenizer).resolve()),
            "vocab_size": cfg.vocab_size, "pad_id": tok.pad_token_id, "eos_id": tok.eos_token_id,
            "max_length": cfg.max_length, "overlong": overlong}

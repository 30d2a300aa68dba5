"""Unit tests of shared/data/dataset.py: the memory-mapped TokenDataset, the BatchPlan and collate."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from specring.shared.data.dataset import (
    BATCH_ID_STRIDE,
    Batch,
    BatchPlan,
    TokenDataset,
    collate,
    sidecar_path,
)
from tests.support import REPO


def write_arrow(path: Path, rows: list[tuple[list[int], list[int]]], chunk_rows: int = 1000,
                meta: dict | None = None) -> Path:
    """Write ``rows`` of (input_ids, loss_mask) in record batches of ``chunk_rows``."""
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                        ("source_file", pa.int32()), ("source_row", pa.int64())])
    with ipc.new_file(str(path), schema) as w:
        for start in range(0, len(rows), chunk_rows):
            part = rows[start:start + chunk_rows]
            w.write_batch(pa.record_batch([
                pa.array([r[0] for r in part], pa.list_(pa.int32())),
                pa.array([r[1] for r in part], pa.list_(pa.uint8())),
                pa.array([0] * len(part), pa.int32()),
                pa.array(range(start, start + len(part)), pa.int64())], schema=schema))
    if meta is not None:
        sidecar_path(path).write_text(json.dumps(meta))
    return path


def random_rows(n: int, seed: int = 0, max_len: int = 50) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        L = int(rng.integers(1, max_len + 1))
        rows.append((rng.integers(0, 8192, L).tolist(), rng.integers(0, 2, L).tolist()))
    return rows


# ------------------------------------------------------------------------------------------------ dataset


def test_dataset_roundtrip_across_record_batches(tmp_path):
    rows = random_rows(257)
    path = write_arrow(tmp_path / "d.arrow", rows, chunk_rows=50, meta={"vocab_size": 8192, "pad_id": 3})
    ds = TokenDataset(path)
    assert len(ds) == 257
    assert ds.lengths.dtype == np.int32
    assert ds.lengths.tolist() == [len(r[0]) for r in rows]
    assert ds.vocab_size == 8192 and ds.pad_id == 3
    for i in (0, 49, 50, 51, 199, 200, 256, -1):
        ids, mask = ds[i]
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        assert ids.tolist() == rows[i][0] and mask.tolist() == rows[i][1]
        assert not ids.flags.owndata and not ids.flags.writeable   # a view into the read-only mapping
    assert ds.source(120) == (0, 120)
    with pytest.raises(IndexError, match="257"):
        ds[257]


def test_dataset_fingerprint_stable_and_sensitive(tmp_path):
    rows = random_rows(40)
    a = TokenDataset(write_arrow(tmp_path / "a.arrow", rows)).fingerprint
    b = TokenDataset(write_arrow(tmp_path / "b.arrow", rows, chunk_rows=7)).fingerprint
    assert a == b and re.fullmatch(r"[0-9a-f]{40}", a)
    rows2 = rows[:-1] + [(rows[-1][0] + [1], rows[-1][1] + [1])]
    assert TokenDataset(write_arrow(tmp_path / "c.arrow", rows2)).fingerprint != a


def test_dataset_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        TokenDataset(tmp_path / "missing.arrow")
    t = pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int32()))})
    with ipc.new_file(str(tmp_path / "nomask.arrow"), t.schema) as w:
        w.write_table(t)
    with pytest.raises(ValueError, match="loss_mask"):
        TokenDataset(tmp_path / "nomask.arrow")
    t = pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int64())),
                  "loss_mask": pa.array([[1, 1]], pa.list_(pa.uint8()))})
    with ipc.new_file(str(tmp_path / "int64.arrow"), t.schema) as w:
        w.write_table(t)
    with pytest.raises(ValueError, match="input_ids.*int32"):
        TokenDataset(tmp_path / "int64.arrow")
    t = pa.table({"input_ids": pa.array([[1, 2], [3, 4, 5]], pa.list_(pa.int32())),
                  "loss_mask": pa.array([[1, 1], [1, 1]], pa.list_(pa.uint8()))})
    with ipc.new_file(str(tmp_path / "mismatch.arrow"), t.schema) as w:
        w.write_table(t)
    with pytest.raises(ValueError, match="row 1"):
        TokenDataset(tmp_path / "mismatch.arrow")


@pytest.fixture(scope="module")
def million_file(tmp_path_factory):
    """1,000,000 samples of 1..63 tokens (~32 M tokens, ~180 MB), written in record batches."""
    path = tmp_path_factory.mktemp("big") / "million.arrow"
    rng = np.random.default_rng(1)
    n, chunk = 1_000_000, 100_000
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])
    with ipc.new_file(str(path), schema) as w:
        for _ in range(n // chunk):
            lengths = rng.integers(1, 64, chunk)
            offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            total = int(lengths.sum())
            ids = pa.ListArray.from_arrays(offsets, pa.array(np.arange(total, dtype=np.int32) % 8192))
            mask = pa.ListArray.from_arrays(offsets, pa.array(np.ones(total, np.uint8)))
            w.write_batch(pa.record_batch([ids, mask], schema=schema))
    gc.collect()
    return path


def test_million_samples_open_lazily(million_file):
    proc = psutil.Process()
    size = os.path.getsize(million_file)
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    ds = TokenDataset(million_file)
    open_s = time.perf_counter() - t0
    rss_growth = proc.memory_info().rss - rss0
    assert len(ds) == 1_000_000
    assert open_s < 0.5, f"opening took {open_s:.3f} s"
    # lengths (4 MB) plus the two offset arrays touched (8 MB); the token data (~170 MB) stays on disk.
    assert rss_growth < 48 * 2**20 and rss_growth < size / 4, f"RSS grew {rss_growth / 2**20:.1f} MiB"
    ids, mask = ds[999_999]
    assert len(ids) == ds.lengths[-1] and mask.all()


# ------------------------------------------------------------------------------------------------- plan


def _plan(lengths, **kw):
    args = dict(max_tokens=256, max_batch_size=16, num_buckets=4, seed=0, fingerprint="f")
    args.update(kw)
    return BatchPlan(lengths, **args)


LENGTHS = np.random.default_rng(3).integers(1, 200, 3000)


def test_plan_covers_every_sample_once_and_respects_budget():
    lengths = np.concatenate([LENGTHS, [300, 1000]])   # two samples longer than the budget
    plan = _plan(lengths)
    for epoch in range(3):
        batches = plan.epoch(epoch)
        assert len(batches) == plan.num_batches(epoch)
        ids = np.sort(np.concatenate([b.sample_ids for b in batches]))
        assert ids.tolist() == list(range(len(lengths)))
        for b in batches:
            assert 1 <= len(b) <= 16
            assert b.pad_to == max(lengths[i] for i in b.sample_ids)
            assert len(b) * b.pad_to <= 256 or len(b) == 1, b
        alone = [b for b in batches if b.pad_to > 256]
        assert sorted(b.sample_ids for b in alone) == [(3000,), (3001,)]


def test_plan_batch_ids_stable_unique_and_decodable():
    plan = _plan(LENGTHS)
    e0, e1 = plan.epoch(0), plan.epoch(1)
    all_ids = [b.batch_id for b in e0 + e1]
    assert len(set(all_ids)) == len(all_ids)
    assert [divmod(b.batch_id, BATCH_ID_STRIDE) for b in e1] == [(1, i) for i in range(len(e1))]
    assert e1[0].batch_id == BATCH_ID_STRIDE
    assert plan.epoch(0) == e0 and _plan(LENGTHS).epoch(1) == e1


def test_plan_differs_between_epochs_seeds_and_fingerprints():
    e0 = _plan(LENGTHS).epoch(0)
    def content(batches):
        return [b.sample_ids for b in batches]
    assert content(_plan(LENGTHS).epoch(1)) != content(e0)
    assert content(_plan(LENGTHS, seed=1).epoch(0)) != content(e0)
    assert content(_plan(LENGTHS, fingerprint="g").epoch(0)) != content(e0)


def _digest(batches: list[Batch]) -> str:
    return hashlib.sha1(repr([(b.batch_id, b.sample_ids, b.pad_to) for b in batches]).encode()).hexdigest()


_CHILD = """
import hashlib, numpy as np
from specring.shared.data.dataset import BatchPlan
lengths = np.random.default_rng(3).integers(1, 200, 3000)
plan = BatchPlan(lengths, max_tokens=256, max_batch_size=16, num_buckets=4, seed=0, fingerprint="f")
b = plan.epoch(2)
print(hashlib.sha1(repr([(x.batch_id, x.sample_ids, x.pad_to) for x in b]).encode()).hexdigest())
"""


def test_plan_identical_in_another_process():
    # A second interpreter with a different hash seed: nothing may depend on hash() or process state.
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                         env=env, cwd=REPO, check=True).stdout.strip()
    assert out == _digest(_plan(LENGTHS).epoch(2))


def test_plan_bucket_edges():
    lengths = np.array([5, 10, 15, 20, 25, 30, 400])
    plan = _plan(lengths, bucket_edges=[10, 20])
    assert plan.edges == [0, 10, 20, 401]
    batches = plan.epoch(0)
    for b in batches:
        ks = {int(np.searchsorted(plan.edges, lengths[i], side="right")) - 1 for i in b.sample_ids}
        assert len(ks) == 1   # a batch never mixes buckets
    with pytest.raises(ValueError, match="bucket_edges"):
        _plan(lengths, bucket_edges=[20, 10])
    with pytest.raises(ValueError, match="max_tokens"):
        _plan(lengths, max_tokens=0)
    with pytest.raises(ValueError, match="sample 1"):
        _plan([3, 0, 2])
    quantile = _plan(LENGTHS, num_buckets=4)
    assert len(quantile.edges) == 5 and quantile.edges[0] == LENGTHS.min() and quantile.edges[-1] == LENGTHS.max() + 1


def test_plan_summary_lines():
    plan = _plan(LENGTHS)
    text = plan.summary()
    assert "samples: 3000" in text
    m = re.search(r"batches per epoch: (\d+)\s+sequences per batch: min (\d+) max (\d+) avg ([\d.]+)", text)
    assert m and int(m.group(1)) == plan.num_batches()
    buckets = re.findall(r"\[(\d+), (\d+)\): (\d+) batches \(([\d.]+)%\)", text)
    assert len(buckets) == len(plan.edges) - 1
    assert sum(int(b[2]) for b in buckets) == plan.num_batches()
    assert abs(sum(float(b[3]) for b in buckets) - 100.0) < 0.5


# ----------------------------------------------------------------------------------------------- collate


def test_collate_right_pads(tmp_path):
    rows = [([5, 6, 7], [0, 1, 1]), ([8], [1]), ([9, 10, 11, 12], [1, 1, 1, 0])]
    ds = TokenDataset(write_arrow(tmp_path / "c.arrow", rows))
    ids, attn, mask, lengths = collate(ds, [1, 0], pad_to=4, pad_id=3)
    assert ids.dtype == torch.int64 and attn.dtype == torch.int64 and mask.dtype == torch.uint8
    assert ids.tolist() == [[8, 3, 3, 3], [5, 6, 7, 3]]
    assert attn.tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]
    assert mask.tolist() == [[1, 0, 0, 0], [0, 1, 1, 0]]
    assert lengths.tolist() == [1, 3]
    with pytest.raises(ValueError, match="sample 2"):
        collate(ds, [2], pad_to=3, pad_id=3)


# ------------------------------------------------------------------------------------------ anchors


def test_samples_without_anchor_follow_the_trainers_rule(tmp_path):
    """``has_anchor`` / ``TokenDataset.samples_without_anchor`` (across record batches) agree with
    ``shared.drafters.dflash_blocks.eligible_anchors``, the rule the trainer samples anchors by (issue 14 item 6)."""
    from specring.shared.data.dataset import has_anchor
    from specring.shared.drafters.dflash_blocks import eligible_anchors

    rng = np.random.default_rng(3)
    rows = []
    for i in range(300):
        n = int(rng.integers(1, 9))
        p = [0.2, 0.5, 0.9][i % 3]
        rows.append(([7] * n, (rng.random(n) < p).astype(int).tolist()))
    rows += [([5, 6, 7, 8, 9, 10], [0, 1, 0, 1, 0, 1]), ([5], [1]), ([5, 6], [1, 1])]
    ds = TokenDataset(write_arrow(tmp_path / "a.arrow", rows, chunk_rows=37))
    want = []
    for i, (_, mask) in enumerate(rows):
        m = torch.tensor(mask)
        ok = eligible_anchors(m, torch.tensor([0, len(mask)])).any().item()
        assert has_anchor(mask) == ok
        if not ok:
            want.append(i)
    assert ds.samples_without_anchor().tolist() == want
    assert len(rows) - 3 in want and len(rows) - 2 in want and len(rows) - 1 not in want

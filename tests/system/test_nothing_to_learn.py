"""Nothing to learn (issue 14 item 6), with the real launcher and real processes: a run whose every step
is skipped for want of labels must not report ``done``; data in which no sample can give a DFlash anchor is
refused before any process starts.

An anchor is a position p with loss_mask[p] == loss_mask[p+1] == 1 inside one sequence
(``shared.drafters.dflash_blocks.eligible_anchors``); a sample whose mask alternates 0/1 has none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from specring.cli.train import build_parser, config_from_args
from specring.supervisor.runplan import resolve_run
from tests.support import REPO
from tests.system.launcher_util import run_launcher, segments_of, small_flags, summary

pytestmark = pytest.mark.timeout(300)


def write_rows(path: Path, masks: list[list[int]], seed: int = 0) -> Path:
    """Samples of the fixture's vocabulary with the given loss masks (no sidecar), as an Arrow file."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(4, 8000, len(m)).tolist() for m in masks]
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())),
                      "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
                      "source_file": pa.array([0] * len(masks), pa.int32()),
                      "source_row": pa.array(range(len(masks)), pa.int64())})
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return path


def alternating(n: int) -> list[int]:
    return [k % 2 for k in range(n)]


def test_data_without_a_single_anchor_is_refused_at_start(tmp_path):
    """The reported rows, written without `prepare` (which now names them): refused naming --data."""
    data = write_rows(tmp_path / "d.arrow", [alternating(6)] * 10)
    out = subprocess.run([sys.executable, "launch.py", "train", *small_flags(data, tmp_path / "run", 10)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: --data: none of the 10 samples" in out.stderr and "two adjacent tokens" in out.stderr
    assert not (tmp_path / "run" / "topology.json").exists()


def test_a_run_whose_every_step_is_skipped_ends_nothing_trained(tmp_path):
    """Most samples have no anchor; the one that has is in no planned batch: every step is skipped
    (no_labels). The run used to end `done`, N/N trained, exit 0."""
    lengths = np.random.default_rng(1).integers(24, 64, 40).tolist()
    steps = 3
    data = write_rows(tmp_path / "d.arrow", [[1] * n if i == 0 else alternating(n) for i, n in enumerate(lengths)])
    flags = small_flags(data, tmp_path / "run", steps)
    plan = resolve_run(config_from_args(build_parser().parse_args(flags)))
    used = {s for b in plan.order for s in b.sample_ids}
    spare = min(set(range(len(lengths))) - used)      # masks do not shape the plan: rewriting them keeps it
    write_rows(data, [[1] * n if i == spare else alternating(n) for i, n in enumerate(lengths)])
    code, log = run_launcher(flags, tmp_path / "launcher.log", 240)
    s = summary(tmp_path / "run")
    assert code == 1, log[-3000:]
    assert s["exit_reason"] == "nothing_trained", s
    assert s["planned_batches"] == len(plan.order) and s["skipped_batches"] == len(plan.order)
    assert s["updated_steps"] == 0 and s["last_checkpoint"].get("step") == steps
    assert "run nothing_trained:" in log and "nothing was trained: every optimizer step was skipped" in log
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == steps and all(r["skipped"] for r in recs)
    assert segments_of(s["run_id"]) == []

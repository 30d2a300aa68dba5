"""System test: ``launch.py train --producers cpu+cpu`` (one producer whose target is split over a device group)
runs to completion, training every planned batch once, on the real launcher and processes."""

from __future__ import annotations

import pytest

from tests.system.launcher_util import metrics_batch_ids, run_launcher, segments_of, small_flags, summary

pytestmark = pytest.mark.timeout(180)


def test_a_producer_over_a_device_group_trains_every_batch_once(dataset, tmp_path):
    run_dir = tmp_path / "run"
    flags = small_flags(dataset, run_dir, 6, producers="cpu+cpu", checkpoint_every=6)
    code, log = run_launcher(flags, tmp_path / "launcher.log", 150)
    assert code == 0, log[-3000:]
    s = summary(run_dir)
    ids = metrics_batch_ids(run_dir)
    assert s["exit_reason"] == "done" and s["planned_batches"] == 6 and s["trained_batches"] == 6, s
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 6
    log = (run_dir / "logs" / "producer-0.log").read_text()
    assert "target split device_map=" in log and "model.layers.7:cpu" in log
    assert segments_of(s["run_id"]) == []

"""--report-to with the real launcher (issue 17): a tiny run on the fixture target sends its records to
TensorBoard (event files), Weights & Biases (an offline run directory, no network) and MLflow (a file store),
the same losses as metrics.jsonl; a tracker that cannot be imported stops the run before anything starts,
with the command that installs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, make_dataset
from tests.system.launcher_util import run_launcher, small_flags, summary

pytestmark = pytest.mark.timeout(300)


def tracker_env(tmp_path: Path, monkeypatch) -> dict:
    """Extra environment of the launcher: no WANDB_*/MLFLOW_* of this shell (so: wandb offline, mlflow's file
    store in the run directory), wandb's caches under ``tmp_path``."""
    for k in list(os.environ):
        if k.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.delenv(k)
    return dict(WANDB_SILENT="true", WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
                WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"))


def test_a_run_reports_to_tensorboard_wandb_and_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    steps = 6
    data = make_dataset(tmp_path / "d.arrow")
    run = tmp_path / "run"
    flags = small_flags(data, run, steps) + ["--report-to", "tensorboard,wandb,mlflow"]
    code, log = run_launcher(flags, tmp_path / "launcher.log", 240, env=tracker_env(tmp_path, monkeypatch))
    assert code == 0, log[-3000:]
    assert summary(run)["exit_reason"] == "done"
    assert "report_to backend=" not in (run / "logs" / "supervisor.log").read_text()  # none disabled or dropped
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == steps

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/acc_slot1", "train/tokens_per_s", "pipeline/tokens_per_s", "pipeline/restarts",
            "pipeline/ring0_free", "pipeline/ring1_ready"} <= tags, tags
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)

    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and list(wandb_runs[0].glob("*.wandb")), list((run / "wandb").iterdir())
    # the run file is a log of protobuf records; a history item is key "train/loss" (field 2) with its JSON
    # value (field 16), as bytes: 0x12 len "train/loss" 0x82 0x01 len value
    raw = next(wandb_runs[0].glob("*.wandb")).read_bytes()
    sent = [float(m.group(2)) for m in re.finditer(rb"\x12\ntrain/loss\x82\x01(.)([-0-9.e+]+)", raw, re.S)]
    assert len(sent) >= steps and set(sent) == set(losses), (sent, losses)

    loss_files = list((run / "mlruns").rglob("metrics/train/loss"))
    assert len(loss_files) == 1
    values = [float(line.split()[1]) for line in loss_files[0].read_text().splitlines()]
    assert values == pytest.approx(losses, rel=1e-6)
    assert list((run / "mlruns").rglob("params/producer.target"))


def test_a_tracker_that_cannot_be_imported_is_an_error_before_anything_starts(tmp_path):
    """wandb shadowed by a module that fails to import (as when it is not installed), in a real launcher."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "wandb.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\")\n")
    data = make_dataset(tmp_path / "d.arrow")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), str(REPO)]))
    out = subprocess.run([sys.executable, "launch.py", "train", *small_flags(data, tmp_path / "run", 4),
                          "--report-to", "tensorboard,wandb"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: --report-to: wandb is not installed (pip install wandb)" in out.stderr
    assert "tensorboard" not in out.stderr.split("--report-to:")[1]  # the installed one is not named
    assert not (tmp_path / "run" / "topology.json").exists()

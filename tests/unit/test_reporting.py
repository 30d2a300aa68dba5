"""Experiment trackers (supervisor/reporting.py): each backend writes its records; a missing one is named."""

from __future__ import annotations

import json
import sys

import pytest

from specring.shared.errors import ConfigError
from specring.supervisor import reporting
from specring.supervisor.reporting import Reporter, check_backends, parse_report_to


def write_run(run_dir, steps=3):
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "loss": 5.0 - s, "per_slot_acc": [0.1 * s, None], "accept_proxy": 1.5,
                                "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0}) + "\n")
    (run_dir / "eval.jsonl").write_text(json.dumps({"step": steps, "tau_mean": 2.5}) + "\n")


def test_report_to_is_parsed_and_checked():
    assert parse_report_to("none") == [] and parse_report_to(None) == []
    assert parse_report_to("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match="--report-to: unknown"):
        parse_report_to("comet")


def test_a_backend_that_is_not_installed_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"wandb is not installed \(pip install wandb\)"):
        check_backends(["tensorboard", "wandb"])


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    write_run(tmp_path)
    r = Reporter(["tensorboard"], tmp_path, "run1", {"trainer": {"lr": 1e-3}})
    r.refresh({"pipeline/tokens_per_s": 900.0, "pipeline/restarts": 1})
    r.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/acc_slot1", "eval/tau", "pipeline/tokens_per_s"} <= tags
    assert [e.value for e in acc.Scalars("train/loss")] == [5.0, 4.0, 3.0]


def test_wandb_writes_an_offline_run_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    write_run(tmp_path)
    r = Reporter(["wandb"], tmp_path, "run2", {"trainer": {"lr": 1e-3}})
    r.refresh({"pipeline/tokens_per_s": 900.0})
    r.close()
    assert r.backends == {"wandb": "started"}, (r.backends, (tmp_path / "logs" / "trackers.log").read_text()[-2000:])
    assert r.stats()["sent"] == r.stats()["queued"] > 0 and not r.stats()["dropped"]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), "no offline run directory with its records"


def test_mlflow_writes_a_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    write_run(tmp_path)
    r = Reporter(["mlflow"], tmp_path, "run3", {"trainer": {"lr": 1e-3}})
    r.refresh()
    r.close()
    metric_files = list((tmp_path / "mlruns").rglob("metrics/train/loss"))
    assert metric_files, "no mlflow metric file"
    values = [float(line.split()[1]) for line in metric_files[0].read_text().splitlines()]
    assert values == [5.0, 4.0, 3.0]
    assert list((tmp_path / "mlruns").rglob("params/trainer.lr"))


def test_lines_still_being_written_wait_for_the_next_refresh(tmp_path):
    tail = reporting.JsonlTail(tmp_path / "m.jsonl")
    (tmp_path / "m.jsonl").write_text('{"step": 1}\n{"step": 2')
    assert tail.read() == [{"step": 1}]
    with open(tmp_path / "m.jsonl", "a") as f:
        f.write('}\n')
    assert tail.read() == [{"step": 2}]


def test_a_resumed_run_reports_only_its_own_steps(tmp_path):
    """Resumed from the checkpoint of step 3: the old run's lines (steps 3.. were trained after that checkpoint
    and are trained again) are not sent; the consumer's rewritten metrics.jsonl is, from step 3 on."""
    pytest.importorskip("tensorboard")
    import os
    old = [{"step": s, "loss": 10.0 + s} for s in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in old))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 3, "tau_mean": 1.5}) + "\n")
    r = Reporter(["tensorboard"], tmp_path, "run4", {}, start_step=3)
    r.refresh()  # the consumer has not rewritten metrics.jsonl yet: nothing of it is sent
    new = old[:3] + [{"step": 3, "loss": 2.0}, {"step": 4, "loss": 1.0}]
    tmp = tmp_path / "metrics.tmp"
    tmp.write_text("".join(json.dumps(m) + "\n" for m in new))
    os.replace(tmp, tmp_path / "metrics.jsonl")  # as Trainer.load_checkpoint does
    r.refresh()
    with open(tmp_path / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "tau_mean": 2.5}) + "\n")
    r.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(3, 2.0), (4, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/tau")] == [(5, 2.5)]


# ------------------------------------------------------------------ a tracker that never answers (issue 27, kind 4)
@pytest.fixture
def silent_tracking_server(monkeypatch):
    """MLflow's tracking URI on a port that completes connections and never answers."""
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    yield
    sock.close()


def test_a_tracker_that_never_answers_blocks_neither_refresh_nor_close(tmp_path, silent_tracking_server):
    pytest.importorskip("mlflow")
    import time
    steps = 3000
    write_run(tmp_path, steps=steps)
    t0 = time.monotonic()
    r = Reporter(["mlflow"], tmp_path, "run5", {"trainer": {"lr": 1e-3}}, queue_records=100, close_wait_s=1.0)
    r.refresh({"pipeline/tokens_per_s": 900.0})
    assert time.monotonic() - t0 < 2.0          # the worker is stuck in mlflow's start-up, the caller is not
    s = r.stats()
    # bounded: the queue (100) and what the worker's stdin pipe holds (64 KiB, records of 100+ bytes); the rest
    # is dropped and counted
    assert s["queued"] + s["dropped"] == steps + 2 and s["queued"] <= 100 + 65536 // 100, s
    t1 = time.monotonic()
    r.close()
    assert time.monotonic() - t1 < 1.0 + 3.0, time.monotonic() - t1
    s = r.stats()
    assert s["sent"] == 0 and s["not_sent"] == s["queued"] and s["backends"] == {}, s
    assert r.proc.poll() is not None            # killed, with what it started


def test_the_worker_ignores_the_terminals_signals(tmp_path):
    """The worker runs in a session of its own: Ctrl-C or a hang-up of the launcher's terminal does not reach
    it (the supervisor decides when the trackers close)."""
    pytest.importorskip("tensorboard")
    import os
    r = Reporter(["tensorboard"], tmp_path, "run6", {})
    try:
        assert os.getsid(r.pid) == r.pid and os.getpgid(r.pid) != os.getpgid(0)
    finally:
        r.close()
    assert r.proc.returncode == 0

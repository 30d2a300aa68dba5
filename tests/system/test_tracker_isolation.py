"""A tracker that does not answer never holds up the run (issue 27, kind 4), with the real launcher.

``--report-to mlflow`` against a tracking server that accepts connections and never answers (MLflow's client
waits 120 s per request and retries): the run starts and trains (no ``supervisor_stalled``, the first checkpoint
comes as without trackers), and SIGTERM stops it as ever: exit 130 within the shutdown bound plus the trackers'
few seconds (``supervisor.reporting.CLOSE_WAIT_S``), no segment left in /dev/shm, the worker killed and what it
never sent counted in ``summary.json``.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from benchmarks.launcher import kill_tree, start_launcher
from specring.supervisor.reporting import CLOSE_WAIT_S
from tests.system.launcher_util import run_id_of, segments_of, small_flags, summary, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def silent_server():
    """A TCP port that completes connections (the kernel's backlog) and never answers a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_a_tracking_server_that_never_answers_delays_nothing(dataset, tmp_path, silent_server):
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    flags = small_flags(dataset, run_dir, 400, checkpoint_every=2) + ["--report-to", "mlflow"]
    env = {"MLFLOW_TRACKING_URI": silent_server, "MLFLOW_HTTP_REQUEST_TIMEOUT": "600"}
    proc = start_launcher(flags, env=env, log_path=tmp_path / "launcher.log")
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file() or proc.poll() is not None, 150,
                 "the first checkpoint while the tracker hangs")
        assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        segments = segments_of(run_id_of(run_dir))
        assert segments
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        code = proc.wait(timeout=90)
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = (tmp_path / "launcher.log").read_text(errors="replace")
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    assert code == 130, log[-3000:]
    assert "supervisor_stalled" not in sup, [x for x in sup.splitlines() if "stalled" in x]
    assert not segments_of(run_id_of(run_dir)) and not (run_dir / "coord.sock").exists()
    s = summary(run_dir)
    assert s["exit_reason"] == "interrupted" and s["trained_batches"] > 0
    rep = s["report_to"]
    assert rep["backends"] == {} and rep["sent"] == 0 and rep["not_sent"] == rep["queued"] > 0, rep  # never started
    assert f"report_to worker did not finish within {CLOSE_WAIT_S:.0f} s" in sup, sup[-3000:]
    assert stop_s < 60 + CLOSE_WAIT_S, stop_s   # the consumer's checkpoint, the trackers' bound, the report

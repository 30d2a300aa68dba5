"""System tests of several nodes on one machine: two launchers on 127.0.0.1 (gloo, CPU), each with its own run
directory, producer and consumer; node 0 owns the ledger and writes summary.json.

Checked: every planned batch trained exactly once across both nodes (node 0's summary and metrics.jsonl, which
list the batch ids of every rank's steps), node 1 stopping with node 0, nothing left in /dev/shm; and a node that
is SIGKILLed mid-run stops the run with a checkpoint from which ``--resume`` on both nodes completes it exactly once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.launcher import child_pid, kill_tree, start_launcher
from tests.system.launcher_util import metrics_batch_ids, segments_of, small_flags, summary, wait_for

pytestmark = pytest.mark.timeout(240)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_flags(data: Path, run_dir: Path, steps: int, rank: int, port: int, node_timeout_s: float = 20,
               **extra) -> list[str]:
    flags = small_flags(data, run_dir, steps, producers="cpu", consumers="cpu", **extra)
    return flags + ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                    "--master-port", str(port), "--nodes.node-timeout-s", str(node_timeout_s)]


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)


def assert_exactly_once(run_dir: Path, planned: int) -> dict:
    s = summary(run_dir)
    ids = metrics_batch_ids(run_dir)
    assert len(ids) == len(set(ids)), f"batches trained twice: {sorted(b for b in set(ids) if ids.count(b) > 1)}"
    assert s["planned_batches"] + s["trained_before_resume"] == planned, s
    assert sorted(ids) == sorted(set(ids)) and len(ids) == planned - s["bad_batches"], (len(ids), s)
    assert s["duplicate_batches"] == 0 and s["lost_batches"] == 0, s
    return s


def test_two_nodes_train_every_batch_once_and_heal_a_producer_of_node_1(dataset, tmp_path):
    port = free_port()
    a, b = tmp_path / "node0", tmp_path / "node1"
    procs = [start_launcher(node_flags(dataset, a, 10, 0, port, checkpoint_every=10), log_path=tmp_path / "n0.log"),
             start_launcher(node_flags(dataset, b, 10, 1, port, checkpoint_every=10), log_path=tmp_path / "n1.log")]
    try:  # node 1's producer is killed once training has started; node 1 restarts it, node 0 fences it
        wait_for(lambda: (a / "metrics.jsonl").is_file() and (a / "metrics.jsonl").read_text().count("\n") >= 2,
                 150, "two steps")
        os.kill(wait_for(lambda: child_pid(b, "producer", 0), 30, "node 1's producer"), signal.SIGKILL)
    except BaseException:
        for p in procs:
            kill_tree(p)
        raise
    codes = finish(procs, 200)
    logs = "\n".join((tmp_path / f).read_text()[-2500:] for f in ("n0.log", "n1.log"))
    assert codes == [0, 0], logs
    s = assert_exactly_once(a, planned=20)  # 10 steps x 2 data-parallel ranks, one on each node
    assert s["exit_reason"] == "done" and s["nodes"]["nnodes"] == 2 and s["nodes"]["consumers"] == [1, 1], s
    s1 = summary(b)
    assert s1["exit_reason"] == "done" and s1["restarts"] == {"0": 1}, s1
    assert "fence producer=1 node=1 generation=2" in (a / "logs" / "supervisor.log").read_text()
    assert s["nodes"]["producer_deaths_on_other_nodes"] == {"1": 1}, s
    # rank 1 (node 1) trained half of every step from its own producer, which was started twice
    assert (b / "logs" / "producer-0.log").read_text().count("serving ring=") == 2
    assert "rendezvous node=1 nnodes=2" in (b / "logs" / "supervisor.log").read_text()
    assert not (b / "metrics.jsonl").exists() and not (b / "checkpoints" / "latest").exists()
    assert segments_of(s["run_id"]) == [] and segments_of(summary(b)["run_id"]) == []


def test_a_node_killed_mid_run_stops_the_run_and_resume_completes_it_exactly_once(dataset, tmp_path):
    port = free_port()
    a, b = tmp_path / "node0", tmp_path / "node1"
    procs = [start_launcher(node_flags(dataset, a, 8, 0, port, 4, checkpoint_every=2), log_path=tmp_path / "n0.log"),
             start_launcher(node_flags(dataset, b, 8, 1, port, 4, checkpoint_every=2), log_path=tmp_path / "n1.log")]
    try:
        wait_for(lambda: (a / "checkpoints" / "latest").is_file(), 150, "node 0's first checkpoint")
        procs[1].send_signal(signal.SIGKILL)  # node 1's supervisor; its children follow it (parent-death signal)
        code0 = procs[0].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    assert code0 != 0, (tmp_path / "n0.log").read_text()[-3000:]
    s1 = summary(a)
    assert s1["exit_reason"] in ("node_1_died", "consumer_0_died"), s1
    assert s1["remaining_batches"] > 0 and s1["last_checkpoint"].get("step", 0) >= 2, s1
    assert segments_of(s1["run_id"]) == []
    port = free_port()
    again = ["--resume", "--master-port", str(port), "--nodes.node-timeout-s", "20"]  # both may change on resume
    procs = [start_launcher(["--run-dir", str(a), *again], log_path=tmp_path / "r0.log"),
             start_launcher(["--run-dir", str(b), *again], log_path=tmp_path / "r1.log")]
    codes = finish(procs, 150)
    logs = "\n".join((tmp_path / f).read_text()[-2500:] for f in ("r0.log", "r1.log"))
    assert codes == [0, 0], logs
    s2 = assert_exactly_once(a, planned=16)
    assert s2["exit_reason"] == "done" and s2["trained_before_resume"] > 0, s2
    assert "resume checkpoint=" in (b / "logs" / "consumer-0.log").read_text()  # node 1 resumed node 0's weights


def test_node_0_alone_stops_with_the_rendezvous_error_and_leaves_nothing(dataset, tmp_path):
    """Node 1 never comes (a wrong --master-port, never started): node 0 must end with the rendezvous error, not
    hang closing the node link it had opened for node 1 (the rings are created only after the rendezvous)."""
    run_dir = tmp_path / "n0"
    flags = node_flags(dataset, run_dir, 4, 0, free_port()) + ["--nodes.rendezvous-timeout-s", "2"]
    proc = start_launcher(flags, log_path=tmp_path / "n0.log")
    [code] = finish([proc], 60)
    log = (tmp_path / "n0.log").read_text()
    assert code != 0, log[-3000:]
    assert "node 1 did not arrive at the rendezvous store" in log, log[-3000:]

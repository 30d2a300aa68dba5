"""System test: a slow batch is not a hang, and a stalled one still is (issue 14, item 4).

A batch slower than ``--hang-timeout-s`` (a long sequence on a big target, a cold compile) must not get its
producer killed; a forward that never returns (a deadlock, with the process otherwise alive and the
heartbeat still going) must still be found, by the per-batch budget ``monitor.batch_timeout_s``. SIGSTOP of a
child (every thread stops) is covered by the chaos test in ``test_launcher.py``; SIGSTOP of the supervisor
itself (its own stall) must not count as its children hanging.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from benchmarks.launcher import kill_tree, start_launcher
from tests.system.launcher_util import metrics_batch_ids, run_launcher, small_flags, summary, wait_for

pytestmark = pytest.mark.timeout(240)


def test_batches_slower_than_the_hang_timeout_train_and_a_stalled_forward_is_killed(dataset, tmp_path):
    """Every forward takes 4 s, the hang timeout is 3 s: nothing is killed for it. Producer 0's first
    incarnation never returns from its first forward: it is killed once its batch has run past
    ``batch_timeout_s`` (8 s), and its replacement produces the batch."""
    run_dir = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    cfg.write_text("[monitor]\nbatch_timeout_s = 8.0\n")
    flags = small_flags(dataset, run_dir, 4, hang_timeout_s=3, max_restarts=2)
    code, log = run_launcher(["--config", str(cfg), *flags], tmp_path / "launcher.log", 200,
                             env={"SPECRING_SLOW_FORWARD_S": "4", "SPECRING_STALL_FORWARD": "0:1"})
    assert code == 0, log[-4000:]
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["restarts"] == {"0": 1, "1": 0}, s
    assert log.count("hang producer=") == 1 and "batch_timeout_s=8" in log, log[-4000:]
    ids = metrics_batch_ids(run_dir)
    assert sorted(ids) == sorted(set(ids)) and len(ids) == s["planned_batches"] == 4


def test_the_supervisors_own_stall_does_not_get_its_children_killed(dataset, tmp_path):
    """The supervisor (the launcher process) is stopped for 6 s, past the 3 s hang timeout, while its children
    go on heartbeating into its socket: once it runs again, nothing is killed and the run finishes."""
    run_dir = tmp_path / "run"
    flags = small_flags(dataset, run_dir, 8, producers="cpu", hang_timeout_s=3, checkpoint_every=8,
                        eval_prompts=0)
    proc = start_launcher(flags, log_path=tmp_path / "launcher.log")
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), 180, "the first optimizer step")
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(proc.pid, signal.SIGCONT)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            kill_tree(proc)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 0, log[-3000:]
    assert "supervisor_stalled" in log and " hang " not in log, log[-3000:]
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["restarts"] == {"0": 0}, s

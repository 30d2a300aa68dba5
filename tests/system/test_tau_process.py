"""System tests of the τ evaluator process (consumer/tau_worker.py) through the real launcher: training does not
wait for τ, the records read as before, and a SIGKILLed consumer leaves no evaluator behind."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from benchmarks.launcher import child_pid, kill_tree, start_launcher
from tests.system.launcher_util import (
    assert_records_read_back,
    metrics_batch_ids,
    segments_of,
    small_flags,
    summary,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)


def _worker_pids(run_dir: Path) -> list[int]:
    log = run_dir / "logs" / "consumer-0.log"
    return [int(p) for p in re.findall(r"tau_worker start pid=(\d+)", log.read_text())] if log.is_file() else []


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_training_goes_on_while_tau_is_measured_and_the_records_read_as_before(dataset, tmp_path):
    """Every checkpoint is evaluated (each evaluation takes at least 2 x 1.5 s), the final one waited for, and the
    summary's τ is the last record's. (Whether training goes on meanwhile is the next test's: a run this short can
    end before the evaluator has loaded on 2 busy cores, so it cannot show it.)"""
    run_dir = tmp_path / "run"
    flags = small_flags(dataset, run_dir, 60, checkpoint_every=20, heldout=dataset, eval_prompts=2,
                        eval_max_new_tokens=8, eval_prompt_len=32)
    proc = start_launcher(flags, env={"SPECRING_SLOW_EVAL_S": "1.5"}, log_path=tmp_path / "launcher.log")
    try:
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 0, log[-3000:]
    recs = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [20, 40, 60], recs
    assert all(r["tau_mean"] is not None and r["eval_s"] >= 3.0 for r in recs), recs
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["eval_failures"] == [], s
    assert s["tau_last"] == {"step": 60, "tau_mean": recs[-1]["tau_mean"]}, s
    top = max(recs, key=lambda r: r["tau_mean"])  # the earliest of equals: max returns the first
    assert s["tau_best"] == {"step": top["step"], "tau_mean": top["tau_mean"],
                             "checkpoint": str(run_dir / "checkpoints" / f"step-{top['step']:06d}")}, s
    assert isinstance(s.get("first_step_s"), float) and s["first_step_s"] > 0, s
    assert len(metrics_batch_ids(run_dir)) == s["planned_batches"]
    assert_records_read_back(run_dir)
    (pid,) = _worker_pids(run_dir)
    assert _gone(pid)
    assert segments_of(s["run_id"]) == []


def test_optimizer_steps_are_trained_while_tau_is_measured(dataset, tmp_path):
    """A run far longer than the test (100,000 steps) is stopped by SIGINT once two evaluations of 2 x 1.5 s each are
    recorded: however long the evaluator took to load, training was still going on while each was measured, so
    optimizer steps were trained inside both windows unless the evaluation blocks the training path."""
    run_dir = tmp_path / "run"
    flags = small_flags(dataset, run_dir, 100_000, checkpoint_every=20, heldout=dataset, eval_prompts=2,
                        eval_max_new_tokens=8, eval_prompt_len=32)
    proc = start_launcher(flags, env={"SPECRING_SLOW_EVAL_S": "1.5"}, log_path=tmp_path / "launcher.log")
    evals = run_dir / "eval.jsonl"
    try:
        wait_for(lambda: evals.is_file() and len(evals.read_text().splitlines()) >= 2, 200, "two tau evaluations")
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 130, log[-3000:]
    recs = [json.loads(x) for x in evals.read_text().splitlines()][:2]
    assert all(r["tau_mean"] is not None and r["eval_s"] >= 3.0 for r in recs), recs
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        during = [m["step"] for m in steps if r["time"] - r["eval_s"] < m["time"] < r["time"]]
        assert during, ("no optimizer step was trained while tau was measured", r, [m["time"] for m in steps])
    s = summary(run_dir)
    assert s["exit_reason"] == "interrupted", s
    (pid,) = _worker_pids(run_dir)
    assert _gone(pid)
    assert segments_of(s["run_id"]) == []


def test_a_sigkilled_consumer_leaves_no_tau_evaluator(dataset, tmp_path):
    run_dir = tmp_path / "run"
    flags = small_flags(dataset, run_dir, 400, checkpoint_every=2, heldout=dataset, eval_prompts=4,
                        eval_max_new_tokens=8, eval_prompt_len=32)
    proc = start_launcher(flags, env={"SPECRING_SLOW_EVAL_S": "5"}, log_path=tmp_path / "launcher.log")
    try:  # at 5 s a prompt, the evaluation of step 2 is running once the evaluator has loaded
        wait_for(lambda: "tau_worker ready" in _log(run_dir) and "checkpoint saved step=2" in _log(run_dir), 180,
                 "the tau evaluator to be evaluating")
        time.sleep(1.0)
        (pid,) = _worker_pids(run_dir)
        consumer = child_pid(run_dir, "consumer", 0)
        assert psutil.Process(pid).ppid() == consumer
        os.kill(consumer, signal.SIGKILL)
        wait_for(lambda: _gone(pid), 10, "the tau evaluator to die with its consumer")
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 1, log[-3000:]
    s = summary(run_dir)
    assert s["exit_reason"] == "consumer_0_died", s
    assert segments_of(s["run_id"]) == []


def _log(run_dir: Path) -> str:
    p = run_dir / "logs" / "consumer-0.log"
    return p.read_text() if p.is_file() else ""

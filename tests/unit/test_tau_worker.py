"""The τ evaluator process (consumer/tau_worker.py), real processes: the records it appends are those of the inline
evaluation, a dead or killed evaluator's evaluation is a visible failure, and nothing outlives its consumer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from specring.consumer.tau import CheckpointEvaluator
from specring.consumer.tau_worker import TauWorker
from specring.consumer.trainer import Trainer, drafter_config_from_run
from specring.shared.config.run_config import DataConfig, ProducerConfig, RunConfig, TrainerConfig
from specring.shared.machine.threads import ThreadTuner, plan_threads
from tests.support import REPO, TARGET, make_dataset

pytestmark = pytest.mark.timeout(240)


def _run(tmp_path, **trainer):
    heldout = make_dataset(tmp_path / "heldout.arrow", num_samples=6)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = RunConfig(run_dir=str(run_dir), data=DataConfig(data=str(heldout), heldout=str(heldout)),
                    producer=ProducerConfig(target=str(TARGET), devices=["cpu"], target_layer_ids=[1, 5]),
                    trainer=TrainerConfig(block_size=4, num_draft_layers=1, eval_prompts=2, eval_max_new_tokens=8,
                                          eval_prompt_len=16, **trainer))
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.manual_seed(1)
    tr = Trainer(cfg.trainer, drafter_config_from_run(cfg), TARGET, "cpu", run_dir, write_metrics=False)
    with torch.no_grad():  # weights unlike a fresh drafter's, so a wrong load shows in tau
        for p in tr.params:
            p.add_(0.05 * torch.randn_like(p))
    return cfg, run_dir, tr


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_worker_records_what_the_inline_evaluation_records(tmp_path):
    cfg, run_dir, tr = _run(tmp_path)
    ckpt = tr.save_checkpoint()
    inline = CheckpointEvaluator(cfg, torch.device("cpu"), tmp_path, prompt_len=16)(tr.model, 0, 1.5)
    w = TauWorker(run_dir, "cpu", batch_timeout_s=60, startup_timeout_s=120)
    try:
        w.submit(0, 1.5, ckpt)  # a checkpoint's step directory
        snap = w.snapshot(tr.model, 7)  # between checkpoints: the trainable tensors alone
        w.submit(7, 1.25, snap, owned=True)
        assert w.wait() and w.idle
        pid = w.pid
    finally:
        w.close()
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == [0, 7], recs
    for rec in recs:
        assert "error" not in rec
        for k in ("tau_mean", "tau_p50", "tau_p90", "forwards_per_token", "prompts"):
            assert rec[k] == inline[k], (k, rec, inline)
    assert recs[0]["loss"] == 1.5 and recs[1]["loss"] == 1.25
    assert not snap.exists() and not (run_dir / "tau").exists()
    assert _gone(pid, 10), "the evaluator outlived close()"


def test_killed_evaluator_is_a_recorded_failure_and_is_started_again(tmp_path, monkeypatch):
    _, run_dir, tr = _run(tmp_path)
    ckpt = tr.save_checkpoint()
    monkeypatch.setenv("SPECRING_SLOW_EVAL_S", "2")
    w = TauWorker(run_dir, "cpu", batch_timeout_s=60, startup_timeout_s=120)
    try:
        w.submit(3, None, ckpt)
        deadline = time.monotonic() + 120
        while w.current is None and time.monotonic() < deadline:  # the evaluation has started
            w.poll()
            time.sleep(0.05)
        first = w.pid
        os.kill(first, signal.SIGKILL)
        assert _gone(first, 10)
        deadline = time.monotonic() + 10
        while not w.idle and time.monotonic() < deadline:  # the consumer polls once per turn of its loop
            w.poll()
            time.sleep(0.05)
        assert w.idle and w.pid is None, (w.current, w.queue, w.pid, w.completed)
        w.submit(4, None, ckpt)
        assert w.wait() and w.pid != first and w.starts == 2
    finally:
        w.close()
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == [3, 4], recs
    assert recs[0]["tau_mean"] is None and recs[0]["stage"] == "process" and "exited with code -9" in recs[0]["error"]
    assert recs[1]["tau_mean"] is not None and "error" not in recs[1]


def test_weights_that_do_not_read_are_a_recorded_failure_and_a_backlog_is_bounded(tmp_path):
    """A file that does not read fails its evaluation visibly (stage ``weights``); beyond ``MAX_OWED`` evaluations
    owed, the newest waiting one gives way (its snapshot deleted) and the others are measured in order."""
    _, run_dir, tr = _run(tmp_path)
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(b"not a safetensors file")
    ckpt = tr.save_checkpoint()
    w = TauWorker(run_dir, "cpu", batch_timeout_s=60, startup_timeout_s=120)
    try:
        w.submit(5, None, bad)  # all before the evaluator has loaded: a backlog of five
        w.submit(6, None, ckpt)
        w.submit(7, None, ckpt)
        skipped = w.snapshot(tr.model, 8)
        w.submit(8, None, skipped, owned=True)
        w.submit(9, None, ckpt)
        assert not skipped.exists()
        assert w.wait()
    finally:
        w.close()
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == [5, 6, 7, 9], recs
    assert recs[0]["tau_mean"] is None and recs[0]["stage"] == "weights", recs[0]
    assert "garbage.safetensors" in recs[0]["error"]
    assert all(r["tau_mean"] is not None for r in recs[1:]), recs


CONSUMER = """
import sys, time
from specring.consumer.tau_worker import TauWorker
w = TauWorker(sys.argv[1], "cpu", batch_timeout_s=60, startup_timeout_s=120)
w.start(0)
print(w.pid, flush=True)
while not w.ready:
    w.poll()
    time.sleep(0.05)
print("ready", flush=True)
time.sleep(600)
"""


def test_evaluator_dies_with_a_sigkilled_consumer(tmp_path):
    """The process that started the evaluator (here a stand-in for the consumer) is SIGKILLed: the evaluator
    follows it (parent-death signal), even though nobody reaps or kills it."""
    _, run_dir, _ = _run(tmp_path)
    parent = subprocess.Popen([sys.executable, "-c", CONSUMER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        assert psutil.Process(pid).ppid() == parent.pid
        parent.kill()
        parent.wait()
        assert _gone(pid, 10), "the evaluator outlived its SIGKILLed consumer"
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_threads_by_role_on_cpu():
    """A CPU consumer takes the cores; producers and the evaluator one thread each; GPUs keep the even split."""
    two = {"producer_devices": ["cpu", "cpu"], "consumer_devices": ["cpu"], "cores": 2}
    assert plan_threads("consumer", "cpu", **two).intra == 2
    assert plan_threads("producer", "cpu", **two).intra == 1 and plan_threads("producer", "cpu", **two).interop == 1
    tau = plan_threads("tau", "cpu", **two)
    assert tau.intra == 1 and tau.interop == 1 and tau.nice == 0
    assert plan_threads("consumer", "cpu", ["cpu"], ["cpu", "cpu"], cores=8).intra == 4
    assert plan_threads("producer", "cuda", ["cuda:0"], ["cuda:1"], cores=16).intra == 8
    with pytest.raises(ValueError, match="role"):
        plan_threads("trainer", "cpu", ["cpu"], ["cpu"])


def test_thread_tuner_keeps_the_faster_count_and_measures_again():
    """Two threads twice as fast: kept, the next round later each time; then one thread becomes the faster
    (a busy machine): the tuner moves to it at the next round."""
    t = ThreadTuner([2, 1], probe_steps=2, hold_steps=4, max_hold_steps=16)
    speed = {2: 1.0, 1: 2.0}
    current, switches = t.current, []
    assert current == 1
    for step in range(120):
        if step == 60:
            best_before = t.best
            speed = {2: 3.0, 1: 2.0}
        n = t.record(speed[current], 1.0)
        if n is not None:
            switches.append((step, n))
            current = n
    assert switches[0] == (0, 2), switches  # 1 thread scouted on one step, then 2: 1 is 2x slower, out; 2 kept
    assert best_before == 2
    assert t.current == 1 and t.best == 1, (t.last, switches)
    assert all(n in (1, 2) for _, n in switches) and t.rounds >= 5
    assert not ThreadTuner([1]).active and ThreadTuner([1]).record(1.0, 1.0) is None


def test_thread_tuner_spends_one_step_on_a_count_far_slower():
    t = ThreadTuner([2, 1], probe_steps=3, hold_steps=50)
    speed, current, at_two = {1: 1.0, 2: 5.0}, 1, 0
    for _ in range(200):
        at_two += current == 2
        n = t.record(speed[current], 1.0)
        current = n if n is not None else current
    assert t.best == 1 and current == 1
    assert at_two == 2, at_two  # one step in each of the two rounds (at the start and 50 steps later)


def test_thread_tuner_spends_one_step_on_one_thread_when_two_are_clearly_faster():
    """The quiet machine's case (one thread 1.7x slower): the start on one thread costs a single step a round."""
    t = ThreadTuner([2, 1], probe_steps=3, hold_steps=50)
    speed, current, at_one = {1: 1.7, 2: 1.0}, t.current, 0
    for _ in range(200):
        at_one += current == 1
        n = t.record(speed[current], 1.0)
        current = n if n is not None else current
    assert t.best == 2 and current == 2
    assert at_one == 2, at_one  # the scout step of each of the two rounds


def test_thread_tuner_measures_close_counts_on_probe_steps_each():
    """Counts within REJECT_FACTOR of each other: both get probe_steps steps, the median decides."""
    t = ThreadTuner([2, 1], probe_steps=3, hold_steps=50)
    steps = {1: [1.00, 1.20, 1.21], 2: [1.10, 1.05, 1.06]}
    current, seen = t.current, {1: 0, 2: 0}
    while t.rounds == 0:
        n = t.record(steps[current][seen[current]], 1.0)
        seen[current] += 1
        current = n if n is not None else current
    assert seen == {1: 3, 2: 3} and t.best == 2 and current == 2, (seen, t.last)

"""System test of the balance figures: a real run whose producer is slowed (``SPECRING_SLOW_WRITE_S``) must
report a busy producer and a starved consumer, live in ``status.json`` and ``launch.py status``, and for the run
in ``summary.json``;
``launch.py train --plan`` then reads the rates back and warns that the consumer would be mostly idle."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.launcher import kill_tree, start_launcher
from specring.supervisor.status import read_status_rows
from tests.support import REPO
from tests.system.launcher_util import run_id_of, segments_of, small_flags, summary, wait_for

pytestmark = pytest.mark.timeout(240)

SLOW_WRITE_S = 1.0  # much longer than a batch's forward or training step on the fixture, even on a loaded CPU


def test_a_slowed_producer_is_busy_and_its_consumer_starved(dataset, tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "slow"
    flags = small_flags(dataset, run_dir, 8, producers="cpu", checkpoint_every=100, eval_prompts=0)
    proc = start_launcher(flags, env={"SPECRING_SLOW_WRITE_S": str(SLOW_WRITE_S)}, log_path=tmp_path / "l.log")
    try:
        rows = wait_for(lambda: [r for r in read_status_rows(run_dir)
                                 if r.get("duty_cycle") is not None or r.get("starvation") is not None],
                        180, "live balance figures in status.json")
        for r in rows:
            figure = r["duty_cycle"] if r["role"] == "producer" else r["starvation"]
            assert 0.0 <= figure <= 1.0, r
        out = subprocess.run([sys.executable, "launch.py", "status", "--run-dir", str(run_dir)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()  # after the first step an accuracy line may stand before the balance line
        at = [k for k, x in enumerate(lines) if x.startswith("balance: producer duty cycle ")]
        assert at and "%" in lines[at[0]], out.stdout
        assert "duty" in lines[at[0] + 1] and "starv" in lines[at[0] + 1], out.stdout
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert code == 0, (tmp_path / "l.log").read_text()[-3000:]
    s = summary(run_dir)
    b = s["balance"]
    prod, cons = b["producers"]["0"], b["consumers"]["0"]
    for x in (prod["duty_cycle"], cons["starvation"], b["producer_duty_cycle"], b["consumer_starvation"]):
        assert 0.0 <= x <= 1.0, b
    # the sleep between slot write and publish is the producer's work: each batch costs it SLOW_WRITE_S
    assert prod["busy_s"] >= s["trained_batches"] * SLOW_WRITE_S * 0.95, b
    assert prod["duty_cycle"] > 0.8, b       # the producer never waits: the consumer always has a free slot
    assert cons["starvation"] > 0.5, b       # the consumer trains a tiny batch, then waits ~SLOW_WRITE_S
    assert b["producer_duty_cycle"] == prod["duty_cycle"] and b["consumer_starvation"] == cons["starvation"]
    assert prod["tokens"] == cons["tokens"] > 0, b   # one producer, one consumer: the same batches
    assert b["consumer_tokens_per_busy_s"] > b["producer_tokens_per_busy_s"] > 0, b
    assert not segments_of(run_id_of(run_dir))

    # --plan for a run of the same shape reads these rates back and warns that the consumers would idle
    out = subprocess.run([sys.executable, "launch.py", "train", "--plan",
                          *small_flags(dataset, runs / "next", 8, producers="cpu", checkpoint_every=100,
                                       eval_prompts=0)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"balance: rates recorded by {run_dir.resolve()}" in out.stdout, out.stdout
    warnings = [x for x in out.stdout.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "consumer(s) would be" in warnings[0] and "more than half idle" in warnings[0], \
        out.stdout

"""Unit tests of shared/process/balance.py: the busy clock of a child, the supervisor's per-process figures, and the
producer:consumer advice of ``launch.py train --plan`` from rates recorded in a run directory's summary.json."""

from __future__ import annotations

import json
import os

import pytest

from specring.shared.config.run_config import RunConfig
from specring.shared.process.balance import (
    DutyClock,
    ProcessBalance,
    advise,
    balance_lines,
    find_recorded_rates,
    rate_shape,
    run_balance,
)
from specring.shared.transport import messages as m


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_duty_clock_counts_outermost_work_from_the_first_piece_of_work():
    c = FakeClock()
    d = DutyClock(clock=c)
    c.t += 50  # start-up wait before the first piece of work: not in the window
    assert d.figures() == {"busy_s": 0.0, "window_s": 0.0, "idle_tail_s": 0.0}
    d.start()
    c.t += 2
    d.start()          # nested: counted once
    c.t += 1
    d.stop()
    assert d.figures() == {"busy_s": 3.0, "window_s": 3.0, "idle_tail_s": 0.0}  # busy now, up to now
    c.t += 1
    d.stop()
    c.t += 4           # idle: waiting for work
    assert d.figures() == {"busy_s": 4.0, "window_s": 8.0, "idle_tail_s": 4.0}
    d.start()
    c.t += 2
    d.stop()
    d.stop()           # an unmatched stop changes nothing
    assert d.figures() == {"busy_s": 6.0, "window_s": 10.0, "idle_tail_s": 0.0}


def test_process_balance_sums_generations_and_leaves_out_idle_tails_for_the_run():
    p = ProcessBalance("producer", 0)
    assert p.live() == {"duty_cycle": None} and p.summary()["duty_cycle"] is None
    p.update(1, {"busy_s": 6.0, "window_s": 10.0, "idle_tail_s": 2.0, "tokens": 600})
    p.update(1, {"busy_s": 8.0, "window_s": 14.0, "idle_tail_s": 4.0, "tokens": 800})  # later beat replaces
    p.update(2, {"busy_s": 2.0, "window_s": 2.0, "idle_tail_s": 0.0, "tokens": 100})   # restarted producer
    assert p.live() == {"duty_cycle": round(10 / 16, 3)}
    s = p.summary()
    assert s["duty_cycle"] == round(10 / 12, 4) and s["tokens"] == 900 and s["tokens_per_busy_s"] == 90.0
    # an older child without the figures, or figures that are not finite non-negative numbers: ignored
    for bad in ({}, {"busy_s": "1", "window_s": 2, "idle_tail_s": 0}, {"busy_s": float("nan"), "window_s": 2,
                "idle_tail_s": 0}, {"busy_s": -1, "window_s": 2, "idle_tail_s": 0},
                {"busy_s": True, "window_s": 2, "idle_tail_s": 0}):
        p.update(3, bad)
    assert 3 not in p.by_generation
    # busy beyond the window (clock skew, a bad peer) is clamped: fractions stay in [0, 1]
    c = ProcessBalance("consumer", 1)
    c.update(1, {"busy_s": 5.0, "window_s": 4.0, "idle_tail_s": 3.0})
    assert c.summary()["starvation"] == 0.0 and c.summary()["tokens"] is None


def test_run_balance_overall_figures_weight_processes_by_their_windows():
    p0, p1, c0 = ProcessBalance("producer", 0), ProcessBalance("producer", 1), ProcessBalance("consumer", 0)
    p0.update(1, {"busy_s": 9.0, "window_s": 10.0, "idle_tail_s": 0.0, "tokens": 900})
    p1.update(1, {"busy_s": 1.0, "window_s": 10.0, "idle_tail_s": 0.0, "tokens": 300})
    c0.update(1, {"busy_s": 5.0, "window_s": 20.0, "idle_tail_s": 0.0, "tokens": 1200})
    b = run_balance([p0, p1], [c0])
    assert b["producer_duty_cycle"] == 0.5 and b["consumer_starvation"] == 0.75
    assert b["producers"]["1"]["duty_cycle"] == 0.1 and b["consumers"]["0"]["starvation"] == 0.75
    assert b["producer_tokens_per_busy_s"] == (100.0 + 300.0) / 2 and b["consumer_tokens_per_busy_s"] == 240.0
    empty = run_balance([ProcessBalance("producer", 0)], [])
    assert empty["producer_duty_cycle"] is None and empty["consumer_starvation"] is None


def test_heartbeats_without_balance_figures_still_validate():
    """The figures ride in Heartbeat.stats (a flat map): an old child's heartbeat decodes as before."""
    old = m.Heartbeat(role="consumer", index=0, generation=1, pid=1, stats={"tokens_per_s": 3.0, "step": 2})
    new = m.Heartbeat(role="consumer", index=0, generation=1, pid=1,
                      stats={"tokens_per_s": 3.0, "busy_s": 1.5, "window_s": 2.0, "idle_tail_s": 0.1})
    assert m.decode(m.encode(old)) == old and m.decode(m.encode(new)) == new


def test_advise_ratio_expected_rate_and_warnings():
    # producer 22K tok/s, consumer 3K tok/s (issue 15's 1 + 1 on H200s): one producer feeds ~7 consumers
    a = advise(22000.0, 3000.0, 1, 1)
    assert a.producers_per_consumer == pytest.approx(3000 / 22000)
    assert a.expected_tokens_per_s == 3000.0 and a.consumer_busy == 1.0
    assert a.producer_busy == pytest.approx(3000 / 22000)
    assert len(a.warnings) == 1 and "producer" in a.warnings[0] and "more than half idle" in a.warnings[0]
    # the seed's 5 + 3 on 8 GPUs: producers mostly idle; the best split of 8 is 1 + 7
    a = advise(22000.0, 3000.0, 5, 3)
    assert a.best_split == (1, 7) and a.producer_busy == pytest.approx(9000 / 110000)
    assert "1 producer(s) + 7 consumer(s)" in a.warnings[0] and "21,000 tokens/s instead of 9,000" in a.warnings[0]
    # balanced (within a factor of two): no warning
    assert advise(1000.0, 600.0, 1, 1).warnings == []
    # a slow producer leaves the consumers idle
    a = advise(100.0, 1000.0, 1, 2)
    assert a.consumer_busy == pytest.approx(0.05) and "consumer" in a.warnings[0]
    assert advise(100.0, 1000.0, 1, 2, own_devices=False).best_split is None
    with pytest.raises(ValueError, match="rates must be > 0"):
        advise(0.0, 1.0, 1, 1)


def _record(run_dir, cfg: RunConfig, prod: float | None, cons: float | None, mtime: float) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    bal = {"producer_tokens_per_busy_s": prod, "consumer_tokens_per_busy_s": cons}
    (run_dir / "summary.json").write_text(json.dumps({"exit_reason": "done", "balance": bal}))
    os.utime(run_dir / "summary.json", (mtime, mtime))


def test_recorded_rates_come_from_the_latest_run_of_the_same_shape(tmp_path):
    cfg = RunConfig()
    cfg.producer.devices, cfg.trainer.devices = ["cuda:0"], ["cuda:1"]
    same_other_topology = RunConfig.from_dict(cfg.to_dict())
    same_other_topology.producer.devices = ["cuda:2", "cuda:3"]
    same_other_topology.trainer.lr = 1e-5       # rate-neutral settings may differ
    same_other_topology.run_dir = "elsewhere"
    other_anchors = RunConfig.from_dict(cfg.to_dict())
    other_anchors.trainer.num_anchors = 64
    on_cpu = RunConfig.from_dict(cfg.to_dict())
    on_cpu.trainer.devices = ["cpu"]
    assert rate_shape(same_other_topology.to_dict()) == rate_shape(cfg.to_dict())
    assert rate_shape(other_anchors.to_dict()) != rate_shape(cfg.to_dict())
    assert rate_shape(on_cpu.to_dict()) != rate_shape(cfg.to_dict())

    runs = tmp_path / "runs"
    assert find_recorded_rates(cfg.to_dict(), [runs]) is None      # no runs directory yet
    _record(runs / "old", cfg, 1000.0, 100.0, 1_000_000)
    _record(runs / "new", same_other_topology, 2000.0, 500.0, 2_000_000)
    _record(runs / "newest-other-shape", other_anchors, 9.0, 9.0, 3_000_000)
    _record(runs / "newest-cpu", on_cpu, 9.0, 9.0, 3_000_000)
    _record(runs / "newest-unfinished", cfg, None, 100.0, 3_000_000)   # no producer figure: skipped
    (runs / "broken").mkdir()
    (runs / "broken" / "summary.json").write_text("{not json")
    r = find_recorded_rates(cfg.to_dict(), [runs])
    assert (r.producer_tokens_per_s, r.consumer_tokens_per_s) == (2000.0, 500.0)
    assert r.source.endswith("new") and "2 producer(s) (cuda) + 1 consumer(s) (cuda)" in r.topology

    lines = balance_lines(cfg.to_dict(), [runs])
    text = "\n".join(lines)
    assert r.source in text and "producer 2,000 tok/s, consumer 500 tok/s" in text
    assert "producer:consumer = 0.25:1" in text and "producers busy 25%, consumers busy 100%" in text
    assert [x for x in lines if x.startswith("warning:")] == [
        x for x in lines if "producer(s) would be 75% idle" in x]
    cfg.producer.devices = ["cuda:0"]
    cfg.trainer.devices = ["cuda:1", "cuda:2", "cuda:3"]   # 1 + 3 on own GPUs: 1.33 producers' worth needed
    text = "\n".join(balance_lines(cfg.to_dict(), [runs]))
    assert "warning" not in text and "about 1,500 tokens/s" in text
    cfg.trainer.num_anchors = 8
    assert "no recorded rates" in "\n".join(balance_lines(cfg.to_dict(), [runs]))

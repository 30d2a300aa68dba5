"""Unit tests of shared/transport/stats.py: the typed heartbeat figures, their flat wire map (byte for byte what
children sent before the types), unknown keys ignored, missing or mistyped keys read as not reported."""

from __future__ import annotations

import dataclasses

import pytest

from specring.shared.transport import messages as m
from specring.shared.transport.stats import (
    ChildStats,
    ConsumerStats,
    ProducerStats,
    parse_stats,
    stats_class,
)

COMMON = {"work": "batch 7", "work_s": 1.25, "busy_s": 10.5, "window_s": 12.0, "idle_tail_s": 0.0}
# the flat maps the children built by hand before the types, in their key order
PRODUCER_WIRE = {"tokens_per_s": 1234.5, "batches": 3, "bad_batches": 1, "tokens": 900, "gpu_mem_bytes": 0,
                 "gpu_mem_reserved_bytes": 0, "current_batch": -1, **COMMON}
CONSUMER_WIRE = {"tokens_per_s": 99.0, "step": 4, "tokens": 800, "gpu_mem_bytes": 1 << 30, "tau_eval": "", **COMMON}


def heartbeat(role: str, stats: dict) -> bytes:
    return m.encode(m.Heartbeat(role=role, index=0, generation=1, pid=7, stats=stats))


@pytest.mark.parametrize("role,cls,wire", [("producer", ProducerStats, PRODUCER_WIRE),
                                           ("consumer", ConsumerStats, CONSUMER_WIRE)])
def test_the_wire_map_is_byte_for_byte_the_one_children_sent(role, cls, wire):
    typed = cls(**wire)
    assert list(typed.to_wire().items()) == list(wire.items())  # same keys, values and order
    assert heartbeat(role, typed.to_wire()) == heartbeat(role, wire)
    back = parse_stats(role, m.decode(heartbeat(role, typed.to_wire())).stats)
    assert back == typed and type(back) is cls


def test_figures_not_reported_are_left_out_and_the_role_comes_first():
    s = ConsumerStats(tokens_per_s=1.0, step=2, tokens=3, work="", work_s=0.5)
    assert list(s.to_wire()) == ["tokens_per_s", "step", "tokens", "work", "work_s"]
    assert ChildStats(stats_error="ValueError: x", work="", work_s=0.0).to_wire() == {
        "stats_error": "ValueError: x", "work": "", "work_s": 0.0}
    assert ProducerStats().to_wire() == {}


def test_unknown_keys_are_ignored_and_missing_keys_are_not_reported():
    s = parse_stats("producer", {"tokens_per_s": 5.0, "rss_mb": 1.5, "future_figure": [1, 2]})
    assert s == ProducerStats(tokens_per_s=5.0)
    assert s.batches is None and s.work_s is None and s.busy_s is None
    assert parse_stats("consumer", {}) == ConsumerStats()


@pytest.mark.parametrize("key,value", [("work_s", True), ("work_s", "1.0"), ("busy_s", None), ("batches", 2.0),
                                       ("batches", False), ("work", 3), ("current_batch", "7"), ("tokens", [1])])
def test_a_figure_of_the_wrong_type_is_not_reported(key, value):
    assert getattr(parse_stats("producer", {key: value}), key) is None


def test_an_int_is_a_fine_float_and_stays_an_int_where_an_int_belongs():
    s = parse_stats("producer", {"work_s": 3, "busy_s": 2, "tokens": 5})
    assert s.work_s == 3.0 and type(s.work_s) is float and type(s.busy_s) is float
    assert s.tokens == 5 and type(s.tokens) is int


def test_each_role_has_its_class_and_others_the_common_figures():
    assert stats_class("producer") is ProducerStats and stats_class("consumer") is ConsumerStats
    assert stats_class("tau") is ChildStats
    assert parse_stats("tau", PRODUCER_WIRE) == ChildStats(**COMMON)
    typed = ProducerStats(tokens=3)
    assert parse_stats("producer", typed) is typed
    assert parse_stats("consumer", ChildStats(work="x")) == ConsumerStats(work="x")


def test_every_class_declares_the_common_figures_first():
    for cls in (ChildStats, ProducerStats, ConsumerStats):
        names = [f.name for f in dataclasses.fields(cls)]
        assert tuple(names[:len(ChildStats.COMMON)]) == ChildStats.COMMON
        assert all(f.default is None for f in dataclasses.fields(cls))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ProducerStats().tokens = 1


def test_the_monitor_keeps_the_latest_of_each_figure_and_reads_them_typed():
    from specring.shared.config.run_config import MonitorConfig
    from specring.supervisor.monitor import Child, HealthMonitor

    mon, child = HealthMonitor(MonitorConfig()), Child("consumer", 0)
    mon.on_heartbeat(child, {"tokens_per_s": 2.0, "step": 3, "gpu_mem_bytes": 5, "work_s": "soon"})
    mon.on_heartbeat(child, ConsumerStats(step=4, work="batch 1", work_s=0.5))
    f = child.figures
    assert isinstance(f, ConsumerStats) and (f.step, f.tokens_per_s, f.gpu_mem_bytes) == (4, 2.0, 5)
    assert (f.work, f.work_s) == ("batch 1", 0.5)
    assert Child("producer", 1).figures == ProducerStats()


def test_a_childs_heartbeat_carries_its_role_figures_then_the_common_ones():
    from specring.shared.config.run_config import RunConfig
    from specring.shared.process.procs import ChildContext

    ctx = ChildContext(role="producer", index=0, generation=1, run_dir=".", config=RunConfig(), topology=None,
                       sock=None, stats=lambda: ProducerStats(tokens_per_s=2.0, batches=1))
    sent = []
    ctx.send = lambda msg, block=True: sent.append(msg) or True
    with ctx.working("batch 3"):
        ctx.heartbeat()
    wire = m.decode(m.encode(sent[-1])).stats
    assert list(wire) == ["tokens_per_s", "batches", "work", "work_s", "busy_s", "window_s", "idle_tail_s"]
    assert wire["work"] == "batch 3" and wire["batches"] == 1
    ctx.stats = lambda: 1 / 0  # the role's figures fail: the heartbeat still goes, saying why
    ctx.heartbeat()
    assert list(sent[-1].stats)[:3] == ["stats_error", "work", "work_s"]
    assert sent[-1].stats["stats_error"].startswith("ZeroDivisionError")
    ctx.stats = lambda: {"tokens_per_s": 7.0, "not_a_figure": 1}  # a flat map is read as the role's figures
    ctx.heartbeat()
    assert sent[-1].stats["tokens_per_s"] == 7.0 and "not_a_figure" not in sent[-1].stats

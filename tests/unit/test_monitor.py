"""Unit tests of the health monitor's hang rules and of the child's heartbeat thread (issue 14, item 4):
a slow batch is not a hang, a stuck one is. No processes: a fake clock, a fake child process, and the
heartbeat thread of a ``ChildContext`` talking to a ROUTER over ``inproc``."""

from __future__ import annotations

import time

import pytest
import zmq

from specring.shared.config.run_config import MonitorConfig, RunConfig
from specring.shared.errors import ConfigError
from specring.shared.process import faults
from specring.shared.process.procs import ChildContext, Topology
from specring.shared.transport import channel
from specring.shared.transport import messages as m
from specring.supervisor.monitor import Child, HealthMonitor


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Running:
    pid = 4242

    def poll(self):
        return None


def monitor_and_child(**cfg) -> tuple[HealthMonitor, Child, Clock]:
    clock = Clock()
    mon = HealthMonitor(MonitorConfig(heartbeat_interval_s=1, hang_timeout_s=5, batch_timeout_s=60, **cfg), clock)
    child = Child("producer", 0)
    mon.started(child, Running())
    mon.on_hello(child)
    return mon, child, clock


def beat(mon, child, clock, work: str, work_s: float, every_s: float = 1.0) -> None:
    clock.t += every_s
    mon.on_heartbeat(child, {"work": work, "work_s": work_s, "tokens_per_s": 1.0})


def test_a_batch_slower_than_the_hang_timeout_is_not_a_hang_while_heartbeats_go_on():
    mon, child, clock = monitor_and_child()
    for k in range(1, 59):  # 58 s on one batch, a heartbeat every second
        beat(mon, child, clock, "batch 3", float(k))
        assert mon.hung(child) == "", k


def test_the_supervisors_own_stall_is_not_the_childrens_hang_but_a_real_hang_is_still_found():
    mon, child, clock = monitor_and_child()            # hang_timeout_s 5
    fresh = Child("consumer", 0)
    mon.started(fresh, Running())
    mon.on_hello(fresh)
    beat(mon, child, clock, "", 0.0)
    clock.t += 9.0                                     # the supervisor was stopped 9 s; heartbeats queued unread
    mon.on_heartbeat(fresh, {"work": "", "work_s": 0.0})  # one of them already read this turn
    assert mon.hung(child).startswith("no heartbeat or progress for 9.0s")
    mon.unwatched([child, fresh], 9.0)
    assert mon.hung(child) == "" and mon.hung(fresh) == ""
    assert fresh.last_heartbeat == clock.t             # never moved past now
    clock.t += 5.5                                     # ... but a child that really stays silent is still hung
    assert mon.hung(child).startswith("no heartbeat or progress")


def test_a_batch_over_batch_timeout_is_a_hang_although_heartbeats_go_on():
    mon, child, clock = monitor_and_child()
    for k in range(1, 62):
        beat(mon, child, clock, "batch 3", float(k))
    assert "busy with batch 3 for 61.0s > batch_timeout_s=60" in mon.hung(child)


def test_silence_is_a_hang_after_hang_timeout_whatever_the_last_heartbeat_said():
    mon, child, clock = monitor_and_child()
    beat(mon, child, clock, "batch 3", 1.0)
    clock.t += 4.9
    assert mon.hung(child) == ""
    clock.t += 0.2  # SIGSTOP: the heartbeat thread stops too
    assert "no heartbeat or progress for 5.1s > hang_timeout_s=5" in mon.hung(child)


def test_an_idle_main_loop_that_stopped_turning_is_a_hang():
    mon, child, clock = monitor_and_child()
    for k in range(1, 5):
        beat(mon, child, clock, "", 0.1)
    assert mon.hung(child) == ""
    for k in range(1, 7):  # heartbeats go on, the idle loop does not turn (a deadlock outside a batch)
        beat(mon, child, clock, "", float(k))
    assert "main loop has not turned for 6.0s" in mon.hung(child)


def test_progress_after_the_last_heartbeat_makes_its_work_figures_stale():
    mon, child, clock = monitor_and_child()
    beat(mon, child, clock, "batch 3", 59.5)
    clock.t += 0.2
    mon.on_progress(child)  # batch 3 published just after that heartbeat
    clock.t += 0.5
    assert mon.hung(child) == ""


def test_children_without_work_figures_are_judged_by_silence_only():
    mon, child, clock = monitor_and_child()
    for _ in range(100):
        clock.t += 1
        mon.on_heartbeat(child, {"tokens_per_s": 1.0})
    assert mon.hung(child) == ""


def test_batch_timeout_must_not_be_below_the_hang_timeout():
    with pytest.raises(ConfigError, match="batch_timeout_s"):
        MonitorConfig(hang_timeout_s=60, batch_timeout_s=30)


def test_fault_hooks_parse_and_name_the_variable(monkeypatch):
    monkeypatch.setenv(faults.SLOW_FORWARD_ENV, "2.5")
    monkeypatch.setenv(faults.STALL_FORWARD_ENV, "1:2")
    f = faults.ForwardFaults(1, 2)
    assert f.slow_s == 2.5 and f.stall
    assert not faults.ForwardFaults(1, 3).stall and not faults.ForwardFaults(0, 2).stall
    for name, bad in ((faults.SLOW_FORWARD_ENV, "-1"), (faults.SLOW_FORWARD_ENV, "inf"),
                      (faults.SLOW_FORWARD_ENV, "soon"), (faults.STALL_FORWARD_ENV, "1"),
                      (faults.STALL_FORWARD_ENV, "0:0"), (faults.HELPERS_ENV, "yes")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=name):
            faults.ForwardFaults(0, 1) if name != faults.HELPERS_ENV else faults.start_helpers()
        monkeypatch.delenv(name)


def test_nested_work_gives_the_outer_work_back_with_its_clock():
    cfg = RunConfig(monitor=MonitorConfig(heartbeat_interval_s=0.05, hang_timeout_s=1.0))
    ctx = ChildContext(role="producer", index=0, generation=1, run_dir=".", config=cfg, topology=None, sock=None)
    assert ctx.work_stats()["work"] == ""
    with ctx.working("batch 2"):
        time.sleep(0.05)
        with ctx.working("publish batch 1"):
            assert ctx.work_stats()["work"] == "publish batch 1" and ctx.work_stats()["work_s"] < 0.05
            ctx.tick()  # a tick inside work changes nothing
            assert ctx.work_stats()["work"] == "publish batch 1"
        assert ctx.work_stats()["work"] == "batch 2" and ctx.work_stats()["work_s"] >= 0.05
    assert ctx.work_stats()["work"] == ""


def test_the_heartbeat_thread_reports_the_work_of_a_busy_main_thread():
    """While the main thread sleeps in a 'batch' the heartbeats keep coming and say so, with growing work_s;
    afterwards they say idle."""
    zctx = zmq.Context()
    router = channel.bind_router(zctx, "inproc://hb")
    sock = channel.connect_dealer(zctx, "inproc://hb", "producer-0-g1")
    cfg = RunConfig(monitor=MonitorConfig(heartbeat_interval_s=0.05, hang_timeout_s=1.0))
    topo = Topology(run_id="r", address="inproc://hb", rings=[], slot_bytes=0, num_slots=0, supervisor_pid=0)
    ctx = ChildContext(role="producer", index=0, generation=1, run_dir=".", config=cfg, topology=topo, sock=sock,
                       stats=lambda: {"tokens_per_s": 7.0})
    try:
        ctx.ready()
        assert isinstance(channel.recv_from(router, 5.0)[1], m.Hello)
        with ctx.working("batch 9"):
            time.sleep(0.6)  # the main thread is busy: no tick, no send
        beats = []
        while (got := channel.recv_from(router, 2.0)) is not None and len(beats) < 100:
            beats.append(got[1])
            if got[1].stats["work"] == "":
                break  # the first heartbeat after the batch
        busy = [b.stats for b in beats if b.stats["work"] == "batch 9"]
        assert len(busy) >= 5 and all(b["tokens_per_s"] == 7.0 for b in busy)
        assert busy[-1]["work_s"] > busy[0]["work_s"] and busy[-1]["work_s"] >= 0.4
        assert beats[-1].stats["work"] == "" and beats[-1].stats["work_s"] < 1.0
    finally:
        ctx.stop_heartbeats()
        zctx.destroy(linger=0)

"""Unit tests: no peer of the coordinator socket can take the supervisor's loop (issue 14, item 3).

In one process: the admission logic with a fake clock, and a real ROUTER/DEALER pair over ``inproc`` to
show that a send to a peer that never reads fails at once instead of blocking."""

from __future__ import annotations

import time

import pytest
import zmq

from specring.shared.transport import channel
from specring.shared.transport import messages as m
from specring.supervisor.dispatch import peer_name
from specring.supervisor.peers import CommandGate, LogLimiter


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_gate_limits_each_peer_and_all_peers_together():
    clock = Clock()
    gate = CommandGate(rate_per_s=2, burst=3, total_rate_per_s=10, total_burst=5, clock=clock)
    assert [gate.admit(b"a") for _ in range(5)] == ["", "", "", "peer_rate", "peer_rate"]
    assert [gate.admit(b"b") for _ in range(3)] == ["", "", "total_rate"]  # 5 in all so far
    clock.t += 0.5  # one token more for a; 5 more in all
    assert gate.admit(b"a") == "" and gate.admit(b"a") == "peer_rate"
    assert gate.admit(b"c") == ""  # a newcomer is served while a flooder is refused


def test_a_dropped_peer_is_refused_for_drop_s_then_served_again():
    clock = Clock()
    gate = CommandGate(drop_s=30, clock=clock)
    gate.drop(b"slow")
    assert gate.admit(b"slow") == "dropped" and gate.admit(b"other") == ""
    clock.t += 31
    assert gate.admit(b"slow") == ""


def test_gate_remembers_a_bounded_number_of_peers():
    clock = Clock()
    gate = CommandGate(max_peers=8, clock=clock)
    for i in range(10_000):  # a new identity per command
        gate.admit(f"p{i}".encode())
        gate.drop(f"d{i}".encode())
    assert len(gate._peers) <= 8 and len(gate._dropped) <= 8


def test_gate_refuses_nonsense_limits():
    with pytest.raises(ValueError, match="burst"):
        CommandGate(burst=0)


def test_log_limiter_lets_one_line_per_key_and_interval_through():
    clock = Clock()
    lim = LogLimiter(interval_s=10, clock=clock)
    assert [lim.allow("k") for _ in range(4)] == [True, False, False, False]
    assert lim.allow("other")
    clock.t += 10
    assert lim.allow("k") and lim.held("k") == 3 and lim.held("k") == 0


def test_peer_names_in_log_lines_are_printable():
    assert peer_name(b"producer-0-g1") == "producer-0-g1"
    assert peer_name(b"\x00k\xe6Eg") == "0x006be64567"
    assert peer_name(b"") == "0x"


def test_a_router_send_to_a_peer_that_never_reads_fails_at_once():
    ctx = zmq.Context()
    try:
        router = channel.bind_router(ctx, "inproc://coord")
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, b"cli-1")
        peer.setsockopt(zmq.RCVHWM, 10)
        peer.connect("inproc://coord")
        channel.send(peer, m.Command(action="status"))
        got = channel.recv_from(router, 5.0)
        assert got is not None and got[0] == b"cli-1"
        reply = m.Reply(ok=True, text="x" * 1000)
        t0 = time.monotonic()
        with pytest.raises(zmq.Again):
            for _ in range(3 * channel.ROUTER_SNDHWM):
                channel.send(router, reply, to=b"cli-1")
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(zmq.ZMQError):
            channel.send(router, reply, to=b"nobody")  # unroutable: raises, never waits
    finally:
        ctx.destroy(linger=0)

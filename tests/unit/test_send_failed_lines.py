"""Sends that fail again and again (a node stopped for 20 s, a child that is gone) are counted, and logged at most
once per peer and interval, as lines about bad peers already are (issue 27, kind 4)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import zmq

from specring.shared.transport import messages as m
from specring.supervisor import dispatch, nodes


def test_node_link_send_failures_are_rate_limited(caplog):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)      # connected to nothing: every non-blocking send fails at once (EAGAIN)
    link = nodes.NodeLink(sock, "tcp://127.0.0.1:1", b"key", 1)
    try:
        with caplog.at_level(logging.WARNING, logger="specring.supervisor.nodes"):
            for _ in range(200):
                assert not link.send(m.NodeMsg(node=1, event="heartbeat"))
        lines = [r for r in caplog.records if "send_failed" in r.getMessage()]
        assert link.send_failures == 200 and len(lines) == 1, [r.getMessage() for r in lines]
    finally:
        sock.close(linger=0)
        ctx.term()


def _dispatch(router):
    """A ``MessageDispatch`` with just what its ``send`` uses: one node, a ROUTER that knows no peer."""
    class _Co:
        @staticmethod
        def generation(role, index):
            return 1
    context = SimpleNamespace(router=router, coordinator=_Co(), child=lambda role, index: None)
    return dispatch.MessageDispatch(context, SimpleNamespace(topo=None, relay=None), records=None)


def test_child_send_failures_are_rate_limited(caplog):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer that is not connected raises EHOSTUNREACH
    try:
        d = _dispatch(router)
        with caplog.at_level(logging.WARNING, logger="specring.supervisor.dispatch"):
            for _ in range(200):
                assert not d.send("consumer", 0, m.Shutdown(reason="done"))
            assert not d.send("producer", 1, m.Shutdown(reason="done"))
        lines = [r.getMessage() for r in caplog.records if "send_failed" in r.getMessage()]
        assert len(lines) == 2 and "to=consumer-0" in lines[0] and "to=producer-1" in lines[1], lines
    finally:
        router.close(linger=0)
        ctx.term()

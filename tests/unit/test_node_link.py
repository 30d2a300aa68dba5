"""The control link between node supervisors (``supervisor.nodes.NodeLink``), on real ZeroMQ TCP sockets with
CURVE: a node whose key was registered at the rendezvous is heard; a peer without a registered key, or without
CURVE at all, is refused (nothing it sends is ever read); a registered node cannot speak for another node; and
the rendezvous through a real TCPStore refuses a node whose plan differs and a second node with the same rank."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from specring.shared.config.run_config import TrainerConfig
from specring.shared.errors import ConfigError
from specring.shared.transport import messages as m
from specring.supervisor.nodes import NodeLink, rendezvous


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def recv_within(link: NodeLink, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = link.recv(0.05)
        if got is not None:
            return got
    return None


def test_only_registered_nodes_are_heard(ctx):
    server = NodeLink.server(ctx, "127.0.0.1", bind_host="127.0.0.1")
    pub, sec = zmq.curve_keypair()
    server.allow(pub, 1)
    good = NodeLink.client(ctx, server.endpoint, server.public_key, pub, sec, node=1)
    rogue_pub, rogue_sec = zmq.curve_keypair()
    rogue = NodeLink.client(ctx, server.endpoint, server.public_key, rogue_pub, rogue_sec, node=1)
    plain = ctx.socket(zmq.DEALER)  # no CURVE at all
    plain.setsockopt(zmq.LINGER, 0)
    plain.setsockopt(zmq.IDENTITY, b"node-1")
    plain.connect(server.endpoint)
    try:
        assert good.send(m.NodeMsg(node=1, event="hello"))
        got = recv_within(server, 15)
        assert got == m.NodeMsg(node=1, event="hello")
        rogue.send(m.NodeMsg(node=1, event="stop", reason="forged"))
        try:  # a DEALER without CURVE may have no pipe at all (its handshake refused): then it cannot even queue
            plain.send(m.encode(m.NodeMsg(node=1, event="stop", reason="forged")), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        assert recv_within(server, 2) is None, "a peer without a registered key was heard"
        assert server.allowed.refused >= 1
        # the server answers the registered node only
        assert server.send(m.NodeMsg(node=0, event="heartbeat"), to=1)
        assert recv_within(good, 15) == m.NodeMsg(node=0, event="heartbeat")
        # a registered node cannot speak for another one
        other_pub, other_sec = zmq.curve_keypair()
        server.allow(other_pub, 2)
        good.send(m.NodeMsg(node=2, event="stop", reason="not mine"))
        assert recv_within(server, 2) is None and server.rejected == 1
    finally:
        for link in (good, rogue, server):
            link.close()
        plain.close(0)


def _cfg(rank: int, port: int, nnodes: int = 2, consumers: int = 1):
    nodes = SimpleNamespace(nnodes=nnodes, node_rank=rank, master_addr="127.0.0.1", master_port=port,
                            rendezvous_timeout_s=20.0)
    return SimpleNamespace(nodes=nodes, producer=SimpleNamespace(devices=["cpu"]),
                           trainer=TrainerConfig(devices=["cpu"] * consumers))


def _plan(order_ids):
    return SimpleNamespace(order=[SimpleNamespace(batch_id=b) for b in order_ids], data_digest="d", slot_bytes=4096,
                           target_layer_ids=[1], total_steps=len(order_ids))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meet(ctx, cfgs_plans):
    """Run ``rendezvous`` for each (cfg, plan) in a thread of its own; returns their results or exceptions."""
    out = [None] * len(cfgs_plans)

    def run(i, cfg, plan):
        try:
            out[i] = rendezvous(cfg, plan, ctx, "/tmp")
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, c, p)) for i, (c, p) in enumerate(cfgs_plans)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # node 0 first: it hosts the store
    for t in threads:
        t.join(60)
    return out


def test_rendezvous_agrees_on_the_topology_and_refuses_another_plan(ctx):
    port = _free_port()
    ok = _meet(ctx, [(_cfg(0, port), _plan([1, 2, 3])), (_cfg(1, port), _plan([1, 2, 3])),
                     (_cfg(1, port), _plan([1, 2, 3]))])  # a second node 1
    try:
        refused = [r for r in ok[1:] if isinstance(r, ConfigError)]  # whichever node 1 came second
        assert len(refused) == 1 and "node rank 1 has already joined" in str(refused[0]), ok
        (t0, l0, _), (t1, l1, _) = [r for r in ok if isinstance(r, tuple)]
        assert t0.producers == t1.producers == [1, 1] and t1.offset("consumer") == 1 and t0.dp_prefix == t1.dp_prefix
        assert l1.send(m.NodeMsg(node=1, event="hello"))
        assert recv_within(l0, 15) == m.NodeMsg(node=1, event="hello")
    finally:
        for r in ok:
            if isinstance(r, tuple):
                r[1].close()
    port = _free_port()
    bad = _meet(ctx, [(_cfg(0, port), _plan([1, 2, 3])), (_cfg(1, port), _plan([1, 3, 2, 4]))])
    for r in bad:
        if isinstance(r, tuple):
            r[1].close()
    assert isinstance(bad[0], ConfigError)
    assert "node 1's run differs from node 0's in batch order, optimizer steps" in str(bad[0])
    assert isinstance(bad[1], ConfigError) and "node 0 refused node 1" in str(bad[1])

"""The supervisor's messages: every frame from the coordinator socket, and every send to a child.

``MessageDispatch`` (a part of ``supervisor.supervisor.Supervisor``) validates a frame's sender (its ZeroMQ
identity names role, index and generation: ``shared.process.procs.peer_identity``), fences other generations
(``Coordinator.fenced``), hands the message to the ``Coordinator`` (ledger), the ``HealthMonitor`` (liveness)
and the balance figures, and answers operator commands (``launch.py status``/``restart``/``stop``), rate-limited
per peer (``supervisor.peers``). A frame that is malformed, from an unknown peer or trips an error in a handler
is logged (rate-limited) and counted, never fatal to the loop. Sends never block: a peer that is gone or does
not read makes ``MessageDispatch.send`` return False (the coordinator then records nothing).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import zmq

from specring.shared.drafters import get_family
from specring.shared.errors import MessageError
from specring.shared.process.procs import parse_identity, peer_identity
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import RunStatus, StatusRow
from specring.shared.transport import channel
from specring.shared.transport import messages as m
from specring.supervisor.context import MAX_FRAMES_PER_TURN, RunContext, to_ledger
from specring.supervisor.peers import CommandGate, LogLimiter

if TYPE_CHECKING:
    from specring.supervisor.node_events import NodeEvents
    from specring.supervisor.records import RunRecords

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # one log line per peer and kind of rejection this often at most


class MessageDispatch:
    """Frames in, messages out (see the module docstring); a part of ``Supervisor``.

    Given: the ``RunContext`` (``coordinator``, ``router``, the children, ``monitor``, ``balance``, ``progress``,
    ``stop_reason``), the ``NodeEvents`` (on several nodes: ``topo``, ``link``, ``relay``, ``dead_nodes``, to reach
    another node's children) and the ``RunRecords`` (steps trained, checkpoints, figures for ``launch.py
    status``).

    Owns: the operator-command gate (``supervisor.peers.CommandGate``) and the rate limit of lines about bad
    peers; public, for ``summary.json`` and the lifecycle's log lines: ``rejected_frames`` (frames of the socket
    rejected), ``refused_commands`` (operator commands refused by the gate) and ``consumer_error`` (the message
    of a consumer's last fatal ``Error``, empty without one)."""

    def __init__(self, context: RunContext, nodes: NodeEvents, records: RunRecords):
        self.context = context
        self.nodes = nodes
        self.records = records
        self.rejected_frames = 0
        self.refused_commands = 0
        self.consumer_error = ""
        self._gate = CommandGate()           # operator commands: rate-limited per peer, non-readers dropped
        self._log_limiter = LogLimiter(LOG_EVERY_S)

    def send(self, role: str, index: int, msg) -> bool:
        """Send to the current incarnation of a child without blocking; False when it could not be queued (the
        peer is not connected, or its queue is full). On node 0 of several nodes a child of another node (global
        ``index`` past this node's) is reached through the node link: True once the link queued it (if that
        node cannot pass it on, it says ``send_failed`` and the coordinator takes it back)."""
        nodes = self.nodes
        if nodes.topo is not None and nodes.relay is None and self.context.child(role, index) is None:
            node = nodes.topo.nodes_of(role)[index]
            return node not in nodes.dead_nodes and bool(nodes.link.send(
                m.NodeMsg(node=0, event="child", role=role, index=index, body=m.encode(msg)), to=node))
        try:
            channel.send(self.context.router, msg,
                         to=peer_identity(role, index, self.context.coordinator.generation(role, index)).encode())
            return True
        except zmq.ZMQError as e:  # a peer that is gone or not reading: one line per peer and LOG_EVERY_S
            self._warn_limited(("send_failed", role, index), "send_failed to=%s-%d kind=%s error=%s", role, index,
                               msg.KIND, e)
            return False

    def handle_safely(self, peer: bytes, msg) -> None:
        """Handle one frame of the socket (``peer``: its ZeroMQ identity; ``msg``: the decoded message, or the
        ``MessageError`` it raised): a message that trips an error is logged and counted, never fatal to the
        loop."""
        try:
            self._handle(peer, msg)
        except Exception as e:
            self.rejected_frames += 1
            log.error("reject kind=%s peer=%r reason=handler_error error=%s: %s", getattr(msg, "KIND", "?"), peer,
                      type(e).__name__, e)

    def _handle(self, peer: bytes, msg) -> None:
        cx = self.context
        co = cx.coordinator
        sender = peer_name(peer)
        if isinstance(msg, MessageError):
            self.rejected_frames += 1
            self._warn_limited(("frame", peer), "reject frame peer=%s error=%s", sender, msg)
            return
        if isinstance(msg, m.Command):
            why = self._gate.admit(peer)
            if why:
                self.refused_commands += 1
                self._warn_limited(("command", peer), "command_refused peer=%s action=%s reason=%s", sender,
                                   msg.action, why)
                return
            self._command(peer, msg)
            return
        ident = parse_identity(peer)
        child = cx.child(ident[0], ident[1]) if ident else None
        if child is None:
            self.rejected_frames += 1
            self._warn_limited(("unknown", peer), "reject kind=%s peer=%s reason=unknown_peer", msg.KIND, sender)
            return
        role, peer_gen = ident[0], ident[2]
        if isinstance(msg, m.Error):  # logged even from a dead incarnation: it may say why it died
            log.error("child_error %s=%d generation=%d fatal=%s message=%s", role, msg.index, msg.generation,
                      msg.fatal, msg.message)
            if role == "consumer" and msg.fatal:
                self.consumer_error = msg.message
            return
        gen = getattr(msg, "generation", peer_gen) if role == "producer" else peer_gen  # a producer's own
        if co.fenced(role, child.index, peer_gen, msg.KIND) or (
                gen != peer_gen and co.fenced(role, child.index, gen, msg.KIND)):
            return
        if isinstance(msg, m.Hello) and (role != msg.role or child.index != msg.index):
            log.warning("reject hello peer=%s says %s-%s", sender, msg.role, msg.index)
            return
        if self.nodes.relay is not None and not isinstance(msg, m.Heartbeat):
            self.nodes.relay.up(role, child.index, msg)  # node 0 keeps the ledger; the local handling below goes on
        if isinstance(msg, m.Hello):
            cx.monitor.on_hello(child)
            co.on_hello(role, msg.index, msg.generation)
            log.info("hello %s=%d pid=%d generation=%d", role, msg.index, msg.pid, msg.generation)
        elif isinstance(msg, m.Heartbeat):
            cx.monitor.on_heartbeat(child, msg.stats)
            cx.balance[(role, child.index)].update(peer_gen, msg.stats)
        elif (progress := to_ledger(co, self.records, self.nodes.world(), role, msg)) is not None:
            if progress:
                cx.monitor.on_progress(child)
        elif isinstance(msg, m.Checkpointed):
            cx.monitor.on_progress(child)
            self.records.on_checkpoint(msg.step, msg.path)
            log.info("checkpoint step=%d path=%s", msg.step, msg.path)
        else:
            self.rejected_frames += 1
            log.warning("reject kind=%s peer=%s reason=unexpected_for_role", msg.KIND, sender)

    def status_rows(self) -> list[StatusRow]:
        """One ``StatusRow`` per child, producers first (``status.json``, ``launch.py status``, the time series)."""
        cx = self.context
        co = cx.coordinator
        rows = []
        now = time.monotonic()
        for c in cx.producers + cx.consumers:
            row = StatusRow(role=c.role, index=c.index, pid=c.pid,
                            generation=co.generation(c.role, c.index) if co else 1,
                            state=c.state, heartbeat_age_s=round(now - c.last_heartbeat, 1) if c.hello else None,
                            tokens_per_s=c.figures.tokens_per_s, gpu_mem_bytes=c.figures.gpu_mem_bytes,
                            restarts=c.restarts, work=c.figures.work, work_s=c.figures.work_s,
                            **cx.balance[(c.role, c.index)].live(), **cx.monitor.sample(c))
            if c.role == "producer" and co:
                row.ring = co.occupancy(c.index)
            rows.append(row)
        return rows

    def _command(self, peer: bytes, cmd: m.Command) -> None:
        cx = self.context
        if cmd.action == "status":
            co = cx.coordinator
            last = RunDir(cx.run_dir).last_metrics()
            acc_key = get_family(cx.cfg.trainer.drafter).acc_key
            status = RunStatus(run_id=cx.run_id, step=cx.progress.step, trained=len(co.trained),
                               planned=len(co.order), loss=co.loss_last, drafter=cx.cfg.trainer.drafter,
                               acc_key=acc_key, acc=last.family.get(acc_key) if last else None,
                               acc_step=last.step if last else None,
                               balance=self.records.balance_figures(steady=False), rows=self.status_rows())
            reply = m.Reply(ok=True, text="", data=status.to_json())
        elif cmd.action == "restart" and cmd.role == "producer" and cx.child("producer", cmd.index):
            ok, text = self.restart_producer(cmd.index)
            reply = m.Reply(ok=ok, text=text)
        elif cmd.action == "restart" and cmd.role == "producer" and self.nodes.topo is not None:
            reply = self._restart_elsewhere(cmd.index)
        elif cmd.action == "restart" and cmd.role == "producer":
            reply = m.Reply(ok=False, text=f"no producer {cmd.index}: the run has producers "
                                           f"0..{len(cx.producers) - 1}")
        elif cmd.action == "stop":
            cx.stop_reason = cx.stop_reason or "stop_requested"
            reply = m.Reply(ok=True, text="stopping: consumers will checkpoint")
        else:
            reply = m.Reply(ok=False, text=f"unknown command {cmd.action!r} {cmd.role!r} {cmd.index}")
        try:
            channel.send(cx.router, reply, to=peer)
        except zmq.Again:  # its queue is full: it does not read what it asked for
            self._gate.drop(peer)
            self._warn_limited(("drop", peer), "peer_dropped peer=%s reason=not_reading drop_s=%g",
                               peer_name(peer), self._gate.drop_s)
        except zmq.ZMQError:
            pass  # gone already

    def restart_producer(self, index: int) -> tuple[bool, str]:
        """Restart this node's producer ``index`` (local; an ``IndexError`` past this node's producers)
        gracefully (it finishes its batch, exits, and the monitor starts its next generation); ``(ok, what the
        operator is told)``."""
        child = self.context.producers[index]
        if not child.alive():
            return False, f"producer {index} is not running (state {child.state})"
        child.graceful_restart = True
        self.send("producer", index, m.Shutdown(reason="restart requested"))
        gen = self.context.coordinator.generation("producer", index)
        log.info("restart_requested producer=%d generation=%d", index, gen)
        return True, f"producer {index} (generation {gen}) is restarting"

    def _restart_elsewhere(self, index) -> m.Reply:
        """Several nodes: ``restart producer N`` of a producer that is not this node's. Node 0 takes N as the
        global index (``launch.py status`` of node k lists its own from 0) and passes the restart to the node that
        owns it over the node link; another node says where N is to be asked."""
        nodes = self.nodes
        t = nodes.topo
        total = sum(t.producers)
        if nodes.relay is not None:  # node k: its own producers by local index; the others through node 0
            return m.Reply(ok=False, text=f"node {t.node_rank} has producers 0..{t.producers[t.node_rank] - 1} "
                                          f"(local indices); restart another node's producer on that node, or on "
                                          f"node 0 by its global index (0..{total - 1})")
        if not (isinstance(index, int) and 0 <= index < total):
            return m.Reply(ok=False, text=f"no producer {index}: the run has producers 0..{total - 1} (global "
                                          f"indices, node by node: {t.producers})")
        node = t.nodes_of("producer")[index]
        local = index - sum(t.producers[:node])
        if node in nodes.dead_nodes or not nodes.link.send(
                m.NodeMsg(node=0, event="restart", role="producer", index=index), to=node):
            return m.Reply(ok=False, text=f"producer {index} is producer {local} of node {node}, which cannot be "
                                          f"reached now; run `launch.py restart producer {local}` on node {node}")
        log.info("restart_requested producer=%d node=%d local=%d (passed to its node)", index, node, local)
        return m.Reply(ok=True, text=f"producer {index} is producer {local} of node {node}: restart passed to node "
                                     f"{node} (its log says restart_requested)")

    def _warn_limited(self, key, fmt: str, *args) -> None:
        """``log.warning`` at most once per ``LOG_EVERY_S`` per key (a peer's flood is not a log flood)."""
        if self._log_limiter.allow(key):
            held = self._log_limiter.held(key)
            log.warning(fmt + (f" (and {held} more like it in the last {LOG_EVERY_S:g} s)" if held else ""), *args)

    def drain_heartbeats(self) -> None:
        """Take the balance figures of the heartbeats still queued once every child has exited (each child sends
        one last heartbeat as it exits, after the loop stopped reading); every other frame is dropped."""
        cx = self.context
        if cx.router is None:
            return
        for _ in range(MAX_FRAMES_PER_TURN):
            got = channel.recv_from(cx.router, 0)
            if got is None:
                return
            peer, msg = got
            ident = parse_identity(peer)
            if isinstance(msg, m.Heartbeat) and ident and cx.child(ident[0], ident[1]) is not None \
                    and msg.role == ident[0] and msg.index == ident[1] and msg.generation == ident[2]:
                cx.balance[(ident[0], ident[1])].update(ident[2], msg.stats)


def peer_name(peer: bytes) -> str:
    """A peer identity for a log line: as is when printable ASCII (children, ``launch.py``), else hex (the
    random binary identity ZeroMQ gives an anonymous peer), so no log line carries raw bytes."""
    if peer and all(32 < b < 127 for b in peer):
        return peer.decode()
    return "0x" + peer.hex()

"""The supervisor's side of a run over several nodes: meeting the other nodes, the node link's events, and
stopping together (the link, the rendezvous and node k's ``RelayCoordinator`` live in ``supervisor.nodes``).

``NodeEvents`` (a part of ``supervisor.supervisor.Supervisor``): node 0 keeps the one ledger over every node's
producers and consumers and takes the other nodes' child messages (``_node_event``, ``_handle_remote``); node
k relays its children's messages up and node 0's leases and deliveries down. Every node heartbeats the nodes
it talks to; one silent for ``nodes.node_timeout_s`` is dead and stops the run (``--resume`` continues it).

State it uses on the supervisor: ``cfg.nodes``, ``topo``, ``link``, ``store``, ``relay``, ``node_seen``,
``node_bye``, ``dead_nodes``, ``stop_from_node0``, ``coordinator`` and ``stop_reason``.
"""

from __future__ import annotations

import logging
import time

from specring.shared.errors import MessageError
from specring.shared.transport import messages as m
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.dispatch import MAX_FRAMES_PER_TURN, POLL_S
from specring.supervisor.lifecycle import SHUTDOWN_CAP_FACTOR

log = logging.getLogger(__name__)


class NodeEvents:
    """Several nodes (see the module docstring); a part of ``Supervisor``. With one node every method is a
    no-op."""

    def _meet_nodes(self, trained: set[int]) -> None:
        """Rendezvous with the other nodes (``supervisor.nodes``); node 0 builds the one ledger over every node's
        producers and consumers, another node a ``RelayCoordinator`` in its place."""
        from specring.supervisor.nodes import RelayCoordinator, rendezvous
        self.topo, self.link, self.store = rendezvous(self.cfg, self.plan, self.ctx, str(self.run_dir))
        now = time.monotonic()
        self.node_seen = {k: now for k in range(self.topo.nnodes)}
        if self.cfg.nodes.node_rank == 0:
            t = self.topo
            self.coordinator = Coordinator(self.plan.order, sum(t.producers), self.cfg.ring.num_slots,
                                           sum(t.consumers), trained=trained, producer_nodes=t.nodes_of("producer"),
                                           consumer_nodes=t.nodes_of("consumer"))
        else:
            self.coordinator = self.relay = RelayCoordinator(self.topo, self.link)
            self.link.send(m.NodeMsg(node=self.cfg.nodes.node_rank, event="hello"))

    def _poll_nodes(self) -> None:
        """Read the node link, send heartbeats, and stop the run when a node (or node 0) falls silent."""
        if self.link is None:
            return
        from specring.supervisor.nodes import HEARTBEAT_S
        rank = self.cfg.nodes.node_rank
        for _ in range(MAX_FRAMES_PER_TURN):
            nm = self.link.recv(0)
            if nm is None:
                break
            self.node_seen[nm.node] = time.monotonic()
            try:
                if rank == 0:
                    self._node_event(nm)
                elif nm.event == "child":
                    self.relay.down(nm)
                elif nm.event == "stop" and not self.stop_reason:
                    self.stop_reason, self.stop_from_node0 = nm.reason or "stopped_by_node_0", True
                    log.info("stop from node 0 reason=%s", self.stop_reason)
                elif nm.event == "restart" and nm.role == "producer":  # an operator's restart, through node 0
                    local = nm.index - self.topo.offset("producer")
                    if self._child("producer", local) is None:
                        raise IndexError(f"producer {nm.index} is not one of node {rank}'s")
                    ok, text = self._restart_producer(local)
                    if not ok:
                        log.warning("restart from node 0 producer=%d: %s", local, text)
            except (MessageError, IndexError) as e:
                self.rejected_frames += 1
                log.warning("node_link reject node=%d event=%s error=%s", nm.node, nm.event, e)
        now = time.monotonic()
        for k in self._live_nodes():
            if now - self.link.last_sent.get(k, 0.0) >= HEARTBEAT_S:
                self.link.send(m.NodeMsg(node=rank, event="heartbeat"), to=k if rank == 0 else None)
        timeout = self.cfg.nodes.node_timeout_s
        for k in self._live_nodes():
            if now - self.node_seen.get(k, now) > timeout:
                self.dead_nodes.add(k)
                log.error("node_died node=%d silent_s=%.1f; stopping the run (resume with --resume on every node)",
                          k, now - self.node_seen[k])
                if not self.stop_reason:  # a node lost after the run is done leaves it done
                    self.stop_reason = f"node_{k}_died" if rank == 0 else "node_0_lost"

    def _live_nodes(self) -> list[int]:
        """The nodes this one talks to (node 0: every other node; others: node 0) that are neither dead nor
        gone (said bye)."""
        if self.topo is None:
            return []
        peers = range(1, self.topo.nnodes) if self.cfg.nodes.node_rank == 0 else [0]
        return [k for k in peers if k not in self.dead_nodes and k not in self.node_bye]

    def _node_event(self, nm: m.NodeMsg) -> None:
        """Node 0: one message from node ``nm.node``."""
        co, t = self.coordinator, self.topo
        if nm.event in ("child", "producer_died", "send_failed") and (
                nm.role not in ("producer", "consumer") or not 0 <= nm.index < len(t.nodes_of(nm.role))
                or t.nodes_of(nm.role)[nm.index] != nm.node):
            raise IndexError(f"{nm.role} {nm.index} is not on node {nm.node}")
        if nm.event == "child":
            msg = m.decode(nm.body)
            self._handle_remote(nm.node, nm.role, nm.index, msg)
        elif nm.event == "producer_died":
            gen = co.producer_died(nm.index)
            self.remote_producer_deaths[nm.index] = self.remote_producer_deaths.get(nm.index, 0) + 1
            log.info("fence producer=%d node=%d generation=%d (its node restarts it unless at its restart limit)",
                     nm.index, nm.node, gen)
        elif nm.event == "send_failed":  # node nm.node could not pass a lease or delivery on: take it back
            msg = m.decode(nm.body)
            if isinstance(msg, m.SlotReady) and nm.role == "consumer":
                co.undeliver(msg, nm.index)
            elif isinstance(msg, m.Lease) and nm.role == "producer":
                co.unlease(msg, nm.index)
        elif nm.event == "stop":
            log.error("node_stopped node=%d reason=%s", nm.node, nm.reason)
            if not self.stop_reason:
                self.stop_reason = f"node_{nm.node}_stopped: {nm.reason}"
        elif nm.event == "bye":
            self.node_bye.add(nm.node)
        elif nm.event == "hello":
            log.info("node_joined node=%d", nm.node)

    def _handle_remote(self, node: int, role: str, index: int, msg) -> None:
        """Node 0: a child message of another node, indices global (``supervisor.nodes.to_global``)."""
        co, t = self.coordinator, self.topo
        producer = getattr(msg, "producer", None)
        if producer is not None and not (0 <= producer < sum(t.producers) and t.nodes_of("producer")[producer] == node):
            raise IndexError(f"{msg.KIND} names producer {producer}, not one of node {node}")
        if isinstance(msg, m.Hello) and msg.role == role and msg.index == index:
            co.on_hello(role, index, msg.generation)
            log.info("hello %s=%d node=%d pid=%d generation=%d", role, index, node, msg.pid, msg.generation)
        elif self._to_ledger(role, msg) is None:  # the same hand-over as a local child's (MessageDispatch)
            self.rejected_frames += 1
            log.warning("reject kind=%s node=%d %s=%d reason=unexpected_for_role", msg.KIND, node, role, index)

    def _stop_nodes(self) -> None:
        """Tell the other nodes that the run stops: node 0 tells every node, another node tells node 0 (unless
        node 0 told it)."""
        if self.link is None:
            return
        rank = self.cfg.nodes.node_rank
        if rank == 0:
            for k in self._live_nodes():
                self.link.send(m.NodeMsg(node=0, event="stop", reason=self.stop_reason), to=k)
        elif not self.stop_from_node0 and 0 not in self.dead_nodes:
            self.link.send(m.NodeMsg(node=rank, event="stop", reason=self.stop_reason))

    def _nodes_bye(self, start: float, quiet_s: float) -> None:
        """Several nodes: another node says bye to node 0 once its consumers have stopped; node 0 waits for every
        live node's bye (it hosts the store their consumers' process group uses), within the shutdown bound."""
        if self.link is None:
            return
        if self.cfg.nodes.node_rank != 0:
            if 0 not in self.dead_nodes:
                self.link.send(m.NodeMsg(node=self.cfg.nodes.node_rank, event="bye"))
            return
        while (self._live_nodes() and self.signals < 2
               and time.monotonic() - start < SHUTDOWN_CAP_FACTOR * max(quiet_s, self.cfg.nodes.node_timeout_s)):
            self._poll_nodes()
            time.sleep(POLL_S)

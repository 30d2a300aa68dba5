"""The supervisor's side of a run over several nodes: meeting the other nodes, the node link's events, and
stopping together (the link, the rendezvous and node k's ``RelayCoordinator`` live in ``supervisor.nodes``).

``NodeEvents`` (a part of ``supervisor.supervisor.Supervisor``): node 0 keeps the one ledger over every node's
producers and consumers and takes the other nodes' child messages (``_node_event``, ``_handle_remote``); node
k relays its children's messages up and node 0's leases and deliveries down. Every node heartbeats the nodes
it talks to; one silent for ``nodes.node_timeout_s`` is dead and stops the run (``--resume`` continues it).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from specring.shared.errors import MessageError
from specring.shared.transport import messages as m
from specring.supervisor.context import MAX_FRAMES_PER_TURN, POLL_S, SHUTDOWN_CAP_FACTOR, RunContext, to_ledger
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.records import RunRecords

log = logging.getLogger(__name__)


class NodeEvents:
    """Several nodes (see the module docstring); a part of ``Supervisor``. With one node every method is a
    no-op.

    Given: the ``RunContext`` (``cfg.nodes``, ``plan``, ``coordinator``, which ``meet_nodes`` sets on several
    nodes, ``stop_reason``, ``signals``), the ``RunRecords`` (a ``Trained`` of another node is recorded there)
    and ``restart_producer``: ``(local index) -> (ok, text)``, the graceful restart of this node's producer that
    node 0 passes on (``MessageDispatch.restart_producer``).

    Owns (public, read by the other parts; all empty or None with one node): ``topo`` (the agreed
    ``supervisor.nodes.NodeTopology``), ``link`` (the ``NodeLink`` between node supervisors), ``store`` (the
    consumers' process-group store), ``relay`` (node k > 0: its ``RelayCoordinator``, also the context's
    ``coordinator``), ``dead_nodes`` (ranks found silent), ``remote_producer_deaths`` (node 0: global producer
    index -> deaths its node reported) and ``rejected_frames`` (node-link messages rejected). Its own:
    when each node was last heard from, the nodes that said bye, whether node 0 told this node to stop."""

    def __init__(self, context: RunContext, records: RunRecords,
                 restart_producer: Callable[[int], tuple[bool, str]]):
        self.context = context
        self.records = records
        self.restart_producer = restart_producer
        self.topo = None
        self.link = None
        self.store = None
        self.relay = None                   # node k > 0: its RelayCoordinator (also context.coordinator)
        self.dead_nodes: set[int] = set()
        self.remote_producer_deaths: dict[int, int] = {}  # node 0: global producer index -> deaths reported
        self.rejected_frames = 0
        self._node_seen: dict[int, float] = {}
        self._node_bye: set[int] = set()
        self._stop_from_node0 = False

    def world(self) -> int:
        """Consumers of the run, every node's."""
        return sum(self.topo.consumers) if self.topo is not None else len(self.context.consumers)

    def meet_nodes(self, trained: set[int], zmq_context) -> None:
        """Rendezvous with the other nodes (``supervisor.nodes``) over ``zmq_context`` (a ``zmq.Context``); node 0
        builds the one ledger over every node's producers and consumers (``trained``: batch ids already trained,
        on ``--resume``), another node a ``RelayCoordinator`` in its place; either becomes the context's
        ``coordinator``. Raises what ``supervisor.nodes.rendezvous`` raises (the nodes' plans differ, a node
        never came)."""
        from specring.supervisor.nodes import RelayCoordinator, rendezvous
        cx = self.context
        self.topo, self.link, self.store = rendezvous(cx.cfg, cx.plan, zmq_context, str(cx.run_dir))
        now = time.monotonic()
        self._node_seen = {k: now for k in range(self.topo.nnodes)}
        if cx.cfg.nodes.node_rank == 0:
            t = self.topo
            cx.coordinator = Coordinator(cx.plan.order, sum(t.producers), cx.cfg.ring.num_slots,
                                         sum(t.consumers), trained=trained, producer_nodes=t.nodes_of("producer"),
                                         consumer_nodes=t.nodes_of("consumer"))
        else:
            cx.coordinator = self.relay = RelayCoordinator(self.topo, self.link)
            self.link.send(m.NodeMsg(node=cx.cfg.nodes.node_rank, event="hello"))

    def poll_nodes(self) -> None:
        """Read the node link, send heartbeats, and stop the run when a node (or node 0) falls silent."""
        if self.link is None:
            return
        from specring.supervisor.nodes import HEARTBEAT_S
        rank = self.context.cfg.nodes.node_rank
        for _ in range(MAX_FRAMES_PER_TURN):
            nm = self.link.recv(0)
            if nm is None:
                break
            self._node_seen[nm.node] = time.monotonic()
            try:
                if rank == 0:
                    self._node_event(nm)
                elif nm.event == "child":
                    self.relay.down(nm)
                elif nm.event == "stop" and not self.context.stop_reason:
                    self.context.stop_reason, self._stop_from_node0 = nm.reason or "stopped_by_node_0", True
                    log.info("stop from node 0 reason=%s", self.context.stop_reason)
                elif nm.event == "restart" and nm.role == "producer":  # an operator's restart, through node 0
                    local = nm.index - self.topo.offset("producer")
                    if self.context.child("producer", local) is None:
                        raise IndexError(f"producer {nm.index} is not one of node {rank}'s")
                    ok, text = self.restart_producer(local)
                    if not ok:
                        log.warning("restart from node 0 producer=%d: %s", local, text)
            except (MessageError, IndexError) as e:
                self.rejected_frames += 1
                log.warning("node_link reject node=%d event=%s error=%s", nm.node, nm.event, e)
        now = time.monotonic()
        for k in self._live_nodes():
            if now - self.link.last_sent.get(k, 0.0) >= HEARTBEAT_S:
                self.link.send(m.NodeMsg(node=rank, event="heartbeat"), to=k if rank == 0 else None)
        timeout = self.context.cfg.nodes.node_timeout_s
        for k in self._live_nodes():
            if now - self._node_seen.get(k, now) > timeout:
                self.dead_nodes.add(k)
                log.error("node_died node=%d silent_s=%.1f; stopping the run (resume with --resume on every node)",
                          k, now - self._node_seen[k])
                if not self.context.stop_reason:  # a node lost after the run is done leaves it done
                    self.context.stop_reason = f"node_{k}_died" if rank == 0 else "node_0_lost"

    def _live_nodes(self) -> list[int]:
        """The nodes this one talks to (node 0: every other node; others: node 0) that are neither dead nor
        gone (said bye)."""
        if self.topo is None:
            return []
        peers = range(1, self.topo.nnodes) if self.context.cfg.nodes.node_rank == 0 else [0]
        return [k for k in peers if k not in self.dead_nodes and k not in self._node_bye]

    def _node_event(self, nm: m.NodeMsg) -> None:
        """Node 0: one message from node ``nm.node``."""
        co, t = self.context.coordinator, self.topo
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
            if not self.context.stop_reason:
                self.context.stop_reason = f"node_{nm.node}_stopped: {nm.reason}"
        elif nm.event == "bye":
            self._node_bye.add(nm.node)
        elif nm.event == "hello":
            log.info("node_joined node=%d", nm.node)

    def _handle_remote(self, node: int, role: str, index: int, msg) -> None:
        """Node 0: a child message of another node, indices global (``supervisor.nodes.to_global``)."""
        co, t = self.context.coordinator, self.topo
        producer = getattr(msg, "producer", None)
        if producer is not None and not (0 <= producer < sum(t.producers) and t.nodes_of("producer")[producer] == node):
            raise IndexError(f"{msg.KIND} names producer {producer}, not one of node {node}")
        if isinstance(msg, m.Hello) and msg.role == role and msg.index == index:
            co.on_hello(role, index, msg.generation)
            log.info("hello %s=%d node=%d pid=%d generation=%d", role, index, node, msg.pid, msg.generation)
        elif to_ledger(co, self.records, self.world(), role, msg) is None:  # the same hand-over as a local child's
            self.rejected_frames += 1
            log.warning("reject kind=%s node=%d %s=%d reason=unexpected_for_role", msg.KIND, node, role, index)

    def stop_nodes(self) -> None:
        """Tell the other nodes that the run stops: node 0 tells every node, another node tells node 0 (unless
        node 0 told it)."""
        if self.link is None:
            return
        rank = self.context.cfg.nodes.node_rank
        if rank == 0:
            for k in self._live_nodes():
                self.link.send(m.NodeMsg(node=0, event="stop", reason=self.context.stop_reason), to=k)
        elif not self._stop_from_node0 and 0 not in self.dead_nodes:
            self.link.send(m.NodeMsg(node=rank, event="stop", reason=self.context.stop_reason))

    def nodes_bye(self, start: float, quiet_s: float) -> None:
        """Several nodes: another node says bye to node 0 once its consumers have stopped; node 0 waits for every
        live node's bye (it hosts the store their consumers' process group uses), within the shutdown bound."""
        if self.link is None:
            return
        cfg = self.context.cfg
        if cfg.nodes.node_rank != 0:
            if 0 not in self.dead_nodes:
                self.link.send(m.NodeMsg(node=cfg.nodes.node_rank, event="bye"))
            return
        while (self._live_nodes() and self.context.signals < 2
               and time.monotonic() - start < SHUTDOWN_CAP_FACTOR * max(quiet_s, cfg.nodes.node_timeout_s)):
            self.poll_nodes()
            time.sleep(POLL_S)

    def credit_stall(self, credit: float, now: float) -> None:
        """The supervisor itself did not turn for ``credit`` s past its bound (``ChildLifecycle.credit_own_stall``):
        that time does not count against the other nodes' silence (what they sent meanwhile is still queued);
        ``now``: monotonic s."""
        for k, seen in self._node_seen.items():
            self._node_seen[k] = min(seen + credit, now)

    def close(self) -> None:
        """Close the node link (if any; before its ``zmq.Context`` is terminated) and let go of the store."""
        if self.link is not None:
            self.link.close()
        self.store = None

    def summary_nodes(self) -> dict | None:
        """``summary.json``'s ``nodes`` record (the topology, dead nodes, relocated batches, other nodes' producer
        deaths, node-link rejections); None with one node."""
        if self.topo is None:
            return None
        return {"nnodes": self.topo.nnodes, "node_rank": self.context.cfg.nodes.node_rank,
                "producers": self.topo.producers, "consumers": self.topo.consumers,
                "dead_nodes": sorted(self.dead_nodes),
                "relocated_batches": getattr(self.context.coordinator, "relocated", 0),
                # node 0: deaths of other nodes' producers (global index); their restarts are
                # in those nodes' summaries
                "producer_deaths_on_other_nodes": {str(k): v for k, v in
                                                   sorted(self.remote_producer_deaths.items())},
                "rejected_node_frames": self.link.rejected if self.link else 0,
                "refused_node_peers": self.link.allowed.refused if self.link and self.link.allowed
                else 0}

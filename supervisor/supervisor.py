"""The supervisor process: owns the rings, the coordinator socket and every child; runs the event loop.

``Supervisor(config).run()`` builds the batch order, creates one ring per producer, binds the ROUTER socket,
starts producers and consumers, and loops: receive control messages and hand them to the ``Coordinator``, send
what it pumps out, watch children with the ``HealthMonitor`` (reap the dead, kill the hung, restart producers
with a new generation), answer ``launch.py status``/``restart``, and keep a live progress line and the
experiment trackers of ``--report-to`` (``supervisor.reporting``) up to date. At the end (all batches trained,
a signal, or a consumer's death) consumers are asked to stop (they write a checkpoint), producers are stopped,
and everything the run created in ``/dev/shm`` and the socket file are removed; ``summary.json`` records the
outcome.

Guarantees: a producer's unpublished slots are reclaimed only after its process has been reaped; a
consumer's death ends the run with its last checkpoint kept (``--resume`` continues), and a run whose
final checkpoint was not written is never reported ``done``; rings and the socket
are removed in ``finally`` whatever happens, and a SIGKILL of the supervisor itself leaves children that
die within a second or two (parent-death signal) and segments that the next start sweeps. Nothing a child
started outlives the child's exit or the run: the child's process group is killed once it has exited, and
the supervisor, a child subreaper, kills the orphans that come back to it (``shared.procs``); after a
SIGKILL of the supervisor, the next start or ``launch.py clean`` kills them by their ``SPECRING_RUN_ID``.

No peer of the socket can stall the loop or the signal path: sends never block (a command peer whose queue
is full is dropped; the coordinator records a lease or delivery only once it was queued), operator commands are rate-limited per peer and in all
(``supervisor.peers``), at most ``MAX_FRAMES_PER_TURN`` frames are handled between two looks at the children
and the stop flag, and lines about bad peers are rate-limited. A signal only sets the stop flag.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from specring.shared.balance import ProcessBalance, run_balance
from specring.shared.config import RunConfig
from specring.shared.errors import MessageError
from specring.shared.procs import (
    RUN_ID_ENV,
    Topology,
    become_subreaper,
    kill_group,
    kill_orphans,
    parse_identity,
    peer_identity,
    spawn_child,
    sweep_run_processes,
    terminate,
)
from specring.shared.transport import channel
from specring.shared.transport import messages as m
from specring.shared.transport.ring import (
    Ring,
    check_shm_space,
    new_run_id,
    run_owned,
    segment_bytes,
    segment_name,
    sweep_stale,
)
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.monitor import Child, HealthMonitor
from specring.supervisor.peers import CommandGate, LogLimiter
from specring.supervisor.progress import Progress
from specring.supervisor.reporting import Reporter, last_metrics
from specring.supervisor.resume import checkpoint_step_on_disk, read_checkpoint_batches
from specring.supervisor.runplan import RunPlan
from specring.supervisor.status import write_status

log = logging.getLogger(__name__)

POLL_S = 0.05
STATUS_EVERY_S = 1.0
ORPHAN_REAP_S = 3.0  # at the end, how long to wait for killed orphans to be reaped
MAX_FRAMES_PER_TURN = 500  # frames handled before the loop pumps, watches children and checks for a stop
LOG_EVERY_S = 10.0  # one log line per peer and kind of rejection this often at most
SHUTDOWN_CAP_FACTOR = 5  # a consumer still heartbeating after shutdown is waited for at most this many shutdown_timeout_s


@dataclass
class Outcome:
    exit_reason: str
    exit_code: int


class Supervisor:
    """One training run. ``plan`` is the resolved ``RunPlan`` (batch order, ring sizes, target shape);
    ``trained``: on ``--resume``, the batch ids of the checkpoint resumed from when the caller has already
    read them (``None``: read from the run directory); ``updated_before``: how many of them were trained by
    steps that updated the weights (``None``: all of them).

    A run that reaches its end without a single step that updated the weights (every step skipped: no
    labels, non-finite losses) ends ``nothing_trained`` (exit 1), not ``done``."""

    def __init__(self, cfg: RunConfig, plan: RunPlan, trained: set[int] | None = None,
                 updated_before: int | None = None):
        self.cfg = cfg
        self._trained_given = trained
        self.updated_before = updated_before
        self.plan = plan
        self.run_dir = Path(cfg.run_dir)
        self.run_id = cfg.run_id or new_run_id()
        self.monitor = HealthMonitor(cfg.monitor)
        self.producers = [Child("producer", i) for i in range(len(cfg.producer.devices))]
        self.consumers = [Child("consumer", i) for i in range(len(cfg.trainer.devices))]
        self.balance = {(c.role, c.index): ProcessBalance(c.role, c.index) for c in self.producers + self.consumers}
        self.rings: list[Ring] = []
        self.stop_reason = ""
        self.signals = 0
        self.started_at = time.monotonic()
        self.tokens_trained = 0            # tokens of every step after the first (rate = steady state)
        self.first_trained_at: float | None = None
        self.last_trained_at: float | None = None
        self.last_checkpoint: dict = {}
        self.trained_at_start: set[int] = set()  # batch ids of the checkpoint a resumed run started from
        self.trained_steps: list[tuple[int, list[int]]] = []  # (optimizer step, batch ids) of each Trained
        self.consumer_error = ""
        self.rejected_frames = 0
        self.coordinator: Coordinator | None = None
        self._orphans_seen: set[int] = set()
        self.gate = CommandGate()           # operator commands: rate-limited per peer, non-readers dropped
        self.log_limiter = LogLimiter(LOG_EVERY_S)
        self.refused_commands = 0
        self.reporter: Reporter | None = None
        self._reported_step = -1
        # several nodes (supervisor.nodes): the agreed topology, the link between node supervisors, the store
        self.topo = None
        self.link = None
        self.store = None
        self.relay = None                   # node k > 0: its RelayCoordinator (also self.coordinator)
        self.node_seen: dict[int, float] = {}
        self.node_bye: set[int] = set()
        self.dead_nodes: set[int] = set()
        self.stop_from_node0 = False

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        for pid, run_id, cmd in sweep_run_processes(run_owned):
            log.warning("sweep process pid=%d run_id=%s cmd=%r reason=run_gone", pid, run_id, cmd)
        removed = sweep_stale()
        if removed:
            log.info("sweep removed=%d segments=%s", len(removed), ",".join(removed))
        self.address = channel.coordinator_address(str(self.run_dir), cfg.tcp)
        if self.address.startswith("ipc://") and os.path.exists(self.address[6:]):
            os.unlink(self.address[6:])  # a dead run's: this launcher holds RUN_DIR/.lock (claim_run_dir)
        trained: set[int] = set()
        if cfg.resume:
            if self._trained_given is not None:
                trained = set(self._trained_given)
            else:
                updated, skipped = read_checkpoint_batches(self.run_dir)
                trained, self.updated_before = updated | skipped, len(updated)
            self.trained_at_start = set(trained)
            self._checkpoint_from_disk()
            log.info("resume trained_batches=%d", len(trained))
        self.ctx = zmq.Context()
        if cfg.nodes.nnodes > 1:
            self._meet_nodes(trained)
        else:
            self.coordinator = Coordinator(self.plan.order, len(self.producers), cfg.ring.num_slots,
                                           len(self.consumers), trained=trained)
        n = len(self.producers)
        check_shm_space(n * segment_bytes(cfg.ring.num_slots, self.plan.slot_bytes), f"{n} rings")
        for i in range(n):
            ring = Ring.create(segment_name(self.run_id, f"p{i}"), cfg.ring.num_slots, self.plan.slot_bytes)
            os.chmod(os.path.join("/dev/shm", ring.name), 0o600)
            self.rings.append(ring)
        self.router = channel.bind_router(self.ctx, self.address)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        Topology(run_id=self.run_id, address=self.address, rings=[r.name for r in self.rings],
                 slot_bytes=self.plan.slot_bytes, num_slots=cfg.ring.num_slots,
                 supervisor_pid=os.getpid()).save(self.run_dir)
        self.dist_port = _free_port()
        self.reporter = Reporter(cfg.report_to, self.run_dir, self.run_id, cfg.to_dict(),
                                 start_step=self.last_checkpoint.get("step", 0) if cfg.resume else 0)
        log.info("start run_id=%s producers=%d consumers=%d planned_batches=%d slot_mib=%.1f address=%s",
                 self.run_id, n, len(self.consumers), len(self.plan.order), self.plan.slot_bytes / 2**20,
                 self.address)

    def _spawn(self, child: Child) -> None:
        module = "specring.producers.main" if child.role == "producer" else "specring.consumer.main"
        env = {RUN_ID_ENV: self.run_id}  # inherited by all it starts: the next start finds leftovers by it
        if child.role == "consumer" and self.topo is not None:
            from specring.supervisor.nodes import consumer_store_env
            env.update(consumer_store_env(self.topo, self.cfg.nodes.node_rank, child.index))
        elif child.role == "consumer":
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.dist_port),
                        "WORLD_SIZE": str(len(self.consumers)), "RANK": str(child.index)})
        generation = self.coordinator.generation(child.role, child.index)
        proc = spawn_child(module, str(self.run_dir), child.index, generation,
                           self.run_dir / "logs" / f"{child.name}.log", env=env)
        self.monitor.started(child, proc)
        log.info("spawn %s=%d pid=%d generation=%d", child.role, child.index, proc.pid, generation)

    # ------------------------------------------------------------------ messages
    def _child(self, role: str, index: int) -> Child | None:
        group = self.producers if role == "producer" else self.consumers if role == "consumer" else []
        return group[index] if isinstance(index, int) and 0 <= index < len(group) else None

    def _send(self, role: str, index: int, msg) -> bool:
        """Send to the current incarnation of a child without blocking; False when it could not be queued (the
        peer is not connected, or its queue is full). On node 0 of several nodes a child of another node (global
        ``index`` past this node's) is reached through the node link: True once the link queued it (if that
        node cannot pass it on, it says ``send_failed`` and the coordinator takes it back)."""
        if self.topo is not None and self.relay is None and self._child(role, index) is None:
            node = self.topo.nodes_of(role)[index]
            return node not in self.dead_nodes and bool(self.link.send(
                m.NodeMsg(node=0, event="child", role=role, index=index, body=m.encode(msg)), to=node))
        try:
            channel.send(self.router, msg, to=peer_identity(role, index, self.coordinator.generation(role, index)).encode())
            return True
        except zmq.ZMQError as e:
            log.warning("send_failed to=%s-%d kind=%s error=%s", role, index, msg.KIND, e)
            return False

    def _handle_safely(self, peer: bytes, msg) -> None:
        """``_handle``, but a message that trips an error is logged and counted, never fatal to the loop."""
        try:
            self._handle(peer, msg)
        except Exception as e:
            self.rejected_frames += 1
            log.error("reject kind=%s peer=%r reason=handler_error error=%s: %s", getattr(msg, "KIND", "?"), peer,
                      type(e).__name__, e)

    def _handle(self, peer: bytes, msg) -> None:
        co = self.coordinator
        sender = peer_name(peer)
        if isinstance(msg, MessageError):
            self.rejected_frames += 1
            self._warn_limited(("frame", peer), "reject frame peer=%s error=%s", sender, msg)
            return
        if isinstance(msg, m.Command):
            why = self.gate.admit(peer)
            if why:
                self.refused_commands += 1
                self._warn_limited(("command", peer), "command_refused peer=%s action=%s reason=%s", sender,
                                   msg.action, why)
                return
            self._command(peer, msg)
            return
        ident = parse_identity(peer)
        child = self._child(ident[0], ident[1]) if ident else None
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
        if co.fenced(role, child.index, peer_gen, msg.KIND) or (gen != peer_gen and co.fenced(role, child.index, gen, msg.KIND)):
            return
        if isinstance(msg, m.Hello) and (role != msg.role or child.index != msg.index):
            log.warning("reject hello peer=%s says %s-%s", sender, msg.role, msg.index)
            return
        if self.relay is not None and not isinstance(msg, m.Heartbeat):
            self.relay.up(role, child.index, msg)  # node 0 keeps the ledger; the local handling below goes on
        if isinstance(msg, m.Hello):
            self.monitor.on_hello(child)
            co.on_hello(role, msg.index, msg.generation)
            log.info("hello %s=%d pid=%d generation=%d", role, msg.index, msg.pid, msg.generation)
        elif isinstance(msg, m.Heartbeat):
            self.monitor.on_heartbeat(child, msg.stats)
            self.balance[(role, child.index)].update(peer_gen, msg.stats)
        elif isinstance(msg, m.SlotReady) and role == "producer":
            if co.on_slot_ready(msg):
                self.monitor.on_progress(child)
        elif isinstance(msg, m.BadBatch):
            co.on_bad_batch(msg, from_consumer=(role == "consumer"))
            self.monitor.on_progress(child)
        elif isinstance(msg, m.SlotReleased) and role == "consumer":
            co.on_slot_released(msg)
            self.monitor.on_progress(child)
        elif isinstance(msg, m.Trained) and role == "consumer":
            self._on_trained(msg)
            self.monitor.on_progress(child)
        elif isinstance(msg, m.Checkpointed):
            self.monitor.on_progress(child)
            self.last_checkpoint = {"step": msg.step, "path": msg.path}
            log.info("checkpoint step=%d path=%s", msg.step, msg.path)
        else:
            self.rejected_frames += 1
            log.warning("reject kind=%s peer=%s reason=unexpected_for_role", msg.KIND, sender)

    def _on_trained(self, msg: m.Trained) -> None:
        co = self.coordinator
        co.on_trained(msg)
        self.trained_steps.append((int(msg.step), [int(b) for b in msg.batch_ids]))
        if msg.consumer == 0:
            now = time.monotonic()
            if self.first_trained_at is None:
                self.first_trained_at = now  # start-up (imports, model loads) is not throughput
            else:
                self.tokens_trained += msg.num_tokens * self._world()
            self.last_trained_at = now
            self.progress.update(msg.step, msg.loss, co)

    def _world(self) -> int:
        """Consumers of the run, every node's."""
        return sum(self.topo.consumers) if self.topo is not None else len(self.consumers)

    # ------------------------------------------------------------------ several nodes
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
            log.info("restart producer=%d node=%d generation=%d", nm.index, nm.node, gen)
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
        elif isinstance(msg, m.SlotReady) and role == "producer":
            co.on_slot_ready(msg)
        elif isinstance(msg, m.BadBatch):
            co.on_bad_batch(msg, from_consumer=(role == "consumer"))
        elif isinstance(msg, m.SlotReleased) and role == "consumer":
            co.on_slot_released(msg)
        elif isinstance(msg, m.Trained) and role == "consumer":
            self._on_trained(msg)
        else:
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

    # ------------------------------------------------------------------ operator commands
    def status_rows(self) -> list[dict]:
        rows = []
        now = time.monotonic()
        for c in self.producers + self.consumers:
            row = {"role": c.role, "index": c.index, "pid": c.pid,
                   "generation": self.coordinator.generation(c.role, c.index) if self.coordinator else 1,
                   "state": c.state, "heartbeat_age_s": round(now - c.last_heartbeat, 1) if c.hello else None,
                   "tokens_per_s": c.stats.get("tokens_per_s"), "gpu_mem_bytes": c.stats.get("gpu_mem_bytes"),
                   "restarts": c.restarts, "work": c.stats.get("work"), "work_s": c.stats.get("work_s")}
            row.update(self.balance[(c.role, c.index)].live())
            row.update(self.monitor.sample(c))
            if c.role == "producer" and self.coordinator:
                row["ring"] = self.coordinator.occupancy(c.index)
            rows.append(row)
        return rows

    def _command(self, peer: bytes, cmd: m.Command) -> None:
        if cmd.action == "status":
            co = self.coordinator
            last = last_metrics(self.run_dir)
            acc_key = "per_step_acc" if self.cfg.trainer.drafter == "eagle3" else "per_slot_acc"
            data = {"rows": self.status_rows(), "run_id": self.run_id, "step": self.progress.step,
                    "trained": len(co.trained), "planned": len(co.order), "loss": co.loss_last,
                    "drafter": self.cfg.trainer.drafter, acc_key: last.get(acc_key), "acc_step": last.get("step"),
                    "balance": self._balance(steady=False)}
            reply = m.Reply(ok=True, text="", data=data)
        elif cmd.action == "restart" and cmd.role == "producer" and self._child("producer", cmd.index):
            child = self.producers[cmd.index]
            if child.alive():
                child.graceful_restart = True
                self._send("producer", cmd.index, m.Shutdown(reason="restart requested"))
                gen = self.coordinator.generation("producer", cmd.index)
                log.info("restart_requested producer=%d generation=%d", cmd.index, gen)
                reply = m.Reply(ok=True, text=f"producer {cmd.index} (generation {gen}) is restarting")
            else:
                reply = m.Reply(ok=False, text=f"producer {cmd.index} is not running (state {child.state})")
        elif cmd.action == "stop":
            self.stop_reason = self.stop_reason or "stop_requested"
            reply = m.Reply(ok=True, text="stopping: consumers will checkpoint")
        else:
            reply = m.Reply(ok=False, text=f"unknown command {cmd.action!r} {cmd.role!r} {cmd.index}")
        try:
            channel.send(self.router, reply, to=peer)
        except zmq.Again:  # its queue is full: it does not read what it asked for
            self.gate.drop(peer)
            self._warn_limited(("drop", peer), "peer_dropped peer=%s reason=not_reading drop_s=%g",
                               peer_name(peer), self.gate.drop_s)
        except zmq.ZMQError:
            pass  # gone already

    def _warn_limited(self, key, fmt: str, *args) -> None:
        """``log.warning`` at most once per ``LOG_EVERY_S`` per key (a peer's flood is not a log flood)."""
        if self.log_limiter.allow(key):
            held = self.log_limiter.held(key)
            log.warning(fmt + (f" (and {held} more like it in the last {LOG_EVERY_S:g} s)" if held else ""), *args)

    # ------------------------------------------------------------------ children
    def _kill_orphans(self) -> int:
        """Kill and reap processes that a child started and left behind (its helpers once it has exited: the
        supervisor is their subreaper); returns how many are still dying."""
        keep = {c.proc.pid for c in self.producers + self.consumers if c.proc is not None}
        killed, pending = kill_orphans(keep, self.run_id)
        for pid, cmd in killed:
            if pid not in self._orphans_seen:
                self._orphans_seen.add(pid)
                log.warning("kill_orphan pid=%d cmd=%r reason=parent_exited", pid, cmd)
        return pending

    def _exited(self, child: Child) -> None:
        """``child`` has exited (and been reaped): nothing it started may outlive it."""
        kill_group(child.proc, signal.SIGKILL)
        self._kill_orphans()

    def _watch(self) -> None:
        co = self.coordinator
        now = time.monotonic()
        for child in self.producers:
            if child.proc is not None and child.proc.poll() is not None and child.state not in ("backoff", "failed", "exited"):
                self._exited(child)
                code = child.proc.returncode
                graceful = child.graceful_restart
                old_gen = co.generation("producer", child.index)
                new_gen = co.producer_died(child.index)
                if self.stop_reason:
                    child.state = "exited"
                    continue
                delay = self.monitor.schedule_restart(child)
                if delay is None:
                    child.state = "failed"
                    self.stop_reason = f"producer_{child.index}_restart_limit"
                    log.error("give_up producer=%d restarts=%d window_s=%g", child.index, len(child.restart_times),
                              self.cfg.monitor.restart_window_s)
                    continue
                log.info("restart producer=%d exitcode=%s generation=%d old_generation=%d backoff_s=%.2f graceful=%s",
                         child.index, code, new_gen, old_gen, delay, graceful)
            elif child.state == "backoff" and now >= child.restart_at and not self.stop_reason:
                self._spawn(child)
            else:
                why = self.monitor.hung(child)
                if why:
                    log.warning("hang producer=%d pid=%d generation=%d reason=%s action=kill", child.index,
                                child.pid, co.generation("producer", child.index), why)
                    kill_group(child.proc, signal.SIGKILL)
                    child.proc.wait()  # reaped before its slots are reused (next pass sees the exit)
        for child in self.consumers:
            if child.proc is not None and child.proc.poll() is not None and child.state not in ("exited", "failed"):
                self._exited(child)
                code = child.proc.returncode
                if code == 0 and self.stop_reason:
                    child.state = "exited"
                    continue
                child.state = "failed"
                if not self.stop_reason or self.stop_reason in ("done",):
                    self.stop_reason = f"consumer_{child.index}_died"
                log.error("consumer_died consumer=%d exitcode=%s error=%s; stopping the run (resume with --resume)",
                          child.index, code, self.consumer_error or "-")
            else:
                why = self.monitor.hung(child)
                if why and not self.stop_reason:
                    log.error("hang consumer=%d pid=%d reason=%s action=stop_run", child.index, child.pid, why)
                    kill_group(child.proc, signal.SIGKILL)
                    child.proc.wait()

    # ------------------------------------------------------------------ main loop
    def run(self) -> Outcome:
        """Run to completion; always cleans up. Returns the exit reason and process exit code."""
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        if not become_subreaper():
            log.warning("subreaper=unavailable: processes that a child starts outside its process group may "
                        "outlive it")
        self.progress = Progress(total_steps=self.plan.total_steps, num_producers=len(self.producers))
        try:
            self._setup()
            for c in self.producers + self.consumers:
                self._spawn(c)
            self._loop()
            self._shutdown()
        except BaseException as e:
            self.stop_reason = f"supervisor_error: {type(e).__name__}: {e}"
            log.exception("supervisor_error")
            raise
        finally:
            self._cleanup()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            self.progress.close(self.tokens_per_s())
            try:
                self._report(final=True)
            except Exception as e:  # noqa: BLE001 - a tracker never changes the run's outcome
                log.error("report_to close failed error=%s: %s", type(e).__name__, e)
            co = self.coordinator
            if (self.stop_reason or "done") == "done" and co is not None and co.bad and not co.trained:
                self.stop_reason = "all_batches_bad"  # nothing trainable: not a success
            if (self.stop_reason or "done") == "done" and co is not None and co.trained and not co.updated_steps \
                    and not (len(self.trained_at_start) if self.updated_before is None else self.updated_before):
                self.stop_reason = "nothing_trained"
                log.error("nothing_trained steps=%d batches=%d: every optimizer step was skipped (no labels: no "
                          "sample of its batches has two adjacent loss tokens; or a non-finite loss), the weights "
                          "never changed; see the step_skipped lines in logs/consumer-0.log",
                          len(self.trained_steps), len(co.skipped))
            reason = self.stop_reason or "done"
            if self.trained_steps:
                self._checkpoint_from_disk()  # saved but its Checkpointed message was lost with the consumer
            if reason == "done" and self.trained_steps and \
                    self.last_checkpoint.get("step") != max(st for st, _ in self.trained_steps):
                reason = "final_checkpoint_missing"
                log.error("final_checkpoint_missing last_step=%d last_checkpoint=%s: the consumer stopped before "
                          "saving the last steps; --resume retrains them", max(st for st, _ in self.trained_steps),
                          self.last_checkpoint.get("step", "-"))
            outcome = Outcome(reason, 0 if reason == "done" else 130 if reason == "interrupted" else 1)
            self._write_summary(outcome)
        return outcome

    def _on_signal(self, signum, _frame) -> None:
        self.signals += 1
        if not self.stop_reason:
            self.stop_reason = "interrupted"
        log.warning("signal=%s count=%d action=%s", signal.Signals(signum).name, self.signals,
                    "graceful_stop" if self.signals == 1 else "hard_stop")

    def _loop(self) -> None:
        co = self.coordinator
        next_status = 0.0
        while not self.stop_reason:
            got = channel.recv_from(self.router, POLL_S)
            handled = 0
            while got is not None:  # bounded: a flood of frames must not keep the children unwatched
                self._handle_safely(*got)
                handled += 1
                got = channel.recv_from(self.router, 0) if handled < MAX_FRAMES_PER_TURN else None
            self._poll_nodes()
            co.pump(self._send)  # only what could be queued is recorded: nothing to roll back
            self._watch()
            if co.done:
                self.stop_reason = "done"
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                self._kill_orphans()  # e.g. a daemon that a live child's helper double-forked
                self.progress.refresh(co, self.producers, self.tokens_per_s(), self._balance(steady=False))
                write_status(self.run_dir, self.run_id, self.status_rows())
                self._report()

    def pipeline_figures(self) -> dict[str, float]:
        """The supervisor's own figures for the trackers: end-to-end tokens/s, slots of each producer's ring
        by state (``pipeline/ring{i}_ready`` ...), restarts of each producer and in all, rejected messages."""
        out = {"pipeline/tokens_per_s": self.tokens_per_s(),
               "pipeline/restarts": float(sum(p.restarts for p in self.producers))}
        for p in self.producers:
            out[f"pipeline/producer{p.index}_restarts"] = float(p.restarts)
            if self.coordinator is not None:
                for state, n in self.coordinator.occupancy(p.index).items():
                    out[f"pipeline/ring{p.index}_{state.lower()}"] = float(n)
        if self.coordinator is not None:
            out["pipeline/trained_batches"] = float(len(self.coordinator.trained))
        return out

    def _report(self, final: bool = False) -> None:
        """Send what is new to the trackers (``Reporter.refresh``); the pipeline figures once per optimizer
        step (and at the end), so that a slow run does not send the same step every second."""
        if self.reporter is None:
            return
        step = self.progress.step
        pipeline = self.pipeline_figures() if final or step != self._reported_step else None
        self._reported_step = step
        if final:
            self.reporter.close(pipeline)
        else:
            self.reporter.refresh(pipeline)

    def tokens_per_s(self) -> float:
        """Target tokens trained per second between the first and the latest optimizer step (all ranks;
        approximated as rank 0's tokens times the number of consumers)."""
        if self.first_trained_at is None or self.last_trained_at == self.first_trained_at:
            return 0.0
        return self.tokens_trained / (self.last_trained_at - self.first_trained_at)

    def _shutdown(self) -> None:
        """Ask consumers to checkpoint and exit, then stop producers.

        Consumers are waited for while they show signs of life: a consumer that has sent nothing (heartbeat,
        ``Checkpointed``, ``Trained``) for ``shutdown_timeout_s``, or whose main thread is stuck
        (``HealthMonitor.stuck``), is left to ``_cleanup`` (SIGTERM, then SIGKILL). A final checkpoint and tau evaluation that keep heartbeating may take longer, up to
        ``SHUTDOWN_CAP_FACTOR * shutdown_timeout_s`` in all. A second signal stops waiting at once.
        """
        self._stop_nodes()
        # a dead node leaves the consumers in a collective that cannot finish: nothing to wait for
        quiet_s = 0.0 if self.dead_nodes else self.cfg.monitor.shutdown_timeout_s
        start = time.monotonic()
        told: dict[int, bool] = {}
        for c in self.consumers:
            if c.alive():
                c.state = "stopping"
                told[c.index] = self._send("consumer", c.index, m.Shutdown(reason=self.stop_reason))

        def lively(c) -> bool:  # one that never said Hello has trained nothing: _cleanup terminates it
            last = max(c.last_heartbeat, c.last_progress, start)
            return c.alive() and c.hello and time.monotonic() - last < quiet_s and not self.monitor.stuck(c)

        while (any(lively(c) for c in self.consumers) and self.signals < 2
               and time.monotonic() - start < SHUTDOWN_CAP_FACTOR * quiet_s):
            for c in self.consumers:  # not connected at the first try (still starting): told once it is
                if c.alive() and c.hello and not told.get(c.index, True):
                    told[c.index] = self._send("consumer", c.index, m.Shutdown(reason=self.stop_reason))
            got = channel.recv_from(self.router, POLL_S)
            if got is not None:
                self._handle_safely(*got)
            self._poll_nodes()
        for c in self.consumers:
            if c.alive():
                log.warning("consumer=%d still running %.1fs after shutdown (quiet %.1fs); terminating", c.index,
                            time.monotonic() - start, time.monotonic() - max(c.last_heartbeat, c.last_progress))
            elif c.proc is not None and c.state == "stopping" and c.proc.returncode != 0:
                log.error("consumer_died_at_shutdown consumer=%d exitcode=%s error=%s", c.index,
                          c.proc.returncode, self.consumer_error or "-")
        for c in self.producers:
            if c.alive():
                c.state = "stopping"
                self._send("producer", c.index, m.Shutdown(reason=self.stop_reason))
        self._nodes_bye(start, quiet_s)

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

    def _cleanup(self) -> None:
        timeout = 0 if self.signals >= 2 else 5.0
        for c in self.consumers + self.producers:  # all at once: the grace period is shared, not per child
            if c.alive():
                kill_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in self.consumers + self.producers:
            if c.proc is not None:
                terminate(c.proc, max(0.0, deadline - time.monotonic()))
                if c.state not in ("failed",):
                    c.state = "exited"
        deadline = time.monotonic() + ORPHAN_REAP_S
        while self._kill_orphans() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._drain_heartbeats()
        for ring in self.rings:
            ring.close()
            ring.unlink()
        if self.link is not None:
            self.link.close()
        if getattr(self, "router", None) is not None:
            self.router.close(linger=0)
        if getattr(self, "ctx", None) is not None:
            self.ctx.term()
        self.store = None
        addr = getattr(self, "address", "")
        if addr.startswith("ipc://"):
            try:
                os.unlink(addr[6:])
            except FileNotFoundError:
                pass
        log.info("cleanup rings=%d socket=%s", len(self.rings), addr)

    def _balance(self, steady: bool) -> dict:
        """Duty cycles and starvation of the run's processes (``shared.balance.run_balance``)."""
        return run_balance([self.balance[("producer", c.index)] for c in self.producers],
                           [self.balance[("consumer", c.index)] for c in self.consumers], steady=steady)

    def _drain_heartbeats(self) -> None:
        """Take the balance figures of the heartbeats still queued once every child has exited (each child sends
        one last heartbeat as it exits, after the loop stopped reading); every other frame is dropped."""
        if getattr(self, "router", None) is None:
            return
        for _ in range(MAX_FRAMES_PER_TURN):
            got = channel.recv_from(self.router, 0)
            if got is None:
                return
            peer, msg = got
            ident = parse_identity(peer)
            if isinstance(msg, m.Heartbeat) and ident and self._child(ident[0], ident[1]) is not None \
                    and msg.role == ident[0] and msg.index == ident[1] and msg.generation == ident[2]:
                self.balance[(ident[0], ident[1])].update(ident[2], msg.stats)

    def _checkpoint_from_disk(self) -> None:
        """Take ``checkpoints/latest`` as the last checkpoint when it is newer than the last one reported."""
        step = checkpoint_step_on_disk(self.run_dir)
        if step is not None and step > self.last_checkpoint.get("step", -1):
            self.last_checkpoint = {"step": step, "path": str(self.run_dir / "checkpoints" / f"step-{step:06d}")}

    def _remaining(self, co: Coordinator) -> int:
        """Planned batches that ``--resume`` will train: neither bad nor in the last checkpoint (batches
        trained after it count: their weights were not saved)."""
        step = self.last_checkpoint.get("step")
        saved = set(self.trained_at_start)
        for st, ids in self.trained_steps:
            if step is not None and st <= step:
                saved.update(ids)
        return sum(1 for b in co.order if b not in saved and b not in co.bad)

    def _tau_last(self) -> dict | None:
        """``{"step", "tau_mean"}`` of the last record in ``eval.jsonl`` (None without one)."""
        try:
            lines = (self.run_dir / "eval.jsonl").read_text().splitlines()
            rec = json.loads(lines[-1])
            return {"step": int(rec["step"]), "tau_mean": float(rec["tau_mean"])}
        except (OSError, IndexError, ValueError, KeyError, TypeError):
            return None

    def _write_summary(self, outcome: Outcome) -> None:
        co = self.coordinator
        elapsed = time.monotonic() - self.started_at
        summary = {
            "exit_reason": outcome.exit_reason,
            "run_id": self.run_id,
            "planned_batches": len(co.order) if co else 0,
            "trained_before_resume": co.trained_before if co else 0,
            "trained_batches": len(co.trained) if co else 0,
            "duplicate_batches": co.duplicates if co else 0,
            # lost: a finished run that did not train a batch it planned (must be 0); remaining: batches a
            # stopped run has not reached yet (--resume trains them)
            "lost_batches": len(co.lost()) if co and outcome.exit_reason == "done" else 0,
            "remaining_batches": self._remaining(co) if co and outcome.exit_reason != "done" else 0,
            "bad_batches": len(co.bad) if co else 0,
            # batches of steps that updated no weight (no labels, non-finite loss); counted in trained_batches
            "skipped_batches": len(co.skipped) if co else 0,
            "updated_steps": co.updated_steps if co else 0,
            "restarts": {str(c.index): c.restarts for c in self.producers},
            "loss_first": co.loss_first if co else None,
            "loss_last": co.loss_last if co else None,
            "tokens_per_s": round(self.tokens_per_s(), 1),
            "elapsed_s": round(elapsed, 2),
            "rejected_messages": dict(co.rejected) if co else {},
            "rejected_frames": self.rejected_frames,
            "refused_commands": self.refused_commands,
            "last_checkpoint": self.last_checkpoint,
            "tau_last": self._tau_last(),
            # duty cycle of producers, starvation of consumers, capacity per process (shared.balance)
            "balance": self._balance(steady=True),
        }
        if self.topo is not None:
            summary["nodes"] = {"nnodes": self.topo.nnodes, "node_rank": self.cfg.nodes.node_rank,
                                "producers": self.topo.producers, "consumers": self.topo.consumers,
                                "dead_nodes": sorted(self.dead_nodes),
                                "relocated_batches": getattr(co, "relocated", 0),
                                "rejected_node_frames": self.link.rejected if self.link else 0,
                                "refused_node_peers": self.link.allowed.refused if self.link and self.link.allowed
                                else 0}
        p = self.run_dir / "summary.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, p)
        self.summary = summary


def peer_name(peer: bytes) -> str:
    """A peer identity for a log line: as is when printable ASCII (children, ``launch.py``), else hex (the
    random binary identity ZeroMQ gives an anonymous peer), so no log line carries raw bytes."""
    if peer and all(32 < b < 127 for b in peer):
        return peer.decode()
    return "0x" + peer.hex()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

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
are removed in ``finally`` whatever happens (a signal of ``shared.process.procs.STOP_SIGNALS``, SIGHUP included, is a
graceful stop), and a SIGKILL of the supervisor itself leaves children that
die within a second or two (parent-death signal) and segments that the next start sweeps. Nothing a child
started outlives the child's exit or the run: the child's process group is killed once it has exited, and
the supervisor, a child subreaper, kills the orphans that come back to it (``shared.process.procs``); after a
SIGKILL of the supervisor, the next start or ``launch.py clean`` kills them by their ``SPECRING_RUN_ID``.

No peer of the socket can stall the loop or the signal path: sends never block (a command peer whose queue is full is
dropped; the coordinator records a lease or delivery only once it was queued), operator commands are rate-limited per
peer and in all (``supervisor.peers``), at most ``MAX_FRAMES_PER_TURN`` frames are handled between two looks at the
children and the stop flag, and lines about bad peers are rate-limited. A signal only sets the stop flag.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

import zmq

from specring.shared.config.run_config import RunConfig
from specring.shared.process.balance import ProcessBalance
from specring.shared.process.procs import (
    RUN_ID_ENV,
    become_subreaper,
    install_stop_handlers,
    restore_handlers,
    spawn_child,
    sweep_run_processes,
)
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import Topology
from specring.shared.transport import channel
from specring.shared.transport.ring import (
    Ring,
    check_shm_space,
    new_run_id,
    run_owned,
    segment_bytes,
    segment_name,
    sweep_stale,
)
from specring.supervisor.context import MAX_FRAMES_PER_TURN, POLL_S, RunContext
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.dispatch import MessageDispatch
from specring.supervisor.lifecycle import ChildLifecycle
from specring.supervisor.monitor import Child, HealthMonitor
from specring.supervisor.node_events import NodeEvents
from specring.supervisor.progress import Progress
from specring.supervisor.records import Outcome, RunRecords
from specring.supervisor.resume import read_checkpoint_batches
from specring.supervisor.runplan import RunPlan
from specring.supervisor.status import write_status

log = logging.getLogger(__name__)

STATUS_EVERY_S = 1.0


class Supervisor:
    """One training run. ``plan`` is the resolved ``RunPlan`` (batch order, ring sizes, target shape);
    ``trained``: on ``--resume``, the batch ids of the checkpoint resumed from when the caller has already
    read them (``None``: read from the run directory); ``updated_before``: how many of them were trained by
    steps that updated the weights (``None``: all of them).

    A run that reaches its end without a single step that updated the weights (every step skipped: no
    labels, non-finite losses) ends ``nothing_trained`` (exit 1), not ``done``.

    It is built from four parts that hold their own state, one module each, and its loop calls them:
    ``dispatch`` (``supervisor.dispatch.MessageDispatch``: frames in, sends out, operator commands),
    ``lifecycle`` (``supervisor.lifecycle.ChildLifecycle``: watching, restarting and stopping children),
    ``records`` (``supervisor.records.RunRecords``: throughput, balance, trackers, time series, summary.json) and
    ``nodes`` (``supervisor.node_events.NodeEvents``: several nodes). What they share is ``context``
    (``supervisor.context.RunContext``: config, plan, run id, children, monitor, coordinator, router, progress,
    stop reason and signals). The supervisor itself owns what it sets up and removes: the rings (``rings``), the
    socket's ``address``, the ZeroMQ context (``zmq_context``) and the consumers' rendezvous port
    (``dist_port``); it spawns children (``_spawn``, handed to the lifecycle) and takes the stop signals."""
    def __init__(self, cfg: RunConfig, plan: RunPlan, trained: set[int] | None = None,
                 updated_before: int | None = None):
        self.cfg = cfg
        self._trained_given = trained
        producers = [Child("producer", i) for i in range(len(cfg.producer.devices))]
        consumers = [Child("consumer", i) for i in range(len(cfg.trainer.devices))]
        self.context = RunContext(
            cfg=cfg, plan=plan, run_dir=Path(cfg.run_dir), run_id=cfg.run_id or new_run_id(),
            monitor=HealthMonitor(cfg.monitor), producers=producers, consumers=consumers,
            balance={(c.role, c.index): ProcessBalance(c.role, c.index) for c in producers + consumers})
        self.records = RunRecords(self.context, updated_before=updated_before)
        # node 0 passes an operator's restart of this node's producer on: the same graceful restart as a local one
        self.nodes = NodeEvents(self.context, self.records,
                                restart_producer=lambda index: self.dispatch.restart_producer(index))
        self.dispatch = MessageDispatch(self.context, self.nodes, self.records)
        self.lifecycle = ChildLifecycle(self.context, self.dispatch, self.nodes, self.records, spawn=self._spawn)
        self.rings: list[Ring] = []
        self.address = ""
        self.zmq_context: zmq.Context | None = None
        self.dist_port = 0
        self._hup_seen = False              # a SIGHUP has stopped the run (another one does not escalate)

    def _setup(self) -> None:
        cfg, cx = self.cfg, self.context
        run = RunDir(cx.run_dir)
        cx.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(cx.run_dir, 0o700)
        run.logs_dir.mkdir(exist_ok=True)
        for pid, run_id, cmd in sweep_run_processes(run_owned):
            log.warning("sweep process pid=%d run_id=%s cmd=%r reason=run_gone", pid, run_id, cmd)
        removed = sweep_stale()
        if removed:
            log.info("sweep removed=%d segments=%s", len(removed), ",".join(removed))
        self.address = run.coordinator_address(cfg.tcp)
        if self.address.startswith("ipc://") and os.path.exists(self.address[6:]):
            os.unlink(self.address[6:])  # a dead run's: this launcher holds RUN_DIR/.lock (claim_run_dir)
        trained: set[int] = set()
        if cfg.resume:
            updated_before = None
            if self._trained_given is not None:
                trained = set(self._trained_given)
            else:
                updated, skipped = read_checkpoint_batches(cx.run_dir)
                trained, updated_before = updated | skipped, len(updated)
            self.records.resumed(trained, updated_before)
            log.info("resume trained_batches=%d", len(trained))
        self.zmq_context = zmq.Context()
        if cfg.nodes.nnodes > 1:
            self.nodes.meet_nodes(trained, self.zmq_context)
        else:
            cx.coordinator = Coordinator(cx.plan.order, len(cx.producers), cfg.ring.num_slots,
                                         len(cx.consumers), trained=trained)
        n = len(cx.producers)
        check_shm_space(n * segment_bytes(cfg.ring.num_slots, cx.plan.slot_bytes), f"{n} rings")
        for i in range(n):
            ring = Ring.create(segment_name(cx.run_id, f"p{i}"), cfg.ring.num_slots, cx.plan.slot_bytes)
            os.chmod(os.path.join("/dev/shm", ring.name), 0o600)
            self.rings.append(ring)
        cx.router = channel.bind_router(self.zmq_context, self.address)
        run.write_config(cfg)
        run.write_topology(Topology(run_id=cx.run_id, address=self.address, rings=[r.name for r in self.rings],
                                    slot_bytes=cx.plan.slot_bytes, num_slots=cfg.ring.num_slots,
                                    supervisor_pid=os.getpid()))
        self.records.open_timeseries()
        self.dist_port = _free_port()
        self.records.open_reporter()
        log.info("start run_id=%s producers=%d consumers=%d planned_batches=%d slot_mib=%.1f address=%s",
                 cx.run_id, n, len(cx.consumers), len(cx.plan.order), cx.plan.slot_bytes / 2**20,
                 self.address)

    def _spawn(self, child: Child) -> None:
        cx = self.context
        module = "specring.producers.main" if child.role == "producer" else "specring.consumer.main"
        env = {RUN_ID_ENV: cx.run_id}  # inherited by all it starts: the next start finds leftovers by it
        if child.role == "consumer" and self.nodes.topo is not None:
            from specring.supervisor.nodes import consumer_store_env
            env.update(consumer_store_env(self.nodes.topo, self.cfg.nodes.node_rank, child.index))
        elif child.role == "consumer":
            env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.dist_port),
                        "WORLD_SIZE": str(len(cx.consumers)), "RANK": str(child.index)})
        generation = cx.coordinator.generation(child.role, child.index)
        proc = spawn_child(module, str(cx.run_dir), child.index, generation,
                           RunDir(cx.run_dir).log_file(child.name), env=env)
        cx.monitor.started(child, proc)
        self.records.spawned()
        log.info("spawn %s=%d pid=%d generation=%d", child.role, child.index, proc.pid, generation)

    def run(self) -> Outcome:
        """Run to completion; always cleans up. Returns the exit reason and process exit code."""
        cx, records = self.context, self.records
        old_handlers = install_stop_handlers(self._on_signal)  # INT, TERM, HUP, QUIT, USR1/2, ...: a graceful stop
        if not become_subreaper():
            log.warning("subreaper=unavailable: processes that a child starts outside its process group may "
                        "outlive it")
        cx.progress = Progress(total_steps=cx.plan.total_steps, num_producers=len(cx.producers))
        try:
            self._setup()
            for c in cx.producers + cx.consumers:
                self._spawn(c)
            self._loop()
            self.lifecycle.shutdown()
        except BaseException as e:
            cx.stop_reason = f"supervisor_error: {type(e).__name__}: {e}"
            log.exception("supervisor_error")
            raise
        finally:
            self.lifecycle.cleanup(self.rings, self.address, self.zmq_context)
            records.close_timeseries()
            restore_handlers(old_handlers)
            try:
                failures = records.poll_eval_failures()
            except Exception as e:  # noqa: BLE001 - never in the way of the summary
                log.error("eval_failures unreadable error=%s: %s", type(e).__name__, e)
                failures = None
            cx.progress.close(records.tokens_per_s(), eval_failures=failures)
            try:
                records.report(final=True)
            except Exception as e:  # noqa: BLE001 - a tracker never changes the run's outcome
                log.error("report_to close failed error=%s: %s", type(e).__name__, e)
            co = cx.coordinator
            if (cx.stop_reason or "done") == "done" and co is not None and co.bad and not co.trained:
                cx.stop_reason = "all_batches_bad"  # nothing trainable: not a success
            updated_before = len(records.trained_at_start) if records.updated_before is None \
                else records.updated_before
            if (cx.stop_reason or "done") == "done" and co is not None and co.trained and not co.updated_steps \
                    and not updated_before:
                cx.stop_reason = "nothing_trained"
                log.error("nothing_trained steps=%d batches=%d: every optimizer step was skipped (no labels: no "
                          "sample of its batches has two adjacent loss tokens; or a non-finite loss), the weights "
                          "never changed; see the step_skipped lines in logs/consumer-0.log",
                          len(records.trained_steps), len(co.skipped))
            reason = cx.stop_reason or "done"
            if records.trained_steps:
                records.checkpoint_from_disk()  # saved but its Checkpointed message was lost with the consumer
            last_step = max((st for st, _ in records.trained_steps), default=None)
            if reason == "done" and records.trained_steps and records.last_checkpoint.get("step") != last_step:
                reason = "final_checkpoint_missing"
                log.error("final_checkpoint_missing last_step=%d last_checkpoint=%s: the consumer stopped before "
                          "saving the last steps; --resume retrains them", last_step,
                          records.last_checkpoint.get("step", "-"))
            outcome = Outcome(reason, 0 if reason == "done" else 130 if reason == "interrupted" else 1)
            records.write_summary(outcome, rejected_frames=self.dispatch.rejected_frames + self.nodes.rejected_frames,
                                  refused_commands=self.dispatch.refused_commands, nodes=self.nodes.summary_nodes())
        return outcome

    def _on_signal(self, signum, _frame) -> None:
        """Any of ``shared.process.procs.STOP_SIGNALS``: the first stops the run gracefully (consumers checkpoint,
        ``summary.json``, rings and socket removed), a second one of another kind hard (no waiting for checkpoints).
        A repeated SIGHUP is the same hang-up (a dropped ssh session hangs up the launcher and its shell, which
        passes it on): it never escalates."""
        cx = self.context
        if signum == signal.SIGHUP and cx.stop_reason and self._hup_seen:
            log.warning("signal=SIGHUP count=%d action=ignored (hang-up already stopping the run)", cx.signals)
            return
        self._hup_seen = self._hup_seen or signum == signal.SIGHUP
        cx.signals += 1
        if not cx.stop_reason:
            cx.stop_reason = "interrupted"
        log.warning("signal=%s count=%d action=%s", signal.Signals(signum).name, cx.signals,
                    "graceful_stop" if cx.signals == 1 else "hard_stop")

    def _loop(self) -> None:
        cx, dispatch, lifecycle, records = self.context, self.dispatch, self.lifecycle, self.records
        co = cx.coordinator
        next_status = 0.0
        while not cx.stop_reason:
            got = channel.recv_from(cx.router, POLL_S)
            handled = 0
            while got is not None:  # bounded: a flood of frames must not keep the children unwatched
                dispatch.handle_safely(*got)
                handled += 1
                got = channel.recv_from(cx.router, 0) if handled < MAX_FRAMES_PER_TURN else None
            lifecycle.credit_own_stall()
            self.nodes.poll_nodes()
            co.pump(dispatch.send)  # only what could be queued is recorded: nothing to roll back
            lifecycle.watch()
            if co.done:
                cx.stop_reason = "done"
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                lifecycle.kill_orphans()  # e.g. a daemon that a live child's helper double-forked
                cx.progress.refresh(co, cx.producers, records.tokens_per_s(), records.balance_figures(steady=False),
                                    eval_failures=records.poll_eval_failures())
                rows = dispatch.status_rows()
                write_status(cx.run_dir, cx.run_id, rows)
                records.sample_timeseries(rows)
                records.report()
        records.sample_timeseries(dispatch.status_rows(), force=True)  # the state the loop ended in


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

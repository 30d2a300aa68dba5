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
from specring.shared.run.run_records import StatusRow, Topology
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
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.dispatch import LOG_EVERY_S, MAX_FRAMES_PER_TURN, POLL_S, MessageDispatch
from specring.supervisor.lifecycle import ChildLifecycle
from specring.supervisor.monitor import Child, HealthMonitor
from specring.supervisor.node_events import NodeEvents
from specring.supervisor.peers import CommandGate, LogLimiter
from specring.supervisor.progress import Progress
from specring.supervisor.records import Outcome, RunRecords
from specring.supervisor.reporting import Reporter
from specring.supervisor.resume import read_checkpoint_batches
from specring.supervisor.runplan import RunPlan
from specring.supervisor.status import write_status
from specring.supervisor.timeseries import TimeSeries

log = logging.getLogger(__name__)

STATUS_EVERY_S = 1.0


class Supervisor(MessageDispatch, NodeEvents, ChildLifecycle, RunRecords):
    """One training run. ``plan`` is the resolved ``RunPlan`` (batch order, ring sizes, target shape);
    ``trained``: on ``--resume``, the batch ids of the checkpoint resumed from when the caller has already
    read them (``None``: read from the run directory); ``updated_before``: how many of them were trained by
    steps that updated the weights (``None``: all of them).

    A run that reaches its end without a single step that updated the weights (every step skipped: no
    labels, non-finite losses) ends ``nothing_trained`` (exit 1), not ``done``.

    This class holds the run's state, sets it up and runs the loop; its jobs live in one module each:
    ``supervisor.dispatch`` (frames in, sends out, operator commands), ``supervisor.lifecycle`` (watching,
    restarting and stopping children), ``supervisor.records`` (throughput, balance, trackers, summary.json) and
    ``supervisor.node_events`` (several nodes)."""
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
        self._hup_seen = False              # a SIGHUP has stopped the run (another one does not escalate)
        self.started_at = time.monotonic()
        self.tokens_trained = 0            # tokens of every step after the first (rate = steady state)
        self.first_trained_at: float | None = None
        self.first_spawn_at: float | None = None  # the first child's spawn (summary.json: first_step_s)
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
        self.remote_producer_deaths: dict[int, int] = {}  # node 0: global producer index -> deaths reported
        self._last_turn: float | None = None  # when the loop last turned (ChildLifecycle._credit_own_stall)
        self.eval_failures: list[dict] = []  # τ evaluations that raised (RunRecords.poll_eval_failures)

    def _setup(self) -> None:
        cfg = self.cfg
        run = RunDir(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
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
        run.write_config(cfg)
        run.write_topology(Topology(run_id=self.run_id, address=self.address, rings=[r.name for r in self.rings],
                                    slot_bytes=self.plan.slot_bytes, num_slots=cfg.ring.num_slots,
                                    supervisor_pid=os.getpid()))
        self.timeseries = TimeSeries(self.run_dir, self.run_id, resume=bool(cfg.resume), producers=n,
                                     consumers=len(self.consumers), num_slots=cfg.ring.num_slots)
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
                           RunDir(self.run_dir).log_file(child.name), env=env)
        self.monitor.started(child, proc)
        if self.first_spawn_at is None:
            self.first_spawn_at = time.monotonic()
        log.info("spawn %s=%d pid=%d generation=%d", child.role, child.index, proc.pid, generation)

    def run(self) -> Outcome:
        """Run to completion; always cleans up. Returns the exit reason and process exit code."""
        old_handlers = install_stop_handlers(self._on_signal)  # INT, TERM, HUP, QUIT, USR1/2, ...: a graceful stop
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
            if getattr(self, "timeseries", None) is not None:
                self.timeseries.close()
            restore_handlers(old_handlers)
            try:
                failures = self.poll_eval_failures()
            except Exception as e:  # noqa: BLE001 - never in the way of the summary
                log.error("eval_failures unreadable error=%s: %s", type(e).__name__, e)
                failures = None
            self.progress.close(self.tokens_per_s(), eval_failures=failures)
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
        """Any of ``shared.process.procs.STOP_SIGNALS``: the first stops the run gracefully (consumers checkpoint,
        ``summary.json``, rings and socket removed), a second one of another kind hard (no waiting for checkpoints).
        A repeated SIGHUP is the same hang-up (a dropped ssh session hangs up the launcher and its shell, which
        passes it on): it never escalates."""
        if signum == signal.SIGHUP and self.stop_reason and self._hup_seen:
            log.warning("signal=SIGHUP count=%d action=ignored (hang-up already stopping the run)", self.signals)
            return
        self._hup_seen = self._hup_seen or signum == signal.SIGHUP
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
            self._credit_own_stall()
            self._poll_nodes()
            co.pump(self._send)  # only what could be queued is recorded: nothing to roll back
            self._watch()
            if co.done:
                self.stop_reason = "done"
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                self._kill_orphans()  # e.g. a daemon that a live child's helper double-forked
                self.progress.refresh(co, self.producers, self.tokens_per_s(), self._balance(steady=False),
                                      eval_failures=self.poll_eval_failures())
                rows = self.status_rows()
                write_status(self.run_dir, self.run_id, rows)
                self._sample_timeseries(rows)
                self._report()
        self._sample_timeseries(self.status_rows(), force=True)  # the state the loop ended in

    def _sample_timeseries(self, rows: list[StatusRow], force: bool = False) -> None:
        """A sample of ``RUN_DIR/timeseries.jsonl`` (``supervisor.timeseries``, read by ``launch.py report``): the
        status ``rows`` and the run's step, loss, tokens/s, balance and trained batches and tokens."""
        self.timeseries.sample([r.to_json() for r in rows], self.progress.step, self.progress.total,
                               self.progress.loss, self.tokens_per_s(), self._balance(steady=False),
                               len(self.coordinator.trained), self.tokens_trained, force=force)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

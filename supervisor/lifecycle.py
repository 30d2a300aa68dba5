"""The supervisor's children: watching them, restarting producers, and stopping everything at the end.

``ChildLifecycle`` (a part of ``supervisor.supervisor.Supervisor``):

* ``watch`` (every turn of the loop): a producer that exited is reaped, fenced (``Coordinator.producer_died``:
  its unpublished slots are reclaimed only now) and restarted after a back-off, up to the restart limit; a hung
  one (``HealthMonitor.hung``) is killed and handled the same way at the next turn. A consumer that exited
  or hung stops the run (its last checkpoint is kept).
* ``_exited`` / ``kill_orphans``: nothing a child started outlives it: its process group is killed once it
  has exited, and the orphans that come back to the supervisor (a child subreaper) are killed.
* ``shutdown``: consumers are asked to stop (they checkpoint) and waited for while they show signs of life,
  then producers are stopped; ``cleanup`` terminates what is left and removes the rings and the socket file.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Callable

from specring.shared.process.procs import kill_group, kill_orphans, terminate
from specring.shared.transport import channel
from specring.shared.transport import messages as m
from specring.shared.transport.ring import Ring
from specring.supervisor.context import POLL_S, SHUTDOWN_CAP_FACTOR, RunContext
from specring.supervisor.dispatch import MessageDispatch
from specring.supervisor.monitor import Child
from specring.supervisor.records import RunRecords

if TYPE_CHECKING:
    from specring.supervisor.node_events import NodeEvents

log = logging.getLogger(__name__)

ORPHAN_REAP_S = 3.0  # at the end, how long to wait for killed orphans to be reaped
UNWATCHED_S = 2.0  # a turn of the loop longer than this is the supervisor's own stall (see credit_own_stall)


class ChildLifecycle:
    """Children from restart to shutdown (see the module docstring); a part of ``Supervisor``.

    Given: the ``RunContext`` (the children, ``monitor``, ``coordinator``, ``router``, ``run_id``,
    ``stop_reason``, which ``watch`` sets when a consumer dies or a producer reaches its restart limit,
    ``signals``), the ``MessageDispatch`` (sends, frames read while shutting down, ``consumer_error``), the
    ``NodeEvents`` (the other nodes told and waited for; ``dead_nodes``), the ``RunRecords`` (the trackers'
    worker, ``reporter``, is not an orphan) and ``spawn``: starts a child's next process (``Supervisor``'s, which
    gives it its environment and generation).

    Owns: the orphans already logged (one line each) and when the loop last turned (its own stalls)."""

    def __init__(self, context: RunContext, dispatch: MessageDispatch, nodes: NodeEvents, records: RunRecords,
                 spawn: Callable[[Child], None]):
        self.context = context
        self.dispatch = dispatch
        self.nodes = nodes
        self.records = records
        self.spawn = spawn
        self._orphans_seen: set[int] = set()
        self._last_turn: float | None = None  # when the loop last turned (credit_own_stall)

    def credit_own_stall(self) -> None:
        """Once per turn of the loop: if the supervisor itself did not turn for more than ``UNWATCHED_S`` (a
        blocking call, SIGSTOP, swapping), the time past ``UNWATCHED_S`` does not count against its children's
        hang clocks (``HealthMonitor.unwatched``) nor against the other nodes' silence: what they sent meanwhile
        is still queued, unread."""
        now = time.monotonic()
        last, self._last_turn = self._last_turn, now
        gap = 0.0 if last is None else now - last
        if gap <= UNWATCHED_S:
            return
        # only the excess is credited: a loop whose every turn is slow still finds a child that really hangs
        credit = gap - UNWATCHED_S
        log.warning("supervisor_stalled s=%.1f: %.1f s not counted against the children or the other nodes", gap,
                    credit)
        cx = self.context
        cx.monitor.unwatched(cx.producers + cx.consumers, credit)
        self.nodes.credit_stall(credit, now)

    def kill_orphans(self) -> int:
        """Kill and reap processes that a child started and left behind (its helpers once it has exited: the
        supervisor is their subreaper); returns how many are still dying."""
        cx = self.context
        keep = {c.proc.pid for c in cx.producers + cx.consumers if c.proc is not None}
        reporter = self.records.reporter
        if reporter is not None and reporter.pid is not None:
            keep.add(reporter.pid)  # the trackers' worker (supervisor.reporting) is waited for by the reporter
        killed, pending = kill_orphans(keep, cx.run_id)
        for pid, cmd in killed:
            if pid not in self._orphans_seen:
                self._orphans_seen.add(pid)
                log.warning("kill_orphan pid=%d cmd=%r reason=parent_exited", pid, cmd)
        return pending

    def _exited(self, child: Child) -> None:
        """``child`` has exited (and been reaped): nothing it started may outlive it."""
        kill_group(child.proc, signal.SIGKILL)
        self.kill_orphans()

    def watch(self) -> None:
        """Once per turn of the loop: reap, fence and restart producers that exited (a back-off, up to the restart
        limit), kill hung ones, and stop the run when a consumer exited or hung (see the module docstring)."""
        cx = self.context
        co = cx.coordinator
        now = time.monotonic()
        for child in cx.producers:
            if (child.proc is not None and child.proc.poll() is not None
                    and child.state not in ("backoff", "failed", "exited")):
                self._exited(child)
                code = child.proc.returncode
                graceful = child.graceful_restart
                old_gen = co.generation("producer", child.index)
                new_gen = co.producer_died(child.index)
                if cx.stop_reason:
                    child.state = "exited"
                    continue
                delay = cx.monitor.schedule_restart(child)
                if delay is None:
                    child.state = "failed"
                    cx.stop_reason = f"producer_{child.index}_restart_limit"
                    log.error("give_up producer=%d restarts=%d window_s=%g", child.index, len(child.restart_times),
                              cx.cfg.monitor.restart_window_s)
                    continue
                log.info("restart producer=%d exitcode=%s generation=%d old_generation=%d backoff_s=%.2f graceful=%s",
                         child.index, code, new_gen, old_gen, delay, graceful)
            elif child.state == "backoff" and now >= child.restart_at and not cx.stop_reason:
                self.spawn(child)
            else:
                why = cx.monitor.hung(child)
                if why:
                    log.warning("hang producer=%d pid=%d generation=%d reason=%s action=kill", child.index,
                                child.pid, co.generation("producer", child.index), why)
                    kill_group(child.proc, signal.SIGKILL)
                    child.proc.wait()  # reaped before its slots are reused (next pass sees the exit)
        for child in cx.consumers:
            if child.proc is not None and child.proc.poll() is not None and child.state not in ("exited", "failed"):
                self._exited(child)
                code = child.proc.returncode
                if code == 0 and cx.stop_reason:
                    child.state = "exited"
                    continue
                child.state = "failed"
                if not cx.stop_reason or cx.stop_reason in ("done",):
                    cx.stop_reason = f"consumer_{child.index}_died"
                log.error("consumer_died consumer=%d exitcode=%s error=%s; stopping the run (resume with --resume)",
                          child.index, code, self.dispatch.consumer_error or "-")
            else:
                why = cx.monitor.hung(child)
                if why and not cx.stop_reason:
                    log.error("hang consumer=%d pid=%d reason=%s action=stop_run", child.index, child.pid, why)
                    kill_group(child.proc, signal.SIGKILL)
                    child.proc.wait()

    def shutdown(self) -> None:
        """Ask consumers to checkpoint and exit, then stop producers.

        Consumers are waited for while they show signs of life: a consumer that has sent nothing (heartbeat,
        ``Checkpointed``, ``Trained``) for ``shutdown_timeout_s``, or whose main thread is stuck
        (``HealthMonitor.stuck``), is left to ``cleanup`` (SIGTERM, then SIGKILL). A final checkpoint and tau
        evaluation that keep heartbeating may take longer, up to ``SHUTDOWN_CAP_FACTOR * shutdown_timeout_s`` in all. A
        second signal stops waiting at once.
        """
        cx, dispatch, nodes = self.context, self.dispatch, self.nodes
        nodes.stop_nodes()
        # a dead node leaves the consumers in a collective that cannot finish: nothing to wait for
        quiet_s = 0.0 if nodes.dead_nodes else cx.cfg.monitor.shutdown_timeout_s
        start = time.monotonic()
        told: dict[int, bool] = {}
        for c in cx.consumers:
            if c.alive():
                c.state = "stopping"
                told[c.index] = dispatch.send("consumer", c.index, m.Shutdown(reason=cx.stop_reason))

        def lively(c) -> bool:  # one that never said Hello has trained nothing: cleanup terminates it
            last = max(c.last_heartbeat, c.last_progress, start)
            return c.alive() and c.hello and time.monotonic() - last < quiet_s and not cx.monitor.stuck(c)

        while (any(lively(c) for c in cx.consumers) and cx.signals < 2
               and time.monotonic() - start < SHUTDOWN_CAP_FACTOR * quiet_s):
            for c in cx.consumers:  # not connected at the first try (still starting): told once it is
                if c.alive() and c.hello and not told.get(c.index, True):
                    told[c.index] = dispatch.send("consumer", c.index, m.Shutdown(reason=cx.stop_reason))
            got = channel.recv_from(cx.router, POLL_S)
            if got is not None:
                dispatch.handle_safely(*got)
            nodes.poll_nodes()
        for c in cx.consumers:
            if c.alive():
                log.warning("consumer=%d still running %.1fs after shutdown (quiet %.1fs); terminating", c.index,
                            time.monotonic() - start, time.monotonic() - max(c.last_heartbeat, c.last_progress))
            elif c.proc is not None and c.state == "stopping" and c.proc.returncode != 0:
                log.error("consumer_died_at_shutdown consumer=%d exitcode=%s error=%s", c.index,
                          c.proc.returncode, dispatch.consumer_error or "-")
        for c in cx.producers:
            if c.alive():
                c.state = "stopping"
                dispatch.send("producer", c.index, m.Shutdown(reason=cx.stop_reason))
        nodes.nodes_bye(start, quiet_s)

    def cleanup(self, rings: list[Ring], address: str, zmq_context) -> None:
        """Terminate every child still running (SIGTERM, SIGKILL after a shared 5 s grace, none after a second
        signal), kill and reap the orphans, take the last heartbeats' figures, then remove ``rings`` (the run's
        ``Ring`` segments), close the node link, the router and ``zmq_context`` (a ``zmq.Context``, or None
        before one was made) and remove the socket file of ``address`` (``ipc://...``; empty before set-up)."""
        cx = self.context
        timeout = 0 if cx.signals >= 2 else 5.0
        for c in cx.consumers + cx.producers:  # all at once: the grace period is shared, not per child
            if c.alive():
                kill_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in cx.consumers + cx.producers:
            if c.proc is not None:
                terminate(c.proc, max(0.0, deadline - time.monotonic()))
                if c.state not in ("failed",):
                    c.state = "exited"
        deadline = time.monotonic() + ORPHAN_REAP_S
        while self.kill_orphans() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.dispatch.drain_heartbeats()
        for ring in rings:
            ring.close()
            ring.unlink()
        self.nodes.close()  # its socket first: zmq_context.term() waits for every socket of the context
        if cx.router is not None:
            cx.router.close(linger=0)
            cx.router = None
        if zmq_context is not None:
            zmq_context.term()
        addr = address
        if addr.startswith("ipc://"):
            try:
                os.unlink(addr[6:])
            except FileNotFoundError:
                pass
        log.info("cleanup rings=%d socket=%s", len(rings), addr)

"""The supervisor's children: watching them, restarting producers, and stopping everything at the end.

``ChildLifecycle`` (a part of ``supervisor.supervisor.Supervisor``):

* ``_watch`` (every turn of the loop): a producer that exited is reaped, fenced (``Coordinator.producer_died``:
  its unpublished slots are reclaimed only now) and restarted after a back-off, up to the restart limit; a hung
  one (``HealthMonitor.hung``) is killed and handled the same way at the next turn. A consumer that exited
  or hung stops the run (its last checkpoint is kept).
* ``_exited`` / ``_kill_orphans``: nothing a child started outlives it: its process group is killed once it
  has exited, and the orphans that come back to the supervisor (a child subreaper) are killed.
* ``_shutdown``: consumers are asked to stop (they checkpoint) and waited for while they show signs of life,
  then producers are stopped; ``_cleanup`` terminates what is left and removes the rings and the socket file.

State it uses on the supervisor: ``producers``/``consumers``, ``monitor``, ``coordinator``, ``rings``,
``router``, ``ctx``, ``address``, ``link``, ``stop_reason``, ``signals``, ``consumer_error``, ``run_id``.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from specring.shared.process.procs import kill_group, kill_orphans, terminate
from specring.shared.transport import channel
from specring.shared.transport import messages as m
from specring.supervisor.dispatch import POLL_S
from specring.supervisor.monitor import Child

log = logging.getLogger(__name__)

ORPHAN_REAP_S = 3.0  # at the end, how long to wait for killed orphans to be reaped
UNWATCHED_S = 2.0  # a turn of the loop longer than this is the supervisor's own stall (see _credit_own_stall)
# a consumer still heartbeating after shutdown is waited for at most this many shutdown_timeout_s
SHUTDOWN_CAP_FACTOR = 5


class ChildLifecycle:
    """Children from restart to shutdown (see the module docstring); a part of ``Supervisor``."""

    def _credit_own_stall(self) -> None:
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
        self.monitor.unwatched(self.producers + self.consumers, credit)
        for k, seen in self.node_seen.items():
            self.node_seen[k] = min(seen + credit, now)

    def _kill_orphans(self) -> int:
        """Kill and reap processes that a child started and left behind (its helpers once it has exited: the
        supervisor is their subreaper); returns how many are still dying."""
        keep = {c.proc.pid for c in self.producers + self.consumers if c.proc is not None}
        if getattr(self, "reporter", None) is not None and self.reporter.pid is not None:
            keep.add(self.reporter.pid)  # the trackers' worker (supervisor.reporting) is waited for by the reporter
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
            if (child.proc is not None and child.proc.poll() is not None
                    and child.state not in ("backoff", "failed", "exited")):
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

    def _shutdown(self) -> None:
        """Ask consumers to checkpoint and exit, then stop producers.

        Consumers are waited for while they show signs of life: a consumer that has sent nothing (heartbeat,
        ``Checkpointed``, ``Trained``) for ``shutdown_timeout_s``, or whose main thread is stuck
        (``HealthMonitor.stuck``), is left to ``_cleanup`` (SIGTERM, then SIGKILL). A final checkpoint and tau
        evaluation that keep heartbeating may take longer, up to ``SHUTDOWN_CAP_FACTOR * shutdown_timeout_s`` in all. A
        second signal stops waiting at once.
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

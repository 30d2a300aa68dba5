"""Health monitor: per-child heartbeats, psutil samples, hang detection and the restart policy.

The monitor decides; the supervisor acts. What it promises:

* A child is **hung** when, for ``hang_timeout_s``, it has sent no heartbeat *and* made no progress
  (published or trained nothing): it is stopped (SIGSTOP), stuck holding the GIL, or gone quiet; a child
  that never says Hello within ``startup_timeout_s`` is hung too.
* Heartbeats come from a thread of the child's own (``shared.process.procs.ChildContext``), so they go on while the
  main thread works; each says what the main thread is doing (``work``) and for how long (``work_s``). A
  child is also hung when its main thread has been on one piece of work (a batch, a checkpoint, one eval
  prompt) for more than ``batch_timeout_s`` (a deadlocked forward: the heartbeat thread is fine, the batch
  never ends), or, idle, has not turned its loop for ``hang_timeout_s``. A batch slower than
  ``hang_timeout_s`` is therefore not a hang; one slower than ``batch_timeout_s`` is.
* A hung child is killed (whole process group) and reaped before anything it owned is reused.
* A producer that died or was killed for hanging is restarted after an exponential back-off
  (``backoff_base_s · 2^(k−1)``, capped at ``backoff_max_s``, k = restarts in the window), unless it has
  already been restarted ``max_restarts`` times within ``restart_window_s``; then the run stops.
* Samples (CPU %, RSS, threads) come from psutil for every live child; GPU memory comes from the child's
  own heartbeat stats (``gpu_mem_bytes``).
"""

from __future__ import annotations

import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import psutil

from specring.shared.config.run_config import MonitorConfig
from specring.shared.transport.stats import ChildStats, parse_stats


@dataclass
class Child:
    """One child process slot (the process itself changes across restarts)."""
    role: str
    index: int
    proc: subprocess.Popen | None = None
    state: str = "new"             # new | starting | running | backoff | stopping | exited | failed
    started_at: float = 0.0
    last_heartbeat: float = 0.0
    last_progress: float = 0.0
    hello: bool = False
    stats: dict = field(default_factory=dict)  # the latest value of each figure its heartbeats sent (wire map)
    restart_times: deque = field(default_factory=deque)
    restart_at: float = 0.0
    restarts: int = 0
    graceful_restart: bool = False
    _ps: psutil.Process | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def figures(self) -> ChildStats:
        """``stats`` typed for the role (``shared.transport.stats``: ``ProducerStats``/``ConsumerStats``; a figure
        never sent, or sent with the wrong type, is None)."""
        return parse_stats(self.role, self.stats)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class HealthMonitor:
    """Tracks children and answers: who is hung, may this one restart, after how long."""

    def __init__(self, cfg: MonitorConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock

    def started(self, child: Child, proc: subprocess.Popen) -> None:
        now = self.clock()
        child.proc, child.state, child.started_at = proc, "starting", now
        child.last_heartbeat = child.last_progress = now
        child.hello, child.stats, child._ps = False, {}, None
        child.graceful_restart = False

    def on_hello(self, child: Child) -> None:
        child.hello, child.state, child.last_heartbeat = True, "running", self.clock()

    def on_heartbeat(self, child: Child, stats: dict | ChildStats) -> None:
        """A heartbeat of ``child`` with its figures (``Heartbeat.stats``, or typed): each figure it reports replaces
        the one kept in ``child.stats``; the others are kept."""
        child.last_heartbeat = self.clock()
        child.stats.update(stats.to_wire() if isinstance(stats, ChildStats) else stats)

    def on_progress(self, child: Child) -> None:
        child.last_progress = self.clock()

    def unwatched(self, children, gap_s: float) -> None:
        """The supervisor did not read its socket for ``gap_s`` seconds (its own stall: a blocking call, a
        SIGSTOP, swapping): the children's heartbeats of that time are still queued, so their clocks are moved
        forward by ``gap_s`` (never past now) and that time does not count against them as a hang."""
        now = self.clock()
        for c in children:
            c.started_at = min(c.started_at + gap_s, now)
            c.last_heartbeat = min(c.last_heartbeat + gap_s, now)
            c.last_progress = min(c.last_progress + gap_s, now)

    def hung(self, child: Child) -> str:
        """Why ``child`` counts as hung ("" if it does not)."""
        if not child.alive() or child.state in ("stopping",):
            return ""
        now = self.clock()
        if not child.hello:
            if now - child.started_at > self.cfg.startup_timeout_s:
                return f"no hello within startup_timeout_s={self.cfg.startup_timeout_s:g}"
            return ""
        quiet = now - max(child.last_heartbeat, child.last_progress)
        if quiet > self.cfg.hang_timeout_s:
            return f"no heartbeat or progress for {quiet:.1f}s > hang_timeout_s={self.cfg.hang_timeout_s:g}"
        return self.stuck(child)

    def stuck(self, child: Child) -> str:
        """Why ``child``'s main thread counts as stuck although its heartbeats go on ("" if it does not): on
        one piece of work longer than ``batch_timeout_s``, or idle without turning its loop for longer than
        ``hang_timeout_s``, as of its last heartbeat plus the time since (see the module docstring)."""
        figures = child.figures
        work_s = figures.work_s
        if work_s is None or child.last_progress > child.last_heartbeat:
            return ""  # an older child without these figures, or progress since the figures were sent
        now = self.clock()
        busy_s = work_s + now - child.last_heartbeat
        what = figures.work or ""
        if what and busy_s > self.cfg.batch_timeout_s:
            return f"busy with {str(what)[:80]} for {busy_s:.1f}s > batch_timeout_s={self.cfg.batch_timeout_s:g}"
        if not what and busy_s > self.cfg.hang_timeout_s:
            return f"main loop has not turned for {busy_s:.1f}s > hang_timeout_s={self.cfg.hang_timeout_s:g}"
        return ""

    def schedule_restart(self, child: Child) -> float | None:
        """Record a restart of ``child``; returns the back-off delay in seconds, or None if over the cap."""
        now = self.clock()
        while child.restart_times and now - child.restart_times[0] > self.cfg.restart_window_s:
            child.restart_times.popleft()
        if len(child.restart_times) >= self.cfg.max_restarts:
            return None
        child.restart_times.append(now)
        child.restarts += 1
        k = len(child.restart_times)
        delay = 0.0 if child.graceful_restart else min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2 ** (k - 1))
        child.restart_at = now + delay
        child.state = "backoff"
        return delay

    def sample(self, child: Child) -> dict:
        """psutil figures for a live child: ``cpu_percent``, ``rss_bytes``, ``threads`` (empty if gone)."""
        if not child.alive():
            return {}
        try:
            if child._ps is None or child._ps.pid != child.pid:
                child._ps = psutil.Process(child.pid)
                child._ps.cpu_percent(None)
            with child._ps.oneshot():
                return {"cpu_percent": child._ps.cpu_percent(None), "rss_bytes": child._ps.memory_info().rss,
                        "threads": child._ps.num_threads()}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return {}

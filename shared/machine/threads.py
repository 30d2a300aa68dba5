"""Host threads by role: how many torch intra-op and inter-op threads each process of a run takes.

A CPU run puts every producer and consumer (and the τ evaluator) on the same cores. Dividing the cores evenly
(``cores // processes``, the rule before this module) gave the consumer, the bottleneck of a CPU run at the
documented shapes, one core of two while a producer busy 8 % of the time held the other
(``pipeline_vs_inprocess=0.62``, docs/performance.md). The rule now, for a process whose device is the CPU:

* a **producer**: 1 intra-op and 1 inter-op thread. Its forward is the cheap side of the pipeline (the target
  runs once per batch, the drafter trains on many anchors of it) and it waits for a free slot the rest of the
  time: a second thread would mostly spin.
* a **consumer**: up to every core the process may run on, divided among the CPU consumers of the run (all of
  them for the one consumer of the default topology), chosen by measurement (``ThreadTuner``): a trainer whose
  producers are mostly waiting (1 producer at the documented shapes) trains faster on both cores, but one that
  shares them with busy producers, or with other work on the machine, can train several times slower on two
  threads than on one (an OpenMP team waits at every barrier for its thread that the scheduler put aside: 230
  against 980 tokens/s measured with the load average at 8 on 2 cores). So the consumer times its steps on each
  candidate, keeps the faster, and measures again from time to time.
* the **τ evaluator** (``consumer.tau_worker``): 1 and 1. It runs while training goes on and takes at most one
  core's share, only while it evaluates; it is not niced, so that the final evaluation, which a finished run waits
  for, is not starved by other work on the machine.

A process whose device is a GPU keeps ``cores // processes`` intra-op threads (its host threads only feed the
device), as before. ``apply`` sets the numbers; the inter-op pool can be sized only before torch first uses it,
so each process calls ``apply`` at the start of its body.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "tau")
REJECT_FACTOR = 1.3  # a candidate this much slower per unit of work on its first step is dropped from the round


@dataclass(frozen=True)
class ThreadPlan:
    """Host threads of one process: ``intra`` (``torch.set_num_threads``), ``interop``
    (``torch.set_num_interop_threads``; None: torch's default) and ``nice`` (added to the process's niceness)."""
    intra: int
    interop: int | None = None
    nice: int = 0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity mask where the platform has one, else
    ``os.cpu_count()``); at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def plan_threads(role: str, device_type: str, producer_devices: list[str], consumer_devices: list[str],
                 cores: int | None = None) -> ThreadPlan:
    """The ``ThreadPlan`` of a process of ``role`` (``producer``, ``consumer`` or ``tau``) whose device is of
    ``device_type`` (``cpu``, ``cuda``, ...), in a run with these producer and consumer device lists (a split
    producer's group is one entry, ``cpu+cpu``); ``cores`` defaults to ``usable_cores()``. See the module
    docstring for the rule. Raises ``ValueError`` for an unknown role."""
    if role not in ROLES:
        raise ValueError(f"role: one of {ROLES}, got {role!r}")
    cores = max(1, int(cores if cores is not None else usable_cores()))
    if device_type != "cpu":
        return ThreadPlan(intra=max(1, cores // max(1, len(producer_devices) + len(consumer_devices))))
    if role == "producer":
        return ThreadPlan(intra=1, interop=1)
    if role == "tau":
        return ThreadPlan(intra=1, interop=1)
    cpu_consumers = sum(1 for d in consumer_devices if str(d).split(":")[0] == "cpu")
    return ThreadPlan(intra=max(1, cores // max(1, cpu_consumers)))


def apply(plan: ThreadPlan, role: str = "") -> ThreadPlan:
    """Set this process's torch threads and niceness to ``plan`` (an inter-op pool torch has already started is
    left as it is, with a log line); returns ``plan``. Logs ``threads role=... intra=... interop=... nice=...``."""
    import torch

    torch.set_num_threads(plan.intra)
    if plan.interop is not None and torch.get_num_interop_threads() != plan.interop:
        try:
            torch.set_num_interop_threads(plan.interop)
        except RuntimeError as e:  # the pool is already running: too late for this process
            log.warning("threads interop=%d not set: %s", plan.interop, e)
    if plan.nice:
        try:
            os.nice(plan.nice)
        except OSError as e:
            log.warning("threads nice=%d not set: %s", plan.nice, e)
    log.info("threads role=%s intra=%d interop=%s nice=%d cores=%d", role or "-", plan.intra,
             plan.interop if plan.interop is not None else "default", plan.nice, usable_cores())
    return plan


class ThreadTuner:
    """Picks a CPU consumer's intra-op thread count by timing its training steps (see the module docstring).

    ``candidates``: the thread counts to choose from (e.g. ``[2, 1]``; one candidate: nothing to tune); it starts on
    the smallest (``current``: the caller sets it first), which is never the disaster that too many threads on a
    busy machine are. Each round first scouts: every candidate, smallest first, gets one step, and a candidate
    ``REJECT_FACTOR`` slower per unit of work than the fastest scouted one is out of the round (on a busy machine
    two threads can be 5x slower, on a quiet one one thread 1.7x slower: every step spent finding out is lost, so
    a clear difference costs one step of the loser). When more than one is left, each of them is measured until
    it has ``probe_steps`` steps, and the one with the least seconds per unit of work (median) is kept. The next
    round comes ``hold_steps`` steps later, four times as late each time the same candidate wins again (at most
    ``max_hold_steps``), ``hold_steps`` after a change. The first round starts at the first ``record``.
    ``record(seconds, work)`` after each step (``seconds`` of compute, ``work`` e.g. its tokens; both > 0) returns
    the thread count to set now, or None to keep the current one.
    """

    def __init__(self, candidates: list[int], probe_steps: int = 3, hold_steps: int = 50, max_hold_steps: int = 800):
        self.candidates = sorted({max(1, int(c)) for c in candidates})
        self.probe_steps, self.base_hold, self.max_hold = int(probe_steps), int(hold_steps), int(max_hold_steps)
        self.current = self.candidates[0]
        self.best: int | None = None
        self.hold = self.base_hold
        self.hold_left = 0
        self.round: list[int] = list(self.candidates)
        self.samples: dict[int, list[float]] = {}
        self.rounds = 0
        self.last: dict[int, float] = {}  # seconds per unit of work of each candidate in the last round

    @property
    def active(self) -> bool:
        """True when there is something to choose."""
        return len(self.candidates) > 1

    def record(self, seconds: float, work: float) -> int | None:
        """One step took ``seconds`` for ``work``; returns the thread count to switch to now, or None."""
        if not self.active or seconds <= 0 or work <= 0:
            return None
        if self.hold_left > 0:
            self.hold_left -= 1
            if self.hold_left > 0:
                return None
            self.round, self.samples = list(self.candidates), {}
            return self._switch(self.round[0])
        self.samples.setdefault(self.current, []).append(seconds / work)
        unscouted = [c for c in self.round if c not in self.samples]
        if unscouted:
            return self._switch(unscouted[0])
        fastest = min(v[0] for v in self.samples.values())
        self.round = [c for c in self.round if self.samples[c][0] <= REJECT_FACTOR * fastest]
        if self.current in self.round and len(self.round) > 1 and len(self.samples[self.current]) < self.probe_steps:
            return None
        short = [c for c in self.round if len(self.samples[c]) < self.probe_steps] if len(self.round) > 1 else []
        if short:
            return self._switch(short[0])
        self.last = {c: sorted(v)[len(v) // 2] for c, v in self.samples.items()}  # the scouted-out ones too (log)
        best = min(self.round, key=self.last.get)
        self.hold = min(4 * self.hold, self.max_hold) if best == self.best else self.base_hold
        self.best, self.hold_left, self.rounds = best, self.hold, self.rounds + 1
        log.info("threads_tuned intra=%d round=%d s_per_kwork=%s next_round_in_steps=%d", best, self.rounds,
                 ",".join(f"{c}:{1000 * v:.3f}" for c, v in sorted(self.last.items())), self.hold)
        return self._switch(best) if best != self.current else None

    def _switch(self, n: int) -> int | None:
        if n == self.current:
            return None
        self.current = n
        return n

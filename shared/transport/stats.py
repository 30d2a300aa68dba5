"""Heartbeat statistics: the typed figures a child sends in ``Heartbeat.stats``, one dataclass per role.

``ChildStats`` holds the figures every child sends (``shared.process.procs.ChildContext`` adds them to each heartbeat):
what the main thread is doing and for how long (``work``, ``work_s``) and the balance figures (``busy_s``,
``window_s``, ``idle_tail_s``; ``shared.process.balance``). ``ProducerStats`` and ``ConsumerStats`` add each role's own
(``producers.main``, ``consumer.main``). Every field is optional: None means "not reported".

On the wire the figures stay a flat msgpack map inside ``Heartbeat`` (``shared.transport.messages``), so readers
and writers of any version agree without a schema version: ``to_wire`` writes the reported fields (the role's
first, then the common ones, in declaration order: the order children always sent them), ``from_wire`` ignores
keys it does not know and reads a missing key, or one whose value has the wrong type (a bool, a string where a
number belongs, ...), as not reported. Units: seconds (``*_s``), tokens per second, bytes (``*_bytes``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping


@dataclass(frozen=True)
class ChildStats:
    """The figures every child's heartbeat carries (None: not reported).

    * ``stats_error`` str: the role's figures could not be computed (their exception, instead of them);
    * ``work`` str: what the main thread is doing (``"batch 17"``; ``""`` idle); ``work_s`` float: for how long,
      seconds (idle: since its loop last turned);
    * ``busy_s`` float: seconds busy since the first piece of work; ``window_s`` float: seconds since its start;
      ``idle_tail_s`` float: seconds idle since the last piece of work ended (``shared.process.balance.DutyClock``).
    """

    #: the fields of this class, which every child sends (after its role's own on the wire)
    COMMON: ClassVar[tuple[str, ...]] = ("stats_error", "work", "work_s", "busy_s", "window_s", "idle_tail_s")

    stats_error: str | None = None
    work: str | None = None
    work_s: float | None = None
    busy_s: float | None = None
    window_s: float | None = None
    idle_tail_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        """The flat map for ``Heartbeat.stats``: ``{name: value}`` of the reported (not None) fields, the role's own
        first, then ``COMMON``."""
        own = [f.name for f in dataclasses.fields(self) if f.name not in self.COMMON]
        out = {}
        for name in (*own, *self.COMMON):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> "ChildStats":
        """The figures of a ``Heartbeat.stats`` map: keys this class does not know are ignored; a missing key, or a
        value of the wrong type (an int for a float is fine and read as a float), is None. Never raises for a
        mapping; a ``ChildStats`` of this class is returned as it is."""
        if isinstance(wire, cls):
            return wire
        if isinstance(wire, ChildStats):
            wire = wire.to_wire()
        out = {}
        for name, kind in _field_kinds(cls).items():
            value = wire.get(name)
            if isinstance(value, bool):
                continue
            if kind is float and isinstance(value, (int, float)):
                out[name] = float(value)
            elif kind is not float and isinstance(value, kind):
                out[name] = value
        return cls(**out)


@dataclass(frozen=True)
class ProducerStats(ChildStats):
    """A producer's heartbeat figures (``producers.main``), besides ``ChildStats``'s (None: not reported).

    ``tokens_per_s`` float: real tokens published per second over the last ~10 s; ``batches`` int: published;
    ``bad_batches`` int: answered with ``BadBatch``; ``tokens`` int: real tokens published; ``gpu_mem_bytes`` and
    ``gpu_mem_reserved_bytes`` int: allocated and reserved CUDA memory, summed over a split target's devices (0
    without CUDA); ``current_batch`` int: the batch in the forward (-1 when idle). Counts are since the process
    started.
    """
    tokens_per_s: float | None = None
    batches: int | None = None
    bad_batches: int | None = None
    tokens: int | None = None
    gpu_mem_bytes: int | None = None
    gpu_mem_reserved_bytes: int | None = None
    current_batch: int | None = None


@dataclass(frozen=True)
class ConsumerStats(ChildStats):
    """A consumer's heartbeat figures (``consumer.main``), besides ``ChildStats``'s (None: not reported).

    ``tokens_per_s`` float: target tokens trained per second since the process started; ``step`` int: optimizer
    steps taken; ``tokens`` int: target tokens this rank trained; ``gpu_mem_bytes`` int: allocated CUDA memory (not
    reported on CPU); ``tau_eval`` str: what the τ evaluator is doing (``consumer.tau_worker``; ``""`` idle; not
    reported without one).
    """
    tokens_per_s: float | None = None
    step: int | None = None
    tokens: int | None = None
    gpu_mem_bytes: int | None = None
    tau_eval: str | None = None


#: the figures of each child role
STATS_BY_ROLE: dict[str, type[ChildStats]] = {"producer": ProducerStats, "consumer": ConsumerStats}


def stats_class(role: str) -> type[ChildStats]:
    """The figures class of a child role (``ChildStats`` for a role that sends only the common figures)."""
    return STATS_BY_ROLE.get(role, ChildStats)


def parse_stats(role: str, wire: Mapping[str, Any] | ChildStats) -> ChildStats:
    """The figures of a heartbeat from a ``role`` child, typed: ``stats_class(role).from_wire(wire)``."""
    return stats_class(role).from_wire(wire)


def _field_kinds(cls: type[ChildStats]) -> dict[str, type]:
    """``{field: its type without None}`` of a stats class (cached on the class)."""
    cached = cls.__dict__.get("_specring_field_kinds")
    if cached is None:
        hints = typing.get_type_hints(cls)
        cached = {}
        for f in dataclasses.fields(cls):
            kinds = [k for k in typing.get_args(hints[f.name]) if k is not type(None)]
            cached[f.name] = kinds[0]
        setattr(cls, "_specring_field_kinds", cached)
    return cached

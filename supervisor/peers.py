"""Who may take the coordinator's time: admission of operator commands, and bounded logging of bad peers.

Anything that can open ``RUN_DIR/coord.sock`` can send frames; none of it may stall the supervisor's loop.
The supervisor never blocks on a send (``shared.transport.channel``); these classes bound the rest. Both are pure
logic with an injectable clock, no sockets.

``CommandGate`` promises: a peer gets at most ``burst`` commands at once and ``rate_per_s`` per second
after that (token bucket), all peers together at most ``total_burst`` / ``total_rate_per_s``; a peer that was
dropped (its answers could not be queued: it does not read) is refused for ``drop_s`` seconds; at most
``max_peers`` peers are remembered (the least recently seen are forgotten first). It does not promise that
an admitted command's answer arrives (the peer may not read it).

``LogLimiter`` lets one line per key through every ``interval_s`` and counts what it held back, so a flood
of bad frames cannot turn into a flood of log lines (a stderr pipe nobody reads would block the loop).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable


@dataclass
class _Bucket:
    tokens: float
    at: float


class _TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, now: float):
        self.rate_per_s, self.burst = rate_per_s, burst
        self.b = _Bucket(burst, now)

    def take(self, now: float) -> bool:
        b = self.b
        b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate_per_s)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return True
        return False


class CommandGate:
    """Admission of commands per peer identity (see the module docstring). Raises ``ValueError`` naming the
    argument for non-positive rates or sizes."""

    def __init__(self, *, rate_per_s: float = 5.0, burst: int = 10, total_rate_per_s: float = 50.0,
                 total_burst: int = 100, drop_s: float = 60.0, max_peers: int = 1024,
                 clock: Callable[[], float] = time.monotonic):
        for name, value in (("rate_per_s", rate_per_s), ("burst", burst), ("total_rate_per_s", total_rate_per_s),
                            ("total_burst", total_burst), ("drop_s", drop_s), ("max_peers", max_peers)):
            if value <= 0:
                raise ValueError(f"CommandGate: {name} must be > 0, got {value}")
        self.rate_per_s, self.burst, self.drop_s, self.max_peers = rate_per_s, burst, drop_s, max_peers
        self.clock = clock
        self._total = _TokenBucket(total_rate_per_s, total_burst, clock())
        self._peers: OrderedDict[bytes, _TokenBucket] = OrderedDict()
        self._dropped: OrderedDict[bytes, float] = OrderedDict()   # peer -> refused until (clock time)

    def admit(self, peer: bytes) -> str:
        """``""`` if ``peer``'s command may be served now, else why not: ``dropped``, ``peer_rate`` or
        ``total_rate``."""
        now = self.clock()
        until = self._dropped.get(peer)
        if until is not None:
            if now < until:
                return "dropped"
            del self._dropped[peer]
        bucket = self._peers.pop(peer, None) or _TokenBucket(self.rate_per_s, self.burst, now)
        self._peers[peer] = bucket  # most recently seen last
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        if not bucket.take(now):
            return "peer_rate"
        if not self._total.take(now):
            return "total_rate"
        return ""

    def drop(self, peer: bytes) -> None:
        """Refuse ``peer`` for ``drop_s`` seconds (its answer could not be queued)."""
        self._dropped.pop(peer, None)
        self._dropped[peer] = self.clock() + self.drop_s
        while len(self._dropped) > self.max_peers:
            self._dropped.popitem(last=False)


class LogLimiter:
    """``allow(key)`` is True at most once per ``interval_s`` per key; ``held(key)`` counts the Falses since
    the last True (reset by it). At most ``max_keys`` keys are remembered."""

    def __init__(self, interval_s: float = 10.0, max_keys: int = 1024, clock: Callable[[], float] = time.monotonic):
        if interval_s < 0 or max_keys < 1:
            raise ValueError(f"LogLimiter: interval_s must be >= 0 and max_keys >= 1, got {interval_s}, {max_keys}")
        self.interval_s, self.max_keys, self.clock = interval_s, max_keys, clock
        self._last: OrderedDict[Hashable, float] = OrderedDict()
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last.pop(key, None)
        self._last[key] = now
        while len(self._last) > self.max_keys:
            old, _ = self._last.popitem(last=False)
            self._held.pop(old, None)
        return True

    def held(self, key: Hashable) -> int:
        """How many lines of ``key`` were held back since the last one let through; resets the count."""
        return self._held.pop(key, 0)

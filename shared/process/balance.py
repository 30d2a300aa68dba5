"""Balance of a run: how much of its time each process works, and which producer:consumer ratio balances a shape.

**In the processes** (``DutyClock``, kept by ``shared.process.procs.ChildContext``): a child's main thread is *busy*
while it is inside an outermost ``ctx.working()`` block (a producer: forward + capture + slot write +
publish; a consumer: copy-in + training step, and its checkpoints and evaluations) and *idle* otherwise (a
producer waiting for a lease, i.e. for a free slot; a consumer waiting for a delivered slot). The window is
measured from the start of the child's first piece of work: the wait before it (the other side loading its
model) is start-up, not imbalance. Each heartbeat carries, in its ``stats`` map:

* ``busy_s``: seconds busy since the first piece of work (the current piece included, up to now);
* ``window_s``: seconds from the start of the first piece of work to now (0 before any work);
* ``idle_tail_s``: seconds idle since the last piece of work ended (0 while busy).

These are plain numbers in ``Heartbeat.stats`` (a flat map the schema already allows), so older children
without them still validate; the supervisor then shows ``-``.

**In the supervisor** (``ProcessBalance``): per child, the latest figures of each generation are kept;
``duty_cycle = busy / window`` (producers) and ``starvation = 1 - busy / window`` (consumers). Live figures
(``launch.py status``) use the whole window up to now; the run's figures (``summary.json``) leave out each
incarnation's idle tail (the end-of-data drain, waiting for Shutdown), so they describe the steady state.
A process's *capacity* is ``tokens / busy_s``: what it would deliver (producer) or take (consumer) if it were
never idle. That is what ``launch.py train --plan`` reads back from a previous run's ``summary.json``
(``advise``) to state the producer:consumer ratio that balances a target, drafter and anchors.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from specring.shared.run.run_dir import SUMMARY_FILE, RunDir
from specring.shared.transport.stats import ChildStats, parse_stats

BALANCE_KEYS = ("busy_s", "window_s", "idle_tail_s")


class DutyClock:
    """Busy time of one process's main thread since its first piece of work (see the module docstring).

    ``start()``/``stop()`` mark the outermost piece of work (nesting is counted: only the outermost pair
    moves the clock); ``figures()`` may be called from another thread (the heartbeat's). Times are
    ``clock()`` seconds (monotonic by default)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._depth = 0
        self._first: float | None = None      # start of the first piece of work
        self._since: float | None = None      # start of the current outermost piece of work
        self._last_end: float | None = None
        self._busy = 0.0

    def start(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                now = self.clock()
                self._since = now
                if self._first is None:
                    self._first = now

    def stop(self) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0 and self._since is not None:
                now = self.clock()
                self._busy += now - self._since
                self._since, self._last_end = None, now

    def figures(self) -> dict[str, float]:
        """``{"busy_s", "window_s", "idle_tail_s"}`` as of now (all 0 before the first piece of work)."""
        with self._lock:
            if self._first is None:
                return {k: 0.0 for k in BALANCE_KEYS}
            now = self.clock()
            busy = self._busy + (now - self._since if self._since is not None else 0.0)
            tail = 0.0 if self._since is not None or self._last_end is None else now - self._last_end
            return {"busy_s": round(busy, 4), "window_s": round(now - self._first, 4), "idle_tail_s": round(tail, 4)}


def _number(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return None
    return float(x)


@dataclass
class ProcessBalance:
    """The balance figures of one child slot (producer or consumer ``index``), over all its generations.

    ``update(generation, stats)`` takes a heartbeat's figures (``Heartbeat.stats``, read as the role's
    ``shared.transport.stats`` class, or that class itself; figures missing or not finite non-negative numbers are
    ignored: an older child, a bad peer); ``tokens`` is the role's tokens figure when reported."""
    role: str
    index: int
    by_generation: dict[int, dict[str, float]] = field(default_factory=dict)

    def update(self, generation: int, stats: dict | ChildStats) -> None:
        f = parse_stats(self.role, stats)
        vals = {"busy_s": _number(f.busy_s), "window_s": _number(f.window_s), "idle_tail_s": _number(f.idle_tail_s),
                "tokens": _number(getattr(f, "tokens", None))}  # ProducerStats and ConsumerStats have tokens
        if any(vals[k] is None for k in BALANCE_KEYS):
            return
        rec = {k: v for k, v in vals.items() if v is not None}
        rec["busy_s"] = min(rec["busy_s"], rec["window_s"])
        rec["idle_tail_s"] = min(rec["idle_tail_s"], rec["window_s"] - rec["busy_s"])
        self.by_generation[int(generation)] = rec

    def totals(self, steady: bool) -> tuple[float, float, float | None]:
        """``(busy_s, window_s, tokens)`` summed over generations; ``steady`` leaves out the idle tails.
        ``tokens`` is None when a generation did not report it."""
        busy = window = 0.0
        tokens: float | None = 0.0
        for rec in self.by_generation.values():
            busy += rec["busy_s"]
            window += rec["window_s"] - (rec["idle_tail_s"] if steady else 0.0)
            tokens = None if tokens is None or "tokens" not in rec else tokens + rec["tokens"]
        return busy, window, tokens

    def busy_fraction(self, steady: bool) -> float | None:
        """``busy / window`` in [0, 1] (None before any work)."""
        busy, window, _ = self.totals(steady)
        return None if window <= 0 else max(0.0, min(1.0, busy / window))

    def live(self) -> dict:
        """The figures for a status row: ``duty_cycle`` (producer) or ``starvation`` (consumer), whole window."""
        f = self.busy_fraction(steady=False)
        if self.role == "producer":
            return {"duty_cycle": None if f is None else round(f, 3)}
        return {"starvation": None if f is None else round(1.0 - f, 3)}

    def summary(self, steady: bool = True) -> dict:
        """The figures of this process for ``summary.json`` (``steady``: idle tails left out)."""
        busy, window, tokens = self.totals(steady)
        f = self.busy_fraction(steady)
        out = {"busy_s": round(busy, 3), "window_s": round(window, 3), "tokens": tokens,
               "tokens_per_busy_s": round(tokens / busy, 1) if tokens is not None and busy > 0 else None}
        if self.role == "producer":
            out["duty_cycle"] = None if f is None else round(f, 4)
        else:
            out["starvation"] = None if f is None else round(1.0 - f, 4)
        return out


def run_balance(producers: Iterable[ProcessBalance], consumers: Iterable[ProcessBalance],
                steady: bool = True) -> dict:
    """The ``balance`` section of ``summary.json``: per process (``producers``/``consumers``, keyed by index)
    and the run's overall ``producer_duty_cycle`` and ``consumer_starvation`` (busy time over window time
    summed over the processes of a side), and the mean capacity of one process of each side
    (``producer_tokens_per_busy_s``, ``consumer_tokens_per_busy_s``; None without figures). ``steady``
    False: the live figures of ``launch.py status`` (idle tails counted)."""
    out: dict = {}
    for side, group in (("producer", list(producers)), ("consumer", list(consumers))):
        out[side + "s"] = {str(b.index): b.summary(steady) for b in group}
        busy = sum(b.totals(steady)[0] for b in group)
        window = sum(b.totals(steady)[1] for b in group)
        f = None if window <= 0 else max(0.0, min(1.0, busy / window))
        key, val = ("producer_duty_cycle", f) if side == "producer" else ("consumer_starvation",
                                                                         None if f is None else 1.0 - f)
        out[key] = None if val is None else round(val, 4)
        caps = [s["tokens_per_busy_s"] for s in out[side + "s"].values() if s["tokens_per_busy_s"]]
        out[f"{side}_tokens_per_busy_s"] = round(sum(caps) / len(caps), 1) if caps else None
    return out


# ---------------------------------------------------------------------------------------------------- --plan

# Settings that do not change how many tokens per second one producer or one consumer process handles; every
# other setting of the config (target, dtype, capture layers, drafter shape, anchors, block size, batch shape,
# label source, ...) must match for a previous run's rates to be used. Devices are compared by kind (cpu/cuda).
RATE_NEUTRAL = {
    "run_dir", "run_id", "resume", "tcp", "monitor", "ring",
    "data.data", "data.heldout", "data.seed", "data.bucket_edges", "data.num_buckets",
    "producer.devices", "trainer.devices",
    "trainer.lr", "trainer.min_lr_ratio", "trainer.warmup_steps", "trainer.weight_decay", "trainer.grad_clip",
    "trainer.max_steps", "trainer.epochs", "trainer.checkpoint_every", "trainer.eval_every",
    "trainer.eval_prompts", "trainer.eval_max_new_tokens", "trainer.eval_prompt_len", "trainer.seed",
    "trainer.max_nonfinite_in_row",
}


def _device_kind(spec: str) -> str:
    return str(spec).split(":")[0]


def rate_shape(config: dict) -> dict:
    """The settings of a run's ``config.json`` (as a dict) that the per-process rates depend on: everything
    but ``RATE_NEUTRAL``, plus the device kinds of each side."""
    flat: dict = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            name = prefix + k
            if name in RATE_NEUTRAL:
                continue
            if isinstance(v, dict):
                walk(v, name + ".")
            else:
                flat[name] = v

    walk(config, "")
    flat["producer.device_kinds"] = sorted({_device_kind(d) for d in config.get("producer", {}).get("devices", [])})
    flat["trainer.device_kinds"] = sorted({_device_kind(d) for d in config.get("trainer", {}).get("devices", [])})
    return flat


@dataclass
class RecordedRates:
    """Capacity of one producer and of one consumer process (tokens per busy second) from a finished run."""
    producer_tokens_per_s: float
    consumer_tokens_per_s: float
    source: str          # the run directory they were read from
    topology: str        # e.g. "2 producers (cpu) + 1 consumer (cpu)"


def find_recorded_rates(config: dict, search: Iterable[Path], exclude: Path | None = None) -> RecordedRates | None:
    """The rates of the most recent run (by ``summary.json`` modification time) under the directories
    ``search`` (each searched for ``*/summary.json`` and itself) whose ``config.json`` has the same
    ``rate_shape`` as ``config`` and whose summary holds both capacities; None if there is none. Run
    directories that cannot be read are skipped. ``exclude``: a run directory to ignore."""
    want = rate_shape(config)
    seen: set[Path] = set()
    found: list[tuple[float, Path, dict, dict]] = []
    for base in search:
        base = Path(base)
        for rd in [RunDir(base), *(RunDir(p.parent) for p in sorted(base.glob(f"*/{SUMMARY_FILE}")))]:
            run = rd.path.resolve()
            if run in seen or (exclude is not None and run == Path(exclude).resolve()) or \
                    not rd.summary_file.is_file():
                continue
            seen.add(run)
            try:
                s = rd.read_summary()
                c = rd.config_dict()
                mtime = rd.summary_file.stat().st_mtime
            except (OSError, ValueError):
                continue
            b = s.balance
            if not isinstance(b, dict) or not b.get("producer_tokens_per_busy_s") or \
                    not b.get("consumer_tokens_per_busy_s"):
                continue
            if rate_shape(c) == want:
                found.append((mtime, rd.path, b, c))
    if not found:
        return None
    _, run, b, c = max(found, key=lambda x: x[0])
    p, q = c.get("producer", {}).get("devices", []), c.get("trainer", {}).get("devices", [])
    topo = (f"{len(p)} producer(s) ({','.join(sorted({_device_kind(d) for d in p}))}) + {len(q)} consumer(s) "
            f"({','.join(sorted({_device_kind(d) for d in q}))})")
    return RecordedRates(float(b["producer_tokens_per_busy_s"]), float(b["consumer_tokens_per_busy_s"]), str(run), topo)


@dataclass
class Advice:
    """What ``--plan`` says about balance for ``producers`` + ``consumers`` processes."""
    producers_per_consumer: float   # producers one consumer keeps busy (consumer rate / producer rate)
    expected_tokens_per_s: float    # min(P * producer rate, C * consumer rate)
    producer_busy: float            # expected fraction of time each producer works
    consumer_busy: float            # expected fraction of time each consumer trains
    best_split: tuple[int, int] | None   # the split of the same number of own devices with the most tokens/s
    warnings: list[str]


def advise(producer_rate: float, consumer_rate: float, producers: int, consumers: int,
           own_devices: bool = True) -> Advice:
    """Balance of ``producers`` + ``consumers`` processes whose single-process capacities are ``producer_rate``
    and ``consumer_rate`` tokens/s (each on a device of its own: the pipeline runs at the slower side's total,
    ``min(P*p, C*c)``). A side whose expected busy fraction is under 0.5 is more than half idle: warned.
    ``best_split``: with ``own_devices``, the ``(P, C)`` with ``P + C == producers + consumers`` that gives the
    most tokens/s (ties: fewer producers). Raises ``ValueError`` for non-positive rates or counts."""
    if not (producer_rate > 0 and consumer_rate > 0) or producers < 1 or consumers < 1:
        raise ValueError(f"advise: rates must be > 0 and counts >= 1, got {producer_rate}, {consumer_rate}, "
                         f"{producers}, {consumers}")
    supply, demand = producers * producer_rate, consumers * consumer_rate
    rate = min(supply, demand)
    pb, cb = rate / supply, rate / demand
    warnings = []
    best = None
    n = producers + consumers
    if own_devices and n >= 2:
        best = max(((p, n - p) for p in range(1, n)),
                   key=lambda s: (round(min(s[0] * producer_rate, s[1] * consumer_rate), 6), -s[0]))
    for side, busy, count in (("producer", pb, producers), ("consumer", cb, consumers)):
        if busy < 0.5:
            msg = (f"the {count} {side}(s) would be {1 - busy:.0%} idle (busy {busy:.0%} of the time): "
                   f"more than half idle")
            if best is not None and best != (producers, consumers):
                b_rate = min(best[0] * producer_rate, best[1] * consumer_rate)
                msg += (f"; {best[0]} producer(s) + {best[1]} consumer(s) on the same {n} devices would give "
                        f"about {b_rate:,.0f} tokens/s instead of {rate:,.0f}")
            warnings.append(msg)
    return Advice(consumer_rate / producer_rate, rate, pb, cb, best, warnings)


def balance_lines(config: dict, search: Iterable[Path], exclude: Path | None = None) -> list[str]:
    """The ``balance:`` lines of ``launch.py train --plan`` for the run ``config`` (its ``to_dict()``): the
    recorded rates of the last run of the same shape (``find_recorded_rates``), the balancing ratio, the
    expected busy fractions and a ``warning:`` line per side left more than half idle; without such a run, a
    line saying how to record rates."""
    p_devs, c_devs = config["producer"]["devices"], config["trainer"]["devices"]
    rates = find_recorded_rates(config, search, exclude)
    if rates is None:
        return ["balance: no recorded rates for this target, drafter and anchor shape (no finished run of the "
                "same settings under the runs directory); a short run records them in its summary.json "
                "(balance), or measure each stage alone with `python benchmarks/pipeline.py`"]
    shared = bool(set(p_devs) & set(c_devs)) and any(_device_kind(d) != "cpu" for d in p_devs + c_devs)
    a = advise(rates.producer_tokens_per_s, rates.consumer_tokens_per_s, len(p_devs), len(c_devs),
               own_devices=not shared)
    lines = [
        f"balance: rates recorded by {rates.source} ({rates.topology}; tokens per busy second of one process, "
        f"from its summary.json): producer {rates.producer_tokens_per_s:,.0f} tok/s, consumer "
        f"{rates.consumer_tokens_per_s:,.0f} tok/s",
        f"balance: producer:consumer = {a.producers_per_consumer:.2f}:1 balances this target, drafter and anchors "
        f"(producers one consumer keeps busy)",
        f"balance: this topology ({len(p_devs)} + {len(c_devs)}): about {a.expected_tokens_per_s:,.0f} tokens/s, "
        f"producers busy {a.producer_busy:.0%}, consumers busy {a.consumer_busy:.0%} of the time",
    ]
    if shared:
        lines.append("balance: producers and consumers share a GPU here: they take turns, so these busy fractions "
                     "are upper bounds and the ratio applies to devices of their own")
    if any(_device_kind(d) == "cpu" for d in p_devs + c_devs):
        lines.append("balance: CPU processes share the machine's cores: rates recorded with another number of "
                     "processes are only indicative")
    lines += [f"warning: {w}" for w in a.warnings]
    return lines

"""``RUN_DIR/timeseries.jsonl``: the pipeline's state over time, for ``launch.py report`` and the live page.

``status.json`` holds only the latest second and the progress lines a text form; this file keeps the history.
The supervisor appends, at its progress cadence (the status tick, about once a second, thinned as below):

* ``{"kind": "start", "time", "run_id", "resume", "producers", "consumers", "num_slots", "interval_s"}`` when a
  supervisor starts on the run directory (a resumed run appends to the file, so it holds every session);
* ``{"kind": "sample", "time", "step", "total_steps", "trained_batches", "tokens_trained", "loss",
  "tokens_per_s", "producer_duty_cycle", "consumer_starvation", "producers": [...], "consumers": [...]}``:
  ``time`` in seconds since the epoch; ``tokens_trained``: target tokens trained by the steps after the first (all
  ranks; its difference between two samples over their time is the pipeline's rate then); ``tokens_per_s``: the
  run's target tokens per second between its first and latest optimizer step; the run's live duty cycle and
  starvation (fractions, ``None`` before the first batch); per producer ``{"index", "state", "generation",
  "restarts", "tokens_per_s" (its own, over ~10 s), "duty_cycle", "ring": [FREE, WRITING, READY, READING]}``
  (slot counts), per consumer ``{"index", "state", "tokens_per_s", "starvation"}``;
* ``{"kind": "event", "time", "event", "text"}`` for each lifecycle line the supervisor logs (``EVENTS``:
  restarts, hangs, fences, deaths, signals, failed τ evaluations, checkpoints), taken from its log records
  (a ``logging.Handler`` on the ``specring.supervisor`` loggers), so marks on a time axis need no log parsing;
* ``{"kind": "stop", "time"}`` when the supervisor is done with the run.

Bounded: at most ``MAX_SAMPLES`` samples; when a sample would exceed it the file is rewritten (aside, then
renamed) keeping every other sample and the sampling interval doubles, so a run of any length keeps between
``MAX_SAMPLES / 2`` and ``MAX_SAMPLES`` samples spread over all of it; at most ``MAX_EVENTS`` events (later ones are
counted in the ``stop`` record as ``events_dropped``). About 0.3 kB per sample plus 0.2 kB per process: a few MB at
most. Writing never raises into the supervisor: an ``OSError`` (a full disk) is logged once and recording stops.

``read_timeseries`` reads it back, tolerating a truncated last line (a killed supervisor) and lines that do not
parse (counted). Standard library only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path

from specring.shared.run.run_dir import RunDir

log = logging.getLogger(__name__)

MAX_SAMPLES = 2000
MAX_EVENTS = 2000
# the first word of a supervisor log line (before a space or "=") -> the event recorded for it
EVENTS = {
    "restart": "restart", "restart_requested": "restart", "hang": "hang", "fence": "fence",
    "give_up": "death", "consumer_died": "death", "consumer_died_at_shutdown": "death", "node_died": "death",
    "node_stopped": "death", "signal": "signal", "supervisor_stalled": "stall", "eval_failed": "eval_failed",
    "bad_batch": "bad_batch", "checkpoint": "checkpoint",
}
_EVENT_LOGGER = "specring.supervisor"


class TimeSeries:
    """The writer of ``RUN_DIR/timeseries.jsonl`` (see the module docstring); one per supervisor run.

    ``interval_s``: the least time between two samples at the start (seconds; doubles at each thinning; a resumed
    run continues with the interval of its file's last sample). Creating it appends the ``start`` record and
    starts taking the supervisor's event lines; ``close()`` stops that and appends ``stop``."""

    def __init__(self, run_dir: str | Path, run_id: str, *, resume: bool = False, producers: int = 0,
                 consumers: int = 0, num_slots: int = 0, interval_s: float = 1.0,
                 max_samples: int = MAX_SAMPLES, max_events: int = MAX_EVENTS):
        self.path = RunDir(run_dir).timeseries_file
        self.max_samples = max(4, int(max_samples))
        self.max_events = int(max_events)
        self.interval_s = float(interval_s)
        self.samples = 0
        self.events = 0
        self.events_dropped = 0
        self._last_sample = float("-inf")
        self._lock = threading.Lock()
        self._broken = False
        if self.path.is_file():  # a resumed run: go on with the file's counts and interval
            recs, _ = read_timeseries(self.path)
            for r in recs:
                if r.get("kind") == "sample":
                    self.samples += 1
                    self.interval_s = max(self.interval_s, float(r.get("interval_s") or 0.0))
                elif r.get("kind") == "event":
                    self.events += 1
            self._terminate_torn_line()
        self._append({"kind": "start", "time": time.time(), "run_id": run_id, "resume": bool(resume),
                      "producers": producers, "consumers": consumers, "num_slots": num_slots,
                      "interval_s": self.interval_s})
        self._handler = _EventHandler(self)
        logging.getLogger(_EVENT_LOGGER).addHandler(self._handler)

    def sample(self, rows: list[dict], step: int, total_steps: int, loss: float | None, tokens_per_s: float,
               balance: dict | None, trained_batches: int, tokens_trained: int, now: float | None = None,
               force: bool = False) -> bool:
        """Append a sample from the status ``rows`` (``Supervisor.status_rows``) and the run's figures, unless the
        last one is less than ``interval_s`` old (``force``: whatever its age, for the end of the loop); returns
        whether one was written."""
        now = time.time() if now is None else now
        if (now - self._last_sample < self.interval_s and not force) or self._broken:
            return False
        self._last_sample = now
        bal = balance or {}
        rec = {"kind": "sample", "time": round(now, 3), "interval_s": self.interval_s, "step": int(step),
               "total_steps": int(total_steps), "trained_batches": int(trained_batches),
               "tokens_trained": int(tokens_trained), "loss": _num(loss), "tokens_per_s": _num(tokens_per_s),
               "producer_duty_cycle": _num(bal.get("producer_duty_cycle")),
               "consumer_starvation": _num(bal.get("consumer_starvation")),
               "producers": [], "consumers": []}
        for r in rows:
            if r.get("role") == "producer":
                ring = r.get("ring") or {}
                rec["producers"].append({
                    "index": r.get("index"), "state": r.get("state"), "generation": r.get("generation"),
                    "restarts": r.get("restarts"), "tokens_per_s": _num(r.get("tokens_per_s")),
                    "duty_cycle": _num(r.get("duty_cycle")),
                    "ring": [int(ring.get(k, 0)) for k in ("FREE", "WRITING", "READY", "READING")] if ring else None})
            elif r.get("role") == "consumer":
                rec["consumers"].append({"index": r.get("index"), "state": r.get("state"),
                                         "tokens_per_s": _num(r.get("tokens_per_s")),
                                         "starvation": _num(r.get("starvation"))})
        with self._lock:
            if self.samples >= self.max_samples:
                self._thin()
            self.samples += 1
            self._append(rec)
        return True

    def event(self, name: str, text: str, when: float | None = None) -> None:
        """Append an event record (``name``: a value of ``EVENTS``; ``text``: the log line, cut at 300 characters)."""
        with self._lock:
            if self.events >= self.max_events:
                self.events_dropped += 1
                return
            self.events += 1
            self._append({"kind": "event", "time": round(time.time() if when is None else when, 3), "event": name,
                          "text": text[:300]})

    def close(self) -> None:
        """Stop taking event lines and append the ``stop`` record (idempotent)."""
        if self._handler is None:
            return
        logging.getLogger(_EVENT_LOGGER).removeHandler(self._handler)
        self._handler = None
        with self._lock:
            self._append({"kind": "stop", "time": round(time.time(), 3), "events_dropped": self.events_dropped})

    # ------------------------------------------------------------------ file
    def _append(self, rec: dict) -> None:
        if self._broken:
            return
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        except OSError as e:
            self._broken = True
            log.error("timeseries_unwritable path=%s error=%s: the report's curves of the pipeline stop here",
                      self.path, e)

    def _thin(self) -> None:
        """Rewrite the file keeping every other sample (and every record of the other kinds); double the interval."""
        recs, _ = read_timeseries(self.path)
        kept, n = [], 0
        for r in recs:
            if r.get("kind") == "sample":
                n += 1
                if n % 2 == 0:  # the 1st, 3rd, ... kept: the run's first sample stays
                    continue
            kept.append(r)
        self.interval_s *= 2
        tmp = self.path.with_suffix(f".tmp-{os.getpid()}")
        try:
            tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
            os.replace(tmp, self.path)
        except OSError as e:
            self._broken = True
            log.error("timeseries_unwritable path=%s error=%s", self.path, e)
            return
        self.samples = (n + 1) // 2

    def _terminate_torn_line(self) -> None:
        """A killed supervisor may have left half a line: end it, so the next record starts on a line of its own."""
        try:
            with open(self.path, "rb+") as f:
                end = f.seek(0, os.SEEK_END)
                if end:
                    f.seek(end - 1)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
        except OSError:
            pass


class _EventHandler(logging.Handler):
    """Takes the supervisor's lifecycle log lines (``EVENTS``) into the time series."""

    def __init__(self, series: TimeSeries):
        super().__init__(logging.INFO)
        self.series = series

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            name = EVENTS.get(text.split(" ", 1)[0].split("=", 1)[0])
            if name is not None:
                self.series.event(name, text, when=record.created)
        except Exception:  # noqa: BLE001, S110 - a log line never breaks the supervisor (nor logs from here)
            pass


def read_timeseries(path: str | Path) -> tuple[list[dict], int]:
    """The records of a ``timeseries.jsonl`` in file order and the number of lines that did not parse (a torn last
    line of a killed supervisor, or garbage); raises ``OSError`` when the file cannot be read."""
    recs, bad = [], 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(rec, dict):
                recs.append(rec)
            else:
                bad += 1
    return recs, bad


def _num(x):
    """A finite number rounded for the file, else ``None``."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return round(float(x), 4)

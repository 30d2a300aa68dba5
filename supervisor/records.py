"""The supervisor's records of a run: throughput, balance, the trackers' figures and ``summary.json``.

``RunRecords`` (a part of ``supervisor.supervisor.Supervisor``) derives the run's figures from what the supervisor saw:
tokens/s between the first and the latest optimizer step, duty cycles and starvation (``shared.process.balance``), ring
occupancy and restarts for the trackers of ``--report-to`` (``supervisor.reporting``), the pipeline's time series
(``supervisor.timeseries``), the last checkpoint (from messages, or from disk when its message was lost), the batches
``--resume`` will train, the τ evaluations that failed (``eval.jsonl``), and at the end ``summary.json`` (a
``shared.run.run_records.Summary``, whose docstring lists its fields; written through ``shared.run.run_dir.RunDir``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from specring.shared.process.balance import run_balance
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import EvalRecord, StatusRow, Summary
from specring.shared.transport import messages as m
from specring.supervisor.context import RunContext
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.reporting import Reporter
from specring.supervisor.timeseries import TimeSeries

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """How a run ended: ``exit_reason`` (``done``, ``interrupted``, ``consumer_0_died``, ...) and the process
    exit code (0 done, 130 interrupted, 1 otherwise)."""
    exit_reason: str
    exit_code: int


class RunRecords:
    """Figures and records of the run (see the module docstring); a part of ``Supervisor``.

    Given: the ``RunContext`` (``cfg``, ``run_dir``, ``run_id``, the children, ``balance``, ``coordinator``,
    ``progress``) and ``updated_before``: on ``--resume``, how many of the resumed checkpoint's batches were
    trained by steps that updated the weights (None: all of them; ``resumed`` may set it).

    Owns (public, read by the ``Supervisor`` and the other parts): ``started_at`` (monotonic s),
    ``tokens_trained`` (target tokens of every optimizer step after the first, all ranks), ``first_trained_at`` /
    ``last_trained_at`` (monotonic s of the first and latest step, None before one), ``first_spawn_at`` (the first
    child's spawn, None before), ``last_checkpoint`` (``{"step", "path"}``, empty before one), ``trained_at_start``
    (batch ids of the checkpoint a resumed run started from), ``trained_steps`` (``(optimizer step, batch ids)`` of
    each ``Trained``), ``updated_before``, ``reporter`` (the trackers' ``Reporter``, None before ``open_reporter``),
    ``timeseries`` (``TimeSeries``, None before ``open_timeseries``), ``eval_failures`` (the last
    ``poll_eval_failures``) and ``summary`` (the ``Summary`` written, None before ``write_summary``)."""

    def __init__(self, context: RunContext, updated_before: int | None = None):
        self.context = context
        self.updated_before = updated_before
        self.started_at = time.monotonic()
        self.tokens_trained = 0            # tokens of every step after the first (rate = steady state)
        self.first_trained_at: float | None = None
        self.first_spawn_at: float | None = None  # the first child's spawn (summary.json: first_step_s)
        self.last_trained_at: float | None = None
        self.last_checkpoint: dict = {}
        self.trained_at_start: set[int] = set()  # batch ids of the checkpoint a resumed run started from
        self.trained_steps: list[tuple[int, list[int]]] = []  # (optimizer step, batch ids) of each Trained
        self.reporter: Reporter | None = None
        self.timeseries: TimeSeries | None = None
        self.eval_failures: list[dict] = []  # τ evaluations that raised (poll_eval_failures)
        self.summary: Summary | None = None
        self._reported_step = -1
        self._eval_cache: tuple | None = None

    def resumed(self, trained: set[int], updated_before: int | None = None) -> None:
        """``--resume``: ``trained`` (batch ids) are the checkpoint's the run starts from; ``updated_before``, when
        given, how many of them steps that updated the weights trained. Takes the last checkpoint from disk."""
        self.trained_at_start = set(trained)
        if updated_before is not None:
            self.updated_before = updated_before
        self.checkpoint_from_disk()

    def open_timeseries(self) -> None:
        """Open ``RUN_DIR/timeseries.jsonl`` (appended to on ``--resume``)."""
        cx, cfg = self.context, self.context.cfg
        self.timeseries = TimeSeries(cx.run_dir, cx.run_id, resume=bool(cfg.resume), producers=len(cx.producers),
                                     consumers=len(cx.consumers), num_slots=cfg.ring.num_slots)

    def open_reporter(self) -> None:
        """Start the trackers of ``--report-to`` (``supervisor.reporting.Reporter``); a resumed run's steps go on
        from its last checkpoint's."""
        cx, cfg = self.context, self.context.cfg
        self.reporter = Reporter(cfg.report_to, cx.run_dir, cx.run_id, cfg.to_dict(),
                                 start_step=self.last_checkpoint.get("step", 0) if cfg.resume else 0)

    def close_timeseries(self) -> None:
        """Close the time series, if it was opened."""
        if self.timeseries is not None:
            self.timeseries.close()

    def spawned(self) -> None:
        """A child was spawned: the first spawn starts the clock of ``summary.json``'s ``first_step_s``."""
        if self.first_spawn_at is None:
            self.first_spawn_at = time.monotonic()

    def on_trained(self, msg: m.Trained, world: int) -> None:
        """A ``Trained`` (an optimizer step, indices global) handed to the ledger and recorded: its batches, and
        from consumer 0 the throughput (its tokens times ``world``, the run's consumers on every node) and the
        progress line."""
        co = self.context.coordinator
        co.on_trained(msg)
        self.trained_steps.append((int(msg.step), [int(b) for b in msg.batch_ids]))
        if msg.consumer == 0:
            now = time.monotonic()
            if self.first_trained_at is None:
                self.first_trained_at = now  # start-up (imports, model loads) is not throughput
            else:
                self.tokens_trained += msg.num_tokens * world
            self.last_trained_at = now
            self.context.progress.update(msg.step, msg.loss, co)

    def on_checkpoint(self, step: int, path: str) -> None:
        """A consumer said it saved the checkpoint of optimizer step ``step`` at ``path``."""
        self.last_checkpoint = {"step": step, "path": path}

    def pipeline_figures(self) -> dict[str, float]:
        """The supervisor's own figures for the trackers: end-to-end tokens/s, slots of each producer's ring
        by state (``pipeline/ring{i}_ready`` ...), restarts of each producer and in all, rejected messages."""
        cx = self.context
        out = {"pipeline/tokens_per_s": self.tokens_per_s(),
               "pipeline/restarts": float(sum(p.restarts for p in cx.producers))}
        for p in cx.producers:
            out[f"pipeline/producer{p.index}_restarts"] = float(p.restarts)
            if cx.coordinator is not None:
                for state, n in cx.coordinator.occupancy(p.index).items():
                    out[f"pipeline/ring{p.index}_{state.lower()}"] = float(n)
        if cx.coordinator is not None:
            out["pipeline/trained_batches"] = float(len(cx.coordinator.trained))
        return out

    def report(self, final: bool = False) -> None:
        """Send what is new to the trackers (``Reporter.refresh``); the pipeline figures once per optimizer
        step (and at the end), so that a slow run does not send the same step every second."""
        if self.reporter is None:
            return
        step = self.context.progress.step
        pipeline = self.pipeline_figures() if final or step != self._reported_step else None
        self._reported_step = step
        if final:
            self.reporter.close(pipeline)
        else:
            self.reporter.refresh(pipeline)

    def tokens_per_s(self) -> float:
        """Target tokens trained per second between the first and the latest optimizer step (all ranks;
        approximated as rank 0's tokens times the number of consumers)."""
        if self.first_trained_at is None or self.last_trained_at == self.first_trained_at:
            return 0.0
        return self.tokens_trained / (self.last_trained_at - self.first_trained_at)

    def balance_figures(self, steady: bool) -> dict:
        """Duty cycles and starvation of the run's processes (``shared.process.balance.run_balance``)."""
        cx = self.context
        return run_balance([cx.balance[("producer", c.index)] for c in cx.producers],
                           [cx.balance[("consumer", c.index)] for c in cx.consumers], steady=steady)

    def sample_timeseries(self, rows: list[StatusRow], force: bool = False) -> None:
        """A sample of ``RUN_DIR/timeseries.jsonl`` (``supervisor.timeseries``, read by ``launch.py report``): the
        status ``rows`` and the run's step, loss, tokens/s, balance and trained batches and tokens."""
        progress = self.context.progress
        self.timeseries.sample([r.to_json() for r in rows], progress.step, progress.total, progress.loss,
                               self.tokens_per_s(), self.balance_figures(steady=False),
                               len(self.context.coordinator.trained), self.tokens_trained, force=force)

    def checkpoint_from_disk(self) -> None:
        """Take ``checkpoints/latest`` as the last checkpoint when it is newer than the last one reported."""
        run = RunDir(self.context.run_dir)
        step = run.latest_checkpoint_step()
        if step is not None and step > self.last_checkpoint.get("step", -1):
            self.last_checkpoint = {"step": step, "path": str(run.checkpoint_dir(step))}

    def _remaining(self, co: Coordinator) -> int:
        """Planned batches that ``--resume`` will train: neither bad nor in the last checkpoint (batches
        trained after it count: their weights were not saved)."""
        step = self.last_checkpoint.get("step")
        saved = set(self.trained_at_start)
        for st, ids in self.trained_steps:
            if step is not None and st <= step:
                saved.update(ids)
        return sum(1 for b in co.order if b not in saved and b not in co.bad)

    def _eval_records(self) -> list[EvalRecord]:
        """The records of ``eval.jsonl`` (τ at checkpoints, and failed evaluations), read again only when the file
        changed since the last call (its inode, size or modification time); lines that do not parse are skipped."""
        run = RunDir(self.context.run_dir)
        try:
            st = os.stat(run.eval_file)
        except OSError:
            self._eval_cache = (None, [])
            return []
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._eval_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        recs = run.read_evals()
        self._eval_cache = (key, recs)
        return recs

    def poll_eval_failures(self) -> list[dict]:
        """The τ evaluations that raised, from ``eval.jsonl`` (``consumer.tau.CheckpointEvaluator.record_failure``):
        ``[{"step", "error"}]`` in the order they happened; each new one is logged once (``eval_failed step=...``).
        Called about once a second by the loop and once more before the summary is written."""
        out = [{"step": int(-1 if r.step is None else r.step), "error": str(r.error)}
               for r in self._eval_records() if r.failed]
        seen = self.eval_failures
        for f in out[len(seen):] if out[:len(seen)] == seen else out:
            log.error("eval_failed step=%d error=%s: tau could not be measured (training goes on; see "
                      "logs/consumer-0.log)", f["step"], f["error"])
        self.eval_failures = out
        return out

    def _measured_taus(self) -> list[tuple[int, float]]:
        """``(step, tau_mean)`` of every measured record of ``eval.jsonl``, in file order (failures and records
        that do not parse skipped)."""
        out = []
        for rec in self._eval_records():
            try:
                if rec.measured:
                    out.append((int(rec.step), float(rec.tau_mean)))
            except (TypeError, ValueError):
                continue
        return out

    def _tau_last(self) -> dict | None:
        """``{"step", "tau_mean"}`` of the last measured record in ``eval.jsonl`` (failures skipped; None without
        one)."""
        taus = self._measured_taus()
        return {"step": taus[-1][0], "tau_mean": taus[-1][1]} if taus else None

    def _tau_best(self) -> dict | None:
        """``{"step", "tau_mean", "checkpoint"}`` of the record with the highest held-out τ in ``eval.jsonl`` (the
        earliest of equals; failures skipped; None without one). ``checkpoint``: that step's checkpoint directory
        when the run still holds it (a step between checkpoints was measured on a snapshot, or the checkpoint was
        rotated out: None), the one to export when the curve has passed its peak."""
        taus = self._measured_taus()
        if not taus:
            return None
        step, tau = max(taus, key=lambda st: st[1])  # max keeps the first of equals
        ckpt_dir = RunDir(self.context.run_dir).checkpoint_dir(step)
        return {"step": step, "tau_mean": tau, "checkpoint": str(ckpt_dir) if ckpt_dir.is_dir() else None}

    def write_summary(self, outcome: Outcome, rejected_frames: int, refused_commands: int,
                      nodes: dict | None = None) -> None:
        """Write ``RUN_DIR/summary.json`` (a ``shared.run.run_records.Summary``, also kept as ``summary``) for
        ``outcome``. ``rejected_frames``/``refused_commands``: the counts of frames rejected (socket and node
        link) and operator commands refused; ``nodes``: several nodes, the ``nodes`` record
        (``NodeEvents.summary_nodes``), None with one node."""
        cx = self.context
        co = cx.coordinator
        elapsed = time.monotonic() - self.started_at
        summary = Summary(
            exit_reason=outcome.exit_reason,
            run_id=cx.run_id,
            planned_batches=len(co.order) if co else 0,
            trained_before_resume=co.trained_before if co else 0,
            trained_batches=len(co.trained) if co else 0,
            duplicate_batches=co.duplicates if co else 0,
            # lost: a finished run that did not train a batch it planned (must be 0); remaining: batches a
            # stopped run has not reached yet (--resume trains them)
            lost_batches=len(co.lost()) if co and outcome.exit_reason == "done" else 0,
            remaining_batches=self._remaining(co) if co and outcome.exit_reason != "done" else 0,
            bad_batches=len(co.bad) if co else 0,
            # batches of steps that updated no weight (no labels, non-finite loss); counted in trained_batches
            skipped_batches=len(co.skipped) if co else 0,
            updated_steps=co.updated_steps if co else 0,
            restarts={str(c.index): c.restarts for c in cx.producers},
            loss_first=co.loss_first if co else None,
            loss_last=co.loss_last if co else None,
            tokens_per_s=round(self.tokens_per_s(), 1),
            elapsed_s=round(elapsed, 2),
            # seconds from the first child's spawn to the first optimizer step (imports, loads, warm-up, 1st batch)
            first_step_s=(round(self.first_trained_at - self.first_spawn_at, 2)
                          if self.first_trained_at is not None and self.first_spawn_at is not None else None),
            rejected_messages=dict(co.rejected) if co else {},
            rejected_frames=rejected_frames,
            refused_commands=refused_commands,
            last_checkpoint=self.last_checkpoint,
            tau_last=self._tau_last(),
            # the best held-out τ so far and its checkpoint (the plateau and the peak, from eval.jsonl)
            tau_best=self._tau_best(),
            # τ evaluations that raised ({step, error}); training went on without them
            eval_failures=self.poll_eval_failures(),
            # duty cycle of producers, starvation of consumers, capacity per process (shared.process.balance)
            balance=self.balance_figures(steady=True),
        )
        if nodes is not None:
            summary.nodes = nodes
        if self.reporter is not None and self.reporter.names:  # what the trackers got (supervisor.reporting)
            summary.report_to = self.reporter.stats()
        RunDir(cx.run_dir).write_summary(summary)
        self.summary = summary

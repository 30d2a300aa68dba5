"""The supervisor's records of a run: throughput, balance, the trackers' figures and ``summary.json``.

``RunRecords`` (a part of ``supervisor.supervisor.Supervisor``) derives the run's figures from what the
supervisor saw: tokens/s between the first and the latest optimizer step, duty cycles and starvation
(``shared.process.balance``), ring occupancy and restarts for the trackers of ``--report-to``
(``supervisor.reporting``), the last checkpoint (from messages, or from disk when its message was lost), the batches
``--resume`` will train, the τ evaluations that failed (``eval.jsonl``), and at the end ``summary.json`` (a
``shared.run.run_records.Summary``, whose docstring lists its fields; written through ``shared.run.run_dir.RunDir``).

State it uses on the supervisor: ``coordinator``, ``producers``/``consumers``, ``balance``, ``reporter``,
``progress``, ``run_dir``, ``run_id``, ``trained_steps``, ``trained_at_start``, ``last_checkpoint``, the
counters, and on several nodes ``topo``, ``link``, ``dead_nodes``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from specring.shared.process.balance import run_balance
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import EvalRecord, Summary
from specring.supervisor.coordinator import Coordinator

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """How a run ended: ``exit_reason`` (``done``, ``interrupted``, ``consumer_0_died``, ...) and the process
    exit code (0 done, 130 interrupted, 1 otherwise)."""
    exit_reason: str
    exit_code: int


class RunRecords:
    """Figures and records of the run (see the module docstring); a part of ``Supervisor``."""

    def pipeline_figures(self) -> dict[str, float]:
        """The supervisor's own figures for the trackers: end-to-end tokens/s, slots of each producer's ring
        by state (``pipeline/ring{i}_ready`` ...), restarts of each producer and in all, rejected messages."""
        out = {"pipeline/tokens_per_s": self.tokens_per_s(),
               "pipeline/restarts": float(sum(p.restarts for p in self.producers))}
        for p in self.producers:
            out[f"pipeline/producer{p.index}_restarts"] = float(p.restarts)
            if self.coordinator is not None:
                for state, n in self.coordinator.occupancy(p.index).items():
                    out[f"pipeline/ring{p.index}_{state.lower()}"] = float(n)
        if self.coordinator is not None:
            out["pipeline/trained_batches"] = float(len(self.coordinator.trained))
        return out

    def _report(self, final: bool = False) -> None:
        """Send what is new to the trackers (``Reporter.refresh``); the pipeline figures once per optimizer
        step (and at the end), so that a slow run does not send the same step every second."""
        if self.reporter is None:
            return
        step = self.progress.step
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

    def _balance(self, steady: bool) -> dict:
        """Duty cycles and starvation of the run's processes (``shared.process.balance.run_balance``)."""
        return run_balance([self.balance[("producer", c.index)] for c in self.producers],
                           [self.balance[("consumer", c.index)] for c in self.consumers], steady=steady)

    def _checkpoint_from_disk(self) -> None:
        """Take ``checkpoints/latest`` as the last checkpoint when it is newer than the last one reported."""
        run = RunDir(self.run_dir)
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
        run = RunDir(self.run_dir)
        try:
            st = os.stat(run.eval_file)
        except OSError:
            self._eval_cache = (None, [])
            return []
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = getattr(self, "_eval_cache", None)
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
        seen = getattr(self, "eval_failures", [])
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
        ckpt_dir = RunDir(self.run_dir).checkpoint_dir(step)
        return {"step": step, "tau_mean": tau, "checkpoint": str(ckpt_dir) if ckpt_dir.is_dir() else None}

    def _write_summary(self, outcome: Outcome) -> None:
        co = self.coordinator
        elapsed = time.monotonic() - self.started_at
        summary = Summary(
            exit_reason=outcome.exit_reason,
            run_id=self.run_id,
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
            restarts={str(c.index): c.restarts for c in self.producers},
            loss_first=co.loss_first if co else None,
            loss_last=co.loss_last if co else None,
            tokens_per_s=round(self.tokens_per_s(), 1),
            elapsed_s=round(elapsed, 2),
            # seconds from the first child's spawn to the first optimizer step (imports, loads, warm-up, 1st batch)
            first_step_s=(round(self.first_trained_at - self.first_spawn_at, 2)
                          if self.first_trained_at is not None and self.first_spawn_at is not None else None),
            rejected_messages=dict(co.rejected) if co else {},
            rejected_frames=self.rejected_frames,
            refused_commands=self.refused_commands,
            last_checkpoint=self.last_checkpoint,
            tau_last=self._tau_last(),
            # the best held-out τ so far and its checkpoint (the plateau and the peak, from eval.jsonl)
            tau_best=self._tau_best(),
            # τ evaluations that raised ({step, error}); training went on without them
            eval_failures=self.poll_eval_failures(),
            # duty cycle of producers, starvation of consumers, capacity per process (shared.process.balance)
            balance=self._balance(steady=True),
        )
        if self.topo is not None:
            summary.nodes = {"nnodes": self.topo.nnodes, "node_rank": self.cfg.nodes.node_rank,
                             "producers": self.topo.producers, "consumers": self.topo.consumers,
                             "dead_nodes": sorted(self.dead_nodes),
                             "relocated_batches": getattr(co, "relocated", 0),
                             # node 0: deaths of other nodes' producers (global index); their restarts are
                             # in those nodes' summaries
                             "producer_deaths_on_other_nodes": {str(k): v for k, v in
                                                                sorted(self.remote_producer_deaths.items())},
                             "rejected_node_frames": self.link.rejected if self.link else 0,
                             "refused_node_peers": self.link.allowed.refused if self.link and self.link.allowed
                             else 0}
        if self.reporter is not None and self.reporter.names:  # what the trackers got (supervisor.reporting)
            summary.report_to = self.reporter.stats()
        RunDir(self.run_dir).write_summary(summary)
        self.summary = summary

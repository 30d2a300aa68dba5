"""The live progress display of a training run: steps, loss, tokens/s, ring occupancy, restarts.

On a terminal it is a tqdm bar whose postfix carries the figures. Elsewhere (CI, a log file, a service)
it is a ``progress step=.../... loss=... tokens_per_s=... rings=... restarts=...`` log line at most every
``log_interval_s`` seconds and one at the end, so logs stay free of carriage returns. Ring occupancy is
written per producer as ``F/W/R/r`` = slots FREE / WRITING / READY / READING. Given the run's balance figures
(``shared.process.balance.run_balance``), the line ends with ``duty=`` (the producers' duty cycle) and ``starved=``
(the consumers' starvation), ``-`` before the first batch; a τ evaluation that raised adds ``eval_failed=N (step
S: error)``.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger(__name__)


class Progress:
    """Progress over ``total_steps`` optimizer steps; ``interactive`` defaults to ``sys.stderr.isatty()``."""

    def __init__(self, total_steps: int, num_producers: int, mininterval_s: float = 1.0,
                 log_interval_s: float = 10.0, interactive: bool | None = None):
        self.step = 0
        self.total = total_steps
        self.loss: float | None = None
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._figures: tuple[float, str, int, str] | None = None
        self.eval_failures: list[dict] = []
        self.bar = tqdm(total=total_steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
                        mininterval=mininterval_s, leave=True) if self.interactive else None

    def update(self, step: int, loss: float, coordinator) -> None:
        """A ``Trained`` of rank 0 arrived for optimizer step ``step``."""
        if step > self.step:
            if self.bar is not None:
                self.bar.update(step - self.step)
            self.step = step
        self.loss = loss

    def refresh(self, coordinator, producers, tokens_per_s: float, balance: dict | None = None,
                eval_failures: list[dict] | None = None) -> None:
        """Re-render the figures (about once a second); without a terminal, log them every ``log_interval_s``.
        ``balance``: the run's live balance figures (``producer_duty_cycle``, ``consumer_starvation``);
        ``eval_failures``: the τ evaluations that raised so far (``[{"step", "error"}]``), named at the end of the
        line (``eval_failed=N (step S: error)``, the last one) once there is one."""
        rings = " ".join(
            "{FREE}/{WRITING}/{READY}/{READING}".format(**coordinator.occupancy(p.index)) for p in producers)
        restarts = sum(p.restarts for p in producers)
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        bal = "" if balance is None else (f" duty={_frac(balance.get('producer_duty_cycle'))} "
                                          f"starved={_frac(balance.get('consumer_starvation'))}")
        self.eval_failures = list(eval_failures or [])
        bal += eval_failure_text(self.eval_failures)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss={loss} tok/s={tokens_per_s:,.0f} rings[F/W/R/r]={rings} "
                                     f"restarts={restarts}{bal}", refresh=True)
            return
        self._figures = (tokens_per_s, rings.replace(" ", ","), restarts, bal)
        now = time.monotonic()
        if now - self._last_log >= self.log_interval_s:
            self._last_log = now
            self._log_line()

    def _log_line(self) -> None:
        tokens_per_s, rings, restarts, bal = self._figures
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        log.info("progress step=%d/%d loss=%s tokens_per_s=%.0f rings_FWRr=%s restarts=%d%s", self.step, self.total,
                 loss, tokens_per_s, rings, restarts, bal)

    def close(self, tokens_per_s: float | None = None, eval_failures: list[dict] | None = None) -> None:
        """End the display; without a terminal, log a last line (with the run's final ``tokens_per_s`` and, given,
        the final ``eval_failures``)."""
        if eval_failures is not None and self._figures is not None:
            tps, rings, restarts, bal = self._figures
            old = eval_failure_text(self.eval_failures)
            bal = (bal[:len(bal) - len(old)] if old and bal.endswith(old) else bal) + eval_failure_text(eval_failures)
            self._figures = (tps, rings, restarts, bal)
            self.eval_failures = list(eval_failures)
        if self.bar is not None:
            if self.eval_failures:
                self.bar.write(f"tau evaluation failed{eval_failure_text(self.eval_failures)}")
            self.bar.close()
        elif self._figures is not None:
            if tokens_per_s is not None:
                self._figures = (tokens_per_s, *self._figures[1:])
            self._log_line()


def eval_failure_text(failures: list[dict]) -> str:
    """`` eval_failed=N (step S: error)`` for the failed τ evaluations ``failures`` (the last one named, its error
    cut at 120 characters); ``""`` when there is none."""
    if not failures:
        return ""
    last = failures[-1]
    err = str(last.get("error", ""))
    err = err if len(err) <= 120 else err[:117] + "..."
    return f" eval_failed={len(failures)} (step {last.get('step')}: {err})"


def _frac(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"

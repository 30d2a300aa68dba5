"""The live progress display of a training run: steps, loss, tokens/s, ring occupancy, restarts.

On a terminal it is a tqdm bar whose postfix carries the figures; elsewhere (CI, a log file) tqdm prints
a line at most every ``mininterval_s`` seconds. Ring occupancy is written per producer as
``F/W/R/r`` = slots FREE / WRITING / READY / READING.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """Progress over ``total_steps`` optimizer steps."""

    def __init__(self, total_steps: int, num_producers: int, mininterval_s: float = 1.0):
        self.step = 0
        self.loss: float | None = None
        interactive = self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
                        mininterval=mininterval_s if interactive else 10.0, leave=True)

    def update(self, step: int, loss: float, coordinator) -> None:
        """A ``Trained`` of rank 0 arrived for optimizer step ``step``."""
        if step > self.step:
            self.bar.update(step - self.step)
            self.step = step
        self.loss = loss

    def refresh(self, coordinator, producers, tokens_per_s: float) -> None:
        """Re-render the postfix (about once a second)."""
        rings = " ".join(
            "{FREE}/{WRITING}/{READY}/{READING}".format(**coordinator.occupancy(p.index)) for p in producers)
        restarts = sum(p.restarts for p in producers)
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        self.bar.set_postfix_str(f"loss={loss} tok/s={tokens_per_s:,.0f} rings[F/W/R/r]={rings} restarts={restarts}",
                                 refresh=self.interactive)

    def close(self) -> None:
        self.bar.close()

"""Where a consumer's time goes between two optimizer steps: phase times always, a torch-profiler window on request.

``StepPhases`` sums the wall time of the consumer loop's phases (``wait``: for the next ``SlotReady``; ``copy``:
slot verification, ``check_batch`` and the host-to-device copy; ``train``: ``Trainer.step``, whose host reads of
the loss sums and the gradient norm wait for the device; ``after``: the step's messages, checkpoints and τ
requests) and logs their means every ``every`` optimizer steps (the first window's ``wait`` includes the wait for the
first batch), one line::

    step_phases steps=1000-1500 ms_per_step=74.8 wait=1.2 copy=6.3 train=60.1 after=7.2

``ProfileWindow`` runs ``torch.profiler`` over optimizer steps ``START .. START + COUNT - 1`` when
``SPECRING_PROFILE_STEPS=START:COUNT`` is set (``shared.envs``), then writes ``RUN_DIR/profile/consumer-I.txt``
(the operators by self device time and by self host time, ``key_averages``, with the window's wall and device
time per step) and ``consumer-I.trace.json`` (Chrome trace) and logs ``profile_written``. The profiler's own cost
is inside the window only. Both write nothing else and raise nothing on the training path except
``ConfigError`` for a malformed ``SPECRING_PROFILE_STEPS`` (at start, before any batch).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from specring.shared import envs
from specring.shared.errors import ConfigError

log = logging.getLogger("consumer")

PHASES = ("wait", "copy", "train", "after")


class StepPhases:
    """Wall time per phase of the consumer loop, summed and logged as means (ms per optimizer step) every
    ``every`` optimizer steps (0: never logged)."""

    def __init__(self, every: int = 500):
        self.every = int(every)
        self.sums = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.first_step: int | None = None
        self._t = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name`` (one of ``PHASES``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sums[name] += time.perf_counter() - t0

    def mark_wait_start(self) -> None:
        """The loop starts waiting for a message now (the ``wait`` phase runs until ``end_wait``)."""
        self._t = time.perf_counter()

    def end_wait(self) -> None:
        self.sums["wait"] += time.perf_counter() - self._t

    def optimizer_step(self, step: int) -> str | None:
        """Count optimizer step ``step``; every ``every`` steps return the log line (and start a new window)."""
        if self.first_step is None:
            self.first_step = step
        self.steps += 1
        if not self.every or self.steps < self.every:
            return None
        ms = {k: 1e3 * v / self.steps for k, v in self.sums.items()}
        line = (f"step_phases steps={self.first_step}-{step} ms_per_step={sum(ms.values()):.1f} "
                + " ".join(f"{k}={v:.1f}" for k, v in ms.items()))
        self.sums = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.first_step = None
        return line


def parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    """``"START:COUNT"`` -> ``(START, COUNT)``; None for unset or empty. ``ConfigError`` naming the variable
    otherwise (START >= 2, 1 <= COUNT <= 1000)."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        start, count = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"{envs.PROFILE_STEPS}={text!r}: expected START:COUNT, e.g. 400:20") from None
    if start < 2 or not 1 <= count <= 1000:
        raise ConfigError(f"{envs.PROFILE_STEPS}={text!r}: START must be >= 2 (the window opens after step "
                          "START - 1) and COUNT in 1..1000")
    return start, count


class ProfileWindow:
    """``torch.profiler`` over optimizer steps ``start .. start + count - 1`` of this consumer (see module
    docstring); inactive when ``SPECRING_PROFILE_STEPS`` is unset."""

    def __init__(self, run_dir: str | Path, index: int, device: torch.device):
        self.window = parse_profile_steps(envs.get(envs.PROFILE_STEPS))
        self.out = Path(run_dir) / "profile"
        self.index = int(index)
        self.device = device
        self._prof = None
        self._t0 = 0.0

    def after_step(self, step: int) -> None:
        """Call after optimizer step ``step`` has completed: starts the profiler after step ``start - 1``, stops
        and writes after step ``start + count - 1``."""
        if self.window is None:
            return
        start, count = self.window
        if self._prof is None and step == start - 1:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize(self.device)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        elif self._prof is not None and step == start + count - 1:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self._write(self._prof, count, wall)
            self._prof, self.window = None, None

    def _write(self, prof, count: int, wall_s: float) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            events = prof.key_averages()
            dev_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
            head = (f"consumer-{self.index}: {count} optimizer steps, wall {1e3 * wall_s / count:.1f} ms/step, "
                    f"self device time {dev_us / 1e3 / count:.1f} ms/step (sum over operators)\n\n")
            parts = [head]
            if self.device.type == "cuda":
                parts.append(events.table(sort_by="self_device_time_total", row_limit=40) + "\n\n")
            parts.append(events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
            text_path = self.out / f"consumer-{self.index}.txt"
            text_path.write_text("".join(parts))
            prof.export_chrome_trace(str(self.out / f"consumer-{self.index}.trace.json"))
            log.info("profile_written path=%s wall_ms_per_step=%.1f device_ms_per_step=%.1f", text_path,
                     1e3 * wall_s / count, dev_us / 1e3 / count)
        except Exception as e:  # noqa: BLE001 - a profile that cannot be written must not stop training
            log.error("profile_failed error=%s: %s", type(e).__name__, e)

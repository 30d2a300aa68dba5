"""τ of the drafter at training checkpoints: ``CheckpointEvaluator``, run by the τ evaluator process
(``consumer.tau_worker``, started and reaped by rank 0 of the consumers, off the training path).

It decodes with ``specring.shared.models.speculative`` against its own copy of the target and appends a
record per evaluation to ``RUN_DIR/eval.jsonl`` (a ``shared.run.run_records.EvalRecord``); an evaluation that raises
appends a failure record there instead (``record_failure``: ``error`` set, ``tau_mean`` null), which the
supervisor names in its progress line, in ``summary.json`` (``eval_failures``) and in the run's last line. The
heavy imports (the decoding loop, transformers) happen on first use, so that a process that only records failures
stays light.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specring.shared.process import faults
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import EvalRecord, append_line

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- inputs
class CheckpointEvaluator:
    """τ of the live drafter at training checkpoints (``train --eval-prompts N``), rank 0 of the consumers.

    The target is loaded by ``load()`` (the τ evaluator process calls it when it starts; ``__call__`` loads it
    if nobody did) on the consumer's device in the producers' dtype (``random_weights`` honoured) and kept;
    prompts are the first ``prompt_len`` tokens of ``num_prompts`` held-out samples. Each evaluation appends
    ``{"step", "tau_mean", "tau_p50", "tau_p90", "forwards_per_token", "loss", "time"}`` to ``RUN_DIR/eval.jsonl``
    and logs ``tau step=... tau=...``; one that raises appends ``record_failure``'s record and raises again (the
    caller logs it; training goes on).
    Costs one extra copy of the target's weights on the consumer's device (in the evaluator process).

    On a GPU all prompts decode together (``batch_size``: ``shared.models.batched_decode``, the rows batched as
    ``launch.py eval`` does; ``on_prompt`` is then called once, after the group); on the CPU one at a time (a
    batched forward there costs what its rows cost, and the per-prompt heartbeat stays).

    ``$SPECRING_SLOW_EVAL_S`` (tests and drills only, ``shared.process.faults``) sleeps that many seconds after each
    prompt.
    """

    def __init__(self, run_cfg, device: torch.device, run_dir: str | Path, prompt_len: int = 64):
        self.cfg = run_cfg
        self.device = device
        self.path = RunDir(run_dir).eval_file
        self.prompt_len = prompt_len
        self.target = None
        self.prompts: list[list[int]] = []

    @property
    def batch_size(self) -> int:
        """Prompts decoded together: all of them on a GPU, 1 on the CPU."""
        return max(1, len(self.prompts)) if self.device.type == "cuda" else 1

    def load(self) -> None:
        """Load the target and the prompts (once); raises ``ConfigError`` if the target does not load."""
        from specring.shared.data.prompts import load_prompts
        from specring.shared.models.target import load_target
        tc, pc = self.cfg.trainer, self.cfg.producer
        if self.target is None:
            self.target, _ = load_target(pc.target, self.device, pc.dtype, random_weights=pc.random_weights,
                                         trust_remote_code=pc.trust_remote_code)
            self.prompts = load_prompts(self.cfg.data.heldout, tc.eval_prompts, self.prompt_len)

    def __call__(self, drafter: torch.nn.Module, step: int, loss: float | None,
                 on_prompt: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Evaluate ``drafter`` at optimizer step ``step``; returns the record appended to ``eval.jsonl``.
        The drafter decodes through its family's proposer (``evaluate_tau``; EAGLE-3: chains of ``ttt_steps``).
        ``on_prompt(done, total)`` is called after each prompt."""
        from specring.shared.drafters.tau import evaluate_tau
        tc, pc = self.cfg.trainer, self.cfg.producer
        self.load()
        slow_s = faults.slow_eval_s()

        def after_prompt(done: int, total: int) -> None:
            if slow_s > 0:
                time.sleep(slow_s)
            if on_prompt is not None:
                on_prompt(done, total)

        t0 = time.perf_counter()
        # decoding shapes differ from training's: run the compiled draft layers eagerly instead of compiling
        # new graphs in the middle of a run
        stance = getattr(torch.compiler, "set_stance", None)
        try:
            if faults.fail_eval():
                raise RuntimeError(f"{faults.FAIL_EVAL_ENV}=1: this tau evaluation fails on purpose")
            with stance("force_eager") if stance is not None else contextlib.nullcontext():
                r = evaluate_tau(self.target, drafter, self.prompts, tc.eval_max_new_tokens, pc.target_layer_ids,
                                 on_prompt=after_prompt, batch_size=self.batch_size)
        except Exception as e:
            self.record_failure(step, e, eval_s=time.perf_counter() - t0)
            raise
        rec = EvalRecord(step=int(step), tau_mean=r["tau_mean"], tau_p50=r["tau_p50"], tau_p90=r["tau_p90"],
                         forwards_per_token=r["forwards_per_token"], cache_rollback=r.get("cache_rollback"),
                         loss=loss, prompts=len(self.prompts), eval_s=round(time.perf_counter() - t0, 2),
                         time=time.time())
        append_line(self.path, rec)
        logger.info("tau step=%d tau=%.3f p50=%s p90=%s forwards_per_token=%.3f loss=%s prompts=%d eval_s=%.1f",
                    step, rec.tau_mean, rec.tau_p50, rec.tau_p90, rec.forwards_per_token,
                    "-" if loss is None else f"{loss:.3f}", len(self.prompts), rec.eval_s)
        return rec.to_json()

    def record_failure(self, step: int, error: BaseException | str, stage: str = "eval",
                       eval_s: float | None = None) -> dict[str, Any]:
        """Append the record of a failed evaluation to ``eval.jsonl`` and return it (``record_failure``)."""
        return record_failure(self.path, step, error, stage=stage, eval_s=eval_s)


def record_failure(path: str | Path, step: int, error: BaseException | str, stage: str = "eval",
                   eval_s: float | None = None) -> dict[str, Any]:
    """Append the record of a failed evaluation to the ``eval.jsonl`` at ``path`` and return it: ``{"step",
    "tau_mean": None, "error": "<type>: <message>" (one line, at most 500 characters; a string ``error`` is taken
    as it is), "stage" (``eval``; ``load`` when the target or the prompts did not load; ``weights`` when the
    drafter's weights did not; ``process`` when the evaluator process died or fell silent), "eval_s", "time"}``.
    Never raises (a full disk is logged)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())[:500]
    rec = EvalRecord(step=int(step), tau_mean=None, error=text, stage=stage,
                     eval_s=None if eval_s is None else round(eval_s, 2), time=time.time())
    try:
        append_line(path, rec)
    except OSError as e:
        logger.error("tau_eval_record_failed path=%s error=%s", path, e)
    return rec.to_json()

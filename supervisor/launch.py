"""The one entry into the supervisor: a run resolved (``plan_run``), then started and seen to its end
(``launch``). ``cli/train.py`` parses the flags, calls these two and prints; nothing of a run's start-up lives
in ``cli/``.

``plan_run(cfg)``: the run directory made ready (``supervisor.resume.prepare_run_dir``), the run resolved
(``supervisor.runplan.resolve_run``: topology, batch plan, slot sizes), and a ``--resume`` checked against the
data, the plan and the draft vocabulary it trained with. Nothing is started, nothing claimed: ``--plan`` stops
here.

``launch(start)``: the run directory claimed (its lock held until the run is over), the batches of a resumed
run's latest checkpoint read (nothing to do when every planned batch is in it), the supervisor's log
configured, EAGLE-3's draft vocabulary built once, then ``Supervisor.run`` to the end. Returns a
``LaunchResult`` with the exit code and the run's summary (``summary.json``'s content, a
``shared.run.run_records.Summary``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specring.shared.config.run_config import RunConfig
from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import Summary


@dataclass
class RunStart:
    """A resolved run, not yet started: its config, plan (``supervisor.runplan.RunPlan``), the resume record
    (``check_resume_data``'s) and whether its run directory is the new default (``runs/latest`` follows it)."""
    cfg: RunConfig
    plan: Any
    record: Any
    new_default: bool


@dataclass
class LaunchResult:
    """What ``launch`` ended with: the exit code, the summary (None when nothing was started) and a line for
    the user when nothing was run (``nothing_to_resume``)."""
    exit_code: int
    summary: Summary | None = None
    note: str = ""


def plan_run(cfg: RunConfig) -> RunStart:
    """Resolve ``cfg`` into a ``RunStart`` (module docstring). Raises ``ConfigError`` naming the flag, the file or
    the mismatch of a resume."""
    from specring.supervisor.resume import check_resume_data, check_resume_draft_vocab, prepare_run_dir
    from specring.supervisor.runplan import resolve_run

    new_default = prepare_run_dir(cfg)
    plan = resolve_run(cfg)
    record = check_resume_data(cfg, plan)  # a resume onto other data or another plan stops here
    check_resume_draft_vocab(cfg, plan)    # EAGLE-3: the checkpoint's own draft vocabulary, in the plan too
    return RunStart(cfg, plan, record, new_default)


def launch(start: RunStart, say: Callable[[str], None] = print) -> LaunchResult:
    """Run ``start`` to its end (module docstring); ``say`` prints the lines a user should see before the run's
    own progress (the draft vocabulary built). Raises ``ConfigError`` (a run directory held by another run, a bad
    draft vocabulary, a node refused) and ``supervisor.nodes.RendezvousError`` (the nodes did not meet); the run
    directory's lock is released on every path."""
    from specring.supervisor.resume import claim_run_dir, prepare_draft_vocab, read_checkpoint_batches

    cfg, plan = start.cfg, start.plan
    lock = claim_run_dir(cfg, start.new_default, start.record)  # held until the run is over
    try:
        trained: set[int] = set()
        updated: set[int] = set()
        if cfg.resume:
            updated, skipped = read_checkpoint_batches(Path(cfg.run_dir))
            trained = updated | skipped
            if all(b.batch_id in trained for b in plan.order):
                return LaunchResult(0, note=f"nothing to resume: all {len(plan.order)} planned batches of "
                                            f"{cfg.run_dir} are in its latest checkpoint (see its summary.json)")
        from specring.shared.process.logs import configure_logging
        configure_logging("supervisor", log_file=RunDir(cfg.run_dir).log_file("supervisor"))
        # EAGLE-3: the draft vocabulary, built once from the data (read back, never rebuilt, on --resume)
        if prepare_draft_vocab(cfg, plan) == "built":
            say(f"draft vocabulary: {plan.draft_vocab_size} of the target's {plan.vocab_size} tokens, the most "
                f"frequent loss-carrying ones of {cfg.data.data} -> {RunDir(cfg.run_dir).draft_vocab_file}")
        from tqdm.contrib.logging import logging_redirect_tqdm

        from specring.supervisor.supervisor import Supervisor
        sup = Supervisor(cfg, plan, trained=trained, updated_before=len(updated) if cfg.resume else 0)
        with logging_redirect_tqdm():
            outcome = sup.run()
        return LaunchResult(outcome.exit_code, summary=sup.records.summary)
    finally:
        lock.close()

"""``launch.py train``: flags and ``--config FILE`` onto the configuration (``specring.cli.flags``, derived
from the declaration in ``specring.shared.config.run_config``), the run resolved
(``specring.supervisor.launch.plan_run``), then printed (``--plan``, with the producer:consumer ratio that balances the
run's shape, from the rates a previous run of the same shape recorded: ``specring.shared.process.balance``) or run
(``specring.supervisor.launch.launch``) and its summary line printed.

Flags given on the command line override the file; everything is validated before any process starts, and
errors name the flag.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from specring.cli.flags import build_parser, config_from_args, cpu_default_lines
from specring.cli.ops import _fmt
from specring.shared.errors import ConfigError
from specring.shared.run.run_dir import RunDir

__all__ = ["build_parser", "config_from_args", "train_main"]

log = logging.getLogger(__name__)




def train_main(argv: list[str]) -> int:
    """``launch.py [train] ...``: resolve and run (or print with ``--plan``). Returns the exit code.

    Signals: every one of ``shared.process.procs.STOP_SIGNALS`` (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1/2, ...) is a
    graceful stop. Once the supervisor runs, it handles them (consumers checkpoint, ``summary.json``, exit 130);
    before that (planning, the data digest, claiming the run directory) one ends the command with 130 and a
    line naming it, nothing started. Lines printed to a terminal that hung up are dropped, not raised."""
    from specring.shared.process.procs import install_stop_handlers, restore_handlers

    def before_the_run(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = install_stop_handlers(before_the_run)
    try:
        return _train_main(argv)
    except KeyboardInterrupt as e:
        _say(f"interrupted ({e or 'SIGINT'}): the command stopped outside the run's loop (nothing was left "
             f"running)")
        return 130
    finally:
        restore_handlers(old)


def _say(text: str) -> None:
    """``print(text, file=sys.stderr)``, dropped when stderr is gone (a closed terminal: EIO; a closed pipe)."""
    try:
        print(text, file=sys.stderr)
    except (OSError, ValueError):
        pass


def _train_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from specring.supervisor.launch import launch, plan_run
    from specring.supervisor.nodes import RendezvousError
    try:
        cfg = config_from_args(args)
        if cfg.resume:
            changed = "; changed: " + ", ".join(cfg.resume_changes) if cfg.resume_changes else ""
            print(f"resuming {cfg.run_dir} with the configuration saved in it{changed}", file=sys.stderr)
        start = plan_run(cfg)
        if args.plan:
            print(start.plan.describe(cfg))
            from specring.shared.paths import runs_dir
            from specring.shared.process.balance import balance_lines
            print("\n".join(balance_lines(cfg.to_dict(), [runs_dir(), Path(cfg.run_dir).parent])))
            lines = cpu_default_lines(cfg)
            if lines:
                print("CPU defaults (every device is CPU; a flag or --config value replaces them):")
                print("\n".join("  " + x for x in lines))
            return 0
        result = launch(start, say=_say)
    except (ConfigError, RendezvousError) as e:  # several nodes: refused or not met (summary.json says so too)
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, RendezvousError) else 2
    if result.summary is None:
        _say(result.note)
        return result.exit_code
    s = result.summary
    run = RunDir(cfg.run_dir)
    if cfg.nodes.nnodes > 1 and cfg.nodes.node_rank != 0:  # node 0's summary.json holds the run's ledger
        _say(f"\nnode {cfg.nodes.node_rank} {s.exit_reason}: its producers and consumers served the run whose "
             f"ledger node 0 ({cfg.nodes.master_addr}) keeps in its summary.json; this node's: {run.summary_file}")
        return result.exit_code
    restarts = " ".join(f"producer{k}={v}" for k, v in s.restarts.items())
    line = (f"\nrun {s.exit_reason}: {s.trained_batches}/{s.planned_batches} batches trained "
            f"(duplicates {s.duplicate_batches}, lost {s.lost_batches}, bad {s.bad_batches}, "
            f"skipped {s.skipped_batches}), "
            f"loss {_fmt(s.loss_first)} -> {_fmt(s.loss_last)}, {s.tokens_per_s:,.0f} tokens/s, "
            f"{s.elapsed_s:.0f} s, restarts {restarts}")
    failures = s.eval_failures or []
    if failures:  # training went on, but tau is missing for these steps: never silent
        last = failures[-1]
        line += (f", tau evaluation FAILED {len(failures)}x (steps {[f['step'] for f in failures]}; last: "
                 f"{last['error'][:200]}; see {run.eval_file} and logs/consumer-0.log)")
    if s.tau_last:
        tau = s.tau_last
        line += f"\ntau {tau['tau_mean']:.3f} at step {tau['step']} ({run.eval_file})"
        best = s.tau_best
        if best and best["step"] != tau["step"] and best["tau_mean"] > tau["tau_mean"]:
            line += (f"; best {best['tau_mean']:.3f} at step {best['step']}"
                     + (f" ({best['checkpoint']})" if best.get("checkpoint") else " (no checkpoint at that step)"))
    if s.exit_reason == "nothing_trained":
        line += ("\nnothing was trained: every optimizer step was skipped (no labels: no sample of the batches has "
                 "two adjacent tokens that carry loss, which a DFlash anchor needs; or non-finite losses); "
                 "check the data's loss_mask (`launch.py prepare` names such rows no_anchor)")
    line += f"\nreport: {write_run_report(cfg.run_dir)}"
    line += f"\nsummary: {run.summary_file}"
    if s.remaining_batches:
        line += (f"\n{s.remaining_batches} batches still to train (not reached, or trained after the last "
                 f"checkpoint); continue with "
                 f"`python launch.py train --run-dir {cfg.run_dir} --resume`")
    _say(line)
    return result.exit_code


def write_run_report(run_dir: str | Path) -> str:
    """Write ``RUN_DIR/report/`` (``specring.supervisor.report``) at the end of a run; returns the path of its
    ``index.html``, or ``not written (...)`` saying why: a report never changes a run's outcome."""
    try:
        from specring.supervisor.report import write_report
        return str(write_report([run_dir]))
    except Exception as e:  # noqa: BLE001 - matplotlib missing, a full disk: said on the line, the run stands
        log.warning("report not written: %s: %s", type(e).__name__, e)
        return f"not written ({type(e).__name__}: {e}; `launch.py report {run_dir}` tries again)"

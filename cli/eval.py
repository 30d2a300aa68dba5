"""``launch.py eval``: τ of a checkpoint or export beside the baselines, by real speculative decoding.

The flags are derived from ``shared.commands.command_config.EvalConfig`` (``specring.cli.flags.command_parser``); the
evaluation itself, what its rows are and how they decode, is ``specring.shared.commands.evaluation`` (its docstring, and
docs/evaluation.md for the standard setting).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specring.cli.flags import command_config, command_parser
from specring.shared.commands.command_config import EvalConfig
from specring.shared.errors import ConfigError

logger = logging.getLogger(__name__)


HELP_EXAMPLES = """\
examples:
  launch.py eval --drafter runs/latest                  the run's latest checkpoint on the demo held-out split
  launch.py eval --drafter exported/ --target Qwen/Qwen3-8B --data data/heldout.arrow --num-prompts 64
  launch.py eval --baselines-only --target /models/Qwen3-8B --data data/heldout.arrow
  launch.py eval --drafter runs/latest --temperature 0.7 --top-p 0.95 --sampling-seed 1   speculative sampling"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py eval``, derived from ``EvalConfig``: its options grouped by concern, each with
    its default."""
    return command_parser(EvalConfig, "launch.py eval", epilog=HELP_EXAMPLES, description=(
        "Acceptance length tau by real block-verify speculative decoding with the target (greedy, or lossless "
        "speculative sampling with --temperature > 0), next to the baselines (untrained drafter, prompt lookup); "
        "greedy decoding is checked lossless against plain greedy decoding. With --temperature > 0 the greedy row "
        "stays as the speed baseline, and the lossless check is n/a."))


def main(argv: list[str] | None = None) -> int:
    """``launch.py eval``: print the τ table (and write ``--output-json``). Exit code 0; 2 for a bad flag
    or input (an ``--output-json`` that names what the evaluation reads: ``check_eval_output``); 1, with one
    ``error: evaluation failed: <type>: <message>`` line (no traceback), when decoding raised; 1 when, in
    float32, a greedy speculative output differed from greedy decoding (``lossless_verdict``; in 16-bit only a
    warning)."""
    from specring.shared.commands import evaluation
    from specring.shared.process.logs import configure_logging

    try:
        cfg = command_config(EvalConfig, build_parser().parse_args(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging("eval")
    try:
        evaluation.check_eval_output(cfg)
        report = evaluation.run_eval(cfg)
    except (ConfigError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - decoding failed: one clear line, the traceback in the log at debug
        logger.debug("eval failed", exc_info=True)
        evaluation.close_progress_bars()  # the interrupted prompt bar would otherwise share the error's line
        msg = " ".join(str(e).split())
        print(f"error: evaluation failed: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    print("\n".join(evaluation.report_lines(report)))
    if cfg.output_json:
        Path(cfg.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output_json).write_text(json.dumps(report, indent=1) + "\n")
    code, line = evaluation.lossless_verdict(report)
    if line:
        print(line, file=sys.stderr)
    return code

"""``launch.py report RUN_DIR [RUN_DIR ...] [--output DIR] [--eval FILE ...]``: a run you can look at.

The page and its plots are drawn by ``specring.supervisor.report`` (its docstring lists them); this module parses
the command (its flags derived from ``shared.commands.command_config.ReportConfig`` by
``specring.cli.flags.command_parser``) and calls ``write_report``.
"""

from __future__ import annotations

import argparse
import sys

from specring.cli.flags import command_config, command_parser
from specring.cli.main import description
from specring.shared.commands.command_config import ReportConfig
from specring.shared.errors import ConfigError
from specring.supervisor.report import write_report


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py report``, derived from ``ReportConfig``."""
    return command_parser(
        ReportConfig, "launch.py report",
        description=description("report") + " One self-contained HTML page (plots embedded, opens without "
        "network) and the plots as PNG files: loss and accuracy per draft position against steps and minutes, "
        "held-out tau against GPU-minutes (with the prompt-lookup and untrained lines of --eval files), target "
        "tokens/s and draft positions/s, ring occupancy, producer duty cycle and consumer starvation, restarts, "
        "hangs and fences on the time axes, and the summary and configuration as tables. Several run "
        "directories share the axes. What is missing or truncated is named on the page.",
        epilog="examples:\n"
               "  launch.py report runs/latest                              RUN_DIR/report/index.html\n"
               "  launch.py report runs/a runs/b --output reports/a-vs-b    two runs on shared axes\n"
               "  launch.py eval --drafter runs/a --output-json a.json && launch.py report runs/a --eval a.json")


def main(argv: list[str] | None = None) -> int:
    """``launch.py report``: write the report and print the path of its ``index.html``. Exit code 0; 2 when a
    run directory does not exist or an ``--eval`` file is unreadable; 1 when the report cannot be written (a
    read-only or full disk)."""
    ap = build_parser()
    try:
        cfg = command_config(ReportConfig, ap.parse_args(argv))
    except ConfigError as e:
        ap.error(str(e))
    try:
        page = write_report(cfg.run_dirs, cfg.output or None, cfg.eval)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: the report cannot be written: {e}", file=sys.stderr)
        return 1
    print(f"report: {page}")
    return 0



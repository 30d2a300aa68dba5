"""``launch.py report RUN_DIR [RUN_DIR ...] [--output DIR] [--eval FILE ...]``: a run you can look at.

The page and its plots are drawn by ``specring.supervisor.report`` (its docstring lists them); this module parses
the command and calls ``write_report``.
"""

from __future__ import annotations

import argparse
import sys

from specring.cli.flags import CommandHelpFormatter
from specring.cli.main import description
from specring.supervisor.report import write_report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="launch.py report", formatter_class=CommandHelpFormatter,
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
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: compared)")
    ap.add_argument("--output", default=None,
                    help="directory for index.html and the PNGs (default: RUN_DIR/report for one run, "
                         "./reports/A-vs-B for several)")
    ap.add_argument("--eval", action="append", default=[], metavar="FILE",
                    help="an eval JSON of `launch.py eval --output-json` (repeatable): its prompt-lookup and "
                         "untrained rows become lines on the tau plot")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``launch.py report``: write the report and print the path of its ``index.html``. Exit code 0; 2 when a
    run directory does not exist or an ``--eval`` file is unreadable; 1 when the report cannot be written (a
    read-only or full disk)."""
    args = build_parser().parse_args(argv)
    try:
        page = write_report(args.run_dirs, args.output, args.eval)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: the report cannot be written: {e}", file=sys.stderr)
        return 1
    print(f"report: {page}")
    return 0



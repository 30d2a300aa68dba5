#!/usr/bin/env python3
"""specring command line: ``prepare``, ``train`` (the default), ``eval``, ``export``, ``status``,
``restart``, ``clean``, ``bench``.

This file only dispatches: each subcommand's flags and work live in the module that owns them.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "prepare": ("shared.prepare", "main"),
    "train": ("supervisor.cli", "train_main"),
    "status": ("supervisor.cli", "status_main"),
    "restart": ("supervisor.cli", "restart_main"),
    "clean": ("supervisor.cli", "clean_main"),
    "eval": ("consumer.evaluate", "main"),
    "export": ("consumer.export", "main"),
    "bench": ("supervisor.cli", "bench_main"),
}


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand (``train`` when none is named); returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nusage: launch.py [COMMAND] [FLAGS]   (COMMAND --help for its flags)")
        print("commands: " + ", ".join(COMMANDS))
        return 0
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    module, func = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())

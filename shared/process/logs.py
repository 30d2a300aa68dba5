"""Logging set-up: one format for every process and command, configured once per process.

A line reads ``<HH:MM:SS> <prefix> <LEVEL> <logger>: <message>``; the prefix names the process
(``supervisor``, ``producer-1/g2``: role, index and generation; ``eval``, ``export``). Modules log through
``logging.getLogger(__name__)`` and never configure anything themselves. Imports nothing but the standard
library, so a command that needs neither torch nor ZeroMQ can use it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def configure_logging(prefix: str, level: int = logging.INFO, log_file: str | Path | None = None) -> None:
    """Send log lines as ``<time> <prefix> <level> <logger>: <message>`` to stderr, and also to ``log_file``
    (appended, its directory created) when given; replaces whatever handlers the root logger had."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    formatter = logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level)

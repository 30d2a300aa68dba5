"""Where specring's own files are, and where a run's files go: the one place that knows.

* Package files: the fixture target (``assets/tiny-code-lm``, package data of ``specring.assets`` in a wheel)
  and, in a checkout only, ``benchmarks/``. Found from this file, so they are right wherever specring is
  installed or checked out.
* Work files: runs (``runs/``) and the demo corpus (``data/demo/``) go under the **current directory**, as a
  user running a tool expects; nothing is written inside the installed package.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]   # the checkout, or site-packages/specring
IMPORT_ROOT = Path(__file__).resolve().parents[2] if (PACKAGE_ROOT / "__init__.py").is_file() else PACKAGE_ROOT
DEFAULT_TARGET = PACKAGE_ROOT / "assets" / "tiny-code-lm"
BENCHMARKS_DIR = PACKAGE_ROOT / "benchmarks"
IPC_PATH_MAX = 100  # characters of an ipc socket's absolute path (Linux's sun_path: 108 bytes, NUL included)


def runs_dir() -> Path:
    """``./runs``: where new runs and the ``runs/latest`` link go."""
    return Path.cwd() / "runs"


def work_root() -> Path:
    """The directory whose ``data/demo`` holds the demo corpus: the current directory."""
    return Path.cwd()


def demo_dir() -> Path:
    """``./data/demo``: the demo corpus built on first use."""
    return work_root() / "data" / "demo"

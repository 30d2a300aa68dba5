"""Driving the real launcher from outside: start ``launch.py train``, find a child's pid, kill everything.

What ``benchmarks/e2e.py`` and the system tests (``tests/system/launcher_util.py``) both need; the run's own
state comes from ``specring.supervisor.status`` (``status.json``). Benchmarks never import tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from specring.supervisor.status import read_status_rows

REPO = Path(__file__).resolve().parents[1]  # the checkout: launch.py


def start_launcher(args: list[str], env: dict | None = None, log_path: Path | None = None) -> subprocess.Popen:
    """Start ``launch.py train ARGS`` in its own process group; output to ``log_path``."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, str(REPO / "launch.py"), "train", *args], cwd=REPO, env=full_env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def child_pid(run_dir: Path, role: str, index: int, min_generation: int = 1) -> int | None:
    """Pid of a running child with at least ``min_generation`` (None if not running yet)."""
    for r in read_status_rows(run_dir):
        if r["role"] == role and r["index"] == index and r["state"] == "running" and r["generation"] >= min_generation:
            if r["pid"] and psutil.pid_exists(r["pid"]):
                return r["pid"]
    return None


def descendants(pid: int) -> list[int]:
    """Pids of every descendant of ``pid`` (``[]`` once it is gone)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen, pids: list[int] = ()) -> None:
    """SIGKILL the launcher's group and any known child pids (each child has its own group)."""
    for pid in list(pids) + descendants(proc.pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass

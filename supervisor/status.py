"""``RUN_DIR/status.json``: one row per child process, rewritten by the supervisor about once a second.

The file is the run's state for tools that do not talk to the socket (benchmarks, tests, a person with
``cat``); ``launch.py status`` asks the live supervisor instead and gets the same rows. It is replaced
atomically (written aside, then renamed), so a reader sees a whole file or the previous one, never a torn
write. It says nothing once the supervisor has exited: the rows are those of its last second.

A row is a ``shared.run.run_records.StatusRow`` (its docstring lists the figures): ``role``, ``index``, ``pid``,
``generation``, ``state``, ``heartbeat_age_s`` (None before Hello), ``tokens_per_s``, ``gpu_mem_bytes``,
``restarts``, ``work``/``work_s`` (what the main thread is busy with, from its last heartbeat), the monitor's psutil
figures (``cpu_percent``, ``rss_bytes``, ``threads``), for a producer ``duty_cycle`` (fraction of the time since
its first batch spent on forward + capture + slot write, the rest waiting for a lease) and ``ring``: its slot
counts by state, and for a consumer ``starvation`` (fraction of the time since its first batch spent waiting for a
delivered slot); both None before the first batch or from a child that does not report them
(``shared.process.balance``). Where the file lives and how it is replaced: ``shared.run.run_dir.RunDir.write_status``.
"""

from __future__ import annotations

import os
from pathlib import Path

from specring.shared.run.run_dir import RunDir
from specring.shared.run.run_records import StatusFile, StatusRow


def write_status(run_dir: str | Path, run_id: str, rows: list[StatusRow]) -> None:
    """Replace ``run_dir/status.json`` with ``rows`` (and this process's pid and the run id)."""
    RunDir(run_dir).write_status(StatusFile(pid=os.getpid(), run_id=run_id, rows=rows))


def read_status_rows(run_dir: str | Path) -> list[dict]:
    """The process rows of ``run_dir/status.json`` as plain dicts, as written (for tools and tests that index them;
    ``[]`` before the supervisor has written it)."""
    status = RunDir(run_dir).read_status()
    return [r.to_json() for r in status.rows] if status is not None else []


# ------------------------------------------------------------ a row's figures as `launch.py status` prints them
def status_work(row: StatusRow) -> str:
    """``batch 17 for 3.2s`` (what the child's main thread is on, from its last heartbeat), ``-`` when idle."""
    what, secs = row.work, row.work_s
    return f"{what} for {secs:.1f}s" if what and isinstance(secs, (int, float)) else "-"


def status_pct(x, none: str = "-") -> str:
    """``0.934`` as ``93%``; ``none`` for a missing figure (e.g. the duty cycle of a consumer)."""
    return none if not isinstance(x, (int, float)) or isinstance(x, bool) else f"{x:.0%}"


def status_mib(x):
    """Bytes as MiB (None stays None)."""
    return None if x is None else x / 2**20


def status_num(x, spec: str) -> str:
    """``x`` formatted with ``spec``; ``-`` for a missing figure."""
    return "-" if x is None else format(x, spec)

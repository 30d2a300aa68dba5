"""Signals other than SIGINT and SIGTERM, with the real launcher (issue 27, kind 6).

A launcher whose terminal closes (the launcher is the session leader of a pseudo-terminal, as a login shell's
job is, and the terminal's master side is closed: the kernel sends SIGHUP, and from then on every write to the
terminal fails with EIO) stops as on SIGINT: the consumer writes its checkpoint, ``summary.json`` says
``interrupted`` with nothing trained after the last checkpoint, the rings and ``coord.sock`` are gone, exit 130.
Every other signal of ``shared.process.procs.STOP_SIGNALS`` takes the same path (``tests/unit/test_stop_signals.py``).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import subprocess
import sys
import termios

import pytest

from tests.support import REPO
from tests.system.launcher_util import run_id_of, segments_of, small_flags, summary, wait_for

pytestmark = pytest.mark.timeout(240)


def _controlling_tty(fd: int):
    def preexec():  # the launcher leads a new session whose controlling terminal is the pty
        os.setsid()
        fcntl.ioctl(fd, termios.TIOCSCTTY, 0)
    return preexec


def _start_on_pty(flags):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), "train", *flags], cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=_controlling_tty(slave), close_fds=True)
    os.close(slave)
    return proc, master


def _drain(master: int, out: bytearray) -> None:
    """Read what the launcher wrote to its terminal so far (it must never block on a full pty)."""
    import select
    while select.select([master], [], [], 0)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            return
        if not chunk:
            return
        out += chunk


def _check_graceful_stop(run_dir, code: int, log: str) -> None:
    assert code == 130, log[-3000:]
    s = summary(run_dir)
    assert s["exit_reason"] == "interrupted", s["exit_reason"]
    assert s["trained_batches"] > 0
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    assert "action=graceful_stop" in sup
    assert not segments_of(run_id_of(run_dir))
    assert not (run_dir / "coord.sock").exists()


def test_a_closed_terminal_stops_the_run_gracefully(dataset, tmp_path):
    run_dir = tmp_path / "run"
    flags = small_flags(dataset, run_dir, 400, checkpoint_every=2)
    proc, master = _start_on_pty(flags)
    out = bytearray()
    try:
        wait_for(lambda: _drain(master, out) or (run_dir / "checkpoints" / "latest").is_file(), 150,
                 "the first checkpoint")
        os.close(master)                    # the terminal goes away: SIGHUP, then EIO on every write to it
        master = -1
        code = wait_for(lambda: (_drain(master, out) if master >= 0 else None) or proc.poll() is not None, 120,
                        "the launcher to stop") and proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if master >= 0:
            os.close(master)
    sup = (run_dir / "logs" / "supervisor.log").read_text()
    assert "signal=SIGHUP count=1 action=graceful_stop" in sup, sup[-3000:]
    _check_graceful_stop(run_dir, code, out.decode(errors="replace") + sup)
    s = summary(run_dir)
    trained_steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{len(trained_steps):06d}", (latest, trained_steps[-3:])   # nothing to train again
    assert s["remaining_batches"] == s["planned_batches"] - s["trained_batches"]

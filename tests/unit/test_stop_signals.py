"""Every terminating signal a launcher meets and can catch is a graceful stop (issue 27, kind 6; the launcher on a
closed terminal: tests/system/test_signals.py): the set (``shared.process.procs.STOP_SIGNALS``), the supervisor's
handler for each (a repeated SIGHUP never escalates to a hard stop), and ``train`` before its supervisor runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from specring.shared.process.procs import STOP_SIGNALS, install_stop_handlers, restore_handlers
from tests.support import REPO

DOCUMENTED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU")


def test_the_stop_signals_are_the_documented_ones():
    names = {s.name for s in STOP_SIGNALS}
    assert set(DOCUMENTED) <= names, names
    assert not names & {"SIGKILL", "SIGSTOP", "SIGALRM", "SIGPIPE", "SIGCHLD", "SIGSEGV"}
    readme = (REPO / "README.md").read_text()
    for name in DOCUMENTED:
        assert name in readme.split("## Signals")[1].split("\n## ")[0], name


@pytest.fixture
def supervisor(tmp_path):
    from specring.cli.flags import build_parser, config_from_args
    from specring.supervisor.supervisor import Supervisor

    cfg = config_from_args(build_parser().parse_args(["--run-dir", str(tmp_path / "run"), "--producers", "cpu",
                                                      "--consumers", "cpu"]))
    return Supervisor(cfg, plan=None)


@pytest.mark.parametrize("sig", [s for s in STOP_SIGNALS if s != signal.SIGINT], ids=lambda s: s.name)
def test_each_stop_signal_stops_the_supervisor_gracefully(supervisor, sig):
    old = install_stop_handlers(supervisor._on_signal)
    try:
        os.kill(os.getpid(), sig)
        assert supervisor.context.stop_reason == "interrupted" and supervisor.context.signals == 1
        if sig == signal.SIGHUP:   # the shell of a dropped ssh session passes the hang-up on: the same stop
            os.kill(os.getpid(), signal.SIGHUP)
            assert supervisor.context.signals == 1
        os.kill(os.getpid(), signal.SIGTERM if sig != signal.SIGTERM else signal.SIGQUIT)
        assert supervisor.context.signals == 2   # a second, other signal: the hard stop
    finally:
        restore_handlers(old)


SIGNAL_WHILE_PLANNING = r"""
import os, signal, sys
from specring.cli import train
plan = train.config_from_args
def config_from_args(args):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return plan(args)
train.config_from_args = config_from_args
sys.exit(train.train_main(["--plan", "--producers", "cpu", "--consumers", "cpu"]))
"""


@pytest.mark.parametrize("name", ["SIGHUP", "SIGUSR1", "SIGQUIT"])
def test_a_signal_before_the_supervisor_runs_ends_train_with_130(tmp_path, name):
    out = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_PLANNING, name], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 130, (out.returncode, out.stderr[-2000:])
    assert f"interrupted ({name})" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]

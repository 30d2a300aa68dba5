"""Unit tests: whether a run directory is held is the launcher's flock on RUN_DIR/.lock, never a pid."""

from __future__ import annotations

import fcntl
import json
import os

from specring.shared.run.run_dir import RunDir


def run_dir_held(path):
    return RunDir(path).held()


def supervisor_alive(path):
    return RunDir(path).supervisor_pid()


def stale_sockets(path):
    return RunDir(path).stale_sockets()


def test_a_held_lock_says_alive_whatever_pid_topology_records(tmp_path):
    # pid 1 is what every supervisor started as a container's first process records; here it is init
    (tmp_path / "topology.json").write_text(json.dumps({"supervisor_pid": 1}))
    (tmp_path / "coord.sock").write_text("")
    assert not run_dir_held(tmp_path) and supervisor_alive(tmp_path) is None
    assert stale_sockets(tmp_path) == [tmp_path / "coord.sock"]
    with open(tmp_path / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert run_dir_held(tmp_path) and supervisor_alive(tmp_path) == 1
        assert stale_sockets(tmp_path) == [], "the socket of a held run directory is not stale"
    assert not run_dir_held(tmp_path) and supervisor_alive(tmp_path) is None


def test_a_probe_does_not_keep_the_launcher_from_claiming(tmp_path):
    for _ in range(20):
        run_dir_held(tmp_path)  # no lock file yet: nothing is created
    assert not (tmp_path / ".lock").exists()
    (tmp_path / ".lock").write_text("")
    assert not run_dir_held(tmp_path)
    fd = os.open(tmp_path / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the probe released its shared lock
    finally:
        os.close(fd)

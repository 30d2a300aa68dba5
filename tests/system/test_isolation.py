"""System tests: runs, children and peers stay apart from each other (issue 14, items 1-3).

* Two runs whose processes live in different PID namespaces but share ``/dev/shm`` (``docker --ipc=host``,
  a shared volume): neither start-up, nor ``launch.py clean``, nor ``launch.py status`` may mistake the
  other run's pids for its own, and a restarted producer of either still finds its ring.
* Processes that a child started (target code's helpers, in the child's process group or in a session of
  their own) do not outlive the child's restart, nor the run.
* A client of the coordinator socket that sends thousands of commands and never reads its answers (or
  sends garbage) stalls neither training, nor ``launch.py status``, nor SIGTERM.

Each test starts the real launcher, kills real children, and cleans up stragglers in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import zmq

from benchmarks.launcher import child_pid, kill_tree, start_launcher
from specring.shared.transport import messages as m
from specring.shared.transport.ring import sweep_stale
from specring.supervisor.status import read_status_rows as status_rows
from tests.support import REPO
from tests.system.launcher_util import (
    PID_NAMESPACE,
    fault_helpers,
    metrics_batch_ids,
    pid_namespace_problem,
    process_alive,
    run_id_of,
    segments_of,
    small_flags,
    summary,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)


def _host_pid(run_dir: Path, module: str, index: int) -> int | None:
    """Host pid of the child ``python -m module --run-dir run_dir --index index`` (whatever its namespace)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if module in cmd and str(run_dir) in cmd and "--index" in cmd and cmd[cmd.index("--index") + 1] == str(index):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    return p.pid
            except psutil.NoSuchProcess:
                pass
    return None


def _running(run_dir: Path, role: str, index: int) -> bool:
    """The supervisor reports ``role-index`` running (its pid may belong to another PID namespace)."""
    return any(r["role"] == role and r["index"] == index and r["state"] == "running" for r in status_rows(run_dir))


def _exactly_once(run_dir: Path, planned: int) -> dict:
    s = summary(run_dir)
    ids = metrics_batch_ids(run_dir)
    assert s["exit_reason"] == "done" and s["lost_batches"] == 0 and s["duplicate_batches"] == 0, s
    assert sorted(ids) == sorted(set(ids)) and len(ids) == planned, (len(ids), s)
    return s


def test_runs_in_other_pid_namespaces_sharing_dev_shm_leave_each_other_alone(dataset, tmp_path):
    """Run A in this PID namespace, run B in a new one (its supervisor is pid 1 there), one /dev/shm.
    B's start-up sweep keeps A's live segments; ``launch.py clean`` and ``status`` here keep and see B's;
    a SIGKILLed producer of each run comes back on its own ring; both runs train every batch once."""
    problem = pid_namespace_problem()
    if problem:
        pytest.skip(problem)
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    proc_a = start_launcher(small_flags(dataset, run_a, 2000, checkpoint_every=1000), log_path=tmp_path / "a.log",
                            env={"SPECRING_SLOW_FORWARD_S": "1"})  # A idles along: B gets the cores
    proc_b = None
    try:
        wait_for(lambda: child_pid(run_a, "producer", 0) and child_pid(run_a, "producer", 1), 120, "run A's producers")
        segs_a = segments_of(run_id_of(run_a))
        assert len(segs_a) == 2, segs_a
        args_b = small_flags(dataset, run_b, 40)
        proc_b = subprocess.Popen([*PID_NAMESPACE, sys.executable,
                                   str(REPO / "launch.py"), "train", *args_b], cwd=REPO,
                                  # B's forwards slowed a little too: it must still run while clean and status
                                  # here are started (each a new interpreter; under load B finished first)
                                  env=dict(os.environ, PYTHONUNBUFFERED="1", SPECRING_SLOW_FORWARD_S="0.5"),
                                  stdout=open(tmp_path / "b.log", "wb"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: _running(run_b, "producer", 0) and _running(run_b, "producer", 1), 120,
                 "run B's producers (in their own PID namespace)")
        assert json.loads((run_b / "topology.json").read_text())["supervisor_pid"] == 1
        assert segments_of(run_id_of(run_a)) == segs_a, "run B's start-up sweep removed run A's live segments"
        segs_b = segments_of(run_id_of(run_b))
        assert len(segs_b) == 2, segs_b

        out = subprocess.run([sys.executable, "launch.py", "clean", "--run-dir", str(run_b)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert segments_of(run_id_of(run_b)) == segs_b, f"clean here removed run B's live segments: {out.stdout}"
        assert (run_b / "coord.sock").exists(), f"clean here removed run B's live socket: {out.stdout}"
        out = subprocess.run([sys.executable, "launch.py", "status", "--run-dir", str(run_b)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "producer-0" in out.stdout, (out.stdout, out.stderr)

        os.kill(_host_pid(run_b, "specring.producers.main", 0), signal.SIGKILL)  # B's restart attaches its ring again
        os.kill(child_pid(run_a, "producer", 1), signal.SIGKILL)
        wait_for(lambda: child_pid(run_a, "producer", 1, 2), 60, "run A's producer 1 back")
        assert proc_b.wait(timeout=150) == 0, (tmp_path / "b.log").read_text()[-3000:]
        s_b = _exactly_once(run_b, 40)
        assert s_b["restarts"]["0"] >= 1, s_b
        assert segments_of(run_id_of(run_a)) == segs_a
        os.kill(proc_a.pid, signal.SIGINT)
        assert proc_a.wait(timeout=90) == 130, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        for p in (proc_a, proc_b):
            if p is not None and p.poll() is None:
                kill_tree(p)
                for run_dir in (run_a, run_b):  # what a SIGKILLed run leaves, the next start would sweep
                    if (run_dir / "topology.json").is_file():
                        sweep_stale(run_id_of(run_dir))
    assert summary(run_a)["exit_reason"] == "interrupted"
    assert segments_of(run_id_of(run_a)) == [] and segments_of(run_id_of(run_b)) == []
    log_b = (tmp_path / "b.log").read_text()
    assert "does not exist" not in log_b and "FileNotFoundError" not in log_b


def test_processes_a_child_started_do_not_outlive_its_restart_or_the_run(dataset, tmp_path):
    """Every producer starts two ``sleep 600`` helpers (one escapes its process group with setsid). After a
    SIGKILL of producer 0 its helpers are gone before long; after the run (stopped by SIGINT), no helper is
    left at all."""
    run_dir = tmp_path / "run"
    proc = start_launcher(small_flags(dataset, run_dir, 2000, checkpoint_every=1000),
                          env={"SPECRING_FAULT_HELPERS": "1"}, log_path=tmp_path / "launcher.log")
    helpers: list[int] = []
    try:
        pid = wait_for(lambda: child_pid(run_dir, "producer", 0), 120, "producer 0 running")
        wait_for(lambda: len(fault_helpers(run_dir)) == 4, 30, "the producers' helpers")
        first = fault_helpers(run_dir, 0)
        assert len(first) == 2 and all(process_alive(h) for h in first)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: child_pid(run_dir, "producer", 0, 2), 60, "producer 0 generation 2")
        wait_for(lambda: not any(process_alive(h) for h in first), 10,
                 f"the helpers {first} of the killed producer 0 to be gone")
        wait_for(lambda: len(fault_helpers(run_dir)) == 6, 30, "generation 2's helpers")
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=90)
    finally:
        helpers = fault_helpers(run_dir)
        kill_tree(proc, [h for h in helpers if process_alive(h)])
    assert code == 130, (tmp_path / "launcher.log").read_text()[-3000:]
    left = [h for h in helpers if process_alive(h)]
    assert not left, f"helpers outlived the run: {left}"
    assert "kill_orphan" in (tmp_path / "launcher.log").read_text()



ORPHANS_SCRIPT = """
import json, os, subprocess, sys, time
from specring.shared.process.procs import RUN_ID_ENV, become_subreaper, kill_orphans
assert become_subreaper()
env = dict(os.environ, **{RUN_ID_ENV: "run1"})
other = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}
# shells that start a sleep and exit at once: the sleeps become orphans, i.e. children of this process. The
# foreign one never carries the run id (not even between fork and exec: a kill then would be right)
sh = "sleep 60 >/dev/null 2>&1 & echo $!"
ours, foreign = (int(subprocess.run(["sh", "-c", sh], env=e, capture_output=True, text=True,
                                    start_new_session=True).stdout) for e in (env, other))
killed, deadline = [], time.monotonic() + 10
while time.monotonic() < deadline:
    k, pending = kill_orphans(set(), "run1")
    killed += [pid for pid, _ in k]
    if killed and not pending:
        break
    time.sleep(0.02)
alive = lambda pid: os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
print(json.dumps({"killed": killed, "ours": ours, "foreign": foreign, "ours_alive": alive(ours),
                  "foreign_alive": alive(foreign)}))
os.kill(foreign, 9)
"""


def test_a_subreaper_kills_its_runs_orphans_and_leaves_other_orphans_alone():
    """What a supervisor that is a container's pid 1 inherits from other processes (``docker exec ...&``)
    is not killed; its own run's orphans (by their SPECRING_RUN_ID) are, and are reaped."""
    out = subprocess.run([sys.executable, "-c", ORPHANS_SCRIPT], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["killed"] == [r["ours"]] and not r["ours_alive"] and r["foreign_alive"], r


def _steps(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_a_client_that_never_reads_stalls_neither_training_nor_status_nor_signals(dataset, tmp_path):
    """12,000 ``status`` commands and 2,000 garbage frames from a DEALER that never receives: training goes
    on, ``launch.py status`` answers, still after the client is gone, and SIGTERM stops the run."""
    run_dir = tmp_path / "run"
    proc = start_launcher(small_flags(dataset, run_dir, 2000, checkpoint_every=1000), log_path=tmp_path / "l.log")
    zctx = zmq.Context()
    try:
        wait_for(lambda: _steps(run_dir) >= 3, 120, "training to start")
        addr = json.loads((run_dir / "topology.json").read_text())["address"]
        flood = zctx.socket(zmq.DEALER)
        flood.setsockopt(zmq.SNDHWM, 0)  # queue everything: the supervisor's side decides what to do with it
        flood.setsockopt(zmq.LINGER, 0)
        flood.connect(addr)
        status = m.encode(m.Command(action="status"))
        for i in range(12_000):
            flood.send(status)
            if i % 6 == 0:
                flood.send(b"\xc1 not msgpack")
        before = _steps(run_dir)
        wait_for(lambda: _steps(run_dir) >= before + 5, 30, "training to go on while the client never reads")
        out = subprocess.run([sys.executable, "launch.py", "status", "--run-dir", str(run_dir)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "producer-0" in out.stdout, (out.stdout, out.stderr)
        flood.close()
        before = _steps(run_dir)
        wait_for(lambda: _steps(run_dir) >= before + 5, 30, "training to go on after the client left")
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        zctx.destroy(linger=0)
    log = (tmp_path / "l.log").read_text()
    assert code == 130, log[-3000:]
    assert "command_refused" in log and log.count("reject frame") < 100, log[-3000:]
    assert summary(run_dir)["exit_reason"] == "interrupted"

"""Helpers for system tests that start the real launcher (``launch.py train``) and kill its children.

Starting the launcher, finding a child's pid and killing them all are ``benchmarks.launcher``'s (the
benchmarks drive the launcher the same way); the fixture paths and ``make_dataset`` are ``tests.support``'s."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil

from tests.support import TARGET


def small_flags(data: Path, run_dir: Path, steps: int, **extra) -> list[str]:
    """Flags for a fast CPU run on the fixture: 2 captured layers, 1 draft layer, block 4, few anchors."""
    flags = {
        "--data": str(data), "--run-dir": str(run_dir), "--target": str(TARGET),
        "--producers": "cpu,cpu", "--consumers": "cpu", "--target-layers": "1,5",
        "--num-draft-layers": "1", "--block-size": "4", "--num-anchors": "16", "--max-tokens": "512",
        "--max-batch-size": "8", "--max-steps": str(steps), "--num-slots": "3", "--lr": "3e-3",
        "--warmup-steps": "2", "--checkpoint-every": "5", "--heartbeat-interval-s": "0.25",
        "--hang-timeout-s": "6",
    }
    flags.update({k if k.startswith("--") else "--" + k.replace("_", "-"): str(v) for k, v in extra.items()})
    out = []
    for k, v in flags.items():
        out += [k, v]
    return out


def wait_for(cond, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``cond()`` until truthy; raise ``AssertionError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def run_id_of(run_dir: Path) -> str:
    """The run id a run's supervisor recorded in ``topology.json``."""
    return json.loads((run_dir / "topology.json").read_text())["run_id"]


def segments_of(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"specring-{run_id}-")]


def metrics_batch_ids(run_dir: Path) -> list[int]:
    """Every batch id listed in ``metrics.jsonl`` (one entry per time it was trained)."""
    out = []
    p = run_dir / "metrics.jsonl"
    for line in p.read_text().splitlines():
        rec = json.loads(line)
        out.extend(int(b) for b in rec["batch_ids"])
    return out


def run_launcher(flags: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> tuple[int, str]:
    """Run ``launch.py train FLAGS`` to its end (output to ``log_path``); returns ``(exit code, its output)``.
    Killed with every process it started, and the wait's ``TimeoutExpired`` raised, if it runs past
    ``timeout_s``."""
    from benchmarks.launcher import kill_tree, start_launcher

    proc = start_launcher(flags, env=env, log_path=log_path)
    try:
        code = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return code, Path(log_path).read_text(errors="replace")


def interrupt_after_checkpoint(flags: list[str], run_dir: Path, log_path: Path, while_running=None,
                               timeout_s: float = 180) -> tuple[int, str]:
    """Start ``launch.py train FLAGS``, wait (up to ``timeout_s``) for its first checkpoint in ``run_dir``, call
    ``while_running()`` (checks of the live run), then SIGINT it and wait up to 90 s for it to stop; returns
    ``(exit code, its output)``. Whatever is still running at the end is killed with everything it started."""
    import signal

    from benchmarks.launcher import kill_tree, start_launcher

    proc = start_launcher(flags, log_path=log_path)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file(), timeout_s, "a checkpoint")
        if while_running is not None:
            while_running()
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return code, Path(log_path).read_text(errors="replace")


def summary(run_dir: Path) -> dict:
    """The run's ``summary.json``; first asserts that the supervisor's handlers never raised on a frame (a
    ``reason=handler_error`` line in ``logs/supervisor.log`` is a bug in our code, which the loop survives by
    dropping the frame, so only the log shows it)."""
    log_path = run_dir / "logs" / "supervisor.log"
    if log_path.exists():
        errors = [x for x in log_path.read_text(errors="replace").splitlines() if "reason=handler_error" in x]
        assert not errors, errors[:3]
    return json.loads((run_dir / "summary.json").read_text())


PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]  # prefix: run a command as pid 1


def pid_namespace_problem() -> str:
    """Why ``PID_NAMESPACE`` cannot run a command here ("" when it can): it needs util-linux's ``unshare`` and
    root (CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    try:
        out = subprocess.run([*PID_NAMESPACE, "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --pid failed: {e}"
    if out.returncode != 0:
        return f"unshare --pid --fork --mount-proc needs root (CAP_SYS_ADMIN): {out.stderr.strip()}"
    return ""


def fault_helpers(run_dir: Path, index: int | str = "*") -> list[int]:
    """Pids of the helper processes that producer ``index`` (default: every producer) of ``run_dir`` started
    under ``SPECRING_FAULT_HELPERS=1`` (from the logs: ``fault helper pid=N``), every generation."""
    out = []
    for log in sorted((run_dir / "logs").glob(f"producer-{index}.log")):
        out += [int(line.split("pid=")[1].split()[0]) for line in log.read_text().splitlines()
                if "fault helper pid=" in line]
    return out


def process_alive(pid: int) -> bool:
    """Whether ``pid`` names a process that has not exited (a zombie counts as exited)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_records_read_back(run_dir: Path) -> None:
    """Every record the run wrote reads back through ``shared.run.run_dir.RunDir`` as its typed record and writes
    again byte for byte (``shared.run.run_records``): ``config.json``, ``topology.json``, ``status.json``,
    ``summary.json`` and each line of ``metrics.jsonl`` and ``eval.jsonl``."""
    from specring.shared.run.run_dir import RunDir
    from specring.shared.run.run_records import EvalRecord, MetricsRecord, StatusFile, Summary, Topology

    run = RunDir(run_dir)
    assert json.dumps(run.read_config().to_dict(), indent=1) == run.config_file.read_text()
    for cls, path, indent in ((Topology, run.topology_file, 1), (StatusFile, run.status_file, None),
                              (Summary, run.summary_file, 1)):
        text = path.read_text()
        assert json.dumps(cls.from_json(json.loads(text)).to_json(), indent=indent) == text, path
    for cls, path in ((MetricsRecord, run.metrics_file), (EvalRecord, run.eval_file)):
        lines = path.read_text().splitlines()
        assert lines, path
        for line in lines:
            assert json.dumps(cls.from_json(json.loads(line)).to_json()) == line, (path, line)

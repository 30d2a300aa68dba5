"""Helpers for system tests that start the real launcher (``launch.py train``) and kill its children."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.ipc as ipc

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "assets" / "tiny-code-lm"


def make_dataset(path: Path, num_samples: int = 48, seed: int = 0) -> Path:
    """A small tokenized dataset of real stdlib code (fixture tokenizer), lengths 48..128, written as Arrow."""
    import sysconfig

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in ("textwrap.py", "bisect.py", "heapq.py", "shlex.py"))
    ids = np.asarray(tok(text)["input_ids"], dtype=np.int32)
    rng = np.random.default_rng(seed)
    rows, masks, src = [], [], []
    pos = 0
    for i in range(num_samples):
        n = int(rng.integers(48, 129))
        if pos + n > len(ids):
            pos = 0
        rows.append(ids[pos:pos + n].tolist())
        masks.append([1] * n)
        src.append(i)
        pos += n
    table = pa.table({
        "input_ids": pa.array(rows, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, type=pa.list_(pa.uint8())),
        "source_file": pa.array([0] * num_samples, type=pa.int32()),
        "source_row": pa.array(src, type=pa.int64()),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return path


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


def start_launcher(args: list[str], env: dict | None = None, log_path: Path | None = None) -> subprocess.Popen:
    """Start ``launch.py train ARGS`` in its own process group; output to ``log_path``."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, str(REPO / "launch.py"), "train", *args], cwd=REPO, env=full_env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(cond, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll ``cond()`` until truthy; raise ``AssertionError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def status_rows(run_dir: Path) -> list[dict]:
    """Process rows from the supervisor's ``status.json`` ([] before it exists)."""
    try:
        return json.loads((run_dir / "status.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def child_pid(run_dir: Path, role: str, index: int, min_generation: int = 1) -> int | None:
    """Pid of a running child with at least ``min_generation`` (None if not running yet)."""
    for r in status_rows(run_dir):
        if r["role"] == role and r["index"] == index and r["state"] == "running" and r["generation"] >= min_generation:
            if r["pid"] and psutil.pid_exists(r["pid"]):
                return r["pid"]
    return None


def descendants(pid: int) -> list[int]:
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


def summary(run_dir: Path) -> dict:
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

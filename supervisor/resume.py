"""The run directory across runs: choosing it, refusing to share it, and resuming from it.

* A fresh run gets ``runs/<UTC time>`` unless ``--run-dir`` names one; ``runs/latest`` points at the newest
  run that passed its start-up checks. ``--resume`` without ``--run-dir`` resumes the run it points at; a
  ``--resume`` of a run that saved no checkpoint trains it from the beginning.
* A run directory whose supervisor is still alive is refused (two supervisors would share a socket).
* A fresh run into a directory that already holds checkpoints is refused (use ``--resume`` or another
  directory) so no earlier result is overwritten.
* ``--resume``: the trained batch ids come from the latest checkpoint (``consumer.checkpoint``); the
  trainer drops the ``metrics.jsonl`` records of steps after that checkpoint (their weights were lost),
  so the final ``metrics.jsonl`` lists every batch exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import psutil

from shared.config import REPO_ROOT, RunConfig
from shared.errors import ConfigError

log = logging.getLogger(__name__)


def supervisor_alive(run_dir: Path) -> int | None:
    """Pid of a live supervisor that owns ``run_dir``, else None."""
    p = run_dir / "topology.json"
    try:
        pid = int(json.loads(p.read_text())["supervisor_pid"])
    except (OSError, ValueError, KeyError):
        return None
    if pid == os.getpid() or not psutil.pid_exists(pid):
        return None
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return pid if "python" in cmd or "specring" in cmd else None


def stale_sockets(run_dir: Path) -> list[Path]:
    """Socket files in ``run_dir`` left by a supervisor that is no longer alive."""
    sock = Path(run_dir) / "coord.sock"
    if sock.exists() and supervisor_alive(Path(run_dir)) is None:
        return [sock]
    return []


def prepare_run_dir(cfg: RunConfig, plan_only: bool = False) -> bool:
    """Pick and check ``cfg.run_dir`` (see module docstring); raises ``ConfigError`` naming ``--run-dir``.

    Returns True when a new ``runs/<UTC time>`` was chosen: the caller then calls ``point_latest`` once the
    run has passed its checks, so a refused start never moves ``runs/latest``. A fresh run into a
    directory without checkpoints, and a ``--resume`` of a run that saved none (it starts again from its
    beginning), clear that directory's earlier ``metrics.jsonl``, ``eval.jsonl``, ``summary.json`` and
    ``tensorboard/``. With ``plan_only`` (``train --plan``) nothing on disk changes."""
    new_default = False
    if cfg.resume:
        cfg.run_dir = resume_dir(cfg.run_dir)
    elif cfg.run_dir in ("", "runs/default"):
        cfg.run_dir = str(REPO_ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
        new_default = True
    run_dir = Path(cfg.run_dir)
    pid = supervisor_alive(run_dir)
    if pid is not None:
        raise ConfigError(f"--run-dir: a run is already going in {run_dir} (supervisor pid {pid}); "
                          f"watch it with `launch.py status --run-dir {run_dir}`")
    ckpts = run_dir / "checkpoints"
    if not cfg.resume and ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir()):
        raise ConfigError(f"--run-dir: {run_dir} already holds checkpoints of an earlier run; "
                          f"continue it with --resume or choose another --run-dir")
    if plan_only:
        return new_default
    for tmp in (ckpts.glob(".step-*.tmp-*") if ckpts.is_dir() else ()):
        shutil.rmtree(tmp, ignore_errors=True)  # a write cut short by a dead consumer: never a checkpoint
    if checkpoint_step_on_disk(run_dir) is None:  # nothing saved: whatever an earlier start logged is void
        if cfg.resume:
            log.warning("resume run_dir=%s has no checkpoint: its batches are trained from the beginning", run_dir)
        for name in ("metrics.jsonl", "eval.jsonl", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
    return new_default


def point_latest(run_dir: str) -> None:
    """Point ``runs/latest`` at ``run_dir`` (a directory under ``runs/``), atomically."""
    latest = REPO_ROOT / "runs" / "latest"
    latest.parent.mkdir(parents=True, exist_ok=True)
    tmp = latest.with_name(f".latest-{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(Path(run_dir).name)
    os.replace(tmp, latest)


def resume_dir(run_dir: str) -> str:
    """The directory ``--resume`` continues: ``run_dir``, or without ``--run-dir`` the run that
    ``runs/latest`` points at."""
    if run_dir not in ("", "runs/default"):
        return run_dir
    latest = REPO_ROOT / "runs" / "latest"
    return str(latest.resolve() if latest.is_symlink() else latest)


def checkpoint_step_on_disk(run_dir: Path) -> int | None:
    """Optimizer step of the checkpoint that ``checkpoints/latest`` names (read from its name, nothing is
    loaded), or None when there is no complete one."""
    from consumer.checkpoint import WEIGHTS_FILE
    ckpts = Path(run_dir) / "checkpoints"
    try:
        name = (ckpts / "latest").read_text().strip()
    except OSError:
        return None
    if not name.startswith("step-") or not name[5:].isdigit() or not (ckpts / name / WEIGHTS_FILE).is_file():
        return None
    return int(name[5:])


def read_trained_from_checkpoint(run_dir: Path) -> set[int]:
    """Batch ids trained up to the latest checkpoint of ``run_dir`` (empty set if there is none)."""
    from consumer.checkpoint import load_checkpoint, latest_checkpoint
    path = latest_checkpoint(Path(run_dir) / "checkpoints")
    if path is None:
        return set()
    state = load_checkpoint(path)[1]
    return {int(b) for b in list(state["trained_batch_ids"]) + list(state.get("skipped_batch_ids", []))}

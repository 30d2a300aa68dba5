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


def prepare_run_dir(cfg: RunConfig) -> bool:
    """Pick and check ``cfg.run_dir`` (see module docstring); changes nothing on disk. Raises
    ``ConfigError`` naming ``--run-dir`` or ``--resume``.

    Returns True when a new ``runs/<UTC time>`` was chosen (``claim_run_dir`` then moves ``runs/latest``;
    ``train --plan`` stops before that)."""
    new_default = False
    latest = latest_link()
    if cfg.resume:
        cfg.run_dir = resume_dir(cfg.run_dir)
    elif cfg.run_dir in ("", "runs/default"):
        if latest.exists() and not latest.is_symlink():
            raise ConfigError(f"--run-dir: {latest} is not the symbolic link specring keeps there; move it away "
                              f"or give --run-dir")
        cfg.run_dir = str(REPO_ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
        new_default = True
    run_dir = Path(cfg.run_dir)
    pid = supervisor_alive(run_dir)
    if pid is not None:
        raise ConfigError(f"--run-dir: a run is already going in {run_dir} (supervisor pid {pid}); "
                          f"watch it with `launch.py status --run-dir {run_dir}`")
    ckpts = run_dir / "checkpoints"
    steps = sorted(p.name for p in ckpts.glob("step-*") if p.is_dir()) if ckpts.is_dir() else []
    if not cfg.resume and (steps or (ckpts / "latest").exists()):
        raise ConfigError(f"--run-dir: {run_dir} already holds checkpoints of an earlier run; "
                          f"continue it with --resume or choose another --run-dir")
    if cfg.resume and (ckpts / "latest").exists() and checkpoint_step_on_disk(run_dir) is None:
        name = (ckpts / "latest").read_text(errors="replace").strip()
        raise ConfigError(f"--resume: {ckpts / 'latest'} names {name!r}, which is not a complete checkpoint "
                          f"(complete ones: {', '.join(steps) or 'none'}); write the name of one of them into it")
    return new_default


def claim_run_dir(cfg: RunConfig, new_default: bool):
    """Take ``cfg.run_dir`` for this launcher, once the run has passed every start-up check.

    Creates the directory, holds an exclusive ``flock`` on ``RUN_DIR/.lock`` (returned: keep it open for the
    life of the run; the kernel drops it if the launcher dies), removes half-written checkpoints, and, when
    no checkpoint was ever saved there, the records of an earlier start (``metrics.jsonl``, ``eval.jsonl``,
    ``summary.json``, ``tensorboard/``: the weights they describe are gone). Moves ``runs/latest`` to a new
    default run. Raises ``ConfigError`` when another launcher holds the directory."""
    import fcntl

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(run_dir / ".lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise ConfigError(f"--run-dir: another launcher is starting or running in {run_dir}") from None
    pid = supervisor_alive(run_dir)
    if pid is not None:  # it set up between our check and the lock
        lock.close()
        raise ConfigError(f"--run-dir: a run is already going in {run_dir} (supervisor pid {pid})")
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        for tmp in ckpts.glob(".step-*.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)  # a write cut short by a dead consumer: never a checkpoint
        for tmp in ckpts.glob(".latest.tmp-*"):
            tmp.unlink(missing_ok=True)
    if checkpoint_step_on_disk(run_dir) is None and not (ckpts / "latest").exists():
        if cfg.resume:
            log.warning("resume run_dir=%s has no checkpoint: its batches are trained from the beginning", run_dir)
        for name in ("metrics.jsonl", "eval.jsonl", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
    if new_default:
        point_latest(cfg.run_dir)
    return lock


def point_latest(run_dir: str) -> None:
    """Point ``runs/latest`` at ``run_dir`` (a directory under ``runs/``), atomically."""
    latest = latest_link()
    latest.parent.mkdir(parents=True, exist_ok=True)
    tmp = latest.with_name(f".latest-{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(Path(run_dir).name)
    try:
        os.replace(tmp, latest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"--run-dir: cannot point {latest} at {run_dir}: {e}") from None


def latest_link() -> Path:
    """``REPO_ROOT/runs/latest``: the link to the newest run, and the default of ``status``/``restart``."""
    return REPO_ROOT / "runs" / "latest"


def resume_dir(run_dir: str) -> str:
    """The directory ``--resume`` continues: ``run_dir``, or without ``--run-dir`` the run that
    ``runs/latest`` points at."""
    if run_dir not in ("", "runs/default"):
        return run_dir
    latest = latest_link()
    try:
        return str(latest.resolve(strict=False) if latest.is_symlink() else latest)
    except (OSError, RuntimeError) as e:  # a link loop
        raise ConfigError(f"--resume: {latest} cannot be followed ({e}); give --run-dir") from None


def checkpoint_step_on_disk(run_dir: Path) -> int | None:
    """Optimizer step of the checkpoint that ``checkpoints/latest`` names (read from its name, nothing is
    loaded), or None when there is no complete one."""
    from consumer.checkpoint import latest_checkpoint
    try:
        path = latest_checkpoint(Path(run_dir) / "checkpoints")
    except (OSError, ValueError):  # latest names a directory without weights, or cannot be read
        return None
    if path is None or not path.name.startswith("step-") or not path.name[5:].isdigit():
        return None
    return int(path.name[5:])


def read_checkpoint_batches(run_dir: Path) -> tuple[set[int], set[int]]:
    """``(updated, skipped)``: batch ids of the latest checkpoint of ``run_dir`` whose steps updated the
    weights, and those whose steps were skipped (no labels, non-finite loss); two empty sets if there is
    no checkpoint. Reads the trainer state only (memory-mapped), not the weights."""
    from consumer.checkpoint import latest_checkpoint, load_trainer_state
    path = latest_checkpoint(Path(run_dir) / "checkpoints")
    if path is None:
        return set(), set()
    state = load_trainer_state(path, mmap=True)
    return ({int(b) for b in state["trained_batch_ids"]}, {int(b) for b in state.get("skipped_batch_ids", [])})


def read_trained_from_checkpoint(run_dir: Path) -> set[int]:
    """Batch ids done up to the latest checkpoint of ``run_dir`` (trained or skipped; empty set if there is
    none); see ``read_checkpoint_batches``."""
    updated, skipped = read_checkpoint_batches(run_dir)
    return updated | skipped

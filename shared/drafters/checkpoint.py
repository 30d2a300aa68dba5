"""Drafter checkpoints on disk: one directory per step, written atomically, and a ``latest`` pointer.

Layout (``checkpoints_dir`` is normally ``run_dir/checkpoints``)::

    checkpoints/
      step-000100/
        drafter.safetensors   trainable weights under their export names + embed_tokens.weight, lm_head.weight
        trainer_state.pt      optimizer, scheduler, RNG states, step, trained batch ids (torch.save)
        dflash_config.json    the drafter config, named by its family (DrafterFamily.config_file: dflash_config.json,
                              dflash2_config.json, eagle3_config.json), which is how a checkpoint's kind is known
      latest                  text: the name of the newest complete step directory ("step-000100")

What is guaranteed:

* A step directory is complete or absent: it is written under a temporary name, every file is fsynced,
  and the directory is renamed into place; only then is ``latest`` replaced, itself through a temporary
  file and ``os.replace``. A crash at any moment leaves ``latest`` naming a complete checkpoint (or no
  ``latest`` at all). Left-over temporaries (``.step-*.tmp-*``, ``.latest.tmp-*``) are removed by the next save.
* ``load_checkpoint`` accepts a step directory, a checkpoints directory (follows ``latest``) or a run
  directory (follows ``checkpoints/latest``); ``resolve_checkpoint`` also accepts an export directory
  (``launch.py export``), which ``load_drafter`` refuses (``specring.cli.export`` loads exports).
* A file that cannot be read (empty, truncated, garbage: a disk that filled, a copy cut short) is named:
  ``read_safetensors``, ``read_json``, ``load_trainer_state`` and ``check_checkpoint_files`` raise
  ``shared.errors.CorruptFile`` with the file's path, never a bare ``SafetensorError``; ``last_good_checkpoint``
  finds the newest step directory whose files all read, which ``--resume`` names when ``latest`` is unreadable.
* Files get the usual modes (``0666 & ~umask``, 0644 under the usual umask), whatever the writer used
  (safetensors writes through a private temporary file, 0600).

Not guaranteed: concurrent writers. Only one process (rank 0) saves.

``$SPECRING_SLOW_CHECKPOINT_S`` (tests and drills only, ``shared.process.faults``) sleeps that many seconds before
the rename, as a large drafter's write would take.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specring.shared.errors import CorruptFile
from specring.shared.json_file import read_json  # noqa: F401 - checkpoint and export readers import it from here
from specring.shared.process import faults
from specring.shared.run.run_dir import LATEST_FILE, WEIGHTS_FILE, RunDir, latest_checkpoint

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "dflash_config.json"   # the DFlash family's (DrafterFamily.config_file); the name older tools look for


def config_files() -> dict[str, str]:
    """``family name -> its checkpoint config file`` for every registered drafter family (``shared.drafters``)."""
    from specring.shared.drafters import NAMES, get_family
    return {name: get_family(name).config_file for name in NAMES}


def step_dir_name(step: int) -> str:
    return f"step-{int(step):06d}"


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (and put it back at once)
    os.umask(mask)
    return mask


def usual_mode(path: str | Path) -> None:
    """Give ``path`` the mode a plain ``open()`` would: ``0666 & ~umask`` for a file, ``0777 & ~umask`` for a
    directory (0644 / 0755 under the usual umask 022)."""
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~_umask())


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` with the usual file mode (``usual_mode``), not the 0600 of its
    temporary file."""
    save_file(tensors, str(path), metadata=metadata)
    usual_mode(path)


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is an export directory (``model.safetensors`` + ``config.json``, no checkpoint)."""
    p = Path(path)
    return (p / "model.safetensors").is_file() and (p / "config.json").is_file() and not (p / WEIGHTS_FILE).is_file()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(checkpoints_dir: str | Path, step: int, tensors: dict[str, torch.Tensor],
                    trainer_state: dict[str, Any], config: dict[str, Any], keep_last: int | None = None,
                    drafter: str = "dflash") -> Path:
    """Write ``step-{step:06d}/`` atomically and point ``latest`` at it; return the step directory.

    ``tensors``: name -> tensor (copied to CPU; tied tensors are stored as separate copies).
    ``keep_last``: when set, older step directories beyond the newest ``keep_last`` are removed.
    ``drafter``: the drafter family's name, which names the config file (``config_files()``).
    """
    config_file = config_files()[drafter]
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST_FILE}.tmp-*"):
        stale.unlink(missing_ok=True)
    name = step_dir_name(step)
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    tmp.mkdir()
    cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_tensors(cpu, tmp / WEIGHTS_FILE, metadata={"format": "pt", "step": str(step)})
    torch.save(trainer_state, tmp / STATE_FILE)
    (tmp / config_file).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in (WEIGHTS_FILE, STATE_FILE, config_file):
        _fsync_file(tmp / f)
    _fsync_dir(tmp)
    slow_s = faults.slow_checkpoint_s()
    if slow_s > 0:
        time.sleep(slow_s)
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        old = root / f".{name}.tmp-old-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    ptr_tmp = root / f".{LATEST_FILE}.tmp-{os.getpid()}"
    ptr_tmp.write_text(name + "\n")
    _fsync_file(ptr_tmp)
    os.replace(ptr_tmp, root / LATEST_FILE)
    _fsync_dir(root)
    logger.info("checkpoint saved step=%d path=%s", step, final)
    if keep_last:
        steps = sorted(p for p in root.glob("step-*") if p.is_dir())
        for p in steps[:-keep_last]:
            shutil.rmtree(p, ignore_errors=True)
    return final


def read_safetensors(path: str | Path, device: str | torch.device = "cpu",
                     keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` (only ``keys`` when given, those of them it holds).

    Raises ``FileNotFoundError`` when it does not exist and ``shared.errors.CorruptFile`` naming it when it is
    not a readable safetensors file (empty, truncated, garbage: safetensors checks the header and that the data
    covers every tensor it declares)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            names = list(f.keys()) if keys is None else [k for k in keys if k in set(f.keys())]
            return {k: f.get_tensor(k) for k in names}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError, ValueError)
        raise CorruptFile(f"{path} is not a readable safetensors file ({path.stat().st_size} bytes: "
                          f"{type(e).__name__}: {e})", path=str(path)) from None


def check_checkpoint_files(step_dir: str | Path) -> None:
    """Check that every file of the step directory ``step_dir`` reads, without loading the tensors: the weights'
    safetensors header and coverage, the trainer state's zip directory (``torch.save`` format), the config JSON.
    Cheap whatever the checkpoint's size. Raises ``FileNotFoundError`` for a missing weights file and
    ``shared.errors.CorruptFile`` naming the first file that does not read."""
    import zipfile

    step_dir = Path(step_dir)
    weights = step_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{step_dir} has no {WEIGHTS_FILE}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001 - SafetensorError
        raise CorruptFile(f"{weights} is not a readable safetensors file ({weights.stat().st_size} bytes: "
                          f"{type(e).__name__}: {e})", path=str(weights)) from None
    state = step_dir / STATE_FILE
    if state.is_file():
        try:
            with zipfile.ZipFile(state) as z:
                if not any(n.endswith("data.pkl") for n in z.namelist()):
                    raise zipfile.BadZipFile("no data.pkl in the archive")
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise CorruptFile(f"{state} is not a readable trainer state ({state.stat().st_size} bytes: "
                              f"{type(e).__name__}: {e})", path=str(state)) from None
    for name in config_files().values():
        if (step_dir / name).is_file():
            read_json(step_dir / name)


def last_good_checkpoint(checkpoints_dir: str | Path) -> tuple[Path | None, list[str]]:
    """``(newest step directory of checkpoints_dir whose files all read (check_checkpoint_files) or None,
    [the problem of each newer one])``: where a run can continue from when ``latest`` is unreadable."""
    problems = []
    for p in sorted((p for p in Path(checkpoints_dir).glob("step-*") if p.is_dir()), reverse=True):
        try:
            check_checkpoint_files(p)
            return p, problems
        except (CorruptFile, FileNotFoundError) as e:
            problems.append(str(e))
    return None, problems


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory from a step directory, a checkpoints directory or a run directory; an export
    directory (``is_export``) is returned as it is.

    Raises ``FileNotFoundError`` naming the path when none of these applies.
    """
    p = Path(path)
    if (p / WEIGHTS_FILE).is_file() or is_export(p):
        return p
    for root in (p, RunDir(p).checkpoints_dir):
        found = latest_checkpoint(root) if (root / LATEST_FILE).is_file() else None
        if found is not None:
            return found
    raise FileNotFoundError(f"no checkpoint at {p} (no {WEIGHTS_FILE}, no latest, no checkpoints/latest)")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """``(tensors, trainer_state, dflash_config_dict)`` of the checkpoint at ``path`` (see ``resolve_checkpoint``).
    Raises ``shared.errors.CorruptFile`` naming a file of it that does not read."""
    step_dir = resolve_checkpoint(path)
    tensors = read_safetensors(step_dir / WEIGHTS_FILE, map_location)
    state = load_trainer_state(step_dir, map_location)
    config = read_json(step_dir / config_files()[drafter_kind(step_dir)])
    return tensors, state, config


def drafter_kind(path: str | Path) -> str:
    """The name of the drafter family (``shared.drafters``) whose checkpoint is at ``path`` (by its config file).
    Raises ``FileNotFoundError`` when it has none."""
    step_dir = resolve_checkpoint(path)
    files = config_files()
    for kind, name in files.items():
        if (step_dir / name).is_file():
            return kind
    raise FileNotFoundError(f"checkpoint {step_dir} has no {' or '.join(files.values())}")


def load_trainer_state(path: str | Path, map_location: str | torch.device = "cpu",
                       mmap: bool = False) -> dict[str, Any]:
    """The trainer state (step, trained batch ids, optimizer, RNG) of the checkpoint at ``path`` alone, without
    the weights; ``{}`` if it has none. ``mmap=True`` maps the file instead of reading it, so a caller that
    wants only the small fields (the supervisor on ``--resume``) does not read a large optimizer state.
    Raises ``shared.errors.CorruptFile`` naming the file when it does not load (empty, truncated, garbage)."""
    state_path = resolve_checkpoint(path) / STATE_FILE
    if not state_path.is_file():
        return {}
    try:
        return torch.load(state_path, map_location=map_location, weights_only=False, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - zip, pickle and storage errors of every kind
        raise CorruptFile(f"{state_path} is not a readable trainer state ({type(e).__name__}: {e})",
                          path=str(state_path)) from None


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 require_head: bool = True) -> torch.nn.Module:
    """Rebuild a drafter (eval mode) from a checkpoint, frozen tensors included, through its family
    (``DrafterFamily.load_checkpoint_model``).

    An export directory (``is_export``) is not a checkpoint: its family's ``load_export`` loads it
    (``launch.py eval`` does so for it).

    Raises ``ValueError`` when the checkpoint lacks the target's frozen tensors and ``require_head`` is true
    (export and evaluation must never run with a head that is not the target's), or when trainable weights
    are missing or unexpected.
    """
    from specring.shared.drafters import get_family

    step_dir = resolve_checkpoint(path)
    if is_export(step_dir):
        raise ValueError(f"{step_dir} is an export, not a checkpoint: load it with its family's load_export "
                         "(shared.drafters)")
    tensors, _, config = load_checkpoint(step_dir)
    family = get_family(drafter_kind(step_dir))
    model = family.load_checkpoint_model(tensors, config, f"checkpoint {step_dir}", dtype, require_head)
    return model.to(device).eval()


def target_of_checkpoint(step_dir: str | Path) -> Path | None:
    """The target a checkpoint was trained against, from ``run_dir/config.json`` (``producer.target``) of
    the run that holds ``run_dir/checkpoints/step-*/`` (``shared.run.run_dir.RunDir.read_config``); None when it is
    not recorded (no run directory, or a configuration that does not read)."""
    try:
        target = RunDir.of_checkpoint(step_dir).read_config().producer.target
    except (OSError, ValueError):  # ConfigError is a ValueError
        return None
    return Path(target) if target else None

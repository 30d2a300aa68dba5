"""What every drafter family's serving format shares: the export directory's file names, the output checks and
the export dtype.

An export directory holds ``config.json`` (the serving engines' config), ``model.safetensors`` (the trainable
weights under the engines' names) and ``specring_export.json`` (provenance); the family's own export module
(``shared/drafters/dflash_export.py``, ``dflash2_export.py``, ``eagle3_export.py``) writes them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from specring.shared.machine.devices import MODEL_DTYPES

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "specring_export.json"


def check_output_dir(output_dir: str | Path, overwrite: bool) -> Path:
    """``output_dir`` as a ``Path``; raises ``FileExistsError`` naming ``--output`` when it exists, is not empty and
    ``overwrite`` is false."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output: {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--output: {out} exists and is not empty (pass --overwrite)")
    return out


def resolve_export_dtype(dtype: str, step_dir: Path, target_dir: str | Path | None) -> str:
    """The dtype an export is written in: ``dtype`` itself, or for ``auto`` the target's (its ``config.json``
    ``dtype``/``torch_dtype``; the run's target unless ``target_dir``), else bfloat16. Raises ``ValueError`` naming
    ``--dtype`` for a dtype that is not ``auto`` or one of ``shared.machine.devices.MODEL_DTYPES``."""
    if dtype == "auto":
        from specring.shared.drafters import checkpoint as ckpt
        from specring.shared.models.hub import resolve_model_dir
        from specring.shared.models.target_config import read_target_config, text_config
        from specring.shared.paths import DEFAULT_TARGET

        target = resolve_model_dir(target_dir or ckpt.target_of_checkpoint(step_dir) or DEFAULT_TARGET, "--target")
        raw = read_target_config(target)
        dtype = str(text_config(raw).get("dtype") or raw.get("torch_dtype") or "bfloat16")
        dtype = dtype if dtype in MODEL_DTYPES else "bfloat16"
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of auto, {', '.join(MODEL_DTYPES)}")
    return dtype


def write_export_dir(out: Path, tensors: dict, texts: dict[str, str]) -> Path:
    """Write an export directory atomically: ``tensors`` into ``WEIGHTS_FILE`` (metadata ``format: pt``) and each
    ``name -> text`` of ``texts``, under a temporary name beside ``out``, every file and the directory given the
    usual modes, then renamed into place (an existing ``out`` replaced). Returns ``out``."""
    from specring.shared.drafters import checkpoint as ckpt
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        ckpt.save_tensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        for name, text in texts.items():
            (tmp / name).write_text(text)
        for f in tmp.iterdir():
            ckpt.usual_mode(f)
        ckpt.usual_mode(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

"""A trained drafter written in the format the serving engines load: the library side of ``launch.py export``
(``specring.cli.export`` parses its flags into ``shared.commands.command_config.ExportConfig`` and calls
``export_checkpoint``).

The checkpoint's drafter family writes it (``DrafterFamily.export``, ``shared/drafters/``): DFlash as
``DFlashDraftModel`` (``shared/drafters/dflash_export.py``), DFlash2 as ``DFlash2DraftModel``
(``shared/drafters/dflash2_export.py``), EAGLE-3 as ``LlamaForCausalLMEagle3`` (``shared/drafters/eagle3_export.py``).
"""

from __future__ import annotations

from pathlib import Path

from specring.shared.commands.command_config import ExportConfig
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.run.run_dir import RunDir


def check_export_output(output: Path, step_dir: Path, target: str | None) -> None:
    """Refuse an ``--output`` directory that is, or holds, what the export reads: the checkpoint, its run
    directory (``--overwrite`` would remove it), or the target's directory (``shared.config.outputs.check_outputs``;
    ``ConfigError`` naming ``--output``)."""
    from specring.shared.config.outputs import check_outputs

    run = RunDir.of_checkpoint(step_dir)
    inputs = {"checkpoint": step_dir, "target directory": target if target and Path(target).is_dir() else
              ckpt.target_of_checkpoint(step_dir)}
    if run.is_run:
        inputs.update({"run directory": run.path, "checkpoints directory": Path(step_dir).resolve().parent})
    check_outputs("--output", {"export directory": output}, inputs)


def export_checkpoint(cfg: ExportConfig) -> list[str]:
    """Write the checkpoint ``cfg.drafter`` names (a step directory, or a run directory's latest) into
    ``cfg.output`` in its family's serving format; returns the family's summary lines of the export.

    Raises ``ValueError`` naming ``--drafter`` when it names an export already, ``FileNotFoundError``/``ValueError``
    for a checkpoint that cannot be read, ``ConfigError`` (a ``ValueError``) when ``--output`` collides with what
    the export reads (``check_export_output``), ``FileExistsError`` for a non-empty ``--output`` without
    ``--overwrite``."""
    from specring.shared.drafters import get_family

    step_dir = ckpt.resolve_checkpoint(cfg.drafter)
    if ckpt.is_export(step_dir):
        raise ValueError(f"--drafter: {step_dir} is an export already; export from a checkpoint or run directory")
    check_export_output(Path(cfg.output), step_dir, cfg.target)
    family = get_family(ckpt.drafter_kind(step_dir))
    out = family.export(step_dir, Path(cfg.output), cfg.target, cfg.dtype, cfg.overwrite, cfg.trust_remote_code)
    return list(family.export_summary(out))

"""``launch.py export``: write a trained drafter in the format the serving engines load.

The checkpoint's drafter family writes it (``DrafterFamily.export``, ``shared/drafters/``): DFlash as
``DFlashDraftModel`` (``shared/drafters/dflash_export.py``), DFlash2 as ``DFlash2DraftModel``
(``shared/drafters/dflash2_export.py``), EAGLE-3 as ``LlamaForCausalLMEagle3`` (``shared/drafters/eagle3_export.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specring.shared import checkpoint as ckpt

HELP_EXAMPLES = """\
examples:
  launch.py export --drafter runs/latest --output exported/
  launch.py export --drafter runs/q8/checkpoints/step-002000 --target Qwen/Qwen3-8B --output q8-dflash/ --overwrite"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py export``, its options grouped by concern, each with its default."""
    from specring.cli.flags import CommandHelpFormatter

    p = argparse.ArgumentParser(prog="launch.py export", formatter_class=CommandHelpFormatter, epilog=HELP_EXAMPLES,
                                description=(
        "Write a drafter checkpoint in the format the serving engines load: a DFlash checkpoint as a "
        "DFlashDraftModel directory (config.json + model.safetensors) that the SGLang and vLLM DFlash loaders "
        "accept; an EAGLE-3 checkpoint as a LlamaForCausalLMEagle3 directory (with d2t/t2d) that their EAGLE-3 "
        "loaders accept."))
    c = p.add_argument_group("checkpoint and target")
    c.add_argument("--drafter", required=True, help="checkpoint step directory or run directory (latest checkpoint)")
    c.add_argument("--target", metavar="DIR|ORG/NAME",
                   help="target checkpoint: a directory or a hub id (Qwen/Qwen3-8B) resolved from the local Hugging "
                        "Face cache (default: the run's target, else assets/tiny-code-lm)")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the tokenizer code the target ships")
    o = p.add_argument_group("output")
    o.add_argument("--output", required=True, help="directory to write")
    o.add_argument("--dtype", default="auto", help="auto (the target's), bfloat16, float16 or float32")
    o.add_argument("--overwrite", action="store_true", help="replace a non-empty --output directory")
    return p


def check_export_output(output: Path, step_dir: Path, target: str | None) -> None:
    """Refuse an ``--output`` directory that is, or holds, what the export reads: the checkpoint, its run
    directory (``--overwrite`` would remove it), or the target's directory (``shared.outputs.check_outputs``;
    ``ConfigError`` naming ``--output``)."""
    from specring.shared.outputs import check_outputs

    run_dir = Path(step_dir).resolve().parent.parent
    inputs = {"checkpoint": step_dir, "target directory": target if target and Path(target).is_dir() else
              ckpt.target_of_checkpoint(step_dir)}
    if (run_dir / "config.json").is_file():
        inputs.update({"run directory": run_dir, "checkpoints directory": Path(step_dir).resolve().parent})
    check_outputs("--output", {"export directory": output}, inputs)


def main(argv: list[str] | None = None) -> int:
    """``launch.py export``: 0 on success, 2 when the checkpoint is refused, a flag is wrong, or ``--output``
    collides with what the export reads (``check_export_output``). The checkpoint's drafter family
    (``shared.drafters``) writes its own serving format."""
    from specring.shared.drafters import get_family
    from specring.shared.logs import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging("export")
    try:
        step_dir = ckpt.resolve_checkpoint(args.drafter)
        if ckpt.is_export(step_dir):
            raise ValueError(f"--drafter: {step_dir} is an export already; export from a checkpoint or run directory")
        check_export_output(Path(args.output), step_dir, args.target)
        family = get_family(ckpt.drafter_kind(step_dir))
        out = family.export(step_dir, Path(args.output), args.target, args.dtype, args.overwrite,
                            args.trust_remote_code)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in family.export_summary(out):
        print(line)
    return 0

"""``launch.py export``: write a trained drafter in the format the serving engines load.

The flags are derived from ``shared.commands.command_config.ExportConfig`` (``specring.cli.flags.command_parser``); the
export itself is ``specring.shared.commands.exporting``.
"""

from __future__ import annotations

import argparse
import sys

from specring.cli.flags import command_config, command_parser
from specring.shared.commands.command_config import ExportConfig
from specring.shared.errors import ConfigError

HELP_EXAMPLES = """\
examples:
  launch.py export --drafter runs/latest --output exported/
  launch.py export --drafter runs/q8/checkpoints/step-002000 --target Qwen/Qwen3-8B --output q8-dflash/ --overwrite"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py export``, derived from ``ExportConfig``: its options grouped by concern, each
    with its default."""
    return command_parser(ExportConfig, "launch.py export", epilog=HELP_EXAMPLES, description=(
        "Write a drafter checkpoint in the format the serving engines load: a DFlash checkpoint as a "
        "DFlashDraftModel directory (config.json + model.safetensors) that the SGLang and vLLM DFlash loaders "
        "accept; an EAGLE-3 checkpoint as a LlamaForCausalLMEagle3 directory (with d2t/t2d) that their EAGLE-3 "
        "loaders accept."))


def main(argv: list[str] | None = None) -> int:
    """``launch.py export``: 0 on success, 2 when a flag is wrong, the checkpoint is refused, or ``--output``
    collides with what the export reads (``shared.commands.exporting.export_checkpoint``)."""
    from specring.shared.commands.exporting import export_checkpoint
    from specring.shared.process.logs import configure_logging

    try:
        cfg = command_config(ExportConfig, build_parser().parse_args(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging("export")
    try:
        lines = export_checkpoint(cfg)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0

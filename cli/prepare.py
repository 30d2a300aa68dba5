"""``launch.py prepare``: tokenize JSONL/Parquet rows (or the demo corpus) into one Arrow IPC file.

Input rows (one JSON object per JSONL line, or one Parquet row) carry one of:

* ``text``: a string, tokenized as is (the tokenizer's own special tokens added); loss on every token.
* ``messages`` or ``conversations``: a list of turns, ``{"role", "content"}`` or ShareGPT
  ``{"from", "value"}`` (``human`` -> user, ``gpt`` -> assistant), rendered with the tokenizer's chat
  template; loss on assistant turns only (see ``render_chat`` for exactly which tokens). Tool use reaches the
  template: the row's ``tools``, assistant turns' ``tool_calls`` (their rendering carries loss), tool turns'
  ``tool_call_id``; rows whose tools or calls the template does not render are bad rows that name them.
* ``input_ids`` (and optionally ``loss_mask``, all ones when absent): already tokenized.

Output: ``--output PATH`` (Arrow IPC file, format in ``specring.shared.data.dataset``) and its sidecar
``sidecar_path(PATH)``: tokenizer name, vocab size, pad/eos ids, counts, token statistics, the
first offending rows of each bad kind, the time taken and a SHA-1 of the token content. Both are written
to a temporary name and renamed at the end, so a failed or interrupted run never leaves a partial file.

Bad rows (kinds in ``BAD_KINDS``) are skipped, counted and the first ``EXAMPLES_PER_KIND`` of each kind
named by file and line (JSONL, 1-based) or row (Parquet, 0-based); the good rows are all kept. ``--strict``
stops at the first bad row with an error naming it. Samples longer than ``--max-length`` are truncated
(default) or dropped (``--overlong drop``); both are counted, neither is a bad row.

Tokenization runs in ``--workers`` processes (``spawn`` context; 1 = in this process), fed in order with
a bounded number of chunks in flight, so the output order is the input order whatever the worker count
and memory stays bounded whatever the input size.

``--demo`` builds the embedded default corpus (``build_demo``): the running interpreter's standard library
``.py`` files, split by the fixture model's held-out rule into ``train.arrow`` and ``heldout.arrow``.

The flags are derived from ``shared.commands.command_config.PrepareConfig`` (``specring.cli.flags.command_parser``); the
work is ``specring.shared.data.prepare`` and ``specring.shared.data.demo``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from specring.cli.flags import command_config, command_parser
from specring.shared import paths
from specring.shared.commands.command_config import PREPARE_MAX_LENGTH, PrepareConfig
from specring.shared.data.demo import DEMO_MAX_LENGTH, build_demo
from specring.shared.data.encode import StrictError
from specring.shared.data.prepare import plan_summary, prepare_files, read_chat_template
from specring.shared.data.writer import report
from specring.shared.errors import ConfigError
from specring.shared.models.hub import resolve_model_dir

HELP_EXAMPLES = """\
examples:
  launch.py prepare data/chat.jsonl --tokenizer Qwen/Qwen3-8B --output data/train.arrow --max-length 4096
  launch.py prepare 'data/shards/*.parquet' --tokenizer /models/Qwen3-8B --output data/train.arrow --strict
  launch.py prepare --demo                                the embedded default corpus (train + held-out)"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py prepare``, derived from ``PrepareConfig``: its options grouped by concern, each
    with its default."""
    return command_parser(PrepareConfig, "launch.py prepare", epilog=HELP_EXAMPLES, description=(
        "Tokenize JSONL/Parquet rows (text, chat messages/conversations, or input_ids with an optional loss_mask) "
        "into one Arrow IPC file, the data `launch.py train` reads, with a JSON sidecar of its statistics and "
        "bad rows; --demo builds the embedded default corpus (train + held-out)."))


def main(argv: list[str]) -> int:
    """``launch.py prepare``: returns 0 on success, 2 for a bad flag or input, 1 for ``--strict`` or no samples."""
    args = build_parser().parse_args(argv)
    try:
        cfg = command_config(PrepareConfig, args)
        t0 = time.perf_counter()
        tokenizer = resolve_model_dir(cfg.tokenizer, "--tokenizer")
        if cfg.demo:
            train, heldout = build_demo(Path(cfg.demo_dir or paths.demo_dir()), tokenizer=tokenizer,
                                        max_length=cfg.max_length or DEMO_MAX_LENGTH, workers=cfg.workers or 1,
                                        progress=not cfg.no_progress)
            print(plan_summary(train))
            print(f"prepare --demo took {time.perf_counter() - t0:.1f} s")
            return 0
        inputs = cfg.inputs + cfg.input
        if not inputs:
            raise ConfigError("no input: give JSONL/Parquet files (positional or --input), or --demo")
        if not cfg.output:
            raise ConfigError("--output is required (the Arrow file to write)")
        template = read_chat_template(cfg.chat_template) if cfg.chat_template else None
        output = Path(cfg.output)
        side = prepare_files(inputs, output, tokenizer=tokenizer, max_length=cfg.max_length or PREPARE_MAX_LENGTH,
                             overlong=cfg.overlong, strict=cfg.strict,
                             workers=cfg.workers or min(8, os.cpu_count() or 1),
                             progress=not cfg.no_progress, chat_template=template,
                             trust_remote_code=cfg.trust_remote_code)
        print(report(side, output))
        print(plan_summary(output))
        return 0
    except ConfigError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    except (StrictError, ValueError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1

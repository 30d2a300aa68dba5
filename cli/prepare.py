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
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from specring.shared import paths
from specring.shared.config import finite_number
from specring.shared.data.demo import DEMO_MAX_LENGTH, build_demo
from specring.shared.data.encode import StrictError
from specring.shared.data.prepare import PrepareOptions, plan_summary, prepare_files, read_chat_template
from specring.shared.data.writer import report
from specring.shared.errors import ConfigError
from specring.shared.hub import resolve_model_dir
from specring.shared.paths import DEFAULT_TARGET

HELP_EXAMPLES = """\
examples:
  launch.py prepare data/chat.jsonl --tokenizer Qwen/Qwen3-8B --output data/train.arrow --max-length 4096
  launch.py prepare 'data/shards/*.parquet' --tokenizer /models/Qwen3-8B --output data/train.arrow --strict
  launch.py prepare --demo                                the embedded default corpus (train + held-out)"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``launch.py prepare``, its options grouped by concern, each with its default."""
    from specring.cli.flags import CommandHelpFormatter

    p = argparse.ArgumentParser(prog="launch.py prepare", formatter_class=CommandHelpFormatter, epilog=HELP_EXAMPLES,
                                description=(
        "Tokenize JSONL/Parquet rows (text, chat messages/conversations, or input_ids with an optional loss_mask) "
        "into one Arrow IPC file, the data `launch.py train` reads, with a JSON sidecar of its statistics and "
        "bad rows; --demo builds the embedded default corpus (train + held-out)."))
    io = p.add_argument_group("input and output")
    io.add_argument("inputs", nargs="*", help="JSONL/Parquet files, directories or globs")
    io.add_argument("--input", action="append", default=[], help="another input (repeatable)")
    io.add_argument("--output", help="Arrow file to write, its sidecar beside it with the suffix .json (required "
                                     "unless --demo)")
    tk = p.add_argument_group("tokenizer")
    tk.add_argument("--tokenizer", default=str(DEFAULT_TARGET), metavar="DIR|ORG/NAME",
                    help="the target's tokenizer: a directory or a hub id (Qwen/Qwen3-8B), resolved from the local "
                         "Hugging Face cache (default: assets/tiny-code-lm)")
    tk.add_argument("--trust-remote-code", action="store_true",
                    help="let transformers run the tokenizer code the directory ships")
    tk.add_argument("--chat-template", help="a Jinja chat template file to use instead of the tokenizer's")
    sm = p.add_argument_group("samples")
    sm.add_argument("--max-length", type=finite_number(int), default=None,
                    help=f"tokens per sample (default 2048; {DEMO_MAX_LENGTH} for --demo)")
    sm.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                    help="what to do with samples longer than --max-length")
    sm.add_argument("--strict", action="store_true", help="stop with an error at the first bad row")
    rn = p.add_argument_group("running")
    rn.add_argument("--workers", type=finite_number(int), default=None,
                    help="tokenizer processes, 1 = in this process (default: min(8, CPUs); 1 for --demo, whose "
                         "whole-file batches the Rust tokenizer already spreads over threads)")
    rn.add_argument("--no-progress", action="store_true", help="no progress bar")
    dm = p.add_argument_group("demo corpus")
    dm.add_argument("--demo", action="store_true", help="build the stdlib demo corpus (train + held-out)")
    dm.add_argument("--demo-dir", default=None, help="where --demo writes (default: ./data/demo)")
    return p


def main(argv: list[str]) -> int:
    """``launch.py prepare``: returns 0 on success, 2 for a bad flag or input, 1 for ``--strict`` or no samples."""
    args = build_parser().parse_args(argv)
    try:
        try:
            PrepareOptions(max_length=args.max_length, workers=args.workers)
        except ConfigError as e:
            raise ConfigError(f"--{e.key.replace('_', '-')}: {e.detail}", key=e.key, detail=e.detail) from None
        t0 = time.perf_counter()
        tokenizer = resolve_model_dir(args.tokenizer, "--tokenizer")
        if args.demo:
            train, heldout = build_demo(Path(args.demo_dir or paths.demo_dir()), tokenizer=tokenizer,
                                        max_length=args.max_length or DEMO_MAX_LENGTH, workers=args.workers or 1,
                                        progress=not args.no_progress)
            print(plan_summary(train))
            print(f"prepare --demo took {time.perf_counter() - t0:.1f} s")
            return 0
        inputs = list(args.inputs) + list(args.input)
        if not inputs:
            raise ConfigError("no input: give JSONL/Parquet files (positional or --input), or --demo")
        if not args.output:
            raise ConfigError("--output is required (the Arrow file to write)")
        template = read_chat_template(args.chat_template) if args.chat_template else None
        output = Path(args.output)
        side = prepare_files(inputs, output, tokenizer=tokenizer, max_length=args.max_length or 2048,
                             overlong=args.overlong, strict=args.strict,
                             workers=args.workers or min(8, os.cpu_count() or 1),
                             progress=not args.no_progress, chat_template=template,
                             trust_remote_code=args.trust_remote_code)
        print(report(side, output))
        print(plan_summary(output))
        return 0
    except ConfigError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    except (StrictError, ValueError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1

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
import glob
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from specring.shared import paths
from specring.shared.config import (
    MAX_INT32,
    check_numbers,
    finite_number,
    num,
)
from specring.shared.data.demo import DEMO_MAX_LENGTH, build_demo
from specring.shared.data.encode import (
    CHUNK_ROWS,
    EncoderConfig,
    Runner,
    StrictError,
    Task,
    load_tokenizer,
    vocab_size_of,
)
from specring.shared.data.writer import _tokenizer_meta, report, write_dataset
from specring.shared.errors import ConfigError
from specring.shared.hub import resolve_model_dir
from specring.shared.paths import DEFAULT_TARGET


@dataclass(kw_only=True)
class PrepareOptions:
    """The numeric options of ``launch.py prepare`` (``None``: the command's default), checked like every
    config field (``shared.config.check_numbers``: finite, in range); ``ConfigError.key`` names the field."""
    max_length: int | None = num(None, ge=1, le=MAX_INT32)   # tokens per sample
    workers: int | None = num(None, ge=1, le=1024)           # tokenizer processes

    def __post_init__(self):
        check_numbers(self)


def expand_inputs(specs: list[str]) -> list[Path]:
    """Input files from paths, directories (their ``*.jsonl``/``*.json``/``*.parquet``) and globs, in
    sorted order without duplicates; raises ``ConfigError`` naming the spec that matches nothing."""
    out: list[Path] = []
    for spec in specs:
        if any(c in spec for c in "*?["):
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        elif Path(spec).is_dir():
            found = sorted(p for p in Path(spec).iterdir() if p.suffix in (".jsonl", ".json", ".ndjson", ".parquet"))
        elif Path(spec).is_file():
            found = [Path(spec)]
        else:
            raise ConfigError(f"input {spec!r}: no such file")
        if not found:
            raise ConfigError(f"input {spec!r}: matches no file")
        for p in found:
            if p.suffix not in (".jsonl", ".json", ".ndjson", ".parquet"):
                raise ConfigError(f"input {str(p)!r}: unknown format (expected .jsonl, .json, .ndjson or .parquet)")
            if p not in out:
                out.append(p)
    return out


def parquet_file(p: Path):
    """``pyarrow.parquet.ParquetFile`` of the input ``p``. Raises ``ConfigError`` naming the file when it is not
    a readable Parquet file (pyarrow's own message, "Parquet magic bytes not found", names no file)."""
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(str(p))
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise ConfigError(f"input {str(p)!r}: not a readable Parquet file ({type(e).__name__}: {e}); a .parquet "
                          f"input must be Parquet (JSON lines go in .jsonl)") from None


def check_inputs(files: list[Path]) -> None:
    """Open every Parquet input once (its footer), so that a file that is not Parquet is refused, by name, before
    anything is tokenized (``parquet_file``)."""
    for p in files:
        if p.suffix == ".parquet":
            parquet_file(p)


def check_output_names(output: Path, files: list[Path], tokenizer: Path | None = None) -> None:
    """Refuse an ``--output`` whose data file, sidecar (``NAME.json``) or their temporary names (``.tmp``)
    collide with one another, with an input file, or with a file of the tokenizer's directory
    (``shared.outputs.check_outputs``; ``ConfigError`` naming ``--output``)."""
    from specring.shared.data.dataset import sidecar_path
    from specring.shared.outputs import check_outputs

    side = sidecar_path(output)
    check_outputs("--output", {"data file": output, "sidecar": side,
                               "temporary data file": output.with_name(output.name + ".tmp"),
                               "temporary sidecar": side.with_name(side.name + ".tmp")},
                  {**{f"input {p}": p for p in files}, "tokenizer directory": tokenizer})


def _count_rows(files: list[Path]) -> int:
    """Rows to read (Parquet metadata, JSONL non-empty lines), for the progress bar."""
    total = 0
    for p in files:
        if p.suffix == ".parquet":
            total += parquet_file(p).metadata.num_rows
        else:
            with open(p, "rb") as f:
                total += sum(1 for line in f if line.strip())
    return total


def _tasks(files: list[Path]) -> Iterator[Task]:
    for fi, p in enumerate(files):
        if p.suffix == ".parquet":
            row = 0
            batches = parquet_file(p).iter_batches(batch_size=CHUNK_ROWS)
            while True:
                try:
                    rb = next(batches, None)
                except (OSError, ValueError) as e:  # a corrupt page or row group mid-file
                    raise ConfigError(f"input {str(p)!r}: cannot be read past row {row} ({type(e).__name__}: "
                                      f"{e})") from None
                if rb is None:
                    break
                rows = rb.to_pylist()
                yield Task(fi, "rows", list(range(row, row + len(rows))), rows)
                row += len(rows)
            continue
        locs, lines = [], []
        with open(p, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                locs.append(n)
                lines.append(line)
                if len(lines) == CHUNK_ROWS:
                    yield Task(fi, "jsonl", locs, lines)
                    locs, lines = [], []
        if lines:
            yield Task(fi, "jsonl", locs, lines)


def plan_summary(path: Path) -> str:
    """Bucket summary of the default batch plan (``shared.config.DataConfig`` defaults) over ``path``."""
    from specring.shared.config import DataConfig
    from specring.shared.data.dataset import BatchPlan, TokenDataset

    cfg = DataConfig()
    ds = TokenDataset(path)
    plan = BatchPlan(ds.lengths, max_tokens=cfg.max_tokens, max_batch_size=cfg.max_batch_size,
                     bucket_edges=cfg.bucket_edges, num_buckets=cfg.num_buckets, seed=cfg.seed,
                     fingerprint=ds.fingerprint)
    return f"batch plan of {path.name}:\n" + plan.summary()


def prepare_files(inputs: list[str], output: Path, *, tokenizer: Path, max_length: int, overlong: str,
                  strict: bool, workers: int, progress: bool = True, chat_template: str | None = None,
                  trust_remote_code: bool = False) -> dict:
    """Tokenize the rows of ``inputs`` (paths, directories or globs) into ``output``; returns the sidecar.
    ``trust_remote_code``: the tokenizer's own code may run (``--trust-remote-code``).

    Raises ``ConfigError`` before anything is written for an ``output`` that collides with its own sidecar or an
    input (``check_output_names``) and for a ``.parquet`` input that is not Parquet (``check_inputs``)."""
    files = expand_inputs(inputs)
    check_output_names(output, files, tokenizer)
    check_inputs(files)
    tok = load_tokenizer(tokenizer, trust_remote_code)
    cfg = EncoderConfig(str(tokenizer), max_length, overlong, vocab_size_of(tokenizer, tok), chat_template,
                        trust_remote_code)
    runner = Runner(cfg, workers)
    try:
        return write_dataset(runner, _tasks(files), output, inputs=[str(p) for p in files],
                             total_rows=_count_rows(files) if progress else 0, strict=strict,
                             progress=progress, meta=_tokenizer_meta(tokenizer, tok, cfg, overlong))
    finally:
        runner.close()


def read_chat_template(path: str) -> str:
    """The text of a ``--chat-template`` file; raises ``ConfigError`` naming it when it is missing, unreadable
    or not UTF-8."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"--chat-template: {path} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--chat-template: {path} is not UTF-8 text (byte offset {e.start})") from None


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

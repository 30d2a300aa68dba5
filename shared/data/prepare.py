"""The work behind ``launch.py prepare``: input files found and checked, rows tokenized by worker processes in
order, one Arrow IPC file and its sidecar written (``prepare_files``); the command's docstring
(``cli/prepare.py``) says what rows it takes and what it writes. The encoders are ``shared.data.encode``'s, the
writer ``shared.data.writer``'s.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Iterator

from specring.shared.data.encode import (
    CHUNK_ROWS,
    EncoderConfig,
    Runner,
    Task,
    load_tokenizer,
    vocab_size_of,
)
from specring.shared.data.writer import _tokenizer_meta, write_dataset
from specring.shared.errors import ConfigError


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
    (``shared.config.outputs.check_outputs``; ``ConfigError`` naming ``--output``)."""
    from specring.shared.config.outputs import check_outputs
    from specring.shared.data.dataset import sidecar_path

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
    """Bucket summary of the default batch plan (``shared.config.run_config.DataConfig`` defaults) over ``path``."""
    from specring.shared.config.run_config import DataConfig
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

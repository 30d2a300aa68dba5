"""``launch.py prepare``: tokenize JSONL/Parquet rows (or the demo corpus) into one Arrow IPC file.

Input rows (one JSON object per JSONL line, or one Parquet row) carry one of:

* ``text``: a string, tokenized as is (the tokenizer's own special tokens added); loss on every token.
* ``messages`` or ``conversations``: a list of turns, ``{"role", "content"}`` or ShareGPT
  ``{"from", "value"}`` (``human`` -> user, ``gpt`` -> assistant), rendered with the tokenizer's chat
  template; loss on assistant turns only (see ``render_chat`` for exactly which tokens).
* ``input_ids`` (and optionally ``loss_mask``, all ones when absent): already tokenized.

Output: ``--output PATH`` (Arrow IPC file, format in ``shared/data.py``) and its sidecar
``shared.data.sidecar_path(PATH)``: tokenizer name, vocab size, pad/eos ids, counts, token statistics, the
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
import collections
import glob
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from shared.config import MAX_INT32, check_numbers, finite_number, num
from shared.data import has_anchor
from shared.errors import ConfigError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = REPO_ROOT / "assets" / "tiny-code-lm"
DEMO_MAX_LENGTH = 1024
DEMO_VERSION = 1
EXAMPLES_PER_KIND = 5
CHUNK_ROWS = 256                     # rows per task sent to a worker
FLUSH_ROWS = 16384                   # rows per Arrow record batch ...
FLUSH_TOKENS = 1 << 24               # ... or tokens (list<int32> offsets must stay < 2**31 per batch)

BAD_KINDS = {
    "invalid_json": "the line is not a JSON object",
    "unknown_format": "no text, messages/conversations or input_ids field",
    "empty": "empty text or empty input_ids",
    "bad_turn": "a turn that is not an object with string role/content (or from/value)",
    "unknown_role": "a turn whose role is not system/user/assistant/tool (or a ShareGPT alias)",
    "no_assistant_turn": "a conversation without an assistant turn",
    "template_error": "the chat template failed to render the conversation",
    "template_mismatch": "an assistant turn cannot be located in the rendered template (dropped, repeated or moved)",
    "bad_input_ids": "input_ids or loss_mask is not a flat list of integers",
    "token_out_of_range": "a token id < 0 or >= the vocab size",
    "loss_mask_length": "loss_mask length differs from input_ids length",
    "loss_mask_values": "loss_mask values other than 0 and 1",
    "loss_mask_all_zero": "no token carries loss (after truncation)",
    "no_anchor": "no two adjacent tokens carry loss (after truncation): a DFlash anchor needs "
                 "loss_mask[p] == loss_mask[p+1] == 1, so the sample would train nothing",
}
ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
                "gpt": "assistant", "model": "assistant", "tool": "tool", "function": "tool",
                "observation": "tool"}


class BadRow(ValueError):
    """One input row that cannot become a sample; ``kind`` is a key of ``BAD_KINDS``."""

    def __init__(self, kind: str, detail: str = ""):
        assert kind in BAD_KINDS, kind
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind, self.detail = kind, detail or BAD_KINDS[kind]


class StrictError(ValueError):
    """``--strict`` met a bad row; the message names file, line/row, kind and detail."""


# ------------------------------------------------------------------------------------------ tokenization


def load_tokenizer(tokenizer_dir: str | Path):
    """A Hugging Face tokenizer from a local directory (no network), without the max-length warning."""
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise ConfigError(f"--tokenizer: {path} is not a directory")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.model_max_length = 1 << 40      # we truncate ourselves; silence "longer than the maximum"
    return tok


def vocab_size_of(tokenizer_dir: str | Path, tok) -> int:
    """Embedding rows of the target: ``vocab_size`` of a ``config.json`` next to the tokenizer, else ``len(tok)``."""
    cfg = Path(tokenizer_dir) / "config.json"
    if cfg.is_file():
        v = json.loads(cfg.read_text()).get("vocab_size")
        if isinstance(v, int) and v > 0:
            return v
    return len(tok)


def normalize_turns(turns: Any) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` from role/content or ShareGPT from/value turns; raises ``BadRow``."""
    if not isinstance(turns, list) or not turns:
        raise BadRow("bad_turn", "messages/conversations must be a non-empty list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRow("bad_turn", f"turn {i} is {type(t).__name__}, not an object")
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if content is None:
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise BadRow("bad_turn", f"turn {i}: role and content must be strings")
        if role.lower() not in ROLE_ALIASES:
            raise BadRow("unknown_role", f"turn {i}: role {role!r}")
        out.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    return out


def render_chat(tok, turns: list[dict[str, str]], chat_template: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of a conversation rendered with the chat template, and its assistant loss mask.

    Returns ``(input_ids [T] int32, loss_mask [T] uint8)``. ``loss_mask`` is 1 on every token that
    overlaps the characters the template rendered from an assistant turn's content, and on the first token
    after them when it is a special token (the end-of-turn token, ``<|im_end|>`` for ChatML: the drafter must
    learn to end a turn); 0 elsewhere (role headers, text the template adds, the newline after the
    end-of-turn token, other turns). An empty assistant turn carries loss on its end-of-turn token only
    (as transformers' ``{% generation %}`` mask has it), or none when the template renders an empty turn
    differently from a non-empty one. Where the assistant text is found is decided by ``assistant_spans``, which works for any turn order, system and tool turns, several
    assistant turns and templates that add text or transform the content (``| trim``), with or without
    ``{% generation %}`` markers. Raises ``BadRow`` (``no_assistant_turn``, ``template_error``,
    ``template_mismatch``).
    """
    if not any(t["role"] == "assistant" for t in turns):
        raise BadRow("no_assistant_turn")
    try:
        text = tok.apply_chat_template(turns, tokenize=False, chat_template=chat_template)
    except Exception as e:  # jinja errors, "roles must alternate", no template at all
        raise BadRow("template_error", f"{type(e).__name__}: {e}") from None
    try:
        spans = assistant_spans(tok, turns, text, chat_template, include_empty=True)
    except BadRow:
        if all(t["content"] for t in turns if t["role"] == "assistant"):
            raise
        spans = assistant_spans(tok, turns, text, chat_template)  # empty turns rendered apart: no loss
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offs = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=np.uint8)
    special = set(tok.all_special_ids)
    for a, b in spans:
        mask[(offs[:, 0] < b) & (offs[:, 1] > a)] = 1
        after = np.nonzero(offs[:, 0] >= b)[0]
        if len(after) and int(ids[after[0]]) in special:
            mask[after[0]] = 1
    return ids.astype(np.int32), mask


def assistant_spans(tok, turns: list[dict[str, str]], text: str, chat_template: str | None = None,
                    include_empty: bool = False) -> list[tuple[int, int]]:
    """Character spans ``[(start, end)]`` of ``text`` (the conversation as the template renders it) that
    the template rendered from the assistant contents, in turn order: the non-empty ones, and with
    ``include_empty`` the empty ones too (as empty spans ``(p, p)`` where they sit). A content that renders
    as nothing gives an empty span, or none without ``include_empty``.

    The conversation is rendered a second time with each non-empty assistant content replaced by a
    marker that no template changes (private-use characters and digits: no letters to upper-case, no
    spaces to trim). The text between the markers is what the template itself writes (headers, system
    prompts, separators); those pieces are matched in order against ``text``, and what lies between two
    of them is the rendering of one assistant content, wherever it is and whatever else in the
    conversation repeats it (a user turn quoting the answer, content equal to a role name or to part of a
    header). So a text search never lands on template text.

    Raises ``BadRow("template_error")`` when the template fails on the marked conversation and
    ``BadRow("template_mismatch")`` naming the turn when the template drops, repeats or reorders an
    assistant content, or renders the text around it differently depending on the content itself (e.g.
    a reasoning block moved out of the content).
    """
    which = [i for i, t in enumerate(turns) if t["role"] == "assistant" and (t["content"] or include_empty)]
    if not which:
        return []
    nonce = 0
    while True:
        marks = {i: f"\ue000{nonce}{n:04d}\ue001" for n, i in enumerate(which)}
        if not any(m in text or any(m in t["content"] for t in turns) for m in marks.values()):
            break
        nonce += 1
    probe = [dict(t, content=marks[i]) if i in marks else t for i, t in enumerate(turns)]
    try:
        marked = tok.apply_chat_template(probe, tokenize=False, chat_template=chat_template)
    except Exception as e:
        raise BadRow("template_error", f"{type(e).__name__}: {e}") from None
    pieces, pos = [], 0
    for i in which:
        at = marked.find(marks[i], pos)
        if at < 0 or marked.count(marks[i]) != 1:
            raise BadRow("template_mismatch", f"turn {i}: the chat template does not render this assistant "
                                              f"content exactly once, in order")
        pieces.append(marked[pos:at])
        pos = at + len(marks[i])
    pieces.append(marked[pos:])
    if not text.startswith(pieces[0]):
        raise BadRow("template_mismatch", f"turn {which[0]}: the template renders the turns before this "
                                          f"assistant turn differently depending on its content")
    spans, cur = [], len(pieces[0])
    for k, i in enumerate(which):
        after, content, last = pieces[k + 1], turns[i]["content"], k + 1 == len(which)
        verbatim = text.startswith(content, cur) and (
            len(text) - len(after) == cur + len(content) and text.endswith(after) if last
            else text.startswith(after, cur + len(content)))
        if verbatim:
            end = cur + len(content)
        elif last:
            end = len(text) - len(after) if text.endswith(after) else -1
        else:
            end = text.find(after, cur)
        if end < cur:
            raise BadRow("template_mismatch", f"turn {i}: the template renders the text after this assistant "
                                              f"turn differently depending on its content")
        if end > cur or include_empty:
            spans.append((cur, end))
        cur = end + len(after)
    return spans


@dataclass(kw_only=True)
class PrepareOptions:
    """The numeric options of ``launch.py prepare`` (``None``: the command's default), checked like every
    config field (``shared.config.check_numbers``: finite, in range); ``ConfigError.key`` names the field."""
    max_length: int | None = num(None, ge=1, le=MAX_INT32)   # tokens per sample
    workers: int | None = num(None, ge=1, le=1024)           # tokenizer processes

    def __post_init__(self):
        check_numbers(self)


@dataclass
class EncoderConfig:
    """What a worker needs to turn rows into samples (picklable)."""
    tokenizer_dir: str
    max_length: int = num(ge=1, le=MAX_INT32)
    overlong: str = "truncate"        # or "drop"
    vocab_size: int = num(0, ge=0, le=MAX_INT32)   # 0 = from the tokenizer directory
    chat_template: str | None = None

    def __post_init__(self):
        check_numbers(self)


@dataclass
class Task:
    """Rows of one input file: ``fmt`` is ``jsonl`` (raw lines), ``rows`` (dicts) or ``doc`` (demo texts)."""
    file_index: int
    fmt: str
    locations: list[int]              # line number (jsonl), row number (rows), file index (doc)
    payload: list[Any]


@dataclass
class ChunkResult:
    """Samples of one ``Task`` as flat arrays, with its counts and its bad rows in input order."""
    ids: np.ndarray                   # [sum(lengths)] int32
    mask: np.ndarray                  # [sum(lengths)] uint8
    lengths: np.ndarray               # [n] int32
    source_file: np.ndarray           # [n] int32
    source_row: np.ndarray            # [n] int64
    rows_read: int = 0
    counts: collections.Counter = field(default_factory=collections.Counter)
    bad: list[tuple[str, int, str, str]] = field(default_factory=list)   # (kind, file, "line 7", detail)


class Encoder:
    """Turns rows into ``(input_ids int32, loss_mask uint8)`` samples; the per-worker state of ``prepare``."""

    def __init__(self, cfg: EncoderConfig):
        self.cfg = cfg
        self.tok = load_tokenizer(cfg.tokenizer_dir)
        self.vocab_size = cfg.vocab_size or vocab_size_of(cfg.tokenizer_dir, self.tok)
        self.eos_id = self.tok.eos_token_id

    def encode_row(self, rec: Any) -> tuple[np.ndarray, np.ndarray]:
        """One sample (before the length limit) from a row; raises ``BadRow``."""
        if not isinstance(rec, dict):
            raise BadRow("invalid_json", f"a JSON {type(rec).__name__}, not an object")
        if rec.get("input_ids") is not None:
            ids, mask = self._pretokenized(rec["input_ids"], rec.get("loss_mask"))
        elif rec.get("messages") is not None or rec.get("conversations") is not None:
            turns = rec.get("messages") if rec.get("messages") is not None else rec.get("conversations")
            ids, mask = render_chat(self.tok, normalize_turns(turns), self.cfg.chat_template)
        elif "text" in rec:
            text = rec["text"]
            if not isinstance(text, str) or not text.strip():
                raise BadRow("empty", "text is empty" if isinstance(text, str) else "text is not a string")
            ids = np.asarray(self.tok(text)["input_ids"], dtype=np.int32)
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            raise BadRow("unknown_format", f"fields {sorted(rec)[:8]}")
        if len(ids) == 0:
            raise BadRow("empty", "no tokens")
        bad = np.nonzero((ids < 0) | (ids >= self.vocab_size))[0]
        if len(bad):
            raise BadRow("token_out_of_range",
                         f"token {int(ids[bad[0]])} at position {int(bad[0])} (vocab size {self.vocab_size})")
        return ids, mask

    def _pretokenized(self, raw_ids: Any, raw_mask: Any) -> tuple[np.ndarray, np.ndarray]:
        ids = _int_array(raw_ids, "input_ids")
        if len(ids) == 0:
            raise BadRow("empty", "input_ids is empty")
        if (ids < 0).any() or (ids >= self.vocab_size).any():
            j = int(np.nonzero((ids < 0) | (ids >= self.vocab_size))[0][0])
            raise BadRow("token_out_of_range", f"token {int(ids[j])} at position {j} (vocab size {self.vocab_size})")
        if raw_mask is None:
            return ids.astype(np.int32), np.ones(len(ids), dtype=np.uint8)
        mask = _int_array(raw_mask, "loss_mask")
        if len(mask) != len(ids):
            raise BadRow("loss_mask_length", f"loss_mask has {len(mask)} entries, input_ids {len(ids)}")
        if ((mask != 0) & (mask != 1)).any():
            raise BadRow("loss_mask_values", f"values {sorted(set(mask.tolist()) - {0, 1})[:5]}")
        return ids.astype(np.int32), mask.astype(np.uint8)

    def encode_task(self, task: Task) -> ChunkResult:
        """All samples of a task, in order; bad rows are counted and listed, never raised."""
        if task.fmt == "doc":
            return self._encode_docs(task)
        out_ids, out_mask, lens, files, rows = [], [], [], [], []
        counts: collections.Counter = collections.Counter()
        bad: list[tuple[str, int, str, str]] = []
        for loc, raw in zip(task.locations, task.payload):
            try:
                rec = raw
                if task.fmt == "jsonl":
                    try:
                        rec = json.loads(raw)
                    except ValueError as e:
                        raise BadRow("invalid_json", str(e)) from None
                ids, mask = self.encode_row(rec)
                if len(ids) > self.cfg.max_length:
                    if self.cfg.overlong == "drop":
                        counts["dropped_overlong"] += 1
                        continue
                    counts["truncated"] += 1
                    ids, mask = ids[:self.cfg.max_length], mask[:self.cfg.max_length]
                if not mask.any():
                    raise BadRow("loss_mask_all_zero")
                if not has_anchor(mask):
                    raise BadRow("no_anchor", f"no two adjacent tokens carry loss (loss_mask "
                                              f"{_brief(mask)}): no DFlash anchor, nothing to train")
            except BadRow as e:
                counts[e.kind] += 1
                if sum(1 for b in bad if b[0] == e.kind) < EXAMPLES_PER_KIND:
                    unit = "line" if task.fmt == "jsonl" else "row"
                    bad.append((e.kind, task.file_index, f"{unit} {loc}", e.detail))
                continue
            out_ids.append(ids)
            out_mask.append(mask)
            lens.append(len(ids))
            files.append(task.file_index)
            rows.append(loc)
        return _result(out_ids, out_mask, lens, files, rows, len(task.payload), counts, bad)

    def _encode_docs(self, task: Task) -> ChunkResult:
        """Demo documents: tokens + EOS, split into ``ceil(n / max_length)`` near-equal samples."""
        out_ids, lens, files, rows = [], [], [], []
        encoded = self.tok(task.payload)["input_ids"]
        for fi, toks in zip(task.locations, encoded):
            ids = np.asarray(list(toks) + ([self.eos_id] if self.eos_id is not None else []), dtype=np.int32)
            k = -(-len(ids) // self.cfg.max_length)
            for j, part in enumerate(np.array_split(ids, k)):
                out_ids.append(part)
                lens.append(len(part))
                files.append(fi)
                rows.append(j)
        masks = [np.ones(len(x), np.uint8) for x in out_ids]
        return _result(out_ids, masks, lens, files, rows, len(task.payload), collections.Counter(), [])


def _brief(values: np.ndarray, n: int = 12) -> str:
    head = values[:n].tolist()
    return f"{head}" if len(values) <= n else f"{head[:-1]}... ({len(values)} tokens)".replace("]...", ", ...]")


def _int_array(raw: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(raw)
    except (ValueError, TypeError):
        arr = None
    if arr is None or arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise BadRow("bad_input_ids", f"{name} is not a flat list of integers")
    return arr.astype(np.int64)


def _result(ids, masks, lens, files, rows, rows_read, counts, bad) -> ChunkResult:
    return ChunkResult(
        ids=np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32),
        mask=np.concatenate(masks).astype(np.uint8) if masks else np.zeros(0, np.uint8),
        lengths=np.asarray(lens, dtype=np.int32), source_file=np.asarray(files, dtype=np.int32),
        source_row=np.asarray(rows, dtype=np.int64), rows_read=rows_read, counts=counts, bad=bad)


# ----------------------------------------------------------------------------------- workers and output

_WORKER: dict[str, Encoder] = {}


def _init_worker(cfg: EncoderConfig) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one process per core already
    _WORKER["encoder"] = Encoder(cfg)


def _work(task: Task) -> ChunkResult:
    return _WORKER["encoder"].encode_task(task)


class Runner:
    """Runs tasks through ``workers`` spawned processes (or in this process when ``workers == 1``),
    yielding results in task order with at most ``2 * workers`` tasks in flight."""

    def __init__(self, cfg: EncoderConfig, workers: int):
        self.workers = max(1, int(workers))
        self._pool = None
        self._encoder = None
        if self.workers == 1:
            self._encoder = Encoder(cfg)
        else:
            import multiprocessing as mp
            self._pool = mp.get_context("spawn").Pool(self.workers, initializer=_init_worker, initargs=(cfg,))

    def map(self, tasks: Iterable[Task]) -> Iterator[ChunkResult]:
        if self._encoder is not None:
            yield from (self._encoder.encode_task(t) for t in tasks)
            return
        pending: collections.deque = collections.deque()
        for t in tasks:
            pending.append(self._pool.apply_async(_work, (t,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


class ArrowSink:
    """Appends ``ChunkResult`` samples to ``<path>.tmp`` in record batches; ``commit()`` renames it."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.ipc as ipc

        self.pa = pa
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
                                 ("source_file", pa.int32()), ("source_row", pa.int64())])
        self._writer = ipc.new_file(str(self.tmp), self.schema)
        self._buf: list[ChunkResult] = []
        self._buf_rows = self._buf_tokens = 0
        self.sha1 = hashlib.sha1()
        self.lengths: list[np.ndarray] = []
        self.loss_tokens = 0

    def add(self, r: ChunkResult) -> None:
        if not len(r.lengths):
            return
        self._buf.append(r)
        self._buf_rows += len(r.lengths)
        self._buf_tokens += len(r.ids)
        self.sha1.update(r.lengths.astype("<i4").tobytes())
        self.sha1.update(r.ids.astype("<i4").tobytes())
        self.sha1.update(r.mask.tobytes())
        self.lengths.append(r.lengths)
        self.loss_tokens += int(r.mask.sum(dtype=np.int64))
        if self._buf_rows >= FLUSH_ROWS or self._buf_tokens >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        pa = self.pa
        lengths = np.concatenate([r.lengths for r in self._buf])
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))
        ids = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([r.ids for r in self._buf])))
        mask = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([r.mask for r in self._buf])))
        self._writer.write_batch(pa.record_batch([
            ids, mask, pa.array(np.concatenate([r.source_file for r in self._buf])),
            pa.array(np.concatenate([r.source_row for r in self._buf]))], schema=self.schema))
        self._buf, self._buf_rows, self._buf_tokens = [], 0, 0

    def stats(self) -> dict:
        """Sample and token statistics of everything added so far."""
        lens = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        out = {"num_samples": int(len(lens)), "num_tokens": int(lens.sum(dtype=np.int64)),
               "num_loss_tokens": self.loss_tokens}
        if len(lens):
            p = np.percentile(lens, [50, 90, 99])
            out["length"] = {"min": int(lens.min()), "max": int(lens.max()), "mean": round(float(lens.mean()), 2),
                             "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}
        return out

    def commit(self, sidecar: dict) -> None:
        from shared.data import sidecar_path

        self._flush()
        self._writer.close()
        side = sidecar_path(self.path)
        tmp_side = side.with_name(side.name + ".tmp")
        tmp_side.write_text(json.dumps(sidecar, indent=1) + "\n")
        os.replace(self.tmp, self.path)
        os.replace(tmp_side, side)

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass
        self.tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ the pipeline


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


def _count_rows(files: list[Path]) -> int:
    """Rows to read (Parquet metadata, JSONL non-empty lines), for the progress bar."""
    total = 0
    for p in files:
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq
            total += pq.ParquetFile(str(p)).metadata.num_rows
        else:
            with open(p, "rb") as f:
                total += sum(1 for line in f if line.strip())
    return total


def _tasks(files: list[Path]) -> Iterator[Task]:
    for fi, p in enumerate(files):
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq
            row = 0
            for rb in pq.ParquetFile(str(p)).iter_batches(batch_size=CHUNK_ROWS):
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


def write_dataset(runner: Runner, tasks: Iterable[Task], output: Path, *, inputs: list[str], total_rows: int,
                  strict: bool, progress: bool, meta: dict) -> dict:
    """Run ``tasks`` through ``runner`` into ``output`` (+ sidecar); returns the sidecar dict.

    ``inputs``: the file names that ``Task.file_index`` indexes (stored in the sidecar). Raises
    ``StrictError`` at the first bad row when ``strict`` (nothing is written then), ``ValueError`` when
    no row gave a sample.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    sink = ArrowSink(output)
    counts: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    rows_read = 0
    try:
        with tqdm(total=total_rows or None, unit="row", desc=f"prepare {output.name}", disable=not progress,
                  file=sys.stderr, dynamic_ncols=True, mininterval=0.5) as bar:
            for res in runner.map(tasks):
                for kind, fi, where, detail in res.bad:
                    if strict:
                        raise StrictError(f"{inputs[fi]} {where}: {kind}: {detail} (--strict)")
                    if len(examples[kind]) < EXAMPLES_PER_KIND:
                        examples[kind].append(f"{inputs[fi]} {where}: {detail}")
                counts.update(res.counts)
                rows_read += res.rows_read
                sink.add(res)
                bar.update(res.rows_read)
        stats = sink.stats()
        if stats["num_samples"] == 0:
            raise ValueError(f"{output}: no sample was produced from {rows_read} rows "
                             f"(bad rows: {dict(sorted(_bad_counts(counts).items()))})")
        sidecar = dict(meta, format_version=1, inputs=inputs, rows_read=rows_read,
                       truncated=counts.get("truncated", 0), dropped_overlong=counts.get("dropped_overlong", 0),
                       bad_rows=dict(sorted(_bad_counts(counts).items())), bad_examples=dict(examples),
                       content_sha1=sink.sha1.hexdigest(), time_s=round(time.perf_counter() - t0, 2), **stats)
        sink.commit(sidecar)
        return sidecar
    except BaseException:
        sink.abort()
        raise


def _bad_counts(counts: collections.Counter) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k in BAD_KINDS}


def report(sidecar: dict, output: Path) -> str:
    """Human-readable lines about one written dataset: counts, bad rows with their first examples."""
    lines = [f"wrote {output}: {sidecar['num_samples']} samples, {sidecar['num_tokens']} tokens "
             f"({sidecar['num_loss_tokens']} with loss) from {sidecar['rows_read']} rows in {sidecar['time_s']} s"]
    if "length" in sidecar:
        s = sidecar["length"]
        lines.append(f"  length: min {s['min']} p50 {s['p50']:.0f} p90 {s['p90']:.0f} p99 {s['p99']:.0f} max {s['max']} mean {s['mean']}")
    lines.append(f"  over --max-length {sidecar['max_length']}: truncated {sidecar['truncated']}, "
                 f"dropped {sidecar['dropped_overlong']}")
    bad = sidecar.get("bad_rows", {})
    lines.append(f"  bad rows skipped: {sum(bad.values())}" + (f" {bad}" if bad else ""))
    for kind, ex in sidecar.get("bad_examples", {}).items():
        for e in ex:
            lines.append(f"    {kind}: {e}")
    return "\n".join(lines)


def plan_summary(path: Path) -> str:
    """Bucket summary of the default batch plan (``shared.config.DataConfig`` defaults) over ``path``."""
    from shared.config import DataConfig
    from shared.data import BatchPlan, TokenDataset

    cfg = DataConfig()
    ds = TokenDataset(path)
    plan = BatchPlan(ds.lengths, max_tokens=cfg.max_tokens, max_batch_size=cfg.max_batch_size,
                     bucket_edges=cfg.bucket_edges, num_buckets=cfg.num_buckets, seed=cfg.seed,
                     fingerprint=ds.fingerprint)
    return f"batch plan of {path.name}:\n" + plan.summary()


def prepare_files(inputs: list[str], output: Path, *, tokenizer: Path, max_length: int, overlong: str,
                  strict: bool, workers: int, progress: bool = True, chat_template: str | None = None) -> dict:
    """Tokenize the rows of ``inputs`` (paths, directories or globs) into ``output``; returns the sidecar."""
    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    cfg = EncoderConfig(str(tokenizer), max_length, overlong, vocab_size_of(tokenizer, tok), chat_template)
    runner = Runner(cfg, workers)
    try:
        return write_dataset(runner, _tasks(files), output, inputs=[str(p) for p in files],
                             total_rows=_count_rows(files) if progress else 0, strict=strict,
                             progress=progress, meta=_tokenizer_meta(tokenizer, tok, cfg, overlong))
    finally:
        runner.close()


def _tokenizer_meta(tokenizer: Path, tok, cfg: EncoderConfig, overlong: str) -> dict:
    return {"tokenizer": Path(tokenizer).resolve().name, "tokenizer_path": str(Path(tokenizer).resolve()),
            "vocab_size": cfg.vocab_size, "pad_id": tok.pad_token_id, "eos_id": tok.eos_token_id,
            "max_length": cfg.max_length, "overlong": overlong}


# ---------------------------------------------------------------------------------------------- the demo


def stdlib_files() -> tuple[Path, list[tuple[str, str]], int]:
    """``(stdlib root, [(relative path, text)], files skipped as not UTF-8)``: the running interpreter's
    standard library ``.py`` files (tests included, site-packages excluded, under 200 characters dropped),
    sorted by relative path: the corpus kind of ``assets/tiny-code-lm`` (see its README)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out, undecodable = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "site-packages" in rel.parts or not p.is_file():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            undecodable += 1
            continue
        if len(text) >= 200:
            out.append((rel.as_posix(), text))
    return root, out, undecodable


def is_heldout(rel_path: str) -> bool:
    """The fixture's held-out rule: ``int(sha1(relative path).hexdigest(), 16) % 20 == 0``."""
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 20 == 0


def build_demo(out_dir: Path, *, tokenizer: Path = DEFAULT_TOKENIZER, max_length: int = DEMO_MAX_LENGTH,
               workers: int = 1, progress: bool = True) -> tuple[Path, Path]:
    """Write ``out_dir/train.arrow`` and ``out_dir/heldout.arrow`` (+ sidecars) from the stdlib corpus.

    Each file is tokenized, an EOS token appended, and cut into ``ceil(n / max_length)`` near-equal
    samples (loss on every token); ``source_file`` indexes the sidecar's ``inputs`` (relative paths) and
    ``source_row`` is the piece number within the file. Returns ``(train_path, heldout_path)``.

    ``workers=1`` is the fast choice here: whole files go to the tokenizer's batch encoder, which is already
    multi-threaded in Rust, while worker processes pay a few seconds each to import ``transformers``.
    """
    root, docs, undecodable = stdlib_files()
    tok = load_tokenizer(tokenizer)
    cfg = EncoderConfig(str(tokenizer), max_length, "truncate", vocab_size_of(tokenizer, tok))
    runner = Runner(cfg, workers)
    paths = []
    try:
        for split in ("train", "heldout"):
            part = [(rel, text) for rel, text in docs if is_heldout(rel) == (split == "heldout")]
            names = [rel for rel, _ in part]
            tasks = (Task(i, "doc", list(range(i, min(i + 16, len(part)))), [t for _, t in part[i:i + 16]])
                     for i in range(0, len(part), 16))
            meta = dict(_tokenizer_meta(tokenizer, tok, cfg, "split"), corpus="stdlib", demo_version=DEMO_VERSION,
                        python=sys.version.split()[0], stdlib_root=str(root), num_files=len(part),
                        num_chars=sum(len(t) for _, t in part), undecodable_files_skipped=undecodable)
            path = Path(out_dir) / f"{split}.arrow"
            side = write_dataset(runner, tasks, path, inputs=names, total_rows=len(part), strict=False,
                                 progress=progress, meta=meta)
            print(report(side, path))
            paths.append(path)
    finally:
        runner.close()
    return paths[0], paths[1]


def ensure_demo(repo_root: str | Path = REPO_ROOT) -> tuple[Path, Path]:
    """The demo files under ``repo_root/data/demo``, built first when missing or of an older demo version.

    Safe to call from several processes at once (an ``flock`` on ``data/demo/.lock``).
    Returns ``(train_path, heldout_path)``.
    """
    import fcntl

    from shared.data import sidecar_path

    out_dir = Path(repo_root) / "data" / "demo"
    train, heldout = out_dir / "train.arrow", out_dir / "heldout.arrow"

    def ready() -> bool:
        for p in (train, heldout):
            side = sidecar_path(p)
            if not (p.is_file() and side.is_file()):
                return False
            try:
                if json.loads(side.read_text()).get("demo_version") != DEMO_VERSION:
                    return False
            except ValueError:
                return False
        return True

    if ready():
        return train, heldout
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready():
            logger.info("building the demo corpus in %s", out_dir)
            build_demo(out_dir, workers=1, progress=False)
    return train, heldout


# ------------------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch.py prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="JSONL/Parquet files, directories or globs")
    p.add_argument("--input", action="append", default=[], help="another input (repeatable)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="local Hugging Face tokenizer directory")
    p.add_argument("--output", help="Arrow file to write (its sidecar gets the suffix .json)")
    p.add_argument("--max-length", type=finite_number(int), default=None,
                   help=f"tokens per sample (default 2048; {DEMO_MAX_LENGTH} for --demo)")
    p.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                   help="what to do with samples longer than --max-length")
    p.add_argument("--strict", action="store_true", help="stop with an error at the first bad row")
    p.add_argument("--workers", type=finite_number(int), default=None,
                   help="tokenizer processes, 1 = in this process (default: min(8, CPUs); 1 for --demo, whose "
                        "whole-file batches the Rust tokenizer already spreads over threads)")
    p.add_argument("--chat-template", help="a Jinja chat template file to use instead of the tokenizer's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--demo", action="store_true", help="build the stdlib demo corpus (train + held-out)")
    p.add_argument("--demo-dir", default=str(REPO_ROOT / "data" / "demo"), help="where --demo writes")
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
        if args.demo:
            train, heldout = build_demo(Path(args.demo_dir), tokenizer=Path(args.tokenizer),
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
        template = Path(args.chat_template).read_text() if args.chat_template else None
        output = Path(args.output)
        side = prepare_files(inputs, output, tokenizer=Path(args.tokenizer), max_length=args.max_length or 2048,
                             overlong=args.overlong, strict=args.strict,
                             workers=args.workers or min(8, os.cpu_count() or 1),
                             progress=not args.no_progress, chat_template=template)
        print(report(side, output))
        print(plan_summary(output))
        return 0
    except ConfigError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    except (StrictError, ValueError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1

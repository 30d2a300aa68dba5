"""Rows into samples: the tokenizer side of ``launch.py prepare`` (and of the demo corpus).

Input rows carry ``text`` (tokenized as is, loss on every token), chat ``messages``/``conversations`` (rendered
with the tokenizer's chat template, loss on the assistant turns: ``render_chat``), or ``input_ids`` (+
``loss_mask``). ``Encoder`` turns a ``Task`` (rows of one file) into a ``ChunkResult`` (flat token arrays,
counts, the bad rows named); ``Runner`` spreads tasks over ``spawn`` worker processes, in order, with a
bounded number in flight. Bad rows are ``BadRow`` of a kind in ``BAD_KINDS``.
"""

from __future__ import annotations

import collections
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from specring.shared import envs
from specring.shared.config.run_config import MAX_INT32, check_numbers, num
from specring.shared.data.dataset import has_anchor
from specring.shared.errors import ConfigError
from specring.shared.models.target_config import CONFIG_FILE, read_target_config, text_config

logger = logging.getLogger(__name__)


EXAMPLES_PER_KIND = 5


CHUNK_ROWS = 256                     # rows per task sent to a worker


BAD_KINDS = {
    "invalid_json": "the line is not a JSON object",
    "unknown_format": "no text, messages/conversations or input_ids field",
    "empty": "empty text or empty input_ids",
    "bad_turn": "a turn that is not an object with string role/content (or from/value)",
    "unknown_role": "a turn whose role is not system/user/assistant/tool (or a ShareGPT alias)",
    "no_assistant_turn": "a conversation without an assistant turn",
    "template_error": "the chat template failed to render the conversation",
    "template_mismatch": "an assistant turn cannot be located in the rendered template (dropped, repeated or moved)",
    "bad_tool_calls": "tool_calls that are not a list of objects with a function name, or tools that are not a "
                      "list of objects",
    "tool_calls_not_rendered": "an assistant turn's tool_calls that the chat template does not render (it does not "
                               "support tool calls): the sample would teach a turn without its calls",
    "tools_not_rendered": "the row's tools that the chat template does not render (it does not support tools)",
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


def load_tokenizer(tokenizer_dir: str | Path, trust_remote_code: bool = False):
    """A Hugging Face tokenizer from a local directory (no network), without the max-length warning.

    Loaded through ``shared.models.hub.load_pretrained`` (``trust_remote_code``: the tokenizer's own code may run).
    Raises ``ConfigError`` naming ``--tokenizer`` when the directory does not exist."""
    from specring.shared.models.hub import load_pretrained

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise ConfigError(f"--tokenizer: {path} is not a directory")
    tok = load_pretrained("tokenizer", path, trust_remote_code=trust_remote_code, flag="--tokenizer")
    tok.model_max_length = 1 << 40      # we truncate ourselves; silence "longer than the maximum"
    return tok


def vocab_size_of(tokenizer_dir: str | Path, tok) -> int:
    """Embedding rows of the target: ``vocab_size`` of a ``config.json`` next to the tokenizer, else ``len(tok)``."""
    if (Path(tokenizer_dir) / CONFIG_FILE).is_file():
        v = text_config(read_target_config(tokenizer_dir, flag="--tokenizer")).get("vocab_size")
        if isinstance(v, int) and v > 0:
            return v
    return len(tok)


def normalize_turns(turns: Any) -> list[dict[str, Any]]:
    """``[{"role", "content"}]`` from role/content or ShareGPT from/value turns; raises ``BadRow``.

    Tool use is kept for the chat template: an assistant turn's ``tool_calls`` (OpenAI's ``{"type": "function",
    "function": {"name", "arguments"}}`` or a bare ``{"name", "arguments"}``; ``arguments`` given as JSON text are
    parsed into an object, as vLLM does before it renders a template), a tool turn's ``tool_call_id`` and
    ``name``. A turn with tool calls may have no content. Malformed tool calls are ``bad_tool_calls``."""
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
        turn: dict[str, Any] = {"role": ROLE_ALIASES[role.lower()], "content": content}
        if t.get("tool_calls") is not None:
            if turn["role"] != "assistant":
                raise BadRow("bad_tool_calls", f"turn {i}: tool_calls on a {turn['role']} turn")
            turn["tool_calls"] = _tool_calls(t["tool_calls"], i)
        for key in ("tool_call_id", "name"):
            if isinstance(t.get(key), str) and turn["role"] == "tool":
                turn[key] = t[key]
        out.append(turn)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """The tool calls of turn ``i`` for the template (``normalize_turns``); raises ``BadRow("bad_tool_calls")``."""
    if not isinstance(calls, list) or not calls:
        raise BadRow("bad_tool_calls", f"turn {i}: tool_calls must be a non-empty list")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow("bad_tool_calls", f"turn {i}: tool call {k} has no function name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
                args = parsed if isinstance(parsed, dict) else args
            except ValueError:
                pass
        fn = {**fn, "arguments": {} if args is None else args}
        out.append({**call, "function": fn} if "function" in call else {"type": "function", "function": fn})
    return out


def row_tools(raw: Any) -> list[dict[str, Any]] | None:
    """A row's ``tools`` (a list of objects, or its JSON text) for the chat template; None when absent or empty.
    Raises ``BadRow("bad_tool_calls")`` for anything else."""
    if raw is None or raw == "" or raw == []:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise BadRow("bad_tool_calls", "tools is text that is not JSON") from None
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise BadRow("bad_tool_calls", "tools must be a list of objects")
    return raw or None


def _render(tok, turns: list[dict[str, Any]], chat_template: str | None, tools: list | None) -> str:
    """The conversation as the template renders it (``tools`` passed when there are some)."""
    kw = {"tools": tools} if tools else {}
    return tok.apply_chat_template(turns, tokenize=False, chat_template=chat_template, **kw)


def tool_call_spans(tok, turns: list[dict[str, Any]], text: str, chat_template: str | None = None,
                    tools: list | None = None) -> list[tuple[int, int]]:
    """Character spans of ``text`` that the template rendered from each assistant turn's ``tool_calls``: what
    differs between ``text`` and the conversation rendered without that turn's calls (the common prefix and
    suffix of the two taken away). The model writes those calls when it is served, so they carry loss like the
    content. Raises ``BadRow("tool_calls_not_rendered")`` naming the turn when the template renders nothing of
    them, ``BadRow("template_error")`` when the template fails without them."""
    out = []
    for i, t in enumerate(turns):
        if t["role"] != "assistant" or not t.get("tool_calls"):
            continue
        without = [dict(u) for u in turns]
        del without[i]["tool_calls"]
        try:
            other = _render(tok, without, chat_template, tools)
        except Exception as e:  # noqa: BLE001 - jinja errors
            raise BadRow("template_error", f"{type(e).__name__}: {e}") from None
        p, limit = 0, min(len(text), len(other))
        while p < limit and text[p] == other[p]:
            p += 1
        q = 0
        while q < limit - p and text[-1 - q] == other[-1 - q]:
            q += 1
        grow = len(text) - len(other)
        if grow > 0 and p + grow + q == len(text):  # an insertion: put it at its earliest place, before the text
            start = max(0, p - grow)                  # it shares with what follows ("<tool_call>" before "<|im_end|>")
            while start < p and text[start + grow:] != other[start:]:
                start += 1
            p, q = start, len(text) - start - grow
        if len(text) - q <= p:
            names = [c["function"]["name"] for c in t["tool_calls"]]
            raise BadRow("tool_calls_not_rendered", f"turn {i}: the chat template renders none of its tool calls "
                                                    f"{names}; use a template that supports tool calls "
                                                    f"(--chat-template)")
        out.append((p, len(text) - q))
    return out


def render_chat(tok, turns: list[dict[str, Any]], chat_template: str | None = None,
                tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of a conversation rendered with the chat template, and its assistant loss mask.

    Returns ``(input_ids [T] int32, loss_mask [T] uint8)``. ``loss_mask`` is 1 on every token that overlaps the
    characters the template rendered from an assistant turn's content, and on the first token after them when it is a
    special token (the end-of-turn token, ``<|im_end|>`` for ChatML: the drafter must learn to end a turn); 0 elsewhere
    (role headers, text the template adds, the newline after the end-of-turn token, other turns). An empty assistant
    turn carries loss on its end-of-turn token only (as transformers' ``{% generation %}`` mask has it), or none when
    the template renders an empty turn differently from a non-empty one. Where the assistant text is found is decided by
    ``assistant_spans``, which works for any turn order, system and tool turns, several assistant turns and templates
    that add text or transform the content (``| trim``), with or without ``{% generation %}`` markers. Raises ``BadRow``
    (``no_assistant_turn``, ``template_error``, ``template_mismatch``).

    Tool use: ``tools`` (the row's) go to the template, and so do the turns' ``tool_calls`` (``normalize_turns``);
    the text the template renders from an assistant turn's tool calls carries loss as its content does
    (``tool_call_spans``; joined to the content's span across the whitespace between them), with the
    end-of-turn token after it. A template that renders the tools or tool calls as if they were not there raises
    ``BadRow("tools_not_rendered")`` / ``BadRow("tool_calls_not_rendered")``: silently dropped calls would
    teach the drafter turns that the target never writes.
    """
    if not any(t["role"] == "assistant" for t in turns):
        raise BadRow("no_assistant_turn")
    try:
        text = _render(tok, turns, chat_template, tools)
    except Exception as e:  # jinja errors, "roles must alternate", no template at all
        raise BadRow("template_error", f"{type(e).__name__}: {e}") from None
    if tools:
        try:
            bare = _render(tok, turns, chat_template, None)
        except Exception:  # noqa: BLE001 - a template that needs its tools: it renders them
            bare = None
        if bare == text:
            raise BadRow("tools_not_rendered", f"the chat template renders none of the row's {len(tools)} tools; use "
                                               f"a template that supports tools (--chat-template)")
    try:
        spans = assistant_spans(tok, turns, text, chat_template, include_empty=True, tools=tools)
    except BadRow:
        if all(t["content"] for t in turns if t["role"] == "assistant"):
            raise
        spans = assistant_spans(tok, turns, text, chat_template, tools=tools)  # empty turns rendered apart: no loss
    spans = _join_spans(text, spans, tool_call_spans(tok, turns, text, chat_template, tools))
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


def _join_spans(text: str, content: list[tuple[int, int]], calls: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The content spans and the tool-call spans in text order, each tool-call span joined to the content span
    just before it when only whitespace lies between them (a turn's content and its calls: one span)."""
    if not calls:
        return content
    tagged = sorted([(a, b, False) for a, b in content] + [(a, b, True) for a, b in calls])
    out: list[tuple[int, int]] = []
    for a, b, is_call in tagged:
        if is_call and out and (a <= out[-1][1] or not text[out[-1][1]:a].strip()):
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def assistant_spans(tok, turns: list[dict[str, Any]], text: str, chat_template: str | None = None,
                    include_empty: bool = False, tools: list | None = None) -> list[tuple[int, int]]:
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
        marked = _render(tok, probe, chat_template, tools)
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


@dataclass
class EncoderConfig:
    """What a worker needs to turn rows into samples (picklable)."""
    tokenizer_dir: str
    max_length: int = num(ge=1, le=MAX_INT32)
    overlong: str = "truncate"        # or "drop"
    vocab_size: int = num(0, ge=0, le=MAX_INT32)   # 0 = from the tokenizer directory
    chat_template: str | None = None
    trust_remote_code: bool = False   # --trust-remote-code of `launch.py prepare`

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
        self.tok = load_tokenizer(cfg.tokenizer_dir, cfg.trust_remote_code)
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
            ids, mask = render_chat(self.tok, normalize_turns(turns), self.cfg.chat_template,
                                    tools=row_tools(rec.get("tools")))
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


_WORKER: dict[str, Encoder] = {}


def _init_worker(cfg: EncoderConfig) -> None:
    import signal

    from specring.shared.process.procs import set_parent_death_signal
    set_parent_death_signal(signal.SIGKILL)          # a tokenizer worker dies with its launcher, whatever kills it
    envs.put("TOKENIZERS_PARALLELISM", "false")   # one process per core already
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

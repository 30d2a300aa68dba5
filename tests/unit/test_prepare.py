"""Unit tests of cli/prepare.py and shared/data/encode.py: chat rendering and its loss mask, bad-row accounting,
--strict, length limits, input kinds, and the demo corpus (on a few stdlib files)."""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specring.cli import prepare as prepare_cli
from specring.shared.data import demo, encode
from specring.shared.data.dataset import TokenDataset, sidecar_path
from specring.shared.data.demo import (
    DEFAULT_TARGET,
    build_demo,
    ensure_demo,
    is_heldout,
)
from specring.shared.data.encode import load_tokenizer, normalize_turns, render_chat

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write add."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "And sub?"},
    {"role": "assistant", "content": "def sub(a, b):\n    return a - b"},
]
ANSWERS = [CONVERSATION[2]["content"], CONVERSATION[4]["content"]]

# A template of another layout, with no {% generation %} markers, ending turns with the EOS token.
PLAIN_TEMPLATE = ("{% for m in messages %}### {{ m['role'] | upper }}:\n{{ m['content'] }}"
                  "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n\n{% endfor %}"
                  "{% if add_generation_prompt %}### ASSISTANT:\n{% endif %}")
# The fixture's ChatML layout, with generation markers, to compare against transformers' own mask.
MARKED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                   "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
                   "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_TARGET)


def masked_runs(tok, ids, mask) -> list[str]:
    """Decoded text of each maximal run of loss-carrying tokens."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


# ----------------------------------------------------------------------------------------------- chat


def test_chat_mask_covers_assistant_content_and_end_of_turn(tok):
    ids, mask = render_chat(tok, CONVERSATION)
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and len(ids) == len(mask)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == text
    assert masked_runs(tok, ids, mask) == [a + "<|im_end|>" for a in ANSWERS]
    # The end-of-turn token of the system and user turns carries no loss, nor the newline after an answer.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert [int(m) for t, m in zip(ids, mask) if t == im_end] == [0, 0, 1, 0, 1]


def test_chat_mask_with_a_template_without_generation_markers(tok):
    ids, mask = render_chat(tok, CONVERSATION, PLAIN_TEMPLATE)
    assert "### ASSISTANT:" in tok.decode(ids.tolist(), skip_special_tokens=False)
    assert masked_runs(tok, ids, mask) == [a + "<|endoftext|>" for a in ANSWERS]


def test_chat_mask_equals_transformers_generation_mask(tok):
    out = tok.apply_chat_template(CONVERSATION, chat_template=MARKED_TEMPLATE, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = render_chat(tok, CONVERSATION, MARKED_TEMPLATE)
    assert ids.tolist() == list(out["input_ids"])
    assert mask.tolist() == list(out["assistant_masks"])
    assert sum(out["assistant_masks"]) > 20


def test_chat_mask_ignores_a_user_turn_that_quotes_the_answer(tok):
    turns = [{"role": "user", "content": "Say: def f(): pass"}, {"role": "assistant", "content": "def f(): pass"}]
    ids, mask = render_chat(tok, turns)
    assert masked_runs(tok, ids, mask) == ["def f(): pass<|im_end|>"]


def _t(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


# Conversations of every shape (issue 14 item 7): turn orders, system/tool turns, empty contents, contents
# that equal template text, repeated answers. Oracle: transformers' own {% generation %} mask.
SHAPES = {
    "starts_with_assistant": _t(("assistant", "t"), ("user", "ok"), ("assistant", "done")),
    "only_assistant": _t(("assistant", "a")),
    "system_first": _t(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")),
    "assistant_then_system": _t(("assistant", "first"), ("system", "s"), ("assistant", "second")),
    "empty_assistant_between": _t(("user", "q"), ("assistant", ""), ("user", "q2"), ("assistant", "a2")),
    "consecutive_assistants": _t(("user", "q"), ("assistant", "x"), ("assistant", "x")),
    "content_is_a_role_name": _t(("user", "assistant"), ("assistant", "assistant"), ("user", "user"),
                                 ("assistant", "user")),
    "content_is_template_text": _t(("assistant", "<|im_start|>"), ("user", "\n"), ("assistant", "\n")),
    "repeated_answer_quoted_first": _t(("user", "ok ok"), ("assistant", "ok"), ("user", "ok?"), ("assistant", "ok")),
    "tool_turns": _t(("user", "run"), ("assistant", "call f"), ("tool", "f -> 1"), ("assistant", "1")),
    "single_characters": _t(("assistant", "s"), ("user", "s"), ("assistant", "s")),
}


# The fixture's template with {% generation %} markers around each answer and its <|im_end|>, rendering the
# very same text (the {{ "\n" }} survives trim_blocks).
FIXTURE_MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                  "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
                  "{% else %}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_chat_mask_of_every_shape_equals_the_generation_mask(tok, shape):
    turns = SHAPES[shape]
    out = tok.apply_chat_template(turns, chat_template=FIXTURE_MARKED, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert tok.decode(out["input_ids"], skip_special_tokens=False) == tok.apply_chat_template(turns, tokenize=False)
    for template in (FIXTURE_MARKED, None):       # with markers, and the fixture's own template without
        ids, mask = render_chat(tok, turns, template)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.tolist() == list(out["assistant_masks"]), (shape, template)


def test_chat_that_starts_with_the_assistant_masks_its_content_not_the_header(tok):
    """The reported input: the mask landed on <|im_start|> and ``t``/its <|im_end|> got 0."""
    ids, mask = render_chat(tok, SHAPES["starts_with_assistant"])
    toks = tok.convert_ids_to_tokens(ids.tolist())
    assert [t for t, m in zip(toks, mask.tolist()) if m] == ["t", "<|im_end|>", "done", "<|im_end|>"]


# Templates that add text of their own: a default system prompt that contains the answers, a reasoning
# block before every answer, trimmed and upper-cased content.
SYSTEM_ADDING = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant. "
                 "Say ok, t or done.<|im_end|>\n{% endif %}" + MARKED_TEMPLATE)
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
            "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}")
TRIMMING = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}"
            "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}")


@pytest.mark.parametrize("template, turns, want", [
    (SYSTEM_ADDING, _t(("assistant", "t"), ("user", "ok"), ("assistant", "done")), ["t<|im_end|>", "done<|im_end|>"]),
    (SYSTEM_ADDING, _t(("user", "ok"), ("assistant", "ok")), ["ok<|im_end|>"]),
    (THINKING, _t(("user", "q"), ("assistant", "think"), ("user", "q"), ("assistant", "</think>")),
     ["think<|im_end|>", "</think><|im_end|>"]),
    (TRIMMING, _t(("assistant", "  ASSISTANT  "), ("user", " x "), ("assistant", "\nUSER\n")),
     [" ASSISTANT<|endoftext|>", " USER<|endoftext|>"]),   # the template's space is merged into the token
    (PLAIN_TEMPLATE, _t(("assistant", "ASSISTANT"), ("user", "###"), ("assistant", "###")),
     ["ASSISTANT<|endoftext|>", "###<|endoftext|>"]),
])
def test_chat_mask_with_templates_that_add_or_change_text(tok, template, turns, want):
    ids, mask = render_chat(tok, turns, template)
    assert masked_runs(tok, ids, mask) == want


def test_a_template_whose_layout_depends_on_the_content_is_a_named_bad_row(tok):
    # Qwen3-style: a reasoning block in the content is moved into a header the marker does not produce
    moving = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if '</think>' in m['content'] %}"
              "<think>{{ m['content'].split('</think>')[0] }}</think>\n{{ m['content'].split('</think>')[1] }}"
              "{% else %}<think></think>\n{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}")
    with pytest.raises(encode.BadRow, match="turn 1: .*depending on its content") as e:
        render_chat(tok, _t(("user", "q"), ("assistant", "r</think>a")), moving)
    assert e.value.kind == "template_mismatch"


def test_sharegpt_turns_normalise():
    turns = normalize_turns([{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}])
    assert turns == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                     {"role": "assistant", "content": "a"}]
    with pytest.raises(encode.BadRow) as e:
        normalize_turns([{"from": "narrator", "value": "x"}])
    assert e.value.kind == "unknown_role" and "narrator" in str(e.value)


# --------------------------------------------------------------------------------------- the command


def run_prepare(capsys, *argv) -> tuple[int, str, str]:
    rc = prepare_cli.main(["--workers", "1", "--no-progress", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = [
    {"text": "import os\nprint(os.getcwd())\n"},
    {"messages": CONVERSATION},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "return 1"}]},
    {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
    {"input_ids": [9, 10, 11]},
]
# (row, kind) pairs; each kind named in the issue, plus unparsable lines and rows of no known format.
BAD = [
    ({"text": "   "}, "empty"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
    ({"input_ids": [1, 2, 8192]}, "token_out_of_range"),
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, "loss_mask_length"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, "loss_mask_all_zero"),
    ({"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 0, 1, 0, 1]}, "no_anchor"),
    ("{not json", "invalid_json"),
    ({"prompt": "x"}, "unknown_format"),
]


def mixed_rows() -> tuple[list, dict[str, int]]:
    """GOOD and BAD rows interleaved; returns the rows and the 1-based line of each bad kind."""
    rows, lines = [], {}
    for i in range(max(len(GOOD), len(BAD))):
        if i < len(GOOD):
            rows.append(GOOD[i])
        if i < len(BAD):
            rows.append(BAD[i][0])
            lines[BAD[i][1]] = len(rows)
    return rows, lines


def test_bad_rows_are_counted_and_named_and_good_rows_kept(tmp_path, capsys):
    rows, lines = mixed_rows()
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "out.arrow"
    rc, stdout, _ = run_prepare(capsys, src, "--output", out)
    assert rc == 0
    side = json.loads(sidecar_path(out).read_text())
    assert side["bad_rows"] == {kind: 1 for _, kind in BAD}
    for kind, line in lines.items():
        assert side["bad_examples"][kind][0].startswith(f"{src} line {line}:"), (kind, side["bad_examples"][kind])
        assert f"{kind}: {src} line {line}:" in stdout
    ds = TokenDataset(out)
    assert len(ds) == len(GOOD) and side["rows_read"] == len(rows)
    good_lines = [i + 1 for i, r in enumerate(rows) if any(r is g for g in GOOD)]
    assert [ds.source(i) for i in range(len(ds))] == [(0, line) for line in good_lines]
    assert ds[3][0].tolist() == [5, 6, 7, 8] and ds[3][1].tolist() == [0, 1, 1, 1]
    assert ds[4][1].tolist() == [1, 1, 1]
    assert ds.vocab_size == 8192 and ds.pad_id == 3 and side["tokenizer"] == "tiny-code-lm"
    assert re.search(r"\[\d+, \d+\): \d+ batches \([\d.]+%\)", stdout)   # the plan summary


def test_strict_fails_naming_the_first_bad_row(tmp_path, capsys):
    rows, lines = mixed_rows()
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "out.arrow"
    rc, _, err = run_prepare(capsys, src, "--output", out, "--strict")
    first_kind, first_line = min(lines.items(), key=lambda kv: kv[1])
    assert rc == 1
    assert f"{src} line {first_line}: {first_kind}" in err
    assert not out.exists() and not sidecar_path(out).exists() and not list(tmp_path.glob("*.tmp"))
    # Only good rows: --strict passes.
    write_jsonl(tmp_path / "good.jsonl", GOOD)
    rc, _, _ = run_prepare(capsys, tmp_path / "good.jsonl", "--output", out, "--strict")
    assert rc == 0 and len(TokenDataset(out)) == len(GOOD)


def test_parquet_rows_are_named_by_row_number(tmp_path, capsys):
    table = pa.table({"text": ["x = 1\n", "", "y = 2\n"]})
    pq.write_table(table, tmp_path / "t.parquet")
    out = tmp_path / "p.arrow"
    rc, stdout, _ = run_prepare(capsys, "--input", tmp_path / "t.parquet", "--output", out)
    assert rc == 0
    side = json.loads(sidecar_path(out).read_text())
    assert side["bad_rows"] == {"empty": 1}
    assert side["bad_examples"]["empty"] == [f"{tmp_path / 't.parquet'} row 1: text is empty"]
    assert [TokenDataset(out).source(i) for i in range(2)] == [(0, 0), (0, 2)]


def test_overlong_truncate_and_drop(tmp_path, capsys):
    rows = [{"input_ids": list(range(1, n + 1))} for n in (3, 10, 5, 12)]
    src = write_jsonl(tmp_path / "ids.jsonl", rows)
    rc, stdout, _ = run_prepare(capsys, src, "--output", tmp_path / "t.arrow", "--max-length", 6)
    assert rc == 0 and "truncated 2, dropped 0" in stdout
    ds = TokenDataset(tmp_path / "t.arrow")
    assert ds.lengths.tolist() == [3, 6, 5, 6] and ds[1][0].tolist() == [1, 2, 3, 4, 5, 6]
    rc, stdout, _ = run_prepare(capsys, src, "--output", tmp_path / "d.arrow", "--max-length", 6,
                                "--overlong", "drop")
    assert rc == 0 and "truncated 0, dropped 2" in stdout
    side = json.loads(sidecar_path(tmp_path / "d.arrow").read_text())
    assert side["dropped_overlong"] == 2 and TokenDataset(tmp_path / "d.arrow").lengths.tolist() == [3, 5]


def test_truncation_that_removes_all_loss_is_a_bad_row(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
                                             {"input_ids": [1, 2], "loss_mask": [1, 1]}])
    rc, _, _ = run_prepare(capsys, src, "--output", tmp_path / "o.arrow", "--max-length", 2)
    assert rc == 0
    assert json.loads(sidecar_path(tmp_path / "o.arrow").read_text())["bad_rows"] == {"loss_mask_all_zero": 1}


def test_globs_and_several_files(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", [{"input_ids": [1, 1]}, {"input_ids": [2, 2]}])
    write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [3, 3]}])
    rc, _, _ = run_prepare(capsys, str(tmp_path / "*.jsonl"), "--output", tmp_path / "o.arrow")
    assert rc == 0
    ds = TokenDataset(tmp_path / "o.arrow")
    assert [ds[i][0].tolist() for i in range(3)] == [[1, 1], [2, 2], [3, 3]]
    assert [ds.source(i) for i in range(3)] == [(0, 1), (0, 2), (1, 1)]


def test_command_errors_name_the_flag(tmp_path, capsys):
    rc, _, err = run_prepare(capsys, "--output", tmp_path / "o.arrow")
    assert rc == 2 and "no input" in err
    rc, _, err = run_prepare(capsys, tmp_path / "missing.jsonl", "--output", tmp_path / "o.arrow")
    assert rc == 2 and "missing.jsonl" in err
    write_jsonl(tmp_path / "bad.jsonl", ["{", {"text": ""}])
    rc, _, err = run_prepare(capsys, tmp_path / "bad.jsonl", "--output", tmp_path / "o.arrow")
    assert rc == 1 and "no sample" in err and not (tmp_path / "o.arrow").exists()


def test_worker_processes_give_the_same_file(tmp_path, capsys):
    # Starts two spawned tokenizer processes (a few seconds): the output must not depend on --workers.
    rows, _ = mixed_rows()
    src = write_jsonl(tmp_path / "mixed.jsonl", rows * 300)
    digests = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}.arrow"
        assert prepare_cli.main([str(src), "--output", str(out), "--workers", str(workers), "--no-progress"]) == 0
        side = json.loads(sidecar_path(out).read_text())
        digests.append((side["content_sha1"], side["num_samples"], side["bad_rows"]))
    capsys.readouterr()
    assert digests[0] == digests[1] and digests[0][1] == len(GOOD) * 300


# ---------------------------------------------------------------------------------------------- demo


def test_heldout_rule_matches_the_fixture_readme():
    assert is_heldout("x.py") == (int(hashlib.sha1(b"x.py").hexdigest(), 16) % 20 == 0)
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [p.relative_to(root).as_posix() for p in root.rglob("*.py")]
    held = [n for n in names if is_heldout(n)]
    assert 0.02 < len(held) / len(names) < 0.08   # about 1 in 20


def test_build_demo_on_a_few_files(tmp_path, monkeypatch):
    root = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p.relative_to(root).as_posix() for p in root.glob("*.py"))
    held = [n for n in names if is_heldout(n)][:2]
    train = [n for n in names if not is_heldout(n)][:6]
    docs = [(n, (root / n).read_text(encoding="utf-8")) for n in sorted(held + train)]
    monkeypatch.setattr(demo, "stdlib_files", lambda: (root, docs, 0))
    tr, ho = build_demo(tmp_path, max_length=256, workers=1, progress=False)
    tok = load_tokenizer(DEFAULT_TARGET)
    for path, expect in ((tr, train), (ho, held)):
        ds = TokenDataset(path)
        side = json.loads(sidecar_path(path).read_text())
        assert side["inputs"] == sorted(expect) and side["corpus"] == "stdlib"
        assert int(ds.lengths.max()) <= 256
        # Every file's pieces, in order, are its tokens followed by EOS; loss on every token.
        for fi, name in enumerate(side["inputs"]):
            pieces = [i for i in range(len(ds)) if ds.source(i)[0] == fi]
            ids = np.concatenate([ds[i][0] for i in pieces]).tolist()
            assert ids == tok(docs[[d[0] for d in docs].index(name)][1])["input_ids"] + [tok.eos_token_id]
            assert all(ds[i][1].all() for i in pieces)


def test_ensure_demo_builds_once(tmp_path, monkeypatch):
    calls = []

    def fake_build(out_dir, **kw):
        calls.append(out_dir)
        for split in ("train", "heldout"):
            (out_dir / f"{split}.arrow").write_bytes(b"x")
            sidecar_path(out_dir / f"{split}.arrow").write_text(json.dumps({"demo_version": demo.DEMO_VERSION}))
        return out_dir / "train.arrow", out_dir / "heldout.arrow"

    monkeypatch.setattr(demo, "build_demo", fake_build)
    first = ensure_demo(tmp_path)
    second = ensure_demo(tmp_path)
    assert first == second == (tmp_path / "data/demo/train.arrow", tmp_path / "data/demo/heldout.arrow")
    assert len(calls) == 1


def test_rows_without_an_anchor_are_named_and_a_file_of_only_them_is_an_error(tmp_path, capsys):
    """Issue 14 item 6: no two adjacent trainable tokens (also after truncation, or a 1-token text) means no
    DFlash anchor: prepare names the rows instead of writing samples that train nothing."""
    rows = [{"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 0, 1, 0, 1]},
            {"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 1, 1]},                  # anchor at 2: kept
            {"input_ids": [5, 6, 7, 8], "loss_mask": [1, 0, 1, 1]}]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    rc, _, err = run_prepare(capsys, src, "--output", tmp_path / "a.arrow", "--max-length", "3")
    assert rc == 1 and "'no_anchor': 3" in err      # truncated to [0, 1, 0] / [1, 0, 1]: no anchor left
    assert not (tmp_path / "a.arrow").exists()
    rc, stdout, _ = run_prepare(capsys, src, "--output", tmp_path / "b.arrow")
    assert rc == 0 and "no_anchor: " + str(src) + " line 1: no two adjacent tokens carry loss" in stdout
    assert json.loads(sidecar_path(tmp_path / "b.arrow").read_text())["bad_rows"] == {"no_anchor": 1}
    assert len(TokenDataset(tmp_path / "b.arrow")) == 2
    only = write_jsonl(tmp_path / "only.jsonl", rows[:1] * 2)
    rc, _, err = run_prepare(capsys, only, "--output", tmp_path / "c.arrow")
    assert rc == 1 and "no sample was produced" in err and "'no_anchor': 2" in err
    assert not (tmp_path / "c.arrow").exists()

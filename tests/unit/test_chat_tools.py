"""Chat rows with tool use (issue 27, kind 7; SpecForge #555 is the same class): the row's ``tools`` and the
assistant turns' ``tool_calls`` reach the chat template, the rendered calls carry loss like the content (a
tool-call-only turn is not an empty turn), and a template that cannot render them names the rows instead of
dropping the calls silently.

``tests/fixtures/chat-templates/tools.jinja`` is the tool part of Qwen2.5's template (``<tools>`` in the system
turn, ``<tool_call>`` blocks in assistant turns, ``<tool_response>`` for tool turns); the fixture target's own
template renders role and content only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specring.cli.prepare import main as prepare_main
from specring.shared.data.dataset import TokenDataset, sidecar_path
from specring.shared.data.encode import BadRow, load_tokenizer, normalize_turns, render_chat, row_tools
from tests.support import TARGET

TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat-templates" / "tools.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL_ONLY = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "It is 21 C in Paris."}]}
WITH_CONTENT = {"messages": [
    {"role": "user", "content": "Compare Paris and Rome."},
    {"role": "assistant", "content": "Checking both.", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "content": "21"}, {"role": "tool", "content": "25"},
    {"role": "assistant", "content": "Rome is warmer."}]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TARGET)


def _loss_text(tok, ids, mask) -> str:
    return tok.decode([int(i) for i, m in zip(ids, mask) if m])


def test_tools_and_a_tool_call_only_turn_reach_the_template_and_the_call_carries_loss(tok):
    ids, mask = render_chat(tok, normalize_turns(CALL_ONLY["messages"]), TEMPLATE.read_text(),
                            tools=row_tools(CALL_ONLY["tools"]))
    text = tok.decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text, text   # the row's tools
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in text, text                         # arguments given as JSON text: an object, as vLLM passes it
    assert _loss_text(tok, ids, mask) == call + "<|im_end|>" + "It is 21 C in Paris.<|im_end|>"


def test_content_and_parallel_calls_of_one_turn_are_one_span(tok):
    ids, mask = render_chat(tok, normalize_turns(WITH_CONTENT["messages"]), TEMPLATE.read_text())
    calls = "".join(f'\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
                    for c in ("Paris", "Rome"))
    assert _loss_text(tok, ids, mask) == "Checking both." + calls + "<|im_end|>" + "Rome is warmer.<|im_end|>"


def test_a_template_that_cannot_render_them_is_named(tok):
    with pytest.raises(BadRow, match=r"tool_calls_not_rendered: turn 1: the chat template renders none of its "
                                     r"tool calls \['get_weather', 'get_weather'\]"):
        render_chat(tok, normalize_turns(WITH_CONTENT["messages"]))        # the fixture's role/content template
    with pytest.raises(BadRow, match="tools_not_rendered: the chat template renders none of the row's 1 tools"):
        render_chat(tok, normalize_turns(CALL_ONLY["messages"]), tools=row_tools(CALL_ONLY["tools"]))
    for bad in ([{"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": "{}"}}]}],
                [{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]}]):
        with pytest.raises(BadRow, match="bad_tool_calls"):
            normalize_turns(bad)
    with pytest.raises(BadRow, match="bad_tool_calls"):
        row_tools("not json")


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prepare_names_the_rows_a_template_cannot_render_and_keeps_them_with_one_that_can(tmp_path, capsys):
    plain = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    src = _write(tmp_path / "chat.jsonl", [plain, CALL_ONLY, WITH_CONTENT])
    out = tmp_path / "out.arrow"
    assert prepare_main([str(src), "--output", str(out), "--workers", "1", "--no-progress"]) == 0
    report = capsys.readouterr().out
    side = json.loads(sidecar_path(out).read_text())
    assert side["bad_rows"] == {"tool_calls_not_rendered": 1, "tools_not_rendered": 1}, side["bad_rows"]
    assert f"tools_not_rendered: {src} line 2:" in report and f"tool_calls_not_rendered: {src} line 3:" in report, \
        report
    assert len(TokenDataset(out)) == 1
    assert prepare_main([str(src), "--output", str(out), "--workers", "1", "--no-progress", "--strict"]) == 1
    assert f"{src} line 2: tools_not_rendered" in capsys.readouterr().err

    assert prepare_main([str(src), "--output", str(out), "--workers", "1", "--no-progress", "--chat-template",
                         str(TEMPLATE)]) == 0
    assert json.loads(sidecar_path(out).read_text())["bad_rows"] == {}
    ds = TokenDataset(out)
    tok = load_tokenizer(TARGET)
    ids, mask = ds[1]
    assert "<tool_call>" in _loss_text(tok, ids, mask) and int(np.asarray(mask).sum()) > 10


def test_parquet_rows_with_tool_calls(tmp_path):
    """Parquet gives every turn every struct field, absent ones as null: a user turn's tool_calls is None."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    msgs = [{"role": m["role"], "content": m.get("content"), "tool_calls": m.get("tool_calls")}
            for m in WITH_CONTENT["messages"]]
    for m in msgs:
        for c in m["tool_calls"] or []:
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    pq.write_table(pa.Table.from_pylist([{"messages": msgs}]), tmp_path / "chat.parquet")
    out = tmp_path / "out.arrow"
    assert prepare_main([str(tmp_path / "chat.parquet"), "--output", str(out), "--workers", "1", "--no-progress",
                         "--chat-template", str(TEMPLATE)]) == 0
    assert json.loads(sidecar_path(out).read_text())["bad_rows"] == {}
    ds = TokenDataset(out)
    ids, mask = ds[0]
    assert len(ds) == 1 and '"arguments": {"city": "Rome"}' in _loss_text(load_tokenizer(TARGET), ids, mask)

"""``launch.py report`` and the live page's server (issue 28), on run directories written here: every plot and
table is in the page (structure, not pixels), several runs share one page, missing and truncated files are named
instead of raising, and the live page answers only at its token, read-only.

The report of a real short run and the live page in headless Chromium are ``tests/system/test_report_live.py``.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from specring.cli import report as report_cli
from specring.supervisor import report
from specring.supervisor.timeseries import TimeSeries

PNG = b"\x89PNG\r\n\x1a\n"
T0 = 1_800_000_000.0


class Page(HTMLParser):
    """What a test looks at in a page: figures (data-plot, data-empty, img src), tables (id -> rows of cells),
    the items of the missing list, and every src/href."""

    def __init__(self, text: str):
        super().__init__()
        self.figures: dict[str, dict] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self.row_classes: dict[str, list[str]] = {}
        self.missing: list[str] = []
        self.links: list[str] = []
        self.ids: set[str] = set()
        self._fig = self._table = None
        self._cell: list[str] | None = None
        self._in_missing = self._in_li = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        for k in ("src", "href"):
            if k in a:
                self.links.append(a[k])
        if tag == "figure" and "data-plot" in a:
            self._fig = a["data-plot"]
            self.figures[self._fig] = {"empty": a.get("data-empty"), "img": None}
        elif tag == "img" and self._fig:
            self.figures[self._fig]["img"] = a.get("src")
        elif tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
            self.row_classes[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
            self.row_classes[self._table].append(a.get("class", ""))
        elif tag in ("td", "th") and self._table:
            self._cell = []
        elif tag == "section" and a.get("id") == "missing":
            self._in_missing = True
        elif tag == "li" and self._in_missing:
            self._in_li = True
            self.missing.append("")

    def handle_endtag(self, tag):
        if tag == "figure":
            self._fig = None
        elif tag == "table":
            self._table = None
        elif tag in ("td", "th") and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "section":
            self._in_missing = False
        elif tag == "li":
            self._in_li = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._in_li:
            self.missing[-1] += data


def _jsonl(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def make_run_dir(path: Path, drafter: str = "dflash", steps: int = 30, producers: int = 2,
                 devices: str = "cpu") -> Path:
    """A run directory as a finished run leaves it: config, summary, metrics (per-position accuracy of
    ``drafter``'s kind), eval.jsonl with a failed evaluation, and a time series written by ``TimeSeries`` itself
    with samples, a restart, a hang and a fence."""
    path.mkdir(parents=True)
    acc_key, n = ("per_step_acc", 7) if drafter == "eagle3" else ("per_slot_acc", 3)
    cfg = {"run_dir": str(path), "producer": {"devices": [devices] * producers, "target": "t"},
           "trainer": {"devices": [devices], "drafter": drafter, "block_size": 4, "lr": 0.003},
           "nodes": {"nnodes": 1}}
    (path / "config.json").write_text(json.dumps(cfg))
    metrics = []
    for s in range(steps):
        m = {"step": s, "loss": 20.0 / (1 + s), acc_key: [min(1.0, s / steps / (j + 1)) for j in range(n)],
             "accept_proxy": 1.0, "num_blocks": 64, "num_tokens": 512, "tokens_per_s": 1000.0 + s,
             "batch_ids": [s], "lr": 0.003, "time": T0 + 10 + 2 * s}
        if drafter == "dflash2":
            m.update(selector_acc=m[acc_key], topk_recall=m[acc_key])
        metrics.append(m)
    _jsonl(path / "metrics.jsonl", metrics)
    _jsonl(path / "eval.jsonl", [
        {"step": 10, "tau_mean": 1.1, "tau_p50": 1.0, "tau_p90": 2.0, "time": T0 + 31},
        {"step": 20, "tau_mean": None, "error": "RuntimeError: on purpose", "stage": "eval", "time": T0 + 51},
        {"step": steps, "tau_mean": 1.3, "tau_p50": 1.0, "tau_p90": 2.0, "time": T0 + 12 + 2 * steps}])
    (path / "summary.json").write_text(json.dumps({
        "exit_reason": "done", "run_id": "r", "planned_batches": steps, "trained_batches": steps,
        "restarts": {str(i): int(i == 0) for i in range(producers)}, "loss_first": 20.0, "loss_last": 1.0,
        "tokens_per_s": 1234.5, "elapsed_s": 12.0 + 2 * steps, "tau_last": {"step": steps, "tau_mean": 1.3},
        "balance": {"producer_duty_cycle": 0.6, "consumer_starvation": 0.2}}))
    (path / "status.json").write_text(json.dumps({"pid": 1, "run_id": "r", "rows": [
        {"role": "producer", "index": 0, "pid": 11, "generation": 2, "state": "running", "heartbeat_age_s": 0.2,
         "tokens_per_s": 900.0, "restarts": 1, "duty_cycle": 0.6, "cpu_percent": 50.0, "rss_bytes": 2**28,
         "ring": {"FREE": 1, "WRITING": 1, "READY": 1, "READING": 0}, "work": "batch 3", "work_s": 0.4},
        {"role": "consumer", "index": 0, "pid": 12, "generation": 1, "state": "running", "heartbeat_age_s": 0.1,
         "tokens_per_s": 800.0, "restarts": 0, "starvation": 0.2}]}))
    ts = TimeSeries(path, "r", producers=producers, consumers=1, num_slots=3)
    tokens = 0
    for k in range(steps + 10):
        tokens += 400 * (k > 5)
        rows = [{"role": "producer", "index": i, "state": "running", "generation": 1, "restarts": 0,
                 "tokens_per_s": 500.0, "duty_cycle": 0.5 + 0.01 * i,
                 "ring": {"FREE": k % 3, "WRITING": 1, "READY": 2 - k % 3, "READING": 0}} for i in range(producers)]
        rows.append({"role": "consumer", "index": 0, "state": "running", "tokens_per_s": 450.0, "starvation": 0.2})
        ts.sample(rows, k, steps, 1.0, 900.0, {"producer_duty_cycle": 0.55, "consumer_starvation": 0.2}, k, tokens,
                  now=T0 + 1 + 2 * k)
    ts.event("restart", "restart producer=0 exitcode=-9 generation=2", when=T0 + 20)
    ts.event("fence", "fence producer=0 generation=2 requeued=[4]", when=T0 + 20.1)
    ts.event("hang", "hang producer=1 pid=5 generation=1 reason=no heartbeat action=kill", when=T0 + 40)
    ts.close()
    recs = [json.loads(x) for x in (path / "timeseries.jsonl").read_text().splitlines()]
    recs[0]["time"] = T0  # the start record: its clock time is the run's
    recs[-1]["time"] = T0 + 30 + 2 * steps
    _jsonl(path / "timeseries.jsonl", recs)
    return path


def eval_json(path: Path, drafter_path: str) -> Path:
    path.write_text(json.dumps({"drafter": drafter_path, "block_size": 4, "rows": [
        {"dataset": "heldout", "drafter": "target greedy (reference)", "num_prompts": 4, "tau_mean": 1.0},
        {"dataset": "heldout", "drafter": "dflash step-000030", "num_prompts": 4, "tau_mean": 1.4,
         "tokens_per_s": 50.0, "speedup": 1.1},
        {"dataset": "heldout", "drafter": "dflash untrained", "num_prompts": 4, "tau_mean": 1.0},
        {"dataset": "heldout", "drafter": "prompt-lookup (n<=3)", "num_prompts": 4, "tau_mean": 1.7}]}))
    return path


def read_page(index: Path) -> Page:
    return Page(index.read_text())


def test_the_report_of_a_run_has_every_plot_and_table_and_needs_no_network(tmp_path):
    run = make_run_dir(tmp_path / "runA", drafter="dflash2")
    ev = eval_json(tmp_path / "a.json", str(run / "checkpoints" / "step-000030"))
    index = report.write_report([run], eval_files=[ev])
    assert index == run / "report" / "index.html"
    page = read_page(index)
    assert set(page.figures) == set(report.PLOTS)
    for name, fig in page.figures.items():
        assert fig["empty"] == "0", name
        assert fig["img"].startswith("data:image/png;base64,")
        assert base64.b64decode(fig["img"].split(",", 1)[1]).startswith(PNG)
        assert (run / "report" / f"{name}.png").read_bytes().startswith(PNG)
    assert not [x for x in page.links if not x.startswith("data:")], page.links  # self-contained
    for tid in ("table-runs", "table-events", "table-summary", "table-config", "table-eval"):
        assert tid in page.tables and len(page.tables[tid]) > 1, tid
    events = {r[2] for r in page.tables["table-events"][1:]}
    assert {"restart", "fence", "hang"} <= events
    assert page.tables["table-runs"][1][:4] == ["runA", str(run), "dflash2", "done"]
    summary = {r[0]: r[1] for r in page.tables["table-summary"][1:]}
    assert summary["exit_reason"] == "done" and summary["balance.producer_duty_cycle"] == "0.6"
    assert {r[2] for r in page.tables["table-eval"][1:]} >= {"prompt-lookup (n<=3)", "dflash untrained"}
    assert len(page.missing) == 0 and "nothing" in index.read_text()
    assert "<title>specring report: runA</title>" in index.read_text()


def test_two_runs_share_one_page_and_the_rows_that_differ_are_marked(tmp_path, monkeypatch, capsys):
    a = make_run_dir(tmp_path / "a", drafter="dflash")
    b = make_run_dir(tmp_path / "b", drafter="eagle3", producers=1, devices="cuda:0")
    monkeypatch.chdir(tmp_path)
    assert report_cli.main([str(a), str(b)]) == 0
    index = tmp_path / "reports" / "a-vs-b" / "index.html"
    assert capsys.readouterr().out.strip() == f"report: {index}"
    page = read_page(index)
    assert [r[0] for r in page.tables["table-runs"][1:]] == ["a", "b"]
    assert page.tables["table-runs"][2][10] == "1"  # GPUs of b; a is a CPU run
    config = page.tables["table-config"]
    assert config[0] == ["field", "a", "b"]
    differs = {row[0] for row, cls in zip(config, page.row_classes["table-config"]) if cls == "differs"}
    assert {"trainer.drafter", "producer.devices"} <= differs and "trainer.lr" not in differs
    assert all(f["empty"] == "0" for f in page.figures.values())


def test_missing_and_truncated_files_are_named_not_raised(tmp_path, capsys):
    run = make_run_dir(tmp_path / "broken")
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[:-40])            # a killed consumer's last line
    (run / "summary.json").write_text('{"exit_reason": "do')   # torn
    (run / "eval.jsonl").write_text("not json\n")
    (run / "config.json").unlink()
    (run / "timeseries.jsonl").write_bytes((run / "timeseries.jsonl").read_bytes()[:-25])
    assert report_cli.main([str(run), "--output", str(tmp_path / "out")]) == 0
    page = read_page(tmp_path / "out" / "index.html")
    said = " | ".join(page.missing)
    assert "config.json: missing" in said
    assert "summary.json: unreadable, truncated or corrupt" in said
    assert "metrics.jsonl: 1 of 30 lines did not parse, first at line 30 (the last line is cut short" in said
    assert "eval.jsonl: 1 of 1 lines did not parse" in said
    assert "timeseries.jsonl: 1 of" in said
    assert page.figures["loss"]["empty"] == "0"   # the 29 whole lines are still drawn
    assert page.figures["tau"]["empty"] == "1"
    assert set(page.figures) == set(report.PLOTS)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert report_cli.main([str(empty)]) == 0
    page = read_page(empty / "report" / "index.html")
    assert all(f["empty"] == "1" for f in page.figures.values())
    assert {m.split(":")[1].strip() for m in page.missing} >= {"config.json", "summary.json", "metrics.jsonl",
                                                              "eval.jsonl", "timeseries.jsonl"}
    capsys.readouterr()
    assert report_cli.main([str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert report_cli.main([str(run), "--eval", str(tmp_path / "bad.json")]) == 2
    assert "--eval" in capsys.readouterr().err


def test_a_run_without_a_time_series_takes_its_events_from_the_supervisor_log(tmp_path):
    run = make_run_dir(tmp_path / "old")
    (run / "timeseries.jsonl").unlink()
    (run / "logs").mkdir()
    import time as _time
    hms = _time.strftime("%H:%M:%S", _time.localtime(T0 + 30))
    (run / "logs" / "supervisor.log").write_text(
        f"{hms} supervisor INFO specring.supervisor.lifecycle: restart producer=1 exitcode=-9 generation=2 "
        "old_generation=1 backoff_s=0.50 graceful=False\n"
        f"{hms} supervisor INFO specring.supervisor.lifecycle: spawn producer=1 pid=9 generation=2\n")
    r = report.load_run(run)
    assert [e["event"] for e in r.events] == ["restart"]
    assert abs(r.events[0]["time"] - (T0 + 30)) < 1.0
    assert any("logs/supervisor.log" in p for p in r.problems)
    assert any("timeseries.jsonl: missing" in p for p in r.problems)


def test_minutes_leave_out_the_time_between_sessions_and_gpu_minutes_count_gpus(tmp_path):
    r = report.Run(path=tmp_path, name="x", sessions=[(0.0, 600.0), (10_000.0, 10_600.0)],
                   config={"producer": {"devices": ["cuda:0+cuda:1", "cuda:2"]}, "trainer": {"devices": ["cuda:2"]},
                           "nodes": {"nnodes": 2}})
    assert r.minutes(300.0) == 5.0 and r.minutes(5_000.0) == 10.0 and r.minutes(10_300.0) == 15.0
    assert r.minutes(11_200.0) == 30.0   # after the last record of the last session: still counting
    assert r.gpus == 6 and r.device_minutes(300.0) == 30.0


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), ""


def test_the_live_page_answers_at_its_token_only_and_is_read_only(tmp_path):
    from specring.supervisor.live_page import make_server
    run = make_run_dir(tmp_path / "live")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*"))
    server, url = make_server(run, refresh_s=1.0)
    assert url.startswith("http://127.0.0.1:") and server.server_address[0] == "127.0.0.1"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code, headers, body = _get(url)
        assert code == 200 and "default-src 'none'" in headers["Content-Security-Policy"]
        page = Page(body)
        assert set(page.figures) == set(report.PLOTS)
        procs = page.tables["table-processes"]
        assert [r[0] for r in procs[1:]] == ["producer-0", "consumer-0"]
        assert procs[1][12] == "1/1/1/0" and procs[1][13] == "batch 3 for 0.4s"
        assert "live-state" in page.ids and "not going" in body  # nobody holds the run directory
        base = url.rsplit("/", 2)[0]
        for bad in (base + "/", base + "/wrong/", url + "../config.json", url + "x"):
            assert _get(bad)[0] == 404, bad
        req = urllib.request.Request(url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 501
    finally:
        server.shutdown()
        server.server_close()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*")) == before  # wrote nothing


def test_no_report_file_names_an_event_kind_the_supervisor_does_not_record():
    from specring.supervisor.timeseries import EVENTS
    assert set(report.EVENT_STYLE) - {"resume"} <= set(EVENTS.values())
    logging.getLogger(__name__).debug("kinds %s", sorted(report.EVENT_STYLE))


def test_the_live_page_reads_only_what_was_appended_and_waits_for_a_line_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "time": T0 + s}) + "\n" for s in range(3))
    path.write_text(whole + '{"step": 3, "ti')                # the consumer is writing line 4
    cache: dict = {}
    problems: list[str] = []
    assert [r["step"] for r in report.read_jsonl(path, "m", problems, "", ("step", "time"), cache)] == [0, 1, 2]
    assert problems == []
    with open(path, "a") as f:
        f.write(f'me": {T0 + 3}}}\n' + json.dumps({"step": 4, "time": T0 + 4}) + "\n")
    assert [r["step"] for r in report.read_jsonl(path, "m", problems, "", ("step", "time"), cache)] == [0, 1, 2, 3, 4]
    assert problems == [] and cache[str(path)].offset == path.stat().st_size
    path.write_text(json.dumps({"step": 0, "time": T0}) + "\n")  # rewritten (a resume): read again from the start
    assert [r["step"] for r in report.read_jsonl(path, "m", problems, "", ("step", "time"), cache)] == [0]


def test_values_of_unexpected_types_cost_a_table_not_the_page(tmp_path):
    run = tmp_path / "odd"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"exit_reason": "done", "restarts": {"0": "x"}}))
    (run / "config.json").write_text(json.dumps({"producer": {"devices": "cuda:0"}, "nodes": {"nnodes": "2"}}))
    _jsonl(run / "metrics.jsonl", [{"step": 0, "time": T0, "loss": "nan?", "per_slot_acc": [None, "x"]}])
    r = report.load_run(run)
    text = report.render_page([r], [], [], "t")
    page = Page(text)
    assert "this table failed: TypeError" in text and "table-runs" in page.ids
    assert len(page.tables["table-summary"]) > 1 and len(page.tables["table-config"]) > 1
    assert all(not p.error for p in report.render_plots([r], []))  # odd values are skipped, not fatal

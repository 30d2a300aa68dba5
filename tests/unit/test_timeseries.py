"""``RUN_DIR/timeseries.jsonl`` (issue 28): the supervisor's samples and event lines, bounded in size, read back
whatever a killed supervisor left."""

from __future__ import annotations

import json
import logging

from specring.supervisor.timeseries import TimeSeries, read_timeseries


def rows(free: int = 3) -> list[dict]:
    return [{"role": "producer", "index": 0, "state": "running", "generation": 1, "restarts": 0, "tokens_per_s": 10.0,
             "duty_cycle": 0.5, "ring": {"FREE": free, "WRITING": 1, "READY": 0, "READING": 0}},
            {"role": "consumer", "index": 0, "state": "running", "tokens_per_s": 9.0, "starvation": 0.25}]


def test_samples_events_and_stop_are_written_and_read_back(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="specring.supervisor")  # as configure_logging sets it in the supervisor
    ts = TimeSeries(tmp_path, "rid", producers=1, consumers=1, num_slots=4, interval_s=1.0)
    assert ts.sample(rows(), 3, 10, 2.5, 100.0, {"producer_duty_cycle": 0.5}, 3, 300, now=1000.0)
    assert not ts.sample(rows(), 4, 10, 2.4, 100.0, None, 4, 400, now=1000.5)  # under interval_s: skipped
    logging.getLogger("specring.supervisor.lifecycle").warning("hang producer=0 pid=1 generation=1 reason=x")
    logging.getLogger("specring.supervisor.lifecycle").info("spawn producer=0 pid=1 generation=1")  # not an event
    logging.getLogger("specring.supervisor.coordinator").info("fence producer=0 generation=2 requeued=[1]")
    ts.close()
    logging.getLogger("specring.supervisor.lifecycle").warning("hang producer=0 after close")
    recs, bad = read_timeseries(tmp_path / "timeseries.jsonl")
    assert bad == 0
    assert [r["kind"] for r in recs] == ["start", "sample", "event", "event", "stop"]
    s = recs[1]
    assert s["producers"][0]["ring"] == [3, 1, 0, 0] and s["consumers"][0]["starvation"] == 0.25
    assert s["producer_duty_cycle"] == 0.5 and s["consumer_starvation"] is None and s["tokens_trained"] == 300
    assert [r["event"] for r in recs if r["kind"] == "event"] == ["hang", "fence"]


def test_the_file_stays_bounded_and_spans_the_whole_run(tmp_path):
    ts = TimeSeries(tmp_path, "rid", interval_s=1.0, max_samples=10, max_events=3)
    for t in range(200):
        ts.sample(rows(), t, 200, 1.0, 1.0, None, t, t, now=float(t))
    for i in range(5):
        ts.event("restart", f"restart producer=0 #{i}")
    ts.close()
    recs, _ = read_timeseries(tmp_path / "timeseries.jsonl")
    samples = [r for r in recs if r["kind"] == "sample"]
    assert 5 <= len(samples) <= 10, len(samples)
    assert samples[0]["step"] == 0 and samples[-1]["step"] > 150  # thinned, not cut: the start is still there
    assert sum(r["kind"] == "event" for r in recs) == 3 and recs[-1]["events_dropped"] == 2
    assert ts.interval_s >= 16


def test_a_torn_last_line_is_counted_and_a_resumed_run_appends_after_it(tmp_path):
    path = tmp_path / "timeseries.jsonl"
    path.write_text(json.dumps({"kind": "start", "time": 1.0}) + "\n" + '{"kind": "sample", "ti')
    recs, bad = read_timeseries(path)
    assert len(recs) == 1 and bad == 1
    ts = TimeSeries(tmp_path, "rid", resume=True)
    ts.close()
    recs, bad = read_timeseries(path)
    assert bad == 1 and [r["kind"] for r in recs] == ["start", "start", "stop"] and recs[1]["resume"] is True

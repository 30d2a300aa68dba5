"""The progress display without a terminal: plain ``progress step=...`` log lines, no carriage returns."""

import logging
from types import SimpleNamespace

from specring.shared.data.dataset import Batch
from specring.supervisor.coordinator import Coordinator
from specring.supervisor.progress import Progress


def test_non_interactive_progress_logs_key_value_lines_without_carriage_returns(caplog, capsys):
    co = Coordinator([Batch(batch_id=i, epoch=0, sample_ids=(i,), pad_to=8) for i in range(4)], num_producers=2,
                     num_slots=3, num_consumers=1)
    producers = [SimpleNamespace(index=0, restarts=1), SimpleNamespace(index=1, restarts=0)]
    p = Progress(total_steps=4, num_producers=2, log_interval_s=0.0, interactive=False)
    with caplog.at_level(logging.INFO, logger="specring.supervisor.progress"):
        p.update(3, 5.25, co)
        p.refresh(co, producers, 1234.4)
        p.update(4, 4.5, co)  # after the last refresh: the closing line still has the final step and loss
        p.close(tokens_per_s=1000.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "progress step=3/4 loss=5.250 tokens_per_s=1234 rings_FWRr=3/0/0/0,3/0/0/0 restarts=1"
    assert lines[-1] == "progress step=4/4 loss=4.500 tokens_per_s=1000 rings_FWRr=3/0/0/0,3/0/0/0 restarts=1"
    assert "\r" not in capsys.readouterr().err


def test_progress_line_carries_the_balance_figures_when_given(caplog):
    co = Coordinator([Batch(batch_id=0, epoch=0, sample_ids=(0,), pad_to=8)], num_producers=1, num_slots=2,
                     num_consumers=1)
    p = Progress(total_steps=1, num_producers=1, log_interval_s=0.0, interactive=False)
    with caplog.at_level(logging.INFO, logger="specring.supervisor.progress"):
        p.refresh(co, [SimpleNamespace(index=0, restarts=0)], 10.0,
                  {"producer_duty_cycle": 0.934, "consumer_starvation": None})
    assert caplog.records[-1].getMessage().endswith("restarts=0 duty=0.93 starved=-")


def test_a_failed_tau_evaluation_is_named_in_the_progress_line(caplog):
    """Issue 24: a τ evaluation that raised is not only in the consumer's log; the live line and the closing one
    name it (count, step, error), the closing one with failures found after the last refresh too."""
    co = Coordinator([Batch(batch_id=0, epoch=0, sample_ids=(0,), pad_to=8)], num_producers=1, num_slots=2,
                     num_consumers=1)
    p = Progress(total_steps=1, num_producers=1, log_interval_s=0.0, interactive=False)
    producers = [SimpleNamespace(index=0, restarts=0)]
    first = {"step": 5, "error": "RuntimeError: crop was called, but the current layer does not track past states"}
    with caplog.at_level(logging.INFO, logger="specring.supervisor.progress"):
        p.refresh(co, producers, 10.0)
        assert "eval_failed" not in caplog.records[-1].getMessage()
        p.refresh(co, producers, 10.0, eval_failures=[first])
        assert caplog.records[-1].getMessage().endswith(f"restarts=0 eval_failed=1 (step 5: {first['error']})")
        p.close(tokens_per_s=9.0, eval_failures=[first, {"step": 10, "error": "ValueError: " + "x" * 300}])
    last = caplog.records[-1].getMessage()
    assert last.count("eval_failed=") == 1 and "eval_failed=2 (step 10: ValueError: xxx" in last
    assert last.endswith("...)") and len(last) < 250

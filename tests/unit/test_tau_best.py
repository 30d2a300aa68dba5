"""summary.json's ``tau_best``: the record of eval.jsonl with the highest held-out τ (failures skipped, the earliest
of equals) and its checkpoint directory when the run still holds it (supervisor/records.py)."""

import json
from types import SimpleNamespace

from specring.supervisor.records import RunRecords


def _records(run_dir, recs):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return RunRecords(SimpleNamespace(run_dir=run_dir))  # its eval.jsonl readers need only the run directory


def test_tau_best_is_the_peak_with_its_checkpoint_and_not_the_last(tmp_path):
    (tmp_path / "checkpoints" / "step-000200").mkdir(parents=True)
    rr = _records(tmp_path, [{"step": 100, "tau_mean": 2.0}, {"step": 200, "tau_mean": 3.5},
                             {"step": 300, "error": "RuntimeError: boom"}, {"step": 400, "tau_mean": 3.5},
                             {"step": 500, "tau_mean": 3.1}])
    assert rr._tau_last() == {"step": 500, "tau_mean": 3.1}
    assert rr._tau_best() == {"step": 200, "tau_mean": 3.5, "checkpoint": str(tmp_path / "checkpoints" / "step-000200")}


def test_tau_best_of_a_step_without_a_checkpoint_says_so_and_none_without_records(tmp_path):
    rr = _records(tmp_path / "a", [{"step": 150, "tau_mean": 4.0}, {"step": 200, "tau_mean": 1.0}])
    assert rr._tau_best() == {"step": 150, "tau_mean": 4.0, "checkpoint": None}  # a snapshot between checkpoints
    assert _records(tmp_path / "b", [{"step": 100, "error": "x"}])._tau_best() is None

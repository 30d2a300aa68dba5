"""The targets users train for now, end to end with the real launcher (issue 24): tiny random Qwen3.5 (Gated
DeltaNet linear attention with full attention every third layer), Qwen3-Next (the same with mixture-of-experts
MLPs) and Qwen3-MoE targets built from transformers' config classes and saved with the fixture's tokenizer
(``tests.support.write_tiny_target``; no download). Each trains a few steps with τ measured during training,
`launch.py eval` reports τ on the checkpoint, lossless against greedy decoding, and `launch.py export` writes a
drafter that loads back with the checkpoint's logits and decodes losslessly too.

And a τ evaluation that fails during training is never silent: it is in the progress line, in ``summary.json``
(``eval_failures``) and in the run's last line.
"""

from __future__ import annotations

import json

import pytest
import torch

from specring.cli.eval import main as eval_main
from specring.cli.export import main as export_main
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters import load_export
from tests.support import write_tiny_target
from tests.system.launcher_util import run_launcher, small_flags, summary

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py

ROLLBACK = {"qwen3_5": "replay", "qwen3_next": "replay", "qwen3_moe": "crop"}
EVAL = ["--num-prompts", "2", "--prompt-len", "32", "--max-new-tokens", "12"]


def short_run(dataset, run_dir, target, steps=4, **extra):
    """A short CPU run on ``target``: one producer, one consumer, layers 1 and 5, τ on 2 held-out prompts at
    the last step."""
    return small_flags(dataset, run_dir, steps, target=str(target), producers="cpu", heldout=dataset,
                       eval_prompts=2, eval_prompt_len=32, eval_max_new_tokens=8, checkpoint_every=steps, **extra)


@pytest.mark.parametrize("kind", list(ROLLBACK))
def test_a_hybrid_or_moe_target_trains_evaluates_losslessly_and_exports(kind, dataset, tmp_path, capsys):
    target = write_tiny_target(tmp_path / kind, kind)
    run_dir = tmp_path / "run"
    code, log = run_launcher(short_run(dataset, run_dir, target), tmp_path / "train.log", 240)
    assert code == 0, log[-3000:]
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["trained_batches"] == s["planned_batches"] == 4, s
    assert s["eval_failures"] == [] and s["tau_last"]["step"] == 4, s
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [4] and evals[0]["tau_mean"] >= 1.0, evals
    assert evals[0]["cache_rollback"] == ROLLBACK[kind], evals
    assert "tau evaluation FAILED" not in log and "tau_eval_failed" not in log

    report = tmp_path / "eval.json"
    capsys.readouterr()
    assert eval_main(["--drafter", str(run_dir), "--data", str(dataset), *EVAL, "--baselines", "prompt-lookup",
                      "--output-json", str(report)]) == 0, capsys.readouterr().err[-3000:]
    rep = json.loads(report.read_text())
    rows = {r["drafter"].split()[0]: r for r in rep["rows"]}
    assert {"target", "dflash", "prompt-lookup"} <= set(rows), list(rows)
    for name in ("dflash", "prompt-lookup"):
        assert rows[name]["lossless_mismatches"] == 0 and rows[name]["tau_mean"] >= 1.0, rows[name]
        assert rows[name]["cache_rollback"] == ROLLBACK[kind], rows[name]
    assert (rows["dflash"]["rollback_forwards"] > 0) == (ROLLBACK[kind] == "replay")

    out = tmp_path / "export"
    assert export_main(["--drafter", str(run_dir), "--output", str(out), "--dtype", "float32"]) == 0, \
        capsys.readouterr().err[-3000:]
    served, mine = load_export(out), ckpt.load_drafter(run_dir)
    torch.manual_seed(0)
    feats = torch.randn(10, 2 * 32)
    a, _ = mine.draft_block(feats, torch.arange(10), 5, 10, None)
    b, _ = served.draft_block(feats, torch.arange(10), 5, 10, None)
    assert torch.equal(a, b)
    if ROLLBACK[kind] == "replay":  # the export decodes a hybrid target as served, lossless
        assert eval_main(["--drafter", str(out), "--target", str(target), "--data", str(dataset), *EVAL,
                          "--no-baselines", "--output-json", str(report)]) == 0, capsys.readouterr().err[-3000:]
        row = json.loads(report.read_text())["rows"][-1]
        assert row["drafter"].startswith("dflash") and row["lossless_mismatches"] == 0 and row["tau_mean"] >= 1.0


def test_a_failed_tau_evaluation_is_named_in_the_progress_the_summary_and_the_last_line(dataset, tmp_path):
    run_dir = tmp_path / "run"
    target = write_tiny_target(tmp_path / "moe", "qwen3_moe")
    flags = short_run(dataset, run_dir, target, steps=2)
    code, log = run_launcher(flags, tmp_path / "train.log", 240, env={"SPECRING_FAIL_EVAL": "1"})
    assert code == 0, log[-3000:]                       # training itself went on and finished
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["tau_last"] is None, s
    assert [f["step"] for f in s["eval_failures"]] == [2], s
    assert s["eval_failures"][0]["error"].startswith("RuntimeError: SPECRING_FAIL_EVAL=1"), s
    progress = [x for x in log.splitlines() if "progress step=" in x]
    assert progress and "eval_failed=1 (step 2: RuntimeError: SPECRING_FAIL_EVAL=1" in progress[-1], progress
    assert "supervisor ERROR specring.supervisor.records: eval_failed step=2" in log
    last = next(x for x in log.splitlines() if x.startswith("run done:"))
    assert "tau evaluation FAILED 1x (steps [2]; last: RuntimeError: SPECRING_FAIL_EVAL=1" in last, last
    rec = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
    assert rec["step"] == 2 and rec["tau_mean"] is None and rec["stage"] == "eval"

"""EAGLE-3 through the whole pipeline (issue 16), with the real launcher on the embedded fixture target: real
producers sending the target's labels and top-K log-probabilities, a real consumer training the EAGLE-3 drafter
with training-time test, τ during training, then `launch.py export` (checked against the engines' names and
shapes) and `launch.py eval`; and an interrupted run resumed exactly, its draft vocabulary read back, never
rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specring.cli.eval import main as eval_main
from specring.cli.export import main as export_main
from specring.cli.ops import status_main
from specring.cli.train import train_main
from specring.shared.data.dataset import TokenDataset
from specring.shared.drafters.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab
from specring.shared.drafters.eagle3_export import check_eagle3_export
from specring.shared.models.eagle3 import draft_to_target
from specring.shared.models.layer_ids import default_eagle3_layer_ids
from specring.shared.models.target_config import read_target_config, text_config
from tests.support import REPO, TARGET
from tests.system.launcher_util import (
    interrupt_after_checkpoint,
    metrics_batch_ids,
    run_launcher,
    segments_of,
    small_flags,
    summary,
)

pytestmark = pytest.mark.timeout(300)

DRAFT_VOCAB = 512
TTT_STEPS = 3


def eagle3_flags(data: Path, run_dir: Path, steps: int, **extra) -> list[str]:
    """``small_flags`` for an EAGLE-3 run: the default (three) target layers, a small draft vocabulary, 3 TTT steps."""
    return small_flags(data, run_dir, steps, **{"target-layers": "none", "drafter": "eagle3",
                                                "draft-vocab": DRAFT_VOCAB, "ttt-steps": TTT_STEPS, **extra})


def _target_shape() -> dict:
    return text_config(read_target_config(TARGET))


def _most_frequent_loss_tokens(data: Path, vocab: int, n: int) -> set[int]:
    """The ``n`` most frequent loss-carrying token ids of ``data``, ties to the lower id, counted here row by row."""
    ds = TokenDataset(data)
    counts = np.zeros(vocab, dtype=np.int64)
    for i in range(len(ds)):
        ids, lm = ds[i]
        np.add.at(counts, ids[lm != 0].astype(np.int64), 1)
    order = sorted(range(vocab), key=lambda j: (-counts[j], j))
    return set(order[:n])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_every_batch_once(run_dir: Path, planned: int) -> list[dict]:
    s = summary(run_dir)
    ids = metrics_batch_ids(run_dir)
    assert len(ids) == len(set(ids)), f"batches trained twice: {sorted(b for b in set(ids) if ids.count(b) > 1)}"
    assert s["duplicate_batches"] == 0 and s["lost_batches"] == 0 and s["bad_batches"] == 0, s
    assert s["planned_batches"] + s.get("trained_before_resume", 0) == planned == len(ids), (s, len(ids))
    assert segments_of(s["run_id"]) == []
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_eagle3_run_trains_to_completion_exports_and_evaluates(dataset, tmp_path, capsys):
    run_dir, steps = tmp_path / "run", 6
    flags = eagle3_flags(dataset, run_dir, steps, heldout=dataset, eval_prompts=2, eval_prompt_len=32,
                         eval_max_new_tokens=8)
    code, log = run_launcher(flags, tmp_path / "train.log", 240)
    assert code == 0, log[-3000:]

    shape = _target_shape()
    vocab, layers = int(shape["vocab_size"]), int(shape["num_hidden_layers"])
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["trainer"]["drafter"] == "eagle3" and cfg["trainer"]["label_source"] == "target"
    assert cfg["trainer"]["distill_topk"] > 0                             # the default top-K, filled at start
    assert cfg["producer"]["target_layer_ids"] == default_eagle3_layer_ids(layers)
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["trained_batches"] == s["planned_batches"] == steps, s

    # the draft vocabulary: the most frequent loss-carrying tokens of the data, as offsets the engines read
    d2t, t2d = read_draft_vocab(run_dir, DRAFT_VOCAB, vocab)
    assert set(draft_to_target(d2t).tolist()) == _most_frequent_loss_tokens(dataset, vocab, DRAFT_VOCAB)
    assert int(t2d.sum()) == DRAFT_VOCAB

    records = _assert_every_batch_once(run_dir, steps)
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:                                                     # accuracy per TTT step
        assert "per_slot_acc" not in r and len(r["per_step_acc"]) == TTT_STEPS, r
        assert all(a is None or 0.0 <= a <= 1.0 for a in r["per_step_acc"]), r
        assert np.isfinite(r["loss"]) and r["num_blocks"] > 0, r
    assert any(a for r in records for a in r["per_step_acc"]), "no TTT step was ever right"
    assert records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [5, 6] and all(e["tau_mean"] >= 1.0 for e in evals), evals

    out = tmp_path / "export"                                              # the commands, in this process
    capsys.readouterr()
    assert export_main(["--drafter", str(run_dir), "--output", str(out)]) == 0, capsys.readouterr().err[-3000:]
    printed = capsys.readouterr().out
    assert "LlamaForCausalLMEagle3" in printed and "EAGLE3" in printed, printed
    exported = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    check_eagle3_export(exported, tensors)                                # the engines' names, shapes, d2t/t2d
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"] and exported["draft_vocab_size"] == DRAFT_VOCAB
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == cfg["producer"]["target_layer_ids"]
    assert torch.equal(tensors["d2t"], d2t) and torch.equal(tensors["t2d"], t2d)
    assert "embed_tokens.weight" not in tensors and tuple(tensors["lm_head.weight"].shape) == (DRAFT_VOCAB,
                                                                                                 shape["hidden_size"])
    assert export_main(["--drafter", str(run_dir), "--output", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err

    report = tmp_path / "eval.json"
    assert eval_main(["--drafter", str(run_dir), "--data", str(dataset), "--num-prompts", "2", "--prompt-len", "32",
                      "--max-new-tokens", "8", "--num-draft-tokens", "3", "--baselines", "prompt-lookup",
                      "--output-json", str(report)]) == 0, capsys.readouterr().err[-3000:]
    rep = json.loads(report.read_text())
    assert rep["drafter_kind"] == "eagle3" and rep["block_size"] == 4
    rows = {r["drafter"].split()[0]: r for r in rep["rows"]}
    assert set(rows) == {"target", "eagle3", "prompt-lookup"}, list(rows)
    for name in ("eagle3", "prompt-lookup"):                               # lossless, on the same prompts
        assert rows[name]["lossless_mismatches"] == 0 and rows[name]["num_prompts"] == 2
        assert rows[name]["tau_mean"] >= 1.0 and rows[name]["mean_drafted"] <= 3


def test_an_interrupted_eagle3_run_resumes_exactly_with_its_draft_vocabulary(dataset, tmp_path, capsys):
    run_dir, steps = tmp_path / "run", 24

    def accuracy_per_ttt_step_in_status():
        capsys.readouterr()
        assert status_main(["--run-dir", str(run_dir)]) == 0                # the live run's accuracy per TTT step
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("eagle3 accuracy per TTT step"))
        assert [x.split(":")[0] for x in line.split("): ")[1].split()] == [str(k) for k in range(TTT_STEPS)], line

    code, log = interrupt_after_checkpoint(eagle3_flags(dataset, run_dir, steps, checkpoint_every=2, eval_prompts=0),
                                           run_dir, tmp_path / "first.log", accuracy_per_ttt_step_in_status)
    assert code == 130, log[-3000:]
    s1 = summary(run_dir)
    assert s1["exit_reason"] == "interrupted" and 0 < s1["trained_batches"] < steps, s1
    vocab_file = run_dir / DRAFT_VOCAB_FILE
    digest, mtime = _digest(vocab_file), vocab_file.stat().st_mtime_ns

    # a resume without its draft vocabulary is refused, naming the file, before anything starts
    moved = tmp_path / "moved.safetensors"
    os.replace(vocab_file, moved)
    out = subprocess.run([sys.executable, "launch.py", "train", "--run-dir", str(run_dir), "--resume"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"error: --resume: {vocab_file} is missing" in out.stderr, out.stderr[-3000:]
    os.replace(moved, vocab_file)
    # the draft vocabulary's size cannot change on resume
    capsys.readouterr()
    assert train_main(["--run-dir", str(run_dir), "--resume", "--draft-vocab", "1024"]) == 2
    assert "--draft-vocab cannot change when resuming (the run trained with 512)" in capsys.readouterr().err

    code, log = run_launcher(["--run-dir", str(run_dir), "--resume"], tmp_path / "second.log", 240)
    assert code == 0, log[-3000:]
    s2 = summary(run_dir)
    assert s2["exit_reason"] == "done" and s2["trained_before_resume"] > 0, s2
    records = _assert_every_batch_once(run_dir, steps)
    assert [r["step"] for r in records] == list(range(steps))
    assert all(len(r["per_step_acc"]) == TTT_STEPS for r in records)
    assert _digest(vocab_file) == digest and vocab_file.stat().st_mtime_ns == mtime   # read back, not rebuilt
    assert "draft_vocab read=" in (run_dir / "logs" / "supervisor.log").read_text()

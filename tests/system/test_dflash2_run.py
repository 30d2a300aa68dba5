"""DFlash2 through the whole pipeline (issue 22), with the real launcher on the embedded fixture target: real
producers, a real consumer training the convolutions and the candidate selector (its metrics in every record),
τ during training, then `launch.py export` as ``DFlash2DraftModel`` (the public header's names and shapes), the
export loaded back with the checkpoint's logits, and `launch.py eval` decoding through the selector, lossless at
temperature 0 and sampling at temperature 1.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specring.cli.eval import main as eval_main
from specring.cli.export import main as export_main
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters import load_export
from specring.shared.drafters.dflash2_export import reference_weight_names
from specring.shared.models.dflash2 import DFlash2Drafter
from tests.system.launcher_util import metrics_batch_ids, run_launcher, small_flags, summary

pytestmark = pytest.mark.timeout(300)

TOP_K, RANK = 8, 16


def test_a_dflash2_run_trains_exports_loads_back_and_evaluates(dataset, tmp_path, capsys):
    run_dir, steps = tmp_path / "run", 6
    flags = small_flags(dataset, run_dir, steps, drafter="dflash2", heldout=dataset, eval_prompts=2,
                        eval_prompt_len=32, eval_max_new_tokens=8, **{"trainer.selector-top-k": TOP_K,
                                                                     "trainer.selector-rank": RANK,
                                                                     "trainer.loss": "dpace"})
    code, log = run_launcher(flags, tmp_path / "train.log", 240)
    assert code == 0, log[-3000:]
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["trained_batches"] == s["planned_batches"] == steps, s
    ids = metrics_batch_ids(run_dir)
    assert len(ids) == len(set(ids)) == steps
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:                                       # the selector's own figures, per slot 1..B-1
        assert len(r["per_slot_acc"]) == len(r["selector_acc"]) == len(r["topk_recall"]) == 3, r
        assert all(a is None or 0.0 <= a <= 1.0 for a in r["selector_acc"] + r["topk_recall"]), r
        assert np.isfinite(r["loss"]) and np.isfinite(r["selector_loss"]) and r["selector_loss"] > 0, r
    assert records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals and all(e["tau_mean"] >= 1.0 for e in evals), evals
    assert ckpt.drafter_kind(run_dir) == "dflash2"

    out = tmp_path / "export"
    capsys.readouterr()
    assert export_main(["--drafter", str(run_dir), "--output", str(out), "--dtype", "float32"]) == 0, \
        capsys.readouterr().err[-3000:]
    assert "DFlash2DraftModel" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in cfg
    d = cfg["dflash_config"]
    assert ((d["selector_top_k"], d["selector_rank"], d["conv_kernel_size"], d["conv_group_size"])
            == (TOP_K, RANK, 2, 16))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert set(tensors) == reference_weight_names(1)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    assert tuple(tensors["layers.0.attention_conv.base_kernel"].shape) == (2, 2, h)
    assert tuple(tensors["layers.0.mlp_conv.kernel_projection.weight"].shape) == (2 * 2 * h // 16, h)
    assert tuple(tensors["candidate_selector.hidden_projection.weight"].shape) == (RANK, h)
    assert tuple(tensors["candidate_selector.predecessor_codebook"].shape) == (v, RANK)   # no ".weight"
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors

    # the export loads back as the checkpoint's drafter: the same logits and the same selector walk
    served = load_export(out)
    assert isinstance(served, DFlash2Drafter)
    mine = ckpt.load_drafter(run_dir)
    torch.manual_seed(0)
    feats = torch.randn(10, 2 * h)
    pos = torch.arange(10)
    a, _ = mine.draft_block(feats, pos, 5, 10, None)
    b, _ = served.draft_block(feats, pos, 5, 10, None)
    assert torch.equal(a, b)
    p1 = mine.propose_block(feats, pos, 5, 10, None, block_size=4)[0]
    p2 = served.propose_block(feats, pos, 5, 10, None, block_size=4)[0]
    assert torch.equal(torch.as_tensor(p1), torch.as_tensor(p2))

    for temperature in ("0", "1"):
        report = tmp_path / f"eval_T{temperature}.json"
        assert eval_main(["--drafter", str(run_dir), "--data", str(dataset), "--num-prompts", "2", "--prompt-len",
                          "32", "--max-new-tokens", "8", "--baselines", "prompt-lookup", "--temperature", temperature,
                          "--output-json", str(report)]) == 0, capsys.readouterr().err[-3000:]
        rep = json.loads(report.read_text())
        assert rep["drafter_kind"] == "dflash2"
        rows = {r["drafter"].split()[0]: r for r in rep["rows"]}
        assert {"dflash2", "prompt-lookup"} <= set(rows), list(rows)
        assert rows["dflash2"]["tau_mean"] >= 1.0 and rows["dflash2"]["num_prompts"] == 2
        if temperature == "0":
            assert rows["dflash2"]["lossless_mismatches"] == 0


def test_the_embedded_default_trains_a_dflash2_drafter(tmp_path):
    """`launch.py train --drafter dflash2` on the embedded default (fixture target, demo corpus, CPU topology),
    a few steps: the run ends done, its checkpoint is a DFlash2 one."""
    run_dir = tmp_path / "run"
    code, log = run_launcher(["--drafter", "dflash2", "--max-steps", "4", "--checkpoint-every", "4",
                              "--eval-prompts", "0", "--run-dir", str(run_dir)], tmp_path / "train.log", 280)
    assert code == 0, log[-3000:]
    s = summary(run_dir)
    assert s["exit_reason"] == "done" and s["trained_batches"] == 4, s
    assert ckpt.drafter_kind(run_dir) == "dflash2"
    assert "run done: 4/4 batches trained" in log

"""Resume onto changed data (issue 14 item 5), with the real launcher, real `prepare` and real files.

Train on D, stop after a checkpoint, rewrite D with `launch.py prepare <other input> --output D` (same
sample lengths, other tokens: what a lengths-only fingerprint cannot see), then `--resume`: refused with an
error naming the data, before anything starts or changes. With D restored (prepared again from the first
input) the resume is accepted, also for a longer or shorter run (--max-steps may change on resume: the
record is compared on the batches both lengths plan); a changed plan-shaping setting is refused naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specring.cli.prepare import main as prepare_main
from specring.cli.train import train_main
from tests.support import REPO
from tests.system.launcher_util import interrupt_after_checkpoint, small_flags, summary

pytestmark = pytest.mark.timeout(300)


def write_tokens(path: Path, lengths: list[int], seed: int) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"input_ids": rng.integers(4, 8000, n).tolist()}) + "\n" for n in lengths))
    return path


def prepare(src: Path, out: Path) -> None:
    assert prepare_main([str(src), "--output", str(out), "--workers", "1", "--no-progress"]) == 0


def test_resume_onto_rewritten_data_is_refused_and_onto_the_same_data_accepted(tmp_path, capsys):
    lengths = np.random.default_rng(0).integers(48, 128, 40).tolist()
    a = write_tokens(tmp_path / "a.jsonl", lengths, seed=1)
    b = write_tokens(tmp_path / "b.jsonl", lengths, seed=2)
    data, run_dir = tmp_path / "D.arrow", tmp_path / "run"
    prepare(a, data)
    code, log = interrupt_after_checkpoint(small_flags(data, run_dir, 40, checkpoint_every=2), run_dir,
                                           tmp_path / "first.log")
    assert code == 130, log[-3000:]
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}

    prepare(b, data)                                   # D rewritten: same lengths, other tokens
    out = subprocess.run([sys.executable, "launch.py", "train", "--run-dir", str(run_dir), "--resume"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"error: --resume: the data of {run_dir} changed since the run started: {data} now holds 40 " \
           f"samples" in out.stderr, out.stderr
    assert "Restore the data" in out.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before  # nothing touched
    assert summary(run_dir)["exit_reason"] == "interrupted"
    record = json.loads((run_dir / "data.json").read_text())
    assert record["num_samples"] == 40 and record["content_digest"].startswith("sha256:")

    prepare(a, data)                                   # the same content again (new file, new mtime): accepted
    capsys.readouterr()
    assert train_main(["--run-dir", str(run_dir), "--resume", "--plan"]) == 0, capsys.readouterr().err
    for steps in ("60", "30"):                           # a longer and a shorter run of the same plan
        assert train_main(["--run-dir", str(run_dir), "--resume", "--plan", "--max-steps", steps]) == 0, \
            capsys.readouterr().err
        assert f"changed: --max-steps 40 -> {steps}" in capsys.readouterr().err
    assert train_main(["--run-dir", str(run_dir), "--resume", "--plan", "--max-tokens", "256"]) == 2
    assert "--resume: --max-tokens cannot change when resuming (the run trained with 512)" in capsys.readouterr().err

    saved = json.loads((run_dir / "config.json").read_text())   # a plan-shaping setting edited by hand
    saved["data"]["seed"] = 7
    (run_dir / "config.json").write_text(json.dumps(saved))
    assert train_main(["--run-dir", str(run_dir), "--resume", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "--resume: the batch plan of" in err and "data.seed 0 -> 7" in err, err

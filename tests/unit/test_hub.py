"""Targets by hub id (shared/models/hub.py): resolved from a prepared local Hugging Face cache, a clear error
otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specring.shared.errors import ConfigError
from specring.shared.models.hub import resolve_model_dir

FIXTURE = Path(__file__).resolve().parents[2] / "assets" / "tiny-code-lm"


def fill_cache(cache: Path, repo: str) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/files}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in FIXTURE.iterdir():
        if f.is_file():
            shutil.copy(f, snap / f.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snap


def test_a_hub_id_resolves_from_the_local_cache_with_the_network_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = fill_cache(tmp_path / "hub", "specring-test/tiny-code-lm")
    got = resolve_model_dir("specring-test/tiny-code-lm")
    assert got == snap and (got / "config.json").is_file()
    from specring.shared.models.target import check_checkpoint
    assert check_checkpoint(got).num_hidden_layers == 8     # a real checkpoint directory


def test_missing_ids_and_bad_specs_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"--target: Qwen/Qwen3-8B is not in the local Hugging Face cache .*"
                                          r"huggingface-cli download Qwen/Qwen3-8B"):
        resolve_model_dir("Qwen/Qwen3-8B")
    with pytest.raises(ConfigError, match="--tokenizer: 'no/such/dir' is neither a directory nor"):
        resolve_model_dir("no/such/dir", flag="--tokenizer")
    assert resolve_model_dir(FIXTURE) == FIXTURE


def test_train_plan_takes_a_hub_id_and_records_its_directory(tmp_path):
    """``launch.py train --target ORG/NAME --plan`` in a real process, the network off: the id resolves from the
    cache the environment names, and the plan (what the children and config.json get) names the directory."""
    import os
    import subprocess
    import sys

    from tests.support import REPO, make_dataset

    snap = fill_cache(tmp_path / "hub", "specring-test/tiny-code-lm")
    data = make_dataset(tmp_path / "d.arrow")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    flags = ["--data", str(data), "--producers", "cpu,cpu", "--consumers", "cpu", "--run-dir", str(tmp_path / "run"),
             "--plan"]
    out = subprocess.run([sys.executable, "launch.py", "train", "--target", "specring-test/tiny-code-lm", *flags],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"target: {snap}  (8 layers, hidden 256)" in out.stdout
    out = subprocess.run([sys.executable, "launch.py", "train", "--target", "specring-test/not-cached", *flags],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "error: --target: specring-test/not-cached is not in the local Hugging Face cache" in out.stderr


def test_resume_accepts_the_hub_id_of_the_directory_the_run_recorded(tmp_path, monkeypatch):
    import json

    from specring.cli.flags import build_parser, config_from_args
    from specring.shared.config.run_config import RunConfig

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = fill_cache(tmp_path / "hub", "specring-test/tiny-code-lm")
    fill_cache(tmp_path / "hub", "specring-test/other")
    run = tmp_path / "run"
    run.mkdir()
    saved = RunConfig(run_dir=str(run))
    saved.producer.target = str(snap)
    (run / "config.json").write_text(json.dumps(saved.to_dict()))
    resume = ["--run-dir", str(run), "--resume", "--target"]
    cfg = config_from_args(build_parser().parse_args(resume + ["specring-test/tiny-code-lm"]))
    assert cfg.producer.target == str(snap) and not cfg.resume_changes
    with pytest.raises(ConfigError, match="--target cannot change when resuming"):
        config_from_args(build_parser().parse_args(resume + ["specring-test/other"]))

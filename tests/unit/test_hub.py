"""Targets by hub id (shared/hub.py): resolved from a prepared local Hugging Face cache, a clear error otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specring.shared.errors import ConfigError
from specring.shared.hub import resolve_model_dir

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

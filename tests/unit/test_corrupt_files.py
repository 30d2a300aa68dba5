"""Corrupt and odd files are named, never a traceback (issue 27, kind 5).

A truncated, empty or garbage safetensors file in an export or a checkpoint (``eval``, ``export``, ``train
--resume``: named, and the resume says which older checkpoint reads and how to continue from it), a trainer
state that is not a ``torch.save`` archive, a ``--config`` that is not UTF-8, a ``prepare`` input named
``.parquet`` that is not Parquet, an EAGLE-3 run whose draft vocabulary is not its checkpoint's (refused in the
plan, before any process starts), and an offline hub id whose revision is not cached (named, with the cached
ones).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specring.cli.eval import main as eval_main
from specring.cli.export import main as export_main
from specring.cli.flags import build_parser, config_from_args
from specring.cli.prepare import main as prepare_main
from specring.cli.train import train_main
from specring.shared.drafters import checkpoint as ckpt
from specring.shared.drafters.dflash_export import export_drafter
from specring.shared.errors import ConfigError, CorruptFile
from specring.shared.models.dflash import DFlashConfig, build_drafter
from tests.support import TARGET, make_dataset

CORRUPTIONS = {
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 3),
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(os.urandom(4096)),
}


@pytest.fixture(scope="module")
def drafter_run(tmp_path_factory):
    """A run directory with two DFlash checkpoints (steps 5 and 10) of a one-layer drafter, its config.json (as
    ``train`` saves it) and an export of it."""
    root = tmp_path_factory.mktemp("corrupt")
    data = make_dataset(root / "d.arrow", num_samples=16)
    run = root / "run"
    cfg = config_from_args(build_parser().parse_args(["--run-dir", str(run), "--target", str(TARGET),
                                                      "--data", str(data), "--num-draft-layers", "1"]))
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    dcfg = DFlashConfig.from_target(TARGET, cfg.producer.target_layer_ids or [1, 3, 5], block_size=4,
                                    mask_token_id=3, num_draft_layers=1)
    model = build_drafter(dcfg, TARGET)
    tensors = {**model.trainable_state_dict(), **model.frozen_state_dict()}
    for step in (5, 10):
        ckpt.save_checkpoint(run / "checkpoints", step, tensors,
                             {"step": step, "trained_batch_ids": list(range(step))}, dcfg.to_dict())
    export_drafter(run, root / "export", TARGET, dtype="float32")
    return root


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_eval_and_export_name_a_corrupt_weights_file(drafter_run, tmp_path, capsys, how):
    export = _copy(drafter_run / "export", tmp_path / "export")
    CORRUPTIONS[how](export / "model.safetensors")
    assert eval_main(["--drafter", str(export), "--num-prompts", "1", "--max-new-tokens", "2",
                      "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert f"error: {export / 'model.safetensors'} is not a readable safetensors file" in err, err
    assert "Traceback" not in err

    run = _copy(drafter_run / "run", tmp_path / "run")
    weights = run / "checkpoints" / "step-000010" / "drafter.safetensors"
    CORRUPTIONS[how](weights)
    assert export_main(["--drafter", str(run), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"error: {weights} is not a readable safetensors file" in err, err
    with pytest.raises(CorruptFile, match="drafter.safetensors is not a readable safetensors file"):
        ckpt.load_checkpoint(run)


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("which", ["drafter.safetensors", "trainer_state.pt", "dflash_config.json"])
def test_resume_names_the_unreadable_file_and_the_checkpoint_to_continue_from(drafter_run, tmp_path, capsys,
                                                                            how, which):
    run = _copy(drafter_run / "run", tmp_path / "run")
    bad = run / "checkpoints" / "step-000010" / which
    CORRUPTIONS[how](bad)
    assert train_main(["--run-dir", str(run), "--resume", "--plan"]) == 2
    err = capsys.readouterr().err
    assert f"error: --resume: the latest checkpoint step-000010 cannot be read: {bad}" in err, err
    assert f"`echo step-000005 > {run / 'checkpoints' / 'latest'}`" in err, err
    (run / "checkpoints" / "latest").write_text("step-000005\n")   # as the message says: the plan goes on
    assert train_main(["--run-dir", str(run), "--resume", "--plan"]) == 0, capsys.readouterr().err
    assert ckpt.last_good_checkpoint(run / "checkpoints")[0].name == "step-000005"


def test_resume_without_any_readable_checkpoint_says_how_to_start_over(drafter_run, tmp_path, capsys):
    run = _copy(drafter_run / "run", tmp_path / "run")
    for step in ("step-000005", "step-000010"):
        CORRUPTIONS["truncated"](run / "checkpoints" / step / "drafter.safetensors")
    assert train_main(["--run-dir", str(run), "--resume", "--plan"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of" in err and "move" in err and "from the beginning" in err, err


def test_a_config_file_that_is_not_utf8_is_named(tmp_path, capsys):
    bad = tmp_path / "recipe.toml"
    bad.write_bytes(b"[trainer]\nlr = 1e-3  # caf\xe9\n")
    assert train_main(["--config", str(bad), "--plan"]) == 2
    err = capsys.readouterr().err
    assert f"error: --config: {bad} is not UTF-8 text (byte 0xe9 at offset 26, line 2)" in err, err
    yml = tmp_path / "recipe.yaml"
    yml.write_bytes(b"\xff\xfet\x00r\x00")   # UTF-16, as some editors save
    assert train_main(["--config", str(yml), "--plan"]) == 2
    assert f"--config: {yml} is not UTF-8 text" in capsys.readouterr().err


def test_a_prepare_input_that_is_not_parquet_is_named_before_anything_is_written(tmp_path, capsys):
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"text": "def f(x):\n    return x + 1\n"}) + "\n")
    bad = tmp_path / "b.parquet"
    bad.write_text('{"text": "JSON lines, not Parquet"}\n')
    out = tmp_path / "o.arrow"
    assert prepare_main([str(good), str(bad), "--output", str(out), "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"prepare: error: input {str(bad)!r}: not a readable Parquet file" in err, err
    assert not out.exists() and not list(tmp_path.glob("o.*"))
    template = tmp_path / "t.jinja"
    template.write_bytes(b"{{ messages }}\xe9")
    assert prepare_main([str(good), "--output", str(out), "--chat-template", str(template), "--workers", "1",
                         "--no-progress"]) == 2
    assert f"--chat-template: {template} is not UTF-8 text" in capsys.readouterr().err


def test_a_swapped_eagle3_draft_vocabulary_is_refused_in_the_plan(tmp_path, capsys):
    from specring.shared.drafters.draft_vocab import DRAFT_VOCAB_FILE, write_draft_vocab
    from specring.shared.models.eagle3 import build_draft_vocab

    data = make_dataset(tmp_path / "d.arrow", num_samples=16)
    run = tmp_path / "run"
    cfg = config_from_args(build_parser().parse_args(["--run-dir", str(run), "--target", str(TARGET), "--data",
                                                      str(data), "--drafter", "eagle3", "--target-layers", "none",
                                                      "--draft-vocab", "64"]))
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    d2t, t2d = write_draft_vocab(run, str(data), 8192, 64)
    mine = ckpt.read_safetensors(run / DRAFT_VOCAB_FILE)
    ckpt.save_checkpoint(run / "checkpoints", 4, {"d2t": mine["d2t"], "t2d": mine["t2d"]},
                         {"step": 4, "trained_batch_ids": [0, 1]}, {}, drafter="eagle3")
    assert train_main(["--run-dir", str(run), "--resume", "--plan"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    other_d2t, other_t2d = build_draft_vocab(torch.arange(8192), 64)   # another run's: the 64 highest ids
    from specring.shared.drafters.checkpoint import save_tensors
    save_tensors({"d2t": other_d2t, "t2d": other_t2d}, run / DRAFT_VOCAB_FILE, metadata={"format": "pt"})
    assert train_main(["--run-dir", str(run), "--resume", "--plan"]) == 2
    err = capsys.readouterr().err
    assert f"error: --resume: {run / DRAFT_VOCAB_FILE} is not the draft vocabulary the checkpoint step-000004 " \
           f"was trained with (d2t and t2d differ" in err, err


def test_an_offline_hub_id_at_an_uncached_revision_names_the_revision(tmp_path, monkeypatch):
    from specring.shared.models.hub import resolve_model_dir
    from tests.unit.test_hub import fill_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = fill_cache(tmp_path / "hub", "specring-test/tiny")
    assert resolve_model_dir("specring-test/tiny@main") == snap
    with pytest.raises(ConfigError) as e:
        resolve_model_dir("specring-test/tiny@v2.0")
    msg = str(e.value)
    assert "specring-test/tiny at revision 'v2.0' is not in the local Hugging Face cache" in msg, msg
    assert "the cache holds specring-test/tiny only at main (commit 0123456789ab)" in msg, msg
    assert "huggingface-cli download specring-test/tiny --revision v2.0" in msg, msg

"""EAGLE-3 run configuration (issue 16): the flags, their validation errors naming the flag, the resolved run
(three default target layers, the default top-K, --plan), what --resume may not change, and the run's draft
vocabulary file (built once, read back, refused when missing or not the run's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specring.cli.train import build_parser, config_from_args, train_main
from specring.shared.config.run_config import DEFAULT_EAGLE3_TOPK
from specring.shared.data.dataset import TokenDataset
from specring.shared.drafters.checkpoint import WEIGHTS_FILE
from specring.shared.drafters.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab, write_draft_vocab
from specring.shared.errors import ConfigError
from specring.shared.models.eagle3 import build_draft_vocab, draft_to_target
from specring.shared.models.layer_ids import default_eagle3_layer_ids
from specring.shared.run.run_dir import RunDir
from specring.supervisor.resume import prepare_draft_vocab
from specring.supervisor.runplan import resolve_run
from tests.support import TARGET, make_dataset

CPU = ("--producers", "cpu", "--consumers", "cpu")


def parse(*argv):
    return config_from_args(build_parser().parse_args([*CPU, *argv]))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("d") / "d.arrow", num_samples=8)


def test_drafter_flags_and_their_defaults():
    cfg = parse("--drafter", "eagle3")
    assert cfg.trainer.drafter == "eagle3" and cfg.trainer.draft_vocab == 32000 and cfg.trainer.ttt_steps == 7
    assert cfg.trainer.distill_topk is None and cfg.trainer.resolved_distill_topk() == DEFAULT_EAGLE3_TOPK
    assert parse("--drafter", "eagle3", "--distill-topk", "0").trainer.resolved_distill_topk() == 0
    dflash = parse()
    assert dflash.trainer.drafter == "dflash" and dflash.trainer.resolved_distill_topk() == 0
    cfg = parse("--trainer.drafter", "eagle3", "--draft-vocab", "4096", "--ttt-steps", "3")
    assert (cfg.trainer.draft_vocab, cfg.trainer.ttt_steps) == (4096, 3)


@pytest.mark.parametrize("argv, needle", [
    (["--drafter", "medusa"], "argument --drafter: expected one of dflash, dflash2, eagle3"),
    (["--draft-vocab", "none"], "argument --draft-vocab: expected an integer"),
])
def test_bad_drafter_flag_values_are_named(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--drafter", "eagle3", "--label-source", "data"], r"^--label-source: drafter eagle3 learns the target's"),
    (["--draft-vocab", "0"], r"^--draft-vocab: must be >= 1, got 0"),
    (["--ttt-steps", "0"], r"^--ttt-steps: must be >= 1, got 0"),
    (["--ttt-steps", "65"], r"^--ttt-steps: must be <= 64, got 65"),
])
def test_config_errors_name_the_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(*argv)


@pytest.mark.parametrize("argv, match", [
    (["--target-layers", "1,5"], r"^--target-layers: EAGLE-3 needs three distinct target layer ids .* in 0\.\.7 "
                                 r"\(the target has 8 layers\), got \[1, 5\]"),
    (["--target-layers", "1,5,8"], r"^--target-layers: EAGLE-3 needs three distinct .* got \[1, 5, 8\]"),
    (["--target-layers", "2,2,5"], r"^--target-layers: duplicate layer ids \[2\]"),
    (["--num-target-layers", "5"], r"^--num-target-layers: EAGLE-3 fuses exactly three target layers .* got 5"),
])
def test_eagle3_target_layers_are_checked_against_the_target(argv, match, data, tmp_path):
    cfg = parse("--drafter", "eagle3", "--data", str(data), "--run-dir", str(tmp_path / "r"), "--eval-prompts", "0",
                *argv) if "2,2,5" not in argv else None
    if cfg is None:  # duplicates are refused by the configuration itself
        with pytest.raises(ConfigError, match=match):
            parse("--drafter", "eagle3", *argv)
        return
    with pytest.raises(ConfigError, match=match):
        resolve_run(cfg)


@pytest.mark.parametrize("argv, match", [
    (["--trainer.loss", "dpace"], r"^--trainer.loss: applies to the DFlash families"),
    (["--trainer.sliding-window", "64"], r"^--trainer.sliding-window: applies to the DFlash families"),
])
def test_block_drafter_options_are_refused_for_eagle3(argv, match, data, tmp_path):
    cfg = parse("--drafter", "eagle3", "--data", str(data), "--run-dir", str(tmp_path / "r"), "--eval-prompts", "0",
                *argv)
    with pytest.raises(ConfigError, match=match):
        resolve_run(cfg)


def test_resolved_eagle3_run_and_plan(data, tmp_path, capsys):
    cfg = parse("--drafter", "eagle3", "--data", str(data), "--run-dir", str(tmp_path / "r"), "--eval-prompts", "0")
    plan = resolve_run(cfg)
    layers = json.loads((TARGET / "config.json").read_text())["num_hidden_layers"]
    vocab = json.loads((TARGET / "config.json").read_text())["vocab_size"]
    assert cfg.producer.target_layer_ids == default_eagle3_layer_ids(layers) == plan.target_layer_ids
    assert len(set(plan.target_layer_ids)) == 3
    assert cfg.trainer.distill_topk == DEFAULT_EAGLE3_TOPK                # filled: the saved config holds it
    assert plan.vocab_size == vocab and plan.draft_vocab_size == min(32000, vocab)
    assert any("exceeds the target's vocabulary" in n for n in plan.notes) == (32000 > vocab)
    custom = parse("--drafter", "eagle3", "--data", str(data), "--run-dir", str(tmp_path / "r"), "--eval-prompts",
                   "0", "--target-layers", "0,2,6")
    assert resolve_run(custom).target_layer_ids == [0, 2, 6]
    assert train_main(["--plan", *CPU, "--drafter", "eagle3", "--draft-vocab", "2048", "--ttt-steps", "5", "--data",
                       str(data), "--run-dir", str(tmp_path / "p"), "--eval-prompts", "0"]) == 0
    out = capsys.readouterr().out
    assert "drafter eagle3, draft vocab 2048, TTT steps 5, label source target, " \
           f"top-K {DEFAULT_EAGLE3_TOPK}" in out, out
    assert f"target layers captured: {default_eagle3_layer_ids(layers)}" in out
    assert not (tmp_path / "p").exists()                                  # --plan writes nothing
    assert train_main(["--plan", *CPU, "--data", str(data), "--run-dir", str(tmp_path / "p"),
                       "--eval-prompts", "0"]) == 0
    assert "(drafter dflash, block size 16" in capsys.readouterr().out


def test_drafter_vocab_and_ttt_steps_cannot_change_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = parse("--run-dir", str(run_dir), "--drafter", "eagle3", "--draft-vocab", "2048")
    cfg.producer.target_layer_ids, cfg.trainer.distill_topk = [1, 3, 4], DEFAULT_EAGLE3_TOPK
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    resumed = config_from_args(build_parser().parse_args(["--run-dir", str(run_dir), "--resume"]))
    assert resumed.trainer.drafter == "eagle3" and resumed.trainer.draft_vocab == 2048
    assert resumed.trainer.distill_topk == DEFAULT_EAGLE3_TOPK
    # the default of a field filled at start stands for the saved value
    config_from_args(build_parser().parse_args(["--run-dir", str(run_dir), "--resume", "--distill-topk", "none"]))
    for flag, value, was in (("--drafter", "dflash", "eagle3"), ("--draft-vocab", "4096", "2048"),
                             ("--ttt-steps", "3", "7"), ("--distill-topk", "8", str(DEFAULT_EAGLE3_TOPK))):
        with pytest.raises(ConfigError, match=rf"{flag} cannot change when resuming \(the run trained with {was}\)"):
            config_from_args(build_parser().parse_args(["--run-dir", str(run_dir), "--resume", flag, value]))


def test_draft_vocab_file_is_the_most_frequent_loss_tokens_and_is_checked_when_read(data, tmp_path):
    vocab = json.loads((TARGET / "config.json").read_text())["vocab_size"]
    d2t, t2d = write_draft_vocab(tmp_path, data, vocab, 300)
    ds = TokenDataset(data)
    counts = np.zeros(vocab, dtype=np.int64)
    for i in range(len(ds)):
        ids, lm = ds[i]
        np.add.at(counts, ids[lm != 0].astype(np.int64), 1)
    assert torch.equal(torch.from_numpy(counts), torch.from_numpy(ds.loss_token_counts(vocab)))
    top = sorted(range(vocab), key=lambda j: (-counts[j], j))[:300]
    assert draft_to_target(d2t).tolist() == sorted(top) and int(t2d.sum()) == 300
    back = read_draft_vocab(tmp_path, 300, vocab)
    assert torch.equal(back[0], d2t) and torch.equal(back[1], t2d)

    with pytest.raises(ConfigError, match=r"d2t \(300,\) / t2d \(8192,\), the run's drafter needs \(512,\)"):
        read_draft_vocab(tmp_path, 512, vocab)
    path = tmp_path / DRAFT_VOCAB_FILE
    bad_t2d = t2d.clone()
    bad_t2d[int(torch.nonzero(~t2d)[0])] = True
    bad_t2d[int(torch.nonzero(t2d)[0])] = False
    save_file({"d2t": d2t, "t2d": bad_t2d}, str(path))
    with pytest.raises(ConfigError, match="t2d does not mark exactly the target ids of d2t"):
        read_draft_vocab(tmp_path, 300, vocab)
    save_file({"d2t": d2t.int(), "t2d": t2d}, str(path))
    with pytest.raises(ConfigError, match="d2t torch.int32 / t2d torch.bool, expected int64 / bool"):
        read_draft_vocab(tmp_path, 300, vocab)
    path.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match=r"^--resume: .* cannot be read as a draft vocabulary"):
        read_draft_vocab(tmp_path, 300, vocab, prefix="--resume: ")
    path.unlink()
    with pytest.raises(ConfigError, match=r"is missing: it holds the draft vocabulary"):
        read_draft_vocab(tmp_path, 300, vocab)
    # a draft vocabulary as large as the vocabulary keeps every id
    d2t_all, t2d_all = build_draft_vocab(torch.from_numpy(counts), vocab + 5)
    assert bool(t2d_all.all()) and not d2t_all.any()


def test_the_supervisor_builds_the_vocabulary_once_and_reads_it_back_on_resume(data, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = parse("--drafter", "eagle3", "--draft-vocab", "256", "--data", str(data), "--run-dir", str(run_dir),
                "--eval-prompts", "0")
    plan = resolve_run(cfg)
    assert prepare_draft_vocab(cfg, plan) == "built"
    path = run_dir / DRAFT_VOCAB_FILE
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    cfg.resume = True
    assert prepare_draft_vocab(cfg, plan) == "read"
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before         # not rebuilt
    step = run_dir / "checkpoints" / "step-000002"          # a checkpoint on disk (its name and weights file)
    step.mkdir(parents=True)
    (step / WEIGHTS_FILE).write_bytes(b"")
    (run_dir / "checkpoints" / "latest").write_text("step-000002")
    assert RunDir(run_dir).latest_checkpoint_step() == 2
    path.unlink()
    with pytest.raises(ConfigError, match=rf"^--resume: {path} is missing"):  # never rebuilt once trained on
        prepare_draft_vocab(cfg, plan)
    assert not path.exists()
    dflash = parse("--data", str(data), "--run-dir", str(tmp_path / "d"), "--eval-prompts", "0")
    assert prepare_draft_vocab(dflash, resolve_run(dflash)) == ""
    assert not (tmp_path / "d" / DRAFT_VOCAB_FILE).exists()


def test_dflash2_options_are_refused_on_a_dflash_run(data, tmp_path):
    cfg = parse("--data", str(data), "--run-dir", str(tmp_path / "r"), "--eval-prompts", "0",
                "--trainer.selector-top-k", "8")
    with pytest.raises(ConfigError, match=r"^--trainer.selector-top-k: a DFlash2 option; this run trains drafter "
                                          r"dflash"):
        resolve_run(cfg)
    ok = parse("--drafter", "dflash2", "--data", str(data), "--run-dir", str(tmp_path / "r2"), "--eval-prompts", "0",
               "--trainer.selector-top-k", "8")
    assert resolve_run(ok).target_layer_ids


@pytest.mark.parametrize("argv, match", [
    (["--trainer.conv-group-size", "24"], r"^--trainer.conv-group-size: 24 does not divide hidden_size 256"),
    (["--trainer.sliding-window", "8"], r"^--trainer.sliding-window: 8 < block_size 16"),
])
def test_a_dflash2_config_the_drafter_refuses_is_refused_in_the_plan(argv, match, data, tmp_path):
    """Before any process starts: the consumer would die on it, and --resume could not change it."""
    cfg = parse("--drafter", "dflash2", "--data", str(data), "--run-dir", str(tmp_path / "r"), "--eval-prompts", "0",
                *argv)
    with pytest.raises(ConfigError, match=match):
        resolve_run(cfg)

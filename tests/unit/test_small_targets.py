"""Targets of every small depth (issue 14 item 9): random Qwen3 checkpoints of 1..12 decoder layers, each
written as a real checkpoint directory, must start with default settings (distinct valid capture layers,
fewer where the target is shallow), capture what the drafter is sized for, and name the flag or config key
of an explicit count that does not fit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from specring.cli.train import build_parser, config_from_args
from specring.shared.config.run_config import DEFAULT_TARGET
from specring.shared.errors import ConfigError
from specring.shared.models.dflash import DFlashConfig
from specring.shared.models.target import (
    LayerCapture,
    StopForward,
    base_model,
    load_target,
)
from specring.supervisor.runplan import resolve_run
from tests.support import make_dataset


def write_qwen3(path: Path, num_layers: int, seed: int = 0) -> Path:
    """A random Qwen3 checkpoint (hidden 32, 2 heads) with ``num_layers`` decoder layers and the fixture's
    tokenizer, saved the way Hugging Face saves one."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=3, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_TARGET / name, path / name)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "small.arrow", num_samples=16)


def parse(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("num_layers", range(1, 13))
def test_default_settings_start_on_a_target_of_any_depth(tmp_path, dataset, num_layers):
    target = write_qwen3(tmp_path / f"qwen3-{num_layers}", num_layers)
    cfg = parse("--target", str(target), "--data", str(dataset), "--run-dir", str(tmp_path / "run"),
                "--producers", "cpu", "--consumers", "cpu", "--max-steps", "2")
    plan = resolve_run(cfg)                                       # what `train --plan` and `train` run first
    ids = plan.target_layer_ids
    assert len(set(ids)) == len(ids) and all(0 <= i < num_layers for i in ids)
    assert len(ids) == (5 if num_layers >= 8 else max(1, num_layers - 3))
    assert (len(ids) < 5) == any("default capture layers" in n for n in plan.notes)
    dcfg = DFlashConfig.from_target(target, None, mask_token_id=3)  # the trainer's and eval's sizing
    assert dcfg.target_layer_ids == ids and dcfg.num_target_layers == len(ids)
    model, _ = load_target(target, "cpu")
    x = torch.randint(4, 8192, (1, 9))
    with torch.no_grad():
        with LayerCapture(model, ids, stop_after_last=True) as cap:
            try:
                base_model(model)(input_ids=x, use_cache=False)
            except StopForward:
                pass
            got = cap.outputs()
        ref = model(input_ids=x, output_hidden_states=True).hidden_states
    for i, h in zip(ids, got):
        torch.testing.assert_close(h, ref[i + 1])


def test_an_explicit_count_that_does_not_fit_names_its_flag_or_config_key(tmp_path, dataset):
    target = write_qwen3(tmp_path / "qwen3-6", 6)
    common = ["--target", str(target), "--data", str(dataset), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError) as e:
        resolve_run(parse(*common, "--num-target-layers", "5"))
    assert str(e.value).startswith("--num-target-layers: a target with 6 decoder layers gives at most 3")
    assert "--target-layers" not in str(e.value)
    toml = tmp_path / "run.toml"
    toml.write_text("[producer]\nnum_target_layers = 4\n")
    with pytest.raises(ConfigError) as e:
        resolve_run(parse(*common, "--config", str(toml)))
    assert str(e.value).startswith(f"--config {toml}: producer.num_target_layers: a target with 6")
    assert resolve_run(parse(*common, "--num-target-layers", "3")).target_layer_ids == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"^--target-layers: layer ids \[6\] are outside"):
        resolve_run(parse(*common, "--target-layers", "1,6"))

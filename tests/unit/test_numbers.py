"""Numbers that are not numbers (issue 14 item 8): NaN, infinities, negatives and absurd sizes in every
numeric flag of ``train``, ``prepare`` and ``restart`` and in every numeric ``--config`` value are refused
with an error that names the flag or the file and key; nothing crashes with a traceback.

The flags and fields are enumerated from the config declaration (``shared.config.run_config.field_specs``: every
field's ``--section.field`` flag and its aliases) and the config dataclasses, so a new numeric field or
alias is covered without touching this file.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import typing

import pytest

from specring.cli.prepare import build_parser as prepare_parser
from specring.cli.prepare import main as prepare_main
from specring.cli.train import build_parser, config_from_args
from specring.shared.commands.command_config import PrepareConfig
from specring.shared.config import run_config as C
from specring.shared.errors import ConfigError
from tests.support import REPO


def _numeric(spec) -> bool:
    base = spec.base_type
    return (typing.get_args(base)[0] if typing.get_origin(base) is list else base) in (int, float)


NUMERIC_FLAGS = sorted(flag for spec in C.field_specs().values() if _numeric(spec)
                       for flag in [spec.flag] + [a.flag for a in spec.aliases])
BAD = ["nan", "inf", "-inf", "-1", "1e300", str(10**30)]
SECTIONS = {"data": C.DataConfig, "ring": C.RingConfig, "producer": C.ProducerConfig,
            "trainer": C.TrainerConfig, "monitor": C.MonitorConfig}


def _numeric_fields():
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            text = str(hints[f.name])
            if "int" in text or "float" in text:
                yield section, f.name, "float" in text, "list" in text


def test_every_numeric_flag_is_covered():
    assert {"--slot-mb", "--lr", "--max-steps", "--hang-timeout-s", "--num-target-layers", "--seed",
            "--trainer.grad-clip", "--monitor.backoff-max-s", "--ring.slot-bytes", "--data.bucket-edges",
            "--data.seed"} <= set(NUMERIC_FLAGS)


@pytest.mark.parametrize("opt", NUMERIC_FLAGS)
@pytest.mark.parametrize("value", BAD)
def test_bad_train_flag_values_name_the_flag(opt, value, capsys):
    try:
        config_from_args(build_parser().parse_args([f"{opt}={value}"]))
    except SystemExit as e:             # argparse: not a finite number / too large
        assert e.code == 2
        assert f"argument {opt}:" in capsys.readouterr().err
    except ConfigError as e:            # the config field's range
        assert str(e).startswith(f"{opt}: "), str(e)
    else:
        pytest.fail(f"{opt}={value} was accepted")


@pytest.mark.parametrize("section, name, is_float, is_list", list(_numeric_fields()))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "1e300", str(10**30)])
def test_bad_config_file_values_name_the_file_and_key(tmp_path, section, name, is_float, is_list, value):
    """TOML's nan/inf floats, negatives and absurd sizes (in an int field a float is a type error)."""
    toml = tmp_path / "run.toml"
    toml.write_text(f"[{section}]\n{name} = {'[' + value + ']' if is_list else value}\n")
    with pytest.raises(ConfigError) as e:
        config_from_args(build_parser().parse_args(["--config", str(toml)]))
    assert str(e.value).startswith(f"--config {toml}: {section}.{name}: "), str(e.value)


def test_yaml_infinity_is_refused_with_its_key(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "run.yaml"
    f.write_text("monitor:\n  hang_timeout_s: .inf\n")
    with pytest.raises(ConfigError, match=r"monitor\.hang_timeout_s: must be a finite number, got inf"):
        config_from_args(build_parser().parse_args(["--config", str(f)]))


def test_dataclasses_refuse_nan_when_built_directly():
    with pytest.raises(ConfigError, match="lr: must be a finite number"):
        C.TrainerConfig(lr=math.nan)
    with pytest.raises(ConfigError, match="slot_bytes: must be <= "):
        C.RingConfig(slot_bytes=2**50)


def test_slot_mb_inf_is_an_error_not_a_traceback():
    """The reported input: ``train --slot-mb inf`` crashed with an OverflowError traceback."""
    out = subprocess.run([sys.executable, "launch.py", "train", "--plan", "--slot-mb", "inf"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --slot-mb: expected a finite number, got 'inf'" in out.stderr


def test_a_run_too_long_to_plan_names_max_steps(tmp_path):
    from specring.supervisor.runplan import resolve_run
    from tests.support import make_dataset

    data = make_dataset(tmp_path / "d.arrow", num_samples=8)
    cfg = config_from_args(build_parser().parse_args(["--data", str(data), "--max-steps", "1000000000",
                                                      "--run-dir", str(tmp_path / "r")]))
    with pytest.raises(ConfigError, match=r"^--max-steps: the run would plan 1,000,000,000 batches"):
        resolve_run(cfg)


PREPARE_NUMERIC_FLAGS = [spec.flag for spec in C.option_specs(PrepareConfig).values() if _numeric(spec)]


def test_every_numeric_prepare_flag_is_covered():
    assert {"--max-length", "--workers"} <= set(PREPARE_NUMERIC_FLAGS)
    assert set(PREPARE_NUMERIC_FLAGS) <= {s for a in prepare_parser()._actions for s in a.option_strings}


@pytest.mark.parametrize("flag", PREPARE_NUMERIC_FLAGS)
@pytest.mark.parametrize("value", BAD + ["0"])
def test_bad_prepare_flag_values_name_the_flag(tmp_path, flag, value, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "x = 1"}\n')
    try:
        code = prepare_main([str(src), "--output", str(tmp_path / "o.arrow"), f"{flag}={value}", "--no-progress"])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "o.arrow").exists()

"""Output names that collide with what a command reads, or with each other, are refused before anything is
written (issue 27, kind 3; ``shared/config/outputs.py``): ``prepare`` (its sidecar is ``NAME.json``), ``regenerate``,
``export`` (whose ``--overwrite`` would remove a run directory named as ``--output``), ``eval --output-json`` and
``train --run-dir``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specring.cli.eval import main as eval_main
from specring.cli.export import main as export_main
from specring.cli.prepare import main as prepare_main
from specring.cli.regenerate import main as regenerate_main
from specring.cli.train import train_main
from specring.shared.config.outputs import check_outputs
from specring.shared.errors import ConfigError
from tests.support import TARGET, make_dataset
from tests.unit.test_corrupt_files import drafter_run  # noqa: F401 - the fixture: a run with two checkpoints


def _snapshot(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _jsonl(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(n)))
    return path


def test_prepare_refuses_an_output_that_is_its_own_sidecar_or_an_inputs(tmp_path, capsys):
    src = _jsonl(tmp_path / "rows.jsonl")
    before = _snapshot(tmp_path)
    assert prepare_main([str(src), "--output", str(tmp_path / "p.json"), "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"prepare: error: --output: the data file and the sidecar would both be written to {tmp_path / 'p.json'}" \
           in err, err
    assert _snapshot(tmp_path) == before                        # nothing written, no temporary left
    side_input = _jsonl(tmp_path / "x.json")                    # a .json input is the sidecar of x.arrow
    assert prepare_main([str(side_input), "--output", str(tmp_path / "x.arrow"), "--workers", "1",
                         "--no-progress"]) == 2
    assert f"--output: {side_input} is the input {side_input}: writing the sidecar there" in capsys.readouterr().err
    assert prepare_main([str(src), "--output", str(src), "--workers", "1", "--no-progress"]) == 2
    assert "writing the data file there would destroy what is read" in capsys.readouterr().err
    assert prepare_main([str(src), "--output", str(tmp_path / "ok.arrow"), "--workers", "1", "--no-progress"]) == 0


def test_regenerate_refuses_an_output_on_its_input_or_the_inputs_sidecar(tmp_path, capsys):
    data = make_dataset(tmp_path / "train.arrow", num_samples=4)
    (tmp_path / "train.json").write_text("{}\n")                # the input's sidecar
    before = _snapshot(tmp_path)
    cases = {tmp_path / "train.json": "the data file and the sidecar would both be written to",
             tmp_path / "train.regen": f"{tmp_path / 'train.json'} is the sidecar of --input: writing the sidecar",
             data: f"{data} is the --input: writing the data file there"}
    for out, needle in cases.items():
        code = regenerate_main(["--target", str(TARGET), "--input", str(data), "--output", str(out),
                                "--devices", "cpu", "--no-progress"])
        assert code == 2
        err = capsys.readouterr().err
        assert "regenerate: error: --output: " in err and needle in err, err
    assert _snapshot(tmp_path) == before and not list(tmp_path.glob("*.parts"))


def test_export_refuses_to_write_over_the_run_it_exports(drafter_run, tmp_path, capsys):  # noqa: F811
    run = Path(shutil.copytree(drafter_run / "run", tmp_path / "run"))
    before = _snapshot(run)
    for out in (run, run / "checkpoints", tmp_path):
        assert export_main(["--drafter", str(run), "--output", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "error: --output: " in err and ("is the run directory" in err or "is the checkpoints directory" in err
                                                or "holds the checkpoint" in err), err
    assert _snapshot(run) == before                             # --overwrite removed nothing
    assert export_main(["--drafter", str(run), "--output", str(run / "export")]) == 0  # beside it: fine


def test_eval_refuses_an_output_json_that_names_a_file_it_reads(drafter_run, tmp_path, capsys):  # noqa: F811
    run = Path(shutil.copytree(drafter_run / "run", tmp_path / "run"))
    before = _snapshot(run)
    step = run / "checkpoints" / "step-000010"
    for out in (run / "config.json", step / "dflash_config.json", TARGET / "config.json"):
        assert eval_main(["--drafter", str(run), "--num-prompts", "1", "--max-new-tokens", "2", "--no-baselines",
                          "--output-json", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"error: --output-json: {out.resolve()} is" in err, err
    assert _snapshot(run) == before


def test_train_refuses_a_run_dir_whose_records_would_replace_its_inputs(tmp_path, capsys):
    target = Path(shutil.copytree(TARGET, tmp_path / "target"))
    data = make_dataset(tmp_path / "d" / "data.arrow", num_samples=8)
    (tmp_path / "d" / "data.json").write_text("{}\n")          # data.arrow's sidecar: the name of a run record
    flags = ["--target", str(target), "--data", str(data), "--producers", "cpu", "--consumers", "cpu", "--plan"]
    assert train_main([*flags, "--run-dir", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"error: --run-dir: {target / 'config.json'} is a file of the target directory" in err, err
    assert train_main([*flags, "--run-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert f"error: --run-dir: {tmp_path / 'd' / 'data.json'} is the sidecar of --data" in err, err
    assert train_main([*flags, "--run-dir", str(tmp_path / "run")]) == 0, capsys.readouterr().err


def test_check_outputs_compares_resolved_paths_and_hard_links(tmp_path):
    a = tmp_path / "a.arrow"
    a.write_text("x")
    (tmp_path / "link.arrow").symlink_to(a)
    (tmp_path / "hard.arrow").hardlink_to(a)
    for name in ("link.arrow", "hard.arrow", "./a.arrow"):
        with pytest.raises(ConfigError, match="is the input"):
            check_outputs("--output", {"data file": tmp_path / name}, {"input": a})
    with pytest.raises(ConfigError, match="is a directory"):
        check_outputs("--output", {"data file": tmp_path}, {})
    check_outputs("--output", {"data file": tmp_path / "b.arrow", "sidecar": tmp_path / "b.json"}, {"input": a})

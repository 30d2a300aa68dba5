"""launch.py train flags and --config files map onto RunConfig; errors name the flag or key."""

from pathlib import Path

import pytest

from specring.cli.train import build_parser, config_from_args
from specring.shared.errors import ConfigError


def parse(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_toml_then_flags_override(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[trainer]\nblock_size = 8\nnum_anchors = 128\n[producer]\ndevices = ["cpu"]\n[ring]\nnum_slots = 6\n')
    cfg = parse("--config", str(f), "--num-anchors", "64", "--consumers", "cpu,cpu")
    assert cfg.trainer.block_size == 8 and cfg.trainer.num_anchors == 64
    assert cfg.producer.devices == ["cpu"] and cfg.trainer.devices == ["cpu", "cpu"] and cfg.ring.num_slots == 6


def test_yaml_config(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  block_size: 10\n")
    cfg = parse("--config", str(f))
    assert cfg.trainer.block_size == 10 and cfg.trainer.resolved_gamma() == 5.0


def test_cpu_defaults_apply_only_where_not_set(tmp_path):
    cfg = parse("--producers", "cpu", "--consumers", "cpu", "--num-anchors", "512")
    assert cfg.trainer.num_anchors == 512 and cfg.data.max_tokens == 2048 and cfg.trainer.max_steps == 200


def test_config_file_must_exist_and_parse(tmp_path):
    with pytest.raises(ConfigError, match="--config"):
        parse("--config", str(tmp_path / "missing.toml"))
    bad = tmp_path / "broken.toml"
    bad.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse("--config", str(bad))


@pytest.mark.parametrize("text, needle", [
    ("[trainer]\nblock_sise = 8\n", "block_sise"),
    ("[nonsense]\nx = 1\n", "nonsense"),
    ("[trainer]\nblock_size = 1\n", "block_size"),
    ("[ring]\nnum_slots = 1\n", "num_slots"),
    ('[producer]\ndevices = "cpu"\n', "devices"),
    ("data = 5\n", "data"),
    ('[data]\nmax_tokens = "abc"\n', "data.max_tokens"),
    ("[ring]\nnum_slots = 3.5\n", "ring.num_slots"),
    ('run_id = "../../etc"\n', "run_id"),
    ("[monitor]\nbackoff_base_s = -1\n", "backoff_base_s"),
    ("[trainer]\nnum_draft_layers = 0\n", "num_draft_layers"),
])
def test_bad_config_files_name_the_key_or_field(tmp_path, text, needle):
    """Unknown keys and sections, values of the wrong type or out of range: the error names them."""
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse("--config", str(f))


def test_run_dir_default_is_a_new_stamped_dir_and_resume_defaults_to_latest(tmp_path, monkeypatch):
    """No --run-dir: a fresh run gets runs/<UTC time>; runs/latest moves only when point_latest is called
    (after the start-up checks); --resume without --run-dir resolves to what runs/latest points at."""
    from specring.shared.config import RunConfig
    from specring.supervisor import resume

    monkeypatch.chdir(tmp_path)  # runs go under the current directory
    cfg = RunConfig()
    cfg.run_dir = "runs/default"
    assert resume.prepare_run_dir(cfg) is True
    stamped = Path(cfg.run_dir)
    assert stamped.parent == tmp_path / "runs" and stamped.name != "latest"
    assert not (tmp_path / "runs" / "latest").is_symlink()  # not before the run passed its checks
    resume.point_latest(cfg.run_dir)
    assert (tmp_path / "runs" / "latest").resolve() == stamped.resolve()
    again = RunConfig()
    again.run_dir, again.resume = "runs/default", True
    assert resume.prepare_run_dir(again) is False
    assert again.run_dir == str(stamped.resolve())


def test_fresh_start_or_resume_without_checkpoint_clears_the_earlier_records(tmp_path):
    """A run directory whose earlier start saved no checkpoint (only a half-written one): checking it
    changes nothing; claiming it (after every start-up check passed) removes its void records and the
    half-written checkpoint."""
    from specring.shared.config import RunConfig
    from specring.supervisor import resume

    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / ".step-000010.tmp-123").mkdir(parents=True)
    records = ("metrics.jsonl", "eval.jsonl", "summary.json", "data.json")
    for resume_it in (False, True):
        for name in records:
            (run_dir / name).write_text("{}\n")
        cfg = RunConfig()
        cfg.run_dir, cfg.resume = str(run_dir), resume_it
        assert resume.prepare_run_dir(cfg) is False
        assert all((run_dir / n).exists() for n in records)  # a start refused later must lose nothing
        lock = resume.claim_run_dir(cfg, False)
        lock.close()
        assert not any((run_dir / n).exists() for n in records)
        assert not list((run_dir / "checkpoints").glob(".step-*"))


def test_run_dir_is_held_by_one_launcher_and_a_broken_latest_pointer_is_named(tmp_path):
    from specring.shared.checkpoint import WEIGHTS_FILE
    from specring.shared.config import RunConfig
    from specring.supervisor import resume

    cfg = RunConfig()
    cfg.run_dir = str(tmp_path / "r")
    lock = resume.claim_run_dir(cfg, False)
    with pytest.raises(ConfigError, match="another launcher"):
        resume.claim_run_dir(cfg, False)
    lock.close()
    resume.claim_run_dir(cfg, False).close()  # free again once the holder let go (or died)
    ckpts = tmp_path / "r" / "checkpoints"
    (ckpts / "step-000010").mkdir(parents=True)
    (ckpts / "step-000010" / WEIGHTS_FILE).write_bytes(b"")
    (ckpts / "latest").write_text("step-000012\n")
    (tmp_path / "r" / "metrics.jsonl").write_text("{}\n")
    cfg.resume = True
    with pytest.raises(ConfigError, match="step-000012.*complete ones: step-000010"):
        resume.prepare_run_dir(cfg)
    assert (tmp_path / "r" / "metrics.jsonl").exists()


def test_train_resume_without_run_dir_reads_the_run_latest_points_at(tmp_path, monkeypatch, capsys):
    from specring.cli.train import train_main

    monkeypatch.chdir(tmp_path)  # runs go under the current directory
    (tmp_path / "runs" / "20260101-000000").mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to("20260101-000000")
    assert train_main(["--resume"]) == 2
    err = capsys.readouterr().err
    assert "20260101-000000/config.json does not exist" in err and "runs/default" not in err

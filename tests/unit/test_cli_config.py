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
    from specring.shared.config.run_config import RunConfig
    from specring.shared.run.run_dir import RunDir
    from specring.supervisor import resume

    monkeypatch.chdir(tmp_path)  # runs go under the current directory
    cfg = RunConfig()
    cfg.run_dir = "runs/default"
    assert resume.prepare_run_dir(cfg) is True
    stamped = Path(cfg.run_dir)
    assert stamped.parent == tmp_path / "runs" and stamped.name != "latest"
    assert not (tmp_path / "runs" / "latest").is_symlink()  # not before the run passed its checks
    RunDir(cfg.run_dir).point_latest()
    assert (tmp_path / "runs" / "latest").resolve() == stamped.resolve()
    again = RunConfig()
    again.run_dir, again.resume = "runs/default", True
    assert resume.prepare_run_dir(again) is False
    assert again.run_dir == str(stamped.resolve())


def test_fresh_start_or_resume_without_checkpoint_clears_the_earlier_records(tmp_path):
    """A run directory whose earlier start saved no checkpoint (only a half-written one): checking it
    changes nothing; claiming it (after every start-up check passed) removes its void records and the
    half-written checkpoint."""
    from specring.shared.config.run_config import RunConfig
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
    from specring.shared.config.run_config import RunConfig
    from specring.shared.drafters.checkpoint import WEIGHTS_FILE
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


# ------------------------------------------------------------------ flags derived from the declaration

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

from specring.shared.config import run_config as C  # noqa: E402

# Every flag `launch.py train` had before the flags were derived from the declaration, with a value and the
# field it sets: they must keep working.
OLD_FLAGS = {
    "--target": ("assets/x", "producer.target", "assets/x"), "--producers": ("cpu", "producer.devices", ["cpu"]),
    "--dtype": ("float32", "producer.dtype", "float32"),
    "--target-layers": ("1,3", "producer.target_layer_ids", [1, 3]),
    "--num-target-layers": ("3", "producer.num_target_layers", 3),
    "--consumers": ("cpu,cpu", "trainer.devices", ["cpu", "cpu"]),
    "--block-size": ("8", "trainer.block_size", 8), "--num-anchors": ("64", "trainer.num_anchors", 64),
    "--num-draft-layers": ("3", "trainer.num_draft_layers", 3),
    "--label-source": ("data", "trainer.label_source", "data"), "--distill-topk": ("4", "trainer.distill_topk", 4),
    "--lr": ("1e-3", "trainer.lr", 1e-3), "--warmup-steps": ("5", "trainer.warmup_steps", 5),
    "--grad-accum": ("2", "trainer.grad_accum", 2), "--max-steps": ("7", "trainer.max_steps", 7),
    "--epochs": ("2", "trainer.epochs", 2), "--checkpoint-every": ("9", "trainer.checkpoint_every", 9),
    "--eval-every": ("4", "trainer.eval_every", 4), "--eval-prompts": ("0", "trainer.eval_prompts", 0),
    "--eval-prompt-len": ("32", "trainer.eval_prompt_len", 32),
    "--eval-max-new-tokens": ("16", "trainer.eval_max_new_tokens", 16), "--seed": ("3", "trainer.seed", 3),
    "--data": ("d.arrow", "data.data", "d.arrow"), "--heldout": ("h.arrow", "data.heldout", "h.arrow"),
    "--max-tokens": ("1024", "data.max_tokens", 1024), "--max-batch-size": ("8", "data.max_batch_size", 8),
    "--num-slots": ("3", "ring.num_slots", 3), "--slot-mb": ("2", "ring.slot_bytes", 2 * 2**20),
    "--hang-timeout-s": ("30", "monitor.hang_timeout_s", 30.0),
    "--batch-timeout-s": ("100", "monitor.batch_timeout_s", 100.0),
    "--heartbeat-interval-s": ("0.5", "monitor.heartbeat_interval_s", 0.5),
    "--max-restarts": ("2", "monitor.max_restarts", 2), "--run-dir": ("runs/x", "run_dir", "runs/x"),
    "--checksum": (None, "ring.checksum", True), "--random-target-weights": (None, "producer.random_weights", True),
    "--tcp": ("tcp://127.0.0.1:5555", "tcp", "tcp://127.0.0.1:5555"),
}


def _get(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _all_fields():
    """(key, dataclass field) of every config field, walked from the dataclasses themselves."""
    for f in dataclasses.fields(C.RunConfig):
        section = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if section is not None and dataclasses.is_dataclass(section):
            for g in dataclasses.fields(section):
                yield f"{f.name}.{g.name}", g
        else:
            yield f.name, f


def test_every_config_field_has_a_help_line_a_flag_and_its_default_in_help():
    ap = build_parser()
    by_flag = {o: a for a in ap._actions for o in a.option_strings}
    text = re.sub(r"\s+", " ", ap.format_help())
    keys = []
    for key, f in _all_fields():
        keys.append(key)
        flag = "--" + key.replace("_", "-")
        assert f.metadata.get("help"), f"{key} has no help"
        assert flag in by_flag, f"{key} has no flag {flag}"
        assert by_flag[flag].dest == key
        assert "(default: " in by_flag[flag].help, key
        if C.field_specs()[key].base_type is bool:  # shown as --ring.[no-]checksum, --[no-]resume
            flag = flag.replace(".", ".[no-]") if "." in flag else flag.replace("--", "--[no-]")
        assert flag in text, key
    assert len(keys) == len(C.field_specs()) > 50
    titles = ["topology:", "target & capture:", "drafter & training:", "data:", "rings:", "health monitor:",
              "run directory:", "examples:"]
    assert [text.index(t) for t in titles] == sorted(text.index(t) for t in titles)
    assert "--max-tokens N (default: 8192; on CPU 2048)" not in text  # the help line is between them
    assert re.search(r"--data\.max-tokens, --max-tokens N padded tokens per batch \(default: 8192; on CPU 2048\)",
                     text)
    assert "(default: 0.0006)" in text and "may change on --resume" in text


@pytest.mark.parametrize("flag", sorted(OLD_FLAGS))
def test_every_flag_of_before_still_sets_its_field(flag):
    value, key, expect = OLD_FLAGS[flag]
    cfg = parse(flag, *([value] if value is not None else []))
    assert _get(cfg, key) == expect
    assert cfg.sources[key] == flag


def test_section_flags_none_bools_and_lists():
    cfg = parse("--trainer.grad-clip", "0.5", "--monitor.backoff-max-s", "30", "--data.bucket-edges", "64,256,",
                "--trainer.gamma", "none", "--trainer.compile", "--ring.no-checksum", "--trainer.attention", "dense",
                "--ring.slot-bytes", "8192", "--run-id", "abc1")
    assert cfg.trainer.grad_clip == 0.5 and cfg.monitor.backoff_max_s == 30.0 and cfg.data.bucket_edges == [64, 256]
    assert cfg.trainer.gamma is None and cfg.trainer.compile is True and cfg.ring.checksum is False
    assert cfg.trainer.attention == "dense" and cfg.ring.slot_bytes == 8192 and cfg.run_id == "abc1"
    cfg = parse("--trainer.compile=none", "--checksum=false", "--no-random-target-weights", "--target-layers", "none")
    assert cfg.trainer.compile is None and cfg.ring.checksum is False and cfg.producer.target_layer_ids is None
    assert parse("--trainer.compile=off", "--no-checksum", "--checksum").trainer.compile is False


@pytest.mark.parametrize("argv, needle", [
    (["--trainer.attention", "sparse"], "argument --trainer.attention: expected one of auto, flex, dense, structured"),
    (["--no-checksum=1"], "argument --no-checksum: takes no value"),
    (["--checksum=maybe"], "argument --checksum: expected true or false, got 'maybe'"),
    (["--lr", "none"], "argument --lr: expected a number, got 'none'"),
    (["--producers", ","], "argument --producers: expected a comma-separated list"),
    (["--trainer.seed=1.5"], "argument --trainer.seed: expected an integer"),
])
def test_bad_flag_values_are_named_by_the_flag_as_typed(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert needle in capsys.readouterr().err


def test_config_errors_name_the_flag_as_typed_and_the_file_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^--trainer\.lr: must be > 0"):
        parse("--trainer.lr", "0")
    with pytest.raises(ConfigError, match=r"^--lr: must be > 0"):
        parse("--lr", "0")
    f = tmp_path / "run.toml"
    f.write_text("[trainer]\nlr = 0.0\n")
    with pytest.raises(ConfigError, match=re.escape(f"--config {f}: trainer.lr: must be > 0")):
        parse("--config", str(f))
    f.write_text("[trainer]\nblock_sise = 8\n")
    with pytest.raises(ConfigError, match=r"unknown key 'block_sise' in section \[trainer\] \(its fields: devices, "):
        parse("--config", str(f))


def test_flags_override_the_file_which_overrides_defaults_and_cpu_defaults(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('tcp = "tcp://127.0.0.1:6000"\n[data]\nmax_tokens = 4096\nseed = 9\n'
                 '[trainer]\nlr = 1e-3\nmax_steps = 50\n[monitor]\nbackoff_max_s = 3\n')
    cfg = parse("--config", str(f), "--lr", "2e-3", "--producers", "cpu", "--consumers", "cpu", "--seed", "4")
    assert cfg.trainer.lr == 2e-3 and cfg.trainer.max_steps == 50 and cfg.data.max_tokens == 4096
    assert cfg.monitor.backoff_max_s == 3.0 and cfg.tcp == "tcp://127.0.0.1:6000"
    assert cfg.data.seed == 9 and cfg.trainer.seed == 4          # data.seed set: it does not follow --seed
    assert cfg.trainer.num_anchors == 32 and set(cfg.cpu_defaults) == {"trainer.num_anchors",
                                                                       "trainer.num_draft_layers"}
    assert cfg.sources["trainer.max_steps"] == f"--config {f}: trainer.max_steps"
    assert parse("--seed", "4", "--producers", "cpu", "--consumers", "cpu").data.seed == 4  # follows --seed


def test_cpu_defaults_only_when_every_device_is_cpu(monkeypatch):
    cfg = parse("--producers", "cpu", "--consumers", "cpu")
    assert cfg.cpu_defaults == {k: s.meta["cpu_default"] for k, s in C.field_specs().items() if s.has_cpu_default}
    assert cfg.data.max_tokens == 2048 and cfg.trainer.num_draft_layers == 2
    cfg = parse("--producers", "cuda:0", "--consumers", "cpu")  # (not resolved here: no device check yet)
    assert cfg.cpu_defaults == {} and cfg.data.max_tokens == 8192 and cfg.trainer.num_draft_layers is None


def test_plan_prints_the_values_that_came_from_cpu_defaults(tmp_path, capsys):
    from specring.cli.train import train_main
    from tests.support import make_dataset

    data = make_dataset(tmp_path / "d.arrow", num_samples=8)
    common = ["--plan", "--data", str(data), "--run-dir", str(tmp_path / "r"), "--producers", "cpu",
              "--consumers", "cpu", "--eval-prompts", "0"]
    assert train_main(common) == 0
    out = capsys.readouterr().out
    assert "CPU defaults" in out and "data.max_tokens = 2048  (--max-tokens; 8192 when a GPU is used)" in out
    assert "trainer.num_draft_layers = 2  (--num-draft-layers; none when a GPU is used)" in out
    assert train_main(common + ["--max-tokens", "4096", "--num-anchors", "16", "--num-draft-layers", "1",
                                "--max-steps", "5"]) == 0
    assert "CPU defaults" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ resume

def _saved_run(tmp_path, *argv):
    """A run directory whose config.json was saved from these flags, with the values a start fills in."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = parse("--run-dir", str(run_dir), "--producers", "cpu", "--consumers", "cpu", *argv)
    cfg.ring.slot_bytes, cfg.producer.target_layer_ids = 3 * 2**20 + 2**19, [1, 5]
    cfg.data.data = str(tmp_path / "demo.arrow")
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    return run_dir


def test_resume_takes_the_saved_run_and_the_flags_that_may_change(tmp_path):
    run_dir = _saved_run(tmp_path, "--lr", "6e-4", "--epochs", "2")
    cfg = parse("--run-dir", str(run_dir), "--resume", "--max-steps", "500", "--hang-timeout-s", "300",
                "--eval-prompts", "2", "--monitor.backoff-max-s", "30", "--checkpoint-every", "50")
    assert cfg.resume and cfg.run_dir == str(run_dir) and cfg.trainer.lr == 6e-4
    assert cfg.trainer.max_steps == 500 and cfg.trainer.epochs is None  # --max-steps ends the saved --epochs
    assert cfg.monitor.hang_timeout_s == 300.0 and cfg.monitor.backoff_max_s == 30.0
    assert cfg.trainer.eval_prompts == 2 and cfg.trainer.checkpoint_every == 50
    assert cfg.cpu_defaults == {} and cfg.trainer.num_anchors == 32  # the saved value, not re-derived
    assert "--max-steps 200 -> 500" in cfg.resume_changes and "--epochs 2 -> none (--max-steps counts the " \
                                                               "run's steps now)" in cfg.resume_changes
    # the same command line again (+ --resume) is no change, including values filled in at the start
    same = parse("--run-dir", str(run_dir), "--resume", "--producers", "cpu", "--consumers", "cpu", "--lr", "0.0006",
                 "--epochs", "2", "--slot-mb", "0", "--target-layers", "1,5")
    assert same.resume_changes == [] and same.ring.slot_bytes == 3 * 2**20 + 2**19


def test_resume_refuses_other_changed_flags_by_name(tmp_path):
    run_dir = _saved_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        parse("--run-dir", str(run_dir), "--resume", "--lr", "1e-3")
    assert str(e.value) == ("--resume: --lr cannot change when resuming (the run trained with 0.0006); "
                            "start a new run instead")
    with pytest.raises(ConfigError) as e:
        parse("--run-dir", str(run_dir), "--resume", "--trainer.block-size", "8", "--slot-mb", "4", "--max-steps", "9")
    assert str(e.value) == ("--resume: --slot-mb cannot change when resuming (the run trained with 3.5 MiB); "
                            "--trainer.block-size cannot change when resuming (the run trained with 16); "
                            "start a new run instead")
    f = tmp_path / "new.toml"
    f.write_text("[producer]\ndevices = [\"cpu\", \"cpu\"]\n[monitor]\nmax_restarts = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"--resume: --config {f}: producer.devices cannot change when "
                                                    f"resuming (the run trained with cpu)")):
        parse("--run-dir", str(run_dir), "--resume", "--config", str(f))
    f.write_text("[monitor]\nmax_restarts = 3\n")
    assert parse("--run-dir", str(run_dir), "--resume", "--config", str(f)).monitor.max_restarts == 3


def test_resume_validates_the_changed_values(tmp_path):
    run_dir = _saved_run(tmp_path)
    with pytest.raises(ConfigError, match=r"^--hang-timeout-s: must exceed twice heartbeat_interval_s"):
        parse("--run-dir", str(run_dir), "--resume", "--hang-timeout-s", "1")


# ------------------------------------------------------------------------------------ subcommands' help

def test_launch_help_lists_every_command_with_a_description(capsys):
    from specring.cli.main import COMMANDS, main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, _, text) in COMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(text)}$", out, re.M), name


@pytest.mark.parametrize("name", ["train", "prepare", "regenerate", "eval", "export", "status", "restart", "clean",
                                  "bench"])
def test_every_command_has_its_own_help(name, capsys):
    from specring.cli.main import COMMANDS, main
    try:
        code = main([name, "--help"])
    except SystemExit as e:
        code = e.code
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: launch.py {name}"), out[:200]
    assert "``" not in out
    if name in ("status", "clean", "bench"):
        assert COMMANDS[name][2][1:] in re.sub(r"\s+", " ", out)
    if name == "bench":
        assert "transport" in out and "benchmarks/NAME.py" in out

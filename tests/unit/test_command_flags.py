"""The flags of eval, export, regenerate and prepare (and of status, restart, clean and report) are derived from
their declarations (issue 26): ``shared.commands.command_config`` declares each command's options once (an option
several commands take, once for all of them), and ``cli.flags.command_parser`` builds every parser from it; a bad value
names the flag."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import typing

import pytest

from specring.cli.flags import command_config, command_parser
from specring.shared.commands import command_config as cc
from specring.shared.config.run_config import MAX_SEED, num, option_specs, setting
from specring.shared.errors import ConfigError

MODULES = {"eval": "specring.cli.eval", "export": "specring.cli.export", "regenerate": "specring.cli.regenerate",
           "prepare": "specring.cli.prepare"}

# the command line's contract: every flag of each command, in --help order (tests, docs and scripts use them)
FLAGS = {
    "eval": ["--drafter", "--target", "--trust-remote-code", "--device", "--dtype", "--data", "--num-prompts",
             "--prompt-len", "--max-new-tokens", "--block-size", "--num-draft-tokens", "--batch-size", "--ignore-eos",
             "--no-lossless-check", "--temperature", "--top-p", "--top-k", "--sampling-seed", "--baselines-only",
             "--no-baselines", "--baselines", "--ngram-max", "--seed", "--output-json"],
    "export": ["--drafter", "--target", "--trust-remote-code", "--output", "--dtype", "--overwrite"],
    "regenerate": ["--target", "--trust-remote-code", "--dtype", "--input", "--output", "--max-samples",
                   "--prefix-len", "--stride", "--include-input", "--max-new-tokens", "--temperature", "--seed",
                   "--devices", "--backend", "--batch-size", "--shard-size", "--no-progress"],
    "prepare": ["inputs", "--input", "--output", "--tokenizer", "--trust-remote-code", "--chat-template",
                "--max-length", "--overlong", "--strict", "--workers", "--no-progress", "--demo", "--demo-dir"],
}
REQUIRED = {"eval": set(), "export": {"--drafter", "--output"}, "regenerate": {"--target", "--input", "--output"},
            "prepare": set()}
# flags that two commands spell alike but that are different options (their type or default differ), so each
# command declares its own
NOT_SHARED = {
    "--batch-size": "eval decodes 64 prompts together, regenerate calls generate with 256",
    "--input": "regenerate reads one Arrow file; prepare takes any number of JSONL/Parquet inputs",
    "--output": "export writes a directory; regenerate and prepare an Arrow file (prepare: none with --demo)",
}


def parser(name: str) -> argparse.ArgumentParser:
    return importlib.import_module(MODULES[name]).build_parser()


def flags_of(ap: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[0] if a.option_strings else a.dest for a in ap._actions
            if not isinstance(a, argparse._HelpAction)]


def declaring_class(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO that declares the field ``name`` (an option group, or the command itself)."""
    return next(k for k in reversed(cls.__mro__) if name in getattr(k, "__annotations__", {}))


def parse(name: str, *argv: str):
    return command_config(cc.COMMAND_CONFIGS[name], parser(name).parse_args(list(argv)))


@pytest.mark.parametrize("name", MODULES)
def test_every_declared_field_is_a_flag_of_its_command_and_nothing_else_is(name):
    cls = cc.COMMAND_CONFIGS[name]
    declared = [s.flag for s in option_specs(cls).values()]
    assert declared == FLAGS[name]
    assert flags_of(parser(name)) == declared
    assert {f.name for f in dataclasses.fields(cls)} == set(option_specs(cls))


@pytest.mark.parametrize("name", MODULES)
def test_required_flags_are_the_declared_ones(name):
    required = {a.option_strings[0] for a in parser(name)._actions if a.required and a.option_strings}
    assert required == REQUIRED[name] == {s.flag for s in option_specs(cc.COMMAND_CONFIGS[name]).values()
                                         if s.required}


@pytest.mark.parametrize("name", MODULES)
def test_no_flags_give_the_declared_defaults(name):
    cls = cc.COMMAND_CONFIGS[name]
    given = {"--target": "t", "--drafter": "d", "--input": "i", "--output": "o"}
    argv = [x for flag in REQUIRED[name] for x in (flag, given[flag])]
    cfg = parse(name, *argv)
    for spec in option_specs(cls).values():
        if not spec.required:
            assert getattr(cfg, spec.name) == spec.default, spec.flag


def help_lines(name: str) -> dict[str, str]:
    """``{flag: its help line}`` as ``--help`` prints it (wrapping undone)."""
    ap = parser(name)
    fmt = ap._get_formatter()
    return {(a.option_strings or [a.dest])[0]: " ".join(fmt._expand_help(a).split()) for a in ap._actions
            if not isinstance(a, argparse._HelpAction)}


def test_a_flag_of_several_commands_is_one_declaration_with_one_help_line():
    commands: dict[str, list[str]] = {}
    for name in MODULES:
        for flag in FLAGS[name]:
            commands.setdefault(flag, []).append(name)
    shared = {flag: names for flag, names in commands.items() if len(names) > 1 and flag not in NOT_SHARED}
    assert {"--target", "--trust-remote-code", "--dtype", "--seed", "--max-new-tokens", "--temperature",
            "--drafter", "--no-progress"} <= set(shared)
    for flag, names in shared.items():
        field = flag[2:].replace("-", "_")
        owners = {declaring_class(cc.COMMAND_CONFIGS[n], field) for n in names}
        assert len(owners) == 1, (flag, owners)            # one declaration, in an option group
        assert next(iter(owners)) not in cc.COMMAND_CONFIGS.values(), flag
        helps = {n: option_specs(cc.COMMAND_CONFIGS[n])[field].help for n in names}
        assert len(set(helps.values())) == 1, (flag, helps)
        # and --help prints it alike (a required option shows no default; the rest shows the same default)
        shown = {n: help_lines(n)[flag] for n in names if field not in getattr(cc.COMMAND_CONFIGS[n], "REQUIRED", ())}
        assert len(set(shown.values())) <= 1, (flag, shown)
    for flag in NOT_SHARED:
        assert len(commands[flag]) > 1, f"{flag} is no longer in several commands: drop it from NOT_SHARED"


BAD_NUMBERS = {int: ["nan", "inf", "abc", "2.5", "1e300"], float: ["nan", "inf", "-inf", "abc"]}


def numeric_flags():
    for name in MODULES:
        for spec in option_specs(cc.COMMAND_CONFIGS[name]).values():
            if spec.base_type in (int, float):
                yield name, spec


@pytest.mark.parametrize("name, spec", list(numeric_flags()), ids=lambda x: getattr(x, "flag", x))
def test_a_number_that_is_not_one_names_the_flag_while_parsing(name, spec, capsys):
    for value in BAD_NUMBERS[spec.base_type]:
        with pytest.raises(SystemExit) as e:
            parser(name).parse_args([f"{spec.flag}={value}"])
        assert e.value.code == 2
        assert f"argument {spec.flag}: " in capsys.readouterr().err, (spec.flag, value)


@pytest.mark.parametrize("name, spec", list(numeric_flags()), ids=lambda x: getattr(x, "flag", x))
def test_a_number_out_of_its_declared_range_names_the_flag(name, spec, capsys):
    low = spec.meta.get("ge") if spec.meta.get("ge") is not None else spec.meta.get("gt")
    values = [str(low - 1 if spec.meta.get("ge") is not None else low)] if low is not None else []
    if spec.meta.get("le") is not None:
        values.append(str(spec.meta["le"] * 2 if spec.base_type is int else spec.meta["le"] * 1.5))
    assert values, f"{spec.flag} declares no bound"
    required = {"--target": "t", "--drafter": "d", "--input": "i", "--output": "o"}
    argv = [x for flag in REQUIRED[name] for x in (flag, required[flag])]
    for value in values:
        try:
            parse(name, *argv, spec.flag, value)
        except ConfigError as e:  # the declared bound
            assert str(e).startswith(f"{spec.flag}: must be"), e
        except SystemExit:        # beyond what an integer flag takes at all (2**62)
            assert f"argument {spec.flag}: {value!r} is too large" in capsys.readouterr().err
        else:
            pytest.fail(f"{spec.flag} {value} was taken")


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float8"], "argument --dtype: expected one of auto, bfloat16, float16, float32, got 'float8'"),
    (["--baselines", "untrained,medusa"], "argument --baselines: expected one of untrained, prompt-lookup, got "
                                          "'medusa'"),
    (["--trust-remote-code=yes"], "argument --trust-remote-code: ignored explicit argument 'yes'"),
])
def test_a_bad_choice_or_a_value_for_a_switch_names_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parser("eval").parse_args(argv)
    assert message in capsys.readouterr().err


def test_values_are_typed_and_taken_as_today():
    cfg = parse("eval", "--data", "a.arrow", "b.arrow", "--baselines", "prompt-lookup", "--num-prompts", "1e3",
                "--drafter", "none", "--block-size", "8", "--trust-remote-code")
    assert cfg.data == ["a.arrow", "b.arrow"] and cfg.baselines == ["prompt-lookup"] and cfg.num_prompts == 1000
    assert cfg.drafter is None and not cfg.uses_drafter and cfg.block_size == 8 and cfg.trust_remote_code is True
    assert parse("eval", "--drafter", "runs/x").uses_drafter
    assert not parse("eval", "--drafter", "runs/x", "--baselines-only").uses_drafter
    cfg = parse("prepare", "a.jsonl", "b.jsonl", "--input", "c.jsonl", "--input", "d.jsonl", "--max-length", "64")
    assert cfg.inputs == ["a.jsonl", "b.jsonl"] and cfg.input == ["c.jsonl", "d.jsonl"] and cfg.max_length == 64
    cfg = parse("regenerate", "--target", "t", "--input", "i", "--output", "o", "--temperature", "0.5",
                "--backend", "transformers", "--no-progress")
    assert cfg.temperature == 0.5 and isinstance(cfg.temperature, float) and cfg.backend == "transformers"
    assert cfg.no_progress is True


def test_a_required_option_of_a_shared_group_is_refused_when_missing(capsys):
    with pytest.raises(SystemExit):
        parser("regenerate").parse_args(["--input", "i", "--output", "o"])
    assert "the following arguments are required: --target" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="^--target: is required"):
        parse("regenerate", "--target", "none", "--input", "i", "--output", "o")
    with pytest.raises(ConfigError, match="target: is required"):
        cc.RegenerateConfig(input="i", output="o")


def test_the_demo_and_default_lengths_are_the_corpus_modules():
    from specring.shared.data.demo import DEMO_MAX_LENGTH
    assert option_specs(cc.PrepareConfig)["max_length"].meta["default_text"] == \
        f"{cc.PREPARE_MAX_LENGTH}; {DEMO_MAX_LENGTH} for --demo"


def test_the_derivation_takes_any_declared_class():
    """A class declared like the commands' gets its parser, typed values, groups and checks from the same code."""
    @dataclasses.dataclass(kw_only=True)
    class Shared:
        seed: int = num(0, ge=0, le=MAX_SEED, help="a seed")

    @dataclasses.dataclass(kw_only=True)
    class Toy(Shared):
        HELP_GROUPS: typing.ClassVar = {"first": ("name", "seed"), "second": ("ratio", "items", "quiet")}
        name: str = setting(help="a name")
        ratio: float = num(0.5, gt=0, le=1, help="a ratio")
        items: list[int] = num([1, 2], ge=0, help="items")
        quiet: bool = setting(False, switch=True, help="say nothing")

        def __post_init__(self):
            from specring.shared.config.run_config import check_fields
            check_fields(self)

    ap = command_parser(Toy, "toy", "a toy", "examples:\n  toy --name x")
    assert [g.title for g in ap._action_groups][-2:] == ["first", "second"]
    cfg = command_config(Toy, ap.parse_args(["--name", "x", "--items", "3,4", "--quiet", "--seed", "7"]))
    assert (cfg.name, cfg.ratio, cfg.items, cfg.quiet, cfg.seed) == ("x", 0.5, [3, 4], True, 7)
    with pytest.raises(ConfigError, match=r"^--ratio: must be <= 1, got 2"):
        command_config(Toy, ap.parse_args(["--name", "x", "--ratio", "2"]))
    text = ap.format_help()
    assert "a ratio (default: 0.5)" in text and "say nothing (default: off)" in text and "a name\n" in text

    @dataclasses.dataclass(kw_only=True)
    class Misplaced(Toy):
        HELP_GROUPS: typing.ClassVar = {"first": ("name",)}

    with pytest.raises(TypeError, match="HELP_GROUPS must place every field once"):
        option_specs(Misplaced)


# the commands that talk to a run (issue 26): their flags, in --help order, from their declarations too
RUN_COMMANDS = {"status": ("specring.cli.ops", "status_parser"), "restart": ("specring.cli.ops", "restart_parser"),
                "clean": ("specring.cli.ops", "clean_parser"), "report": ("specring.cli.report", "build_parser")}
RUN_FLAGS = {"status": ["--run-dir", "--json", "--serve", "--port", "--host", "--refresh-s"],
             "restart": ["role", "index", "--run-dir"], "clean": ["--run-dir"],
             "report": ["run_dirs", "--output", "--eval"]}


def run_parser(name: str) -> argparse.ArgumentParser:
    module, builder = RUN_COMMANDS[name]
    return getattr(importlib.import_module(module), builder)()


@pytest.mark.parametrize("name", RUN_COMMANDS)
def test_the_run_commands_flags_are_their_declarations(name):
    declared = [s.flag for s in option_specs(cc.COMMAND_CONFIGS[name]).values()]
    assert declared == RUN_FLAGS[name] == flags_of(run_parser(name))


def test_the_run_commands_defaults_and_values(tmp_path, monkeypatch):
    from specring.shared.run.run_dir import RunDir
    monkeypatch.chdir(tmp_path)   # runs/latest is the current directory's, when the command runs

    def parse_run(name, *argv):
        return command_config(cc.COMMAND_CONFIGS[name], run_parser(name).parse_args(list(argv)))
    st = parse_run("status")
    assert (st.run_dir, st.json, st.serve, st.port, st.host, st.refresh_s) == \
        (str(RunDir.latest_link()), False, False, 0, "127.0.0.1", 5.0) and st.run_dir.startswith(str(tmp_path))
    assert parse_run("restart", "producer", "1e0", "--run-dir", "r") == cc.RestartConfig(role="producer", index=1,
                                                                                         run_dir="r")
    assert parse_run("clean", "--run-dir", "a,b", "--run-dir", "c").run_dir == ["a,b", "c"]
    assert parse_run("clean").run_dir == []
    rep = parse_run("report", "a", "b", "--eval", "x.json", "--eval", "y.json")
    assert (rep.run_dirs, rep.output, rep.eval) == (["a", "b"], "", ["x.json", "y.json"])

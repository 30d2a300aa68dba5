"""--help of every command (issue 17): described, grouped by concern, every option with its default, examples at
the end of `launch.py --help` and `launch.py train --help`."""

from __future__ import annotations

import importlib
import re

import pytest

from specring.cli.main import COMMANDS, main

OWN_PARSERS = {"prepare": "specring.cli.prepare", "regenerate": "specring.cli.regenerate",
               "eval": "specring.cli.eval", "export": "specring.cli.export"}


def help_text(name: str, capsys) -> str:
    try:
        code = main([name, "--help"])
    except SystemExit as e:
        code = e.code
    assert code == 0
    return capsys.readouterr().out


def option_blocks(text: str) -> dict[str, str]:
    """``{first flag: its help text}`` of every option entry of an argparse help (the examples excluded)."""
    text = text.split("\nexamples:")[0]
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (-[-\w.\[\]]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def required_flags(name: str) -> set[str]:
    if name not in OWN_PARSERS:
        return set()
    parser = importlib.import_module(OWN_PARSERS[name]).build_parser()
    return {a.option_strings[0] for a in parser._actions if a.required and a.option_strings}


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "bench"])
def test_every_option_of_every_command_shows_its_default(name, capsys):
    text = help_text(name, capsys)
    blocks = option_blocks(text)
    assert blocks, text[:500]
    missing = [flag for flag, block in blocks.items()
               if flag not in ("-h", "--help") and flag not in required_flags(name) and "default" not in block]
    assert not missing, f"launch.py {name} --help: no default shown for {missing}"


@pytest.mark.parametrize("name", ["train", *OWN_PARSERS])
def test_the_larger_commands_group_their_options_by_concern(name, capsys):
    text = help_text(name, capsys).split("\nexamples:")[0]
    groups = [g for g in re.findall(r"^(\S[^\n]*):$", text, re.M) if g not in ("options", "positional arguments")]
    assert len(groups) >= 2, (name, groups)


@pytest.mark.parametrize("name", ["train", *OWN_PARSERS])
def test_help_ends_with_examples_of_the_command(name, capsys):
    text = help_text(name, capsys)
    examples = text.split("\nexamples:\n")[1]
    assert re.search(rf"^  launch\.py {name} ", examples, re.M), examples


def test_launch_help_ends_with_examples_that_name_recipes_and_trackers(capsys):
    assert main(["--help"]) == 0
    examples = capsys.readouterr().out.split("\nexamples:\n")[1]
    assert "configs/qwen3-8b.toml" in examples and "--report-to" in examples
    assert "--tokenizer Qwen/Qwen3-8B" in examples  # a hub id


def test_train_help_names_hub_ids_trust_remote_code_and_trackers(capsys):
    blocks = option_blocks(help_text("train", capsys))
    assert "hub id" in blocks["--producer.target"] and "(default: the embedded fixture" in blocks["--producer.target"]
    assert "(default: off)" in blocks["--producer.[no-]trust-remote-code"]
    assert "tensorboard, wandb, mlflow" in blocks["--report-to"] and "(default: none; may change on --resume)" in \
        blocks["--report-to"]

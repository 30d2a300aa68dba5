#!/usr/bin/env python3
"""specring's command line: ``launch.py [COMMAND] [FLAGS]`` runs one of ``COMMANDS`` (``train`` when the
first word is not a command name); ``launch.py --help`` lists them with their one-line descriptions and
``launch.py COMMAND --help`` gives a command's own flags."""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one line for `launch.py --help`)
COMMANDS = {
    "train": ("specring.cli.train", "train_main",
              "train a drafter: producers (target, hidden states) and consumers (drafter trainers) as processes"),
    "prepare": ("specring.cli.prepare", "main",
                "tokenize JSONL/Parquet data into the Arrow file train reads (--demo: the embedded corpus)"),
    "regenerate": ("specring.cli.regenerate", "main",
                   "rewrite training data with the target's own answers or continuations (loss on generated tokens)"),
    "eval": ("specring.cli.eval", "main",
             "acceptance length tau of a drafter by real speculative decoding with the target"),
    "export": ("specring.cli.export", "main",
               "write a trained drafter in the format SGLang/vLLM load (DFlashDraftModel or LlamaForCausalLMEagle3)"),
    "report": ("specring.cli.report", "main",
               "an HTML page and PNG plots of one run or several side by side: loss, accuracy, tau, rings, balance"),
    "status": ("specring.cli.ops", "status_main",
               "one line per process of a running run: pid, heartbeat, tokens/s, memory, ring occupancy "
               "(--serve: a live page)"),
    "restart": ("specring.cli.ops", "restart_main",
                "restart one producer of a running run gracefully (restart producer N)"),
    "clean": ("specring.cli.ops", "clean_main",
              "remove shared-memory segments, sockets and processes left by runs whose supervisor died"),
    "bench": ("specring.cli.ops", "bench_main",
              "run a benchmark script of a specring checkout (transport, producer, trainer, e2e)"),
}


EXAMPLES = """\
examples:
  launch.py                                           train on the embedded default (fixture target, demo corpus)
  launch.py prepare data/chat.jsonl --tokenizer Qwen/Qwen3-8B --output data/train.arrow
  launch.py train --config configs/qwen3-8b.toml --data data/train.arrow --report-to tensorboard
  launch.py status                                    the processes of the running run (runs/latest)
  launch.py eval --drafter runs/latest                tau of the latest checkpoint against the baselines
  launch.py report runs/a runs/b                      plots of two runs on shared axes (HTML + PNG)
  launch.py export --drafter runs/latest --output exported/"""


def usage() -> str:
    """The text of ``launch.py --help``: every command with its one-line description, then examples."""
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: launch.py [COMMAND] [FLAGS]", "",
             "specring: train speculative-decoding drafters (DFlash, EAGLE-3) from a target LLM's hidden states.", "",
             "commands (train when none is named):"]
    lines += [f"  {name:<{width}}{text}" for name, (_, _, text) in COMMANDS.items()]
    lines += ["", "Run `launch.py COMMAND --help` for a command's flags, e.g. `launch.py train --help`.", "", EXAMPLES]
    return "\n".join(lines)


def description(name: str) -> str:
    """A command's one-line description, as a sentence (for its own ``--help``)."""
    text = COMMANDS[name][2]
    return text[0].upper() + text[1:] + "."


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand (``train`` when none is named); returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())

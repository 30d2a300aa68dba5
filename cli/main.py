#!/usr/bin/env python3
"""specring: train speculative-decoding drafters (DFlash) from a target LLM's hidden states.

Commands (the default is train):
  train     train a drafter: producers (targets) and consumers (drafter trainers) as separate processes
  prepare   tokenize JSONL/Parquet data into the Arrow format train reads (--demo: the embedded corpus)
  regenerate  rewrite training data with the target's own answers/continuations (loss on generated tokens)
  status    one line per process of a running run (--run-dir)
  restart   restart one producer of a running run gracefully (restart producer N --run-dir R)
  clean     remove shared-memory segments, sockets and processes left by runs whose supervisor died
  eval      acceptance length tau by real speculative decoding with the target
  export    write a trained drafter as a DFlashDraftModel directory for SGLang/vLLM
  bench     run a benchmark from benchmarks/ (transport, producer, trainer, e2e)

Run `python launch.py COMMAND --help` for a command's flags.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "prepare": ("specring.cli.prepare", "main"),
    "regenerate": ("specring.cli.regenerate", "main"),
    "train": ("specring.cli.train", "train_main"),
    "status": ("specring.cli.ops", "status_main"),
    "restart": ("specring.cli.ops", "restart_main"),
    "clean": ("specring.cli.ops", "clean_main"),
    "eval": ("specring.cli.eval", "main"),
    "export": ("specring.cli.export", "main"),
    "bench": ("specring.cli.ops", "bench_main"),
}


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand (``train`` when none is named); returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: launch.py [COMMAND] [FLAGS]\n\n" + __doc__.strip())
        return 0
    name = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    module, func = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())

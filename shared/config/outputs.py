"""What a command writes must not be what it reads: one check for every command that writes an output.

Every command that writes files (``prepare``, ``regenerate``, ``export``, ``eval --output-json``, ``train
--run-dir``) lists what it will write, temporary names and sidecars included (a data file ``NAME.arrow`` has the
sidecar ``NAME.json``; both are written under ``.tmp`` names first), and what it reads; ``check_outputs`` refuses,
before anything is written, a list where

* two outputs are one path (``prepare --output p.json``: the data file and its sidecar would both be ``p.json``);
* an output is an input file or an input's sidecar (``regenerate --output data/train.json`` when the input is
  ``data/train.arrow``);
* an output directory is, or holds, an input (``export --output`` the run directory it exports from);
* an output file would replace a file of an input directory (``eval --output-json`` a checkpoint's
  ``config.json``; ``train --run-dir`` the target's directory);
* an output file is an existing directory.

Paths are compared after ``resolve()`` (symbolic links followed), and as the same file when both exist
(``os.path.samefile``: hard links).
"""

from __future__ import annotations

import os
from pathlib import Path

from specring.shared.errors import ConfigError


def _norm(p: str | Path) -> Path:
    return Path(os.path.abspath(Path(p).expanduser())).resolve(strict=False)


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(child: Path, parent: Path) -> bool:
    return child != parent and parent in child.parents


def check_outputs(flag: str, outputs: dict[str, str | Path], inputs: dict[str, str | Path]) -> None:
    """Refuse outputs that collide with one another or with an input (module docstring).

    ``flag``: the option that names the outputs (``--output``), which starts the message; ``outputs``: what is
    written, ``description -> path`` (a file, or a directory when the description ends in ``directory``);
    ``inputs``: what is read, ``description -> path`` (files or directories; ones that do not exist are
    skipped). Raises ``ConfigError`` naming ``flag``, both descriptions and the path."""
    outs = [(what, _norm(p)) for what, p in outputs.items()]
    ins = [(what, _norm(p)) for what, p in inputs.items() if p is not None and Path(p).exists()]
    for i, (wa, a) in enumerate(outs):
        for wb, b in outs[i + 1:]:
            if _same(a, b):
                raise ConfigError(f"{flag}: the {wa} and the {wb} would both be written to {a}; choose a name "
                                  f"that does not end in {a.suffix or 'the same name'} (e.g. {a.with_suffix('.arrow')})"
                                  if a.suffix == ".json" else
                                  f"{flag}: the {wa} and the {wb} would both be written to {a}")
    for wo, o in outs:
        is_dir = wo.endswith("directory")
        if not is_dir and o.is_dir():
            raise ConfigError(f"{flag}: {o} is a directory; the {wo} is a file: give a file name")
        for wi, i in ins:
            if _same(o, i):
                raise ConfigError(f"{flag}: {o} is the {wi}: writing the {wo} there would destroy what is read; "
                                  f"choose another name")
            if is_dir and _inside(i, o):
                raise ConfigError(f"{flag}: the {wo} {o} holds the {wi} ({i}): writing it would destroy what is "
                                  f"read; choose another directory")
            if not is_dir and i.is_dir() and _inside(o, i) and o.exists():
                raise ConfigError(f"{flag}: {o} is a file of the {wi} ({i}): writing the {wo} there would replace "
                                  f"it; choose another name")

"""shared/envs.py is the one home of environment variables: no other module of the project reads one from
``os.environ``/``os.getenv`` or spells a ``SPECRING_*`` name of its own, and every declared name is read or set
somewhere (no stale declaration). Readers raise for an undeclared name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from specring.shared import envs

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(p for room in ("shared", "producers", "consumer", "supervisor", "cli")
                 for p in (ROOT / room).rglob("*.py"))
HOME = ROOT / "shared" / "envs.py"


def _reads(tree: ast.AST):
    """(line, text) of every ``os.environ.get/setdefault/pop(...)``, ``os.environ[...]`` and ``os.getenv(...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                yield node.lineno, "os.getenv"
            if (f.attr in ("get", "setdefault", "pop") and isinstance(f.value, ast.Attribute)
                    and f.value.attr == "environ"):
                yield node.lineno, f"os.environ.{f.attr}"
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            yield node.lineno, "os.environ[...]"


@pytest.mark.parametrize("path", [p for p in MODULES if p != HOME], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_but_envs_reads_the_environment_or_names_a_variable(path):
    src = path.read_text()
    reads = [f"line {n}: {what}" for n, what in _reads(ast.parse(src))]
    names = [f"line {src[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
             for m in re.finditer(r"[\"']SPECRING_[A-Z_]+[\"']", src)]
    assert not reads and not names, (f"{path.relative_to(ROOT)} reads the environment or names a variable outside "
                                     f"shared/envs.py: {reads + names}")


def test_every_declared_variable_is_used():
    text = "\n".join(p.read_text() for p in MODULES if p != HOME)
    consts = {v: k for k, v in vars(envs).items() if isinstance(v, str) and v in envs.VARIABLES and k.isupper()}
    unused = [n for n in envs.VARIABLES
              if f'"{n}"' not in text and f"'{n}'" not in text and not (n in consts and f"envs.{consts[n]}" in text)]
    assert not unused, f"declared in shared/envs.py but never read or set: {unused}"


def test_readers_refuse_undeclared_names_and_parse_with_the_name_in_the_error(monkeypatch):
    with pytest.raises(KeyError, match="SPECRING_NOPE is not declared"):
        envs.get("SPECRING_NOPE")
    monkeypatch.setenv(envs.SLOW_WRITE_S, "soon")
    with pytest.raises(Exception, match="SPECRING_SLOW_WRITE_S='soon' is not a number of seconds"):
        envs.seconds(envs.SLOW_WRITE_S)
    monkeypatch.setenv(envs.FAULT_HELPERS, "yes")
    with pytest.raises(Exception, match="SPECRING_FAULT_HELPERS='yes' must be 0 or 1"):
        envs.flag(envs.FAULT_HELPERS)
    monkeypatch.delenv(envs.DECODE_GRAPHS, raising=False)
    assert envs.flag(envs.DECODE_GRAPHS, True) and not envs.flag(envs.DECODE_GRAPHS)   # unset: the default
    monkeypatch.setenv(envs.DECODE_GRAPHS, "0")
    assert not envs.flag(envs.DECODE_GRAPHS, True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "True")
    assert envs.truthy("HF_HUB_OFFLINE") and envs.is_set("HF_HUB_OFFLINE")

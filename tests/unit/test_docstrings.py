"""Docstrings name only what exists: every dotted name of a project module (``shared.models.target``,
``specring.consumer.trainer.Trainer``, ...) resolves to a module and, past it, to an attribute; every file path of
the checkout they name (``docs/evaluation.md``, ``benchmarks/trainer.py``, ...) is there. A module moved or
renamed without its readers' docstrings fails here, naming the file, line and reference."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("shared", "consumer", "producers", "supervisor", "cli")
SOURCES = sorted([p for room in (*ROOMS, "benchmarks", "tests") for p in (ROOT / room).rglob("*.py")]
                 + [ROOT / "launch.py", ROOT / "specring" / "__init__.py"])
DOTTED = re.compile(r"(?<![\w./-])(?:specring\.)?((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(ROOMS))
# a path inside the checkout: a known top folder (or a top-level markdown file) and a file name with a suffix
PATH = re.compile(r"(?<![\w./:-])((?:(?:%s|benchmarks|tests|docs|configs|assets|\.ci)/[\w./-]*\w)|[A-Z][A-Z_]+\.md)"
                  % "|".join(ROOMS))


def docstrings(path: Path):
    """(line, text) of the module's, classes' and functions' docstrings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield (node.body[0].lineno if node.body else 1), doc


def resolves(dotted: str) -> bool:
    """``dotted`` is a project module, or an attribute chain past the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        where = ROOT.joinpath(*parts[:i])
        if where.with_suffix(".py").is_file() or (where / "__init__.py").is_file():
            obj = importlib.import_module("specring." + ".".join(parts[:i]))
            for name in parts[i:]:
                if not hasattr(obj, name):
                    return False
                obj = getattr(obj, name)
            return True
    return False


def exists(ref: str) -> bool:
    ref = ref.rstrip(".")
    if "*" in ref or "<" in ref or ref.endswith("/") or re.search(r"(^|/)[A-Z]+(/|\.|$)", ref):
        return True  # a pattern: a glob, a placeholder (NAME, N) or a folder
    if re.fullmatch(r"[A-Z][A-Z_]+\.md", ref):  # a top-level document of the checkout
        return (ROOT / ref).is_file() or (ROOT / "docs" / ref).is_file()
    return (ROOT / ref).exists()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docstrings_name_modules_and_files_that_exist(path):
    bad = []
    for line, doc in docstrings(path):
        for m in DOTTED.finditer(doc):
            ref = m.group(1).rstrip(".")
            if ref.split(".")[-1] in ("py", "md", "toml", "json", "jsonl", "sh"):
                continue  # a file name written with dots (handled as a path)
            if not resolves(ref):
                bad.append(f"line {line}: {ref}")
        for m in PATH.finditer(doc):
            if not exists(m.group(1)):
                bad.append(f"line {line}: {m.group(1)}")
    assert not bad, f"{path.relative_to(ROOT)} names what does not exist: " + "; ".join(bad)

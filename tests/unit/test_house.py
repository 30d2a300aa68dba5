"""The house rules, read off the source: process packages import only from ``shared``, ``shared`` only from
itself, and nothing installed imports the tests or the benchmarks (docs/DESIGN.md, "The house")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO

ROOMS = ("shared", "producers", "consumer", "supervisor", "cli")
# what each room may import of specring (besides itself)
ALLOWED = {"shared": set(), "producers": {"shared"}, "consumer": {"shared"}, "supervisor": {"shared"},
           "cli": {"shared", "producers", "consumer", "supervisor"}}


def specring_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, room)`` of every import of a specring room in ``path``, function-local ones included; also
    ``tests``/``benchmarks`` imports, named as such."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "specring" and len(parts) > 1 and parts[1] in ROOMS:
                out.append((node.lineno, parts[1]))
            elif parts[0] in ROOMS + ("tests", "benchmarks"):
                out.append((node.lineno, f"bare:{parts[0]}"))
    return out


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_imports_only_what_it_may(room):
    bad = []
    for path in sorted((REPO / room).rglob("*.py")):
        for line, other in specring_imports(path):
            if other != room and other not in ALLOWED[room]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {other}")
    assert not bad, "\n".join(bad)


def test_the_walker_sees_function_local_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from specring.consumer.trainer import Trainer\n    import tests.support\n")
    assert specring_imports(src) == [(2, "consumer"), (3, "bare:tests")]

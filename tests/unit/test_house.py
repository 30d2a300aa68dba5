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


FAMILY_NAMES = ("dflash", "dflash2", "eagle3")


def family_name_comparisons(path: Path) -> list[int]:
    """Lines of ``path`` that compare something with a drafter family's name (``x == "eagle3"``, ``x != "dflash"``,
    ``x in ("dflash", ...)``): dispatch on a family that belongs behind the registry (``shared/drafters``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, right in zip(node.ops, node.comparators):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)):
                continue
            consts = []
            for o in operands:
                if isinstance(o, ast.Constant):
                    consts.append(o.value)
                elif isinstance(o, (ast.Tuple, ast.List, ast.Set)):
                    consts.extend(e.value for e in o.elts if isinstance(e, ast.Constant))
            if any(c in FAMILY_NAMES for c in consts):
                out.append(node.lineno)
                break
    return out


def test_no_drafter_kind_dispatch_outside_the_registry():
    """A drafter family lives behind the contract (``shared/drafters/``): no product module outside that package
    compares a value with a family's name (issue 22)."""
    bad = []
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*.py")):
            if path.is_relative_to(REPO / "shared" / "drafters"):
                continue
            bad += [f"{path.relative_to(REPO)}:{line}" for line in family_name_comparisons(path)]
    assert not bad, "compare a drafter kind outside shared/drafters:\n" + "\n".join(bad)


def test_the_kind_walker_sees_comparisons(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('a = kind == "eagle3"\nb = "dflash" != k\nc = k in ("dflash2", "x")\nd = k == "other"\n')
    assert family_name_comparisons(src) == [1, 2, 3]


def test_every_registered_family_keeps_the_contract():
    """Each registry line names a ``DrafterFamily`` whose name is its key and whose abstract methods are all
    implemented."""
    from specring.shared.drafters import FAMILIES, get_family
    from specring.shared.drafters.contract import DrafterFamily

    for name in FAMILIES:
        fam = get_family(name)
        assert isinstance(fam, DrafterFamily) and fam.name == name
        assert not getattr(type(fam), "__abstractmethods__", None), (name, type(fam).__abstractmethods__)

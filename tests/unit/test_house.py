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


def shared_folder_imports(shared: Path) -> dict[str, dict[str, list[str]]]:
    """``folder -> imported folder -> ["path:line", ...]`` among the folders of ``shared`` (its direct
    subfolders; the top-level modules of a folder count as that folder, those of ``shared`` itself as ``"."``): the
    module graph of ``module_imports`` over ``shared`` alone, its modules taken by folder."""
    def folder(module: str) -> str:
        parts = module.split(".")[1:]  # "shared.drafters.checkpoint" -> ["drafters", "checkpoint"]
        return parts[0] if parts and (shared / parts[0]).is_dir() else "."

    graph: dict[str, dict[str, list[str]]] = {}
    for a, targets in module_imports(shared.parent, rooms=("shared",)).items():
        for b, where in targets.items():
            if folder(a) != folder(b):
                graph.setdefault(folder(a), {}).setdefault(folder(b), []).extend(where)
    for targets in graph.values():
        for b in targets:
            targets[b] = sorted(set(targets[b]), key=lambda w: (w.rsplit(":", 1)[0], int(w.rsplit(":", 1)[1])))
    return graph


def folder_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """A cycle of ``graph`` (``[a, b, ..., a]``), or None when there is none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, {})):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


# folder circles known and not yet broken, by their edge and why (none: the configuration reads the families' facts
# from shared/config/families.py, which the registry in shared/drafters/ reads too)
KNOWN_CIRCLE_EDGES: dict[tuple[str, str], str] = {}


def test_no_folder_of_shared_imports_one_that_imports_it_back():
    """The folders of ``shared/`` form layers: none reaches itself through the imports of the others (issue 26),
    but for ``KNOWN_CIRCLE_EDGES``, each of which must still be there (remove it here once it is gone)."""
    graph = shared_folder_imports(REPO / "shared")
    gone = [edge for edge in KNOWN_CIRCLE_EDGES if edge[1] not in graph.get(edge[0], {})]
    assert not gone, f"no longer imported, remove from KNOWN_CIRCLE_EDGES: {gone}"
    for a, b in KNOWN_CIRCLE_EDGES:
        del graph[a][b]
    cycle = folder_cycle(graph)
    where = [f"  {a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "shared/ folders in a circle: " + " -> ".join(cycle or []) + "\n" + "\n".join(where)


@pytest.mark.parametrize("where", ["module", "function"])
def test_the_folder_walker_sees_a_circle(tmp_path, where):
    shared = tmp_path / "shared"
    for folder, text in (("a", "from specring.shared.b.y import Y\n"), ("b", "from specring.shared.a import x\n")):
        (shared / folder).mkdir(parents=True)
        (shared / folder / "__init__.py").write_text("")
        if where == "function":
            text = "def f():\n    " + text
        (shared / folder / ("x.py" if folder == "a" else "y.py")).write_text(text)
    (shared / "errors.py").write_text("")
    (shared / "c").mkdir()
    (shared / "c" / "z.py").write_text("from specring.shared import errors\nfrom specring.shared.a.x import X\n")
    graph = shared_folder_imports(shared)
    assert graph["c"] == {".": ["shared/c/z.py:1"], "a": ["shared/c/z.py:2"]}
    assert folder_cycle(graph) == ["a", "b", "a"]
    (shared / "b" / "y.py").write_text("from specring.shared import errors\n")
    assert folder_cycle(shared_folder_imports(shared)) is None


def module_imports(root: Path, rooms=ROOMS) -> dict[str, dict[str, list[str]]]:
    """``module -> imported module -> ["path:line", ...]`` among the modules of ``rooms`` under ``root`` (dotted
    names without ``specring.``; a package is its ``__init__``), from every import, function-local, relative and
    ``if TYPE_CHECKING`` ones included; ``from PACKAGE import NAME`` is an import of the module ``PACKAGE.NAME``
    when there is one, else of ``PACKAGE``."""
    modules = {}
    for room in rooms:
        for path in sorted((root / room).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, list[str]]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
                module = ".".join(x for x in (base, node.module or "") if x).removeprefix("specring.")
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            for t in dict.fromkeys(t.removeprefix("specring.") for t in targets):
                if t in modules and t != name:
                    graph.setdefault(name, {}).setdefault(t, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """No module circle anywhere in the rooms (issue 26), counting the imports a module makes only inside a function
    or for type checking: each module can be read knowing only the modules below it."""
    graph = module_imports(REPO)
    cycle = folder_cycle(graph)
    where = [f"  {a} -> {b}: {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "modules in a circle: " + " -> ".join(cycle or []) + "\n" + "\n".join(where)


def test_the_module_walker_sees_a_circle_through_a_lazy_import(tmp_path):
    (tmp_path / "shared" / "p").mkdir(parents=True)
    (tmp_path / "shared" / "p" / "__init__.py").write_text("def f():\n    from specring.shared.p.q import g\n")
    (tmp_path / "shared" / "p" / "q.py").write_text("from specring.shared.p import f\n")
    (tmp_path / "shared" / "r.py").write_text("from specring.shared.p import q\n")
    graph = module_imports(tmp_path, rooms=("shared",))
    assert graph["shared.r"] == {"shared.p.q": ["shared/r.py:1"]}
    assert folder_cycle(graph) == ["shared.p", "shared.p.q", "shared.p"]

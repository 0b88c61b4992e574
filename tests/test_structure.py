"""The shape of the tree: the package graph against docs/ARCHITECTURE.md, file sizes, test hygiene.

The allowed graph is the `## Rooms` table of docs/ARCHITECTURE.md (`| package | job | may import |`,
"may import" lists rooms in backticks, or `—` for none). Every room is a subpackage `halfmoon.<room>`
(the folder halfmoon/<room>/), except `halfmoon` itself: the SDK, the package's own modules and the
generated `halfmoon.v1`. Imports are read with `ast` from every .py file of every room (inside
functions too). Nothing else is installed: the one namespace is checked too.
"""

from __future__ import annotations

import ast
import os
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
TESTS = ROOT / "tests"
MAX_LINES = 600
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
SKIP_DIRS = {"tests", "build", "dist", "node_modules", "__pycache__"}
NONE_CELL = "—"


class Edge(NamedTuple):
    """`src` imports `dst`, first seen at `where` (path:line)."""

    src: str
    dst: str
    where: str


# ---------------------------------------------------------------- reading the tree and the table


PACKAGE = ROOT / "halfmoon"
SDK = "halfmoon"  # the room of halfmoon's own modules and of halfmoon.v1
STUBS = "v1"


def packages() -> list[str]:
    """The rooms: the subpackages of halfmoon/ (the generated stubs are the SDK's), and the SDK."""
    return sorted({SDK, *(p.parent.name for p in PACKAGE.glob("*/__init__.py") if p.parent.name != STUBS)})


def room_files(room: str) -> Iterator[Path]:
    """The .py files of a room: its folder, or for the SDK halfmoon/*.py and halfmoon/v1/."""
    if room != SDK:
        yield from source_files(PACKAGE / room)
        return
    yield from sorted(PACKAGE.glob("*.py"))
    yield from source_files(PACKAGE / STUBS)


def room_of(module: str, rooms: set[str]) -> str | None:
    """The room an absolute module name is in (`halfmoon.engine.model` -> `engine`), or None
    when it is not Halfmoon's."""
    parts = module.split(".")
    if parts[0] != SDK:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in rooms else SDK


def test_room_of() -> None:
    rooms = {"engine", "core", SDK}
    assert room_of("halfmoon.engine.model", rooms) == "engine"
    assert room_of("halfmoon.v1.generation_pb2", rooms) == SDK
    assert room_of("halfmoon", rooms) == SDK
    assert room_of("engine.model", rooms) is None  # not ours: another distribution's top level


def test_nothing_but_halfmoon_is_installed_at_the_top() -> None:
    """One namespace: no package of the repository's root besides halfmoon/ (and tests/)."""
    tops = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in {"halfmoon", "tests"})
    assert not tops, f"top-level packages outside halfmoon/ (users' environments would collide): {tops}"


def source_files(under: Path) -> Iterator[Path]:
    """Every .py file below `under`, in sorted order, skipping hidden, build and test folders."""
    for folder, dirs, files in os.walk(under):
        dirs[:] = sorted(d for d in dirs
                         if not (d.startswith(".") or d in SKIP_DIRS or d.endswith(".egg-info")))
        yield from (Path(folder) / f for f in sorted(files) if f.endswith(".py"))


def imported_modules(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) of every import, at any depth; relative imports skipped."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def observed_edges() -> list[Edge]:
    """One Edge per (package, imported package) pair, at its first occurrence."""
    names = set(packages())
    first: dict[tuple[str, str], str] = {}
    for src in sorted(names):
        for path in room_files(src):
            tree = ast.parse(path.read_text(), filename=str(path))
            for module, line in imported_modules(tree):
                dst = room_of(module, names)
                if dst is not None and dst != src:
                    first.setdefault((src, dst), f"{path.relative_to(ROOT)}:{line}")
    return [Edge(s, d, w) for (s, d), w in sorted(first.items())]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rooms_table(text: str) -> dict[str, set[str]]:
    """package -> packages it may import, from the `| package | job | may import |` table."""
    lines = text.splitlines()
    header = next((i for i, ln in enumerate(lines)
                   if ln.lstrip().startswith("|") and [c.lower() for c in _cells(ln)]
                   == ["package", "job", "may import"]), None)
    assert header is not None, "docs/ARCHITECTURE.md has no `| package | job | may import |` table"
    table: dict[str, set[str]] = {}
    for line in lines[header + 2:]:  # past the header and its |---| separator
        if not line.lstrip().startswith("|"):
            break
        package_cell, _, may_import = _cells(line)
        package = package_cell.strip("`")
        names = set(re.findall(r"`([^`]+)`", may_import))
        assert names or may_import == NONE_CELL, (
            f"room {package!r}: 'may import' must list packages in backticks or be {NONE_CELL!r}, "
            f"got {may_import!r}")
        assert package not in table, f"room {package!r} has two rows"
        table[package] = names
    assert table, "the rooms table has no rows"
    return table


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a path [a, b, ..., a], or None. Depth-first, in sorted order (deterministic)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.fixture(scope="module")
def table() -> dict[str, set[str]]:
    return rooms_table(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return observed_edges()


def _listing(edges: list[Edge]) -> str:
    return "\n".join(f"  {e.src} -> {e.dst}  ({e.where})" for e in edges)


# ---------------------------------------------------------------- the checker itself


TOY = """
intro

| package | job | may import |
|---|---|---|
| `low` | bottom | — |
| `mid` | middle | `low` |
| `top` | top | `low`, `mid` |

after
"""


def test_the_table_parser_reads_backticks_and_the_none_cell() -> None:
    assert rooms_table(TOY) == {"low": set(), "mid": {"low"}, "top": {"low", "mid"}}


def test_the_table_parser_rejects_a_cell_without_backticks() -> None:
    with pytest.raises(AssertionError, match="backticks"):
        rooms_table(TOY.replace("| `low`, `mid` |", "| low, mid |"))


def test_cycles_are_found_and_a_dag_has_none() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_inside_functions_are_seen_and_relative_ones_are_not() -> None:
    tree = ast.parse("import a.b\ndef f():\n    from c.d import e\nfrom . import g\n")
    assert [m for m, _ in imported_modules(tree)] == ["a.b", "c.d"]


# ---------------------------------------------------------------- the package graph


def test_every_package_has_a_row(table: dict[str, set[str]]) -> None:
    missing = sorted(set(packages()) - set(table))
    assert not missing, f"packages without a row in the rooms table of docs/ARCHITECTURE.md: {missing}"


def test_the_table_names_only_its_own_rooms(table: dict[str, set[str]]) -> None:
    unknown = sorted({n for names in table.values() for n in names} - set(table))
    assert not unknown, f"'may import' names rooms that have no row: {unknown}"


def test_every_row_is_a_package(table: dict[str, set[str]]) -> None:
    stale = sorted(set(table) - set(packages()))
    assert not stale, f"rooms table rows with no package in the repo: {stale}"


def test_every_import_is_allowed_by_the_table(table: dict[str, set[str]], edges: list[Edge]) -> None:
    bad = [e for e in edges if e.dst not in table.get(e.src, set())]
    assert not bad, f"imports the rooms table does not allow:\n{_listing(bad)}"


def test_the_package_graph_has_no_cycle(table: dict[str, set[str]], edges: list[Edge]) -> None:
    graph = {room: set(names) for room, names in table.items()}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"import cycle {' -> '.join(cycle or [])}; the observed edges on it:\n"
        + _listing([e for e in edges if e.src in (cycle or []) and e.dst in (cycle or [])]))


# ---------------------------------------------------------------- file sizes


# One door per third-party seam: the grammar engine is engine/grammar.py's alone (the sampler's
# neighbour, where constraint state lives), and the shapes clients send constraints in are the
# request surface's (api/structured.py), never the Conductor's scheduling.
SOLE_IMPORTERS = {"llguidance": {"halfmoon/engine/grammar.py"}}
SURFACE_NAMES = {"response_format": "halfmoon/api", "structured_outputs": "halfmoon/api"}
# Tool calling is the request surface's too: the families' call formats and parsers, the chat
# templates with tools and the tools' shapes are imported by nothing outside it but the command
# line (`serve --tool-call-parser`'s choices).
SURFACE_MODULES = {"halfmoon.api.tools", "halfmoon.api.tool_formats", "halfmoon.api.chat", "halfmoon.api.tool_stream"}


def test_the_grammar_engine_has_one_door() -> None:
    for package, allowed in SOLE_IMPORTERS.items():
        users = set()
        for room in packages():
            for path in room_files(room):
                tree = ast.parse(path.read_text(), filename=str(path))
                if any(m == package or m.startswith(package + ".") for m, _ in imported_modules(tree)):
                    users.add(str(path.relative_to(ROOT)))
        assert users == allowed, f"{package} is imported by {sorted(users)}; only {sorted(allowed)} may"


def test_constraint_shapes_are_read_by_the_request_surface_only() -> None:
    for name, room in SURFACE_NAMES.items():
        readers = {str(path.relative_to(ROOT)) for r in packages() for path in room_files(r)
                   if f'"{name}"' in path.read_text() and not str(path.relative_to(ROOT)).startswith(room)}
        assert not readers, f"{name!r} is read outside {room}: {sorted(readers)}"


def test_tool_calling_lives_in_the_request_surface() -> None:
    outside = set()
    for room in packages():
        for path in room_files(room):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(("halfmoon/api/", "halfmoon/cli/")):
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            outside |= {f"{rel} imports {m}" for m, _ in imported_modules(tree) if m in SURFACE_MODULES}
    assert not outside, sorted(outside)
    for module in SURFACE_MODULES:  # each exists (a renamed module would make this check vacuous)
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module


def test_no_source_file_is_over_600_lines() -> None:
    long = [(str(p.relative_to(ROOT)), n) for p in source_files(ROOT)
            if not p.name.endswith(GENERATED) and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"source files over {MAX_LINES} lines (split them): {long}"


# ---------------------------------------------------------------- test hygiene


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[-1].startswith("test_")


def imported_test_modules(tree: ast.AST, package: str) -> Iterator[tuple[str, int]]:
    """(module, line) of each test module `tree` imports; `package` resolves relative imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if _is_test_module(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            if _is_test_module(module):
                yield module, node.lineno
            yield from ((f"{module}.{a.name}", node.lineno) for a in node.names
                        if _is_test_module(a.name))


def test_the_test_import_finder() -> None:
    tree = ast.parse("from tests.a.test_b import x\nimport test_c\nfrom tests.a import test_d\n"
                     "from .test_e import y\nfrom tests.a.conftest import z\nfrom tests.a import helper\n")
    assert [m for m, _ in imported_test_modules(tree, "tests.a")] == [
        "tests.a.test_b", "test_c", "tests.a.test_d", "tests.a.test_e"]


def test_no_test_module_imports_another() -> None:
    found = []
    for path in _test_files():
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        for module, line in imported_test_modules(ast.parse(path.read_text()), package):
            found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not found, "test modules import test modules (move the helper to conftest.py or a " \
                      "non-test_ module):\n" + "\n".join(found)


def _sleep_calls(tree: ast.AST) -> Iterator[ast.Call]:
    """Calls of `time.sleep(...)`, and of `sleep(...)` where it was imported from time."""
    bare = any(isinstance(n, ast.ImportFrom) and n.module == "time"
               and any(a.name == "sleep" and a.asname is None for a in n.names) for n in ast.walk(tree))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "sleep" and isinstance(f.value, ast.Name)
                and f.value.id == "time") or (bare and isinstance(f, ast.Name) and f.id == "sleep"):
            yield node


def _comment_lines(path: Path) -> set[int]:
    with path.open("rb") as f:
        return {t.start[0] for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT}


def test_every_sleep_in_tests_says_why() -> None:
    """A sleep is the thing under test, or the poll interval of a bounded wait: the comment on
    its line says which. Synchronisation waits on a condition (tests/waiting.py) instead."""
    bare = []
    for path in _test_files():
        comments = _comment_lines(path)
        for call in _sleep_calls(ast.parse(path.read_text())):
            if not comments & set(range(call.lineno, (call.end_lineno or call.lineno) + 1)):
                bare.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not bare, "time.sleep without a comment saying why (wait on a condition instead):\n" \
                     + "\n".join(bare)

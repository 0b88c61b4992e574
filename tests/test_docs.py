"""The documented commands run from a fresh clone: every repository file a command or code span of
README.md and docs/*.md names exists, every `python -m` module and `halfmoon` (bench) command
they name is one, every relative link resolves, and no file reaches outside the repository
into a sibling `shared` folder.

Only code is read (fenced and indented blocks, inline code spans) plus Markdown links, never
prose; a path counts when it starts at one of the repository's top-level entries (`bench/`,
`docs/`, `helm/`, ...), so `--out sweep/` or `/tmp/cm1.json` (where a command writes, or a file
of the reader's) are not checked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from halfmoon.cli.bench import BENCHMARKS
from halfmoon.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
TOP = sorted(p.name for p in ROOT.iterdir() if not p.name.startswith("."))
FENCE = re.compile(r"^(```|~~~)")
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a repository path: a top-level entry, then path characters (a trailing dot or comma is prose)
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")(?:/[\w.*-]+)*/?)")
MODULE = re.compile(r"python3? -m ([\w.]+)")
# `halfmoon CMD [NAME]` where a command starts: a line's start, after a prompt, a pipe or `&&`
HALFMOON = re.compile(r"(?:^\s*|[;&|(]\s*|\$ )halfmoon ([a-z][\w-]*)(?: ([a-z][\w-]*))?")


class Snippet(NamedTuple):
    """A piece of code of a document, and where it starts."""

    text: str
    where: str


def code(path: Path) -> Iterator[Snippet]:
    """The fenced blocks, indented blocks (4 spaces, outside lists' continuation is not told
    apart: an indented prose line holds no path-like code anyway) and inline spans of `path`."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        where = f"{path.relative_to(ROOT)}:{number}"
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            yield Snippet(line, where)
        else:
            yield from (Snippet(m.group(1), where) for m in INLINE.finditer(line))


def named_paths(snippet: Snippet) -> Iterator[str]:
    for m in PATH.finditer(snippet.text):
        path = m.group(1).rstrip(".")
        if "kubectl" in snippet.text and path.startswith("deploy/"):
            continue  # `kubectl ... deploy/NAME`: a Kubernetes Deployment, not this folder
        if "/" in path or (ROOT / path).is_file():  # a bare word like `bench` or `sim` is a command
            yield path


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def module_exists(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def snippets() -> list[Snippet]:
    return [s for doc in DOCS for s in code(doc)]


def test_the_docs_hold_commands_to_check() -> None:
    found = [p for s in snippets() for p in named_paths(s)]
    assert "halfmoon/bench/data/sample_trace.jsonl" in found and len(found) > 100


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = sorted({f"{s.where}: {p}" for s in snippets() for p in named_paths(s) if not exists(p)})
    assert not missing, "documented paths that are not in the repository:\n" + "\n".join(missing)


def test_every_python_module_the_docs_run_exists() -> None:
    runs = [(s.where, m.group(1)) for s in snippets() for m in MODULE.finditer(s.text)]
    assert runs, "no `python -m` command found: the extractor is broken"
    missing = [f"{where}: python -m {name}" for where, name in runs
               if not module_exists(name) and name.split(".")[0] in TOP]
    assert not missing, "\n".join(missing)


def test_every_halfmoon_command_the_docs_run_exists() -> None:
    calls = [(s.where, m.group(1), m.group(2)) for s in snippets() for m in HALFMOON.finditer(s.text)]
    assert any(c == "bench" for _, c, _ in calls)
    bad = [f"{where}: halfmoon {cmd}" for where, cmd, _ in calls if cmd not in COMMANDS]
    bad += [f"{where}: halfmoon bench {name}" for where, cmd, name in calls
            if cmd == "bench" and name is not None and name not in BENCHMARKS]
    assert not bad, "\n".join(bad)


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), start=1):
            for m in LINK.finditer(line):
                target = m.group(1).split("#")[0]
                if target and not re.match(r"[a-z]+:", target) and not (doc.parent / target).exists():
                    broken.append(f"{doc.relative_to(ROOT)}:{number}: {m.group(1)}")
    assert not broken, "\n".join(broken)


def repository_files() -> Iterator[Path]:
    """Every file of the checkout, hidden folders (.git, .venv), caches and build outputs skipped."""
    skip = {"__pycache__", "build", "dist", "node_modules"}
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if path.is_file() and not any(p.startswith(".") or p in skip or p.endswith(".egg-info") for p in parts):
            yield path


def test_no_file_reaches_outside_the_repository() -> None:
    outside = b".." + b"/shared"  # spelled in two so that this file does not name it
    hits = [str(p.relative_to(ROOT)) for p in repository_files() if outside in p.read_bytes()]
    assert not hits, f"files naming {outside.decode()} (outside the repository): {hits}"

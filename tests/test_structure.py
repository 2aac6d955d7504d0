"""The shape of the source: no import circle in any package, no module over 400 lines.

Read from the files (nothing is imported), over every package's src/. An import counts wherever
it stands: inside a function (a lazy import that closes a circle is a circle postponed) and under
`if TYPE_CHECKING:` (two modules that need each other's types are one concern split badly).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("packages/*/src"))
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of this repository that `name` imports."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_package_has_an_import_circle():
    known = modules()
    assert len(SOURCES) >= 5 and "diloco.spec" in known and "diloco_replica.diloco" in known
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "diloco.schema" in graph["diloco.spec"]  # the graph sees relative imports
    found = circles(graph)
    shown = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(shown)


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.parent.name)
def test_no_module_over_400_lines(src):
    over = {}
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            over[rel] = lines
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"


def test_every_replica_image_shown_is_of_the_replica_version_released():
    """An example or a guide that names the replica's image names this version of it: an older
    tag is stopped by the replica's version check (exit 78) the first time a user copies it."""
    import re
    import tomllib

    version = tomllib.loads((ROOT / "packages/replica/pyproject.toml").read_text())["project"]["version"]
    shown = {}
    for path in [*ROOT.glob("examples/**/*"), *ROOT.glob("docs/*.md"), *ROOT.glob("packages/*/README.md"),
                 ROOT / "README.md"]:
        if path.is_file() and path.suffix in (".toml", ".md", ".py", ".yaml", ".yml"):
            for tag in re.findall(r"diloco-replica:([0-9][\w.+-]*)", path.read_text()):
                shown.setdefault(tag, []).append(str(path.relative_to(ROOT)))
    assert shown and set(shown) == {version}, shown

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
    assert len(SOURCES) >= 5 and "diloco.spec.runspec" in known and "diloco_replica.loop.diloco" in known
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "diloco.spec.schema" in graph["diloco.spec.runspec"]  # the graph sees relative imports
    found = circles(graph)
    shown = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(shown)


def test_a_rounds_data_flows_one_way_the_repair_desk_reached_from_the_allreduce_only():
    """The reducer and the gatherer return what they did (a reduction, the shards found) and the
    all-reduce reads, keeps and repairs reduced shards: a step that reached the repair desk itself
    sent a round's values back into a module it had left (issue "Billion-parameter rounds")."""
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert {m for m, deps in graph.items() if "diloco_replica.round.steps.repairs" in deps} == {"diloco_replica.round.allreduce"}
    assert "diloco_replica.round.allreduce" not in graph["diloco_replica.round.steps.gather"] | graph["diloco_replica.round.steps.reduce"]


# The layers of each package, bottom to top: a module may import its own layer and those below,
# never one above (a module's layer is its longest prefix here). The folder tree is the diagram:
# core's top level holds the backend contract (the public modules a backend author imports), its
# sub-packages what core does with it; a round's driver (round.allreduce) sits above its steps
# (round.steps), which sit above the round's own state, I/O and layout (round).
LAYERS = {
    "diloco": [
        ["diloco.errors", "diloco.lazyexports"],
        ["diloco.inputs"],
        ["diloco.host"],
        ["diloco.shipping"],
        ["diloco.options", "diloco.records", "diloco.protocol", "diloco.request", "diloco.procgroup",
         "diloco.backendapi", "diloco.hookspecs", "diloco.submitting", "diloco.waiting"],
        ["diloco.store"],
        ["diloco.plugins"],
        ["diloco.spec"],
        ["diloco.bootstrap"],
        ["diloco.local"],
        ["diloco.runrecord"],
        ["diloco.supervise"],
        ["diloco.launching"],
        ["diloco.observe"],
        ["diloco.api", "diloco.cli", "diloco.__main__", "diloco"],
        ["diloco.testing"],
    ],
    "diloco_replica": [
        ["diloco_replica.transport"],
        ["diloco_replica.round"],
        ["diloco_replica.round.steps"],
        ["diloco_replica.round.allreduce"],
        ["diloco_replica.outer"],
        ["diloco_replica.records"],
        ["diloco_replica.exchange"],
        ["diloco_replica.loop"],
        ["diloco_replica.export", "diloco_replica.preload", "diloco_replica.torchrun", "diloco_replica.__main__",
         "diloco_replica"],
        ["diloco_replica.integrations"],
    ],
}


def layer_of(module: str) -> tuple[str, int] | None:
    """(package, layer index) of a module of diloco or diloco_replica, by its longest prefix in LAYERS."""
    package = module.split(".")[0]
    best = None
    for index, prefixes in enumerate(LAYERS.get(package, [])):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else (package, best[1])


def test_the_layer_finder_reads_the_longest_prefix():
    assert layer_of("diloco_replica.round.steps.reduce") == ("diloco_replica", 2)
    assert layer_of("diloco_replica.round.allreduce") == ("diloco_replica", 3)
    assert layer_of("diloco_replica.round.io") == ("diloco_replica", 1)
    assert layer_of("diloco") == ("diloco", 14) and layer_of("diloco.waiting") == ("diloco", 4)
    assert layer_of("diloco_eks.executor") is None


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_every_module_has_a_layer_and_imports_none_above_its_own(package):
    known = modules()
    mine = [name for name in known if name.split(".")[0] == package]
    assert len(mine) > 40
    unplaced = [name for name in mine if layer_of(name) is None]
    assert not unplaced, f"modules in no layer (add their sub-package to LAYERS): {unplaced}"
    upward = []
    for name in mine:
        here = layer_of(name)[1]
        for target in imports_of(name, known[name], known):
            there = layer_of(target)
            if there is not None and there[0] == package and there[1] > here:
                upward.append(f"{name} (layer {here}) imports {target} (layer {there[1]})")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


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


# Reaches into another package's private names, each for want of a public way, and why (a new one
# fails the test below: find the public way, or say here why there is none). `os._exit` is
# public API despite its name: a child process ending without running its parent's handlers.
PRIVATE_REACHES = {
    ("diloco.bootstrap.runner", "os._exit"): "the runner's watchdog ends the process at once (public, os docs)",
    ("diloco_replica.exchange.syncproc", "os._exit"): "a forked sync process ends without its parent's handlers (public)",
    ("diloco.local.warmstart", "os._exit"): "a forked replica that could not take its place ends without the template's "
                                      "handlers (public)",
    **{("diloco_modal.testing.call", x): "the stand-in sets the cluster info Modal's runtime sets in the SDK "
                                         "(no public setter)"
       for x in ("from modal import _cluster", "from modal import _clustered_functions")},
    ("diloco_modal.testing.rpc_functions", "d._experimental_group_size"): "a clustered function's size: the "
        "service's own proto field, which Modal names with a leading underscore",
    **{("diloco_modal.functions", x): "the secrets a deployed function holds: modal has no public reader"
       for x in ("synchronizer._translate_in", "synchronizer._translate_out", "raw._spec",
                 "modal.Secret._new_hydrated", "function._client", "function._client._stub",
                 "from modal._object import _get_environment_name")},
    **{("diloco_modal.calls", x): "a call's output without waiting: modal's public get() blocks or raises"
       for x in ("call._client", "call._client._stub")},
    ("diloco_modal.testing", "from modal.client import _Client"): "forgetting modal's cached client (stand-in)",
    **{("diloco_modal.testing.call", x): "the stand-in runs a function's Python body as Modal's runtime does"
       for x in ("synchronizer._translate_in", "synchronizer._translate_in(obj)._raw_f")},
    ("diloco_modal.testing.server", "server._server"): "the port grpclib's server bound (no public accessor)",
}


def private_reaches(name: str, path: Path) -> set[str]:
    """`x._name` (x not self, cls or super()) and `from m import _name` in module `name`, where
    `_name` is not one of the module's own names."""
    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            mine = isinstance(base, ast.Name) and base.id in ("self", "cls") or \
                isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
            if not mine and node.attr not in own:
                found.add(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            found |= {f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")}
    return found


def test_no_module_reaches_into_another_ones_private_names():
    """A private name is its module's own business: calling `sup._event` from the resizer, or
    reading `pool._max_workers` of a library's pool, ties two modules (or a library's version) together
    where nothing shows it. Reaches with no public way are listed, with why, in PRIVATE_REACHES."""
    found = {(name, x) for name, path in modules().items() for x in private_reaches(name, path)}
    assert found - set(PRIVATE_REACHES) == set(), sorted(found - set(PRIVATE_REACHES))
    assert set(PRIVATE_REACHES) - found == set(), "listed but gone: remove them from PRIVATE_REACHES"

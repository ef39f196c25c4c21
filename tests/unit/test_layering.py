"""Import direction: schemas depends on nothing of ours; workers only on schemas; the core
only on schemas and itself; nothing imports the shell but entry points (api, cli, up)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import REPO

OURS = ("schemas", "services", "workers", "tests", "bench")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in OURS}


RULES = [
    ("schemas", ("schemas",)),
    ("workers", ("schemas", "workers")),
    ("services/core", ("schemas", "services.core")),
]


@pytest.mark.parametrize("package,allowed", RULES, ids=[r[0] for r in RULES])
def test_import_direction(package, allowed):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, package
    bad = {
        f"{p.relative_to(REPO)} imports {name}"
        for p in files
        for name in imports_of(p)
        if not any(name == a or name.startswith(a + ".") for a in allowed)
    }
    assert not bad, sorted(bad)


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph(packages=("schemas", "services", "workers")) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in it: a function-level import is a
    dependency too); `from pkg import name` counts pkg.name where that is a module."""
    files = {_module_of(p): p for pkg in packages for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in files:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files}
        graph[mod] = deps - {mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    """No module of ours imports one that imports it back, directly or through others (a
    package's __init__ re-exporting its modules is the package, not a cycle)."""
    graph = _import_graph()
    for mod in graph:  # an __init__ importing its own submodules
        graph[mod] = {d for d in graph[mod] if not d.startswith(mod + ".")}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_workers_show_their_two_packages():
    """The openai adapter and the sim server are packages; no module of theirs is left flat."""
    flat = {p.name for p in (REPO / "workers").glob("*.py")}
    assert not {n for n in flat if n.startswith(("openai", "sim_", "vllm_", "upstream", "http_front"))}, flat
    for pkg, modules in (("openai", {"agent", "relays", "status", "upstream", "kv_events", "kv_zmq"}),
                         ("sim_server", {"http", "front", "formats", "requests", "pd"})):
        assert modules <= {p.stem for p in (REPO / "workers" / pkg).glob("*.py")}, pkg


def test_only_entry_points_import_the_shell():
    entry_points = {"services/api.py", "services/cli.py", "services/up.py"}
    bad = []
    for p in (REPO / "services").rglob("*.py"):
        rel = str(p.relative_to(REPO))
        if rel.startswith("services/shell/") or rel in entry_points:
            continue
        if any(n.startswith("services.shell") for n in imports_of(p)):
            bad.append(rel)
    assert not bad


def test_the_core_reads_no_clock_and_no_global_rng():
    forbidden = ("time.time", "time.monotonic", "time.perf_counter", "datetime.now", "random.random(", "random.choice(",
                 "random.randint(", "import asyncio", "import nats", "import redis")
    for p in (REPO / "services" / "core").rglob("*.py"):
        text = p.read_text()
        for f in forbidden:
            assert f not in text, f"{p.relative_to(REPO)} uses {f}"


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from services.shell.router import RouterService\nimport workers.agent\n")
    assert imports_of(bad) == {"services.shell.router", "workers.agent"}


# The router's parts (services/shell/router.py's docstring has the table): which other shell
# modules each may import. Calls go one way, so no part reaches back into one that calls it.
SHELL_PARTS = {
    "handle": set(),
    "state": {"bus", "ledger", "metrics", "handle"},
    "journal": {"state"},
    "intake": {"state", "handle"},
    "relay": {"state", "handle"},
    "upkeep": {"state", "ledger"},
    "recovery": {"state", "handle", "upkeep"},
    "admin": {"state", "recovery"},
    "leadership": {"state", "handle", "intake"},
    "dispatch": {"state", "handle", "ledger", "recovery", "upkeep"},
    "fold": {"state", "ledger", "relay", "recovery", "upkeep"},
    "liveness": {"state", "recovery", "admin", "upkeep", "leadership"},
    "bus": set(), "ledger": set(), "metrics": set(),
}
SHELL_MAX_LINES = 400


def shell_modules() -> dict[str, Path]:
    return {p.stem: p for p in (REPO / "services" / "shell").glob("*.py") if p.stem != "__init__"}


def test_every_shell_module_is_a_known_part_and_imports_only_the_parts_below_it():
    modules = shell_modules()
    assert set(modules) == set(SHELL_PARTS) | {"router"}, "a new shell module needs its row in SHELL_PARTS"
    bad = []
    for name, allowed in SHELL_PARTS.items():
        for imported in imports_of(modules[name]):
            if imported.startswith("services.shell."):
                part = imported.split(".")[2]
                if part not in allowed:
                    bad.append(f"shell/{name}.py imports shell/{part}.py")
    assert not bad, bad


def test_each_part_is_one_class_in_a_module_of_at_most_400_lines():
    for name, path in shell_modules().items():
        text = path.read_text()
        assert len(text.splitlines()) <= SHELL_MAX_LINES, f"services/shell/{name}.py has {len(text.splitlines())} lines"
        tree = ast.parse(text)
        assert ast.get_docstring(tree), f"services/shell/{name}.py says nothing about what it owns"
        classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        if name not in ("state", "handle", "bus", "ledger", "metrics"):  # state and handle hold small helper types too
            assert len(classes) == 1, f"services/shell/{name}.py defines {classes}: one part, one class"

"""Import direction: schemas depends on nothing of ours; workers only on schemas; the core
only on schemas and itself; nothing imports the shell but entry points (api, cli, up)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
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
    "state": {"bus", "ledger", "metrics"},
    "journal": {"state"},
    "intake": {"state"},
    "relay": {"state"},
    "upkeep": {"state", "ledger"},
    "recovery": {"state", "upkeep"},
    "admin": {"state", "recovery"},
    "leadership": {"state", "intake"},
    "dispatch": {"state", "ledger", "recovery", "upkeep"},
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
        if name not in ("state", "bus", "ledger", "metrics"):  # state also holds the request types
            assert len(classes) == 1, f"services/shell/{name}.py defines {classes}: one part, one class"

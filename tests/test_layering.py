"""Import direction: schemas depends on nothing of ours; workers only on schemas; the core
only on schemas and itself; nothing imports the shell but entry points (api, cli, up)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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

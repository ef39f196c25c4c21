"""The test tree: `tests/unit/` (pure: no servers, no processes; laid out as the packages
are, unit/services/core/ for services/core/ and so on; `pytest tests/unit` runs alone on a
machine without a nats-server or redis-server) and `tests/integration/` (real
NATS, Redis and `flexlb` processes; its fixtures are in tests/integration/conftest.py).
Each test is marked by its folder (`-m unit`, `-m integration`); golden payloads and the
recorded journal are in tests/golden/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        kind = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        if kind in ("unit", "integration"):
            item.add_marker(getattr(pytest.mark, kind))

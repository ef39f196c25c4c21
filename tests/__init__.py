"""The test tree (tests/conftest.py says how it is laid out)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the repository root, wherever a test file sits

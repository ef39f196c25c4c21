"""Pipeline scorers: one per file, found by its `name` (services/core/pipeline/__init__.py)."""

"""Pipeline filters: one per file, found by its `name` (services/core/pipeline/__init__.py);
what two of them share is here."""

from __future__ import annotations

from services.core.policies.protocol import PolicyParams


class FactorParams(PolicyParams):
    factor: float = 3.0

    def validate(self) -> "FactorParams":
        if not self.factor > 1:
            raise ValueError(f"filter: factor must be > 1, got {self.factor!r}")
        return self


def within_factor_of_average(values: list[float], factor: float) -> list[bool]:
    """Whether each value is within `factor` x their average (every one, when the average is 0)."""
    avg = sum(values) / len(values) if values else 0.0
    return [not (avg > 0 and v > factor * avg) for v in values]

"""Golden journals (tests/golden/journals/, written by bench/golden_journals.py with the code
of their commit): the core's calls in seeded virtual-time runs, shipped defaults in both
engine modes and every other routing policy and batcher. Replayed through today's core, every
decision must come out as recorded: a change meant to leave scheduling as it was (a refactor
of the core, its policies, batchers or parameters) shows here if it did not."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from schemas import messages as m
from services.core.journal import replay

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "journals"
FILES = sorted(GOLDEN.glob("*.jsonl.gz"))


def test_every_shipped_policy_and_batcher_has_a_golden_journal():
    configs = set()
    for path in FILES:
        with gzip.open(path, "rb") as f:
            first = m.decode(f.readline()).payload
        assert first.op == "config", path
        cfg = first.args["config"]
        configs.add((cfg["prefill_policy"], cfg["decode_policy"], cfg["batcher"]))
    from services.core.batchers import BATCHERS
    from services.core.policies import DECODE_POLICIES, PREFILL_POLICIES

    assert {p for p, _, _ in configs} == set(PREFILL_POLICIES)
    assert {d for _, d, _ in configs} == set(DECODE_POLICIES)
    assert {b for _, _, b in configs} == set(BATCHERS)


@pytest.mark.parametrize("path", FILES, ids=[p.name.removesuffix(".jsonl.gz") for p in FILES])
def test_a_golden_journal_replays_to_identical_decisions(path):
    with gzip.open(path, "rb") as f:
        envs = [m.decode(line) for line in f if line.strip()]
    r = replay(envs)
    assert r.errors == [] and r.gaps == []
    assert r.first_divergence is None, r.first_divergence
    assert r.decisions > 50 and r.matched == r.decisions

"""Golden journals (tests/golden/journals/, written by bench/golden_journals.py with the code
of their commit): the core's calls in seeded virtual-time runs, shipped defaults in both
engine modes and every other routing policy and batcher. Replayed through today's core, every
decision must come out as recorded: a change meant to leave scheduling as it was (a refactor
of the core, its policies, batchers or parameters) shows here if it did not."""

from __future__ import annotations

import gzip

import pytest

from schemas import messages as m
from services.core.journal import replay
from tests import REPO

GOLDEN = REPO / "tests" / "golden" / "journals"
FILES = sorted(GOLDEN.glob("*.jsonl.gz"))


def test_every_shipped_policy_decides_in_a_golden_journal_and_every_batcher_runs_in_one():
    decided, batchers = set(), set()
    for path in FILES:
        with gzip.open(path, "rb") as f:
            for line in f:
                rec = m.decode(line).payload
                if rec.op == "config":
                    batchers.add(rec.args["config"]["batcher"])
                elif rec.op == "admit":
                    decided |= {(stage, policy) for stage, policy, *_ in rec.out.get("decisions", [])}
    from services.core.batchers import BATCHERS
    from services.core.policies import DECODE_POLICIES, PREFILL_POLICIES

    assert {p for s, p in decided if s == "prefill"} == set(PREFILL_POLICIES)
    assert {p for s, p in decided if s == "decode"} == set(DECODE_POLICIES)
    assert batchers == set(BATCHERS)


@pytest.mark.parametrize("path", FILES, ids=[p.name.removesuffix(".jsonl.gz") for p in FILES])
def test_a_golden_journal_replays_to_identical_decisions(path):
    with gzip.open(path, "rb") as f:
        envs = [m.decode(line) for line in f if line.strip()]
    r = replay(envs)
    assert r.errors == [] and r.gaps == []
    assert r.first_divergence is None, r.first_divergence
    assert r.decisions > 50 and r.matched == r.decisions

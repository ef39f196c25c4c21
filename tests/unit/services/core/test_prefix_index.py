"""Prefix index: the cached-tokens rule, the exact index fed by KV events (sequence gaps,
duplicates, restarts, snapshots), the approximate index with a fake clock, and property tests
of both against naive reference models."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import KvAllCleared, KvBlocksRemoved, KvBlocksStored, KvSnapshot
from services.core.prefix_index import (
    APPLIED,
    NEEDS_RESYNC,
    STALE,
    ApproximatePrefixIndex,
    IndexUpdate,
    PrefixIndex,
    cached_tokens,
)

MS = 1_000_000


# ------------------------------------------------------------------ builders
def stored(seq: int, *hashes: int, worker: str = "w0", boot: str = "b0") -> KvBlocksStored:
    return KvBlocksStored(worker_id=worker, boot_id=boot, kv_seq=seq, block_hashes=list(hashes))


def removed(seq: int, *hashes: int, worker: str = "w0", boot: str = "b0") -> KvBlocksRemoved:
    return KvBlocksRemoved(worker_id=worker, boot_id=boot, kv_seq=seq, block_hashes=list(hashes))


def cleared(seq: int, worker: str = "w0", boot: str = "b0") -> KvAllCleared:
    return KvAllCleared(worker_id=worker, boot_id=boot, kv_seq=seq)


def snapshot(seq: int, *hashes: int, worker: str = "w0", boot: str = "b0") -> KvSnapshot:
    return KvSnapshot(worker_id=worker, boot_id=boot, kv_seq=seq, block_hashes=list(hashes))


def make_index(*events) -> tuple[PrefixIndex, list[str]]:
    index = PrefixIndex()
    return index, [index.apply(e).status for e in events]


# ------------------------------------------------------------------ cached_tokens
@pytest.mark.parametrize(
    "matched,block,prompt,expected",
    [
        (4, 256, 1000, 744),  # full hit: the last block is always computed
        (3, 256, 1000, 768),
        (0, 16, 10, 0),
        (0, 256, 1000, 0),
        (2, 16, 33, 32),
        (2, 16, 32, 16),  # reaches the prompt exactly: cut by one block
        (1, 16, 16, 0),
        (1, 16, 10, 0),  # prompt shorter than a block: never negative
    ],
    ids=["full-hit-744", "partial-768", "no-match", "no-match-long", "below-prompt", "exact-prompt",
         "one-block-prompt", "short-prompt"],
)
def test_cached_tokens(matched, block, prompt, expected):
    assert cached_tokens(matched, block, prompt) == expected


@pytest.mark.parametrize("args", [(1, 0, 10), (-1, 16, 10), (1, 16, -1)],
                         ids=["zero-block", "neg-matched", "neg-prompt"])
def test_cached_tokens_rejects_bad_input(args):
    with pytest.raises(ValueError):
        cached_tokens(*args)


def test_full_prefix_hit_on_a_1000_token_prompt_with_4_blocks_of_256_gives_744():
    index, _ = make_index(stored(1, 101, 102, 103, 104))
    prompt = [101, 102, 103, 104]
    assert index.match(prompt) == {"w0": 4}
    assert cached_tokens(index.match(prompt)["w0"], 256, 1000) == 744


# ------------------------------------------------------------------ exact index: stories
EXACT_CASES = [
    # id, events, statuses, prompt, expected match, awaiting resync after
    ("stored-blocks-match", [stored(1, 10, 11, 12)], [APPLIED], [10, 11, 12, 13], {"w0": 3}, False),
    ("chained-prefix-0-1-3-matches-2", [stored(1, 10, 11, 13)], [APPLIED], [10, 11, 12, 13], {"w0": 2}, False),
    ("first-block-missing-no-match", [stored(1, 11, 12)], [APPLIED], [10, 11, 12], {}, False),
    ("removed-block-cuts-the-prefix", [stored(1, 10, 11, 12), removed(2, 11)], [APPLIED, APPLIED],
     [10, 11, 12], {"w0": 1}, False),
    ("removing-unknown-hash-is-harmless", [stored(1, 10), removed(2, 99)], [APPLIED, APPLIED], [10], {"w0": 1}, False),
    ("all-cleared-drops-everything", [stored(1, 10, 11), cleared(2)], [APPLIED, APPLIED], [10, 11], {}, False),
    ("duplicate-is-stale", [stored(1, 10), removed(2, 10), stored(1, 10)], [APPLIED, APPLIED, STALE],
     [10], {}, False),
    ("gap-keeps-blocks-and-awaits", [stored(1, 10), stored(3, 11)], [APPLIED, NEEDS_RESYNC], [10, 11],
     {"w0": 1}, True),
    ("events-while-awaiting-are-ignored", [stored(1, 10), stored(3, 11), stored(4, 11)],
     [APPLIED, NEEDS_RESYNC, NEEDS_RESYNC], [10, 11], {"w0": 1}, True),
    ("snapshot-repairs", [stored(1, 10), stored(3, 11), snapshot(3, 10, 11, 12)],
     [APPLIED, NEEDS_RESYNC, APPLIED], [10, 11, 12], {"w0": 3}, False),
    ("events-continue-after-snapshot", [stored(1, 10), stored(3, 11), snapshot(3, 10, 11), stored(4, 12)],
     [APPLIED, NEEDS_RESYNC, APPLIED, APPLIED], [10, 11, 12], {"w0": 3}, False),
    ("snapshot-older-than-the-gap-is-stale", [stored(1, 10), stored(5, 11), snapshot(3, 10, 11)],
     [APPLIED, NEEDS_RESYNC, STALE], [10, 11], {"w0": 1}, True),
    ("snapshot-older-than-an-ignored-event-is-stale",
     [stored(1, 10), stored(3, 11), stored(4, 12), snapshot(3, 10, 11)],
     [APPLIED, NEEDS_RESYNC, NEEDS_RESYNC, STALE], [10, 11], {"w0": 1}, True),
    ("snapshot-replaces-wholesale", [stored(1, 10, 11), snapshot(1, 12)], [APPLIED, APPLIED], [10], {}, False),
    ("snapshot-older-than-applied-is-stale", [stored(1, 10), stored(2, 11), snapshot(1, 10)],
     [APPLIED, APPLIED, STALE], [10, 11], {"w0": 2}, False),
    ("snapshot-ahead-jumps", [stored(1, 10), snapshot(7, 20), stored(8, 21)], [APPLIED, APPLIED, APPLIED],
     [20, 21], {"w0": 2}, False),
    ("first-event-late-join", [stored(5, 10)], [NEEDS_RESYNC], [10], {}, True),
    ("first-event-snapshot", [snapshot(7, 10), stored(8, 11)], [APPLIED, APPLIED], [10, 11], {"w0": 2}, False),
    ("restart-drops-old-blocks", [stored(1, 10, 11), stored(1, 12, boot="b1")], [APPLIED, APPLIED],
     [10, 11], {}, False),
    ("restart-mid-stream-awaits", [stored(1, 10), stored(4, 12, boot="b1")], [APPLIED, NEEDS_RESYNC],
     [10], {}, True),
    ("restart-with-snapshot", [stored(1, 10), snapshot(4, 12, boot="b1")], [APPLIED, APPLIED], [12], {"w0": 1}, False),
    ("retired-boot-is-stale", [stored(1, 10), stored(1, 11, boot="b1"), stored(2, 12)], [APPLIED, APPLIED, STALE],
     [11, 12], {"w0": 1}, False),
    ("two-workers-different-depths", [stored(1, 10, 11, 12), stored(1, 10, worker="w1"), stored(1, 11, worker="w2")],
     [APPLIED, APPLIED, APPLIED], [10, 11, 12], {"w0": 3, "w1": 1}, False),
]


@pytest.mark.parametrize("events,statuses,prompt,expected,awaiting", [c[1:] for c in EXACT_CASES],
                         ids=[c[0] for c in EXACT_CASES])
def test_exact_index(events, statuses, prompt, expected, awaiting):
    index, got = make_index(*events)
    assert got == statuses
    assert index.match(prompt) == expected
    assert index.needs_resync("w0") is awaiting


@pytest.mark.parametrize(
    "events,reason",
    [
        ([stored(1, 10), stored(2, 10), stored(3, 10), stored(6, 11)], "gap: expected kv_seq 4, got 6"),
        ([stored(1, 10), stored(3, 11, boot="b1")], "restart: boot b0 -> b1: expected kv_seq 1 or a snapshot, got 3"),
        ([stored(4, 10)], "first event: expected kv_seq 1 or a snapshot, got 4"),
        ([stored(1, 10), stored(3, 11), stored(4, 12)], "awaiting snapshot: gap: expected kv_seq 2, got 3"),
    ],
    ids=["gap", "restart", "late-join", "still-awaiting"],
)
def test_needs_resync_says_why(events, reason):
    index = PrefixIndex()
    *head, last = events
    for e in head:
        index.apply(e)
    assert index.apply(last) == IndexUpdate(NEEDS_RESYNC, "w0", reason)


def test_remove_worker_forgets_it_but_not_the_others():
    index, _ = make_index(stored(1, 10, 11), stored(1, 10, 11, worker="w1"))
    index.remove_worker("w0")
    assert index.match([10, 11]) == {"w1": 2}
    assert index.workers() == {"w1"} and index.num_blocks("w0") == 0 and index.boot_id("w0") is None
    index.remove_worker("w1")
    index.remove_worker("never-seen")
    assert index.match([10]) == {} and index.workers() == set()
    assert index._workers == {} and index.block_counts == {}  # nothing of a removed worker left behind
    # a removed worker's next event is a first event again: kv_seq 2 means we joined late
    assert index.apply(stored(2, 12)).status == NEEDS_RESYNC


def test_num_blocks_workers_and_boot_id():
    index, _ = make_index(stored(1, 10, 11, 11), stored(1, 12, worker="w1", boot="x"))
    assert index.num_blocks("w0") == 2 and index.num_blocks("w1") == 1 and index.num_blocks("nope") == 0
    assert index.workers() == {"w0", "w1"}
    assert index.boot_id("w1") == "x" and not index.needs_resync("nope")


@pytest.mark.parametrize("event", [stored(0, 1), cleared(-1), snapshot(-1)],
                         ids=["stored-0", "cleared-neg", "snapshot-neg"])
def test_malformed_kv_seq_is_an_error(event):
    with pytest.raises(ValueError, match="kv_seq"):
        PrefixIndex().apply(event)


def test_retired_boots_are_bounded():
    index = PrefixIndex(max_retired_boots_per_worker=1)
    for boot in ("b0", "b1", "b2"):
        assert index.apply(stored(1, 10, boot=boot)).status == APPLIED
    assert index.apply(stored(2, 10, boot="b1")).status == STALE  # remembered
    # b0 was forgotten: a redelivery from it reads as a restart, visible through boot_id()
    assert index.apply(stored(1, 10, boot="b0")).status == APPLIED and index.boot_id("w0") == "b0"


# ------------------------------------------------------------------ approximate index
def test_approximate_record_and_match():
    index = ApproximatePrefixIndex(ttl_ms=1000)
    index.record("w0", [10, 11, 12], now_ns=0)
    index.record("w1", [10, 13], now_ns=0)
    assert index.match([10, 11, 12, 14], now_ns=0) == {"w0": 3, "w1": 1}
    assert index.match([10, 13], now_ns=0) == {"w0": 1, "w1": 2}
    assert index.match([14, 10], now_ns=0) == {} and index.match([], now_ns=0) == {}


@pytest.mark.parametrize(
    "records,match_at_ms,expected",
    [
        ([(0, [10, 11])], 999, {"w0": 2}),
        ([(0, [10, 11])], 1000, {}),  # expires exactly ttl after the last record
        ([(0, [10, 11]), (500, [10])], 1200, {"w0": 1}),  # block 10 refreshed, block 11 expired
        ([(0, [10, 11]), (500, [10, 11])], 1499, {"w0": 2}),
        ([(0, [10]), (500, [11])], 1200, {}),  # block 11 alive but block 10 expired: no prefix
    ],
    ids=["before-ttl", "at-ttl", "refresh-one", "refresh-all", "lead-expired"],
)
def test_approximate_ttl_with_a_fake_clock(records, match_at_ms, expected):
    index = ApproximatePrefixIndex(ttl_ms=1000)
    for t_ms, hashes in records:
        index.record("w0", hashes, now_ns=t_ms * MS)
    assert index.match([10, 11], now_ns=match_at_ms * MS) == expected


def test_approximate_expiry_is_swept_lazily():
    index = ApproximatePrefixIndex(ttl_ms=1000)
    index.record("w0", [10, 11], now_ns=0)
    index.record("w1", [10], now_ns=900 * MS)
    assert index.match([10], now_ns=1500 * MS) == {"w1": 1}
    assert index.num_blocks("w0") == 2  # a query does not mutate
    index.record("w0", [20], now_ns=1500 * MS)  # recording sweeps that worker's expired entries
    assert index.num_blocks("w0") == 1
    index.expire(now_ns=2000 * MS)
    assert index.workers() == {"w0"} and index.num_blocks("w1") == 0
    assert index._hash_to_worker_ids == {20: {"w0"}}


def test_approximate_capacity_evicts_least_recent_and_keeps_leading_blocks():
    index = ApproximatePrefixIndex(ttl_ms=1000, max_blocks_per_worker=4)
    index.record("w0", [10, 11, 12], now_ns=0)
    index.record("w0", [20, 21], now_ns=1)  # over capacity: the oldest, deepest block 12 goes
    assert index.num_blocks("w0") == 4
    assert index.match([10, 11, 12], now_ns=2) == {"w0": 2} and index.match([20, 21], now_ns=2) == {"w0": 2}
    index.record("w0", [30, 31, 32, 33, 34, 35], now_ns=3)  # longer than capacity: its first 4 blocks stay
    assert index.num_blocks("w0") == 4 and index.match([30, 31, 32, 33, 34, 35], now_ns=3) == {"w0": 4}


def test_approximate_clock_stepping_back_keeps_entries_in_time_order():
    index = ApproximatePrefixIndex(ttl_ms=1000)
    index.record("w0", [10], now_ns=0)
    index.record("w0", [12], now_ns=500 * MS)
    index.record("w0", [11], now_ns=100 * MS)  # wall clock stepped back: stamped at 500 ms, counted
    assert index.num_clock_regressions == 1
    # block 10 has expired, so entry times are checked: 11 lives until 1500 ms, not 1100 ms
    assert index.match([11], now_ns=1200 * MS) == {"w0": 1} and index.match([11], now_ns=1500 * MS) == {}
    index.record("w1", [10], now_ns=0)  # per worker: another worker's earlier time is no regression
    assert index.num_clock_regressions == 1


def test_approximate_remove_worker():
    index = ApproximatePrefixIndex()
    index.record("w0", [10], now_ns=0)
    index.record("w1", [10], now_ns=0)
    index.remove_worker("w0")
    index.remove_worker("never-seen")
    assert index.match([10], now_ns=0) == {"w1": 1} and index.workers() == {"w1"}


@pytest.mark.parametrize("kw", [{"ttl_ms": 0}, {"max_blocks_per_worker": 0}], ids=["ttl-0", "capacity-0"])
def test_approximate_rejects_bad_parameters(kw):
    with pytest.raises(ValueError):
        ApproximatePrefixIndex(**kw)


# ------------------------------------------------------------------ property: exact index vs a reference
WORKERS = ("w0", "w1", "w2", "w3")
HASH_UNIVERSE = 6
MAX_RETIRED = 2  # small, so that forgetting old boots is exercised too


@dataclass
class TrueWorker:
    """What a worker really holds; `history[boot][seq]` is its block set after event `seq`."""

    worker_id: str
    num_boots: int = 0
    boot_id: str = ""
    kv_seq: int = 0
    published: list = field(default_factory=list)  # every event it ever published (for redelivery)

    def restart(self, history: dict) -> None:
        self.boot_id = f"{self.worker_id}-b{self.num_boots}"
        self.num_boots += 1
        self.kv_seq = 0
        history[self.boot_id] = [frozenset()]

    def blocks(self, history: dict) -> frozenset:
        return history[self.boot_id][self.kv_seq]


@dataclass
class Belief:
    """What the index should believe about one worker. When in sync, its blocks are not
    tracked here but looked up in the truth: `history[boot][applied_seq]`."""

    boot_id: str
    applied_seq: int = 0  # the truth's kv_seq our belief corresponds to (in sync)
    max_seen_seq: int = 0
    awaiting: bool = False
    frozen: frozenset = frozenset()  # the blocks kept while awaiting a snapshot
    retired: list = field(default_factory=list)

    def blocks(self, history: dict) -> frozenset:
        return self.frozen if self.awaiting else history[self.boot_id][self.applied_seq]


def reference_deliver(beliefs: dict, history: dict, event) -> str:
    """The rules, as the issue states them, over the truth's history (with the index's bound of
    MAX_RETIRED remembered boots). Returns the status the index must report."""
    is_snapshot = isinstance(event, KvSnapshot)
    b = beliefs.get(event.worker_id)
    if b is not None and event.boot_id != b.boot_id and event.boot_id in b.retired:
        return STALE
    if b is None or event.boot_id != b.boot_id:
        retired = [] if b is None else (b.retired + [b.boot_id])[-MAX_RETIRED:]
        b = beliefs[event.worker_id] = Belief(boot_id=event.boot_id, retired=retired)
        if is_snapshot or event.kv_seq == 1:
            b.applied_seq = b.max_seen_seq = event.kv_seq
            return APPLIED
        b.awaiting, b.frozen, b.max_seen_seq = True, frozenset(), event.kv_seq
        return NEEDS_RESYNC
    if is_snapshot:
        if event.kv_seq < b.max_seen_seq:
            return STALE
        b.applied_seq = b.max_seen_seq = event.kv_seq
        b.awaiting = False
        return APPLIED
    if b.awaiting:
        b.max_seen_seq = max(b.max_seen_seq, event.kv_seq)
        return NEEDS_RESYNC
    if event.kv_seq <= b.applied_seq:
        return STALE
    if event.kv_seq > b.applied_seq + 1:
        b.frozen = history[b.boot_id][b.applied_seq]
        b.awaiting, b.max_seen_seq = True, event.kv_seq
        return NEEDS_RESYNC
    b.applied_seq = b.max_seen_seq = event.kv_seq
    return APPLIED


def naive_match(block_sets: dict, prompt: list) -> dict:
    out = {}
    for worker_id, blocks in block_sets.items():
        n = 0
        while n < len(prompt) and prompt[n] in blocks:
            n += 1
        if n:
            out[worker_id] = n
    return out


hash_lists = st.lists(st.integers(0, HASH_UNIVERSE - 1), min_size=1, max_size=4)
# kind -> weight. "lost_*": published but not delivered now (a later "redeliver" may bring it,
# late); "resync": the shell answering needs_resync with a snapshot of the TRUE worker state.
ACTION_WEIGHTS = {"op": 6, "lost_op": 2, "redeliver": 3, "snapshot": 1, "lost_snapshot": 2, "resync": 3,
                  "restart": 2, "router_restart": 1, "remove_worker": 1}
ACTION_KINDS = [kind for kind, weight in ACTION_WEIGHTS.items() for _ in range(weight)]
actions = st.tuples(
    st.integers(1, len(WORKERS)),  # how many workers take part
    st.lists(
        st.tuples(
            st.sampled_from(ACTION_KINDS),
            st.integers(0, len(WORKERS) - 1),  # which worker (modulo how many take part)
            st.sampled_from(["store", "remove", "clear"]),
            hash_lists,
            st.integers(0, 4),  # how far back a redelivery reaches
        ),
        min_size=20,  # hypothesis lists average max(2 × min_size, min_size + 5): ~40 actions, not ~5
        max_size=100,
    ),
)
prompts = st.lists(st.lists(st.integers(0, HASH_UNIVERSE - 1), max_size=6), max_size=6)


def run_exact_model(num_workers, action_list, prompt_list):
    def index_factory():
        return PrefixIndex(max_retired_boots_per_worker=MAX_RETIRED)

    history: dict = {}  # boot id -> [block set after seq 0, 1, 2, ...]
    truth = {w: TrueWorker(w) for w in WORKERS}
    for t in truth.values():
        t.restart(history)
    index = index_factory()
    beliefs: dict = {}
    singletons = [[h] for h in range(HASH_UNIVERSE)]

    def deliver(event):
        expected = reference_deliver(beliefs, history, event)
        got = index.apply(event)
        assert (got.status, got.worker_id) == (expected, event.worker_id), event

    for kind, worker_number, op, hashes, num_back in action_list:
        w = WORKERS[worker_number % num_workers]
        t = truth[w]
        if kind in ("op", "lost_op"):
            blocks = t.blocks(history)
            t.kv_seq += 1
            if op == "store":
                event, blocks = stored(t.kv_seq, *hashes, worker=w, boot=t.boot_id), blocks | set(hashes)
            elif op == "remove":
                event, blocks = removed(t.kv_seq, *hashes, worker=w, boot=t.boot_id), blocks - set(hashes)
            else:
                event, blocks = cleared(t.kv_seq, worker=w, boot=t.boot_id), frozenset()
            history[t.boot_id].append(frozenset(blocks))
            t.published.append(event)
            if kind == "op":
                deliver(event)
        elif kind == "redeliver" and t.published:  # duplicates, and late arrivals of lost events
            deliver(t.published[-1 - num_back % len(t.published)])
        elif kind in ("snapshot", "lost_snapshot") or (kind == "resync" and index.needs_resync(w)):
            # of the TRUE state, stamped with the last kv_seq published, as the worker answers RequestKvSnapshot
            event = snapshot(t.kv_seq, *sorted(t.blocks(history)), worker=w, boot=t.boot_id)
            t.published.append(event)
            if kind != "lost_snapshot":
                deliver(event)
        elif kind == "restart":
            t.restart(history)
        elif kind == "router_restart":
            index, beliefs = index_factory(), {}
        elif kind == "remove_worker":
            index.remove_worker(w)
            beliefs.pop(w, None)

        believed = {worker_id: b.blocks(history) for worker_id, b in beliefs.items()}
        assert index.workers() == set(beliefs)
        for worker_id in WORKERS:
            b = beliefs.get(worker_id)
            assert index.needs_resync(worker_id) == (b is not None and b.awaiting)
            assert index.num_blocks(worker_id) == len(believed.get(worker_id, ()))
            assert index.block_counts.get(worker_id, 0) == index.num_blocks(worker_id)  # the routing hot path reads this
        for prompt in singletons + prompt_list + [hashes]:
            assert index.match(prompt) == naive_match(believed, prompt), prompt

    # Truth, not rules: a fresh snapshot of every worker's true state, if applied, makes the
    # index exactly right; it is applied unless the worker's live boot was retired here.
    for w, t in truth.items():
        got = index.apply(snapshot(t.kv_seq, *sorted(t.blocks(history)), worker=w, boot=t.boot_id))
        b = beliefs.get(w)
        assert got.status == (STALE if b is not None and t.boot_id in b.retired and t.boot_id != b.boot_id else APPLIED)
    true_sets = {w: t.blocks(history) for w, t in truth.items() if index.boot_id(w) == t.boot_id}
    for prompt in singletons + prompt_list:
        assert {w: n for w, n in index.match(prompt).items() if w in true_sets} == naive_match(true_sets, prompt)


@settings(max_examples=500, deadline=None)
@given(actions, prompts)
def test_exact_index_agrees_with_the_reference_on_random_event_streams(workers_and_actions, prompt_list):
    run_exact_model(*workers_and_actions, prompt_list)


# ------------------------------------------------------------------ property: approximate index vs a naive model
APPROX_TTL_MS = 10
APPROX_CAPACITY = 5
approx_actions = st.lists(
    st.tuples(st.sampled_from(["record"] * 4 + ["expire", "remove_worker"]), st.sampled_from(WORKERS[:3]),
              st.lists(st.integers(0, HASH_UNIVERSE - 1), max_size=APPROX_CAPACITY + 2),
              # whole ms, so TTL boundaries are hit; now and then the clock steps back
              st.integers(-3, 2 * APPROX_TTL_MS).map(lambda ms: ms * MS)),
    min_size=10,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(approx_actions, prompts)
def test_approximate_index_agrees_with_a_naive_model(action_list, prompt_list):
    index = ApproximatePrefixIndex(ttl_ms=APPROX_TTL_MS, max_blocks_per_worker=APPROX_CAPACITY)
    ttl_ns = APPROX_TTL_MS * MS
    model: dict[str, list] = {}  # worker id -> [(hash, recorded ns)], least recently recorded first
    now_ns = 0
    for kind, w, hashes, advance_ns in action_list:
        now_ns += advance_ns
        if kind == "record":
            index.record(w, hashes, now_ns)
            entries = model.get(w, [])
            stamp_ns = max([now_ns] + [t for _, t in entries])  # a clock step back is not a rejuvenation
            entries = [(h, t) for h, t in entries if stamp_ns - t < ttl_ns]
            for h in reversed(hashes):
                entries = [(x, t) for x, t in entries if x != h] + [(h, stamp_ns)]
            model[w] = entries[-APPROX_CAPACITY:]
        elif kind == "expire":
            index.expire(now_ns)
            model = {x: [(h, t) for h, t in es if now_ns - t < ttl_ns] for x, es in model.items()}
        else:
            index.remove_worker(w)
            model.pop(w, None)
        for x in WORKERS:
            assert index.num_blocks(x) == len(model.get(x, []))
        live = {x: {h for h, t in es if now_ns - t < ttl_ns} for x, es in model.items()}
        for prompt in [[h] for h in range(HASH_UNIVERSE)] + prompt_list + [hashes]:
            assert index.match(prompt, now_ns) == naive_match(live, prompt), prompt

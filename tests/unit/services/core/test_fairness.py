"""The admission queue (services/core/fairness.py): stories with a fake clock, and properties.

Each story offers requests at given times and pops with given capacity; the expected order
is written out. Times are in ms on a fake clock (the queue gets ns)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.fairness import (
    Dispatched,
    FairnessParams,
    FairQueue,
    FairRequest,
    Queued,
    Refused,
    class_of_priority,
)

MS = 1_000_000


def make_request(request_id: str, tenant: str = "a", cls: str = "standard", input_tokens: int = 100,
                 output_tokens: int = 0) -> FairRequest:
    return FairRequest(request_id=request_id, tenant=tenant, priority_class=cls, num_input_tokens=input_tokens,
                       num_est_output_tokens=output_tokens)


def drain(q: FairQueue, now_ms: float, can_take: int = 1_000) -> list[str]:
    return [d.request_id for d in q.pop(int(now_ms * MS), can_take)]


@pytest.mark.parametrize("priority,cls", [(None, "standard"), (1, "sheddable"), (29, "sheddable"), (30, "standard"),
                                          (50, "standard"), (69, "standard"), (70, "critical"), (100, "critical")])
def test_numeric_priority_bands(priority, cls):
    assert class_of_priority(priority) == cls


@pytest.mark.parametrize("priority", [0, 101])
def test_numeric_priority_out_of_range_fails(priority):
    with pytest.raises(ValueError):
        class_of_priority(priority)


@pytest.mark.parametrize("params", [dict(w_out=-1), dict(starvation_bound_ms=0), dict(max_queued_per_class=(1, 1)),
                                    dict(max_queued_total=0), dict(tenant_weights={"a": 0}), dict(default_weight=-1),
                                    dict(max_queue_wait_ms=(1, 0, 1))],
                         ids=["w_out", "bound", "class_limits", "total", "tenant_weight", "default_weight", "max_wait"])
def test_bad_params_fail_naming_the_field(params):
    with pytest.raises(ValueError, match="fairness"):
        FairnessParams(**params)


# (id, offers as (request id, class, offered at ms), pops as (at ms, can_take), expected dispatch order)
PRIORITY_STORIES = [
    ("critical_first", [("s1", "sheddable", 0), ("st1", "standard", 0), ("c1", "critical", 0)], [(1, 3)],
     ["c1", "st1", "s1"]),
    ("fcfs_within_class_one_tenant", [("st1", "standard", 0), ("st2", "standard", 1), ("st3", "standard", 2)], [(3, 3)],
     ["st1", "st2", "st3"]),
    ("capacity_limits_each_pop", [("c1", "critical", 0), ("c2", "critical", 0), ("st1", "standard", 0)], [(1, 1), (2, 1), (3, 1)],
     ["c1", "c2", "st1"]),
    # standard waits 4.9 s behind critical: within the 5 s bound, critical still goes first
    ("within_bound_no_promotion", [("st1", "standard", 0), ("c1", "critical", 100), ("c2", "critical", 200)], [(4_900, 1)],
     ["c1"]),
    # beyond the bound, the starved class is served once, then critical again
    ("starved_standard_served_once", [("st1", "standard", 0), ("st2", "standard", 0), ("c1", "critical", 100),
                                      ("c2", "critical", 100)], [(5_001, 3)], ["st1", "c1", "c2"]),
    # both lower classes starved: the one waiting longest first, each once per bound
    ("two_starved_classes", [("s1", "sheddable", 0), ("st1", "standard", 1_000), ("c1", "critical", 1_000),
                             ("c2", "critical", 1_000), ("c3", "critical", 1_000)], [(6_500, 4)],
     ["s1", "st1", "c1", "c2"]),
]


@pytest.mark.parametrize("offers,pops,expected", [s[1:] for s in PRIORITY_STORIES], ids=[s[0] for s in PRIORITY_STORIES])
def test_strict_priority_with_starvation_bound(offers, pops, expected):
    q = FairQueue()
    for rid, cls, at_ms in offers:
        assert isinstance(q.offer(make_request(rid, cls=cls), at_ms * MS), Queued)
    got = []
    for at_ms, can_take in pops:
        got += drain(q, at_ms, can_take)
    assert got == expected


def test_starvation_dispatch_says_so_and_the_clock_restarts():
    q = FairQueue(FairnessParams(starvation_bound_ms=1_000))
    for i in range(3):
        q.offer(make_request(f"st{i}"), 0)
    for i in range(30):
        q.offer(make_request(f"c{i}", cls="critical"), 0)
    # one dispatch per 100 ms; standard gets one per bound, not one per pop once it is starved
    records = [d for t in range(1, 23) for d in q.pop(t * 100 * MS, 1)]
    standard = [(d.request_id, d.reason) for d in records if d.priority_class == "standard"]
    assert standard == [("st0", "starvation"), ("st1", "starvation")]  # at 1,100 ms and 2,200 ms
    assert all(d.reason == "priority" for d in records if d.priority_class == "critical")


def test_starvation_bound_is_a_setting_that_acts():
    def first_standard_at(bound_ms):
        q = FairQueue(FairnessParams(starvation_bound_ms=bound_ms))
        q.offer(make_request("st"), 0)
        for i in range(100):
            q.offer(make_request(f"c{i}", cls="critical"), 0)
        for t in range(1, 101):
            if q.pop(t * 100 * MS, 1)[0].request_id == "st":
                return t * 100
    assert first_standard_at(500) == 600
    assert first_standard_at(2_000) == 2_100


# VTC: (id, weights, w_out, offers as (request id, tenant, input, output), expected order)
VTC_STORIES = [
    # equal weights, equal sizes: alternate (ties by the head's arrival)
    ("equal_alternate", {}, 2.0, [("a1", "a", 100, 0), ("a2", "a", 100, 0), ("a3", "a", 100, 0), ("b1", "b", 100, 0),
                                  ("b2", "b", 100, 0)], ["a1", "b1", "a2", "b2", "a3"]),
    # b's requests cost a fifth of a's: b gets five for each of a's
    ("by_tokens_not_requests", {}, 2.0, [("a1", "a", 500, 0), ("a2", "a", 500, 0)] + [(f"b{i}", "b", 100, 0) for i in range(1, 7)],
     ["a1", "b1", "b2", "b3", "b4", "b5", "a2", "b6"]),
    # weight 2 gets twice the tokens
    ("weights", {"a": 2.0}, 2.0, [(f"a{i}", "a", 100, 0) for i in range(1, 5)] + [(f"b{i}", "b", 100, 0) for i in range(1, 3)],
     ["a1", "b1", "a2", "a3", "b2", "a4"]),
    # output tokens cost w_out: a's 100+2x100 = 300 vs b's 100 each
    ("output_weighted", {}, 2.0, [("a1", "a", 100, 100), ("a2", "a", 100, 100)] + [(f"b{i}", "b", 100, 0) for i in range(1, 5)],
     ["a1", "b1", "b2", "b3", "a2", "b4"]),
    ("output_free_when_w_out_0", {}, 0.0, [("a1", "a", 100, 100), ("a2", "a", 100, 100)] + [(f"b{i}", "b", 100, 0) for i in range(1, 3)],
     ["a1", "b1", "a2", "b2"]),
]


@pytest.mark.parametrize("weights,w_out,offers,expected", [s[1:] for s in VTC_STORIES], ids=[s[0] for s in VTC_STORIES])
def test_vtc_within_a_class(weights, w_out, offers, expected):
    q = FairQueue(FairnessParams(tenant_weights=weights, w_out=w_out))
    for i, (rid, tenant, n_in, n_out) in enumerate(offers):
        q.offer(make_request(rid, tenant, input_tokens=n_in, output_tokens=n_out), i)
    assert drain(q, 1_000) == expected


def test_dispatch_records_counters_and_cost():
    q = FairQueue(FairnessParams(tenant_weights={"a": 4.0}))
    q.offer(make_request("a1", "a", input_tokens=100, output_tokens=50), 0)
    (d,) = q.pop(7 * MS, 1)
    assert (d.tenant, d.priority_class, d.reason) == ("a", "standard", "priority")
    assert (d.counter_before, d.cost_tokens, d.weight, d.counter_after) == (0.0, 200.0, 4.0, 50.0)
    assert d.waited_ns == 7 * MS


def test_returning_tenant_gets_no_banked_credit():
    q = FairQueue()
    # b is served alone for a while; a was idle all that time
    for i in range(10):
        q.offer(make_request(f"b{i}", "b"), 0)
    assert len(drain(q, 1, 5)) == 5  # b's counter: 500
    q.offer(make_request("a1", "a"), 2 * MS)
    q.offer(make_request("a2", "a"), 2 * MS)
    assert q.counters("standard")["a"] == 500.0  # lifted to the backlogged minimum, not 0
    # so a alternates with b instead of taking the next ten; lifted, it wins its first tie with
    # b (whose head is older): served next, then one request each
    assert drain(q, 3, 4) == ["a1", "b5", "b6", "a2"]


def test_tenant_returning_to_an_empty_class_is_lifted_to_the_last_one_out():
    q = FairQueue()
    q.offer(make_request("b1", "b", input_tokens=300), 0)
    drain(q, 1)
    q.offer(make_request("a1", "a"), 2 * MS)
    assert q.counters("standard")["a"] == 300.0


def test_a_returning_tenant_above_the_floor_keeps_its_counter():
    q = FairQueue()
    q.offer(make_request("a1", "a", input_tokens=1_000), 0)
    for i in range(1, 10):
        q.offer(make_request(f"b{i}", "b"), 0)
    assert drain(q, 1, 3) == ["a1", "b1", "b2"]  # a is idle with 1,000; b has 200
    q.offer(make_request("a2", "a"), 2 * MS)
    assert q.counters("standard") == {"a": 1_000.0, "b": 200.0}  # not lowered to b's
    assert drain(q, 3) == [f"b{i}" for i in range(3, 10)] + ["a2"]


def test_classes_keep_their_own_counters():
    q = FairQueue()
    q.offer(make_request("a1", "a", cls="critical", input_tokens=1_000), 0)
    drain(q, 1)
    assert q.counters("critical") == {"a": 1_000.0}
    assert q.counters("standard") == {}


@pytest.mark.parametrize("actual,counter_after", [(50, 200.0), (0, 100.0), (80, 260.0)], ids=["exact", "none", "more"])
def test_settle_corrects_the_counter(actual, counter_after):
    q = FairQueue()
    q.offer(make_request("a1", "a", input_tokens=100, output_tokens=50), 0)
    (d,) = q.pop(1, 1)
    s = q.settle(d, actual)
    assert (s.counter_before, s.counter_after) == (200.0, counter_after)
    assert q.counters("standard")["a"] == counter_after


def test_settle_changes_the_next_pick():
    def order_after_settle(actual):
        q = FairQueue()
        q.offer(make_request("a1", "a", input_tokens=100, output_tokens=500), 0)  # charged 1,100
        q.offer(make_request("a2", "a", input_tokens=300), 0)
        for i in range(3):
            q.offer(make_request(f"b{i}", "b", input_tokens=300), 0)
        (d,) = q.pop(1, 1)
        assert d.request_id == "a1"
        q.settle(d, actual)
        return drain(q, 3)
    assert order_after_settle(500) == ["b0", "b1", "b2", "a2"]
    assert order_after_settle(0) == ["b0", "a2", "b1", "b2"]  # a really cost 100


def test_settle_of_a_backlogged_tenant_reorders_it():
    q = FairQueue(FairnessParams(w_out=1.0))
    q.offer(make_request("a1", "a", input_tokens=100, output_tokens=400), 0)
    q.offer(make_request("a2", "a", input_tokens=100), 0)
    q.offer(make_request("b1", "b", input_tokens=300), 0)
    q.offer(make_request("b2", "b", input_tokens=300), 0)
    (d,) = q.pop(1, 1)  # a1: a's counter 500
    assert drain(q, 2, 1) == ["b1"]  # b (0) before a (500)
    q.settle(d, 0)  # a's counter 100, b's 300
    assert drain(q, 3) == ["a2", "b2"]


# (id, params, offers as (request id, tenant, class), expected outcome of each: "queued" or the refusal code)
BOUND_STORIES = [
    ("tenant_limit", dict(max_queued_per_tenant=2), [("a1", "a", "standard"), ("a2", "a", "standard"), ("a3", "a", "standard"),
                                                     ("b1", "b", "standard")], ["queued", "queued", "queue_full", "queued"]),
    ("class_limit", dict(max_queued_per_class=(8, 2, 8)), [("a1", "a", "standard"), ("b1", "b", "standard"),
                                                          ("c1", "c", "standard"), ("c2", "c", "critical")],
     ["queued", "queued", "queue_full", "queued"]),
    ("total_full_sheddable_refused", dict(max_queued_total=2), [("a1", "a", "standard"), ("b1", "b", "standard"),
                                                                ("s1", "c", "sheddable")], ["queued", "queued", "shed"]),
    ("total_full_none_sheddable", dict(max_queued_total=2), [("a1", "a", "standard"), ("b1", "b", "critical"),
                                                             ("c1", "c", "critical")], ["queued", "queued", "queue_full"]),
]


@pytest.mark.parametrize("params,offers,expected", [s[1:] for s in BOUND_STORIES], ids=[s[0] for s in BOUND_STORIES])
def test_bounds(params, offers, expected):
    q = FairQueue(FairnessParams(retry_after_ms=750, **params))
    got = []
    for rid, tenant, cls in offers:
        r = q.offer(make_request(rid, tenant, cls), 0)
        got.append("queued" if isinstance(r, Queued) else r.code)
        if isinstance(r, Refused):
            assert r.retry_after_ms == 750 and r.reason
    assert got == expected


def test_full_queue_sheds_the_newest_sheddable_first():
    q = FairQueue(FairnessParams(max_queued_total=3))
    for rid in ("s1", "s2"):
        q.offer(make_request(rid, "x", "sheddable"), 0)
    q.offer(make_request("st1", "y"), 0)
    r = q.offer(make_request("c1", "z", "critical"), 1)
    assert isinstance(r, Queued) and r.evicted is not None
    assert (r.evicted.request_id, r.evicted.code, r.evicted.retry_after_ms) == ("s2", "shed", 1_000)
    r = q.offer(make_request("st2", "y"), 2)
    assert r.evicted.request_id == "s1"
    r = q.offer(make_request("st3", "y"), 3)
    assert isinstance(r, Refused) and r.code == "queue_full"  # nothing sheddable left
    assert drain(q, 4) == ["c1", "st1", "st2"]


def test_expire_refuses_what_waited_too_long_per_class():
    q = FairQueue(FairnessParams(max_queue_wait_ms=(10_000, 3_000, 1_000)))
    q.offer(make_request("s1", "x", "sheddable"), 0)
    q.offer(make_request("st1", "y"), 0)
    q.offer(make_request("st2", "y"), 2_500 * MS)
    q.offer(make_request("c1", "z", "critical"), 0)
    assert q.expire(1_000 * MS) == []  # not more than the bound yet
    assert [(r.request_id, r.code) for r in q.expire(1_001 * MS)] == [("s1", "queue_timeout")]
    assert [r.request_id for r in q.expire(5_000 * MS)] == ["st1"]
    assert drain(q, 5_000) == ["c1", "st2"]
    assert q.expire(60_000 * MS) == []


def test_expiry_of_a_tenants_head_keeps_vtc_order():
    q = FairQueue(FairnessParams(max_queue_wait_ms=(1_000, 1_000, 1_000)))
    q.offer(make_request("a1", "a"), 0)
    q.offer(make_request("b1", "b"), 500 * MS)
    q.offer(make_request("a2", "a"), 600 * MS)
    assert [r.request_id for r in q.expire(1_100 * MS)] == ["a1"]
    assert drain(q, 1_100) == ["b1", "a2"]  # a's head went, so b1 (earlier than a2) first


def test_cancel_takes_a_queued_request_out_once():
    q = FairQueue()
    q.offer(make_request("a1", "a"), 0)
    q.offer(make_request("a2", "a"), 0)
    c = q.cancel("a1", "standard", 5 * MS)
    assert (c.request_id, c.waited_ns) == ("a1", 5 * MS)
    assert q.cancel("a1", "standard", 6 * MS) is None
    assert drain(q, 7) == ["a2"]


def test_offering_a_queued_request_again_fails():
    q = FairQueue()
    q.offer(make_request("a1"), 0)
    with pytest.raises(ValueError, match="already queued"):
        q.offer(make_request("a1"), 0)


# -- properties --

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.sampled_from("abcd"), st.sampled_from(["critical", "standard", "sheddable"]),
                  st.integers(1, 2_000), st.integers(0, 500)),
        st.tuples(st.just("pop"), st.integers(0, 4)),
        st.tuples(st.just("cancel"), st.integers(0, 200)),
        st.tuples(st.just("tick"), st.integers(1, 3_000)),
        st.tuples(st.just("expire")),
    ),
    max_size=200,
)


def run_ops(ops, params, settle_exact=True):
    """Apply ops; returns (offered ids, final outcome per id, records in order, queue, max counter spread seen)."""
    q = FairQueue(params)
    now_ms = 0
    offered, outcome, records = [], {}, []
    max_cost = {c: 0.0 for c in ("critical", "standard", "sheddable")}
    worst_spread = 0.0
    for op in ops:
        if op[0] == "offer":
            _, tenant, cls, n_in, n_out = op
            rid = f"r{len(offered)}"
            offered.append(rid)
            max_cost[cls] = max(max_cost[cls], q.cost_tokens(n_in, n_out) / params.weight_of(tenant))
            r = q.offer(make_request(rid, tenant, cls, n_in, n_out), now_ms * MS)
            records.append(r)
            if isinstance(r, Refused):
                outcome.setdefault(rid, []).append("refused")
            elif r.evicted is not None:
                outcome.setdefault(r.evicted.request_id, []).append("refused")
        elif op[0] == "pop":
            for d in q.pop(now_ms * MS, op[1]):
                records.append(d)
                outcome.setdefault(d.request_id, []).append("dispatched")
                if settle_exact:
                    records.append(q.settle(d, d.request.num_est_output_tokens))
        elif op[0] == "cancel" and offered:
            rid = offered[op[1] % len(offered)]
            for cls in ("critical", "standard", "sheddable"):
                c = q.cancel(rid, cls, now_ms * MS)
                if c is not None:
                    records.append(c)
                    outcome.setdefault(rid, []).append("cancelled")
        elif op[0] == "expire":
            for r in q.expire(now_ms * MS):
                records.append(r)
                outcome.setdefault(r.request_id, []).append("refused")
        elif op[0] == "tick":
            now_ms += op[1]
        for cls in ("critical", "standard", "sheddable"):
            counters = q.counters(cls)
            backlogged = [counters[t] for t in q.backlogged_tenants(cls)]
            if len(backlogged) > 1:
                spread = max(backlogged) - min(backlogged)
                assert spread <= max_cost[cls] + 1e-9, (cls, spread, max_cost[cls])
                worst_spread = max(worst_spread, spread)
    return offered, outcome, records, q


SMALL = FairnessParams(max_queued_per_tenant=6, max_queued_per_class=(8, 8, 8), max_queued_total=12,
                       starvation_bound_ms=2_000, max_queue_wait_ms=(9_000, 6_000, 3_000), tenant_weights={"a": 4.0, "c": 0.5})


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_request_ends_exactly_once_and_backlogged_counters_stay_within_one_cost(ops):
    offered, outcome, _, q = run_ops(ops, SMALL)
    tail = q.pop(10**15, 10**6)  # drain what is left
    for d in tail:
        outcome.setdefault(d.request_id, []).append("dispatched")
    assert q.num_queued() == 0
    for rid in offered:
        assert len(outcome.get(rid, [])) == 1, (rid, outcome.get(rid))
    assert set(outcome) == set(offered)


@settings(max_examples=100, deadline=None)
@given(OPS)
def test_the_same_calls_give_the_same_records(ops):
    *_, first, _ = run_ops(ops, SMALL)
    *_, again, _ = run_ops(ops, SMALL)

    def plain(r):
        return (type(r).__name__, r.request_id, getattr(r, "counter_after", None), getattr(r, "reason", None))
    assert [plain(r) for r in first] == [plain(r) for r in again]
    assert first == again


def test_records_are_typed():
    q = FairQueue()
    assert isinstance(q.offer(make_request("a1"), 0), Queued)
    assert all(isinstance(d, Dispatched) for d in q.pop(1, 1))

"""Configuration tells the truth: every parameter of every policy and batcher changes a decision.

One row per parameter (`ROWS`): a scenario, the smallest situation in which the parameter
matters, run once with the parameter at its default and once at an altered value; the two
decisions (a pick, a filter, which batch leaves when and with whom, what expires, whether a
request is admitted) must be the ones the row expects, and differ. A parameter that is
validated and documented but not read where it acts makes its row fail.

Where the parameter acts decides how its scenario is built:
- the scheduler reads cost-based's pending gate, kv-aware's KV gate and expected output, and
  slo-budget's TPOT hold (fed to cost-based's TPOT filter): those run end to end, from
  `RouterSettings(...).scheduler_config()` through `Scheduler.admit` with worker status and
  KV events (that path is where they were once validated and then ignored);
- everything a policy's `select` or a batcher's `poll` reads runs on the component built by
  `build_policy` / `build_batcher`, with hand-built candidates and queue items.

`test_the_table_covers_every_parameter` fails when a parameter (or a policy or batcher with a
new parameter struct) is added without a row; `test_settings_json_reaches_the_component` checks
that each parameter given as JSON in the settings arrives in the built component. Fake time in
integer nanoseconds, seeded RNGs, no sleeps, no network.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from schemas.messages import KvBlocksStored, WorkerStatusReported
from services.core.batchers import (
    BATCHERS,
    FixedWindowParams,
    PollResult,
    SloBudgetParams,
    WorkerLoad,
    build_batcher,
)
from services.core.policies import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    CacheAwareParams,
    Candidate,
    CostBasedParams,
    KvAwareParams,
    NoParams,
    RouteContext,
    build_policy,
)
from services.core.scheduler import AdmitRequest, Admitted, Scheduler
from services.core.view import WorkerInfo
from services.settings import RouterSettings
from services.settings import load as load_settings

MS = 1_000_000
BLOCK = 16  # tokens per KV block, the fleet's


# ------------------------------------------------------------------ builders: policies
def make_worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="pd_fusion", boot_id="b0", num_kv_blocks=10_000, num_free_kv_blocks=10_000)


def cand(worker_id: str, **kw: Any) -> Candidate:
    fields = dict(kv_total_tokens=160_000, kv_used_tokens=0, kv_available_tokens=160_000)
    fields.update(kw)
    return Candidate(worker=make_worker(worker_id), **fields)


def route(cands: list[Candidate], seed: int, slo_ttft_ms: float = 0.0) -> RouteContext:
    """A 1,000-token request (no SLO by default) choosing among `cands`, drawing from `seed`."""
    return RouteContext("r", 1000, 100, cands, 0, random.Random(seed), 1000 // BLOCK, slo_ttft_ms)


def pick(stage: str, name: str, params: dict[str, Any], cands: list[Candidate], slo_ttft_ms: float = 0.0) -> str | None:
    return build_policy(stage, name, params).select(route(cands, 0, slo_ttft_ms)).worker_id


def picks_over_seeds(stage: str, name: str, params: dict[str, Any], cands: list[Candidate],
                     num_seeds: int) -> list[str | None]:
    policy = build_policy(stage, name, params)
    return [policy.select(route(cands, seed)).worker_id for seed in range(num_seeds)]


# ------------------------------------------------------------------ builders: batchers
@dataclass(frozen=True)
class Item:
    """A queued request, as a batcher reads it (`Batchable`)."""

    request_id: str
    num_prompt_tokens: int = 10
    enqueued_ns: int = 0
    deadline_ns: int = 0  # TTFT deadline; 0: none
    kv_tokens: int = 0
    num_cached_tokens: int = 0
    tpot_target_ms: float = 0.0
    strict_deadline: bool = False


def item(rid: str, tokens: int = 10, t_ms: float = 0.0, deadline_ms: float = 0.0, tpot_target_ms: float = 0.0) -> Item:
    return Item(rid, tokens, round(t_ms * MS), round(deadline_ms * MS), tokens, tpot_target_ms=tpot_target_ms)


def predict_ms(batch) -> float:  # noqa: ANN001 - a PredictFn: 0.1 ms per uncached prompt token
    return sum(0.1 * (i.num_prompt_tokens - i.num_cached_tokens) for i in batch)


def load(max_batch_tokens: int = 0, inflight: int = 0, tpot_ms: float = 0.0, tpot_ms_per_request: float = 0.0) -> WorkerLoad:
    return WorkerLoad(max_batch_tokens=max_batch_tokens, free_kv_tokens=1 << 40, num_inflight_batches=inflight, wait_ms=0.0,
                      tpot_ms=tpot_ms, tpot_ms_per_request=tpot_ms_per_request)


def poll_after(name: str, params: dict[str, Any], items: list[Item], poll_ms: float, worker: WorkerLoad) -> tuple:
    """Queue `items`, poll once at `poll_ms`: ((reason, member ids) per batch, expired ids, unattainable ids)."""
    batcher = build_batcher(name, params, predict_ms)
    for it in items:
        batcher.add(it)
    res: PollResult = batcher.poll(round(poll_ms * MS), worker)
    assert not res.too_large
    return (tuple((b.reason, tuple(i.request_id for i in b.items)) for b in res.batches),
            tuple(i.request_id for i in res.expired), tuple(i.request_id for i in res.unattainable))


NOTHING = ((), (), ())  # a poll that dispatches, expires and refuses nothing


def batch(reason: str, *ids: str) -> tuple:
    return ((reason, ids),), (), ()


# ------------------------------------------------------------------ builders: the scheduler
def scheduler(**settings: Any) -> Scheduler:
    """The scheduler the router would build from these settings."""
    return Scheduler(RouterSettings(**settings).validate().scheduler_config(), id_prefix="r-test")


def status(worker_id: str, role: str = "pd_fusion", **kw: Any) -> WorkerStatusReported:
    fields = dict(block_size_tokens=BLOCK, num_kv_blocks=10_000, num_free_kv_blocks=10_000, max_batch_tokens=65_536,
                  max_seq_len_tokens=8192)
    fields.update(kw)
    return WorkerStatusReported(worker_id=worker_id, role=role, boot_id="b0", **fields)


def cached_prompt(s: Scheduler, worker_id: str, first_hash: int, num_tokens: int, kv_seq: int = 1) -> tuple[int, ...]:
    """A prompt's block hashes, every block already in `worker_id`'s prefix cache."""
    hashes = tuple(range(first_hash, first_hash + num_tokens // BLOCK))
    s.on_kv_event(KvBlocksStored(worker_id=worker_id, boot_id="b0", kv_seq=kv_seq, block_hashes=list(hashes)))
    return hashes


def outcome(result: Any) -> str:
    return "admitted" if isinstance(result, Admitted) else result.code


# ================================================================== scenarios
# Each takes {parameter: value} (the parameter under test, alone) and returns a decision.

# ------------------------------------------------------------------ cost-based, through the scheduler
def gate_high(param: dict) -> str:
    """w0 holds every block of the prompt (much cheaper there) and reports 40 running
    requests: below the gate at 64, above one at 32."""
    s = scheduler(prefill_policy="cost-based", prefill_policy_params=param, batcher="fixed-window")
    s.on_worker_event(status("w0", num_running_requests=40), 0)
    s.on_worker_event(status("w1"), 0)
    hashes = cached_prompt(s, "w0", 1, 3200)
    return s.admit(AdmitRequest("x", 3200, 10, hashes), 0).request.prefill_worker_id


def gate_hysteresis(param: dict) -> tuple[str, str]:
    """The gate (high 10) closes at 10 pending on w0; w0 then reports 7: reopened at
    10 x (1 - 0.15) = 8.5, still closed at 10 x (1 - 0.5) = 5."""
    s = scheduler(prefill_policy="cost-based", prefill_policy_params={"pending_gate_high": 10, **param},
                  batcher="fixed-window")
    s.on_worker_event(status("w0", num_running_requests=10), 0)
    s.on_worker_event(status("w1"), 0)
    first = s.admit(AdmitRequest("x", 3200, 10, cached_prompt(s, "w0", 1, 3200, kv_seq=1)), 0)
    s.on_worker_event(status("w0", num_running_requests=7), 1 * MS)
    second = s.admit(AdmitRequest("y", 3200, 10, cached_prompt(s, "w0", 1001, 3200, kv_seq=2)), 1 * MS)
    return first.request.prefill_worker_id, second.request.prefill_worker_id


def tpot_hold_routing(param: dict) -> str:
    """Colocated: w0 holds the prompt's blocks but decodes 50 requests (predicted TPOT with
    this one ~40 ms); w1 is idle. The request's TPOT target is 50 ms: a hold at 0.5 x 50 =
    25 ms would only park it on w0, so cost-based (its tpot_filter on) sends it to w1; without a
    hold, w0."""
    s = scheduler(prefill_policy="cost-based", prefill_policy_params={"tpot_filter": True}, batcher="slo-budget",
                  batcher_params=param)
    s.on_worker_event(status("w0", num_running_requests=50), 0)
    s.on_worker_event(status("w1"), 0)
    hashes = cached_prompt(s, "w0", 1, 3200)
    return s.admit(AdmitRequest("x", 3200, 10, hashes, slo_tpot_ms=50.0), 0).request.prefill_worker_id


def tpot_refuse_ratio(param: dict, finished_tpot_ms: float | None = None) -> str:
    """Held on w0 (its prefix cached there) whose TPOT with it is ~97 ms against a 100 ms
    target and a 0.9 hold; w1 slower. At its emergency point nobody can take it without
    holding it: refused with the ratio at 0, served on w0 at 1.1."""
    s = scheduler(batcher="slo-budget", batcher_params={"window_ms": 0, "tpot_headroom": 0.9, **param})
    for t in range(400):
        for w in ("w0", "w1"):
            s.on_worker_event(status(w, num_running_requests=60, num_free_kv_blocks=9_000,
                                     recent_step_ms=97.0 if w == "w0" else 160.0, max_seq_len_tokens=40960), t * 1_000_000)
    if finished_tpot_ms is not None:  # a request finished on w0 with this TPOT
        s.decode_model("w0").observe_tpot(97.0, finished_tpot_ms)
    hashes = cached_prompt(s, "w0", 1, 624)
    s.admit(AdmitRequest("x", 3300, 200, hashes, slo_ttft_ms=2000.0, slo_tpot_ms=100.0), 500_000_000)
    for k in range(200):
        res = s.tick(500_000_000 + k * 10_000_000)
        if res.failures:
            return res.failures[0].code
        if res.batches:
            return res.batches[0].worker_id
    return "held"


def give_way_tpot_ratio(param: dict) -> str:
    """As `tpot_refuse_ratio` at 1.1 (served on w0), where a request finished with a TPOT of
    97 ms: a ratio of 0.9 (finished over 90 ms: saturated) keeps the hold from giving way."""
    return tpot_refuse_ratio({"tpot_refuse_ratio": 1.1, **param}, finished_tpot_ms=97.0)


def give_way_prefill_ratio(param: dict) -> str:
    """As `give_way_tpot_ratio` at 0.9 (the gate closed: refused), the request cheap on w0 by
    any ratio above ~2.4 (its predicted prefill there ~236 ms against a 100 ms TPOT target) and
    its TPOT there (~97 ms) within 1.1 x: served on w0 with the ratio at 10, refused at 0."""
    return give_way_tpot_ratio({"give_way_tpot_ratio": 0.9, "give_way_cheap_tpot_ratio": 1.1, **param})


def give_way_cheap_tpot_ratio(param: dict) -> str:
    """As `give_way_prefill_ratio` at 10 (cheap): served on w0 only when its predicted TPOT
    there (~97 ms) is within the ratio x 100 ms (1.1), refused at 0."""
    return give_way_tpot_ratio({"give_way_tpot_ratio": 0.9, "give_way_prefill_ratio": 10.0, **param})


def tpot_filter(param: dict) -> str:
    """As tpot_hold_routing with the hold at 0.5: off (the default), w0's prefix wins; on, the filter leaves w0 out."""
    s = scheduler(prefill_policy="cost-based", prefill_policy_params=param, batcher="slo-budget",
                  batcher_params={"tpot_headroom": 0.5})
    s.on_worker_event(status("w0", num_running_requests=50), 0)
    s.on_worker_event(status("w1"), 0)
    hashes = cached_prompt(s, "w0", 1, 3200)
    return s.admit(AdmitRequest("x", 3200, 10, hashes, slo_tpot_ms=50.0), 0).request.prefill_worker_id


# ------------------------------------------------------------------ cost-based, select
# a: cheap prefill behind a 400 ms wait (TTFT 450); b: no wait, 500 ms prefill (TTFT 500).
SLO_PAIR = [cand("a", prefill_ms=50, wait_ms=400), cand("b", prefill_ms=500)]


# a: 800 of the prompt's 1,000 tokens cached, 100 ms prefill behind a 600 ms wait (TTFT 700);
# b: no cache, 500 ms prefill (400 of it for the 800 tokens a has cached), no wait (TTFT 500)
CACHE_PAIR = [cand("a", prefill_ms=100, wait_ms=600, num_cached_tokens=800), cand("b", prefill_ms=500)]


def prefill_weight(param: dict) -> str | None:
    """0 (cost-based's own): the sooner first token, b. 1: b's 400 ms of extra prefill count
    again (900 against 700), a."""
    return pick("prefill", "cost-based", param, CACHE_PAIR, slo_ttft_ms=2000.0)


def slo_filter(param: dict) -> str | None:
    """Off: the cheapest TTFT (a). On (budget 500 - 100 = 400): both filtered, the fallback
    takes the least waiting (b)."""
    return pick("prefill", "cost-based", param, SLO_PAIR, slo_ttft_ms=500.0)


def slo_margin(param: dict) -> str | None:
    """Filter on, SLO 500: margin 100 filters both (fallback b); margin 0 keeps both (a)."""
    return pick("prefill", "cost-based", {"slo_filter": True, **param}, SLO_PAIR, slo_ttft_ms=500.0)


def hotspot(pending_a: int) -> Callable[[dict], str | None]:
    """a is the cheapest and holds `pending_a` requests, three others none."""
    def run(param: dict) -> str | None:
        return pick("prefill", "cost-based", param, [
            cand("a", prefill_ms=50, num_pending=pending_a), cand("b", prefill_ms=200), cand("c", prefill_ms=300),
            cand("d", prefill_ms=400)])
    return run


def imbalance(wait_a_ms: float) -> Callable[[dict], str | None]:
    """a is the cheapest behind a `wait_a_ms` wait, three others wait nothing."""
    def run(param: dict) -> str | None:
        return pick("prefill", "cost-based", param, [
            cand("a", prefill_ms=10, wait_ms=wait_a_ms), cand("b", prefill_ms=300), cand("c", prefill_ms=400),
            cand("d", prefill_ms=500)])
    return run


def tie_window(cost_a: float, cost_b: float) -> Callable[[dict], str | None]:
    """b costs a little more than a but holds fewer requests: it wins only inside the tie window."""
    def run(param: dict) -> str | None:
        return pick("prefill", "cost-based", param, [cand("a", prefill_ms=cost_a, num_pending=1),
                                                     cand("b", prefill_ms=cost_b, num_pending=0)])
    return run


def tie_break(param: dict) -> list[str]:
    """a and b tie (100 vs 105 ms), b holds fewer requests: fewest-pending always b, random both."""
    cands = [cand("a", prefill_ms=100, num_pending=2), cand("b", prefill_ms=105, num_pending=0)]
    return sorted(set(picks_over_seeds("prefill", "cost-based", param, cands, 20)))


# ------------------------------------------------------------------ cache-aware, select
def cache_threshold(param: dict) -> str | None:
    """a matches 60 % of the prompt; b has the smaller cache: above a 0.5 threshold a, under 0.7 b."""
    return pick("prefill", "cache-aware", param, [cand("a", num_cached_tokens=600, num_cache_blocks=100),
                                                  cand("b", num_cache_blocks=10)])


def balance(pending_a: int, pending_b: int) -> Callable[[dict], str | None]:
    """a matches 90 % of the prompt; the load check may overrule it for the shorter queue (b)."""
    def run(param: dict) -> str | None:
        return pick("prefill", "cache-aware", param, [cand("a", num_cached_tokens=900, num_pending=pending_a),
                                                      cand("b", num_pending=pending_b)])
    return run


# ------------------------------------------------------------------ kv-aware, select
def kv_weight(param: dict) -> float:
    """a uses 1,000 KV tokens fewer than b: share of a's picks over 400 seeds (e^1 : 1 vs even)."""
    picks = picks_over_seeds("decode", "kv-aware", param, [cand("a"), cand("b", kv_used_tokens=1000)], 400)
    return round(picks.count("a") / len(picks), 1)


def load_factor(param: dict) -> str | None:
    """a uses the least KV (picked, at weight 1/token, unless filtered) but holds 10 requests
    to the others' 0: above 3 x the average 2.5, not above 5 x."""
    return pick("decode", "kv-aware", {"kv_weight_per_token": 1.0, **param}, [
        cand("a", num_pending=10), cand("b", kv_used_tokens=100), cand("c", kv_used_tokens=200),
        cand("d", kv_used_tokens=300)])


def kv_used_factor(param: dict) -> list[str]:
    """Uniform weights; a uses 1,000 KV tokens, the others none: above 3 x the average 250,
    not above 5 x. Which workers 40 seeds pick."""
    cands = [cand("a", kv_used_tokens=1000), cand("b"), cand("c"), cand("d")]
    return sorted(set(picks_over_seeds("decode", "kv-aware", {"kv_weight_per_token": 0.0, **param}, cands, 40)))


# ------------------------------------------------------------------ kv-aware, through the scheduler
def disaggregated(param: dict, **decode_status: Any) -> Scheduler:
    s = scheduler(prefill_policy="round-robin", decode_policy="kv-aware", decode_policy_params=param,
                  batcher="fixed-window")
    s.on_worker_event(status("p0", "prefill"), 0)
    s.on_worker_event(status("d0", "decode", **decode_status), 0)
    return s


def max_kv_usage(param: dict) -> str:
    """The only decode worker is 85 % full: open under a 0.9 gate, closed under 0.8."""
    s = disaggregated(param, num_free_kv_blocks=1500)
    return outcome(s.admit(AdmitRequest("x", 160, 10, slo_ttft_ms=60_000), 0))


def kv_usage_hysteresis(param: dict) -> tuple[str, str]:
    """d0 at 95 % closes the gate (0.9); at 70 % it reopens below 0.9 x 0.85 = 76.5 %, not
    below 0.9 x 0.6 = 54 %."""
    s = disaggregated(param, num_free_kv_blocks=500)
    first = s.admit(AdmitRequest("x", 160, 10, slo_ttft_ms=60_000), 0)
    s.on_worker_event(status("d0", "decode", num_free_kv_blocks=3000), 1 * MS)
    second = s.admit(AdmitRequest("y", 160, 10, slo_ttft_ms=60_000), 1 * MS)
    return outcome(first), outcome(second)


def expected_output_cap(param: dict) -> tuple[str, float]:
    """d0 holds 1,600 KV tokens. A 480-token prompt that may write 2,000 reserves 480 + cap:
    1,480 (92.5 %: the 0.9 gate closes for the next request) or 580. Returns the next
    request's outcome and d0's KV use on its decode card."""
    s = disaggregated(param, num_kv_blocks=100, num_free_kv_blocks=100)
    assert isinstance(s.admit(AdmitRequest("long", 480, 2000, slo_ttft_ms=60_000), 0), Admitted)
    nxt = s.admit(AdmitRequest("next", 16, 10, slo_ttft_ms=60_000), 0)
    card = next(c for d in nxt.decisions if d.stage == "decode" for c in d.pick.scores if c.worker_id == "d0")
    return outcome(nxt), card.components["kv_used_tokens"]


# ------------------------------------------------------------------ fixed-window, poll
def fw_batch_size_max(param: dict) -> tuple:
    """Three requests at 0, polled at 0 (the 300 ms window open): full at 2, not at 8."""
    return poll_after("fixed-window", param, [item("a"), item("b"), item("c")], 0, load())


def fw_wait_ms(param: dict) -> tuple:
    """One request, polled at 100 ms: a 50 ms window has closed, a 300 ms one has not."""
    return poll_after("fixed-window", param, [item("a")], 100, load())


def fw_threshold(param: dict) -> tuple:
    """A 1,000-token request (predicted 100 ms) at 0: a 50 ms threshold sends it at once."""
    return poll_after("fixed-window", param, [item("a", 1000)], 0, load())


def fw_enqueue_deadline(param: dict) -> tuple:
    """One request, polled at 250 ms, inside the 300 ms window: expired after 200 ms, not 5 s."""
    return poll_after("fixed-window", param, [item("a")], 250, load())


def fw_max_inflight(param: dict) -> tuple:
    """One request past its window, the worker with one batch inflight: held only at a limit of 1."""
    return poll_after("fixed-window", param, [item("a")], 400, load(inflight=1))


def fw_dispatch_when_capped(param: dict) -> tuple:
    """Three 400-token requests under a 1,000 padded-token cap: the third cannot join, so the
    first two leave at once (capacity), or wait out the window (FlexLB)."""
    return poll_after("fixed-window", param, [item("a", 400), item("b", 400), item("c", 400)], 0,
                      load(max_batch_tokens=1000))


# ------------------------------------------------------------------ slo-budget, poll
STREAM = [item("a", t_ms=0), item("b", t_ms=10), item("c", t_ms=20)]  # arrivals every 10 ms, no deadlines


def sb_batch_size_max(param: dict) -> tuple:
    """The stream polled at 20 ms (the next arrival expected before the window ends): full at
    2, waiting at 8."""
    return poll_after("slo-budget", param, STREAM, 20, load())


def sb_window_ms(param: dict) -> tuple:
    """The stream polled at 100 ms: the oldest has waited out a 50 ms window, not a 300 ms one
    (nor has the target come: the next arrival is expected before 160 ms)."""
    return poll_after("slo-budget", param, STREAM, 100, load())


def sb_guard_ms(param: dict) -> tuple:
    """a (1,000 tokens, 100 ms, deadline 200 ms) and b arrive together: the pair must start by
    99 ms; waiting stops at 99 - guard, and half way there the next arrival is no longer
    expected: at 29.5 ms with a 40 ms guard, 49.5 ms with none. Polled at 40 ms."""
    return poll_after("slo-budget", param, [item("a", 1000, deadline_ms=200), item("b")], 40, load())


def sb_emergency_guard_ms(param: dict) -> tuple:
    """a (100 ms, deadline 300 ms, so it must start by 200 ms) held by backpressure (2
    batches inflight): it breaks through at 200 - 150 = 50 ms, or 200 - 50 = 150 ms. Polled at 100 ms."""
    return poll_after("slo-budget", param, [item("a", 1000, deadline_ms=300)], 100, load(inflight=2))


def sb_ema_alpha(param: dict) -> tuple:
    """Gaps of 200 then 10 ms: the EMA is 162 ms at 0.2 (the next arrival not expected before
    the 300 ms window ends: go now) and 10 ms at 1.0 (wait). Polled at the third arrival, 210 ms."""
    return poll_after("slo-budget", param, [item("a", t_ms=0), item("b", t_ms=200), item("c", t_ms=210)], 210, load())


def sb_max_inflight(param: dict) -> tuple:
    """One request (no arrival history: it would go at once), one batch inflight: held at a limit of 1."""
    return poll_after("slo-budget", param, [item("a")], 0, load(inflight=1))


def sb_enqueue_deadline(param: dict) -> tuple:
    """A request without a deadline held by backpressure, polled late at 1 s: expired after
    500 ms; with 5 s its emergency (from its expiry) is not due yet."""
    return poll_after("slo-budget", param, [item("a")], 1000, load(inflight=2))


def sb_tpot_hold(param: dict) -> tuple:
    """The worker decodes at 40 ms, one more request adds 2: above 0.8 x the request's 50 ms
    TPOT target, so it is held (until its emergency); with no hold it goes at once."""
    return poll_after("slo-budget", param, [item("a", tpot_target_ms=50.0)], 0,
                      load(tpot_ms=40.0, tpot_ms_per_request=2.0))


def sb_stall_hold(param: dict) -> tuple:
    """A 10-token prompt (1 ms of prefill) on a worker whose one decoding request can absorb
    0.5 ms of stall and finishes in 200 ms: held until then at 1.0, sent at once when off."""
    return poll_after("slo-budget", param, [item("a", deadline_ms=2000.0, tpot_target_ms=100.0)], 0,
                      load(tpot_ms=40.0)._replace(stall_limits=((0.5, 200.0),)))


def sb_stall_hold_headroom(param: dict) -> tuple:
    """As `sb_stall_hold` at 1.0, the worker's TPOT with the request 40 ms of its 100 ms target:
    held within a headroom of 1.0, sent at once within 0.3 (the stall hold stands aside)."""
    return poll_after("slo-budget", {"stall_hold": 1.0, **param}, [item("a", deadline_ms=2000.0, tpot_target_ms=100.0)], 0,
                      load(tpot_ms=40.0)._replace(stall_limits=((0.5, 200.0),)))


# ================================================================== the table
@dataclass(frozen=True)
class Row:
    struct: type[msgspec.Struct]
    field: str
    altered: Any  # the value the scenario runs with besides the default
    scenario: Callable[[dict[str, Any]], Any]
    expected: tuple[Any, Any]  # (decision at the default, decision at `altered`)
    where: str = ""  # which of several scenarios of one parameter

    @property
    def default(self) -> Any:
        return getattr(self.struct(), self.field)

    @property
    def id(self) -> str:
        return f"{self.struct.__name__}.{self.field}" + (f"-{self.where}" if self.where else "")


ROWS = [
    # cost-based (the gates and the TPOT filter end to end through the scheduler)
    Row(CostBasedParams, "pending_gate_high", 32, gate_high, ("w0", "w1")),
    Row(CostBasedParams, "pending_gate_hysteresis", 0.5, gate_hysteresis, (("w1", "w0"), ("w1", "w1"))),
    Row(CostBasedParams, "tpot_filter", True, tpot_filter, ("w0", "w1")),
    Row(CostBasedParams, "slo_filter", True, slo_filter, ("a", "b")),
    Row(CostBasedParams, "prefill_weight", 1.0, prefill_weight, ("b", "a")),
    Row(CostBasedParams, "slo_margin_ms", 0.0, slo_margin, ("b", "a")),
    Row(CostBasedParams, "hotspot_factor", 4.5, hotspot(pending_a=10), ("b", "a")),
    Row(CostBasedParams, "hotspot_min_excess", 2, hotspot(pending_a=4), ("a", "b")),
    Row(CostBasedParams, "imbalance_factor", 4.5, imbalance(wait_a_ms=150), ("b", "a")),
    Row(CostBasedParams, "imbalance_min_excess_ms", 50.0, imbalance(wait_a_ms=120), ("a", "b")),
    Row(CostBasedParams, "tie_rel", 0.01, tie_window(1000, 1050), ("b", "a")),
    Row(CostBasedParams, "tie_abs_ms", 5.0, tie_window(100, 115), ("b", "a")),
    Row(CostBasedParams, "tie_break", "random", tie_break, (["b"], ["a", "b"])),
    # cache-aware
    Row(CacheAwareParams, "cache_threshold", 0.7, cache_threshold, ("a", "b")),
    Row(CacheAwareParams, "balance_abs_threshold", 50, balance(40, 0), ("b", "a")),
    Row(CacheAwareParams, "balance_rel_threshold", 4.0, balance(60, 20), ("b", "a")),
    # kv-aware (the gate and the reservation end to end through the scheduler)
    Row(KvAwareParams, "expected_output_cap", 100, expected_output_cap, (("no_worker", 1480.0), ("admitted", 580.0))),
    Row(KvAwareParams, "max_kv_usage", 0.8, max_kv_usage, ("admitted", "no_worker")),
    Row(KvAwareParams, "kv_usage_hysteresis", 0.4, kv_usage_hysteresis,
        (("no_worker", "admitted"), ("no_worker", "no_worker"))),
    Row(KvAwareParams, "kv_weight_per_token", 0.0, kv_weight, (0.7, 0.5)),
    Row(KvAwareParams, "load_factor", 5.0, load_factor, ("b", "a")),
    Row(KvAwareParams, "kv_used_factor", 5.0, kv_used_factor, (["b", "c", "d"], ["a", "b", "c", "d"])),
    # fixed-window
    Row(FixedWindowParams, "batch_size_max", 2, fw_batch_size_max, (NOTHING, batch("full", "a", "b"))),
    Row(FixedWindowParams, "wait_ms", 50.0, fw_wait_ms, (NOTHING, batch("window", "a"))),
    Row(FixedWindowParams, "predicted_ms_threshold", 50.0, fw_threshold, (NOTHING, batch("threshold", "a"))),
    Row(FixedWindowParams, "enqueue_deadline_ms", 200.0, fw_enqueue_deadline, (NOTHING, ((), ("a",), ()))),
    Row(FixedWindowParams, "max_inflight_batches", 1, fw_max_inflight, (batch("window", "a"), NOTHING)),
    Row(FixedWindowParams, "dispatch_when_capped", False, fw_dispatch_when_capped,
        (batch("capacity", "a", "b"), NOTHING)),
    # slo-budget (its TPOT hold twice: in the batcher, and fed to cost-based through the scheduler)
    Row(SloBudgetParams, "batch_size_max", 2, sb_batch_size_max, (NOTHING, batch("full", "a", "b"))),
    Row(SloBudgetParams, "window_ms", 50.0, sb_window_ms, (NOTHING, batch("window", "a", "b", "c"))),
    Row(SloBudgetParams, "guard_ms", 0.0, sb_guard_ms, (batch("target", "a", "b"), NOTHING)),
    Row(SloBudgetParams, "emergency_guard_ms", 50.0, sb_emergency_guard_ms, (batch("emergency", "a"), NOTHING)),
    Row(SloBudgetParams, "ema_alpha", 1.0, sb_ema_alpha, (batch("target", "a", "b", "c"), NOTHING)),
    Row(SloBudgetParams, "max_inflight_batches", 1, sb_max_inflight, (batch("target", "a"), NOTHING)),
    Row(SloBudgetParams, "enqueue_deadline_ms", 500.0, sb_enqueue_deadline, (NOTHING, ((), ("a",), ()))),
    Row(SloBudgetParams, "tpot_headroom", 0.8, sb_tpot_hold, (batch("target", "a"), NOTHING), where="hold"),
    Row(SloBudgetParams, "tpot_headroom", 0.5, tpot_hold_routing, ("w0", "w1"), where="routing"),
    Row(SloBudgetParams, "tpot_refuse_ratio", 1.1, tpot_refuse_ratio, ("slo_unattainable", "w0")),
    Row(SloBudgetParams, "give_way_tpot_ratio", 0.9, give_way_tpot_ratio, ("w0", "slo_unattainable")),
    Row(SloBudgetParams, "give_way_prefill_ratio", 10.0, give_way_prefill_ratio, ("slo_unattainable", "w0")),
    Row(SloBudgetParams, "give_way_cheap_tpot_ratio", 1.1, give_way_cheap_tpot_ratio, ("slo_unattainable", "w0")),
    Row(SloBudgetParams, "stall_hold", 1.0, sb_stall_hold, (batch("target", "a"), NOTHING)),
    Row(SloBudgetParams, "stall_hold_headroom", 0.3, sb_stall_hold_headroom, (NOTHING, batch("target", "a"))),
]


PARAM_STRUCTS = (CostBasedParams, CacheAwareParams, KvAwareParams, NoParams, FixedWindowParams, SloBudgetParams)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_each_parameter_changes_a_decision(row: Row) -> None:
    assert row.altered != row.default, f"{row.id}: the altered value is the default"
    at_default = row.scenario({row.field: row.default})
    at_altered = row.scenario({row.field: row.altered})
    assert (at_default, at_altered) == row.expected, (
        f"{row.id}: at the default {row.default!r} -> {at_default!r}, at {row.altered!r} -> {at_altered!r}")
    assert at_default != at_altered


def test_the_table_covers_every_parameter_of_every_policy_and_batcher() -> None:
    """A parameter (or a policy or batcher with its own parameter struct) added without a
    scenario fails here."""
    # (`pipeline`'s parameters are plugins, each shown to change a decision in test_pipeline.py)
    registered = ({spec.params for table in (PREFILL_POLICIES, DECODE_POLICIES)
                   for name, spec in table.items() if name != "pipeline"}
                  | {spec.params_type for spec in BATCHERS.values()})
    assert registered == set(PARAM_STRUCTS)
    assert NoParams.__struct_fields__ == ()
    documented = {(s.__name__, f) for s in PARAM_STRUCTS for f in s.__struct_fields__}
    covered = {(r.struct.__name__, r.field) for r in ROWS}
    assert covered == documented, (
        f"without a scenario: {sorted(documented - covered)}; unknown: {sorted(covered - documented)}")
    assert len({r.id for r in ROWS}) == len(ROWS)


# ------------------------------------------------------------------ the settings' JSON reaches the component
def _component_setting(struct: type) -> tuple[str, str]:
    """(settings prefix, registered name) of the policy or batcher whose parameters `struct` holds."""
    for prefix, table in (("prefill_policy", PREFILL_POLICIES), ("decode_policy", DECODE_POLICIES)):
        for name, spec in table.items():
            if spec.params is struct:
                return prefix, name
    return "batcher", next(name for name, spec in BATCHERS.items() if spec.params_type is struct)


SETTINGS_ROWS = list({(r.struct, r.field): r for r in ROWS}.values())  # one per parameter


@pytest.mark.parametrize("row", SETTINGS_ROWS, ids=[f"{r.struct.__name__}.{r.field}" for r in SETTINGS_ROWS])
def test_settings_json_reaches_the_component(row: Row) -> None:
    """FLEXLB_<COMPONENT>=name, FLEXLB_<COMPONENT>_PARAMS={"field": value} (a JSON object, as
    the environment or a settings file gives it): the scheduler's policy or batcher carries it."""
    prefix, name = _component_setting(row.struct)
    environ = {f"FLEXLB_{prefix.upper()}": name,
               f"FLEXLB_{prefix.upper()}_PARAMS": json.dumps({row.field: row.altered})}
    settings = load_settings(RouterSettings, environ=environ)
    s = Scheduler(settings.scheduler_config(), id_prefix="r-test")
    if prefix == "batcher":
        component = s.batcher("w0")  # (built per prefill worker, on first use)
    else:
        component = s.prefill_policy if prefix == "prefill_policy" else s.decode_policy
    assert component.name == name
    assert isinstance(component.params, row.struct)
    assert getattr(component.params, row.field) == row.altered != row.default

"""Fair admission under overload: FCFS against the fairness queue (services/core/fairness.py),
in virtual time, with no servers.

The fleet: `--engines` engines x `--slots` sequences each. A request holds one slot for its
prefill (input / `--prefill-tps` s) and its decode (output x `--tpot-ms`); its TTFT is its wait
(router queue, then the engines' own FIFO) plus its prefill. The router hands the engines
what they can run plus `--buffer` requests (held in the engines' FIFO), as item 4 of issue
27 asks. Capacity (requests/s) = slots / mean service time of the size mix; tenants arrive
as Poisson processes at multiples of it. Counters are charged at dispatch with the request's
`max_tokens` and settled with the output it really produced (drawn in [max/2, max]).

Scenarios:
- (a) noisy neighbour: a quiet tenant at 0.25 x capacity beside a noisy one at 2 x; the
  quiet tenant's rejections and TTFT p50/p99 against its TTFT alone; utilisation.
- (b) four backlogged tenants (1 x capacity each) with different size mixes: Jain's index
  of cost tokens (input + 2 x output) served per 60 s window; then two tenants weighted 4:1
  (2 x capacity each): the ratio served.
- (c) priority: critical at 0.5 x, standard at 1 x (8 tenants), sheddable at 1 x (8 tenants):
  lower-class dispatches while critical work was queued (by reason), critical's wait, each
  class's refusals.
- (d) decision time with 1,000 backlogged tenants: one offer + one pop, p50/p99.

    python bench/fairness.py [--duration-s 600] [--seed 1] [--out bench/results/fairness.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile, print_table  # noqa: E402
from services.core.fairness import Dispatched, FairnessParams, FairQueue, FairRequest, Queued, Refused  # noqa: E402

NS = 1_000_000_000

# Size mixes: (input tokens, max output tokens) drawn uniformly.
MIXED = [(256, 64), (512, 128), (1_024, 256), (2_048, 256), (256, 512), (1_024, 64)]
SIZE_MIXES = {
    "mixed": MIXED,
    "short": [(256, 64)],
    "long-prompt": [(2_048, 64)],
    "long-output": [(256, 512)],
}


@dataclass
class Fleet:
    engines: int = 8
    slots: int = 32  # per engine
    prefill_tps: float = 8_000.0  # prefill tokens/s of one sequence
    tpot_ms: float = 20.0
    buffer: int = 8  # requests the engines hold beyond what they can run

    def prefill_s(self, n_in: int) -> float:
        return n_in / self.prefill_tps

    def service_s(self, n_in: int, n_out: int) -> float:
        return self.prefill_s(n_in) + n_out * self.tpot_ms / 1_000

    def capacity_rps(self, mix: list[tuple[int, int]]) -> float:
        mean_out = sum(o * 0.75 for _, o in mix) / len(mix)  # actual output is uniform in [max/2, max]
        mean_in = sum(i for i, _ in mix) / len(mix)
        return self.engines * self.slots / self.service_s(mean_in, mean_out)


@dataclass
class Tenant:
    name: str
    rate_x: float  # arrival rate, x capacity
    mix: str = "mixed"
    cls: str = "standard"
    weight: float = 1.0


class FcfsQueue:
    """Today's behaviour with a bound: one FIFO for everyone, refused when full."""

    def __init__(self, max_queued: int) -> None:
        self.q: deque[tuple[FairRequest, int]] = deque()
        self.max_queued = max_queued
        self.class_to_num_queued: dict[str, int] = defaultdict(int)

    def offer(self, req: FairRequest, now_ns: int):
        if len(self.q) >= self.max_queued:
            return Refused(request_id=req.request_id, priority_class=req.priority_class, tenant=req.tenant, code="queue_full",
                           retry_after_ms=1_000, reason="fifo full", request=req)
        self.q.append((req, now_ns))
        self.class_to_num_queued[req.priority_class] += 1
        return Queued(request_id=req.request_id, priority_class=req.priority_class, tenant=req.tenant, num_queued_in_class=len(self.q))

    def pop(self, now_ns: int, can_take: int):
        out = []
        while self.q and len(out) < can_take:
            req, t = self.q.popleft()
            self.class_to_num_queued[req.priority_class] -= 1
            out.append(Dispatched(request=req, priority_class=req.priority_class, tenant=req.tenant, reason="priority",
                                  counter_before=0.0, counter_after=0.0, cost_tokens=0.0, weight=1.0, waited_ns=now_ns - t))
        return out

    def settle(self, d, actual):
        return None

    def expire(self, now_ns: int) -> list:
        return []  # no wait bound: today's router has none (its queue bound keeps waits under 30 s here)

    def num_queued(self, cls=None) -> int:
        return len(self.q) if cls is None else self.class_to_num_queued[cls]


@dataclass
class Outcome:
    arrival_s: float
    tenant: str
    cls: str
    n_in: int
    n_out: int
    refused: str | None = None
    refused_s: float | None = None  # when (an evicted or expired request is refused after its arrival)
    first_token_s: float | None = None
    done_s: float | None = None


@dataclass
class RunResult:
    outcomes: list[Outcome]
    busy_slot_s: float  # within [warmup, duration]
    slots: int
    lower_while_critical: dict[str, int] = field(default_factory=dict)  # reason -> count
    starvation_gaps_s: dict[str, list[float]] = field(default_factory=dict)  # class -> gaps between its starvation dispatches


def arrivals(tenants: list[Tenant], fleet: Fleet, duration_s: float, rng: random.Random):
    cap = fleet.capacity_rps(MIXED)  # the unit: capacity on the mixed size mix
    out = []
    for t in tenants:
        rate = t.rate_x * cap * fleet.service_s(*mean_of(MIXED)) / fleet.service_s(*mean_of(SIZE_MIXES[t.mix]))
        now = rng.expovariate(rate)
        while now < duration_s:
            n_in, max_out = rng.choice(SIZE_MIXES[t.mix])
            n_out = rng.randint(max_out // 2, max_out)
            out.append((now, t, n_in, max_out, n_out))
            now += rng.expovariate(rate)
    out.sort(key=lambda a: a[0])
    return out


def mean_of(mix):
    return (sum(i for i, _ in mix) / len(mix), sum(o * 0.75 for _, o in mix) / len(mix))


def simulate(tenants: list[Tenant], fleet: Fleet, duration_s: float, seed: int, fair: bool, params: FairnessParams | None = None,
             warmup_s: float = 30.0) -> RunResult:
    rng = random.Random(seed)
    weights = {t.name: t.weight for t in tenants}
    params = params or FairnessParams(tenant_weights=weights)
    q = FairQueue(params) if fair else FcfsQueue(params.max_queued_total)
    total_slots = fleet.engines * fleet.slots
    free_slots = total_slots
    engine_fifo: deque[tuple[Dispatched, int]] = deque()  # (dispatch, outcome index)
    completions: list[tuple[float, int, Dispatched]] = []
    outcomes: list[Outcome] = []
    index_of: dict[str, int] = {}
    busy = 0.0
    last_t = 0.0
    lower_while_critical: dict[str, int] = defaultdict(int)
    last_starved: dict[str, float] = {}
    gaps: dict[str, list[float]] = defaultdict(list)
    events = arrivals(tenants, fleet, duration_s, rng)
    ai = 0

    def account(t: float) -> None:
        nonlocal busy, last_t
        lo, hi = max(last_t, warmup_s), min(t, duration_s)
        if hi > lo:
            busy += (total_slots - free_slots) * (hi - lo)
        last_t = t

    def refuse(i: int, code: str, now: float) -> None:
        outcomes[i].refused, outcomes[i].refused_s = code, now

    def start(now: float) -> None:
        nonlocal free_slots
        while free_slots and engine_fifo:
            d, i = engine_fifo.popleft()
            o = outcomes[i]
            free_slots -= 1
            o.first_token_s = now + fleet.prefill_s(o.n_in)
            heapq.heappush(completions, (now + fleet.service_s(o.n_in, o.n_out), i, d))

    def dispatch(now: float) -> None:
        for r in q.expire(int(now * NS)):
            refuse(index_of[r.request_id], r.code, now)
        while True:
            room = free_slots + fleet.buffer - len(engine_fifo)
            if room <= 0 or not q.num_queued():
                break
            critical_waiting = q.num_queued("critical") > 0
            (d,) = q.pop(int(now * NS), 1)
            if critical_waiting and d.priority_class != "critical":
                lower_while_critical[d.reason] += 1
            if d.reason == "starvation":
                if d.priority_class in last_starved:
                    gaps[d.priority_class].append(now - last_starved[d.priority_class])
                last_starved[d.priority_class] = now
            engine_fifo.append((d, index_of[d.request_id]))
            start(now)

    while ai < len(events) or completions:
        next_arrival = events[ai][0] if ai < len(events) else float("inf")
        if completions and completions[0][0] <= next_arrival:
            now, i, d = heapq.heappop(completions)
            account(now)
            free_slots += 1
            outcomes[i].done_s = now
            q.settle(d, outcomes[i].n_out)
            start(now)
        else:
            now, t, n_in, max_out, n_out = events[ai]
            ai += 1
            account(now)
            rid = f"r{len(outcomes)}"
            index_of[rid] = len(outcomes)
            outcomes.append(Outcome(now, t.name, t.cls, n_in, n_out))
            r = q.offer(FairRequest(request_id=rid, tenant=t.name, priority_class=t.cls, num_input_tokens=n_in,
                                    num_est_output_tokens=max_out), int(now * NS))
            if isinstance(r, Refused):
                refuse(len(outcomes) - 1, r.code, now)
            elif r.evicted is not None:
                refuse(index_of[r.evicted.request_id], r.evicted.code, now)
        dispatch(now)
    return RunResult(outcomes, busy, total_slots, dict(lower_while_critical), dict(gaps))


def ttft_stats(res: RunResult, tenant: str, warmup_s: float, duration_s: float) -> dict:
    mine = [o for o in res.outcomes if o.tenant == tenant and warmup_s <= o.arrival_s < duration_s]
    ttfts = sorted(o.first_token_s - o.arrival_s for o in mine if o.refused is None)
    return {"offered": len(mine), "refused": sum(1 for o in mine if o.refused), "served": len(ttfts),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def utilisation(res: RunResult, warmup_s: float, duration_s: float) -> float:
    return res.busy_slot_s / (res.slots * (duration_s - warmup_s))


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 1.0


def served_per_window(res: RunResult, names: list[str], window_s: float, start_s: float, end_s: float, w_out: float = 2.0):
    """Per window: tenant -> cost tokens (input + w_out x output) of requests completed in it."""
    windows = []
    t = start_s
    while t + window_s <= end_s:
        per = {n: 0.0 for n in names}
        for o in res.outcomes:
            if o.done_s is not None and t <= o.done_s < t + window_s:
                per[o.tenant] += o.n_in + w_out * o.n_out
        windows.append(per)
        t += window_s
    return windows


def scenario_noisy(fleet: Fleet, duration_s: float, seed: int, warmup_s: float) -> dict:
    quiet, noisy = Tenant("quiet", 0.25), Tenant("noisy", 2.0)
    alone = simulate([quiet], fleet, duration_s, seed, fair=True, warmup_s=warmup_s)
    out = {"alone": ttft_stats(alone, "quiet", warmup_s, duration_s)}
    for name, fair in (("fcfs", False), ("fair", True)):
        res = simulate([quiet, noisy], fleet, duration_s, seed, fair=fair, warmup_s=warmup_s)
        out[name] = {"quiet": ttft_stats(res, "quiet", warmup_s, duration_s), "noisy": ttft_stats(res, "noisy", warmup_s, duration_s),
                     "utilisation": utilisation(res, warmup_s, duration_s)}
        out[name]["quiet_p99_vs_alone"] = out[name]["quiet"]["ttft_p99_s"] / out["alone"]["ttft_p99_s"]
    return out


def scenario_backlogged(fleet: Fleet, duration_s: float, seed: int, warmup_s: float) -> dict:
    four = [Tenant("t-mixed", 1.0, "mixed"), Tenant("t-short", 1.0, "short"), Tenant("t-long-prompt", 1.0, "long-prompt"),
            Tenant("t-long-output", 1.0, "long-output")]
    names = [t.name for t in four]
    out = {}
    for name, fair in (("fcfs", False), ("fair", True)):
        res = simulate(four, fleet, duration_s, seed, fair=fair, warmup_s=warmup_s)
        windows = served_per_window(res, names, 60.0, 60.0, duration_s)
        js = [jain(list(w.values())) for w in windows]
        totals = {n: sum(w[n] for w in windows) for n in names}
        raw = [jain(list(w.values())) for w in served_per_window(res, names, 60.0, 60.0, duration_s, w_out=1.0)]
        out[name] = {"jain_min": min(js), "jain_mean": sum(js) / len(js), "windows": len(js), "jain_min_raw_tokens": min(raw),
                     "max_over_min": max(totals.values()) / min(totals.values()), "cost_tokens_by_tenant": totals,
                     "utilisation": utilisation(res, warmup_s, duration_s)}
    weighted = [Tenant("w4", 2.0, weight=4.0), Tenant("w1", 2.0, weight=1.0)]
    res = simulate(weighted, fleet, duration_s, seed, fair=True, warmup_s=warmup_s)
    windows = served_per_window(res, ["w4", "w1"], 60.0, 60.0, duration_s)
    ratios = [w["w4"] / w["w1"] for w in windows]
    total = sum(w["w4"] for w in windows) / sum(w["w1"] for w in windows)
    out["weights_4_1"] = {"ratio": total, "ratio_min_window": min(ratios), "ratio_max_window": max(ratios)}
    return out


def scenario_priority(fleet: Fleet, duration_s: float, seed: int, warmup_s: float, rates_x: tuple[float, float, float]) -> dict:
    crit_x, std_x, shed_x = rates_x
    tenants = [Tenant("crit", crit_x, cls="critical")]
    tenants += [Tenant(f"std{i}", std_x / 8, cls="standard") for i in range(8)]
    tenants += [Tenant(f"shed{i}", shed_x / 8, cls="sheddable") for i in range(8)]
    params = FairnessParams()
    out = {"starvation_bound_ms": params.starvation_bound_ms}
    for name, fair in (("fcfs", False), ("fair", True)):
        res = simulate(tenants, fleet, duration_s, seed, fair=fair, params=params, warmup_s=warmup_s)
        per = {}
        for cls in ("critical", "standard", "sheddable"):
            mine = [o for o in res.outcomes if o.cls == cls and warmup_s <= o.arrival_s < duration_s]
            waits = sorted(o.first_token_s - o.arrival_s - fleet.prefill_s(o.n_in) for o in mine if o.refused is None)
            refused = [o for o in res.outcomes if o.cls == cls and o.refused]
            codes = defaultdict(int)
            for o in refused:
                codes[o.refused] += 1
            per[cls] = {"offered": len(mine), "refused_pct": 100.0 * sum(1 for o in mine if o.refused) / max(1, len(mine)),
                        "refused_by_code": dict(codes), "first_refusal_s": min((o.refused_s for o in refused), default=None),
                        "wait_p50_s": percentile(waits, 50), "wait_p99_s": percentile(waits, 99), "wait_max_s": waits[-1] if waits else None}
        gaps = {c: min(g) for c, g in res.starvation_gaps_s.items() if g}
        out[name] = {"classes": per, "lower_dispatches_while_critical_queued": res.lower_while_critical,
                     "min_gap_between_starvation_dispatches_s": gaps, "utilisation": utilisation(res, warmup_s, duration_s)}
    return out


def scenario_decision_time(num_tenants: int, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    q = FairQueue(FairnessParams(max_queued_total=10**6, max_queued_per_class=(10**6,) * 3))
    names = [f"t{i}" for i in range(num_tenants)]
    for i in range(num_tenants * 4):  # every tenant backlogged
        q.offer(FairRequest(request_id=f"w{i}", tenant=names[i % num_tenants], priority_class="standard",
                            num_input_tokens=rng.randint(100, 2_000), num_est_output_tokens=rng.randint(10, 500)), i)
    times = []
    now = num_tenants * 4
    for i in range(n):
        now += 1
        t0 = time.perf_counter_ns()
        q.offer(FairRequest(request_id=f"r{i}", tenant=rng.choice(names), priority_class="standard",
                            num_input_tokens=rng.randint(100, 2_000), num_est_output_tokens=rng.randint(10, 500)), now)
        (d,) = q.pop(now, 1)
        q.settle(d, rng.randint(0, d.request.num_est_output_tokens))
        times.append((time.perf_counter_ns() - t0) / 1_000)
    times.sort()
    return {"tenants": num_tenants, "decisions": n, "offer_pop_settle_p50_us": percentile(times, 50),
            "offer_pop_settle_p99_us": percentile(times, 99)}


def f(x, nd=2):
    return "-" if x is None else f"{x:,.{nd}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--buffer", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench/results/fairness.json"))
    a = ap.parse_args()
    fleet = Fleet(engines=a.engines, slots=a.slots, buffer=a.buffer)
    t0 = time.perf_counter()
    result = {"fleet": fleet.__dict__, "capacity_rps": fleet.capacity_rps(MIXED), "duration_s": a.duration_s, "warmup_s": a.warmup_s,
              "seed": a.seed, "params": {k: v for k, v in FairnessParams().__dict__.items() if k != "tenant_weights"}}
    result["noisy_neighbour"] = nn = scenario_noisy(fleet, a.duration_s, a.seed, a.warmup_s)
    rows = [["alone", "-", f(nn["alone"]["ttft_p50_s"], 3), f(nn["alone"]["ttft_p99_s"], 3), "1.00", str(nn["alone"]["refused"]), "-"]]
    for name in ("fcfs", "fair"):
        r = nn[name]
        rows.append([name, f"{100 * r['utilisation']:.1f} %", f(r["quiet"]["ttft_p50_s"], 3), f(r["quiet"]["ttft_p99_s"], 3),
                     f(r["quiet_p99_vs_alone"]), f"{r['quiet']['refused']} / {r['quiet']['offered']}",
                     f"{r['noisy']['refused']} / {r['noisy']['offered']}"])
    print_table("(a) noisy neighbour: quiet 0.25x beside noisy 2x", ["queue", "util", "quiet p50 s", "quiet p99 s", "p99 / alone",
                                                                     "quiet refused", "noisy refused"], rows, left=("queue",))
    result["backlogged"] = bl = scenario_backlogged(fleet, a.duration_s, a.seed, a.warmup_s)
    rows = [[n, f(bl[n]["jain_min"], 4), f(bl[n]["jain_mean"], 4), f(bl[n]["max_over_min"], 3), f(bl[n]["jain_min_raw_tokens"], 4),
             f"{100 * bl[n]['utilisation']:.1f} %"] for n in ("fcfs", "fair")]
    print_table("(b) four backlogged tenants, cost tokens (input + 2 x output) per 60 s window",
                ["queue", "Jain min", "Jain mean", "max/min total", "Jain min, input + output", "util"], rows, left=("queue",))
    w = bl["weights_4_1"]
    print(f"weights 4:1 served {w['ratio']:.3f}:1 (per window {w['ratio_min_window']:.3f} - {w['ratio_max_window']:.3f})")
    for key, rates in (("priority", (0.5, 1.0, 1.0)), ("priority_critical_overload", (1.5, 0.5, 0.5))):
        result[key] = pr = scenario_priority(fleet, a.duration_s, a.seed, a.warmup_s, rates)
        rows = []
        for n in ("fcfs", "fair"):
            for cls, c in pr[n]["classes"].items():
                rows.append([n, cls, f(c["wait_p50_s"], 3), f(c["wait_p99_s"], 3), f(c["wait_max_s"], 3), f(c["refused_pct"], 1),
                             json.dumps(c["refused_by_code"]), f(c["first_refusal_s"], 1)])
        cols = ["queue", "class", "wait p50 s", "wait p99 s", "wait max s", "refused %", "codes", "first refusal s"]
        title = f"(c) priority: critical {rates[0]}x, standard {rates[1]}x, sheddable {rates[2]}x (wait: to a slot)"
        print_table(title, cols, rows, left=("queue", "class", "codes"))
        gaps = {k: round(v, 3) for k, v in pr["fair"]["min_gap_between_starvation_dispatches_s"].items()}
        print("fair: lower-class dispatches while critical was queued, by reason:", pr["fair"]["lower_dispatches_while_critical_queued"],
              "; min gap between starvation dispatches (s):", gaps)
    result["decision_time"] = dt = scenario_decision_time(1_000, 20_000, a.seed)
    print(f"(d) 1,000 backlogged tenants: offer + pop + settle p50 {dt['offer_pop_settle_p50_us']:.1f} us, "
          f"p99 {dt['offer_pop_settle_p99_us']:.1f} us")
    result["wall_s"] = time.perf_counter() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

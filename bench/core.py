"""Benchmark of the pure scheduling core: routing decisions per second.

No network, no I/O: a `Scheduler` with N simulated workers (status reports with KV, a
prefix index fed with KV events so that prompts have real cache hits) and batcher queues
pre-filled to Q requests in total; then `admit()` is timed for new requests, each of which
is removed again (an O(1) cancel, included in the time) so the queue length stays at Q. The
virtual clock advances 50 us per decision; batchers use the shipped parameters. One decision = one admitted request
(colocated: one prefill pick; disaggregated: a decode pick and a prefill pick).

    python bench/core.py [--workers 16,128] [--queued 0,1000] [--decisions 20000]
                         [--policy cost-based] [--batcher fixed-window] [--out FILE]

Runs on one core (this process). Prompts: 2,048 tokens in 16-token blocks, drawn from 200
shared prefixes so the index has hits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schemas.messages import KvBlocksStored, WorkerStatusReported  # noqa: E402
from services.core.scheduler import AdmitRequest, Scheduler, SchedulerConfig  # noqa: E402
from services.settings import SHIPPED_FIXED_WINDOW_WAIT_MS  # noqa: E402

BLOCKS_PER_PROMPT = 128  # 2,048 tokens of 16
STEP_NS = 50_000  # the virtual clock advances 50 us per decision (20,000 arrivals/s)


def build(num_workers: int, policy: str, decode_policy: str, batcher: str, seed: int = 0) -> tuple[Scheduler, list[tuple[int, ...]]]:
    # The shipped batcher parameters (the fixed window of `flexlb up`); the benchmark never
    # ticks, so queued requests stay queued whatever the window.
    params = {"wait_ms": SHIPPED_FIXED_WINDOW_WAIT_MS} if batcher == "fixed-window" else {}
    cfg = SchedulerConfig(prefill_policy=policy, decode_policy=decode_policy, batcher=batcher, batcher_params=params,
                          max_queue_per_worker=10**6, seed=seed)
    s = Scheduler(cfg, id_prefix="bench")
    rng = random.Random(seed)
    prefixes = [tuple(rng.getrandbits(62) for _ in range(BLOCKS_PER_PROMPT)) for _ in range(200)]
    for i in range(num_workers):
        wid = f"w{i:03d}"
        s.on_worker_event(WorkerStatusReported(
            worker_id=wid, role="pd_fusion", boot_id="b", block_size_tokens=16, num_kv_blocks=200_000,
            num_free_kv_blocks=150_000, max_batch_tokens=1 << 20, max_seq_len_tokens=1 << 20,
        ), 0)
        held = rng.sample(prefixes, 20)
        s.on_kv_event(KvBlocksStored(worker_id=wid, boot_id="b", kv_seq=1,
                                     block_hashes=[h for p in held for h in p[: rng.randint(8, BLOCKS_PER_PROMPT)]]))
    return s, prefixes


def run(num_workers: int, queued: int, decisions: int, policy: str, decode_policy: str, batcher: str) -> dict:
    s, prefixes = build(num_workers, policy, decode_policy, batcher)
    rng = random.Random(1)
    for i in range(queued):
        s.admit(AdmitRequest(request_id=f"q{i}", num_prompt_tokens=2048, max_tokens=128,
                             block_hashes=rng.choice(prefixes)), 0)
    reqs = [AdmitRequest(request_id=f"r{i}", num_prompt_tokens=2048, max_tokens=128, block_hashes=rng.choice(prefixes))
            for i in range(decisions)]
    now = [1 + (i + 1) * STEP_NS for i in range(decisions)]
    t0 = time.perf_counter()
    for r, now_ns in zip(reqs, now):
        s.admit(r, now_ns)
        s.remove_queued(r.request_id)
    elapsed = time.perf_counter() - t0
    return {"workers": num_workers, "queued": queued, "decisions": decisions, "seconds": round(elapsed, 3),
            "decisions_per_s": round(decisions / elapsed), "us_per_decision": round(elapsed / decisions * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="16,128")
    ap.add_argument("--queued", default="0,1000")
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--policy", default="cost-based")
    ap.add_argument("--decode-policy", default="kv-aware")
    ap.add_argument("--batcher", default="fixed-window")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for w in [int(x) for x in a.workers.split(",")]:
        for q in [int(x) for x in a.queued.split(",")]:
            row = run(w, q, a.decisions, a.policy, a.decode_policy, a.batcher)
            rows.append(row)
            print(f"workers={w:4d} queued={q:5d}  {row['decisions_per_s']:>8,} decisions/s  {row['us_per_decision']:7.1f} us each", flush=True)
    report = {"bench": "core", "policy": a.policy, "decode_policy": a.decode_policy, "batcher": a.batcher,
              "python": platform.python_version(), "cpu_count": os.cpu_count(), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

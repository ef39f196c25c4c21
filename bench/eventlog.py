"""Benchmarks of the flight recorder: replay speed and export of a large stream.

    python bench/eventlog.py replay [--records 300000]
    python bench/eventlog.py export [--events 1000000]

replay: a journal recorded from the pure core (a seeded run: 16 workers, shared prefixes,
batches, completions, status reports, liveness cycles — the mix a router records), encoded
to JSON and decoded back as `flexlb replay` reads a file; then `replay()` is timed alone on
one core (decode timed separately). Reports records/s and that every decision matched.

export: starts a nats-server, publishes N `request.finished` envelopes into FLEXLB_EVENTS,
then times `flexlb events export` of the stream to a gzip'd file (the CLI's code path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schemas import messages as m  # noqa: E402
from schemas.messages import KvBlocksStored, WorkerStatusReported  # noqa: E402
from services.core.journal import Recorder, replay  # noqa: E402
from services.core.scheduler import AdmitRequest, Scheduler, SchedulerConfig  # noqa: E402

MS = 1_000_000


def record(num_records: int, num_workers: int = 16, seed: int = 3) -> list[bytes]:
    envelopes = m.EnvelopeFactory("bench-router", "boot")
    out: list[bytes] = []

    def sink(op, now_ns, args, result):
        out.append(m.encode(envelopes.wrap(m.CoreRecorded(router_id="bench-router", op=op, now_ns=now_ns, args=args,
                                                          out=result), now_ns)))

    cfg = SchedulerConfig(batcher_params={"wait_ms": 10, "batch_size_max": 8}, seed=seed)
    s = Recorder(Scheduler(cfg, id_prefix="bench-boot"), sink)
    rng = random.Random(seed)
    workers = [f"w{i:02d}" for i in range(num_workers)]
    prefixes = [tuple(rng.getrandbits(60) for _ in range(64)) for _ in range(40)]

    def status(w, running):
        return WorkerStatusReported(worker_id=w, role="pd_fusion", boot_id="b", block_size_tokens=16, num_kv_blocks=100_000,
                                    num_free_kv_blocks=90_000, max_batch_tokens=1 << 17, max_seq_len_tokens=1 << 17,
                                    num_running_requests=len(running), running_request_ids=sorted(running))

    running = {w: set() for w in workers}
    for w in workers:
        s.on_worker_event(status(w, ()), 0)
        s.on_kv_event(KvBlocksStored(worker_id=w, boot_id="b", kv_seq=1, block_hashes=list(rng.choice(prefixes)[:32])))
    inflight: dict[str, list[str]] = {}
    now, i = 0, 0
    while len(out) < num_records:
        i += 1
        now += rng.randint(1, 3) * MS // 2
        hashes = rng.choice(prefixes)[: rng.randint(8, 64)]
        s.admit(AdmitRequest(request_id=f"r{i}", num_prompt_tokens=len(hashes) * 16 + 7, max_tokens=rng.randint(1, 200),
                             block_hashes=hashes), now)
        for b in s.tick(now).batches:
            s.on_batch_started(b.worker_id, b.batch_id, now)
            inflight[b.batch_id] = [b.worker_id, *[it.request_id for it in b.items]]
            running[b.worker_id] |= {it.request_id for it in b.items}
        for batch_id in list(inflight)[:2]:
            worker, *rids = inflight.pop(batch_id)
            s.on_prefill_completed(worker, batch_id, measured_ms=rng.uniform(20, 200), num_cached_tokens=0)
            for rid in rids:
                s.on_terminal(rid)
                running[worker].discard(rid)
        if i % 20 == 0:
            for w in workers:
                s.on_worker_event(status(w, running[w]), now)
            s.take_settled()
            s.sync(now)
    return out


def bench_replay(num_records: int, num_workers: int) -> dict:
    t0 = time.perf_counter()
    raw = record(num_records, num_workers)
    t_record = time.perf_counter() - t0
    t0 = time.perf_counter()
    envs = [m.decode(b) for b in raw]
    t_decode = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = replay(envs)
    t_replay = time.perf_counter() - t0
    row = {"workers": num_workers, "records": len(envs), "decisions": report.decisions, "matched": report.matched,
           "divergence": report.first_divergence is not None, "record_s": round(t_record, 2),
           "decode_s": round(t_decode, 2), "replay_s": round(t_replay, 2),
           "replay_records_per_s": round(len(envs) / t_replay), "decode_and_replay_records_per_s":
           round(len(envs) / (t_replay + t_decode)), "mb_json": round(sum(map(len, raw)) / 1e6, 1)}
    print(json.dumps(row))
    return row


async def bench_export(num_events: int) -> dict:
    import nats

    from services.eventlog import export
    from services.infra import start_nats
    from services.shell.bus import ensure_streams

    data_dir = tempfile.mkdtemp(prefix="flexlb-bench-nats-")
    server = start_nats(data_dir)
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js)
        envelopes = m.EnvelopeFactory("bench-worker", "boot")
        t0 = time.perf_counter()
        for i in range(num_events):
            env = envelopes.wrap(m.RequestFinished(request_id=f"r{i}", worker_id="w0", finish_reason="length",
                                                   num_prompt_tokens=1000, num_output_tokens=100), time.time_ns())
            await nc.publish("flexlb.evt.req.w0", m.encode(env))
            if i % 10_000 == 0:
                await nc.flush()
        await nc.flush()
        while (await js.stream_info("FLEXLB_EVENTS")).state.messages < num_events:
            await asyncio.sleep(0.2)
        t_publish = time.perf_counter() - t0
        await nc.close()
        out = os.path.join(data_dir, "export.jsonl.gz")
        t0 = time.perf_counter()
        header = await export(server.url, out, ["FLEXLB_EVENTS"], progress=False)
        t_export = time.perf_counter() - t0
        row = {"events": header["streams"]["FLEXLB_EVENTS"]["exported"], "publish_s": round(t_publish, 1),
               "export_s": round(t_export, 1), "events_per_s": round(num_events / t_export),
               "file_mb": round(os.path.getsize(out) / 1e6, 1)}
        print(json.dumps(row))
        return row
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["replay", "export"])
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--workers", default="4,16")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.what == "replay":
        row = {"rows": [bench_replay(a.records, int(w)) for w in a.workers.split(",")]}
    else:
        row = asyncio.run(bench_export(a.events))
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()

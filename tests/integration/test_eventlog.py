"""The flight recorder on a running stack: record, export, replay with a determinism check,
tamper, explain a re-routed request. Real NATS, Redis, router and workers (`flexlb up`)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import pathlib
import random
import signal
import subprocess
import sys

import httpx

from schemas import messages as m
from tests.integration.stack import run_concurrent_streams, wait_async


def shared_prefix_bodies(n: int, seed: int, length: tuple[int, int] = (300, 900)) -> list[dict]:
    """Prompts drawn from a few long shared prefixes (prefix hits) plus a unique tail."""
    rng = random.Random(seed)
    prefixes = ["".join(rng.choice("abcdefghij ") for _ in range(rng.randint(*length))) for _ in range(5)]
    return [{"prompt": rng.choice(prefixes) + f" tail {i} " + "x" * rng.randint(1, 80), "max_tokens": rng.randint(2, 20)}
            for i in range(n)]


def flexlb(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def export(state: dict, out: str) -> None:
    res = flexlb("events", "export", "--nats-url", state["nats_url"], "--out", out)
    assert res.returncode == 0, res.stderr
    assert "FLEXLB_JOURNAL" in res.stdout and "TRUNCATED" not in res.stdout, res.stdout


def replay_json(path: str) -> tuple[int, dict]:
    res = flexlb("replay", path, "--json")
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


async def wait_quiet(url: str) -> None:
    async def idle():
        async with httpx.AsyncClient() as c:
            return (await c.get(url + "/admin/ledger")).json()["num_entries"] == 0

    await wait_async(idle, 30, "an empty ledger")
    await asyncio.sleep(1.0)  # a liveness cycle or two more in the journal


async def test_record_export_replay_identical_then_a_tampered_status_diverges_at_or_after_it(flexlb_up, tmp_path):
    _, state = flexlb_up("--workers", "4", "--time-scale", "0.02", "--prefill-policy", "cost-based")
    url = state["router_url"]
    results = await run_concurrent_streams(url, shared_prefix_bodies(120, seed=11))
    assert all(r["done"] and not r["errors"] for r in results)
    await wait_quiet(url)
    path = str(tmp_path / "run.jsonl.gz")
    export(state, path)
    rc, summary = replay_json(path)
    print({k: summary[k] for k in ("events", "decisions", "matched", "first_divergence", "gaps", "errors")})
    assert rc == 0 and summary["errors"] == [] and summary["gaps"] == []
    assert summary["decisions"] >= 120 and summary["matched"] == summary["decisions"]
    assert summary["first_divergence"] is None
    # The state at an instant mid-run, and a what-if under another policy, from the same file.
    from services.eventlog import read_export

    _, envs, _ = read_export(path)
    mid = sorted(e.payload.now_ns for e in envs if isinstance(e.payload, m.CoreRecorded) and e.payload.now_ns)
    at = flexlb("replay", path, "--at", str(mid[len(mid) // 2] / 1e9), "--show", "workers")
    assert at.returncode == 0 and '"liveness": "ready"' in at.stdout, at.stdout + at.stderr
    for extra in ([], ["--prefill-policy", "round-robin"], ["--refusal", "marginal"]):
        res = flexlb("whatif", path, "--json", *extra)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["recorded"]["ttft_ms"]["n"] == 120 and out["rerun"]["ttft_ms"]["n"] == 120, out
    marginal = out["marginal_over_refusal"]  # (a light run: whatever it refuses is judged one by one)
    assert marginal["requests"] == 120 and len(marginal["others_delta"]) == marginal["refused"]
    assert marginal["at_no_cost"] + marginal["at_a_cost"] + marginal["would_miss"] == marginal["refused"]

    # Alter one status report in the middle of the journal: the latest report, before a
    # mid-run admission, of the worker that admission picked now says "stopping" — so the
    # re-made pick must differ. The first divergence is at or after the altered record.
    with gzip.open(path, "rb") as f:
        lines = f.read().splitlines()
    journal_idx = [i for i, line in enumerate(lines[1:], 1) if b'"core.recorded"' in line]
    recs = {i: json.loads(lines[i])["payload"] for i in journal_idx}
    admits = [i for i in journal_idx if recs[i]["op"] == "admit" and recs[i]["out"]["ok"]]
    target = None
    for a in admits[len(admits) // 2:]:
        picked = recs[a]["out"]["prefill"]
        reports = [i for i in journal_idx if i < a and recs[i]["op"] == "on_worker_event"
                   and recs[i]["args"]["event"]["worker_id"] == picked and recs[i]["args"]["event"]["type"] == "worker.status_reported"]
        if reports:
            target = reports[-1]
            break
    assert target is not None
    env = json.loads(lines[target])
    env["payload"]["args"]["event"]["state"] = "stopping"  # the worker says it takes no new work
    lines[target] = json.dumps(env).encode()
    tampered = str(tmp_path / "tampered.jsonl.gz")
    with gzip.open(tampered, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    rc, bad = replay_json(tampered)
    assert rc == 1 and bad["first_divergence"] is not None, bad
    position_in_journal = journal_idx.index(target)  # the replay's record index counts journal records only
    assert bad["first_divergence"]["index"] >= position_in_journal, (bad["first_divergence"], position_in_journal)
    # The human form names the record and shows recorded vs re-made side by side.
    text = flexlb("replay", tampered).stdout
    assert "first divergence: record" in text and "recorded" in text and "re-made" in text


async def test_a_run_with_a_killed_and_a_drained_worker_replays_identically_and_explain_shows_the_reroute(flexlb_up, tmp_path):
    _, state = flexlb_up("--workers", "4", "--time-scale", "1.0", "--prefill-policy", "cost-based")
    url = state["router_url"]
    # Long prompts: at the kill, the victim still has prefill batches it has not started (re-routed).
    bodies = [dict(b, max_tokens=b["max_tokens"] + 20) for b in shared_prefix_bodies(200, seed=5, length=(2500, 4000))]
    load = asyncio.create_task(run_concurrent_streams(url, bodies))
    await asyncio.sleep(1.0)
    assert not load.done()
    # The victim: the worker holding the most work now (prompts sharing a prefix gather where it
    # is cached, so which one that is depends on the run); another one is drained.
    held = {w["id"]: w["num_held"] for w in httpx.get(url + "/admin/workers").json()["workers"]}
    victim = max(sorted(held), key=held.get)
    drained = next(w for w in sorted(held) if w != victim)
    os.kill(state["pids"][f"worker-{victim}"], signal.SIGKILL)
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(url + f"/admin/workers/{drained}/drain", json={})).status_code == 200

        async def victim_dead():
            ws = {w["id"]: w for w in (await c.get(url + "/admin/workers")).json()["workers"]}
            return victim not in ws or ws[victim]["liveness"] == "dead"

        await wait_async(victim_dead, 20, f"the router to declare {victim} dead")
    results = await asyncio.wait_for(load, 180)
    assert all(r["done"] for r in results)
    await wait_quiet(url)
    path = str(tmp_path / "faulty.jsonl.gz")
    export(state, path)
    rc, summary = replay_json(path)
    print({k: summary[k] for k in ("events", "decisions", "matched", "first_divergence", "gaps", "errors")})
    assert rc == 0 and summary["matched"] == summary["decisions"] and summary["first_divergence"] is None

    from services.eventlog import read_export

    _, envs, _ = read_export(path)
    journal = [e.payload for e in envs if isinstance(e.payload, m.CoreRecorded)]
    assert any(r.op == "sync" and victim in r.out["dead"] for r in journal)  # the liveness decision was replayed
    assert any(r.op == "set_drain_flags" and r.args["worker_ids"] == [drained] for r in journal)
    admits: dict[str, list] = {}
    for r in journal:
        if r.op == "admit" and r.out["ok"]:
            admits.setdefault(r.args["request"]["request_id"], []).append(r.out["prefill"])
    rerouted = [rid for rid, ws in admits.items() if len(ws) >= 2 and ws[0] == victim]
    assert rerouted, "no request was re-routed off the killed worker"
    res = flexlb("explain", rerouted[0], "--file", path, "--json")
    assert res.returncode == 0, res.stderr
    timeline = json.loads(res.stdout)["timeline"]
    whats = [s["what"] for s in timeline]
    print(whats)
    first_admit = whats.index("admitted")
    died = whats.index("worker_died", first_admit)
    second_admit = whats.index("admitted", died)
    terminal = next(i for i, w in enumerate(whats) if w in ("request.finished", "request.failed") and i > second_admit)
    assert first_admit < died < second_admit < terminal
    assert timeline[first_admit]["worker"] == victim and timeline[second_admit]["worker"] != victim
    assert timeline[first_admit]["decisions"][0]["candidates"]  # every candidate with its score components
    text = flexlb("explain", rerouted[0], "--file", path).stdout
    assert "worker_died" in text and "picked" in text


async def test_export_says_loudly_when_retention_already_truncated_the_stream(tmp_path):
    """A private nats-server whose FLEXLB_EVENTS keeps 4 KB: the oldest events are gone;
    export still writes what is left, and the header and stderr say TRUNCATED."""
    import msgspec
    import nats as nats_client

    from schemas.subjects import EVENTS_STREAM
    from services.eventlog import read_export
    from services.infra import start_nats
    from services.shell.bus import ensure_streams

    server = start_nats(str(tmp_path / "nats"))
    try:
        nc = await nats_client.connect(server.url)
        await ensure_streams(nc.jetstream(), (msgspec.structs.replace(EVENTS_STREAM, max_bytes=4096),))
        factory = m.EnvelopeFactory("w0", "b")
        for i in range(200):
            env = factory.wrap(m.RequestFinished(request_id=f"r{i}", worker_id="w0", finish_reason="length",
                                                 num_prompt_tokens=10, num_output_tokens=2), i)
            await nc.publish("flexlb.evt.req.w0", m.encode(env))
        await nc.flush()
        await nc.close()
        out = str(tmp_path / "t.jsonl.gz")
        res = await asyncio.to_thread(flexlb, "events", "export", "--nats-url", server.url, "--out", out,
                                      "--streams", "FLEXLB_EVENTS")
        assert res.returncode == 0, res.stderr
        assert "TRUNCATED" in res.stderr and "TRUNCATED" in res.stdout
        header, envs, bad = read_export(out)
        st = header["streams"]["FLEXLB_EVENTS"]
        assert st["truncated"] and st["first_seq"] > 1 and st["exported"] == len(envs) > 0 and bad == 0
        assert envs[-1].payload.request_id == "r199"  # what is left is all there, up to the newest
    finally:
        server.stop()


async def test_events_tail_prints_live_events_filtered_by_kind(flexlb_up, tmp_path):
    _, state = flexlb_up("--workers", "1", "--time-scale", "0.01")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "events", "tail", "--nats-url", state["nats_url"],
                             "--kind", "request."], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        await asyncio.sleep(1.5)  # subscribed
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(state["router_url"] + "/v1/completions", json={"prompt": "tail me", "max_tokens": 3})
        assert r.status_code == 200
        await asyncio.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "request.admitted" in out and "request.finished" in out
    assert "batch.dispatched" not in out and "core.recorded" not in out  # filtered by kind
    # explain against the live router: the same JSON shape as from a file.
    live = flexlb("explain", r.json()["id"], "--url", state["router_url"], "--json")
    assert live.returncode == 0, live.stderr
    data = json.loads(live.stdout)
    assert data["found"] and data["request_id"] == r.json()["id"]
    assert {"t_ms", "source", "what"} <= set(data["timeline"][0]) and any(t["what"] == "request.finished" for t in data["timeline"])
    # With no --nats-url, export finds the running `flexlb up` (its state file); a dead URL is one clear line.
    found = flexlb("events", "export", "--out", str(tmp_path / "x.jsonl"), env={"FLEXLB_UP_STATE": str(tmp_path / "last-up.json")})
    assert found.returncode == 0 and "FLEXLB_JOURNAL" in found.stdout, found.stderr
    dead = flexlb("events", "export", "--nats-url", "nats://127.0.0.1:1", "--out", str(tmp_path / "y.jsonl"))
    assert dead.returncode == 2 and "cannot use NATS at nats://127.0.0.1:1" in dead.stderr and "Traceback" not in dead.stderr


def test_reading_only_the_journal_skips_other_lines_but_never_a_journal_line(tmp_path):
    """Replay decodes only journal lines (the rest is half an export): a journal line is
    read whatever its JSON spacing (a hand-edited file), a damaged one is counted, and lines
    of other events are neither decoded nor counted as undecodable."""
    from services.eventlog import read_export

    envelopes = m.EnvelopeFactory("router-t", "boot1")
    journal = [m.encode(envelopes.wrap(m.CoreRecorded(router_id="router-t", op="tick", now_ns=i), i)) for i in (1, 2)]
    other = m.encode(envelopes.wrap(m.RequestFinished(request_id="r1", worker_id="w0", finish_reason="length",
                                                      num_prompt_tokens=10, num_output_tokens=2), 3))
    respaced = json.dumps(json.loads(journal[1]), indent=None, separators=(", ", ": ")).encode()
    path = tmp_path / "x.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join([journal[0], other, respaced, b'{"payload": {"type": "core.recorded", "op": ']) + b"\n")
    header, envs, bad = read_export(str(path), only=(m.CoreRecorded,))
    assert [e.payload.now_ns for e in envs] == [1, 2] and bad == 1
    _, everything, bad_all = read_export(str(path))
    assert len(everything) == 3 and isinstance(everything[1].payload, m.RequestFinished) and bad_all == 1


async def test_a_run_where_the_tpot_hold_holds_and_refuses_replays_identically(flexlb_up, tmp_path):
    """The shipped defaults under a burst: 80 requests at once on 2 workers at engine speed,
    each stating a 40 ms TPOT target, which ~25 decodes a worker reach: the TPOT hold keeps the
    rest at the router, serves what frees up in time and refuses (slo_unattainable) what cannot
    start before its TTFT target. The decode model learned from the reports, and the journal
    replays to the same decisions, holds and refusals included."""
    _, state = flexlb_up("--workers", "2", "--time-scale", "1")
    url = state["router_url"]
    rng = random.Random(5)
    bodies = [{"prompt": "".join(rng.choice("klmnopqrst ") for _ in range(400)) + f" {i}", "max_tokens": 60,
               "slo_ttft_ms": 1200, "slo_tpot_ms": 40} for i in range(80)]
    results = await run_concurrent_streams(url, bodies)
    refused = [r for r in results if any(isinstance(e, dict) and e.get("code") == "slo_unattainable"
                                         and "TPOT" in e.get("message", "") for e in r["errors"])
               or (r["status"] == 429 and "slo_unattainable" in "".join(map(str, r["errors"])))]
    served = [r for r in results if r["done"] and not r["errors"]]
    assert refused and served and len(refused) + len(served) == len(results), (len(refused), len(served))
    async with httpx.AsyncClient() as c:
        workers = (await c.get(url + "/admin/workers")).json()["workers"]
    assert all(w["decode_model"]["num_observations"] > 0 for w in workers), workers
    await wait_quiet(url)
    path = str(tmp_path / "tpot.jsonl.gz")
    export(state, path)
    rc, summary = replay_json(path)
    print({"refused": len(refused), "served": len(served), **{k: summary[k] for k in ("events", "decisions", "matched")}})
    assert rc == 0 and summary["errors"] == [] and summary["gaps"] == [], summary
    assert summary["decisions"] >= 80 and summary["matched"] == summary["decisions"], summary
    assert summary["first_divergence"] is None


def test_a_journal_recorded_before_the_core_was_reorganised_replays_identically():
    """tests/golden/journal-before-issue26.jsonl.gz: `flexlb events export` of a `flexlb up`
    run (3 workers, 60 requests: completions streamed and not, chat with a shared system
    prompt) recorded before issue 26 moved the core's modules. Every later version must
    replay it to the same decisions: a move that changes behaviour shows here."""
    from services.eventlog import replay_file

    summary, _ = replay_file(str(pathlib.Path(__file__).parent.parent / "golden" / "journal-before-issue26.jsonl.gz"),
                             progress=False)
    assert summary["journals"] == 1 and summary["decisions"] == 114
    assert summary["matched"] == summary["decisions"] and summary["first_divergence"] is None
    assert not summary["errors"] and not summary["gaps"]

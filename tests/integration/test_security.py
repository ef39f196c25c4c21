"""Security rules on a running stack (issue 37). First part: identity. With API keys set,
every request needs a known key, its tenant is the key's whatever header it sends, and the
keys never appear on a command line."""

from __future__ import annotations

import json
import pathlib

import httpx

KEYS = {"k-alpha-5f1c2e": "alpha", "k-beta-9a7d4b": "beta"}


def _cmdlines() -> list[str]:
    out = []
    for p in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append(p.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return out


def test_with_api_keys_a_request_needs_a_known_key_and_its_tenant_is_the_keys(flexlb_up, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"k-gamma-77e0aa": "gamma"}))
    _, state = flexlb_up("--workers", "1", "--time-scale", "0.05", "--tenant-api-keys-file", str(keys_file),
                         env={"FLEXLB_TENANT_API_KEYS": json.dumps(KEYS)})
    url = state["router_url"]
    body = {"prompt": "who am i", "max_tokens": 4}
    for headers in ({}, {"x-flexlb-tenant": "alpha"}, {"authorization": "Bearer wrong"},
                    {"authorization": "k-alpha-5f1c2e"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert "k-alpha" not in r.text
    tenants = []
    for key, claimed in (("k-alpha-5f1c2e", "beta"), ("k-beta-9a7d4b", None), ("k-gamma-77e0aa", None)):
        headers = {"authorization": f"Bearer {key}", **({"x-flexlb-tenant": claimed} if claimed else {})}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        rec = httpx.get(url + f"/admin/requests/{r.headers['x-request-id']}", timeout=10).json()
        tenants.append(rec["tenant"])
    assert tenants == ["alpha", "beta", "gamma"]  # the key's, not the header's
    # The keys are in no process's command line (up passes them to its router by environment).
    lines = _cmdlines()
    assert any("services.cli router" in line for line in lines)
    assert not [line for line in lines if any(k in line for k in (*KEYS, "k-gamma-77e0aa"))]


def test_a_thousand_bogus_tenants_and_models_add_a_bounded_number_of_series(flexlb_up):
    """Tenant and model labels name configured tenants and served pools only: bogus ones are
    counted as `other` / `unknown`, so a client cannot grow /metrics (or the router's memory)."""
    _, state = flexlb_up("--workers", "1", "--time-scale", "0.05", "--tenant-weights", '{"known": 1.0}')
    url = state["router_url"]

    def series() -> int:
        text = httpx.get(url + "/metrics", timeout=10).text
        return sum(1 for line in text.splitlines() if line.startswith(("flexlb_tenant_", "flexlb_model_requests")))

    router_pid = state["pids"]["router"]

    def rss_kb() -> int:
        status = pathlib.Path(f"/proc/{router_pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))

    with httpx.Client(timeout=30) as c:
        for i in range(200):  # warm: the code paths, allocator arenas and label sets a steady router has
            c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, **({"model": f"warm-{i}"} if i % 2 else {})},
                   headers={"x-flexlb-tenant": "known" if i % 3 else f"warm-{i}"})
        before, rss_before = series(), rss_kb()
        for i in range(1000):
            c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, **({"model": f"bogus-{i}"} if i % 2 else {})},
                   headers={"x-flexlb-tenant": f"bogus-{i}"})
        text = c.get(url + "/metrics").text
    grown_kb = rss_kb() - rss_before
    print(f"router RSS {rss_before} kB -> {rss_before + grown_kb} kB over 1,000 bogus names")
    assert series() <= before + 12, series() - before  # a few codes under `other` / `unknown`, not 1,000 names
    assert "bogus-" not in text and 'tenant="other"' in text and 'model="unknown"' in text
    # Memory: bounded, not a series and a record per name. The router keeps its last
    # RECENT_RECORDS_MAX request records (a few kB each, ring-bounded): a generous 16 MB.
    assert grown_kb < 16_000, grown_kb


def _events(state: dict, tmp_path, only: tuple) -> list:
    """Every event of `only`'s kinds in the stack's event log (`flexlb events export`)."""
    import subprocess
    import sys

    from services.eventlog import read_export

    out = str(tmp_path / "events.jsonl.gz")
    res = subprocess.run([sys.executable, "-m", "services.cli", "events", "export", "--nats-url", state["nats_url"],
                          "--out", out], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    _, envs, bad = read_export(out, only=only)
    assert bad == 0
    return [e.payload for e in envs]


def test_a_class_is_granted_not_claimed_and_the_event_records_both(flexlb_up, tmp_path):
    """alpha is granted critical; beta (not listed) gets the default grant: its `critical` is
    lowered to standard, served, and request.admitted says what it asked. With
    --strict-priority it would be a 403 (tests/unit/services/test_api_headers.py)."""
    from schemas import messages as m

    _, state = flexlb_up("--workers", "1", "--time-scale", "0.05",
                         "--tenant-classes", json.dumps({"alpha": ["standard", "critical"]}),
                         env={"FLEXLB_TENANT_API_KEYS": json.dumps(KEYS)})
    url = state["router_url"]
    ids = {}
    for who, key in (("alpha", "k-alpha-5f1c2e"), ("beta", "k-beta-9a7d4b")):
        r = httpx.post(url + "/v1/completions", json={"prompt": "vip", "max_tokens": 2, "priority_class": "critical"},
                       headers={"authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        ids[who] = r.headers["x-request-id"]
        rec = httpx.get(url + f"/admin/requests/{ids[who]}", timeout=10).json()
        assert rec["priority_class"] == ("critical" if who == "alpha" else "standard"), rec
    admitted = {e.request_id: e for e in _events(state, tmp_path, (m.RequestAdmitted,))}
    a, b = admitted[ids["alpha"]], admitted[ids["beta"]]
    assert (a.tenant, a.priority_class, a.priority_class_asked) == ("alpha", "critical", "")
    assert (b.tenant, b.priority_class, b.priority_class_asked) == ("beta", "standard", "critical")


def test_the_largest_allowed_fields_reach_the_event_log_and_a_2_mb_model_name_is_a_400_logged_too(flexlb_up, tmp_path):
    """Every event fits the bus's message limit by construction: a request with the largest
    id, model name (an unserved one: model_not_found names it) and tenant allowed, and one with
    a 2 MB model name (400), each leave their event in the log (a 2 MB field once made the
    rejection exceed NATS's 1 MiB limit: retried for 60 s, then lost)."""
    from schemas import messages as m

    _, state = flexlb_up("--workers", "1", "--time-scale", "0.05")
    url = state["router_url"]
    long_id, model, tenant = "r" * 128, "m" * 256, "t" * 64
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": model, "request_id": long_id},
                   headers={"x-flexlb-tenant": tenant}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": "x" * 2_000_000,
                                                  "request_id": "huge-model"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request" and len(r.content) < 2000
    huge = r.headers["x-request-id"]  # (the body did not parse: the router named it)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "request_id": "s" * 128},
                   headers={"x-flexlb-tenant": tenant}, timeout=30)
    assert r.status_code == 200, r.text
    events = _events(state, tmp_path, (m.RequestRejected, m.RequestAdmitted))
    rejected = {e.request_id: e for e in events if isinstance(e, m.RequestRejected)}
    assert rejected[long_id].code == "model_not_found" and rejected[huge].code == "invalid_request"
    assert len(rejected[huge].message) < 200
    assert any(isinstance(e, m.RequestAdmitted) and e.request_id == "s" * 128 and e.tenant == tenant for e in events)


def test_a_fresh_flexlb_up_closes_its_admin_api_and_the_cli_finds_the_token(flexlb_up, tmp_path):
    """No token given: `up` generates one, keeps it in a 0600 file it names in its state file
    (also 0600), passes it to its router by environment; /admin/* is 401 without it, the CLI
    sends it unasked, a cross-site POST is refused even with it, /healthz names no address."""
    import os
    import stat
    import subprocess
    import sys

    proc, state = flexlb_up("--workers", "1", "--time-scale", "0.05", open_admin=False)
    url = state["router_url"]
    token_file = state["admin_token_file"]
    assert token_file and stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    state_files = [p for p in tmp_path.glob("state-*.json")] + [tmp_path / "last-up.json"]
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in state_files)
    token = pathlib.Path(token_file).read_text().strip()
    assert len(token) >= 32 and all(token not in p.read_text() for p in state_files)  # the file's path, not the token
    assert not [line for line in _cmdlines() if token in line]
    for path in ("/admin/workers", "/admin/ledger", "/admin/router", "/admin/requests/x"):
        r = httpx.get(url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (path, r.text)
    r = httpx.post(url + "/admin/workers/w0/drain", timeout=10)
    assert r.status_code == 401
    auth = {"authorization": f"Bearer {token}"}
    assert httpx.get(url + "/admin/workers", headers=auth, timeout=10).status_code == 200
    # A page on another site, even holding the token, cannot drain a worker with a simple request.
    r = httpx.post(url + "/admin/workers/w0/drain", headers={**auth, "content-type": "text/plain"}, content=b"{}", timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = httpx.post(url + "/admin/workers/w0/drain", headers={**auth, "origin": "http://evil.example"}, json={}, timeout=10)
    assert r.status_code == 403
    workers = httpx.get(url + "/admin/workers", headers=auth, timeout=10).json()["workers"]
    assert all(w["state"] == "ready" for w in workers)
    # The CLI finds the router and its token through the last `up`'s state (FLEXLB_UP_STATE).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FLEXLB_")},
           "FLEXLB_UP_STATE": str(tmp_path / "last-up.json")}
    res = subprocess.run([sys.executable, "-m", "services.cli", "workers", "list"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0 and json.loads(res.stdout)["workers"], res.stdout + res.stderr
    # Hostile bodies against the real router: nested past the decoder's bound, a 2 MB model name
    # (tests/unit/services/test_api_headers.py has the rest): 400, never a 500 or a traceback.
    for body in (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", json.dumps({"prompt": "x", "model": "m" * 300}).encode()):
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text[:200]
    # /healthz is public: it names no address (the NATS server is on /admin/router).
    health = httpx.get(url + "/healthz", timeout=10)
    assert health.status_code == 200 and "nats" not in health.text and "127.0.0.1" not in health.text
    assert httpx.get(url + "/admin/router", headers=auth, timeout=10).json()["nats_server"].startswith("nats://")


def test_admin_port_takes_the_admin_api_and_docs_off_the_public_port(flexlb_up, tmp_path):
    import os
    import subprocess
    import sys

    from services.infra import free_port

    admin_port = free_port()
    _, state = flexlb_up("--workers", "1", "--time-scale", "0.05", "--admin-port", str(admin_port), open_admin=False)
    url, admin = state["router_url"], state["admin_url"]
    assert admin == f"http://127.0.0.1:{admin_port}"
    auth = {"authorization": "Bearer " + pathlib.Path(state["admin_token_file"]).read_text().strip()}
    for path in ("/admin/workers", "/docs", "/openapi.json", "/admin"):
        r = httpx.get(url + path, headers=auth, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
    ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and httpx.get(url + "/metrics", timeout=10).status_code == 200
    assert httpx.get(admin + "/admin/workers", timeout=10).status_code == 401  # its own port, still closed
    assert httpx.get(admin + "/admin/workers", headers=auth, timeout=10).status_code == 200
    assert "/v1/completions" in httpx.get(admin + "/openapi.json", timeout=10).json()["paths"]
    r = httpx.post(admin + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 404
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FLEXLB_")},
           "FLEXLB_UP_STATE": str(tmp_path / "last-up.json")}
    res = subprocess.run([sys.executable, "-m", "services.cli", "workers", "drain", "w0"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert res.returncode == 0 and json.loads(res.stdout)["state"] in ("draining", "drained"), res.stdout + res.stderr


async def test_nats_and_redis_refuse_a_client_without_the_credentials_up_generated(flexlb_up, tmp_path):
    """`flexlb up` starts nats-server and redis-server with a generated user and password: a
    client without them is refused by both; the credentials are in a 0600 file (not in the
    state file, and on no command line), and what up started works with them."""
    import asyncio
    import os
    import stat
    from urllib.parse import urlsplit

    import nats
    import redis.asyncio as aioredis

    _, state = flexlb_up("--workers", "1", "--time-scale", "0.05")
    nats_url, redis_url = state["nats_url"], state["redis_url"]  # (the fixture adds the credentials)
    password = urlsplit(redis_url).password
    assert password and urlsplit(nats_url).password == password
    raw_state = json.loads(next(tmp_path.glob("state-*.json")).read_text())
    assert password not in json.dumps(raw_state) and stat.S_IMODE(os.stat(raw_state["secrets_file"]).st_mode) == 0o600
    assert not [line for line in _cmdlines() if password in line]
    bare_nats, bare_redis = raw_state["nats_url"], raw_state["redis_url"]
    assert "@" not in bare_nats + bare_redis
    for connect in ("{}", json.dumps({"user": "flexlb", "pass": "wrong"})):  # the protocol itself: no client magic
        host, port = urlsplit(bare_nats).hostname, urlsplit(bare_nats).port
        reader, writer = await asyncio.open_connection(host, port)
        await reader.readline()  # INFO
        writer.write(f"CONNECT {connect}\r\nPING\r\n".encode())
        await writer.drain()
        said = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert said.startswith(b"-ERR") and b"Authorization Violation" in said, said
    for url in (bare_redis, redis_url.replace(password, "wrong")):
        r = aioredis.from_url(url, socket_timeout=2)
        try:
            await r.ping()
            raise AssertionError("Redis answered without the password")
        except aioredis.AuthenticationError:
            pass
        except aioredis.ResponseError as exc:
            assert "NOAUTH" in str(exc) or "WRONGPASS" in str(exc), exc
        finally:
            await r.aclose()
    nc = await nats.connect(nats_url, connect_timeout=2)
    await nc.close()
    r = aioredis.from_url(redis_url)
    assert await r.ping()
    await r.aclose()
    ok = httpx.post(state["router_url"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # the router and worker have them


def test_what_held_still_holds_on_a_real_stack(flexlb_up, tmp_path):
    """Body size (413), request ids that would be NATS subject wildcards or separators (400),
    and no secret (admin token, API key, NATS / Redis password) in any log of the stack or in
    its event log."""
    from urllib.parse import urlsplit

    from schemas import messages as m

    _, state = flexlb_up("--workers", "1", "--time-scale", "0.05", open_admin=False,
                         env={"FLEXLB_MAX_BODY_BYTES": "65536", "FLEXLB_TENANT_API_KEYS": json.dumps(KEYS)})
    url = state["router_url"]
    key = {"authorization": "Bearer k-alpha-5f1c2e"}
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 2}, headers=key, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    for rid in ("a.b", "a*", "a>", "a b", "x" * 129):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "request_id": rid}, headers=key,
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (rid, r.text)
        assert len(r.content) < 400 and (rid in r.text) == (len(rid) <= 40), r.text  # echoed at most 40 characters
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=key, timeout=30).is_success
    secrets = [pathlib.Path(state["admin_token_file"]).read_text().strip(), urlsplit(state["redis_url"]).password,
               *KEYS]
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert logs and not [s for s in secrets if s in logs]
    events = _events(state, tmp_path, (m.RequestRejected, m.RequestAdmitted, m.RouteDecided, m.WorkerRegistered))
    assert events and not [s for s in secrets if s in json.dumps([msgspec_to_builtins(e) for e in events])]


def msgspec_to_builtins(event) -> object:
    import msgspec

    return msgspec.to_builtins(event)

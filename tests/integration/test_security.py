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

    with httpx.Client(timeout=30) as c:
        c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-flexlb-tenant": "known"})
        before = series()
        for i in range(1000):
            c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, **({"model": f"bogus-{i}"} if i % 2 else {})},
                   headers={"x-flexlb-tenant": f"bogus-{i}"})
        text = c.get(url + "/metrics").text
    assert series() <= before + 12, series() - before  # a few codes under `other` / `unknown`, not 1,000 names
    assert "bogus-" not in text and 'tenant="other"' in text and 'model="unknown"' in text

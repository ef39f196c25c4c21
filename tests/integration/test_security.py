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

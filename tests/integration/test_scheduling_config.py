"""`flexlb up --scheduling-config FILE`: the routers schedule with the file's pipeline, and a
request's record shows each scorer's score on every candidate's card."""

from __future__ import annotations

import httpx


async def test_a_scheduling_config_file_routes_through_its_pipeline(flexlb_up, tmp_path):
    path = tmp_path / "scheduling.yaml"
    path.write_text("prefill:\n  filters: [{type: gated}]\n  scorers:\n    - {type: prefix-affinity, weight: 2}\n"
                    "    - {type: fewest-pending}\n  picker: {type: max-score}\n")
    proc, state = flexlb_up("--time-scale", "0", "--workers", "2", "--scheduling-config", str(path))
    url = state["router_url"]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(url + "/v1/completions", json={"prompt": "a pipeline " * 20, "max_tokens": 2})
        assert r.status_code == 200, r.text
        record = (await c.get(url + f"/admin/requests/{r.json()['id']}")).json()
    [prefill] = [d for d in record["decisions"] if d["stage"] == "prefill"]
    assert prefill["policy"] == "pipeline" and prefill["reason"].startswith("highest score"), prefill
    assert len(prefill["candidates"]) == 2
    for card in prefill["candidates"]:
        assert {"score.prefix-affinity", "score.fewest-pending"} <= set(card["components"]), card
    assert proc.stop() == 0

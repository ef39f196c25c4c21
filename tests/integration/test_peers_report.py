"""bench/peers_report.py and the report side of bench/peers.py: merging reports of one
workload, the headline at another target and over repeats, misses by kind, the matrix of
(engine mode, workload, configuration) cells, the capacity bound's flag; and one tiny
bench/peers.py run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


def run(config, mult, load, att, **kw):
    return {"config": config, "multiplier": mult, "load_req_per_s": load, "attainment": att, **kw}


def test_a_tiny_peers_run_of_the_chat_workload_on_both_engine_modes(tmp_path):
    """bench/peers.py end to end: the chat workload through direct round-robin to sim-servers
    of both engine modes (each started with --scheduler), and its report rendered again."""
    out = tmp_path / "chat.json"
    cmd = [sys.executable, str(REPO / "bench" / "peers.py"), "--trace", "chat", "--rows", "6", "--workers", "2",
           "--configs", "direct-round-robin", "--engine-modes", "vllm,sglang", "--rates", "4", "--time-scale", "0.05",
           "--drain-s", "20", "--warmup", "1", "--per-request", "--out", str(out)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode in (0, 3), res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["headline"]) == {"direct-round-robin[vllm]", "direct-round-robin[sglang]"}
    for r in result["runs"]:
        assert r["requests"] == 6 and r["completed"] == 6, r.get("errors")
        assert r["commands"] and all(c.split("--scheduler ")[1].startswith(r["engine_mode"]) for c in r["commands"])
        assert r["misses"]["not_completed"] == 0
        assert [x[-1] for x in r["per_request"]][0] == "chat-s00000-t00"
    assert result["workload"]["prefix_reuse_unbounded"] > 0
    assert set(result["capacity_by_mode"]) == {"vllm", "sglang"}
    assert result["workload"]["rows_chosen"] == "given"
    again = subprocess.run([sys.executable, str(REPO / "bench" / "peers_report.py"), str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode in (0, 3), again.stderr
    assert "direct-round-robin" in again.stdout and "sglang" in again.stdout

"""services/core/view.py's readiness reason: each worker that is not live, and why, in one
bounded line (what /readyz and `flexlb up` print). (The processes under signals:
tests/integration/test_signals.py.)"""

from __future__ import annotations

import pytest

from schemas.messages import WorkerStatusReported
from services.core.view import READINESS_REASON_MAX, WorkerView


# ---------------------------------------------------------------------------- the reason (pure core)
def status(worker_id: str, state: str = "ready", reason: str = "") -> WorkerStatusReported:
    return WorkerStatusReported(worker_id=worker_id, role="pd_fusion", boot_id="b", state=state,
                                not_ready_reason=reason)


def view_of(*events, dead: tuple[str, ...] = (), drained: tuple[str, ...] = ()) -> WorkerView:
    view = WorkerView()
    for e in events:
        view.apply(e, 1)
    for w in dead:
        view.workers[w].liveness, view.workers[w].num_missed_syncs = "dead", 3
    view.set_drain_flags(set(drained))
    return view


@pytest.mark.parametrize("view, reason", [
    (view_of(), "no worker has reported yet"),
    (view_of(status("w0", "not_ready", "engine server http://x unreachable: connection refused")),
     "no live worker for role pd_fusion: w0 not_ready (engine server http://x unreachable: connection refused)"),
    (view_of(status("w0", "not_ready", "no\nserver"), status("w1"), dead=("w1",)),
     "no live worker for role pd_fusion: w0 not_ready (no server); w1 dead (no status for 3 liveness cycles)"),
    (view_of(status("w0", "stopping"), status("w1"), drained=("w1",)),
     "no live worker for role pd_fusion: w0 stopping; w1 drained by an operator"),
    (view_of(*(status(f"w{i}", "not_ready", "x" * 500) for i in range(9))),
     None),  # nine long reasons: four shown (cut), five counted, the whole cut to the bound
    (view_of(status("w0"), status("w1", "not_ready", "busy")), "ok"),
], ids=["nobody", "one-not-ready", "not-ready-and-dead", "stopping-and-drained", "bounded", "one-live-is-enough"])
def test_readiness_reason_names_each_worker_not_live_and_why(view, reason):
    ready, said = view.readiness()
    assert ready == (reason == "ok")
    assert "\n" not in said and len(said) <= READINESS_REASON_MAX
    if reason is not None:
        assert said == reason
    else:
        assert said.startswith("no live worker for role pd_fusion: w0 not_ready (xxx") and "w3 not_ready" in said
        assert "w4 " not in said and said.endswith(("5 more", "..."))

"""Admin: operator actions and views.

Owns: drain flags (in Redis, so every router replica honours them), drain / undrain / remove,
the "drained" event once a draining worker holds nothing, and the workers view of
GET /admin/workers. Calls: Redis, the core, recovery (a forced remove). Called by: the
HTTP API, recovery (each liveness cycle).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from schemas import messages as m
from services.core.scheduler import DEGRADED_RATIO
from services.shell.state import RouterState

if TYPE_CHECKING:
    from services.shell.recovery import Recovery

log = logging.getLogger("flexlb.router")


class Admin:
    def __init__(self, state: RouterState, recovery: "Recovery") -> None:
        self.s = state
        self.recovery = recovery
        self.reported_drained: set[str] = set()  # draining workers whose "drained" event went out

    def drain_key(self, worker_id: str) -> str:
        return f"flexlb:{self.s.settings.cluster}:drain:{worker_id}"

    async def refresh_drain_flags(self) -> None:
        """Drain flags live in Redis, so every router replica (and a restarted one) honours them."""
        prefix = f"flexlb:{self.s.settings.cluster}:drain:"
        try:
            flags = {k.decode()[len(prefix):] if isinstance(k, bytes) else k[len(prefix):]
                     async for k in self.s.redis.scan_iter(match=prefix + "*", count=500)}
        except Exception as exc:  # Redis away: keep the flags we have
            log.warning("could not read drain flags: %s", exc)
            return
        self.s.scheduler.set_drain_flags(flags)
        self.reported_drained &= flags | self.s.seen_draining  # (a worker's own drain: once, until it is back)

    async def report_drained(self) -> None:
        """Once per drain: an operator's (the drain flag) or the worker's own (it reports
        "draining": told to stop, it finishes what it holds), when it holds nothing more."""
        view = self.s.scheduler.view
        for worker_id in sorted((view.drain_flags | self.s.seen_draining) - self.reported_drained):
            if worker_id in view.workers and self.s.scheduler.holds_work(worker_id) == 0:
                self.reported_drained.add(worker_id)
                by = "" if worker_id in view.drain_flags else "worker"
                await self.s.emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.s.router_id, action="drained",
                                                       by=by))
                log.info("worker %s drained%s", worker_id, " (stopping)" if by else "")

    def worker_state(self, worker_id: str) -> str:
        w = self.s.scheduler.view.workers.get(worker_id)
        if w is None:
            return "unknown"
        if w.draining or (worker_id in self.s.seen_draining and w.liveness in ("ready", "suspect")):
            return "drained" if worker_id in self.reported_drained else "draining"
        if w.liveness == "dead" and w.state == "stopping":
            return "stopped"  # silent after saying it stops: not a failure
        return w.state if w.liveness in ("ready", "suspect") else w.liveness

    async def drain(self, worker_id: str, by: str) -> dict[str, Any]:
        await self.s.redis.set(self.drain_key(worker_id), by or "admin")
        await self.refresh_drain_flags()
        await self.s.emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.s.router_id, action="drain", by=by))
        await self.report_drained()
        return {"worker_id": worker_id, "state": self.worker_state(worker_id)}

    async def undrain(self, worker_id: str, by: str) -> dict[str, Any]:
        await self.s.redis.delete(self.drain_key(worker_id))
        await self.refresh_drain_flags()
        await self.s.emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.s.router_id, action="undrain", by=by))
        self.s.wakeup.set()
        return {"worker_id": worker_id, "state": self.worker_state(worker_id)}

    async def remove(self, worker_id: str, force: bool, by: str) -> tuple[bool, dict[str, Any]]:
        """Forget a worker. Refused while it holds work, unless forced: then its requests are
        re-routed (not started) or failed retryable (started), as for a dead worker."""
        if worker_id not in self.s.scheduler.view.workers:
            return False, {"code": "not_found", "message": f"no worker {worker_id}"}
        held = self.s.scheduler.holds_work(worker_id)
        if held and not force:
            return False, {"code": "conflict", "message": f"worker {worker_id} holds {held} requests; drain it first or force"}
        moved = 0
        # Re-routes must go elsewhere. Marking it dead is not enough: the recovery below awaits
        # the bus, a heartbeat of the (still running) worker revives it meanwhile, and a
        # re-route then picked it again. That dispatch carried a request the worker had just
        # been told to withdraw, so the worker dropped it silently and its client hung. A drain
        # flag survives a re-registration; it is cleared below, once the worker is forgotten.
        await self.s.redis.set(self.drain_key(worker_id), f"removing:{by or 'admin'}")
        await self.refresh_drain_flags()
        self.s.scheduler.mark_dead(worker_id)
        if held:
            await self.recovery.recover_dead_worker(worker_id, "removed")
            moved = held
        for item in self.s.scheduler.remove_worker(worker_id):
            moved += 1
            await self.recovery.reroute(item.payload, f"worker {worker_id} removed by an operator")
        await self.s.redis.delete(self.drain_key(worker_id))
        await self.refresh_drain_flags()
        await self.s.emit(m.WorkerDrainChanged(worker_id=worker_id, router_id=self.s.router_id, action="removed", by=by,
                                              num_requests_moved=moved))
        return True, {"worker_id": worker_id, "removed": True, "num_requests_moved": moved}

    def workers_view(self) -> list[dict[str, Any]]:
        now = time.time_ns()
        ratios = self.s.scheduler.step_ratios()
        out = []
        for w in sorted(self.s.scheduler.view.workers.values(), key=lambda w: w.worker_id):
            live = w.is_live()
            out.append({
                "id": w.worker_id, "role": w.role, "model": w.model, "lora_adapters": list(w.lora_adapters),
                "live": live, "liveness": w.liveness, "num_missed_syncs": w.num_missed_syncs,
                "draining": w.draining, "state": self.worker_state(w.worker_id), "reported_state": w.state,
                "not_ready_reason": w.not_ready_reason,
                # Which signals it has from its engine (EngineSignals): the openai agent's
                # server may give no /metrics, no token ids, no KV events.
                "signals": msgspec.structs.asdict(w.signals) if w.signals is not None else None,
                "num_dispatched": self.s.num_dispatched.get(w.worker_id, 0),
                "num_finished": self.s.num_finished.get(w.worker_id, 0),
                "num_held": self.s.scheduler.holds_work(w.worker_id), "pid": w.pid, "host": w.host, "engine": w.engine, "boot_id": w.boot_id,
                "last_heartbeat_ns": w.last_heartbeat_ns,
                "last_heartbeat_age_ms": round((now - w.last_heartbeat_ns) / 1e6, 1),
                "num_kv_blocks": w.num_kv_blocks, "num_free_kv_blocks": w.num_free_kv_blocks,
                "num_running_requests": w.num_running_requests, "num_queued_batches": w.num_queued_batches,
                "num_queued_at_router": len(self.s.scheduler.batchers[w.worker_id]) if w.worker_id in self.s.scheduler.batchers else 0,
                "num_restarts": w.num_restarts,
                # its circuit breaker (services/core/breaker.py): state, consecutive failures, last error
                "breaker": self.s.scheduler.breakers.get_view(w.worker_id, now),
                # slower than its peers: its learned decode step over theirs (Scheduler.step_ratios);
                # degraded at DEGRADED_RATIO or more (it keeps getting fewer requests: the policies read its steps)
                "step_ratio": ratios.get(w.worker_id),
                "degraded": ratios.get(w.worker_id, 0.0) >= DEGRADED_RATIO,
                **self.decode_model_view(w.worker_id, w.role),
            })
        return out

    def decode_model_view(self, worker_id: str, role: str) -> dict[str, Any]:
        """What the router learned of the worker's decode steps (services/core/decode_model.py)
        and the TPOT it predicts there now; nothing for a prefill worker."""
        sch = self.s.scheduler
        if role == "prefill":
            return {}
        model = sch.decode_model(worker_id)
        running, kv = sch.engine_load(worker_id)
        return {"decode_model": {"base_ms": round(model.a, 3), "per_request_ms": round(model.b, 4),
                                 "per_kilotoken_ms": round(model.c, 4), "num_observations": model.num_observations,
                                 "mean_abs_pct_error": round(model.mean_abs_pct_error, 2),
                                 # the TPOT its finished requests got against the step predicted at dispatch
                                 "tpot_calibration": {"intercept_ms": round(model.tpot_intercept_ms, 3),
                                                      "slope": round(model.tpot_slope, 4),
                                                      "num_requests": model.num_tpot_observations},
                                 "recent_tpot_ms": round(model.recent_tpot_ms, 2)},
                "predicted_step_ms": round(model.predict_ms(running, kv), 2) if running else None,
                "predicted_tpot_ms": round(model.predict_tpot_ms(running, kv), 2) if running else None}


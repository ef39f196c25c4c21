"""The router's view of the fleet: a fold of worker registration and status events.

`WorkerView.apply(event, now_ns)` folds one event; queries take `now_ns` and a liveness
timeout. A worker is *live* when its last status report is younger than the timeout
(issue 5 replaces this with the full Pending/Ready/Suspect/Dead/Expired machine). A worker
whose `boot_id` changes has restarted: its counters reset.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.messages import WorkerRegistered, WorkerStatusReported


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    boot_id: str
    engine: str = "sim"
    pid: int = 0
    host: str = ""
    state: str = "ready"  # as the worker reports it: ready | draining | stopping
    block_size_tokens: int = 16
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    max_batch_tokens: int = 0
    max_seq_len_tokens: int = 0
    num_running_requests: int = 0
    num_queued_batches: int = 0
    first_seen_ns: int = 0
    last_heartbeat_ns: int = 0  # router's receive time of the last report
    num_restarts: int = 0

    def is_live(self, now_ns: int, timeout_ns: int) -> bool:
        return self.state == "ready" and now_ns - self.last_heartbeat_ns <= timeout_ns

    def serves_prefill(self) -> bool:
        return self.role in ("pd_fusion", "prefill")

    def serves_decode(self) -> bool:
        return self.role in ("pd_fusion", "decode")


class WorkerView:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}  # worker id -> info
        self.roles_seen: set[str] = set()

    def apply(self, event: WorkerRegistered | WorkerStatusReported, now_ns: int) -> WorkerInfo:
        info = self.workers.get(event.worker_id)
        if info is None:
            info = WorkerInfo(worker_id=event.worker_id, role=event.role, boot_id=event.boot_id, first_seen_ns=now_ns)
            self.workers[event.worker_id] = info
        elif info.boot_id != event.boot_id:
            info.boot_id = event.boot_id
            info.num_restarts += 1
        info.role = event.role
        self.roles_seen.add(event.role)
        info.engine = event.engine
        info.pid = event.pid
        info.host = event.host
        info.block_size_tokens = event.block_size_tokens
        info.max_batch_tokens = event.max_batch_tokens
        info.max_seq_len_tokens = event.max_seq_len_tokens
        if isinstance(event, WorkerStatusReported):
            info.state = event.state
            info.num_kv_blocks = event.num_kv_blocks
            info.num_free_kv_blocks = event.num_free_kv_blocks
            info.num_running_requests = event.num_running_requests
            info.num_queued_batches = event.num_queued_batches
            info.last_heartbeat_ns = now_ns
        else:
            info.num_kv_blocks = event.num_kv_blocks
        return info

    def live(self, now_ns: int, timeout_ns: int) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.is_live(now_ns, timeout_ns)]

    def roles_in_use(self) -> set[str]:
        """pd_fusion if colocated workers were seen; prefill+decode if either PD role was."""
        roles: set[str] = set()
        if "pd_fusion" in self.roles_seen:
            roles.add("pd_fusion")
        if self.roles_seen & {"prefill", "decode"}:
            roles |= {"prefill", "decode"}
        return roles

    def readiness(self, now_ns: int, timeout_ns: int) -> tuple[bool, str]:
        """Ready when every role in use has at least one live worker; the reason says why not."""
        roles = self.roles_in_use()
        if not roles:
            return False, "no worker has reported yet"
        live_roles = {w.role for w in self.live(now_ns, timeout_ns)}
        missing = sorted(roles - live_roles)
        if missing:
            return False, "no live worker for role " + ", ".join(missing)
        return True, "ok"

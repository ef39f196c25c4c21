"""Every NATS subject and JetStream stream FlexLB uses, built in one place.

| what                         | subject                           | delivery                               |
|------------------------------|-----------------------------------|----------------------------------------|
| worker status heartbeats     | flexlb.evt.status.<worker>        | stream FLEXLB_STATUS (last few per worker) |
| worker lifecycle events      | flexlb.evt.req.<worker>           | stream FLEXLB_EVENTS                   |
| router decisions / lifecycle | flexlb.evt.router.<router>        | stream FLEXLB_EVENTS                   |
| admin actions                | flexlb.evt.admin                  | stream FLEXLB_EVENTS                   |
| KV-cache events              | flexlb.evt.kv.<worker>            | stream FLEXLB_EVENTS                   |
| batch dispatch commands      | flexlb.cmd.dispatch.<worker>      | work-queue stream FLEXLB_DISPATCH      |
| PD decode hand-off           | flexlb.cmd.decode.<worker>        | work-queue stream FLEXLB_DISPATCH      |
| cancel                       | flexlb.cmd.cancel.<worker>        | core NATS, best effort                 |
| KV snapshot request          | flexlb.cmd.kvsnapshot.<worker>    | core NATS; the snapshot is a KV event  |
| fencing epoch                | flexlb.cmd.epoch.<worker>         | core NATS, repeated every liveness cycle |
| forwarded requests (standby) | flexlb.cmd.submit.<cluster>       | core NATS request-reply to the leader  |
| tokens                       | flexlb.tok.<router>.<request>     | core NATS                              |
| tokens, coalesced            | flexlb.tok.<router>               | core NATS (TokensBatch)                |
| dead letters                 | flexlb.dlq.<component>            | stream FLEXLB_DLQ                      |

Ids used in subjects must be subject-safe tokens: `validate_token` enforces it.
"""

from __future__ import annotations

import hashlib
import re

import msgspec

PREFIX = "flexlb"

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def nats_servers(url: str) -> list[str]:
    """The server URLs of a NATS setting: one URL, or a cluster's, comma-separated
    (`nats://a:4222,nats://b:4222`). A client is given every one and moves to another
    server when its own is lost. ValueError names a malformed entry."""
    servers = [u.strip() for u in url.split(",")]
    for u in servers:
        if not re.fullmatch(r"(nats|tls)://[^\s,/]+(:\d+)?/?", u):
            raise ValueError(f"not a NATS server URL: {u!r} (nats://host:port, comma-separated for a cluster)")
    return servers


def validate_token(kind: str, value: str) -> str:
    """Return `value` if it is usable as one subject token, else raise ValueError."""
    if not _TOKEN_RE.match(value):
        shown = repr(value[:40]) + ("..." if len(value) > 40 else "")  # (a client's bytes: echoed at most 40)
        raise ValueError(f"{kind} {shown} must be 1-128 characters of [A-Za-z0-9_-]")
    return value


def status_subject(worker_id: str) -> str:
    return f"{PREFIX}.evt.status.{worker_id}"


def worker_events_subject(worker_id: str) -> str:
    return f"{PREFIX}.evt.req.{worker_id}"


def router_events_subject(router_id: str) -> str:
    return f"{PREFIX}.evt.router.{router_id}"


def kv_events_subject(worker_id: str) -> str:
    return f"{PREFIX}.evt.kv.{worker_id}"


ADMIN_EVENTS_SUBJECT = f"{PREFIX}.evt.admin"
ALL_STATUS = f"{PREFIX}.evt.status.>"
ALL_WORKER_EVENTS = f"{PREFIX}.evt.req.>"
ALL_EVENTS = f"{PREFIX}.evt.>"


def dispatch_subject(worker_id: str) -> str:
    return f"{PREFIX}.cmd.dispatch.{worker_id}"


def decode_subject(worker_id: str) -> str:
    return f"{PREFIX}.cmd.decode.{worker_id}"


def cancel_subject(worker_id: str) -> str:
    return f"{PREFIX}.cmd.cancel.{worker_id}"


def resend_subject(worker_id: str) -> str:
    """Core NATS: a router asks the worker to publish a request's token chunks again."""
    return f"{PREFIX}.cmd.resend.{worker_id}"


def submit_subject(cluster: str, pool: str = "") -> str:
    """Where the leader router of a cluster takes requests forwarded by standby routers; with
    `pool` (routers leading one pool each, `scheduling_pool`), that pool's leader."""
    return f"{PREFIX}.cmd.submit.{cluster}" + (f".pool.{pool_token(pool)}" if pool else "")


def pool_token(pool: str) -> str:
    """A model (pool) name as one subject token or key part: model names hold '/' and '.'
    (Qwen/Qwen2.5-7B), so the safe characters are kept and a hash of the whole name keeps
    two names that differ only in the others apart."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", pool)[:40]
    return f"{safe}-{hashlib.sha1(pool.encode()).hexdigest()[:8]}"


ALL_ROUTER_EVENTS = f"{PREFIX}.evt.router.>"


def epoch_subject(worker_id: str) -> str:
    return f"{PREFIX}.cmd.epoch.{worker_id}"


def kv_snapshot_request_subject(worker_id: str) -> str:
    return f"{PREFIX}.cmd.kvsnapshot.{worker_id}"


ALL_KV_EVENTS = f"{PREFIX}.evt.kv.>"


def token_subject(router_id: str, request_id: str) -> str:
    return f"{PREFIX}.tok.{router_id}.{request_id}"


def all_tokens_subject(router_id: str) -> str:
    return f"{PREFIX}.tok.{router_id}.*"


def token_batch_subject(router_id: str) -> str:
    """Core NATS: a router's own token subject, where workers send it token chunks of many
    requests coalesced (TokensBatch); the per-request subjects above are one level below."""
    return f"{PREFIX}.tok.{router_id}"


def dlq_subject(component: str) -> str:
    return f"{PREFIX}.dlq.{component}"


def dispatch_consumer(worker_id: str) -> str:
    return f"worker-{worker_id}-dispatch"


def decode_consumer(worker_id: str) -> str:
    return f"worker-{worker_id}-decode"


def router_events_consumer(router_id: str) -> str:
    return f"router-{router_id}-events"


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream stream, in the form of the JetStream JSON API (nats-py reads it with
    `StreamConfig.from_response(spec.api_config())`)."""

    name: str
    subjects: list[str]
    retention: str  # "limits" | "workqueue"
    max_age_s: float  # 0: unlimited
    max_bytes: int  # -1: unlimited
    max_msgs_per_subject: int = -1
    duplicate_window_s: float = 120.0
    storage: str = "file"

    def api_config(self, replicas: int = 1) -> dict:
        """`replicas`: copies of the stream across a NATS cluster (1 on one server; 3 on a
        three-node cluster, so any one node can be lost). Consumers inherit it."""
        if not 1 <= replicas <= 5:
            raise ValueError(f"stream replicas must be 1..5 (JetStream's limit), got {replicas!r}")
        return {
            "name": self.name,
            "num_replicas": replicas,
            "subjects": list(self.subjects),
            "retention": self.retention,
            "max_age": int(self.max_age_s * 1e9),
            "max_bytes": self.max_bytes,
            "max_msgs_per_subject": self.max_msgs_per_subject,
            "duplicate_window": int(self.duplicate_window_s * 1e9),
            "storage": self.storage,
            "discard": "old",
        }


# Retention defaults: status is only needed "now" (last few per worker, one hour at most);
# the event log keeps a day or 1 GiB, whichever comes first; dispatch is a work queue whose
# messages leave on ack; dead letters are kept a week for forensics.
STATUS_STREAM = StreamSpec(
    name="FLEXLB_STATUS",
    subjects=[ALL_STATUS],
    retention="limits",
    max_age_s=3600,
    max_bytes=256 * 1024 * 1024,
    max_msgs_per_subject=8,
)
EVENTS_STREAM = StreamSpec(
    name="FLEXLB_EVENTS",
    subjects=[f"{PREFIX}.evt.req.>", f"{PREFIX}.evt.router.>", f"{PREFIX}.evt.kv.>", ADMIN_EVENTS_SUBJECT],
    retention="limits",
    max_age_s=24 * 3600,
    max_bytes=1024 * 1024 * 1024,
)
DISPATCH_STREAM = StreamSpec(
    name="FLEXLB_DISPATCH",
    subjects=[f"{PREFIX}.cmd.dispatch.>", f"{PREFIX}.cmd.decode.>"],
    retention="workqueue",
    max_age_s=3600,
    max_bytes=1024 * 1024 * 1024,
)
DLQ_STREAM = StreamSpec(
    name="FLEXLB_DLQ",
    subjects=[f"{PREFIX}.dlq.>"],
    retention="limits",
    max_age_s=7 * 24 * 3600,
    max_bytes=256 * 1024 * 1024,
)
# The core journal (`core.recorded`, one subject per router): what replay folds. Its
# retention defaults to the event log's; the router's settings journal_max_age_s /
# journal_max_bytes (and events_max_age_s / events_max_bytes) override them.
JOURNAL_STREAM = StreamSpec(
    name="FLEXLB_JOURNAL",
    subjects=[f"{PREFIX}.journal.>"],
    retention="limits",
    max_age_s=24 * 3600,
    max_bytes=1024 * 1024 * 1024,
)
ALL_STREAMS: tuple[StreamSpec, ...] = (STATUS_STREAM, EVENTS_STREAM, DISPATCH_STREAM, DLQ_STREAM, JOURNAL_STREAM)

# PD hand-off of real KV (the torch engine): the prefill worker puts the prompt's K/V here
# as one object per request (`kv_object_name`), the decode worker reads and deletes it. An
# object store, not messages: a 1b prompt of 2,000 tokens is ~45 MB, over any message limit;
# the store chunks it, checks its digest and keeps it until read. The TTL bounds what a
# decode worker that died before reading leaves behind.
KV_BUCKET = "FLEXLB_KV"
KV_BUCKET_TTL_S = 600


def kv_object_name(batch_id: str, request_id: str) -> str:
    return f"{batch_id}.{request_id}"


JOURNAL_PREFIX = f"{PREFIX}.journal."


def journal_subject(router_id: str) -> str:
    """Where a router's core journal goes (captured by FLEXLB_JOURNAL)."""
    return f"{PREFIX}.journal.{router_id}"

# Header names
HDR_MSG_ID = "Nats-Msg-Id"
HDR_DLQ_REASON = "Flexlb-Dlq-Reason"
HDR_DLQ_SUBJECT = "Flexlb-Dlq-Subject"


_USERINFO = re.compile(r"://[^@/,]*@")
_PASSWORD = re.compile(r"(://[^:@/,]*:)[^@/,]*@")


def redact_url(url: str) -> str:
    """A URL (or comma-separated URLs) with any password replaced by ***: for logs and output."""
    return _PASSWORD.sub(r"\1***@", url)


def strip_credentials(url: str) -> str:
    """A URL (or comma-separated URLs) without user and password: an address to show or store."""
    return _USERINFO.sub("://", url)

"""NATS helpers for the router: connection, idempotent stream setup, dead letters."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import nats
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError

from schemas.subjects import ALL_STREAMS, HDR_DLQ_REASON, HDR_DLQ_SUBJECT, dlq_subject

log = logging.getLogger("flexlb.bus")


async def connect(url: str | list[str], name: str, on_state: Callable[[str], Awaitable[None]] | None = None) -> nats.NATS:
    """Connect with unbounded reconnects: a bus outage is waited out, never fatal."""

    num_errors = 0

    async def error_cb(exc: Exception) -> None:
        nonlocal num_errors
        num_errors += 1
        if num_errors == 1 or num_errors % 40 == 0:  # an outage logs a line now and then, not a flood
            log.warning("nats error on %s (%d so far): %s", name, num_errors, exc)

    async def disconnected_cb() -> None:
        log.warning("nats disconnected (%s)", name)
        if on_state:
            await on_state("disconnected")

    async def reconnected_cb() -> None:
        log.info("nats reconnected (%s)", name)
        if on_state:
            await on_state("reconnected")

    return await nats.connect(
        url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.25, connect_timeout=5,
        allow_reconnect=True, error_cb=error_cb, disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb,
    )


async def ensure_streams(js, specs=ALL_STREAMS, replicas: int = 1) -> None:
    """Create every FlexLB stream, or bring an existing one to the current definition
    (its replica count included: JetStream scales a stream's replicas on update)."""
    for spec in specs:
        config = StreamConfig.from_response(spec.api_config(replicas))
        try:
            await js.add_stream(config)
        except BadRequestError:
            # Exists with another configuration (e.g. retention limits changed): update it.
            await js.update_stream(config)


async def dead_letter(nc, component: str, subject: str, data: bytes, reason: str) -> None:
    """Republish an undecodable message to flexlb.dlq.<component> with the reason."""
    await nc.publish(
        dlq_subject(component), data, headers={HDR_DLQ_REASON: reason[:512], HDR_DLQ_SUBJECT: subject}
    )

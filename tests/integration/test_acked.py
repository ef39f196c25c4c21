"""schemas/acked.py on a real nats-server: a fact published while its stream cannot take it
(no stream yet: what a cluster's stream looks like while its leader is elected) is re-sent
until the stream acks it, stored once; one never acked is given up after give_up_s,
counted and reported."""

from __future__ import annotations

import asyncio
import secrets

import nats
from nats.js.api import StreamConfig

from schemas.acked import AckedPublisher


def _names() -> tuple[str, str]:
    tag = secrets.token_hex(4)
    return f"ACKED_{tag}", f"acked.{tag}"


async def _stored(js, stream: str) -> list[bytes]:
    info = await js.stream_info(stream)
    return [(await js.get_msg(stream, seq)).data for seq in range(info.state.first_seq, info.state.last_seq + 1)]


async def test_a_fact_the_stream_cannot_take_yet_is_resent_until_acked_and_stored_once(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream, subject = _names()
    pub = AckedPublisher(nc, "test fact", ack_timeout_s=0.3, give_up_s=10, check_interval_s=0.05)
    runner = asyncio.create_task(pub.run())
    try:
        await pub.publish(subject + ".a", b"first", "id-1")
        await pub.publish(subject + ".a", b"second", "id-2")
        await asyncio.sleep(0.6)  # no stream: every send is refused (no responders) and re-sent
        assert set(pub.pending) == {"id-1", "id-2"} and pub.num_retried >= 2
        await js.add_stream(StreamConfig(name=stream, subjects=[subject + ".>"], duplicate_window=120))
        for _ in range(100):
            if not pub.pending:
                break
            await asyncio.sleep(0.05)
        assert not pub.pending
        # A send whose ack was merely late was re-sent with the same id: the stream kept one.
        await pub.publish(subject + ".a", b"first", "id-1")
        assert await pub.drain(5) == 0
        assert sorted(await _stored(js, stream)) == [b"first", b"second"]
        assert pub.num_lost == 0 and pub.num_published == 3
    finally:
        runner.cancel()
        await nc.close()


async def test_a_fact_never_acked_is_given_up_counted_and_reported(nats_url):
    nc = await nats.connect(nats_url)
    lost = []
    pub = AckedPublisher(nc, "test fact", ack_timeout_s=0.1, give_up_s=0.5, check_interval_s=0.05,
                         on_lost=lambda subject, msg_id: lost.append((subject, msg_id)))
    try:
        _, subject = _names()
        await pub.publish(subject + ".x", b"nobody stores this", "id-x")
        assert await pub.drain(3) == 0  # drain gives up on it, it does not wait forever
        assert pub.num_lost == 1 and lost == [(subject + ".x", "id-x")] and not pub.pending
    finally:
        await nc.close()

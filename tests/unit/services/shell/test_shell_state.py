"""The router shell's small shared pieces: a request's Inbox and the ids intake makes."""

from __future__ import annotations

import asyncio
import re

import pytest

from services.shell.intake import Intake
from services.shell.state import Inbox


def test_an_inbox_hands_items_over_in_order_and_wakes_its_reader():
    async def run():
        box = Inbox()
        box.put_nowait("a")
        assert await box.get() == "a"
        reader = asyncio.get_running_loop().create_task(box.get())
        await asyncio.sleep(0)  # the reader is waiting on an empty inbox
        assert not reader.done()
        box.put_nowait("b")
        box.put_nowait("c")
        assert await asyncio.wait_for(reader, 5) == "b"
        assert not box.empty() and box.qsize() == 1
        assert box.get_nowait() == "c"
        assert box.empty()
        with pytest.raises(asyncio.QueueEmpty):
            box.get_nowait()

    asyncio.run(run())


def test_an_inbox_has_one_reader_and_a_cancelled_reader_leaves_it_usable():
    async def run():
        box = Inbox()
        first = asyncio.get_running_loop().create_task(box.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await box.get()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        box.put_nowait("x")  # no waiter left behind to trip over
        assert await asyncio.wait_for(box.get(), 5) == "x"

    asyncio.run(run())


def test_an_inbox_reader_waits_for_an_item_or_a_wake_up_and_get_ignores_wake_ups():
    async def run():
        box = Inbox()
        waiter = asyncio.get_running_loop().create_task(box.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        box.wake()  # (RequestHandle.mark_dispatched: no item, the reader looks again)
        await asyncio.wait_for(waiter, 5)
        assert box.empty() and box.peek() is None
        reader = asyncio.get_running_loop().create_task(box.get())
        await asyncio.sleep(0)
        box.wake()
        await asyncio.sleep(0)
        assert not reader.done()  # woken without an item: it waits again
        box.put_nowait("t")
        assert box.peek() == "t"  # (left in place)
        assert await asyncio.wait_for(reader, 5) == "t"
        box.put_nowait("u")
        await asyncio.wait_for(box.wait(), 5)  # an item queued: at once
        box.wake()  # nobody waiting: nothing happens
        assert box.get_nowait() == "u"

    asyncio.run(run())


def test_request_ids_are_unique_and_shaped_like_before():
    a, b = Intake(state=None), Intake(state=None)
    ids = [a.new_request_id() for _ in range(1000)] + [b.new_request_id() for _ in range(1000)]
    assert len(set(ids)) == len(ids)  # two routers (or boots) draw different prefixes
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{24}", i) for i in ids)

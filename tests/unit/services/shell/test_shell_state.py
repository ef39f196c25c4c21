"""The router shell's small shared pieces: a request's Inbox, the ids intake makes, the batches
in flight, RouterState's one owner per field, and a handle that keeps its own state."""

from __future__ import annotations

import ast
import asyncio
import re

import pytest

from schemas import messages as m
from services.shell.handle import STREAM_FIELDS, Inbox, RequestHandle
from services.shell.intake import Intake
from services.shell.state import OWNERS, SIGNALS, Batches
from tests import REPO


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


# ------------------------------------------------------------------ RouterState: one owner per field
STATE_NAMES = {"s", "st", "state"}  # what the parts call the RouterState they hold (`self.s`, `s = self.s`)
MUTATORS = {"add", "discard", "pop", "popitem", "clear", "append", "extend", "update", "setdefault", "remove", "insert"}


def _state_fields() -> tuple[set[str], set[str]]:
    """RouterState's fields (what its __init__ sets), and which of them are containers."""
    tree = ast.parse((REPO / "services/shell/state.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RouterState")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    fields, containers = set(), set()
    for node in ast.walk(init):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    fields.add(t.attr)
                    v = node.value
                    if isinstance(v, (ast.Dict, ast.Set, ast.List)) or (
                            isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("set", "dict", "list")):
                        containers.add(t.attr)
    return fields, containers


def _assigned(node: ast.AST) -> list[ast.expr]:
    """What `node` assigns or deletes: each target, a tuple's elements one by one."""
    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    return [one for t in targets for one in (t.elts if isinstance(t, ast.Tuple) else [t])]


def _state_writes(source: str, fields: set[str], containers: set[str]) -> list[tuple[str, int, str]]:
    """(field, line, how) of every write of a RouterState field in `source`: an assignment, a
    deletion, an item assigned or deleted, a container's mutating call, a signal's clear()."""
    def field_of(e):
        while isinstance(e, ast.Subscript):
            e = e.value
        held = isinstance(e, ast.Attribute) and (
            (isinstance(e.value, ast.Name) and e.value.id in STATE_NAMES)
            or (isinstance(e.value, ast.Attribute) and e.value.attr in STATE_NAMES))
        return e.attr if held and e.attr in fields else None

    out = []
    for node in ast.walk(ast.parse(source)):
        for one in _assigned(node):
            if (f := field_of(one)) is not None:
                out.append((f, node.lineno, "assigned"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = field_of(node.func.value)
            if f is not None and ((f in containers and node.func.attr in MUTATORS) or (f in SIGNALS and node.func.attr == "clear")):
                out.append((f, node.lineno, node.func.attr))
    return out


def test_each_router_state_field_is_written_by_its_owner_only():
    fields, containers = _state_fields()
    assert set(OWNERS) <= fields and set(SIGNALS) <= fields
    writers: dict[str, set[str]] = {}
    wrong = []
    for path in sorted((REPO / "services").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("services/core/") or rel == "services/shell/state.py":
            continue  # the pure core holds no RouterState (test_layering); state.py's leaf actions are shared
        part = path.stem if rel.startswith("services/shell/") else rel
        for f, line, how in _state_writes(path.read_text(), fields, containers):
            writers.setdefault(f, set()).add(part)
            owner = OWNERS.get(f) or SIGNALS.get(f)
            if owner != part:
                wrong.append(f"{rel}:{line}: {f} {how} (its owner: {owner or 'none, set once in __init__'})")
    assert not wrong, "\n".join(wrong)
    # every owner does write its fields (a stale entry would hide a field nobody writes any more)
    assert {f for f in OWNERS if OWNERS[f] not in writers.get(f, set())} <= {"worker_models", "adapter_models"}


def test_the_owner_check_finds_a_write_from_another_part():
    fields, containers = _state_fields()
    source = ("def f(self, h):\n"
              "    self.s.is_leader = True\n"
              "    s = self.s\n"
              "    s.handles.pop(h.request_id, None)\n"
              "    del s.num_dispatched['w0']\n"
              "    self.s.fenced.clear()\n"
              "    self.s.wakeup.set()\n"
              "    self.s.redis.set('k', 1)\n")
    assert [(f, how) for f, _, how in _state_writes(source, fields, containers)] == [
        ("is_leader", "assigned"), ("num_dispatched", "assigned"), ("handles", "pop"), ("fenced", "clear")]


def test_batches_count_a_batchs_members_out_and_name_it_at_its_last():
    b = Batches()
    b.open("b1", ["r1", "r2"])
    b.open("b2", ["r3"])
    assert len(b) == 2
    assert b.member_ended("r1") is None
    assert b.member_ended("r1") is None  # once only
    assert b.member_ended("r2") == "b1"
    b.close("b2", ["r3"])
    assert b.member_ended("r3") is None and len(b) == 0
    assert b.member_ended("unknown") is None


# ------------------------------------------------------------------ a request's handle: its own state
def _handle_writes(source: str) -> list[tuple[str, int]]:
    """(field, line) of every assignment to a RequestHandle field of something other than
    `self` in `source`, and of every mutating call on one of its containers."""
    names = set(RequestHandle.__dataclass_fields__)
    out = []
    for node in ast.walk(ast.parse(source)):
        for one in _assigned(node):
            while isinstance(one, ast.Subscript):
                one = one.value
            if isinstance(one, ast.Attribute) and one.attr in names and not (
                    isinstance(one.value, ast.Name) and one.value.id == "self"):
                out.append((one.attr, node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            held = node.func.value
            if isinstance(held, ast.Attribute) and held.attr == "ahead":
                out.append(("ahead", node.lineno))
    return out


def test_a_handles_state_is_written_by_the_handle_and_its_stream_by_the_relay_only():
    wrong = []
    for path in [*sorted((REPO / "services" / "shell").glob("*.py")), REPO / "services" / "api.py"]:
        if path.name == "handle.py":
            continue
        for f, line in _handle_writes(path.read_text()):
            if not (f in STREAM_FIELDS and path.name == "relay.py"):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {f}")
    assert not wrong, "\n".join(wrong)
    assert _handle_writes("def f(h):\n    h.decode_worker_id = 'w1'\n    h.ahead.pop(3)\n    self.done = True\n") == [
        ("decode_worker_id", 2), ("ahead", 3)]


def test_a_handle_told_what_happened_keeps_its_placement_and_its_admission():
    async def run():
        h = RequestHandle(m.Request(request_id="r1", prompt_token_ids=[1], max_tokens=2), 0)
        h.place("p1", "d1", 500.0, 50.0)
        h.batched("b1")
        h.rerouted("p2", "d2", counts=True)
        assert (h.prefill_worker_id, h.decode_worker_id, h.batch_id, h.num_reroutes, h.slo_ttft_ms) == ("p2", "d2", "", 1, 500.0)
        h.rerouted("p3", "d3", counts=False)  # a batch that never went: not counted
        assert h.num_reroutes == 1
        h.wait_for_admission()
        waiting = h.admission
        h.wait_for_admission()  # one already awaited is kept
        assert h.admission is waiting
        h.taken(m.SubmitReply(request_id="r1", router_id="lead", admitted=True, code="queued"))
        assert (h.leader_id, h.prefill_worker_id) == ("lead", "") and not waiting.done()
        h.taken(m.SubmitReply(request_id="r1", router_id="lead2", admitted=True, prefill_worker_id="p4",
                              decode_worker_id="d4", slo_ttft_ms=700.0, slo_tpot_ms=70.0))
        assert waiting.done() and waiting.result() is None
        assert (h.leader_id, h.decode_worker_id, h.slo_ttft_ms, h.slo_tpot_ms) == ("lead2", "d4", 700.0, 70.0)
        h.dispatched = True
        h.handed_over("pool-a")
        assert (h.leader_pool, h.dispatched) == ("pool-a", False)
        h.admit_here(None)
        assert (h.leader_id, h.leader_pool) == ("", "")
        h.admission_over("ignored: not waiting")
        assert waiting.result() is None

    asyncio.run(run())

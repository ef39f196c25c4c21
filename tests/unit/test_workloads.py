"""bench/workloads.py: the traces load exactly as bench/peers.py loaded them before the move,
and the chat workload is what its docstring says (history re-sent, ShareGPT lengths, arrivals,
the prompt cap, determinism)."""

from __future__ import annotations

import hashlib
import statistics

import pytest

from bench.workloads import (
    ChatParams,
    load_workload,
    prefix_reuse,
    sharegpt_lengths,
    workload_requests,
)
from schemas.tokens import block_hashes

# Digests of (row, ts_ms, recorded and sent input length, max_tokens, prompt) of every row,
# computed with bench/peers.py's load_rows / PromptText at 5750d25, before they moved here.
LEGACY_DIGESTS = [
    ("mooncake", 0, 100, 100, "98a7350b47678531368581c1d4774152bf2adfa44c40aaff75f2295d6bdcaba4"),
    ("mooncake", 3990, 10, 3, "82c808d72510fad1d2f1d7af110ee2c38c57baa53fcfbd1994a687c89587fc0f"),
    ("azure-conv", 0, 600, 600, "4af0bba4652457bb585d1fd0735df961b64bb063a435b7292ea2377db5404aed"),
    ("azure-code", 100, 400, 400, "90e8aa1187e8440d6190355920a4c69523527766fc3075e8c707256ea4bb2195"),
]
# sha256 of the request bodies bench/peers.py sends (default flags), computed the same way.
LEGACY_BODY_DIGESTS = [
    ("mooncake", 0, 20, "fe19ba8b6bfdd8b21bee87035436c5516393e2a6ecf43e3c81b3800e0409aa2a"),
    ("azure-conv", 0, 50, "be5b4d087899006987d5bd76014f2e36a4f538086855455cbfa3d86d2b2ec7fe"),
    ("azure-code", 100, 30, "e76ebb24ce7ed19c4d61038d7f20eb0cb433af112e873531718ca6df1ae7ab5e"),
]


def digest(rows) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(f"{r.row}|{r.ts_ms!r}|{r.recorded_input_length}|{r.input_length}|{r.max_tokens}|".encode())
        h.update(r.prompt().encode())
        h.update(b"\n")
    return h.hexdigest()


@pytest.mark.parametrize("name,start,count,num_rows,expected", LEGACY_DIGESTS,
                         ids=[f"{n}-{s}+{c}" for n, s, c, _, _ in LEGACY_DIGESTS])
def test_the_traces_load_the_same_rows_and_prompts_as_before_the_move(name, start, count, num_rows, expected):
    rows = load_workload(name, start, count)
    assert len(rows) == num_rows
    assert digest(rows) == expected
    assert [r.request_id for r in rows[:2]] == [f"row-{start:05d}", f"row-{start + 1:05d}"]


@pytest.mark.parametrize("name,start,count,expected", LEGACY_BODY_DIGESTS, ids=[n for n, *_ in LEGACY_BODY_DIGESTS])
def test_bench_peers_sends_the_same_bodies_as_before_the_move(name, start, count, expected):
    from bench.peers import build_bodies, parse_args

    bodies = build_bodies(load_workload(name, start, count), parse_args([]))
    assert hashlib.sha256(b"".join(bodies)).hexdigest() == expected


def test_mooncake_prompts_share_prefixes_and_their_block_hashes_are_the_engines():
    rows = load_workload("mooncake", 0, 100)
    r = rows[5]
    assert r.block_hashes(16) == block_hashes(list(r.prompt().encode()), 16)
    assert len(r.prompt()) == r.input_length
    assert r.hash_ids is not None and r.prefix_block_tokens == 512
    # The README's figure for these rows (and the capacity bound's reuse, bench/PEERS.md): 0.044.
    assert prefix_reuse(rows) == pytest.approx(0.044, abs=0.002)


def test_azure_rows_share_nothing():
    rows = load_workload("azure-conv", 0, 50)
    assert all(r.prefix_block_ids is None for r in rows)
    assert prefix_reuse(rows) == 0.0


def test_bad_names_and_knobs_fail_clearly():
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("no-such-trace", 0, 10)
    with pytest.raises(ValueError, match="chat workload"):
        load_workload("azure-conv", 0, 10, seed=3)
    with pytest.raises(ValueError, match="rows"):
        load_workload("chat", 0, 0)
    with pytest.raises(ValueError, match="num_tenants"):
        ChatParams(num_tenants=0)
    with pytest.raises(ValueError, match="no room"):
        load_workload("chat", 0, 10, max_prompt_tokens=3000)  # system prompts reach 4000 tokens


# --------------------------------------------------------------------------- chat
@pytest.fixture(scope="module")
def chat_rows():
    return load_workload("chat", 0, 300, seed=7)


def by_session(rows):
    out: dict[int, list] = {}
    for r in rows:
        out.setdefault(r.session, []).append(r)
    return out


def test_chat_is_deterministic_by_seed(chat_rows):
    again = load_workload("chat", 0, 300, seed=7)
    assert [(r.request_id, r.ts_ms, r.input_length, r.max_tokens) for r in again] == \
        [(r.request_id, r.ts_ms, r.input_length, r.max_tokens) for r in chat_rows]
    assert digest(again[:40]) == digest(chat_rows[:40])
    other = load_workload("chat", 0, 300, seed=8)
    assert [r.input_length for r in other] != [r.input_length for r in chat_rows]
    assert other[0].prompt() != chat_rows[0].prompt()


def test_a_turn_resends_the_previous_prompt_and_answer_exactly(chat_rows):
    pairs = 0
    for turns in by_session(chat_rows).values():
        for prev, cur in zip(turns, turns[1:]):
            assert cur.turn == prev.turn + 1
            history = cur.prompt()[:prev.input_length + prev.max_tokens]
            assert history.startswith(prev.prompt())
            # the answer in the history is the same filler in every later turn of the session
            answer = history[prev.input_length:]
            assert len(answer) == prev.max_tokens
            assert all(t.prompt()[prev.input_length:prev.input_length + prev.max_tokens] == answer
                       for t in turns if t.turn > prev.turn)
            # so the engines' block hashes of the previous prompt are a prefix of this one's
            assert cur.block_hashes(16)[:prev.input_length // 16] == prev.block_hashes(16)
            pairs += 1
    assert pairs > 50
    for r in chat_rows[:30]:
        assert len(r.prompt()) == r.input_length and r.prompt().isprintable() and r.prompt().isascii()
        assert r.block_hashes(16) == block_hashes(list(r.prompt().encode()), 16)
        assert list(r.prefix_block_ids) == r.block_hashes(16)


def test_sessions_of_a_tenant_share_its_system_prompt_and_nothing_else(chat_rows):
    firsts = [r for r in chat_rows if r.turn == 0]
    tenant_of = {r.session: r.source.sessions[r.session].tenant for r in firsts}
    a, b = next((x, y) for x in firsts for y in firsts
                if x.session < y.session and tenant_of[x.session] == tenant_of[y.session])
    shared = len(_common_prefix(a.prompt(), b.prompt()))
    system_tokens = a.source.system_lengths[tenant_of[a.session]]
    assert 1000 <= system_tokens <= 4000
    assert system_tokens <= shared < system_tokens + 5  # random text may agree for a character or two
    c = next(y for y in firsts if tenant_of[y.session] != tenant_of[a.session])
    assert len(_common_prefix(a.prompt(), c.prompt())) < 5


def _common_prefix(x: str, y: str) -> str:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return x[:n]


def test_user_and_answer_lengths_are_sharegpt_rows(chat_rows):
    pairs = set(sharegpt_lengths())
    users = {u for u, _ in pairs}
    answers = {a for _, a in pairs}
    for turns in by_session(chat_rows).values():
        for prev, cur in zip(turns, turns[1:]):
            user = cur.input_length - prev.input_length - prev.max_tokens
            assert (user, cur.max_tokens) in pairs
    assert all(r.max_tokens in answers for r in chat_rows)
    assert min(users) >= 1 and max(r.max_tokens for r in chat_rows) <= max(answers)


def test_arrivals_are_ordered_sessions_poisson_and_turns_after_the_nominal_answer(chat_rows):
    ts = [r.ts_ms for r in chat_rows]
    assert ts[0] == 0.0 and ts == sorted(ts)
    starts = sorted(t[0].ts_ms for t in by_session(chat_rows).values() if t[0].turn == 0)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert statistics.mean(gaps) == pytest.approx(1000 / ChatParams().session_rate_per_s, rel=0.25)
    for turns in by_session(chat_rows).values():
        for prev, cur in zip(turns, turns[1:]):
            assert cur.ts_ms >= prev.ts_ms + prev.max_tokens * ChatParams().nominal_ms_per_token


def test_a_longer_slice_extends_a_shorter_one_and_start_row_skips():
    long = load_workload("chat", 0, 120, seed=7)
    assert [r.request_id for r in load_workload("chat", 0, 60, seed=7)] == [r.request_id for r in long[:60]]
    tail = load_workload("chat", 40, 80, seed=7)
    assert [r.request_id for r in tail] == [r.request_id for r in long[40:]]
    assert [r.row for r in tail] == list(range(40, 120))
    assert [round(r.ts_ms, 6) for r in tail] == [round(r.ts_ms - long[40].ts_ms, 6) for r in long[40:]]
    assert tail[5].prompt() == long[45].prompt()


def test_a_session_ends_before_its_history_exceeds_the_prompt_cap():
    capped = load_workload("chat", 0, 300, max_prompt_tokens=12000, seed=7)
    full = load_workload("chat", 0, 300, max_prompt_tokens=32000, seed=7)
    assert max(r.input_length for r in capped) <= 12000
    assert max(r.input_length for r in full) <= 32000
    assert all(r.input_length == r.recorded_input_length for r in capped)  # nothing is cut
    turns_capped = {s: [r.turn for r in t] for s, t in by_session(capped).items()}
    full_by = by_session(full)
    ended_by_cap = 0
    for s, turns in turns_capped.items():
        if s not in full_by:
            continue
        full_turns = full_by[s]
        common = min(len(turns), len(full_turns))  # either slice may end within the session
        assert turns[:common] == [r.turn for r in full_turns][:common]  # the same draws until the cap
        # a turn the capped stream would have sent within its slice, had the history fit
        if len(full_turns) > len(turns) and full_turns[len(turns)].ts_ms <= capped[-1].ts_ms:
            assert full_turns[len(turns)].input_length > 12000
            ended_by_cap += 1
    assert ended_by_cap > 0


def test_chat_offers_prefix_reuse_and_the_capacity_bound_reads_it(chat_rows):
    reuse = prefix_reuse(chat_rows)
    assert 0.5 < reuse < 0.95
    requests, prefix_block_tokens = workload_requests(chat_rows)
    assert prefix_block_tokens == 16
    assert requests[0].prefix_block_ids == tuple(chat_rows[0].block_hashes(16))

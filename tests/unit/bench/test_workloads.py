"""bench/workloads.py: the traces load exactly as bench/peers.py loaded them before the move,
the chat workload is what its docstring says (history re-sent, ShareGPT lengths, arrivals,
the prompt cap, determinism), and long-conv is the same generator with long per-session
contexts, capped user messages and a 16000-token prompt cap, leaving chat as it was."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import statistics

import pytest

from bench.workloads import (
    CHAT_WORKLOADS,
    LONG_CONV,
    WORKLOADS,
    ChatParams,
    chat_params_of,
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
# The chat workload's rows (digest below; (start, rows, max_prompt_tokens, seed)), computed before
# ChatParams grew long-conv's fields: their defaults must leave chat bit-for-bit as it was.
CHAT_DIGESTS = [
    (0, 300, 32000, 7, "97e2b7fca0a8fa05baa8f328618d48f25632f8343f1320f0098183b7c5f64b55"),
    (0, 300, 12000, 7, "fba52111d9cf3f258894d7449aa14778aa1c84917c7fbdd77219ea9227982710"),
    (50, 100, 32000, 0, "5dfe621539e283f07560e635e9050c0b842d3aebd6f51c28ec641f64c40d4e0f"),
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


@pytest.mark.parametrize("start,count,max_prompt,seed,expected", CHAT_DIGESTS,
                         ids=[f"{s}+{c}-cap{m}-seed{d}" for s, c, m, d, _ in CHAT_DIGESTS])
def test_chat_rows_are_the_same_as_before_long_conv(start, count, max_prompt, seed, expected):
    rows = load_workload("chat", start, count, max_prompt, seed=seed)
    assert digest(rows) == expected
    assert all(re.fullmatch(r"chat-s\d{5}-t\d{2}", r.request_id) for r in rows)


def test_chat_offers_prefix_reuse_and_the_capacity_bound_reads_it(chat_rows):
    reuse = prefix_reuse(chat_rows)
    assert 0.5 < reuse < 0.95
    requests, prefix_block_tokens = workload_requests(chat_rows)
    assert prefix_block_tokens == 16
    assert requests[0].prefix_block_ids == tuple(chat_rows[0].block_hashes(16))


# --------------------------------------------------------------------------- long-conv
@pytest.fixture(scope="module")
def lconv_rows():
    return load_workload("long-conv", 0, 300, seed=7)


def test_long_conv_is_a_chat_workload_with_its_preset():
    assert "long-conv" in WORKLOADS and set(CHAT_WORKLOADS) == {"chat", "long-conv"}
    assert chat_params_of("long-conv") is LONG_CONV and chat_params_of("chat") == ChatParams()
    assert chat_params_of("azure-conv") is None
    p = LONG_CONV
    assert (p.num_tenants, p.system_prompt_tokens, p.session_context_tokens, p.max_user_tokens,
            p.max_session_prompt_tokens, p.mean_turns, p.mean_think_s, p.request_id_prefix) == \
        (4, (200, 600), (2000, 10000), 2000, 16000, 3.0, 20.0, "lconv")
    # the new fields' defaults change nothing
    d = ChatParams()
    assert (d.session_context_tokens, d.max_user_tokens, d.max_session_prompt_tokens, d.request_id_prefix) == \
        ((0, 0), 0, 0, "chat")


def test_long_conv_is_deterministic_by_seed(lconv_rows):
    again = load_workload("long-conv", 0, 300, seed=7)
    assert [(r.request_id, r.ts_ms, r.input_length, r.max_tokens) for r in again] == \
        [(r.request_id, r.ts_ms, r.input_length, r.max_tokens) for r in lconv_rows]
    assert digest(again[:40]) == digest(lconv_rows[:40])
    assert [r.prefix_block_ids for r in again] == [r.prefix_block_ids for r in lconv_rows]
    other = load_workload("long-conv", 0, 300, seed=8)
    assert [r.input_length for r in other] != [r.input_length for r in lconv_rows]
    assert other[0].prompt() != lconv_rows[0].prompt()


def test_long_conv_request_ids_use_its_prefix(lconv_rows):
    assert all(re.fullmatch(r"lconv-s\d{5}-t\d{2}", r.request_id) for r in lconv_rows)
    assert all(r.request_id == f"lconv-s{r.session:05d}-t{r.turn:02d}" for r in lconv_rows)
    assert len({r.request_id for r in lconv_rows}) == len(lconv_rows)


def test_a_long_conv_turn_starts_with_the_previous_turns_whole_prompt(lconv_rows):
    pairs = 0
    for turns in by_session(lconv_rows).values():
        for prev, cur in zip(turns, turns[1:]):
            assert cur.turn == prev.turn + 1
            assert cur.prompt().startswith(prev.prompt())
            assert cur.block_hashes(16)[:prev.input_length // 16] == prev.block_hashes(16)
            user = cur.input_length - prev.input_length - prev.max_tokens
            assert 1 <= user <= 2000  # user messages are capped
            pairs += 1
    assert pairs > 50
    for r in lconv_rows[:30]:
        assert len(r.prompt()) == r.input_length and r.prompt().isprintable() and r.prompt().isascii()
        assert r.block_hashes(16) == block_hashes(list(r.prompt().encode()), 16)
        assert list(r.prefix_block_ids) == r.block_hashes(16)


def test_a_long_conv_prompt_is_system_prompt_then_the_sessions_own_context(lconv_rows):
    src = lconv_rows[0].source
    firsts = [r for r in lconv_rows if r.turn == 0]
    for r in firsts:
        s = src.sessions[r.session]
        system = src.system_lengths[s.tenant]
        assert 200 <= system <= 600 and 2000 <= s.context_tokens <= 10000
        assert r.input_length == system + s.context_tokens + s.turn_lengths[0][0]
        assert r.prompt()[:system] == src.piece("system", s.tenant, 0, system)
        assert r.prompt()[system:system + s.context_tokens] == src.piece("context", s.session, 0, s.context_tokens)
    assert len({src.sessions[r.session].context_tokens for r in firsts}) > len(firsts) // 2  # drawn per session


def test_long_conv_sessions_share_at_most_their_tenants_system_prompt(lconv_rows):
    src = lconv_rows[0].source
    firsts = {}
    for r in lconv_rows:
        firsts.setdefault(r.session, r)  # a session's first turn in the slice
    sessions = list(firsts.values())
    assert len(sessions) > 40
    tenants_seen = set()
    text = {r.session: r.prompt() for r in sessions}
    hashes = {r.session: r.block_hashes(16) for r in sessions}
    for i, a in enumerate(sessions):
        for b in sessions[i + 1:]:
            ta, tb = src.sessions[a.session].tenant, src.sessions[b.session].tenant
            ha, hb = hashes[a.session], hashes[b.session]
            common = next((k for k, (x, y) in enumerate(zip(ha, hb)) if x != y), min(len(ha), len(hb)))
            shared_text = len(_common_prefix(text[a.session], text[b.session]))
            assert common == shared_text // 16  # the hashes agree exactly as far as the text does
            if ta == tb:
                system = src.system_lengths[ta]
                tenants_seen.add(ta)
                # the system prompt, then the contexts differ: random text may agree for a character or two
                assert system <= shared_text < system + 5
            else:
                assert shared_text < 5
    assert len(tenants_seen) == 4
    # and the whole slice: a block hash seen in two sessions lies within a system prompt
    owners: dict[int, set[int]] = {}
    for r in lconv_rows:
        for h in r.block_hashes(16):
            owners.setdefault(h, set()).add(r.session)
    shared = {h for h, o in owners.items() if len(o) > 1}
    # (a block may reach a few characters past the system prompt where two contexts happen to agree)
    system_blocks = {h for r in lconv_rows
                     for h in r.block_hashes(16)[:(src.system_lengths[src.sessions[r.session].tenant] + 4) // 16]}
    assert shared and shared <= system_blocks
    # little cross-session sharing: turn 0s alone reuse little, whole sessions much more
    assert prefix_reuse([r for r in lconv_rows if r.turn == 0]) < 0.1
    assert 0.3 < prefix_reuse(lconv_rows) < 0.8


def test_no_long_conv_prompt_exceeds_16000_tokens(lconv_rows):
    assert max(r.input_length for r in lconv_rows) <= 16000
    assert all(r.input_length == r.recorded_input_length for r in lconv_rows)  # nothing is cut: sessions end
    more = load_workload("long-conv", 0, 1000, seed=0)
    assert max(r.input_length for r in more) <= 16000
    assert max(r.input_length for r in more) > 15000  # the cap, not the draws, is what ends the longest
    # the lower of the two caps wins
    capped = load_workload("long-conv", 0, 300, max_prompt_tokens=13000, seed=7)
    assert max(r.input_length for r in capped) <= 13000
    with pytest.raises(ValueError, match="no room"):
        load_workload("long-conv", 0, 10, max_prompt_tokens=10600)  # 600 + 10000 leaves no room


def test_long_conv_takes_chat_overrides_and_chat_fields_apply_to_chat():
    five = dataclasses.replace(LONG_CONV, mean_turns=5.0)
    rows = load_workload("long-conv", 0, 200, seed=3, chat=five)
    assert rows[0].request_id.startswith("lconv-")
    assert [r.request_id for r in rows] != [r.request_id for r in load_workload("long-conv", 0, 200, seed=3)]
    # the same rows whichever chat-family name carries the params
    assert digest(load_workload("chat", 0, 50, seed=3, chat=five)) == digest(rows[:50])
    # a chat with long-conv's prefix only renames its requests
    renamed = load_workload("chat", 0, 50, seed=7, chat=ChatParams(request_id_prefix="x"))
    plain = load_workload("chat", 0, 50, seed=7)
    assert [r.request_id for r in renamed] == [r.request_id.replace("chat-", "x-", 1) for r in plain]
    assert [r.prefix_block_ids for r in renamed] == [r.prefix_block_ids for r in plain]


@pytest.mark.parametrize("field,value", [
    ("session_context_tokens", (-1, 5)),
    ("session_context_tokens", (10, 5)),
    ("session_context_tokens", (1, 2, 3)),
    ("max_user_tokens", -1),
    ("max_session_prompt_tokens", -5),
    ("request_id_prefix", ""),
    ("request_id_prefix", "a b"),
    ("request_id_prefix", "x/y"),
])
def test_bad_long_conv_fields_fail_clearly(field, value):
    with pytest.raises(ValueError, match=field):
        ChatParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(LONG_CONV, **{field: value})


def test_bench_peers_takes_long_conv_and_its_chat_knobs():
    from bench.peers import chat_field, parse_args

    args = parse_args(["--trace", "long-conv", "--chat-turns", "5", "--chat-seed", "2"])
    assert args.chat_params == dataclasses.replace(LONG_CONV, mean_turns=5.0) and args.chat_seed == 2
    assert parse_args(["--trace", "long-conv"]).chat_params == LONG_CONV
    assert parse_args(["--trace", "chat"]).chat_params == ChatParams()
    field = chat_field(args.chat_params, args.chat_seed)
    assert field["seed"] == 2 and field["request_id_prefix"] == "lconv" and field["session_context_tokens"] == \
        [2000, 10000] and field["mean_turns"] == 5.0
    for bad in (["--trace", "azure-code", "--chat-turns", "2"], ["--trace", "long-conv", "--chat-turns", "0.5"]):
        with pytest.raises(SystemExit):
            parse_args(bad)

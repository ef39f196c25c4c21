"""The model's tokenizer at the router (`--tokenizer`, schemas/tokens.py).

Story: a small byte-level BPE `tokenizer.json` is trained here, with a BOS post-processor
like Llama's. Alone, it round-trips text, decodes a stream chunk by chunk without mangling
a multi-byte character, refuses a bad file naming it, and bounds how many characters one
token stands for only where the file proves it. Then the real stack: `flexlb up
--tokenizer FILE` (one simulated worker, blocks of one token so that the block hashes spell
out every id) and `flexlb sim-server --tokenizer FILE` must agree: the ids the router
counted and hashed for a text prompt (its core journal's admission record) are the ids the
server's `/tokenize` gives for the same text — BOS included, and fewer than the byte-level
tokenizer would have made, so the byte-level default could not pass.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest
import tokenizers  # noqa: E402, F401  (the openai extra; the README test command installs it)
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from schemas import messages as m
from schemas.http import HttpError
from schemas.subjects import JOURNAL_STREAM
from schemas.tokens import BYTE_TOKENIZER, HFTokenizer, block_hashes, encode_text, load_tokenizer
from services.api import parse_completion
from services.infra import free_port
from services.settings import RouterSettings, SettingsError, load
from tests.integration.stack import read_event_log, start_sim_server, wait_async

CORPUS = [
    "The router receives a completion request, tokenizes the prompt, and hashes its blocks. "
    "Each block hash chains the hash of the block before it with the block's token ids.",
    "A worker that already holds the first blocks of a prompt in its prefix cache computes only "
    "the rest, so the router prefers it unless it is much busier than the others.",
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps; the quick fox routes.",
    "Prefill workers compute prompts, decode workers generate tokens, and the scheduler balances "
    "the load between them with predicted prefill times and reserved KV blocks.",
]
PROMPT = "The router hashes the blocks of the prompt before it routes the request to a worker."
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def train_tokenizer(path, pre_tokenizer=None) -> str:
    """A byte-level BPE of ~300 tokens trained on CORPUS, with a `<s>` BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


@pytest.fixture(scope="module")
def hf(tokenizer_file) -> HFTokenizer:
    return HFTokenizer(tokenizer_file)


# --------------------------------------------------------------------------- the tokenizer alone
@pytest.mark.parametrize("text", [PROMPT, "héllo wörld, 日本語 🎉", "  leading and trailing  ", "x"],
                         ids=["english", "multi-byte", "spaces", "one-char"])
def test_hf_encode_decode_round_trips_and_adds_the_bos_by_default(hf, text):
    bos = hf._tokenizer.token_to_id("<s>")
    ids = hf.encode(text)
    assert ids[0] == bos
    assert hf.decode(ids) == text  # the BOS is a special token: skipped on the way back
    assert hf.encode(text, add_special_tokens=False) == ids[1:]
    assert HFTokenizer(hf.path, add_special_tokens=False).encode(text) == ids[1:]


def test_merges_make_fewer_tokens_than_bytes(hf):
    assert len(hf.encode(PROMPT)) < len(encode_text(PROMPT)) // 2


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=60),
       st.lists(st.integers(1, 4), min_size=1, max_size=8))
@hyp_settings(max_examples=150, deadline=None)
def test_incremental_decoding_joins_to_the_whole_text_and_never_emits_half_a_character(tokenizer_file, text, sizes):
    hf = HFTokenizer(tokenizer_file, add_special_tokens=False)
    ids = hf.encode(text)
    decoder = hf.incremental_decoder()
    chunks, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        chunks.append(decoder.decode(ids[i:i + n]))
        i, k = i + n, k + 1
    chunks.append(decoder.decode([], final=True))
    assert "".join(chunks) == text == hf.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in c for c in chunks)


def test_the_byte_tokenizer_is_the_default(tmp_path):
    assert load_tokenizer(None) is BYTE_TOKENIZER and load_tokenizer("") is BYTE_TOKENIZER
    assert BYTE_TOKENIZER.encode("hé") == [104, 195, 169] and BYTE_TOKENIZER.decode([104, 195, 169]) == "hé"


def test_a_directory_with_a_tokenizer_json_loads_like_the_file(tokenizer_file):
    from pathlib import Path

    assert HFTokenizer(str(Path(tokenizer_file).parent)).encode(PROMPT) == HFTokenizer(tokenizer_file).encode(PROMPT)


@pytest.mark.parametrize("content", [None, "not json", '{"version": "1.0"}'], ids=["missing", "not-json", "not-a-tokenizer"])
def test_a_bad_file_is_a_value_error_naming_the_path(tmp_path, content):
    path = tmp_path / "tok.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=str(path)):
        HFTokenizer(str(path))


def test_a_missing_tokenizers_package_says_how_to_install_it(monkeypatch, tokenizer_file):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now raises ImportError
    with pytest.raises(ValueError, match=r"pip install tokenizers") as err:
        HFTokenizer(tokenizer_file)
    assert tokenizer_file in str(err.value)


def test_the_characters_per_token_bound_holds_and_is_withheld_where_the_file_cannot_prove_it(hf, tmp_path):
    from tokenizers import pre_tokenizers

    bound = hf.max_chars_per_token
    assert bound is not None and bound > 1
    for text in [PROMPT, " " * 500, "the " * 200, "日本語" * 50, "".join(CORPUS)]:
        assert len(text) <= len(hf.encode(text, add_special_tokens=False)) * bound, text[:40]
    # A Whitespace pre-tokenizer drops the spaces: 500 spaces are no token at all.
    dropping = HFTokenizer(train_tokenizer(tmp_path / "ws.json", pre_tokenizers.Whitespace()))
    assert dropping.encode(" " * 500, add_special_tokens=False) == []
    assert dropping.max_chars_per_token is None


# --------------------------------------------------------------------------- the router's settings and parser
def test_router_settings_take_the_tokenizer_from_env_and_refuse_a_bad_one(tokenizer_file, tmp_path):
    s = load(RouterSettings, {"FLEXLB_TOKENIZER": tokenizer_file, "FLEXLB_TOKENIZER_ADD_SPECIAL_TOKENS": "false"})
    assert (s.tokenizer, s.tokenizer_add_special_tokens) == (tokenizer_file, False)
    assert RouterSettings().validate().tokenizer == ""  # default: byte-level
    missing = str(tmp_path / "nope.json")
    with pytest.raises(SettingsError, match=r"tokenizer.*nope\.json"):
        load(RouterSettings, {}, {"tokenizer": missing})


def test_parse_completion_tokenizes_text_with_the_given_tokenizer_and_bounds_it_first(hf):
    settings = RouterSettings(max_prompt_tokens=64)
    _, ids, _ = parse_completion(json.dumps({"prompt": PROMPT}).encode(), settings, hf)
    assert ids == hf.encode(PROMPT)
    _, byte_ids, _ = parse_completion(json.dumps({"prompt": PROMPT}).encode(), RouterSettings())
    assert byte_ids == encode_text(PROMPT)
    _, given_ids, _ = parse_completion(json.dumps({"prompt": [5, 6, 7]}).encode(), settings, hf)
    assert given_ids == [5, 6, 7]  # token ids are the client's: never re-tokenized
    too_long = json.dumps({"prompt": "a" * (64 * hf.max_chars_per_token + 1)}).encode()
    with pytest.raises(HttpError) as err:
        parse_completion(too_long, settings, hf)
    assert err.value.code == "too_large" and "characters" in err.value.message
    # Within the character bound but over the token limit: refused after tokenizing.
    with pytest.raises(HttpError, match="tokens exceeds"):
        parse_completion(json.dumps({"prompt": "日本" * 40}).encode(), settings, hf)


def test_a_bad_tokenizer_stops_the_router_and_the_sim_server_with_status_2(spawn, tmp_path):
    missing = str(tmp_path / "missing-tokenizer.json")
    router = spawn("router", "--tokenizer", missing, "--port", str(free_port()), name="router")
    sim = spawn("sim-server", "--tokenizer", missing, "--port", str(free_port()), name="sim")
    for proc in (router, sim):
        assert proc.popen.wait(60) == 2, proc.tail()
        assert "missing-tokenizer.json" in proc.tail() and "configuration error" in proc.tail()


# --------------------------------------------------------------------------- the real stack
async def test_the_router_dispatches_the_ids_the_sim_server_tokenizes(flexlb_up, spawn, tokenizer_file, hf):
    _, state = flexlb_up("--tokenizer", tokenizer_file, "--time-scale", "0", "--workers", "1", "--block-size-tokens", "1")
    sim_url, _ = await asyncio.to_thread(start_sim_server, spawn, "--tokenizer", tokenizer_file, "--time-scale", "0")
    async with httpx.AsyncClient(timeout=60) as c:
        resp = await c.post(state["router_url"] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        rid = resp.json()["id"]
        server = (await c.post(sim_url + "/tokenize", json={"prompt": PROMPT})).json()
        server_completion = (await c.post(sim_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})).json()
        info = (await c.get(sim_url + "/server_info")).json()

    async def admission():
        envs = await read_event_log(state["nats_url"], JOURNAL_STREAM.name)
        return next((e.payload.args["request"] for e in envs if isinstance(e.payload, m.CoreRecorded)
                     and e.payload.op == "admit" and e.payload.args["request"]["request_id"] == rid), None)

    admitted = await wait_async(admission, 20, f"the journal's admission of {rid}")
    server_ids = server["tokens"]
    assert info["tokenizer"] == f"hf:{tokenizer_file}"
    assert server_ids == hf.encode(PROMPT) and server_ids[0] == hf._tokenizer.token_to_id("<s>")
    assert server["count"] == len(server_ids) == server_completion["usage"]["prompt_tokens"]
    # What the router counted and hashed (one token per block: the hashes spell out every id).
    assert admitted["num_prompt_tokens"] == len(server_ids) == resp.json()["usage"]["prompt_tokens"]
    assert admitted["block_hashes"] == block_hashes(server_ids, 1)
    # The byte-level tokenizer would have made other, more ids: the default could not pass.
    assert len(server_ids) < len(encode_text(PROMPT))
    assert admitted["block_hashes"] != block_hashes(encode_text(PROMPT), 1)

"""Tokenizers of text prompts and the chained block hashes of a prompt.

Two tokenizers, one shape (`encode(text) -> ids`, `decode(ids) -> text`,
`incremental_decoder()`, `name`, `max_chars_per_token`, `is_costly`); `load_tokenizer(path)`
picks one:

- `ByteTokenizer` (the default, `BYTE_TOKENIZER`): dependency-free, a token id is a UTF-8
  byte (0-255); what the simulated engine and the torch presets' 256-token vocabulary speak.
  `encode_text` / `decode_tokens` / `TextDecoder` are its functions.
- `HFTokenizer(path)`: a Hugging Face `tokenizer.json` (or a directory holding one), read
  with the `tokenizers` package, imported only when one is loaded (`pip install
  tokenizers`). The router uses it so that the ids it hashes and sends are the model's
  (`--tokenizer`); `flexlb sim-server --tokenizer` answers `/tokenize` with the same ids.

Special tokens: the router sends token ids, which a server (vLLM, SGLang, our workers) runs
as given, never re-tokenized; so the ids must be the ones the server would have computed
for the text. vLLM's `/v1/completions` and `/tokenize` and SGLang's `/generate` tokenize a
text prompt with `add_special_tokens=True` (the file's post-processor: Llama's BOS, ...),
hence `HFTokenizer`'s default `add_special_tokens=True`; a file without a post-processor
adds nothing either way. False matches a server asked not to (vLLM's per-request
`add_special_tokens: false`). Decoding skips special tokens (vLLM's and SGLang's default
`skip_special_tokens`).

It is part of the contract because the router tokenizes prompts and the workers turn
generated ids back into text (both must agree on the vocabulary).

Block hashes: a prompt is cut into blocks of `block_size_tokens`; block i's hash chains the
hash of block i-1 with block i's token ids, so two prompts share their first k block hashes
exactly when they share their first k full blocks. Only full blocks are hashed. The hash is
a 63-bit int from blake2b (stable across processes and Python versions, unlike `hash()`).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import struct
from typing import Any

VOCAB_SIZE = 256


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_tokens(token_ids: list[int]) -> str:
    return bytes(t & 0xFF for t in token_ids).decode("utf-8", errors="replace")


class TextDecoder:
    """One request's output text, chunk by chunk: bytes of a character split across chunks
    are held until it is whole, so the chunks joined equal `decode_tokens` of all tokens."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, token_ids: list[int], final: bool = False) -> str:
        return self._decoder.decode(bytes(t & 0xFF for t in token_ids), final)


class ByteTokenizer:
    """The byte-level tokenizer (module docstring): one UTF-8 byte = one token id."""

    name = "byte"
    # A character is 1-4 bytes, so a text of n characters is at least n tokens: a prompt
    # longer than max_prompt_tokens characters is too large before it is tokenized.
    max_chars_per_token = 1
    is_costly = False  # a bytes() call: cheaper than a thread hop

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """`add_special_tokens` is accepted for the shared shape; there are none to add."""
        return encode_text(text)

    def decode(self, token_ids: list[int]) -> str:
        return decode_tokens(token_ids)

    def incremental_decoder(self) -> TextDecoder:
        return TextDecoder()


BYTE_TOKENIZER = ByteTokenizer()


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (module docstring).

    `path`: the file, or a directory with a `tokenizer.json`. `add_special_tokens` (True):
    what `encode` does when the caller does not say; True is what vLLM and SGLang do to a
    text prompt (module docstring). A missing `tokenizers` package, a missing, unreadable or
    invalid file: ValueError naming the path.

    `encode` runs `encode_batch` of one text: the same ids as `encode`, but it releases the
    GIL while it works (`encode` holds it: ~0.1 s per 32k tokens with the event loop stuck),
    so a caller on an event loop can run it in a thread (`is_costly`).
    """

    is_costly = True

    def __init__(self, path: str, add_special_tokens: bool = True) -> None:
        try:
            import tokenizers
        except ImportError:
            raise ValueError(f"tokenizer {path}: the tokenizers package is not installed "
                             "(pip install tokenizers)") from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            with open(file, encoding="utf-8") as fh:
                raw = fh.read()
            self._tokenizer = tokenizers.Tokenizer.from_str(raw)
            spec = json.loads(raw)
        except OSError as exc:
            raise ValueError(f"tokenizer {path}: cannot read {file}: {exc.strerror or exc}") from None
        except Exception as exc:  # the Rust side raises a plain Exception for every parse error
            raise ValueError(f"tokenizer {path}: {file} is not a Hugging Face tokenizer.json "
                             f"({type(exc).__name__}: {exc})") from None
        # A file may carry the truncation or padding of its training run: the router needs
        # every id of the prompt, and none added.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.path = path
        self.name = f"hf:{path}"
        self.add_special_tokens = add_special_tokens
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_chars_per_token = _max_chars_per_token(spec, self._tokenizer.get_vocab(with_added_tokens=True),
                                                        set(tokenizers.pre_tokenizers.ByteLevel.alphabet()))

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        return self._tokenizer.encode_batch([text], add_special_tokens=add)[0].ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens skipped; an id outside the vocabulary adds nothing."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def incremental_decoder(self) -> "HFTextDecoder":
        return HFTextDecoder(self)


class HFTextDecoder:
    """One request's output text, chunk by chunk, for an `HFTokenizer` (vLLM's incremental
    detokenization): decode a window of the ids, from the start of the previous chunk's ids
    to the end, and emit what it adds to the previous chunk's window. The window starts
    where a chunk ended, on a whole character, so the cost per chunk is that of its own ids
    and the previous chunk's, not of the whole output. A window whose text ends in U+FFFD
    (a multi-byte character whose last bytes have not come) or adds nothing is held, and
    decoded again with the next ids; `final` emits what is held. Joined, the chunks equal
    `decode` of all ids for decoders that treat only the first token specially (ByteLevel,
    Metaspace's leading space: both windows of a step start at the same token)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # the window starts here: the first id of the previous chunk
        self._read_offset = 0  # ids before this are emitted

    def decode(self, token_ids: list[int], final: bool = False) -> str:
        self._token_ids.extend(token_ids)
        prefix = self._tokenizer.decode(self._token_ids[self._prefix_offset:self._read_offset])
        text = self._tokenizer.decode(self._token_ids[self._prefix_offset:])
        if not final and (len(text) <= len(prefix) or text.endswith("\ufffd")):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return text[len(prefix):]


def load_tokenizer(path: str | None, add_special_tokens: bool = True) -> ByteTokenizer | HFTokenizer:
    """None or "": the byte-level tokenizer; else `HFTokenizer(path, add_special_tokens)`."""
    return HFTokenizer(path, add_special_tokens) if path else BYTE_TOKENIZER


# Pre-tokenizers that split text without dropping any of it (a token's string then has at
# least as many characters as the text it came from: ByteLevel maps each byte to one
# character, Metaspace a space to "▁"). Whitespace / WhitespaceSplit / BertPreTokenizer drop
# spaces, so a token can stand for any number of characters.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"})


def _pre_tokenizers(pre: dict[str, Any] | None) -> list[dict[str, Any]]:
    if pre is None:
        return []
    if pre.get("type") == "Sequence":
        return [q for p in pre.get("pretokenizers", []) for q in _pre_tokenizers(p)]
    return [pre]


def _max_chars_per_token(spec: dict[str, Any], vocab: dict[str, int], byte_level_alphabet: set[str]) -> int | None:
    """The most characters of a text one token can stand for, when the file proves a bound;
    None otherwise (the caller then bounds the text by bytes only).

    A bound holds for a BPE model with no normalizer (NFC, lowercasing, stripping can shrink
    text), pre-tokenizers that keep every character, no character dropped as unknown (BPE
    without `unk_token` skips a character outside its vocabulary, unless ByteLevel maps every
    byte to a character it has, or `byte_fallback` spells it in bytes), no unknown run fused
    into one token (`fuse_unk` without `byte_fallback`), and no added token that swallows the
    spaces beside it (`lstrip` / `rstrip`): then every token's string is at least as long as
    the text it covers, and the longest one in the vocabulary is the bound."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") is not None:
        return None
    pres = _pre_tokenizers(spec.get("pre_tokenizer"))
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pres):
        return None
    byte_fallback = bool(model.get("byte_fallback"))
    covers_every_byte = any(p.get("type") == "ByteLevel" for p in pres) and byte_level_alphabet <= vocab.keys()
    if model.get("unk_token") is None and not (byte_fallback or covers_every_byte):
        return None
    if model.get("fuse_unk") and not (byte_fallback or covers_every_byte):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    return max((len(token) for token in vocab), default=1) or 1


ROOT_DIGEST = b"\x00" * 8  # the parent of a prompt's first block


def block_hashes(token_ids: list[int], block_size_tokens: int) -> list[int]:
    """The chained hashes of a prompt's full blocks (what the router's prefix index and the
    engines' caches key blocks by)."""
    return [h for h, _ in chain_block_hashes(token_ids, block_size_tokens, ROOT_DIGEST)]


def chain_block_hashes(token_ids: list[int], block_size_tokens: int, parent_digest: bytes) -> list[tuple[int, bytes]]:
    """(hash, digest) of each full block of `token_ids`, chained from `parent_digest` (a
    block's digest is the next one's parent; ROOT_DIGEST for a prompt's start). Lets a
    translator extend a chain whose first blocks it saw earlier (vLLM's KV events)."""
    if block_size_tokens <= 0:
        raise ValueError("block_size_tokens must be positive")
    out: list[tuple[int, bytes]] = []
    parent = parent_digest
    for i in range(len(token_ids) // block_size_tokens):
        block = token_ids[i * block_size_tokens : (i + 1) * block_size_tokens]
        digest = hashlib.blake2b(parent + struct.pack(f"<{len(block)}I", *block), digest_size=8).digest()
        out.append((int.from_bytes(digest, "little") >> 1, digest))
        parent = digest
    return out

"""The default tokenizer and the chained block hashes of a prompt.

The tokenizer is byte-level and dependency-free: a token id is a UTF-8 byte (0-255). It is
part of the contract because the router tokenizes prompts and the workers turn generated ids
back into text. Real engines with their own vocabularies are a later issue.

Block hashes: a prompt is cut into blocks of `block_size_tokens`; block i's hash chains the
hash of block i-1 with block i's token ids, so two prompts share their first k block hashes
exactly when they share their first k full blocks. Only full blocks are hashed. The hash is
a 63-bit int from blake2b (stable across processes and Python versions, unlike `hash()`).
"""

from __future__ import annotations

import codecs
import hashlib
import struct

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

"""Token sampling for the torch engine: greedy, or temperature with top-p (nucleus), seeded
per request so that the same request gives the same output, whatever it is batched with.

`SamplingParams(temperature=0)` is greedy (argmax; ties to the lowest id). Otherwise the
logits are divided by the temperature, the smallest set of tokens whose probability sums to
at least `top_p` is kept (the most likely token always is), and one token is drawn with the
request's own generator, seeded from (`seed`, output index): a request's draws depend on
nothing but its seed and its logits, so batching, preemption and recompute do not change
them. `stop_token_id` (the model's end token, when it has one) ends a request early unless
`ignore_eos`. Bad parameters are a ValueError naming the field.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    def stops(self, token_id: int, num_output_tokens: int) -> bool:
        """After emitting `token_id` as output number `num_output_tokens` (from 1)."""
        if num_output_tokens >= self.max_tokens:
            return True
        return not self.ignore_eos and self.stop_token_id is not None and token_id == self.stop_token_id


def _generator(seed: int, index: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sample(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """One token from a [vocab] row of logits, as output number `index` (from 0)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float32).cpu() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more likely tokens
        keep = before < params.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=_generator(params.seed, index)))

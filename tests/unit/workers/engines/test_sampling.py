"""Sampling of the torch engine: greedy is the argmax, a seed fixes the draws, top-p keeps
the nucleus only, temperature sharpens or flattens, the end token stops unless ignore_eos."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from workers.engines.sampling import SamplingParams, sample

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def draws(params: SamplingParams, n: int = 400) -> Counter:
    return Counter(sample(LOGITS, SamplingParams(**{**params.__dict__, "seed": s}), 0) for s in range(n))


def test_greedy_takes_the_argmax_and_ties_go_to_the_lowest_id():
    assert sample(LOGITS, SamplingParams(), 0) == 0
    assert sample(torch.tensor([1.0, 3.0, 3.0]), SamplingParams(), 5) == 1


def test_the_same_seed_and_index_give_the_same_token_and_others_vary():
    p = SamplingParams(temperature=1.0, seed=42)
    assert len({sample(LOGITS, p, 3) for _ in range(20)}) == 1
    assert len({sample(LOGITS, p, i) for i in range(40)}) > 1


def test_draws_follow_the_distribution_and_top_p_keeps_only_the_nucleus():
    c = draws(SamplingParams(temperature=1.0))
    assert 0.4 < c[0] / 400 < 0.6 and 0.2 < c[1] / 400 < 0.4 and c[3] > 0
    # top_p 0.7: 0.5 + 0.3 reaches it; tokens 2 and 3 are never drawn
    c = draws(SamplingParams(temperature=1.0, top_p=0.7))
    assert set(c) == {0, 1} and 0.5 < c[0] / 400 < 0.75  # renormalised 0.625 / 0.375
    # the most likely token is always kept, even when it alone exceeds top_p
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.1))) == {0}


def test_a_low_temperature_sharpens_and_a_high_one_flattens():
    cold, hot = draws(SamplingParams(temperature=0.2)), draws(SamplingParams(temperature=5.0))
    assert cold[0] > 340 and hot[0] < 160 and hot[3] > 45  # p^5: 0.925; p^0.2: 0.30 and 0.19


def test_stop_rules_and_bad_parameters():
    p = SamplingParams(max_tokens=3, stop_token_id=7)
    assert p.stops(7, 1) and not p.stops(8, 1) and p.stops(8, 3)
    assert not SamplingParams(max_tokens=3, stop_token_id=7, ignore_eos=True).stops(7, 1)
    for bad, field in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_tokens=0), "max_tokens")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)

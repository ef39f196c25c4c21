"""The torch engine's model against a reference nobody here wrote: our forward pass on seeded
random weights, saved as a Hugging Face checkpoint, matches `transformers`' LlamaForCausalLM
logits (fp32, atol 2e-5); a packed batch equals its sequences alone, and a cached prefix plus
new tokens equals the whole sequence at once."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # the reference (the `torch-reference` extra, installed by the README's test command)

from workers.engines.torch_model import PRESETS, DenseKv, LlamaConfig, build_model, load_hf_dir, save_hf_dir

ATOL = 2e-5  # fp32; the logits are O(0.1-1) with these weights
LENGTHS = (1, 7, 33, 130)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def ours_alone(model, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids)
    return model(t, torch.arange(len(ids)), [len(ids)], DenseKv([len(ids)]))


class ListKv:
    """One sequence's K/V kept across calls (a minimal cache for the incremental check)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def write(self, layer, k, v):
        self.k[layer] = torch.cat([self.k[layer], k]) if layer in self.k else k
        self.v[layer] = torch.cat([self.v[layer], v]) if layer in self.v else v

    def read(self, layer):
        return [(self.k[layer], self.v[layer])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = LlamaConfig(num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=200,
                      max_positions=512, rope_theta=500000.0)
    model = build_model(cfg, seed=11)
    path = tmp_path_factory.mktemp("hf-llama")
    save_hf_dir(model, path)
    return model, path


def test_logits_match_transformers_llama_on_prompts_of_several_lengths(checkpoint):
    model, path = checkpoint
    ref = transformers.LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32, local_files_only=True).eval()
    for n in LENGTHS:
        ids = prompt(n, seed=n)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        got = ours_alone(model, ids)
        assert got.shape == expected.shape == (n, 256)
        assert torch.allclose(got, expected, atol=ATOL, rtol=0), f"n={n}: max diff {(got - expected).abs().max():.2e}"
        assert expected.abs().max() > 0.05  # the comparison is not of near-zero numbers


def test_a_packed_batch_equals_each_sequence_alone(checkpoint):
    model, _ = checkpoint
    seqs = [prompt(n, seed=100 + n) for n in (5, 17, 2)]
    lengths = [len(s) for s in seqs]
    packed = model(torch.tensor(sum(seqs, [])), torch.cat([torch.arange(n) for n in lengths]), lengths, DenseKv(lengths))
    alone = torch.cat([ours_alone(model, s) for s in seqs])
    assert torch.allclose(packed, alone, atol=1e-6, rtol=0)
    last = [4, 21, 23]  # each sequence's last token: the only logits the engine samples from
    only = model(torch.tensor(sum(seqs, [])), torch.cat([torch.arange(n) for n in lengths]), lengths, DenseKv(lengths),
                 rows=last)
    assert torch.allclose(only, packed[last], atol=1e-6, rtol=0)


def test_a_cached_prefix_then_one_token_at_a_time_equals_the_whole_sequence(checkpoint):
    model, _ = checkpoint
    ids = prompt(24, seed=5)
    full = ours_alone(model, ids)
    kv = ListKv()
    rows = [model(torch.tensor(ids[:20]), torch.arange(20), [20], kv)]
    for pos in range(20, 24):
        rows.append(model(torch.tensor([ids[pos]]), torch.tensor([pos]), [1], kv))
    assert torch.allclose(torch.cat(rows), full, atol=1e-5, rtol=0)


def test_the_hf_directory_round_trips_and_bad_ones_are_refused(checkpoint, tmp_path):
    model, path = checkpoint
    loaded = load_hf_dir(path)
    ids = prompt(9, seed=9)
    assert torch.equal(ours_alone(loaded, ids), ours_alone(model, ids))
    with pytest.raises(ValueError, match="config.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not a Llama"):
        load_hf_dir(tmp_path)


def test_seeded_weights_are_reproducible_and_the_presets_are_valid():
    a, b = build_model(PRESETS["tiny"], seed=3), build_model(PRESETS["tiny"], seed=3)
    ids = prompt(6, seed=1)
    assert torch.equal(ours_alone(a, ids), ours_alone(b, ids))
    assert not torch.equal(ours_alone(a, ids), ours_alone(build_model(PRESETS["tiny"], seed=4), ids))
    big = PRESETS["1b"]
    params = big.num_layers * (2 * big.hidden_size ** 2 + 2 * big.hidden_size * big.num_kv_heads * big.head_dim
                               + 3 * big.hidden_size * big.intermediate_size)
    assert 0.9e9 < params < 1.2e9
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig(num_heads=4, num_kv_heads=3)

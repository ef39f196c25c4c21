"""A decoder-only transformer of the Llama family in plain torch: the model of the torch engine.

RMSNorm, rotary position embeddings (the rotate-half convention of Hugging Face's Llama),
grouped-query attention, SwiGLU MLP, untied LM head. Sized by `LlamaConfig`; named presets
(`PRESETS`: `tiny` for tests, `1b` for a GPU). Weights are seeded random by default (nothing
is ever downloaded), or read from a local directory in the Hugging Face Llama layout
(`config.json` + `*.safetensors`, `load_hf_dir`); `save_hf_dir` writes that layout, which is
how the tests check this forward pass against `transformers`' `LlamaForCausalLM` (a
reference nobody here wrote).

This module is the model only: `forward(token_ids, positions, kv)` computes logits for a
packed batch of sequences, reading and writing keys and values through a `KvView` the
caller supplies (the paged cache of the engine, or `DenseKv` for a whole sequence at once).
Vocabulary 256 by default, so the byte-level tokenizer (`schemas.tokens`) maps text in and out.

Numerics: weights and activations in the config's dtype (fp32 by default); RMSNorm and the
softmax run in fp32, as in the reference. Imports: torch (the `torch` extra) and the standard
library only.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 172
    vocab_size: int = 256
    max_positions: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dtype: str = "float32"
    eos_token_id: int | None = None  # the end token, if the model has one (the presets do not)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("the head dimension must be even (rotary embeddings rotate pairs)")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        for name in ("num_layers", "vocab_size", "max_positions", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    # About 1.1 B parameters in the TinyLlama shape (22 layers, 2048 wide, 32 heads, 4 KV
    # heads), with the byte vocabulary: for a GPU, in bfloat16.
    "1b": LlamaConfig(num_layers=22, hidden_size=2048, num_heads=32, num_kv_heads=4, intermediate_size=5632,
                      max_positions=4096, dtype="bfloat16"),
}


class KvView(Protocol):
    """Where one layer's keys and values live. `write` stores the new tokens' K/V (shape
    [tokens, kv_heads, head_dim]); `read` returns, per sequence of the batch, the K/V of all
    its tokens so far (cached prefix + new), oldest first."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def read(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class DenseKv:
    """A KvView for whole sequences computed from scratch, packed: `lengths` tokens each."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store[layer] = (k, v)

    def read(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        k, v = self.store[layer]
        return list(zip(torch.split(k, self.lengths), torch.split(v, self.lengths)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary(cfg: LlamaConfig, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [tokens, head_dim] for the given absolute positions."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    freqs = positions.to(device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, new_lengths: list[int],
                layer: int, kv: KvView) -> torch.Tensor:
        cfg = self.cfg
        n, d = x.shape[0], cfg.head_dim
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(n, cfg.num_heads, d)
        k = self.k_proj(y).view(n, cfg.num_kv_heads, d)
        v = self.v_proj(y).view(n, cfg.num_kv_heads, d)
        c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        kv.write(layer, k, v)
        outs = []
        scale = 1.0 / math.sqrt(d)
        for q_seq, (k_all, v_all) in zip(torch.split(q, new_lengths), kv.read(layer)):
            m, total = q_seq.shape[0], k_all.shape[0]
            # [1, heads, tokens, d]: 4-D inputs take torch's fused (flash) CPU kernel, 3-D ones the slow math path
            qq, kk, vv = (t.transpose(0, 1).unsqueeze(0) for t in (q_seq, k_all, v_all))
            # Causal: new token i (absolute position total - m + i) sees keys 0..total - m + i.
            # A whole prompt is the kernel's own causal case; one new token sees everything;
            # a chunk after a cached prefix needs the shifted mask.
            if m == total:
                mask, causal = None, m > 1
            elif m == 1:
                mask, causal = None, False
            else:
                mask, causal = torch.ones(m, total, dtype=torch.bool, device=x.device).tril(diagonal=total - m), False
            out = nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal, scale=scale,
                                                             enable_gqa=cfg.num_heads != cfg.num_kv_heads)
            outs.append(out[0].transpose(0, 1).reshape(m, cfg.num_heads * d))
        x = x + self.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(y)) * self.up_proj(y))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, new_lengths: list[int],
                kv: KvView, rows: list[int] | None = None) -> torch.Tensor:
        """Logits [tokens, vocab] for a packed batch: `new_lengths[i]` new tokens of sequence i,
        at absolute `positions`; their cached prefix (if any) comes from `kv`. `rows`: only
        those tokens' logits (the engine samples from each sequence's last token only)."""
        if int(positions.max()) >= self.cfg.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond max_positions {self.cfg.max_positions}")
        x = self.embed_tokens(token_ids)
        cos, sin = rotary(self.cfg, positions, x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, new_lengths, i, kv)
        if rows is not None:
            x = x[rows]
        return self.lm_head(self.norm(x))


def build_model(cfg: LlamaConfig, seed: int = 0, device: str = "cpu") -> LlamaModel:
    """Seeded random weights (normal, std 0.02; norms 1), the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.to(device=device, dtype=cfg.torch_dtype).eval()


# ------------------------------------------------------------------ Hugging Face layout
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
}


def hf_parameters(model: LlamaModel) -> dict[str, nn.Parameter]:
    """Every parameter under its Hugging Face Llama name."""
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        params = dict(layer.named_parameters())
        for hf_name, name in _LAYER_NAMES.items():
            out[f"model.layers.{i}.{hf_name}"] = params[name]
    return out


def hf_config(cfg: LlamaConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "head_dim": cfg.head_dim, "torch_dtype": cfg.dtype,
        **({"eos_token_id": cfg.eos_token_id} if cfg.eos_token_id is not None else {}),
    }


def save_hf_dir(model: LlamaModel, path: str | pathlib.Path) -> None:
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=1))
    out = hf_parameters(model)
    save_file({k: v.detach().contiguous().cpu() for k, v in out.items()}, str(path / "model.safetensors"))


def _first_eos(value: object) -> int | None:
    """config.json's eos_token_id: an int, a list (several end tokens: the first is used), or absent."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def load_hf_dir(path: str | pathlib.Path, device: str = "cpu", dtype: str | None = None) -> LlamaModel:
    """A local Hugging Face Llama directory (config.json + *.safetensors); never downloads.
    A missing or unexpected tensor, or a config outside the Llama family, is a ValueError."""
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from None
    if raw.get("model_type") != "llama" or raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: not a Llama-family checkpoint (model_type {raw.get('model_type')!r})")
    if raw.get("attention_bias") or raw.get("mlp_bias") or raw.get("rope_scaling"):
        raise ValueError(f"{path}: biases and rope scaling are not supported")
    cfg = LlamaConfig(
        num_layers=raw["num_hidden_layers"], hidden_size=raw["hidden_size"], num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        intermediate_size=raw["intermediate_size"], vocab_size=raw["vocab_size"],
        max_positions=raw.get("max_position_embeddings", 2048), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", 10000.0), dtype=dtype or "float32",
        eos_token_id=_first_eos(raw.get("eos_token_id")),
    )
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    for f in files:
        tensors.update(load_file(str(f)))
    if raw.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model = LlamaModel(cfg)
    ours = hf_parameters(model)
    missing = sorted(set(ours) - set(tensors))
    unexpected = sorted(k for k in set(tensors) - set(ours) if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in ours.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(p.shape)}")
            p.copy_(tensors[name])
    return model.to(device=device, dtype=cfg.torch_dtype).eval()


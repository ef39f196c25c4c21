"""The torch engine's speed: prefill tokens/s and decode step time at batch 1, 8 and 32, with
the arithmetic bound beside each figure.

    python bench/torch_engine.py --models tiny,mid --device cpu --out bench/results/torch_engine_cpu.json
    python bench/torch_engine.py --models 1b --device cuda --dtype bfloat16   # on a GPU machine

What runs: `TorchEngine.step()` itself (scheduler, paged KV, packed forward, sampling), not
the model alone, so the figures are what a worker gets. Prefill: `batch` prompts of
`--prompt-tokens` submitted together, the first step's tokens / its measured time (chunked
prefill: the step holds min(batch × prompt, 8192) tokens). Decode: the same requests then
decode; the median step time over `--decode-steps` steps.

The bounds (per step):
- compute: 2 × parameters × tokens FLOPs of the weights, plus the attention's 4 × layers ×
  hidden × Σ(context) FLOPs, over `--peak-tflops` (default: measured here, the speed of a
  large fp32/bf16 matmul on this device, so the bound is what this machine can do);
- memory (decode): weight bytes + K/V bytes read per step (every decoding sequence's
  context) over `--bandwidth-gbs` (default: measured, a large tensor copy). A decode step
  can be no faster than max(compute, memory); on a GPU the decode figure is compared with
  the memory-bandwidth bound.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from workers.engines.sim import EngineBatch, EngineRequest  # noqa: E402
from workers.engines.torch_engine import TorchEngine  # noqa: E402
from workers.engines.torch_model import PRESETS, LlamaConfig, build_model  # noqa: E402

MODELS = {
    "tiny": PRESETS["tiny"],
    # A mid-size config that a CPU still runs in seconds: 8 layers, 512 wide (~23 M parameters).
    "mid": LlamaConfig(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1376),
    "1b": PRESETS["1b"],
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measured_peak_tflops(device: str, dtype: torch.dtype) -> float:
    n = 2048 if device.startswith("cuda") else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    reps = 20 if device.startswith("cuda") else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def measured_bandwidth_gbs(device: str) -> float:
    x = torch.empty(64 * 1024 * 1024 // 4, device=device)  # 64 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 4 * reps / (time.perf_counter() - t0) / 1e9  # read + write


def run(cfg: LlamaConfig, batch: int, prompt_tokens: int, decode_steps: int, device: str, peak: float, bw: float):
    model = build_model(cfg, seed=0, device=device)
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block = 16
    blocks = batch * -(-(prompt_tokens + decode_steps + 2) // block) + 8
    eng = TorchEngine(model, "pd_fusion", num_kv_blocks=blocks, block_size_tokens=block,
                      max_seq_len_tokens=prompt_tokens + decode_steps + 2)
    gen = torch.Generator().manual_seed(batch)
    eng.submit_batch(EngineBatch(batch_id="b", requests=[
        EngineRequest(request_id=f"r{i}", prompt_token_ids=torch.randint(0, cfg.vocab_size, (prompt_tokens,), generator=gen).tolist(),
                      max_tokens=decode_steps + 1, ignore_eos=True) for i in range(batch)]))
    prefill = []
    decode = []
    while (step := eng.step()) is not None:
        if step.num_prefill_tokens:
            prefill.append((step.num_prefill_tokens, step.duration_ms, step.num_decode_tokens))
        elif step.num_decode_tokens == batch:
            decode.append(step.duration_ms)
    tokens, ms, _ = prefill[0]
    layers, hidden = cfg.num_layers, cfg.hidden_size
    kv_bytes_per_token = 2 * layers * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=cfg.torch_dtype).element_size()
    # prefill bound: weights on every token, causal attention over each prompt chunk
    per_prompt = min(prompt_tokens, tokens)
    n_prompts = max(1, tokens // per_prompt)
    prefill_flops = 2 * num_params * tokens + 4 * layers * hidden * n_prompts * per_prompt * per_prompt / 2
    context = prompt_tokens + decode_steps / 2  # mean context over the decode steps
    decode_flops = 2 * num_params * batch + 4 * layers * hidden * batch * context
    decode_bytes = weight_bytes + batch * context * kv_bytes_per_token
    decode_ms = statistics.median(decode) if decode else float("nan")
    return {
        "batch": batch, "prompt_tokens": prompt_tokens, "num_params": num_params,
        "prefill_step_tokens": tokens, "prefill_step_ms": round(ms, 3),
        "prefill_tokens_per_s": round(tokens / ms * 1000, 1),
        "prefill_bound_tokens_per_s": round(tokens / (prefill_flops / (peak * 1e12)), 1),
        "decode_step_ms": round(decode_ms, 3), "decode_steps_measured": len(decode),
        "decode_compute_bound_ms": round(decode_flops / (peak * 1e12) * 1000, 4),
        "decode_memory_bound_ms": round(decode_bytes / (bw * 1e9) * 1000, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,mid", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="override the configs' dtype (1b: bfloat16)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="0: measure a matmul here")
    ap.add_argument("--bandwidth-gbs", type=float, default=0.0, help="0: measure a copy here")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(), "models": {}}
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        cfg = MODELS[name]
        if args.dtype:
            from dataclasses import replace
            cfg = replace(cfg, dtype=args.dtype)
        peak = args.peak_tflops or measured_peak_tflops(args.device, cfg.torch_dtype)
        bw = args.bandwidth_gbs or measured_bandwidth_gbs(args.device)
        run(cfg, 2, 32, 4, args.device, peak, bw)  # warm-up: first-call allocations and kernel selection
        rows = []
        for b in (int(x) for x in args.batches.split(",")):
            row = run(cfg, b, args.prompt_tokens, args.decode_steps, args.device, peak, bw)
            rows.append(row)
            print(f"{name:5s} batch {b:3d}: prefill {row['prefill_tokens_per_s']:>10.0f} tok/s "
                  f"(bound {row['prefill_bound_tokens_per_s']:>10.0f}), decode step {row['decode_step_ms']:8.2f} ms "
                  f"(compute bound {row['decode_compute_bound_ms']:.3f}, memory bound {row['decode_memory_bound_ms']:.3f})",
                  flush=True)
        results["models"][name] = {"dtype": cfg.dtype, "peak_tflops": round(peak, 3), "bandwidth_gbs": round(bw, 1),
                                   "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

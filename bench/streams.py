"""Many users at once: servers driven over HTTP at 1, 4, 16 and 32 concurrent streams.

    .venv/bin/python bench/streams.py [--layers 4] [--streams 1 4 16 32] [--rounds 1]

Servers, one after the other on this host, on the same weights (bench/synthetic.py's
Llama-2-7B-shaped layers, random bf16): `vllm serve` of the bf16 checkpoint, of its
`cpu-int4 quantize` output (g64), and of a compressed-tensors W4A16 checkpoint (int4,
asymmetric, g64; bench/compressed.py) that stock vLLM runs through its CPUWNA16 kernel (AVX-512
hosts only); and llama.cpp's `llama-server` on the Q4_K_M GGUF, `-np N` slots, continuous
batching (`make bench-deps` builds it). vLLM servers run eager, as the other benchmarks here.

Each stream: a fixed prompt of 128 random token ids (the same for every server), 128 output
tokens, greedy, ignore_eos, streamed. `--rounds R` sends R x N requests at concurrency N. Per
server and stream count: aggregate output tok/s (every output token over the wall time from the
first request sent to the last token), TTFT p50/p99, the gap between streamed chunks (inter-token
latency) p50/p99, and the RSS of the server's processes after the run. Ratios to vLLM bf16 follow.
Prints the CPU's model and ISA flags. Loopback only; every request is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import torch
from compressed import write_compressed
from kernel import cpu_description
from load import free_port, serve, started
from serve import BENCH_PYTHON, CACHE, DENSE_MODEL, prepared_models

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / ".bench-venv" / "llama-server" / "bin" / "llama-server"
PROMPT_TOKENS = OUTPUT_TOKENS = 128
REQUEST_S = 1800


@dataclass
class Stream:
    """One request's timeline: when it was sent, when each chunk of text arrived, its tokens."""

    sent: float
    chunks: list[float]
    tokens: int


@dataclass
class Row:
    streams: int
    tok_s: float
    ttft_ms: tuple[float, float]
    itl_ms: tuple[float, float]
    rss_gb: float


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


async def one_stream(client: httpx.AsyncClient, base: str, model: str, prompt: list[int]) -> Stream:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = Stream(time.perf_counter(), [], 0)
    async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=REQUEST_S) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stream.chunks.append(time.perf_counter())
            if chunk.get("usage"):
                stream.tokens = chunk["usage"]["completion_tokens"]
    stream.tokens = stream.tokens or len(stream.chunks)
    return stream


async def drive(base: str, model: str, requests: list[list[int]], concurrency: int) -> list[Stream]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 1)) as client:

        async def limited(prompt):
            async with limit:
                return await one_stream(client, base, model, prompt)

        return await asyncio.gather(*(limited(p) for p in requests))


def p50_p99(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def tree_rss_gb(proc: subprocess.Popen) -> float:
    root = psutil.Process(proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 1e9


def measure(base: str, proc, streams: int, rounds: int, vocab: int) -> Row:
    requests = prompts(streams * rounds, vocab)
    start = time.perf_counter()
    done = asyncio.run(drive(base, "model", requests, streams))
    wall = max(s.chunks[-1] for s in done) - start
    for s in done:
        if s.tokens != OUTPUT_TOKENS:
            raise SystemExit(f"a stream returned {s.tokens} tokens, not {OUTPUT_TOKENS}")
    ttft = [1e3 * (s.chunks[0] - s.sent) for s in done]
    itl = [1e3 * (b - a) for s in done for a, b in itertools.pairwise(s.chunks)]
    return Row(streams, sum(s.tokens for s in done) / wall, p50_p99(ttft), p50_p99(itl), tree_rss_gb(proc))


def warm(base: str, vocab: int) -> None:
    """One short request first: the first forward pass pays one-time costs (oneDNN, caches)."""
    asyncio.run(drive(base, "model", prompts(1, vocab, seed=99), 1))


@contextlib.contextmanager
def llama_server(gguf: Path, slots: int, log: Path):
    port = free_port()
    cmd = [
        str(LLAMA_SERVER),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * (PROMPT_TOKENS + OUTPUT_TOKENS + 16)),
        "-t",
        str(os.cpu_count()),
        "-a",
        "model",
    ]
    with started(cmd, dict(os.environ), log, f"http://127.0.0.1:{port}") as running:
        yield running


def demo_tokenizer() -> Path:
    """The synthetic model has SmolLM2's vocabulary size and no tokenizer: the demo model's."""
    sys.path.insert(0, str(ROOT / "examples"))
    from smollm2 import build_demo_model

    return build_demo_model()


def q4_k_m(bf16: Path) -> Path:
    """The Q4_K_M GGUF of the bf16 checkpoint, made in the bench venv (bench/llamacpp.py)."""
    script = Path(__file__).with_name("llamacpp.py")
    done = subprocess.run(
        [str(BENCH_PYTHON), str(script), str(bf16), str(demo_tokenizer()), "Q4_K_M", "--file-only"],
        capture_output=True,
        text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"Q4_K_M conversion failed:\n{done.stderr[-3000:]}")
    return Path(json.loads(lines[-1].removeprefix("RESULT "))["gguf"])


def avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def run_vllm(model: Path, label: str, args, vocab: int, kv_gib: int) -> list[Row]:
    rows = []
    with serve(model, CACHE / f"streams-{label}.log", kv_gib=kv_gib, tokenizer=demo_tokenizer()) as (
        base,
        proc,
    ):
        warm(base, vocab)
        for n in args.streams:
            rows.append(measure(base, proc, n, args.rounds, vocab))
            print(f"  {label}, {n} streams: {rows[-1].tok_s:.1f} tok/s", flush=True)
    return rows


def run_llama(gguf: Path, args, vocab: int) -> list[Row]:
    rows = []
    for n in args.streams:
        with llama_server(gguf, n, CACHE / "streams-llama-server.log") as (base, proc):
            warm(base, vocab)
            rows.append(measure(base, proc, n, args.rounds, vocab))
            print(f"  llama-server Q4_K_M, {n} streams: {rows[-1].tok_s:.1f} tok/s", flush=True)
    return rows


def print_tables(results: dict[str, list[Row]], skipped: dict[str, str]) -> None:
    print("\n| server | streams | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | RSS (GB) |")
    print("|---|---|---|---|---|---|")
    for label, rows in results.items():
        for r in rows:
            print(
                f"| {label} | {r.streams} | {r.tok_s:.1f} | {r.ttft_ms[0]:.0f} / {r.ttft_ms[1]:.0f} "
                f"| {r.itl_ms[0]:.0f} / {r.itl_ms[1]:.0f} | {r.rss_gb:.2f} |"
            )
    base = results.get("vLLM bf16")
    if base:
        streams = [r.streams for r in base]
        print("\n| output tok/s over vLLM bf16's | " + " | ".join(f"{n} streams" for n in streams) + " |")
        print("|---|" + "---|" * len(streams))
        for label, rows in results.items():
            print(
                f"| {label} | "
                + " | ".join(f"{r.tok_s / b.tok_s:.2f}x" for r, b in zip(rows, base, strict=True))
                + " |"
            )
    for label, why in skipped.items():
        print(f"\n{label}: not run ({why})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rounds", type=int, default=1, help="requests per stream")
    parser.add_argument("--servers", nargs="+", default=["bf16", "int4", "ct", "llama"])
    args = parser.parse_args()
    models = prepared_models("int4", args.layers)
    vocab = json.loads((models["bf16"] / "config.json").read_text())["vocab_size"]
    # KV for every stream at once (K and V: 2 x 4096 bf16 values a layer and token), a tenth to
    # spare: 32 layers' bf16 weights (13.8 GB) and their KV must fit in 24 GiB together.
    kv_bytes = max(args.streams) * (PROMPT_TOKENS + OUTPUT_TOKENS) * args.layers * 16384 * 1.1
    kv_gib = max(2, math.ceil(kv_bytes / 2**30))
    results: dict[str, list[Row]] = {}
    skipped: dict[str, str] = {}
    if "bf16" in args.servers:
        results["vLLM bf16"] = run_vllm(models["bf16"], "bf16", args, vocab, kv_gib)
    if "int4" in args.servers:
        results["vLLM + cpu_int4"] = run_vllm(models["int4"], "int4", args, vocab, kv_gib)
    if "ct" in args.servers:
        label = "stock vLLM, compressed-tensors W4A16 g64"
        if avx512():
            ct = write_compressed(models["bf16"], CACHE / f"{DENSE_MODEL[0]}-{args.layers}l-ct-w4a16")
            results[label] = run_vllm(ct, "ct", args, vocab, kv_gib)
        else:
            skipped[label] = "vLLM's CPUWNA16 kernel is built for AVX-512 only; this host has AVX2"
    if "llama" in args.servers:
        if LLAMA_SERVER.is_file():
            results["llama-server Q4_K_M"] = run_llama(q4_k_m(models["bf16"]), args, vocab)
        else:
            skipped["llama-server Q4_K_M"] = "run `make bench-deps` to build it"
    print(
        f"\n{args.layers} Llama-2-7B-shaped layers; {PROMPT_TOKENS} tokens in, {OUTPUT_TOKENS} out, "
        f"{args.rounds} request(s) per stream; {cpu_description()}"
    )
    print_tables(results, skipped)


if __name__ == "__main__":
    main()

"""Many users at once: servers driven over HTTP at 1, 4, 16 and 32 concurrent streams, and the
prefill of a lone prompt of 64 to 2048 tokens.

    .venv/bin/python bench/streams.py [--layers 4] [--streams 1 4 16 32] [--rounds 1]
                                      [--prefill 64 128 256 512 2048] [--servers bf16 int4 ct llama]

Servers, one after the other on this host, on the same weights (bench/synthetic.py's
Llama-2-7B-shaped layers, random bf16): `vllm serve` of the bf16 checkpoint, of its
`cpu-int4 quantize` output (g64), and of a compressed-tensors W4A16 checkpoint (int4,
asymmetric, g64; bench/compressed.py) that stock vLLM runs through its CPUWNA16 kernel (AVX-512
hosts only); and llama.cpp's `llama-server` on the Q4_K_M GGUF, `-np N` slots, continuous
batching (`make bench-deps` builds it). vLLM servers run eager, as the other benchmarks here.

Each stream: a prompt of 128 random token ids (its own for every request of a run, the same for
every server), 128 output tokens, greedy, ignore_eos, streamed. `--rounds R` sends R x N
requests at concurrency N. Per server and stream count: aggregate output tok/s (every output
token over the wall time from the first request sent to the last token), TTFT p50/p99, the gap
between streamed chunks (inter-token latency) p50/p99, and the RSS of the server's processes
after the run. Prefill: prompt length over the time to its first token, alone, the median of 3
prompts. Ratios to vLLM bf16 follow. Prints the CPU's model and ISA flags. Loopback only;
every request is bounded in time.
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
from compressed import write_compressed
from cpu_int4_vllm import native
from kernel import cpu_description
from load import free_port, serve, started, tree_rss_gb
from serve import BENCH_PYTHON, CACHE, DENSE_MODEL, prepared_models

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / ".bench-venv" / "llama-server" / "bin" / "llama-server"
PROMPT_TOKENS = OUTPUT_TOKENS = 128
PREFILL_REPEATS = 3
MAX_MODEL_LEN = 4096  # room for the longest prefill asked for
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


@dataclass
class Served:
    """One server's rows, one per stream count, and its prefill tok/s per prompt length."""

    rows: list[Row]
    prefill: dict[int, float]


def prompts(count: int, vocab: int, seed: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """`count` prompts of random token ids; each run uses its own seed, so no server finds a
    prompt it has already seen in its prefix cache."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


async def one_stream(
    client: httpx.AsyncClient, base: str, model: str, prompt: list[int], max_tokens: int = OUTPUT_TOKENS
) -> Stream:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
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


def measure(base: str, proc, streams: int, rounds: int, vocab: int) -> Row:
    requests = prompts(streams * rounds, vocab, seed=streams)
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
    asyncio.run(drive(base, "model", prompts(1, vocab, seed=-1), 1))


def prefill_tok_s(base: str, length: int, vocab: int) -> float:
    """A lone prompt of `length` tokens over its time to first token (one output token), the
    median of PREFILL_REPEATS prompts."""

    async def ttft(prompt: list[int]) -> float:
        async with httpx.AsyncClient() as client:
            stream = await one_stream(client, base, "model", prompt, max_tokens=1)
        return stream.chunks[0] - stream.sent

    seconds = [
        asyncio.run(ttft(p)) for p in prompts(PREFILL_REPEATS, vocab, seed=10_000 + length, length=length)
    ]
    return length / statistics.median(seconds)


@contextlib.contextmanager
def llama_server(gguf: Path, slots: int, context: int, log: Path):
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
        str(context),
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


def run_vllm(model: Path, label: str, args, vocab: int, kv_gib: int) -> Served:
    served = Served([], {})
    log = CACHE / f"streams-{label}.log"
    with serve(model, log, kv_gib=kv_gib, tokenizer=demo_tokenizer(), max_model_len=MAX_MODEL_LEN) as running:
        base, proc = running
        warm(base, vocab)
        for n in args.streams:
            served.rows.append(measure(base, proc, n, args.rounds, vocab))
            print(f"  {label}, {n} streams: {served.rows[-1].tok_s:.1f} tok/s", flush=True)
        for length in args.prefill:
            served.prefill[length] = prefill_tok_s(base, length, vocab)
    return served


def run_llama(gguf: Path, args, vocab: int) -> Served:
    served = Served([], {})
    for n in args.streams:
        slots_context = n * (PROMPT_TOKENS + OUTPUT_TOKENS + 16)
        with llama_server(gguf, n, slots_context, CACHE / "streams-llama-server.log") as running:
            base, proc = running
            warm(base, vocab)
            served.rows.append(measure(base, proc, n, args.rounds, vocab))
            print(f"  llama-server Q4_K_M, {n} streams: {served.rows[-1].tok_s:.1f} tok/s", flush=True)
    if args.prefill:
        with llama_server(gguf, 1, MAX_MODEL_LEN, CACHE / "streams-llama-server.log") as (base, _):
            warm(base, vocab)
            served.prefill = {length: prefill_tok_s(base, length, vocab) for length in args.prefill}
    return served


def print_tables(results: dict[str, Served], skipped: dict[str, str]) -> None:
    print("\n| server | streams | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | RSS (GB) |")
    print("|---|---|---|---|---|---|")
    for label, served in results.items():
        for r in served.rows:
            print(
                f"| {label} | {r.streams} | {r.tok_s:.1f} | {r.ttft_ms[0]:.0f} / {r.ttft_ms[1]:.0f} "
                f"| {r.itl_ms[0]:.0f} / {r.itl_ms[1]:.0f} | {r.rss_gb:.2f} |"
            )
    base = results.get("vLLM bf16")
    if base:
        tok_s = {label: [r.tok_s for r in served.rows] for label, served in results.items()}
        ratio_table("output tok/s", [f"{r.streams} streams" for r in base.rows], tok_s)
        if base.prefill:
            prefill = {label: list(served.prefill.values()) for label, served in results.items()}
            ratio_table("prefill tok/s", [f"{n}-token prompt" for n in base.prefill], prefill)
    for label, why in skipped.items():
        print(f"\n{label}: not run ({why})")


def ratio_table(what: str, columns: list[str], values: dict[str, list[float]]) -> None:
    """Each server's `what` per column, with its ratio to vLLM bf16's."""
    base = values["vLLM bf16"]
    print(f"\n| {what} (x vLLM bf16) | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label, row in values.items():
        cells = [f"{v:.1f} ({v / b:.2f}x)" for v, b in zip(row, base, strict=True)]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--rounds", type=int, default=1, help="requests per stream")
    parser.add_argument("--servers", nargs="+", default=["bf16", "int4", "ct", "llama"])
    parser.add_argument(
        "--prefill", type=int, nargs="*", default=[64, 128, 256, 512, 2048], help="prompt lengths"
    )
    args = parser.parse_args()
    models = prepared_models("int4", args.layers)
    vocab = json.loads((models["bf16"] / "config.json").read_text())["vocab_size"]
    # KV for every stream at once (K and V: 2 x 4096 bf16 values a layer and token), a tenth to
    # spare: 32 layers' bf16 weights (13.8 GB) and their KV must fit in 24 GiB together.
    tokens = max(max(args.streams) * (PROMPT_TOKENS + OUTPUT_TOKENS), MAX_MODEL_LEN)
    kv_bytes = tokens * args.layers * 16384 * 1.1
    kv_gib = max(2, math.ceil(kv_bytes / 2**30))
    results: dict[str, Served] = {}
    skipped: dict[str, str] = {}
    if "bf16" in args.servers:
        results["vLLM bf16"] = run_vllm(models["bf16"], "bf16", args, vocab, kv_gib)
    if "int4" in args.servers:
        results["vLLM + cpu_int4"] = run_vllm(models["int4"], "int4", args, vocab, kv_gib)
    if "ct" in args.servers:
        label = "stock vLLM, compressed-tensors W4A16 g64"
        if native.Isa.AVX512 in native.supported_isas():
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

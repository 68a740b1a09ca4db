"""Serving under load: 64 requests at concurrency 16 against `vllm serve`, bf16 vs cpu_int4.

    .venv/bin/python bench/load.py [--requests 64] [--concurrency 16]

Mixed prompt lengths (10 to 800 tokens of WikiText-2), mixed max_tokens (ignore_eos, so each
must come back at exactly that length), half of them streamed, all greedy; one streamed request
in eight is dropped by its client after a few chunks, and four malformed requests (bad JSON, an
unknown model, max_tokens beyond the context, no prompt) go in among them. Every completed
request is then sent again alone; the table gives how many kept the same first 16 tokens under
load, and the server's RSS after the load against its steady state before it. Loopback only;
every request and the whole run are bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from cpu_int4_vllm.dense import fast_bf16_gemm
from wikitext import wiki_text

REPO = Path(__file__).resolve().parent.parent
STARTUP_S = 600
# Without a fast bf16 GEMM (AVX2-only hosts) a bf16 server's prefill runs PyTorch's reference
# GEMM, ~4x slower (dense.py): the bf16 control's requests then need longer. Timeouts scale with
# the host; what the tests assert does not.
REQUEST_S = 300 * (1 if fast_bf16_gemm() else 4)
COMPARED_TOKENS = 16


@dataclass
class LoadResult:
    requests: int  # sent to completion (malformed and dropped ones not counted)
    completed: int  # answered with exactly max_tokens tokens
    errors: list[str]
    dropped: int  # streams the client closed early
    malformed_status: list[int]  # the HTTP status of each malformed request
    same_first_16: int
    healthy_after: bool
    rss_before_gb: float
    rss_after_gb: float
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(
    model: Path,
    log: Path,
    name: str = "model",
    kv_gib: int = 2,
    tokenizer: Path | None = None,
    max_model_len: int = 2048,
):
    """`vllm serve MODEL` on 127.0.0.1 (eager, `kv_gib` GiB of KV cache; the tokenizer from
    `tokenizer` if the model has none); yields the base URL and the server's process, stops it
    after."""
    port = free_port()
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [
        str(vllm),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--served-model-name",
        name,
        *(["--tokenizer", str(tokenizer)] if tokenizer else []),
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    with started(cmd, env, log, f"http://127.0.0.1:{port}") as (base, proc):
        yield base, proc


@contextlib.contextmanager
def started(cmd: list[str], env: dict, log: Path, base: str):
    """A server process from `cmd`, logging to `log`, once `base`/health answers; stopped after."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not healthy(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{Path(cmd[0]).name} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def make_requests(tokenizer_dir: Path, count: int, seed: int = 0) -> list[dict]:
    """Prompts of 10..800 tokens cut from WikiText-2, mixed max_tokens, every other one streamed,
    one in eight of those dropped by the client after DROP_AFTER chunks."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode(wiki_text().read_text()[:400_000], add_special_tokens=False)
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        length = rng.randint(10, 800)
        start = rng.randrange(0, len(ids) - length)
        requests.append(
            {
                "prompt": tok.decode(ids[start : start + length]),
                "max_tokens": rng.choice([16, 24, 32, 48, 64]),
                "stream": i % 2 == 1,
                "drop": i % 8 == 3,
            }
        )
    return requests


DROP_AFTER = 3  # chunks a dropping client reads before it closes the connection


def malformed(model: str) -> list[dict]:
    """Four requests a server must refuse with a 4xx answer, as httpx.post keyword arguments."""
    return [
        {"content": b'{"model": "' + model.encode() + b'", "prompt": "cut off'},  # bad JSON
        {"json": {"model": "no-such-model", "prompt": "Hello", "max_tokens": 4}},
        {"json": {"model": model, "prompt": "Hello", "max_tokens": 1_000_000}},  # beyond the context
        {"json": {"model": model, "max_tokens": 4}},  # no prompt
    ]


async def _complete(client, model: str, request: dict) -> list[str] | None:
    """Send one greedy completion; its generated tokens (as strings), or None if dropped."""
    args = dict(
        model=model,
        prompt=request["prompt"],
        max_tokens=request["max_tokens"],
        temperature=0,
        logprobs=1,
        timeout=REQUEST_S,
        extra_body={"ignore_eos": True},
    )
    if not request["stream"]:
        reply = await client.completions.create(**args)
        return list(reply.choices[0].logprobs.tokens)
    tokens: list[str] = []
    stream = await client.completions.create(**args, stream=True)
    chunks = 0
    async for chunk in stream:
        chunks += 1
        if request.get("drop") and chunks == DROP_AFTER:
            await stream.close()  # the client goes away mid-stream
            return None
        if chunk.choices and chunk.choices[0].logprobs:
            tokens.extend(chunk.choices[0].logprobs.tokens)
    return tokens


async def _refused(base: str, request: dict) -> int:
    async with httpx.AsyncClient(timeout=REQUEST_S) as client:
        reply = await client.post(
            f"{base}/v1/completions", headers={"content-type": "application/json"}, **request
        )
        return reply.status_code


async def _run(base: str, model: str, requests: list[dict], concurrency: int) -> tuple[list, list, list]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    limit = asyncio.Semaphore(concurrency)

    async def one(request):
        async with limit:
            return await _complete(client, model, request)

    bad = [_refused(base, r) for r in malformed(model)]
    (*under_load,) = await asyncio.gather(*(one(r) for r in requests), *bad, return_exceptions=True)
    under_load, statuses = under_load[: len(requests)], under_load[len(requests) :]
    alone = []
    for request, loaded in zip(requests, under_load, strict=True):
        single = {**request, "max_tokens": COMPARED_TOKENS, "stream": False, "drop": False}
        alone.append(await _complete(client, model, single) if isinstance(loaded, list) else None)
    await client.close()
    return under_load, alone, statuses


def tree_rss_gb(proc: subprocess.Popen) -> float:
    """RSS of a server and every process it started."""
    import psutil

    root = psutil.Process(proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 1e9


def run_load(
    base: str, model: str, requests: list[dict], proc: subprocess.Popen, concurrency: int = 16
) -> LoadResult:
    """Send `requests` (and the malformed ones) at `concurrency`, then each completed one alone;
    count completions of the right length, errors, refusals, agreement, and RSS before and after.
    The steady state is the RSS after a first pass of the same requests, not counted."""
    warm = [{**r, "drop": False} for r in requests[:concurrency]]
    asyncio.run(_run(base, model, warm, concurrency))
    before = tree_rss_gb(proc)
    start = time.perf_counter()
    under_load, alone, statuses = asyncio.run(_run(base, model, requests, concurrency))
    seconds = time.perf_counter() - start
    errors = [f"{type(r).__name__}: {r}" for r in [*under_load, *statuses] if isinstance(r, BaseException)]
    kept = [(r, loaded) for r, loaded in zip(requests, under_load, strict=True) if not r["drop"]]
    completed = sum(1 for r, loaded in kept if isinstance(loaded, list) and len(loaded) == r["max_tokens"])
    dropped = sum(1 for r, loaded in zip(requests, under_load, strict=True) if r["drop"] and loaded is None)
    same = sum(
        1
        for loaded, single in zip(under_load, alone, strict=True)
        if isinstance(loaded, list) and loaded[:COMPARED_TOKENS] == single[:COMPARED_TOKENS]
    )
    refusals = [s for s in statuses if isinstance(s, int)]
    after = tree_rss_gb(proc)
    return LoadResult(
        len(kept), completed, errors, dropped, refusals, same, healthy(base), before, after, seconds
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "examples"))
    from cpu_int4.quantize import quantize
    from smollm2 import build_demo_model

    base_model = build_demo_model()
    quant = REPO / ".cache" / "smollm2-135m-instruct-cpu-int4"
    if not (quant / "config.json").is_file():
        quantize(str(base_model), quant)
    requests = make_requests(base_model, args.requests)
    rows = []
    for label, model in (("bf16", base_model), ("cpu_int4", quant)):
        with serve(model, REPO / ".cache" / f"load-{label}.log") as (base, proc):
            rows.append((label, run_load(base, "model", requests, proc, args.concurrency)))
    print(
        f"\n{args.requests} requests at concurrency {args.concurrency}, prompts 10-800 tokens, half streamed,"
        f" {sum(r['drop'] for r in requests)} dropped mid-stream, {len(malformed('model'))} malformed\n"
    )
    print(
        "| model | completed | errors | malformed: status | healthy after | same first 16 tokens as alone "
        "| RSS before / after (GB) | wall time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        print(
            f"| {label} | {r.completed}/{r.requests} | {len(r.errors)} | {r.malformed_status} "
            f"| {'yes' if r.healthy_after else 'NO'} "
            f"| {r.same_first_16}/{r.completed} ({r.same_first_16 / r.completed:.0%}) "
            f"| {r.rss_before_gb:.2f} / {r.rss_after_gb:.2f} | {r.seconds:.0f} s |"
        )


if __name__ == "__main__":
    main()

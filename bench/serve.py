"""Decode, prefill, memory and engine start: vLLM bf16 vs cpu_int4, or cpu_int4 at TP=1 vs TP=2.

    .venv/bin/python bench/serve.py [--rounds 3] [--layers 4] [--compare tp]

The model: 4 Llama-2-7B-shaped layers (hidden 4096, MLP 11008, vocab 49152, untied head),
random bf16 weights (bench/synthetic.py), and its `cpu-int4 quantize` output (g64). Each
measurement is a fresh process per model, interleaved (bf16, int4, int4, bf16, ...), eager,
2 threads. Decode: tokens/s over 128 greedy tokens at batch 1 (the first token's time, i.e. the
prefill, taken out). Prefill: a 512-token prompt, time to its first token. Memory: RSS of the
serving processes after load, and the bytes the model's parameters hold. Prints medians with
their spread (min-max) and the ratios. `--compare tp` serves the cpu_int4 model on one rank and
on two (vLLM's `mp` executor), each rank bound to its own core (VLLM_CPU_OMP_THREADS_BIND=0|1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic import build_synthetic  # noqa: E402

CACHE = Path(__file__).resolve().parent.parent / ".cache"
DECODE_TOKENS = 128
PREFILL_TOKENS = 512
WORKER_TIMEOUT_S = 900
# (key, label, higher is better)
METRICS = [
    ("decode_tok_s", "decode tok/s (batch 1, 128 tokens)", True),
    ("prefill_tok_s", f"prefill tok/s ({PREFILL_TOKENS}-token prompt)", True),
    ("weights_gb", "weights held by the model (GB)", False),
    ("rss_gb", "RSS of serving processes after load (GB)", False),
    ("start_s", "engine start (s)", False),
]


# name -> (which checkpoint, tensor-parallel size, VLLM_CPU_OMP_THREADS_BIND)
COMPARISONS = {
    "int4": {"vLLM bf16": ("bf16", 1, "nobind"), "vLLM cpu_int4": ("int4", 1, "nobind")},
    "tp": {"cpu_int4 TP=1": ("int4", 1, "nobind"), "cpu_int4 TP=2": ("int4", 2, "0|1")},
}


def measure(model: str, tp: int) -> dict:
    """One model in this process: start the engine, then time decode and prefill."""
    import psutil
    import torch
    from report import weight_bytes
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=2048,
        enable_prefix_caching=False,
        seed=0,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
    )
    start_s = time.perf_counter() - start
    me = psutil.Process()
    rss = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
    weights = sum(llm.apply_model(weight_bytes))  # one entry per rank
    gen = torch.Generator().manual_seed(0)

    def timed(prompt_len: int, max_tokens: int) -> float:
        ids = torch.randint(100, 40000, (prompt_len,), generator=gen).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        begin = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == max_tokens
        return time.perf_counter() - begin

    timed(16, 8)  # warm-up
    first = min(timed(16, 1) for _ in range(3))
    decode_s = timed(16, DECODE_TOKENS + 1) - first
    prefill_s = min(timed(PREFILL_TOKENS, 1) for _ in range(2))
    return {
        "decode_tok_s": DECODE_TOKENS / decode_s,
        "prefill_tok_s": PREFILL_TOKENS / prefill_s,
        "weights_gb": weights / 1e9,
        "rss_gb": rss / 1e9,
        "start_s": start_s,
    }


def run_worker(model: Path, tp: int, bind: str) -> dict:
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model ships a function to the worker
    }
    done = subprocess.run(
        [sys.executable, __file__, "--worker", str(model), "--tp", str(tp)],
        env=env,
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"worker for {model} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def prepared_models(layers: int) -> dict[str, Path]:
    from cpu_int4.quantize import quantize

    bf16 = build_synthetic(CACHE / f"synthetic-7b-shapes-{layers}l", layers)
    int4 = CACHE / f"synthetic-7b-shapes-{layers}l-cpu_int4"
    if not (int4 / "config.json").is_file():
        quantize(str(bf16), int4)
    return {"bf16": bf16, "int4": int4}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def print_table(results: dict[str, list[dict]]) -> None:
    (a_name, a_runs), (b_name, b_runs) = results.items()
    print(f"| metric | {a_name} | {b_name} | {b_name} / {a_name} |")
    print("|---|---|---|---|")
    for key, label, _ in METRICS:
        a = [r[key] for r in a_runs]
        b = [r[key] for r in b_runs]
        ratio = statistics.median(b) / statistics.median(a)
        print(f"| {label} | {spread(a)} | {spread(b)} | {ratio:.2f}x |")
    print(f"\nmedian (min-max) of {len(a_runs)} rounds, each a fresh process, models interleaved")


def llama_cpp_note() -> str:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama_cpp is not importable here: no llama.cpp rows (its wheel compiles for 15+ min)"
    return "llama_cpp is importable, but llama.cpp rows are not implemented in this script yet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="int4")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(measure(args.worker, args.tp)), flush=True)
        return
    checkpoints = prepared_models(args.layers)
    runs = COMPARISONS[args.compare]
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            which, tp, bind = runs[name]
            results[name].append(run_worker(checkpoints[which], tp, bind))
            print(f"round {round_ + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    print_table(results)
    print("bindings (VLLM_CPU_OMP_THREADS_BIND): " + ", ".join(f"{n}: {b}" for n, (_, _, b) in runs.items()))
    if args.compare == "int4":
        print(llama_cpp_note())


if __name__ == "__main__":
    main()

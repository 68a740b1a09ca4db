"""Decode, prefill, memory and engine start: vLLM bf16 vs cpu_int4 vs llama.cpp, cpu_int4 at
TP=1 vs TP=2, cpu_int4 under different thread settings, or a mixture-of-experts model.

    .venv/bin/python bench/serve.py [--rounds 3] [--layers 4]
                                       [--compare int4|modes|spin|tp|threads|moe|nice|step]
                                       [--compiled]

The model: 4 Llama-2-7B-shaped layers (hidden 4096, MLP 11008, vocab 49152, untied head),
random bf16 weights (bench/synthetic.py), its `cpu-int4 quantize` output (g64) and, where
`make bench-deps` has built llama.cpp, its Q4_K_M and Q4_0 GGUFs (bench/llamacpp.py). Each
measurement is a fresh process, runs interleaved (forward, then backward, round by round),
eager. Decode: tokens/s over 128 greedy tokens at batch 1 (the first token's time, i.e. the
prefill, taken out), the median of 3 runs. Prefill: a 512-token prompt, time to its first
token. Memory: RSS of the serving processes after load, and the bytes the model's parameters
hold. Prints medians with their spread (min-max), the ratios to the first run, the thread
settings and the CPU.
`--compare int4` also runs the cpu_int4 model on the AVX2 kernel path (CPU_INT4_ISA=avx2), on
hosts whose own path is wider, and on AMX hosts without the AMX kernel (CPU_INT4_AMX=0: large
batches through a dequantized W^T and oneDNN instead).
`--compare spin` serves the cpu_int4 model as the plugin sets libgomp's spin (openmp_spin.py),
at libgomp's own default, with CPU_INT4_ENGINE_NICE=19 too, and with vLLM's spinning wait in the
engine core (CPU_INT4_ENGINE_WAIT=spin, engine_wait.py).
`--compare tp` serves it on one rank and on two (vLLM's `mp` executor), each rank bound to its
own core (VLLM_CPU_OMP_THREADS_BIND=0|1). `--compare threads` is the study in docs/runtime.md.
`--compare moe` serves 4 Qwen3-30B-A3B-shaped layers instead (hidden 2048, 128 experts of width
768, 8 active per token; vocab 49152): bf16 against cpu_int4 on the host's kernel and on the
AVX2 path. `--compare nice` serves that model in bf16 and cpu_int4, each with and without
CPU_INT4_ENGINE_NICE=19 (runtime/cpu_int4_vllm/engine_priority.py), and cpu_int4 under vLLM's
default binding (`auto`: a core kept for the engine per rank). `--compare step` serves bf16
and cpu_int4 with one call from the engine core to the worker a step and with vLLM's two
(CPU_INT4_ONE_CALL_STEP=0, one_call_step.py); bench/alternate.py --switch step compares the two in one engine.
`--compiled` serves in vLLM's default mode (torch.compile), as `vllm serve` does without flags,
instead of eager. `--compare modes` serves the cpu_int4 model both ways, beside llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from cpu_int4_vllm import native  # noqa: E402
from cpu_int4_vllm.engine_priority import ENV as ENGINE_NICE  # noqa: E402
from cpu_int4_vllm.engine_wait import ENV as ENGINE_WAIT  # noqa: E402
from cpu_int4_vllm.native import AMX_ENV as AMX  # noqa: E402
from cpu_int4_vllm.one_call_step import ENV as ONE_CALL  # noqa: E402
from cpu_int4_vllm.openmp_spin import ENV as OPENMP_SPIN  # noqa: E402
from kernel import cpu_description  # noqa: E402
from smollm2 import build_demo_model  # noqa: E402
from synthetic import build_synthetic, build_synthetic_moe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
BENCH_PYTHON = ROOT / ".bench-venv" / "bin" / "python"  # `make bench-deps`
DECODE_TOKENS = 128
# Decode is the median of 3 in each process: one 128-token run of the MoE model takes ~2 s, and
# on these VMs single runs of the same process type ranged 55-72 tok/s (Zen 4 EPYC).
DECODE_REPEATS = 3
PREFILL_TOKENS = 512
WORKER_TIMEOUT_S = 900
# (key, label)
METRICS = [
    ("decode_tok_s", "decode tok/s (batch 1, 128 tokens)"),
    ("prefill_tok_s", f"prefill tok/s ({PREFILL_TOKENS}-token prompt)"),
    ("weights_gb", "weights held by the model (GB)"),
    ("rss_gb", "RSS of serving processes after load (GB)"),
    ("start_s", "engine start (s)"),
]


@dataclass(frozen=True)
class Run:
    """One column of a table: which checkpoint, served how."""

    checkpoint: str  # "bf16" or "int4" (vLLM), or a llama.cpp type ("Q4_K_M", "Q4_0")
    tp: int = 1
    bind: str = "nobind"  # VLLM_CPU_OMP_THREADS_BIND
    env: tuple[tuple[str, str], ...] = ()
    compiled: bool | None = None  # True: torch.compile, False: eager, None: as --compiled says


LLAMA_CPP = {"llama.cpp Q4_K_M": Run("Q4_K_M"), "llama.cpp Q4_0": Run("Q4_0")}
COMPARISONS = {
    "int4": {
        "vLLM bf16": Run("bf16"),
        "vLLM cpu_int4": Run("int4"),
        "cpu_int4, AVX2 path": Run("int4", env=(("CPU_INT4_ISA", "avx2"),)),
        "cpu_int4, no AMX kernel": Run("int4", env=((AMX, "0"),)),
        **LLAMA_CPP,
    },
    "spin": {
        "vLLM cpu_int4": Run("int4"),
        "cpu_int4, libgomp's default spin": Run("int4", env=((OPENMP_SPIN, "300000"),)),
        "cpu_int4, engine nice 19": Run("int4", env=((ENGINE_NICE, "19"),)),
        "cpu_int4, vLLM's engine spin": Run("int4", env=((ENGINE_WAIT, "spin"),)),
    },
    "modes": {
        "cpu_int4 eager": Run("int4", compiled=False),
        "cpu_int4 compiled": Run("int4", compiled=True),
        **LLAMA_CPP,
    },
    "tp": {"cpu_int4 TP=1": Run("int4"), "cpu_int4 TP=2": Run("int4", tp=2, bind="0|1")},
    "threads": {
        "torch 1": Run("int4", env=(("OMP_NUM_THREADS", "1"), ("CPU_INT4_THREADS", "0"))),
        "torch 2": Run("int4", env=(("OMP_NUM_THREADS", "2"), ("CPU_INT4_THREADS", "0"))),
        "torch 1, GEMV 2": Run("int4", env=(("OMP_NUM_THREADS", "1"), ("CPU_INT4_THREADS", "2"))),
        "torch 2, GEMV 2": Run("int4", env=(("OMP_NUM_THREADS", "2"), ("CPU_INT4_THREADS", "2"))),
        "torch 2, GEMV 2, passive": Run(
            "int4", env=(("OMP_NUM_THREADS", "2"), ("CPU_INT4_THREADS", "2"), ("OMP_WAIT_POLICY", "passive"))
        ),
    },
    "moe": {
        "vLLM bf16": Run("bf16"),
        "vLLM cpu_int4": Run("int4"),
        "cpu_int4, AVX2 path": Run("int4", env=(("CPU_INT4_ISA", "avx2"),)),
    },
    "nice": {
        "vLLM bf16": Run("bf16"),
        "vLLM bf16, engine nice 19": Run("bf16", env=((ENGINE_NICE, "19"),)),
        "vLLM cpu_int4": Run("int4"),
        "cpu_int4, engine nice 19": Run("int4", env=((ENGINE_NICE, "19"),)),
        "cpu_int4, vLLM's default binding": Run("int4", bind="auto"),
    },
    "step": {
        "vLLM bf16": Run("bf16"),
        "vLLM bf16, two calls a step": Run("bf16", env=((ONE_CALL, "0"),)),
        "vLLM cpu_int4": Run("int4"),
        "cpu_int4, two calls a step": Run("int4", env=((ONE_CALL, "0"),)),
    },
}
# The checkpoint each comparison serves: (cache folder stem, builder).
MOE_MODEL = ("synthetic-qwen3-30b-a3b-shapes", build_synthetic_moe)
MODELS = {"moe": MOE_MODEL, "nice": MOE_MODEL}
DENSE_MODEL = ("synthetic-7b-shapes", build_synthetic)


def measure(model: str, tp: int, compiled: bool) -> dict:
    """One model in this process: start the engine, then time decode and prefill."""
    import psutil
    import torch
    from report import torch_threads, weight_bytes
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=not compiled,
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
    threads = llm.apply_model(torch_threads)[0]
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
    decode_s = statistics.median(timed(16, DECODE_TOKENS + 1) - first for _ in range(DECODE_REPEATS))
    prefill_s = min(timed(PREFILL_TOKENS, 1) for _ in range(2))
    return {
        "decode_tok_s": DECODE_TOKENS / decode_s,
        "prefill_tok_s": PREFILL_TOKENS / prefill_s,
        "weights_gb": weights / 1e9,
        "rss_gb": rss / 1e9,
        "start_s": start_s,
        "torch_threads": threads,
    }


def run_worker(model: Path, run: Run, compiled: bool) -> dict:
    """`run` measured in a fresh process: vLLM here, llama.cpp in its own venv."""
    if run.checkpoint not in ("bf16", "int4"):
        script = Path(__file__).with_name("llamacpp.py")
        threads = str(os.cpu_count())
        # The synthetic model has SmolLM2's vocabulary size; llama.cpp's converter needs a tokenizer.
        tokenizer = build_demo_model()
        return result_of([str(BENCH_PYTHON), str(script), str(model), str(tokenizer), run.checkpoint,
                          "--threads", threads], dict(os.environ), model)  # fmt: skip
    env = {
        **os.environ,
        **dict(run.env),
        "VLLM_CPU_OMP_THREADS_BIND": run.bind,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model ships a function to the worker
    }
    command = [sys.executable, __file__, "--worker", str(model), "--tp", str(run.tp)]
    return result_of(command + ["--compiled"] * compiled, env, model)


def result_of(command: list[str], env: dict, model: Path) -> dict:
    """The RESULT line of a worker process."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"worker for {model} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def prepared_models(comparison: str, layers: int) -> dict[str, Path]:
    from cpu_int4.quantize import quantize

    stem, build = MODELS.get(comparison, DENSE_MODEL)
    bf16 = build(CACHE / f"{stem}-{layers}l", layers)
    int4 = CACHE / f"{stem}-{layers}l-cpu_int4"
    if not (int4 / "config.json").is_file():
        quantize(str(bf16), int4)
    return {"bf16": bf16, "int4": int4, **{run.checkpoint: bf16 for run in LLAMA_CPP.values()}}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def median(results: dict[str, list[dict]], name: str, key: str) -> float:
    return statistics.median(r[key] for r in results[name])


def print_table(results: dict[str, list[dict]]) -> None:
    """Medians (min-max) per run, then each run against the first."""
    names = list(results)
    print("| metric | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key, label in METRICS:
        print(f"| {label} | " + " | ".join(spread([r[key] for r in results[n]]) for n in names) + " |")
    base = names[0]
    print(f"\n| ratio to {base} | " + " | ".join(names[1:]) + " |")
    print("|---|" + "---|" * (len(names) - 1))
    for key, label in METRICS:
        ratios = [median(results, n, key) / median(results, base, key) for n in names[1:]]
        print(f"| {label} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    print(f"\nmedian (min-max) of {len(results[base])} rounds, each a fresh process, runs interleaved")


def describe(runs: dict[str, Run], results: dict[str, list[dict]]) -> None:
    """Each run's thread settings, as measured in its worker."""
    for name, run in runs.items():
        threads = results[name][0].get("torch_threads")
        if threads is None:
            print(f"{name}: {os.cpu_count()} threads")
            continue
        settings = [f"VLLM_CPU_OMP_THREADS_BIND={run.bind}", *(f"{k}={v}" for k, v in run.env)]
        print(f"{name}: {', '.join(settings)}; worker torch threads: {threads}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="int4")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="vLLM's default mode (torch.compile), as `vllm serve` runs without flags",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(measure(args.worker, args.tp, args.compiled)), flush=True)
        return
    checkpoints = prepared_models(args.compare, args.layers)
    runs = dict(COMPARISONS[args.compare])
    if not BENCH_PYTHON.exists() and set(runs) & set(LLAMA_CPP):
        runs = {name: run for name, run in runs.items() if name not in LLAMA_CPP}
        print("no .bench-venv (`make bench-deps` builds it): no llama.cpp runs", file=sys.stderr)
    if native.supported_isas() == [native.Isa.AVX2]:
        runs = {name: run for name, run in runs.items() if ("CPU_INT4_ISA", "avx2") not in run.env}
        print("this host's own kernel path is AVX2: no separate AVX2 column", file=sys.stderr)
    if not native.amx():
        runs = {name: run for name, run in runs.items() if (AMX, "0") not in run.env}
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            run = runs[name]
            compiled = args.compiled if run.compiled is None else run.compiled
            results[name].append(run_worker(checkpoints[run.checkpoint], run, compiled))
            print(f"round {round_ + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    print_table(results)
    describe(runs, results)
    print(cpu_description())


if __name__ == "__main__":
    main()

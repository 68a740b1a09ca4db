"""llama.cpp on the benchmark's model: GGUF conversion, Q4_K_M / Q4_0 quantization, decode and
prefill timing. Runs in the venv `make bench-deps` builds (.bench-venv), called by serve.py.

    .bench-venv/bin/python bench/llamacpp.py BF16_DIR TOKENIZER_DIR Q4_K_M --threads 2

Converts BF16_DIR (safetensors + config) with the converter bundled in llama-cpp-python's sdist,
taking the tokenizer from TOKENIZER_DIR (the synthetic model has none), quantizes with the
bindings' `llama_model_quantize`, then times what serve.py times for vLLM: 128 greedy tokens
after a 16-token prompt (the median of 3 runs), and a 512-token prompt's evaluation. Prints
one RESULT line (JSON); with --file-only, just the GGUF's path (bench/streams.py serves it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
import numpy as np

BENCH_VENV = Path(__file__).resolve().parent.parent / ".bench-venv"
CONVERTER = next(BENCH_VENV.glob("sdist/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"), None)
FTYPES = {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}
DECODE_TOKENS = 128
DECODE_REPEATS = 3  # as serve.py
PREFILL_TOKENS = 512


def converted(bf16_dir: Path, tokenizer_dir: Path, out: Path) -> Path:
    """BF16_DIR as a bf16 GGUF, its tokenizer files taken from TOKENIZER_DIR (once)."""
    if out.is_file():
        return out
    if CONVERTER is None:
        raise SystemExit("no GGUF converter under .bench-venv/sdist: run `make bench-deps`")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        for f in bf16_dir.iterdir():
            (model / f.name).symlink_to(f.resolve())
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).symlink_to((tokenizer_dir / name).resolve())
        staged = out.with_suffix(".partial")
        done = subprocess.run(
            [sys.executable, str(CONVERTER), str(model), "--outtype", "bf16", "--outfile", str(staged)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            staged.unlink(missing_ok=True)
            raise SystemExit(f"GGUF conversion of {bf16_dir} failed:\n{done.stderr[-3000:]}")
        os.replace(staged, out)
    return out


def quantized(source: Path, kind: str) -> Path:
    """`source` quantized to `kind` (Q4_K_M or Q4_0) by llama.cpp (once)."""
    out = source.with_name(f"{source.stem}-{kind}.gguf")
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[kind]
        params.nthread = os.cpu_count() or 1
        staged = out.with_suffix(".partial")
        if llama_cpp.llama_model_quantize(str(source).encode(), str(staged).encode(), params) != 0:
            raise SystemExit(f"llama_model_quantize failed for {source} -> {kind}")
        os.replace(staged, out)
    return out


def measure(gguf: Path, threads: int) -> dict:
    """Engine start, decode and prefill tok/s, file size and peak RSS, as serve.py reports them."""
    start = time.perf_counter()
    llm = llama_cpp.Llama(
        str(gguf),
        n_ctx=2048,
        n_batch=PREFILL_TOKENS,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    start_s = time.perf_counter() - start
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return rng.integers(100, 40000, n).tolist()

    def decode_s(ids: list[int], tokens: int) -> float:
        """Seconds for `tokens` greedy tokens after the first (the prompt's own step taken out)."""
        llm.reset()
        for i, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1)):
            if i == 0:
                first = time.perf_counter()
            if i == tokens:
                return time.perf_counter() - first
        raise AssertionError("generation ended early")

    def prefill_s(ids: list[int]) -> float:
        llm.reset()
        begin = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - begin

    decode_s(prompt(16), 8)  # warm-up
    decode = statistics.median(decode_s(prompt(16), DECODE_TOKENS) for _ in range(DECODE_REPEATS))
    prefill = min(prefill_s(prompt(PREFILL_TOKENS)) for _ in range(2))
    return {
        "decode_tok_s": DECODE_TOKENS / decode,
        "prefill_tok_s": PREFILL_TOKENS / prefill,
        "weights_gb": gguf.stat().st_size / 1e9,
        "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "start_s": start_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bf16_dir", type=Path)
    parser.add_argument("tokenizer_dir", type=Path)
    parser.add_argument("kind", choices=sorted(FTYPES))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--file-only", action="store_true", help="make the GGUF and print its path, no timing"
    )
    args = parser.parse_args()
    source = converted(
        args.bf16_dir, args.tokenizer_dir, args.bf16_dir.with_name(args.bf16_dir.name + ".gguf")
    )
    gguf = quantized(source, args.kind)
    result = {"gguf": str(gguf)} if args.file_only else measure(gguf, args.threads)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

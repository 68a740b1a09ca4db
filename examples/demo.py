"""The demo: build SmolLM2-135M-Instruct (bf16), quantize it with `cpu-int4`, serve one prompt.

Run with `make demo`. The quantized model lands in .cache/smollm2-135m-instruct-cpu-int4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from smollm2 import DEFAULT_DIR, build_demo_model

OUT = DEFAULT_DIR.with_name("smollm2-135m-instruct-cpu-int4")
QUESTION = "Explain in two sentences why the sky is blue."


def main() -> None:
    source = build_demo_model()
    print(f"demo model: {source}", flush=True)
    cli = Path(sys.executable).with_name("cpu-int4")
    subprocess.run([str(cli), "quantize", str(source), str(OUT), "--overwrite"], check=True)

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(OUT), enforce_eager=True, max_model_len=2048, kv_cache_memory_bytes=1 << 30)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    start = time.perf_counter()
    result = llm.chat([{"role": "user", "content": QUESTION}], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    tokens = len(result.outputs[0].token_ids)
    print(f"\nQ: {QUESTION}\nA: {result.outputs[0].text.strip()}")
    rate = tokens / seconds
    print(f"{tokens} tokens in {seconds:.2f} s = {rate:.1f} tok/s (prefill + decode, eager, cpu_int4)")


if __name__ == "__main__":
    main()

"""One batch through one layer: vLLM's bf16 GEMM against cpu_int4's paths, in ms per call, for
the row counts of many decoding streams and of prefills.

    .venv/bin/python bench/prefill.py [--rows 16 64 512] [--rounds 5]

Layers: the Llama-7B shapes (11008 x 4096, 4096 x 11008, 4096 x 4096; g64), random weights.
Columns: vLLM's bf16 linear as its CPU build runs it (oneDNN on weights packed at load,
`create_onednn_mm`); cpu_int4's path (`native_linear`: the AMX kernel where native.amx() says
so); the same with the AMX kernel off (W^T dequantized a slice at a time for a bf16 GEMM).
Each cell: the median of `--rounds` rounds, each the median of 5 calls, the columns taking
turns within a round so that this VM's drifting speed hits all of them alike. Runs on torch's
threads (all cores here). Prints one table and the CPU's model and ISA flags.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import time

import torch
import vllm._custom_ops as vllm_ops
from cpu_int4_vllm import native, native_backend
from cpu_int4_vllm.format import quantize_minmax
from cpu_int4_vllm.native_layout import pack_native
from kernel import cpu_description

SHAPES = [(11008, 4096), (4096, 11008), (4096, 4096)]  # (N, K): gate/up, down, attention
G = 64
CALLS = 5


def ms_per_call(fn) -> float:
    fn()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def int4_linear(x, lanes, sz, amx: bool):
    """A call of native_linear with the AMX kernel on or off (native.amx caches the setting)."""

    def call():
        os.environ[native.AMX_ENV] = "1" if amx else "0"
        native.amx.cache_clear()
        return native_backend.native_linear(x, lanes, sz, G)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 512])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    has_amx = native.amx()
    print(
        "| rows | N x K | vLLM bf16 (oneDNN, prepacked): ms (GFLOPS) | cpu_int4: ms (GFLOPS) "
        "| cpu_int4, no AMX kernel | int4 / bf16 time |"
    )
    print("|---|---|---|---|---|---|")
    for rows, (n, k) in itertools.product(args.rows, SHAPES):
        weight = torch.randn(n, k) * 0.02
        lanes, sz = pack_native(*quantize_minmax(weight, G))
        handler = vllm_ops.create_onednn_mm(weight.bfloat16().t(), 32)
        x = torch.randn(rows, k).bfloat16()
        columns = {
            "bf16": functools.partial(vllm_ops.onednn_mm, handler, x, None),
            "int4": int4_linear(x, lanes, sz, has_amx),
        }
        if has_amx:
            columns["no amx"] = int4_linear(x, lanes, sz, False)
        times: dict[str, list[float]] = {name: [] for name in columns}
        for _ in range(args.rounds):
            for name, fn in columns.items():
                times[name].append(ms_per_call(fn))
        ms = {name: statistics.median(t) for name, t in times.items()}
        no_amx = f"{ms['no amx']:.2f}" if has_amx else "(no AMX on this CPU)"
        ratio = ms["int4"] / ms["bf16"]
        gflops = {name: 2 * rows * n * k / t / 1e6 for name, t in ms.items()}
        print(
            f"| {rows} | {n} x {k} | {ms['bf16']:.2f} ({gflops['bf16']:.0f}) "
            f"| {ms['int4']:.2f} ({gflops['int4']:.0f}) | {no_amx} | {ratio:.2f} |"
        )
    print(cpu_description())


if __name__ == "__main__":
    main()

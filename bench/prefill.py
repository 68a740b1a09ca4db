"""One batch through one layer: vLLM's bf16 GEMM against cpu_int4's paths, in ms per call, for
the row counts of many decoding streams and of prefills.

    .venv/bin/python bench/prefill.py [--rows 16 64 512] [--rounds 5]

Layers: the Llama-7B shapes (11008 x 4096, 4096 x 11008, 4096 x 4096; g64), random weights.
Columns: vLLM's bf16 linear as its CPU build runs it (oneDNN on weights packed at load,
`create_onednn_mm`); cpu_int4 as served (`native_linear`: the kernel below
`kernel_row_limit()` rows, else the dense path, which is the AMX kernel where native.amx()
says so); the kernel alone at any row count; the dense path without the AMX kernel (W^T
dequantized a slice at a time for a bf16 GEMM, fp32 on hosts without a fast bf16 GEMM).
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


def amx_set(on: bool) -> None:
    """The AMX kernel on or off for what follows (native.amx and the row limit cache it)."""
    os.environ[native.AMX_ENV] = "1" if on else "0"
    native.amx.cache_clear()
    native_backend.kernel_row_limit.cache_clear()


def with_amx(on: bool, fn, *args):
    """fn(*args) with the AMX kernel on or off."""

    def call():
        amx_set(on)
        return fn(*args)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 512])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    has_amx, isa = native.amx(), int(native.isa())
    print(
        "| rows | N x K | vLLM bf16 (oneDNN, prepacked) | cpu_int4 as served | kernel | dense path, no AMX "
        "| served / bf16 time |"
    )
    print("|---|---|---|---|---|---|---|")
    for rows, (n, k) in itertools.product(args.rows, SHAPES):
        weight = torch.randn(n, k) * 0.02
        lanes, sz = pack_native(*quantize_minmax(weight, G))
        handler = vllm_ops.create_onednn_mm(weight.bfloat16().t(), 32)
        x = torch.randn(rows, k).bfloat16()
        columns = {
            "bf16": functools.partial(vllm_ops.onednn_mm, handler, x, None),
            "int4": with_amx(has_amx, native_backend.native_linear, x, lanes, sz, G),
            "kernel": functools.partial(torch.ops.cpu_int4_native.gemv, x, lanes, sz, G, isa),
            "dense": with_amx(False, native_backend._many_rows_gemm, x, lanes, sz, G, isa),
        }
        times: dict[str, list[float]] = {name: [] for name in columns}
        for _ in range(args.rounds):
            for name, fn in columns.items():
                times[name].append(ms_per_call(fn))
        amx_set(has_amx)
        ms = {name: statistics.median(t) for name, t in times.items()}
        cells = [f"{ms[name]:.2f} ({2 * rows * n * k / ms[name] / 1e6:.0f})" for name in columns]
        print(f"| {rows} | {n} x {k} | " + " | ".join(cells) + f" | {ms['int4'] / ms['bf16']:.2f} |")
    print("ms per call (GFLOPS); " + cpu_description())


if __name__ == "__main__":
    main()

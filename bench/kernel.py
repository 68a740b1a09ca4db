"""The int4 GEMV's speed in GB/s of weights read, per ISA path, row count and thread count,
next to this host's streaming-read bandwidth measured in the same run.

    .venv/bin/python bench/kernel.py [--rows 1 2 4 8 16] [--threads 1 2] [--gib 1]

Weights: Llama-7B MLP-shaped layers (N=11008, K=4096, g64) with random codes, as many as make
`--gib` of packed codes, so every call reads from DRAM, not from cache. GB/s counts the bytes
a call must read (codes, scales and zeros). Read bandwidth: torch's sum over a float32 buffer
of the same size on the same threads (a plain front-to-back read). "In cache": one row through
a layer small enough to stay in each core's L2 (512 x 4096), called again and again, less the
time of a 16 x 4096 call (the call's fixed cost): what the path computes when memory is not
the limit. Prints one table and the CPU's model and ISA flags.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from cpu_int4_vllm import native

N, K, G = 11008, 4096, 64
REPEATS = 3  # passes over all the layers; the best is reported
CACHED_N, SMALL_N, CACHED_CALLS = 512, 16, 400  # the in-cache rate's layers and calls per timing


def cpu_description() -> str:
    """The CPU's model name and the SIMD flags that choose kernel paths."""
    name, flags = platform.processor(), set()
    with open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    isa = sorted(f for f in flags if f.startswith(("avx", "amx")) or f == "fma")
    return f"{name}; {torch.get_num_threads()} threads available; flags: {' '.join(isa)}"


def random_layer(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-layout tensors of an n x K layer: random codes, unit scales."""
    lanes = torch.randint(-(2**31), 2**31 - 1, (n // 16, K // 8, 16), dtype=torch.int32, generator=gen)
    return lanes, torch.ones(n // 16, K // G, 2, 16, dtype=torch.bfloat16)


def random_layers(gib: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """N x K layers summing to `gib` of packed codes."""
    count = max(1, round(gib * 2**30 / (N * K // 2)))
    gen = torch.Generator().manual_seed(0)
    return [random_layer(N, gen) for _ in range(count)]


def gemv_gbps(layers, rows: int, isa: native.Isa) -> float:
    """GB/s of weights read by the GEMV over all layers, best of REPEATS passes."""
    x = torch.randn(rows, K).bfloat16()
    read = sum(lanes.nbytes + sz.nbytes for lanes, sz in layers)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for lanes, sz in layers:
            torch.ops.cpu_int4_native.gemv(x, lanes, sz, G, int(isa))
        best = min(best, time.perf_counter() - start)
    return read / best / 1e9


def cached_gbps(isa: native.Isa) -> float:
    """GB/s of one row through a layer that stays in L2, the fixed cost of a call taken out."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, K).bfloat16()

    def seconds_per_call(layer) -> float:
        for _ in range(CACHED_CALLS // 8):  # into the cache
            torch.ops.cpu_int4_native.gemv(x, *layer, G, int(isa))
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            for _ in range(CACHED_CALLS):
                torch.ops.cpu_int4_native.gemv(x, *layer, G, int(isa))
            best = min(best, (time.perf_counter() - start) / CACHED_CALLS)
        return best

    big, small = random_layer(CACHED_N, gen), random_layer(SMALL_N, gen)
    extra_bytes = sum(t.nbytes for t in big) - sum(t.nbytes for t in small)
    return extra_bytes / (seconds_per_call(big) - seconds_per_call(small)) / 1e9


def read_gbps(gib: float) -> float:
    """GB/s of a plain streaming read (sum of a float32 buffer larger than the caches)."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, torch.get_num_threads()}))
    parser.add_argument("--gib", type=float, default=1.0, help="packed codes swept per pass")
    args = parser.parse_args()
    if native.isa() is None:
        raise SystemExit("the native kernels are not available here (see the warning above)")
    print(cpu_description())
    layers = random_layers(args.gib)
    isas = native.supported_isas()
    print(
        "\n| threads | read GB/s | ISA path | in cache, 1 row | "
        + " | ".join(f"{r} row{'s' * (r > 1)}" for r in args.rows)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(args.rows))
    for threads in args.threads:
        torch.set_num_threads(threads)  # the read
        torch.ops.cpu_int4_native.set_gemv_threads(threads)  # the GEMV's own region
        for isa in isas:
            cells, reads = [], []
            for rows in args.rows:
                # A read just before each cell: on a shared VM the bandwidth drifts by 2x in minutes.
                reads.append(read_gbps(args.gib))
                gbps = gemv_gbps(layers, rows, isa)
                cells.append(f"{gbps:.1f} ({gbps / reads[-1]:.0%})")
            cells.insert(0, f"{cached_gbps(isa):.1f}")
            print(f"| {threads} | {statistics.median(reads):.1f} | {isa.name} | " + " | ".join(cells) + " |")
    print("\nGB/s of codes + scales + zeros read (share of a streaming read measured just before it);")
    print("read GB/s: the median of those reads; in cache: GB/s with the layer in L2.")


if __name__ == "__main__":
    main()

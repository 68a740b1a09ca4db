"""The GEMV on the same weights held in 4 KiB pages and in huge pages (the runtime's
huge_pages.py), interleaved in one process so that the VM's drifting bandwidth hits both alike.

    .venv/bin/python bench/pages.py [--rounds 20] [--mib 512]

One input row, decode's case. Dense shapes go through `gemv`, one call per layer, as many layers
as make --mib of codes; the experts (Qwen3-30B-A3B: 128 per layer, w13 1536 x 2048 and w2
2048 x 768) through `gemv_experts` with 8 experts drawn at random per call, as routing does,
8 calls per layer a round. GB/s counts the codes, scales and zeros a call reads; the median
over --rounds. Prints one table and the CPU's model and ISA flags.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_int4_vllm import native
from cpu_int4_vllm.huge_pages import in_huge_pages
from kernel import cpu_description

G, EXPERTS, ACTIVE = 64, 128, 8
CALLS_PER_EXPERT_LAYER = 8  # each with its own 8 experts: a round reads ~100 MB, not 14
DENSE = {
    "Llama-7B MLP": (11008, 4096),
    "qkv (Qwen3-30B-A3B)": (5120, 2048),
    "head 49152 x 2048": (49152, 2048),
}
EXPERT_SHAPES = {"experts w13": (1536, 2048), "experts w2": (2048, 768)}


def random_weights(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-layout codes [..., N/16, K/8, 16] and unit scales for weights of `shape` [..., N, K]."""
    *lead, n, k = shape
    codes = torch.randint(-(2**31), 2**31 - 1, (*lead, n // 16, k // 8, 16), dtype=torch.int32, generator=gen)
    return codes, torch.ones(*lead, n // 16, k // G, 2, 16, dtype=torch.bfloat16)


def cases(mib: int, gen: torch.Generator):
    """(name, layers in 4 KiB pages, the same in huge pages, call(layers) -> bytes read)."""
    isa = int(native.isa())
    for name, (n, k) in {**DENSE, **EXPERT_SHAPES}.items():
        expert = name in EXPERT_SHAPES
        shape = (EXPERTS, n, k) if expert else (n, k)
        count = max(1, mib * 2**20 // (torch.Size(shape).numel() // 2))
        plain = [random_weights(shape, gen) for _ in range(count)]
        huge = [tuple(in_huge_pages(t) for t in layer) for layer in plain]
        x = torch.randn(ACTIVE if expert else 1, k, generator=gen).bfloat16()

        def call(layers, x=x, expert=expert):
            read = 0
            for codes, sz in layers * (CALLS_PER_EXPERT_LAYER if expert else 1):
                if expert:
                    chosen = torch.randperm(EXPERTS, generator=gen)[:ACTIVE].sort().values
                    groups = torch.stack(
                        (chosen, torch.arange(ACTIVE), torch.ones(ACTIVE, dtype=torch.long)), 1
                    )
                    torch.ops.cpu_int4_native.gemv_experts(x, codes, sz, groups, G, isa)
                    read += (codes[0].nbytes + sz[0].nbytes) * ACTIVE
                else:
                    torch.ops.cpu_int4_native.gemv(x, codes, sz, G, isa)
                    read += codes.nbytes + sz.nbytes
            return read

        yield name, plain, huge, call


def gbps(call, layers) -> float:
    start = time.perf_counter()
    read = call(layers)
    return read / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--mib", type=int, default=512, help="MiB of codes per shape")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_description()}; ISA path {native.isa().name}, {native.gemv_threads()} GEMV threads\n")
    print("| weights | 4 KiB pages (GB/s) | huge pages (GB/s) | time, huge / 4 KiB |")
    print("|---|---|---|---|")
    for name, plain, huge, call in cases(args.mib, gen):
        rates = {"plain": [], "huge": []}
        for r in range(args.rounds):
            for which in ("plain", "huge") if r % 2 else ("huge", "plain"):
                rates[which].append(gbps(call, plain if which == "plain" else huge))
        a, b = statistics.median(rates["plain"]), statistics.median(rates["huge"])
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.3f} |", flush=True)
        del plain, huge


if __name__ == "__main__":
    main()

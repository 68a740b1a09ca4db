"""The dense path's compute dtype: what a batch too large for the int4 kernels is multiplied in."""

from __future__ import annotations

import functools
import os

import torch

FP32_MAX_ROWS = 256  # on hosts with a fast bf16 GEMM, batches up to this size still compute in fp32


@functools.cache
def fast_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32: AVX512-BF16 or AMX, which
    oneDNN uses. $CPU_INT4_BF16_GEMM=0/1 overrides (tests, and hosts where it measures otherwise).

    Without them PyTorch's bf16 GEMM is its reference loop: 512x4096 @ 4096x4096 on 2 AVX2
    cores (AMD EPYC) ran at 20 GFLOPS in bf16 against 76 in fp32.
    """
    forced = os.environ.get("CPU_INT4_BF16_GEMM")
    if forced is not None:
        return forced == "1"
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def dense_dtype(rows: int, bf16_is_fast: bool | None = None) -> torch.dtype:
    """fp32, except for batches over FP32_MAX_ROWS rows on a host with a fast bf16 GEMM.

    In fp32, weights and accumulation are what the kernels compute, so a prompt gives the same
    tokens alone and in a batch (bf16 weights differed from the kernel at ~52 dB SNR and
    changed greedy tokens). Large prefills take the bf16 GEMM where it is 3-4x faster than
    fp32; elsewhere bf16 would be 4x slower and lose fidelity too (96.9% served top-1 agreement
    on an AVX2 host, under the 97% floor).
    """
    if bf16_is_fast is None:
        bf16_is_fast = fast_bf16_gemm()
    return torch.bfloat16 if bf16_is_fast and rows > FP32_MAX_ROWS else torch.float32

"""The dense path's compute dtype: what a batch too large for the int4 kernels is multiplied in."""

from __future__ import annotations

import torch

FP32_MAX_ROWS = 256  # multi-row batches up to this size compute in fp32


def dense_dtype(rows: int) -> torch.dtype:
    """fp32 up to FP32_MAX_ROWS rows, bf16 above.

    In fp32, weights and accumulation are what the kernels compute, so a prompt gives the same
    tokens alone and in a batch (bf16 weights differed from the kernel at ~52 dB SNR and
    changed greedy tokens). Larger prefills take the bf16 GEMM, 3-4x faster than fp32 on
    AVX-512 BF16 hosts.
    """
    return torch.float32 if rows <= FP32_MAX_ROWS else torch.bfloat16

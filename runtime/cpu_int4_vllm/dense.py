"""The dense path's compute dtype: what a batch too large for the int4 kernels is multiplied in."""

from __future__ import annotations

import functools
import os

import torch


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


def dense_dtype(bf16_is_fast: bool | None = None) -> torch.dtype:
    """bf16 on a host with a fast bf16 GEMM, else fp32.

    In bf16 a prefill runs at the GEMM's full rate: on 2 Zen 5 cores, 64-512 rows through a
    dequantized 11008 x 4096 W^T took 13.5-74 ms in bf16 and 48-282 ms in fp32 (a scratch timing
    of native_backend._many_rows_gemm). Its rows then differ from the kernel's by bf16 rounding
    of the weights (~52 dB), as vLLM's own bf16 engine differs between batch shapes. Without a
    fast bf16 GEMM, bf16 would be 4x slower than fp32 and lose fidelity too (96.9% served top-1
    agreement on an AVX2 host, under the 97% floor).
    """
    if bf16_is_fast is None:
        bf16_is_fast = fast_bf16_gemm()
    return torch.bfloat16 if bf16_is_fast else torch.float32

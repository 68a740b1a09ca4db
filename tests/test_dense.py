"""The dense path's dtype follows the host's bf16 GEMM: both answers, forced, on any host."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from checks import quantized
from cpu_int4_vllm import dense, native
from cpu_int4_vllm.format import dequantize
from cpu_int4_vllm.native_backend import _many_rows_gemm
from cpu_int4_vllm.native_layout import pack_native


def test_the_dtype_is_the_fast_gemm_s():
    assert dense.dense_dtype(bf16_is_fast=False) == torch.float32
    assert dense.dense_dtype(bf16_is_fast=True) == torch.bfloat16


@pytest.mark.parametrize("forced", ["0", "1"])
def test_the_host_answer_can_be_forced(forced):
    code = "from cpu_int4_vllm import dense; print(dense.fast_bf16_gemm())"
    env = {**os.environ, "CPU_INT4_BF16_GEMM": forced}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(forced == "1")


def test_the_host_answer_follows_its_bf16_instructions():
    caps = torch.cpu.get_capabilities()
    if "CPU_INT4_BF16_GEMM" not in os.environ:
        assert dense.fast_bf16_gemm() == bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


@pytest.mark.parametrize("bf16_is_fast", [False, True])
def test_the_dense_path_multiplies_in_the_chosen_dtype(bf16_is_fast, monkeypatch):
    monkeypatch.setattr(dense, "fast_bf16_gemm", lambda: bf16_is_fast)
    packed, scale, zero = quantized(512, 1024, 64)
    lanes, sz = pack_native(packed, scale, zero)
    x = torch.randn(600, 1024).bfloat16()
    weight = dequantize(packed, scale, zero, 64, torch.float32)
    in_fp32 = (x.float() @ weight.t()).bfloat16()
    in_bf16 = x @ weight.bfloat16().t()
    out = _many_rows_gemm(x, lanes, sz, 64, native.isa())  # bf16, as x
    closer, farther = (in_bf16, in_fp32) if bf16_is_fast else (in_fp32, in_bf16)
    assert (out == closer).float().mean() > 0.95
    assert (out == farther).float().mean() < 0.9

"""The format's math: nibble packing and min/max quantization (docs/format.md)."""

import torch
from cpu_int4_vllm.format import (
    dequantize,
    pack_nibbles,
    quantize_minmax,
    shape_problem,
    unpack_nibbles,
)


def test_pack_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x0F]]


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (32, 128), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_minmax_error_within_half_step_and_extremes_exact():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]
    packed, scale, zero = quantize_minmax(w, 64)
    deq = dequantize(packed, scale, zero, 64, torch.float32)
    step = scale.float().repeat_interleave(64, dim=1)
    slack = 2.0**-8 * (zero.float().abs() + 8 * scale.float()).repeat_interleave(64, dim=1)
    assert ((deq - w).abs() <= step / 2 + slack).all()


def test_constant_group_dequantizes_to_its_value():
    w = torch.full((16, 64), 0.3125)  # exactly representable in bf16
    packed, scale, zero = quantize_minmax(w, 32)
    assert torch.equal(dequantize(packed, scale, zero, 32, torch.float32), w)


def test_codes_use_the_whole_grid():
    w = torch.linspace(-1, 1, 16).repeat(16, 2)  # 16 evenly spaced values per group of 32
    codes = unpack_nibbles(quantize_minmax(w, 32)[0])
    assert codes.min() == 0 and codes.max() == 15


def test_shape_rules():
    assert shape_problem(2048, 576, 64) is None
    assert "K=576" in shape_problem(2048, 576, 128)
    assert "N=40" in shape_problem(40, 64, 64)

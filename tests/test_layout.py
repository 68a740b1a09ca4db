"""The kernel layout and the two compute paths, with torch and the runtime's format code only.

No vLLM import here, so this runs on any host; test_layout_isa.py reruns it under AVX2 dispatch.
"""

from __future__ import annotations

import pytest
import torch
from checks import DEMO_SHAPES, TAIL_SHAPES, quantized, snr_db
from cpu_int4_vllm.dense import dense_dtype
from cpu_int4_vllm.format import dequantize, unpack_nibbles
from cpu_int4_vllm.tinygemm_backend import dequantize_kernel_weight, int4_linear, prepare_kernel_weights
from cpu_int4_vllm.tinygemm_layout import learn_layout, pack_for_kernel, unpack_kernel_codes


def test_layout_matches_the_measured_isa_facts():
    isa = torch.backends.cpu.get_cpu_capability()
    main_block = learn_layout(2048).segments[0].block_rows
    if isa.startswith("AVX512"):
        assert main_block == 64  # docs/runtime.md: [N/64][K][32 bytes]
    elif isa == "AVX2":
        assert main_block == 32  # docs/runtime.md: [N/32][K][16 bytes] ...
        tail = learn_layout(48).segments[-1]
        assert (tail.block_rows, tail.rows) == (16, 16)  # ... and a trailing 16-row block
        assert learn_layout(48).order[32:40].tolist() == [32, 34, 36, 38, 40, 42, 44, 46]
    else:
        pytest.fail(f"no layout facts recorded for {isa}")


@pytest.mark.parametrize("n", [16, 48, 80, 96, 2048, 2080, 3072])
def test_chunked_repack_is_byte_identical(n):
    codes = torch.randint(0, 16, (n, 256), dtype=torch.uint8)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(pack_for_kernel(codes, chunk_rows=64), whole)
    assert torch.equal(pack_for_kernel(codes), whole)


@pytest.mark.parametrize("n,k", DEMO_SHAPES + TAIL_SHAPES)
def test_learned_layout_reads_the_kernel_exactly(n, k):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    assert torch.equal(unpack_kernel_codes(pack_for_kernel(codes), learn_layout(n), k), codes)


@pytest.mark.parametrize("g", [32, 64, 128, 256])
@pytest.mark.parametrize("n,k", [s for s in DEMO_SHAPES if s[1] % 128 == 0] + TAIL_SHAPES)
def test_paths_agree_all_group_sizes(n, k, g):
    check_paths(n, k, g)


@pytest.mark.parametrize("n,k", DEMO_SHAPES)
def test_paths_agree_demo_shapes(n, k):
    check_paths(n, k, 64)


def check_paths(n: int, k: int, g: int) -> None:
    packed, scale, zero = quantized(n, k, g)
    kernel_packed, sz, rowmajor = prepare_kernel_weights(packed, scale, zero)
    assert rowmajor is None  # the layout was understood: no second packed copy kept
    # Dequantizing from the kernel layout is bit-identical to the row-major tensors.
    reference_w = dequantize(packed, scale, zero, g)
    assert torch.equal(dequantize_kernel_weight(kernel_packed, sz, g), reference_w)
    x = torch.randn(1, k, dtype=torch.bfloat16)
    decode = int4_linear(x, kernel_packed, sz, g, dequant_threshold=2)
    prefill = int4_linear(x, kernel_packed, sz, g, dequant_threshold=1)
    exact = x.double() @ reference_w.double().t()
    # In fp32 the dense path does the kernel's math summed in another order, and both outputs
    # are rounded to bf16: a sum near a rounding boundary flips one element by one bf16 step
    # (~76 dB for K=576). Where the dense path multiplies in bf16 (a fast bf16 GEMM), its
    # weights are rounded to bf16 too (~52 dB). A misread layout gives ~0 dB.
    assert snr_db(prefill, decode) >= (60 if dense_dtype() == torch.float32 else 45)
    assert snr_db(exact, decode) >= 40


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_a_raised_threshold_sends_a_few_rows_through_the_kernel(rows):
    packed, scale, zero = quantized(960, 576, 64)
    kernel_packed, sz, _ = prepare_kernel_weights(packed, scale, zero)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    by_kernel = int4_linear(x, kernel_packed, sz, 64, dequant_threshold=8)
    by_dequant = int4_linear(x, kernel_packed, sz, 64, dequant_threshold=1)
    assert by_kernel.shape == (rows, 960)
    assert snr_db(by_dequant, by_kernel) >= 40
    # Row i of a batch is exactly what row i alone gives.
    assert torch.equal(by_kernel[-1:], int4_linear(x[-1:], kernel_packed, sz, 64, dequant_threshold=8))


def test_misread_layout_falls_back_to_row_major(monkeypatch):
    """A layout that does not read the weight back exactly must not be used."""
    import cpu_int4_vllm.tinygemm_backend as kernels

    packed, scale, zero = quantized(64, 256, 64)
    real = learn_layout(64)
    wrong = type(real)(real.n, real.segments, real.order.flip(0), real.slot_of_row.flip(0))
    monkeypatch.setattr(kernels, "learn_layout", lambda n: wrong)
    kernel_packed, sz, rowmajor = prepare_kernel_weights(packed, scale, zero)
    assert rowmajor is not None and torch.equal(rowmajor, packed)
    assert torch.equal(
        dequantize_kernel_weight(kernel_packed, sz, 64, rowmajor), dequantize(packed, scale, zero, 64)
    )


def test_rowmajor_codes_are_the_checkpoint_codes():
    packed, _, _ = quantized(48, 128, 32)
    codes = unpack_nibbles(packed)
    assert torch.equal(unpack_kernel_codes(pack_for_kernel(codes), learn_layout(48), 128), codes)

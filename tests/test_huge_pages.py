"""Kernel weights in memory advised for transparent huge pages (huge_pages.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from checks import quantized
from cpu_int4_vllm import native
from cpu_int4_vllm.huge_pages import HUGE_PAGE, in_huge_pages
from report import advised_ranges, huge_page_bytes


def test_a_copy_in_huge_pages_holds_the_same_values_from_a_2_mib_boundary():
    tensor = torch.randn(5 * HUGE_PAGE // 8 // 16, 16).bfloat16()  # 2.5 MiB
    copy = in_huge_pages(tensor)
    assert torch.equal(copy, tensor)
    assert (copy.shape, copy.dtype) == (tensor.shape, tensor.dtype)
    assert copy.data_ptr() % HUGE_PAGE == 0
    # Its one whole 2 MiB page is advised, its tail is not; the original was never advised.
    assert huge_page_bytes(copy) == (HUGE_PAGE, HUGE_PAGE)
    assert huge_page_bytes(tensor) == (0, HUGE_PAGE)


def test_tensors_under_a_huge_page_stay_as_they_are():
    tensor = torch.randn(HUGE_PAGE // 4 - 1)
    assert in_huge_pages(tensor) is tensor


def test_dropping_the_copy_frees_its_mapping():
    copy = in_huge_pages(torch.ones(HUGE_PAGE // 4))  # 2 MiB
    assert huge_page_bytes(copy)[0] == HUGE_PAGE
    start = copy.data_ptr()
    del copy
    assert all(not lo <= start < hi for lo, hi in advised_ranges()), "the mapping outlived the tensor"


def test_stacked_experts_are_held_in_huge_pages_and_compute_the_same():
    """4 experts of 1024 x 2048: their stacked codes (4 MiB) go to huge pages, the 0.5 MiB of
    scales and zeros stay; the kernel reads the copies as it read the originals."""
    from cpu_int4_vllm.moe import _kernel_experts
    from cpu_int4_vllm.native_layout import pack_native

    experts = [quantized(1024, 2048, 64, seed=e) for e in range(4)]
    packed, scale, zero = (torch.stack(t) for t in zip(*experts, strict=True))
    stacked = _kernel_experts(packed, scale, zero, SimpleNamespace(group_size=64))
    assert huge_page_bytes(stacked["int4_packed"]) == (2 * HUGE_PAGE, 2 * HUGE_PAGE)
    assert huge_page_bytes(stacked["scales_and_zeros"]) == (0, 0)

    plain = [pack_native(*t) for t in experts]
    x, groups = torch.randn(4, 2048).bfloat16(), torch.tensor([[3, 0, 2], [1, 2, 2]])
    isa = int(native.isa())
    on_huge = torch.ops.cpu_int4_native.gemv_experts(x, *stacked.values(), groups, 64, isa)
    on_plain = torch.ops.cpu_int4_native.gemv_experts(
        x, *(torch.stack(t) for t in zip(*plain, strict=True)), groups, 64, isa
    )
    assert torch.equal(on_huge, on_plain)

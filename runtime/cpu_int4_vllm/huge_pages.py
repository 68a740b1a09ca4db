"""Kernel weights in memory advised for transparent huge pages.

A decode step streams every weight once. On 4 KiB pages that stream also walks a page table
entry per 4 KiB; on 2 MiB pages it does not. On the 2-core Zen 4 EPYC the GEMV took 4-10% less
time a call on huge pages for most shapes (`bench/pages.py`, both copies of the same weights
interleaved in one process), and a served token 3% (MoE) to 8% (7B-shaped) less
(`bench/alternate.py --switch pages`).

Many distributions (and these machines) set THP to `madvise`: only memory that asks gets huge
pages, and PyTorch's allocator asks only under THP_MEM_ALLOC_ENABLE, read once per process. So
the weights get a mapping of their own, advised before the first write.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` whose whole 2 MiB pages are advised MADV_HUGEPAGE.

    The copy starts on a 2 MiB boundary; its last partial huge page stays on 4 KiB pages, so
    resident memory grows by nothing. Tensors under 2 MiB, and systems without madvise, keep
    `tensor` as it is.
    """
    whole = tensor.nbytes // HUGE_PAGE * HUGE_PAGE
    if whole == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return tensor
    region = mmap.mmap(-1, tensor.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
    except OSError:  # a kernel built without transparent huge pages
        return tensor
    # The tensor holds the region (frombuffer keeps its buffer alive); freeing it unmaps.
    copy = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel(), offset=start)
    return copy.view(tensor.shape).copy_(tensor)

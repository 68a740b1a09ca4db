"""The tinygemm CPU kernel's packed int4 layout, learned on the host (docs/runtime.md).

`_convert_weight_to_int4pack_for_cpu` lays nibbles out differently per ISA (AVX-512: 64-row
blocks; AVX2: 32-row blocks plus a 16-row tail). Hard-coding either returns wrong weights on
the other with no error, so the layout is read off the kernel: pack index patterns, see where
every nibble lands, and describe it as row blocks of `[K][rows/2 bytes]`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from .format import unpack_nibbles

logger = logging.getLogger(__name__)

# Repacking 2048 output rows at a time was the fastest and nearly the leanest (docs/runtime.md).
REPACK_CHUNK_ROWS = 2048
_PROBE_K = 64  # enough columns to see the K stride; the layout does not depend on K otherwise


@dataclass(frozen=True)
class Segment:
    """A run of row blocks of one size: bytes `[blocks][K][block_rows/2]`."""

    row_start: int
    rows: int
    block_rows: int


@dataclass(frozen=True)
class KernelLayout:
    """Where the kernel puts each nibble, for weights with `n` output rows.

    Within a block, byte d of a K step holds storage slots d (low nibble) and d + rows/2 (high
    nibble); `order[i]` is the output channel in storage slot i over all blocks.
    """

    n: int
    segments: tuple[Segment, ...]
    order: torch.Tensor  # int64 [N]: channel stored in slot i
    slot_of_row: torch.Tensor  # int64 [N]: inverse of order


def pack_for_kernel(codes: torch.Tensor, chunk_rows: int = REPACK_CHUNK_ROWS) -> torch.Tensor:
    """Convert uint8 codes [N, K] to the kernel's packed tensor, `chunk_rows` rows at a time.

    The kernel wants int32 codes (8x the packed size); chunking bounds that transient.
    `chunk_rows` must be a multiple of every block size (64 covers AVX2 and AVX-512), so each
    chunk is whole blocks and the result equals packing at once.
    """
    parts = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes[start : start + chunk_rows].to(torch.int32), 1
        )
        for start in range(0, codes.shape[0], chunk_rows)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


@functools.cache
def learn_layout(n: int) -> KernelLayout | None:
    """Read the kernel's layout for N output rows off the kernel itself; None if not understood."""
    nibble_k, nibble_n = _probe(n, _PROBE_K)
    try:
        return _describe(nibble_k, nibble_n, n, _PROBE_K)
    except ValueError as err:
        logger.warning("cpu_int4: int4 kernel layout for N=%d not understood (%s)", n, err)
        return None


def _probe(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack patterns that spell each code's column and row; return both per storage nibble."""
    rows = torch.arange(n, dtype=torch.int64)[:, None].expand(n, k)
    cols = torch.arange(k, dtype=torch.int64)[None, :].expand(n, k)

    def read(values: torch.Tensor, digits: int) -> torch.Tensor:
        total = torch.zeros(n * k, dtype=torch.int64)
        for digit in range(digits):
            codes = ((values >> (4 * digit)) & 0xF).to(torch.uint8)
            nibbles = unpack_nibbles(pack_for_kernel(codes, chunk_rows=n).reshape(-1))
            total |= nibbles.to(torch.int64) << (4 * digit)
        return total

    return read(cols, _digits(k)), read(rows, _digits(n))


def _digits(count: int) -> int:
    return max(1, ((count - 1).bit_length() + 3) // 4)


def _describe(nibble_k: torch.Tensor, nibble_n: torch.Tensor, n: int, k: int) -> KernelLayout:
    """Fit row blocks of `[K][rows/2 bytes]` to the probed nibble map, or raise ValueError."""
    if nibble_k.numel() != n * k:
        raise ValueError(f"packed size {nibble_k.numel()} nibbles, expected {n * k}")
    segments: list[Segment] = []
    order: list[torch.Tensor] = []
    pos, row = 0, 0
    while row < n:
        # Bytes of K step 0 come first in a block: their count is half the block's rows.
        half = 0
        while pos + 2 * half < nibble_k.numel() and int(nibble_k[pos + 2 * half]) == 0:
            half += 1
        block_rows = 2 * half
        if block_rows == 0 or row + block_rows > n:
            raise ValueError(f"no block of rows found at row {row}")
        block = slice(pos, pos + block_rows * k)
        ks = nibble_k[block].view(k, half, 2)
        ns = nibble_n[block].view(k, half, 2)
        expected_k = torch.arange(k)[:, None, None].expand_as(ks)
        if not torch.equal(ks, expected_k) or not torch.equal(ns, ns[:1].expand_as(ns)):
            raise ValueError(f"block at row {row} is not [K][{half} bytes]")
        slots = torch.cat((ns[0, :, 0], ns[0, :, 1]))  # low nibbles, then high nibbles
        if not torch.equal(slots.sort().values, torch.arange(row, row + block_rows)):
            raise ValueError(f"block at row {row} does not hold rows {row}..{row + block_rows - 1}")
        if segments and segments[-1].block_rows == block_rows:
            last = segments[-1]
            segments[-1] = Segment(last.row_start, last.rows + block_rows, block_rows)
        else:
            segments.append(Segment(row, block_rows, block_rows))
        order.append(slots)
        pos += block_rows * k
        row += block_rows
    order_t = torch.cat(order)
    return KernelLayout(n, tuple(segments), order_t, torch.argsort(order_t))


def unpack_kernel_codes_t(packed: torch.Tensor, layout: KernelLayout, k: int) -> torch.Tensor:
    """Codes as uint8 [K, N] with columns in storage-slot order: the layout's natural transpose.

    Each block `[K][rows/2 bytes]` becomes `[K][rows]` (low nibbles, then high) with no gather,
    so a GEMM can use it as is and reorder its output columns instead (`slot_of_row`).
    """
    flat = packed.reshape(-1)
    out = torch.empty(k, layout.n, dtype=torch.uint8)
    offset = 0
    for seg in layout.segments:
        half = seg.block_rows // 2
        blocks = seg.rows // seg.block_rows
        size = seg.rows * k // 2
        src = flat[offset : offset + size].view(blocks, k, half).transpose(0, 1)  # [K, blocks, half]
        dst = out[:, seg.row_start : seg.row_start + seg.rows].view(k, blocks, 2, half)
        torch.bitwise_and(src, 0x0F, out=dst[:, :, 0])
        torch.bitwise_right_shift(src, 4, out=dst[:, :, 1])
        offset += size
    return out


def unpack_kernel_codes(packed: torch.Tensor, layout: KernelLayout, k: int) -> torch.Tensor:
    """Read uint8 codes [N, K] in channel order straight out of the kernel's packed tensor."""
    return unpack_kernel_codes_t(packed, layout, k).index_select(1, layout.slot_of_row).t().contiguous()

"""The native kernel's weight layout (int4_kernels.cpp), built from the checkpoint's tensors.

Unlike tinygemm's, this layout is ours and the same on every ISA, so it is written down here
rather than learned: 16 output rows per block, one per SIMD lane; each int32 lane holds 8
consecutive codes of its row, codes k and k+1 sixteen bits apart (what the bf16 dot product
takes as a pair).
"""

from __future__ import annotations

import torch

from .format import pack_nibbles, unpack_nibbles

BLOCK_ROWS = 16
STEP = 8  # codes per int32 lane
REPACK_CHUNK_ROWS = 2048  # bounds the uint8 codes transient (2 bytes a weight) on big tables


def pack_native(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lanes int32 [N/16, K/8, 16], scale and zero bf16 [N/16, K/g, 2, 16]) from the row-major
    checkpoint tensors (docs/format.md). N must be a multiple of 16, K of 8."""
    n, groups = scale.shape
    lanes = torch.cat([_lanes(part) for part in packed.split(REPACK_CHUNK_ROWS)])
    sz = torch.stack((scale, zero), dim=1).to(torch.bfloat16)  # [N, 2, K/g]
    sz = sz.view(n // BLOCK_ROWS, BLOCK_ROWS, 2, groups).permute(0, 3, 2, 1).contiguous()
    return lanes, sz


def _lanes(packed: torch.Tensor) -> torch.Tensor:
    """int32 lanes of rows `packed` (a multiple of 16 rows), blocks of 16 rows transposed."""
    n = packed.shape[0]
    codes = unpack_nibbles(packed).view(n, -1, STEP)
    # Little-endian bytes of a lane: (k0, k2), (k4, k6), (k1, k3), (k5, k7), low nibble first,
    # so `lane >> 4t & 0x000F000F` holds codes 2t and 2t+1 at bits 0 and 16.
    lane_bytes = torch.cat((pack_nibbles(codes[..., 0::2]), pack_nibbles(codes[..., 1::2])), dim=-1)
    lanes = lane_bytes.contiguous().view(torch.int32).view(n // BLOCK_ROWS, BLOCK_ROWS, -1)
    return lanes.transpose(1, 2).contiguous()

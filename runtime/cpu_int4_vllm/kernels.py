"""The int4 linear: an int4 kernel for decode rows, dequantize + dense GEMM for prefill.

Two kernels: cpu_int4's own (native.py, int4_kernels.cpp) when it is built, PyTorch's tinygemm
otherwise. Each has its own weight layout; build_kernel_weights in linear.py picks one per process.

Behind a registered custom op with a fake implementation, so torch.compile sees one opaque call
with the right output shape and never guards on the row count (DESIGN §2).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import native
from .format import ZERO_CODE, dequantize, unpack_nibbles
from .layout import learn_layout, pack_for_kernel, unpack_kernel_codes, unpack_kernel_codes_t
from .native_layout import BLOCK_ROWS

logger = logging.getLogger(__name__)

FP32_MAX_ROWS = 256  # multi-row batches up to this size compute in fp32 (see int4_linear)
# The native kernel unpacks once per 3 rows but multiplies per row, so it is compute-bound
# above one row; on 2 cores (4096x4096, g64) it took 3.1 ms for 16 rows and 12.9 ms for 64,
# where dequantizing to fresh memory + fp32 GEMM took ~20 ms (before the GEMM was sliced).
# Below this many rows it also gives a row the same bits whatever the batch.
NATIVE_MAX_ROWS = 64
DEQUANT_SLICE_BLOCKS = 64  # 1024 columns of W^T per slice: 8-22 MiB for K = 4096-11008 in bf16


def _dense_dtype(rows: int) -> torch.dtype:
    # Up to FP32_MAX_ROWS rows, fp32 weights and accumulation as the kernels compute, so a
    # prompt gives the same tokens alone and in a batch (bf16 weights differed from the
    # kernel at ~52 dB SNR and changed greedy tokens). Larger prefills take the bf16 GEMM,
    # 3-4x faster than fp32 here.
    return torch.float32 if rows <= FP32_MAX_ROWS else torch.bfloat16


def prepare_kernel_weights(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    direct_dequant: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Kernel tensors from the checkpoint's row-major ones: (kernel packed, scales_and_zeros,
    row-major packed or None).

    The row-major copy is kept only when asked (direct_dequant off) or when the learned layout
    does not read this weight back exactly: a safe path instead of wrong weights (DESIGN §2.1).
    """
    codes = unpack_nibbles(packed)
    kernel_packed = pack_for_kernel(codes)
    scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    if not direct_dequant:
        return kernel_packed, scales_and_zeros, packed
    layout = learn_layout(codes.shape[0])
    if layout is None or not torch.equal(unpack_kernel_codes(kernel_packed, layout, codes.shape[1]), codes):
        logger.warning(
            "cpu_int4: kernel layout for shape %s not understood; keeping a row-major copy",
            tuple(codes.shape),
        )
        return kernel_packed, scales_and_zeros, packed
    return kernel_packed, scales_and_zeros, None


def dequantize_kernel_weight_t(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """W^T [K, N], columns in the layout's storage order, read from the kernel's own tensor.

    Same fp32 formula as format.dequantize_codes, so the values are bit-identical; the [K, N]
    orientation needs no gather of the N*K codes (the GEMM's output columns are reordered).
    """
    layout = learn_layout(scales_and_zeros.shape[1])
    groups = scales_and_zeros.shape[0]
    k = groups * group_size
    codes = unpack_kernel_codes_t(packed, layout, k).view(groups, group_size, layout.n)
    sz = scales_and_zeros.index_select(1, layout.order).float()  # [K/g, N, 2], storage order
    weight = codes.float().sub_(ZERO_CODE).mul_(sz[:, None, :, 0]).add_(sz[:, None, :, 1])
    return weight.view(k, layout.n).to(dtype)


def dequantize_kernel_weight(
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    rowmajor: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[N, K] weight from the kernel's tensors (or from a row-major copy when given)."""
    if rowmajor is not None:
        scale, zero = scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t()
        return dequantize(rowmajor, scale, zero, group_size, dtype)
    slot_of_row = learn_layout(scales_and_zeros.shape[1]).slot_of_row
    return (
        dequantize_kernel_weight_t(packed, scales_and_zeros, group_size, dtype)
        .index_select(1, slot_of_row)
        .t()
    )


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    dequant_threshold: int,
    rowmajor: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T for bf16 x [..., K]; W held in the kernel's packed int4 layout.

    Rows >= dequant_threshold dequantize once and use the dense GEMM: the tinygemm kernel
    dequantizes per row and loses above ~8 rows, and on AMX hosts multi-row calls followed
    by vLLM's CPU attention died with SIGILL (DESIGN §2). Fewer rows go through the kernel.
    """
    rows = x.reshape(-1, x.shape[-1])
    n = scales_and_zeros.shape[1]
    if rows.shape[0] < dequant_threshold:
        # One row per call even when a raised threshold lets a few rows through: only multi-row
        # calls were seen to leave AMX state that killed vLLM's CPU attention (SIGILL).
        out = torch.cat(
            [
                torch.ops.aten._weight_int4pack_mm_for_cpu(row, packed, group_size, scales_and_zeros)
                for row in rows.split(1)
            ]
        )
    else:
        dtype = _dense_dtype(rows.shape[0])
        if rowmajor is not None:
            weight = dequantize_kernel_weight(packed, scales_and_zeros, group_size, rowmajor, dtype)
            out = F.linear(rows.to(dtype), weight).to(rows.dtype)
        else:
            weight_t = dequantize_kernel_weight_t(packed, scales_and_zeros, group_size, dtype)
            out_slots = (rows.to(dtype) @ weight_t).to(rows.dtype)
            out = out_slots.index_select(1, learn_layout(n).slot_of_row)
    return out.reshape(*x.shape[:-1], n)


def native_linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """y = x @ W.T for bf16 x [..., K] on the native kernel's layout (native_layout.py).

    Fewer than NATIVE_MAX_ROWS rows take the kernel (no AMX, so multi-row calls are safe);
    more dequantize W^T a slice of columns at a time and use the dense GEMM on each.
    """
    rows = x.reshape(-1, x.shape[-1])
    isa = native.isa()
    if rows.shape[0] < NATIVE_MAX_ROWS:
        out = torch.ops.cpu_int4_native.gemv(rows, packed, sz, group_size, isa).to(rows.dtype)
    else:
        out = _dequantized_gemm(rows, packed, sz, group_size, isa)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _dequantized_gemm(rows: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int, isa: int):
    """rows @ W^T, W^T dequantized DEQUANT_SLICE_BLOCKS * 16 columns at a time into one reused
    buffer. On 2 cores (512 rows x 4096 x 4096) this took 10.7 ms against 20.9 ms for the whole
    W^T in fresh memory (first-touch page faults, then a second trip through DRAM); bf16
    F.linear took 9.5 ms."""
    dtype = _dense_dtype(rows.shape[0])
    k, blocks = rows.shape[1], packed.shape[0]
    x = rows.to(dtype)
    out = rows.new_empty(rows.shape[0], blocks * BLOCK_ROWS)
    buffer = _workspace(dtype, k * min(blocks, DEQUANT_SLICE_BLOCKS) * BLOCK_ROWS)
    for start in range(0, blocks, DEQUANT_SLICE_BLOCKS):
        stop = min(blocks, start + DEQUANT_SLICE_BLOCKS)
        weight_t = buffer[: k * (stop - start) * BLOCK_ROWS].view(k, -1)
        torch.ops.cpu_int4_native.dequantize_t(packed[start:stop], sz[start:stop], group_size, isa, weight_t)
        out[:, start * BLOCK_ROWS : stop * BLOCK_ROWS] = x @ weight_t
    return out


_WORKSPACES: dict[torch.dtype, torch.Tensor] = {}


def _workspace(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A per-process scratch buffer of at least `numel` elements, grown when needed."""
    buffer = _WORKSPACES.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = _WORKSPACES[dtype] = torch.empty(numel, dtype=dtype)
    return buffer


@torch.library.custom_op("cpu_int4::native_linear", mutates_args=())
def native_linear_op(
    x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int
) -> torch.Tensor:
    """native_linear as an opaque op for torch.compile."""
    return native_linear(x, packed, sz, group_size)


@native_linear_op.register_fake
def _(x, packed, sz, group_size):
    return x.new_empty(*x.shape[:-1], sz.shape[0] * sz.shape[-1])


@torch.library.custom_op("cpu_int4::linear", mutates_args=())
def int4_linear_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    dequant_threshold: int,
    rowmajor: torch.Tensor | None = None,
) -> torch.Tensor:
    """int4_linear as an opaque op for torch.compile."""
    return int4_linear(x, packed, scales_and_zeros, group_size, dequant_threshold, rowmajor)


@int4_linear_op.register_fake
def _(x, packed, scales_and_zeros, group_size, dequant_threshold, rowmajor=None):
    return x.new_empty(*x.shape[:-1], scales_and_zeros.shape[1])

"""The tinygemm backend: PyTorch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`), the fallback
when the native kernels cannot run. Same two verbs as the native backend: `prepare`, `linear`.

Its packed layout differs per ISA and is learned on the host (tinygemm_layout.py); the
dequantize path reads that layout directly, so no second packed copy is held.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .config import through_op
from .dense import dense_dtype
from .format import ZERO_CODE, dequantize, unpack_nibbles
from .tinygemm_layout import learn_layout, pack_for_kernel, unpack_kernel_codes, unpack_kernel_codes_t

logger = logging.getLogger(__name__)

NAME = "tinygemm"


def prepare(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, config
) -> dict[str, torch.Tensor | None]:
    """The kernel's tensors, plus a row-major copy of the codes where one is needed."""
    kernel_packed, scales_and_zeros, rowmajor = prepare_kernel_weights(
        packed, scale, zero, config.direct_dequant
    )
    return {"int4_packed": kernel_packed, "scales_and_zeros": scales_and_zeros, "int4_rowmajor": rowmajor}


def linear(x: torch.Tensor, layer, config) -> torch.Tensor:
    """x @ W.T for bf16 x: the plain function, or its custom op while torch.compile traces."""
    fn = int4_linear_op if through_op(config) else int4_linear
    return fn(
        x,
        layer.int4_packed,
        layer.scales_and_zeros,
        config.group_size,
        config.dequant_threshold,
        layer.int4_rowmajor,
    )


def grouped_linear(x: torch.Tensor, experts, groups: list[tuple[int, int, int]], config) -> torch.Tensor:
    """Rows of bf16 x [M, K] times their expert's W^T, fp32 [M, N] (native_backend.grouped_linear),
    an expert at a time."""
    out = x.new_empty(x.shape[0], experts.scales_and_zeros.shape[2], dtype=torch.float32)
    for expert, start, count in groups:
        rowmajor = None if experts.int4_rowmajor is None else experts.int4_rowmajor[expert]
        rows = slice(start, start + count)
        out[rows] = int4_linear(
            x[rows],
            experts.int4_packed[expert],
            experts.scales_and_zeros[expert],
            config.group_size,
            config.dequant_threshold,
            rowmajor,
        )
    return out


def prepare_kernel_weights(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    direct_dequant: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Kernel tensors from the checkpoint's row-major ones: (kernel packed, scales_and_zeros,
    row-major packed or None).

    The row-major copy is kept only when asked (direct_dequant off) or when the learned layout
    does not read this weight back exactly: a safe path instead of wrong weights (docs/runtime.md).
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
    by vLLM's CPU attention died with SIGILL (docs/runtime.md). Fewer rows go through the kernel.
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
        dtype = dense_dtype()
        if rowmajor is not None:
            weight = dequantize_kernel_weight(packed, scales_and_zeros, group_size, rowmajor, dtype)
            out = F.linear(rows.to(dtype), weight).to(rows.dtype)
        else:
            weight_t = dequantize_kernel_weight_t(packed, scales_and_zeros, group_size, dtype)
            out_slots = (rows.to(dtype) @ weight_t).to(rows.dtype)
            out = out_slots.index_select(1, learn_layout(n).slot_of_row)
    return out.reshape(*x.shape[:-1], n)


# int4_linear as an opaque op for torch.compile.
int4_linear_op = torch.library.custom_op("cpu_int4::linear", int4_linear, mutates_args=())


@int4_linear_op.register_fake
def _(x, packed, scales_and_zeros, group_size, dequant_threshold, rowmajor=None):
    return x.new_empty(*x.shape[:-1], scales_and_zeros.shape[1])

"""The native backend: cpu_int4's own kernels (native.py, int4_kernels.cpp) behind the two verbs
every backend has, `prepare` (checkpoint tensors -> kernel tensors) and `linear`.

Behind a registered custom op with a fake implementation, so torch.compile sees one opaque call
with the right output shape and never guards on the row count.
"""

from __future__ import annotations

import functools

import torch

from . import native
from .config import through_op
from .dense import dense_dtype
from .native_layout import BLOCK_ROWS, pack_native

NAME = "native"
# From this many rows the int16 paths (AVX2, AVX-512F) hand a batch to the dense path: they
# unpack once per 2-3 rows and multiply per row, so they are compute-bound above one row; on
# 2 cores (4096x4096, g64) they took 3.1 ms for 16 rows and 12.9 ms for 64, where dequantizing
# to fresh memory + fp32 GEMM took ~20 ms (before the GEMM was sliced).
MAX_KERNEL_ROWS = 64
DEQUANT_SLICE_BLOCKS = 64  # 1024 columns of W^T per slice: 8-22 MiB for K = 4096-11008 in bf16


def prepare(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, config) -> dict[str, torch.Tensor]:
    """The kernel's tensors; the layout is ours, so nothing needs a row-major copy to check it."""
    lanes, sz = pack_native(packed, scale, zero)
    return {"int4_packed": lanes, "scales_and_zeros": sz}


def linear(x: torch.Tensor, layer, config) -> torch.Tensor:
    """x @ W.T for bf16 x: the plain function, or its custom op while torch.compile traces."""
    fn = native_linear_op if through_op(config) else native_linear
    return fn(x, layer.int4_packed, layer.scales_and_zeros, config.group_size)


# From this many rows the AVX-512 BF16 kernel hands a batch to the dense path where there is no
# AMX kernel. Below it the kernel is faster: it multiplies bf16 pairs at the dot-product rate and
# unpacks a panel once for all rows; from here oneDNN's GEMM on a dequantized bf16 W^T catches
# up, bf16 rounding of the weights and all (2 Zen 5 cores, 7B shapes, `bench/prefill.py`: the
# kernel took 0.54-0.65x the dense path's time at 64 rows, 0.86-0.99x at 256, 0.93-1.03x at 512
# and 1.11-1.20x at 2048).
BF16_KERNEL_MAX_ROWS = 512


@functools.cache
def kernel_row_limit() -> int:
    """Batches of this many rows or more take _many_rows_gemm, fewer the kernel, which gives a row
    the same bits in any batch below it."""
    if native.isa() == native.Isa.AVX512_BF16 and not native.amx():
        return BF16_KERNEL_MAX_ROWS
    return MAX_KERNEL_ROWS


def native_linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """y = x @ W.T for bf16 x [..., K] on the native layout (native_layout.py): the kernel (no
    AMX, so multi-row calls are safe) below kernel_row_limit() rows, else _many_rows_gemm."""
    rows = x.reshape(-1, x.shape[-1])
    isa = native.isa()
    if rows.shape[0] < kernel_row_limit():
        out = torch.ops.cpu_int4_native.gemv(rows, packed, sz, group_size, isa).to(rows.dtype)
    else:
        out = _many_rows_gemm(rows, packed, sz, group_size, isa)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def grouped_linear(x: torch.Tensor, experts, groups: list[tuple[int, int, int]], config) -> torch.Tensor:
    """Rows of bf16 x [M, K] times their expert's W^T, fp32 [M, N]: for each (expert, start,
    count) of `groups`, rows [start, start + count). `experts` holds all experts' kernel tensors
    stacked [E, ...]. Groups of fewer than kernel_row_limit() rows go to the kernel together, in
    one call; larger ones go through _many_rows_gemm."""
    packed, sz, isa, limit = experts.int4_packed, experts.scales_and_zeros, native.isa(), kernel_row_limit()
    small = torch.tensor([g for g in groups if g[2] < limit], dtype=torch.long).view(-1, 3)
    out = torch.ops.cpu_int4_native.gemv_experts(x, packed, sz, small, config.group_size, isa)
    for expert, start, count in groups:
        if count >= limit:
            rows = slice(start, start + count)
            _many_rows_gemm(x[rows], packed[expert], sz[expert], config.group_size, isa, out[rows])
    return out


def silu_experts(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13, w2, config
) -> torch.Tensor:
    """moe.run_experts for SiLU-gated experts, router weights on the output, in one native call;
    for fewer than MAX_KERNEL_ROWS (token, expert) pairs, so every expert runs on the kernel."""
    return torch.ops.cpu_int4_native.silu_experts(
        x,
        topk_weights,
        topk_ids,
        w13.int4_packed,
        w13.scales_and_zeros,
        w2.int4_packed,
        w2.scales_and_zeros,
        config.group_size,
        native.isa(),
    )


def _many_rows_gemm(
    rows: torch.Tensor,
    packed: torch.Tensor,
    sz: torch.Tensor,
    group_size: int,
    isa: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows @ W^T (into `out` if given, else a new tensor of the rows' dtype) in the dense
    path's dtype (dense.py). bf16 on an AMX host runs the fused AMX kernel (native.amx);
    otherwise W^T is dequantized DEQUANT_SLICE_BLOCKS * 16 columns at a time into one reused
    buffer for the dense GEMM. On 2 cores (512 rows x 4096 x 4096) the slices took 10.7 ms
    against 20.9 ms for the whole W^T in fresh memory (first-touch page faults, then a second
    trip through DRAM); bf16 F.linear took 9.5 ms."""
    dtype = dense_dtype()
    if out is None:
        out = rows.new_empty(rows.shape[0], packed.shape[0] * BLOCK_ROWS)
    if dtype == torch.bfloat16 and native.amx():
        torch.ops.cpu_int4_native.amx_linear(rows.to(dtype), packed, sz, group_size, out)
        return out
    k, blocks = rows.shape[1], packed.shape[0]
    x = rows.to(dtype)
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


# native_linear as an opaque op for torch.compile.
native_linear_op = torch.library.custom_op("cpu_int4::native_linear", native_linear, mutates_args=())


@native_linear_op.register_fake
def _(x, packed, sz, group_size):
    return x.new_empty(*x.shape[:-1], sz.shape[0] * sz.shape[-1])

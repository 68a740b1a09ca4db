"""Quantization methods: each maps a [N, K] weight to the format's (packed, scale, zero).

All methods emit the same three tensors with the same meaning (DESIGN §1.1), so the runtime
never changes; they differ only in how each group's scale and offset are chosen.
"""

from __future__ import annotations

import torch
from cpu_int4_vllm.format import MAX_CODE, ZERO_CODE, encode, quantize_minmax, round_to_codes

# Range stretches tried by `search`: the code grid spans (15 + t) steps over the group's range,
# the range search behind llama.cpp's K-quants (make_qkx2_quants).
SEARCH_STRETCHES = torch.linspace(-1.0, 1.5, 11).tolist()


def importance(groups: torch.Tensor) -> torch.Tensor:
    """Per-weight importance |w| + rms(group), as llama.cpp weighs K-quant errors."""
    rms = groups.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return groups.abs() + rms


def weighted_error(
    groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, imp: torch.Tensor | None = None
) -> torch.Tensor:
    """Importance-weighted squared error per group [N, G] of the stored (bf16) grid."""
    scale = scale.to(torch.bfloat16).float()
    zero = zero.to(torch.bfloat16).float()
    codes = round_to_codes(groups, scale, zero).float()
    deq = (codes - ZERO_CODE) * scale[..., None] + zero[..., None]
    imp = importance(groups) if imp is None else imp
    return (imp * (deq - groups).pow(2)).sum(dim=-1)


def quantize_search(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, the scale and offset with the least importance-weighted squared error.

    Tries stretched code grids over the group's range, refits scale and offset to each grid's
    codes by weighted least squares, and keeps the best, min/max included, so the error is never
    above min/max's (errors are compared after bf16 rounding, as stored).
    """
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    imp = importance(groups)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    span = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
    best_scale = (high / MAX_CODE - low / MAX_CODE).clamp_min(torch.finfo(torch.float32).tiny)
    best_zero = low + ZERO_CODE * best_scale
    best_err = weighted_error(groups, best_scale, best_zero, imp)
    sum_w = imp.sum(dim=-1)
    sum_x = (imp * groups).sum(dim=-1)
    for stretch in SEARCH_STRETCHES:
        inv_step = (MAX_CODE + stretch) / span
        codes = ((groups - low[..., None]) * inv_step[..., None]).round_().clamp_(0, MAX_CODE)
        scale, offset = _least_squares(groups, imp, codes, sum_w, sum_x)
        zero = offset + ZERO_CODE * scale
        valid = torch.isfinite(scale) & torch.isfinite(zero) & (scale > 0)
        scale, zero = torch.where(valid, scale, best_scale), torch.where(valid, zero, best_zero)
        err = weighted_error(groups, scale, zero, imp)
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_err = torch.where(better, err, best_err)
    return encode(weight, best_scale, best_zero, group_size)


def _least_squares(groups, imp, codes, sum_w, sum_x) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted fit of groups ~ scale * codes + offset, per group, in closed form."""
    wl = imp * codes
    sum_l = wl.sum(dim=-1)
    sum_l2 = (wl * codes).sum(dim=-1)
    sum_xl = (wl * groups).sum(dim=-1)
    det = sum_w * sum_l2 - sum_l * sum_l
    scale = (sum_w * sum_xl - sum_x * sum_l) / det
    offset = (sum_l2 * sum_x - sum_l * sum_xl) / det
    return scale, offset


METHODS = {"minmax": quantize_minmax, "search": quantize_search}

"""Quantization methods: each maps a [N, K] weight to the format's (packed, scale, zero).

All methods emit the same three tensors with the same meaning (docs/format.md), so the runtime
never changes; they differ only in how each group's scale and offset are chosen.
"""

from __future__ import annotations

from enum import Enum

import torch
from cpu_int4_vllm import native
from cpu_int4_vllm.format import MAX_CODE, ZERO_CODE, encode, group_view, quantize_minmax, round_to_codes

# Range stretches tried by `search`: the code grid spans (15 + t) steps over the group's range,
# the range search behind llama.cpp's K-quants (make_qkx2_quants).
SEARCH_STRETCHES = [-0.5, 0.0, 0.5, 1.0]


def importance(groups: torch.Tensor) -> torch.Tensor:
    """Per-weight importance |w| + rms(group), as llama.cpp weighs K-quant errors."""
    rms = groups.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return groups.abs() + rms


def weighted_error(
    groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, imp: torch.Tensor | None = None
) -> torch.Tensor:
    """Importance-weighted squared error per group [N, G] of the stored (bf16) grid.

    Measured in units of each group's largest |w|, so groups near the fp32 limits (1e30, 1e-30)
    neither overflow nor underflow; the ranking of grids within a group is unchanged by it.
    `imp`, when given, is importance() of those normalized groups.
    """
    scale = scale.to(torch.bfloat16).float()
    zero = zero.to(torch.bfloat16).float()
    norm = _group_norm(groups)[..., None]
    codes = round_to_codes(groups, scale, zero)
    diff = (codes * scale[..., None]).add_((zero - ZERO_CODE * scale)[..., None]).sub_(groups)
    diff.div_(norm)
    imp = importance(groups / norm) if imp is None else imp
    return _dot(imp, diff.mul_(diff))


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-group dot product over the last dim (einsum measured ~3x faster than linalg.vecdot)."""
    return torch.einsum("...i,...i->...", a, b)


def _group_norm(groups: torch.Tensor) -> torch.Tensor:
    return groups.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


class NonFiniteWeights(ValueError):
    """A weight to quantize is NaN or infinite: there is no grid for it."""


def require_finite(weight: torch.Tensor) -> None:
    if not torch.isfinite(weight).all():
        raise NonFiniteWeights("weight contains NaN or Inf")


def quantize_search(
    weight: torch.Tensor, group_size: int, channel_importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, the scale and offset with the least importance-weighted squared error.

    Tries stretched code grids over the group's range and refits scale and offset to each grid's
    codes by weighted least squares (ranked by their fit residual, which costs no extra pass),
    refits the winner once more to its own rounded codes, and keeps whichever of min/max, winner
    and refit has the least error after bf16 rounding, as stored: never worse than min/max.
    `channel_importance` [K], when known, weighs each input channel (see plan.input_norm).
    """
    require_finite(weight)
    groups = group_view(weight.float(), group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    # Fits run on groups scaled to max |w| = 1: sums of w^2 stay inside fp32 at any magnitude.
    norm = _group_norm(groups)
    unit = groups / norm[..., None]
    imp = importance(unit)
    if channel_importance is not None:
        imp = imp * group_view(channel_importance.float()[None], group_size)
    unit_low = unit.amin(dim=-1)
    unit_span = (unit.amax(dim=-1) - unit_low).clamp_min(torch.finfo(torch.float32).tiny)
    sums = _WeightedSums(unit, imp)
    fit_scale, fit_zero, fit_residual = None, None, torch.full_like(low, float("inf"))
    for stretch in SEARCH_STRETCHES:
        scale, zero, residual = sums.fit(_stretched_codes(unit, unit_low, unit_span, stretch))
        better = residual < fit_residual
        fit_scale = scale if fit_scale is None else torch.where(better, scale, fit_scale)
        fit_zero = zero if fit_zero is None else torch.where(better, zero, fit_zero)
        fit_residual = torch.where(better, residual, fit_residual)
    fit_scale, fit_zero = fit_scale * norm, fit_zero * norm
    best_scale = (high / MAX_CODE - low / MAX_CODE).clamp_min(torch.finfo(torch.float32).tiny)
    best_zero = low + ZERO_CODE * best_scale
    best_err = weighted_error(groups, best_scale, best_zero, imp)
    refit_scale, refit_zero, _ = sums.fit(_stored_codes(groups, fit_scale, fit_zero))
    for scale, zero in ((fit_scale, fit_zero), (refit_scale * norm, refit_zero * norm)):
        valid = torch.isfinite(scale) & torch.isfinite(zero) & (scale > 0)
        scale, zero = torch.where(valid, scale, best_scale), torch.where(valid, zero, best_zero)
        err = weighted_error(groups, scale, zero, imp)
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
        best_err = torch.where(better, err, best_err)
    return encode(weight, best_scale, best_zero, group_size)


class _WeightedSums:
    """Weighted least squares of groups ~ scale * (codes - 8) + zero, per group, in closed form."""

    def __init__(self, groups: torch.Tensor, imp: torch.Tensor):
        self.groups, self.imp = groups, imp
        self.sum_w = imp.sum(dim=-1)
        self.sum_x = _dot(imp, groups)
        self.sum_x2 = _dot(imp, groups * groups)

    def fit(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale, zero, residual) of the best fit to these codes 0..15."""
        wl = self.imp * codes
        sum_l = wl.sum(dim=-1)
        sum_l2 = _dot(wl, codes)
        sum_xl = _dot(wl, self.groups)
        det = self.sum_w * sum_l2 - sum_l * sum_l
        scale = (self.sum_w * sum_xl - self.sum_x * sum_l) / det
        offset = (sum_l2 * self.sum_x - sum_l * sum_xl) / det
        # At the least-squares optimum the residual is sum(w x^2) - scale*sum(w l x) - offset*sum(w x).
        residual = torch.nan_to_num(self.sum_x2 - scale * sum_xl - offset * self.sum_x, nan=float("inf"))
        return scale, offset + ZERO_CODE * scale, residual


def _stretched_codes(
    groups: torch.Tensor, low: torch.Tensor, span: torch.Tensor, stretch: float
) -> torch.Tensor:
    """Codes 0..15 of a grid with 15 + stretch steps over the group's range, from its minimum."""
    inv_step = (MAX_CODE + stretch) / span
    return (groups * inv_step[..., None]).sub_((low * inv_step)[..., None]).round_().clamp_(0, MAX_CODE)


def _stored_codes(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 of a grid as it will be stored (bf16 scale and zero)."""
    return round_to_codes(groups, scale.to(torch.bfloat16).float(), zero.to(torch.bfloat16).float())


def _minmax(weight: torch.Tensor, group_size: int, channel_importance: torch.Tensor | None = None):
    """The extremes alone decide (no weighting). bf16 weights take the compiled twin of
    format.quantize_minmax: bit-identical (tests/test_native.py), ~10x its throughput on one
    11008x4096 matrix, and it checks finiteness in the same pass (torch.isfinite on bf16 alone
    took 65% of a run)."""
    if weight.dtype == torch.bfloat16 and native.isa() is not None:
        try:
            return torch.ops.cpu_int4_native.quantize_minmax(weight, group_size)
        except ValueError as err:  # the only value it refuses: NaN or Inf
            raise NonFiniteWeights(str(err)) from err
    require_finite(weight)
    return quantize_minmax(weight, group_size)


METHODS = {"minmax": _minmax, "search": quantize_search}
Method = Enum("Method", {name: name for name in METHODS}, type=str)  # the CLI's choices

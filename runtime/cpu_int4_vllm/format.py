"""The cpu_int4 checkpoint format: nibble packing, min/max quantization, dequantization, config keys.

The one definition of the format, shared by the quantizer and the vLLM plugin. It imports only
torch, so the quantizer can use it without loading vLLM (DESIGN §1).
"""

from __future__ import annotations

import torch

QUANT_METHOD = "cpu_int4"
GROUP_SIZES = (32, 64, 128, 256)  # the only group sizes the tinygemm CPU kernel accepts
ROW_MULTIPLE = 16  # the int4 packer refuses N that is not a multiple of 16
ZERO_CODE = 8  # w = (q - 8) * scale + zero, the tinygemm convention
MAX_CODE = 15

PACKED_SUFFIX = "weight_packed"
SCALE_SUFFIX = "weight_scale"
ZERO_SUFFIX = "weight_zero"

# Every quantization_config key with its default (DESIGN §1.2); the runtime fills gaps from here.
CONFIG_DEFAULTS: dict[str, object] = {
    "quant_method": QUANT_METHOD,
    "method": "minmax",
    "group_size": 64,
    "ignore": [],
    "quantize_embedding": True,
    "prefill_dequant": True,
    "dequant_threshold": 2,
    "use_custom_op": True,
    "direct_dequant": True,
}


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes 0..15 of shape [N, K] into [N, K/2] bytes, low nibble first."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension {codes.shape[-1]} is odd; cannot pack two codes a byte")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack [N, K/2] bytes into uint8 codes [N, K] (inverse of pack_nibbles)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _group_view(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group size {group_size}")
    return weight.reshape(n, k // group_size, group_size)


def quantize_minmax(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max group-wise 4-bit quantization (DESIGN §1.1).

    Returns (packed uint8 [N, K/2], scale bf16 [N, K/g], zero bf16 [N, K/g]). The math runs in
    fp32; codes are rounded against the bf16 scale and zero actually stored, so dequantization
    is as close to the source as the stored numbers allow.
    """
    groups = _group_view(weight.float(), group_size)
    low = groups.amin(dim=-1)
    high = groups.amax(dim=-1)
    # Dividing before subtracting keeps the range finite for magnitudes near the fp32 limit.
    scale = (high / MAX_CODE - low / MAX_CODE).clamp_min(torch.finfo(torch.float32).tiny)
    zero = low + ZERO_CODE * scale
    return encode(weight, scale, zero, group_size)


def encode(
    weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round weights to the codes of a given per-group grid; returns (packed, scale, zero) as stored."""
    scale = scale.to(torch.bfloat16)
    zero = zero.to(torch.bfloat16)
    codes = round_to_codes(_group_view(weight.float(), group_size), scale.float(), zero.float())
    return pack_nibbles(codes.reshape(weight.shape).to(torch.uint8)), scale, zero


def round_to_codes(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest code 0..15 (as float) for each weight of [N, G, g] groups under per-group scale/zero [N, G]."""
    inv_scale = 1.0 / scale
    # w / scale + (8 - zero / scale); mul then add_ measured 2x faster than a broadcast addcmul.
    steps = (groups * inv_scale[..., None]).add_((ZERO_CODE - zero * inv_scale)[..., None])
    torch.nan_to_num_(steps, nan=ZERO_CODE)  # inf - inf: a huge constant group, whose code is 8
    return steps.round_().clamp_(0, MAX_CODE)


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize row-major tensors: w = (q - 8) * scale + zero, computed in fp32."""
    return dequantize_codes(unpack_nibbles(packed), scale, zero, group_size, dtype)


def dequantize_codes(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize unpacked codes [N, K] with per-group scale and zero [N, K/g]."""
    n, k = codes.shape
    groups = codes.reshape(n, k // group_size, group_size).float() - ZERO_CODE
    weight = groups * scale.float()[..., None] + zero.float()[..., None]
    return weight.reshape(n, k).to(dtype)


def shape_problem(n: int, k: int, group_size: int) -> str | None:
    """Why a [N, K] weight cannot be quantized at this group size (DESIGN §1.4), or None."""
    if k % group_size:
        return f"K={k} is not a multiple of group size {group_size}"
    if n % ROW_MULTIPLE:
        return f"N={n} is not a multiple of {ROW_MULTIPLE}"
    return None


def bits_per_weight(group_size: int) -> float:
    """Storage cost of one quantized weight: a 4-bit code plus its share of bf16 scale and zero."""
    return 4 + 2 * 16 / group_size


_CONFIG_TYPES: dict[str, type] = {
    "quant_method": str,
    "method": str,
    "group_size": int,
    "ignore": list,
    "quantize_embedding": bool,
    "prefill_dequant": bool,
    "dequant_threshold": int,
    "use_custom_op": bool,
    "direct_dequant": bool,
}


def parse_config(raw: object) -> tuple[dict, list[str]]:
    """Validate a `quantization_config` block; returns (settings with defaults, unknown keys).

    Raises ValueError naming the field for a value of the wrong type or out of range.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be a JSON object, not {type(raw).__name__}")
    settings = dict(CONFIG_DEFAULTS)
    unknown = sorted(str(k) for k in raw if k not in CONFIG_DEFAULTS)
    for key, kind in _CONFIG_TYPES.items():
        if key not in raw:
            continue
        value = raw[key]
        # bool is a subclass of int: refuse `"group_size": true` explicitly.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"quantization_config.{key} must be {kind.__name__}, got {value!r}")
        settings[key] = value
    if settings["quant_method"] != QUANT_METHOD:
        raise ValueError(
            f"quantization_config.quant_method is {settings['quant_method']!r}, not {QUANT_METHOD!r}"
        )
    if settings["group_size"] not in GROUP_SIZES:
        raise ValueError(
            f"quantization_config.group_size {settings['group_size']} is not one of {list(GROUP_SIZES)}"
        )
    if not all(isinstance(name, str) for name in settings["ignore"]):
        raise ValueError("quantization_config.ignore must be a list of module names")
    if settings["dequant_threshold"] < 1:
        raise ValueError("quantization_config.dequant_threshold must be at least 1")
    return settings, unknown

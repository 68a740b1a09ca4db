"""The cpu_int4 checkpoint format: a quantized layer's tensors, nibble packing, min/max
quantization, dequantization, config keys.

The one definition of the format (docs/format.md), shared by the quantizer and the vLLM plugin.
It imports only torch, so the quantizer can use it without loading vLLM.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import torch

QUANT_METHOD = "cpu_int4"
GROUP_SIZES = (32, 64, 128, 256)  # the only group sizes the tinygemm CPU kernel accepts
ROW_MULTIPLE = 16  # the int4 packer refuses N that is not a multiple of 16
ZERO_CODE = 8  # w = (q - 8) * scale + zero, the tinygemm convention
MAX_CODE = 15

# Mixture-of-experts routers and shared-expert gates: tiny linears whose outputs pick and weigh
# experts. The quantizer keeps them and the runtime runs them unquantized, by this one rule,
# whatever a checkpoint's `ignore` says (vLLM asks for a method for some of them, not others).
ROUTER = re.compile(r"(\.gate$|router|shared_expert_gate$)")
# One expert's linear in the per-expert layout Hub checkpoints use: `<layer>.experts.<E>.<proj>`.
# vLLM loads all experts of `<layer>.experts` into one FusedMoE layer: one method for all of them.
EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[^.]+)$")

PACKED_SUFFIX = "weight_packed"
SCALE_SUFFIX = "weight_scale"
ZERO_SUFFIX = "weight_zero"
QUANTIZED_SUFFIXES = (PACKED_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX)

# safetensors dtype codes and the torch dtypes they hold: the one table both sides read.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: name, safetensors dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (index 0): where row r of a slice starts is r * row_bytes."""
        return self.nbytes // self.shape[0]


def quantized_tensors(module: str, n: int, k: int, group_size: int) -> tuple[TensorSpec, ...]:
    """The three tensors that replace `<module>.weight` [N, K]: packed codes, scale, zero."""
    groups = k // group_size
    return (
        TensorSpec(f"{module}.{PACKED_SUFFIX}", "U8", (n, k // 2)),
        TensorSpec(f"{module}.{SCALE_SUFFIX}", "BF16", (n, groups)),
        TensorSpec(f"{module}.{ZERO_SUFFIX}", "BF16", (n, groups)),
    )


# quantization_config keys that describe the weights: every new checkpoint writes these.
FORMAT_KEYS: dict[str, tuple[type, object]] = {
    "quant_method": (str, QUANT_METHOD),
    "method": (str, "minmax"),
    "group_size": (int, 64),
    "ignore": (list, []),
    "quantize_embedding": (bool, True),
}
# Knobs of PyTorch's tinygemm kernel, the runtime's fallback (docs/runtime.md). Checkpoints
# written before the native kernel carry them and still load; new ones leave them out, so
# the defaults here apply. Set in config.json they still count, and key vLLM's compile cache.
TUNING_KEYS: dict[str, tuple[type, object]] = {
    "prefill_dequant": (bool, True),
    "dequant_threshold": (int, 2),
    "use_custom_op": (bool, True),
    "direct_dequant": (bool, True),
}
CONFIG_KEYS = {**FORMAT_KEYS, **TUNING_KEYS}
CONFIG_DEFAULTS: dict[str, object] = {key: default for key, (_, default) in CONFIG_KEYS.items()}
DEFAULT_GROUP_SIZE: int = CONFIG_DEFAULTS["group_size"]
DEFAULT_METHOD: str = CONFIG_DEFAULTS["method"]


def format_config(method: str, group_size: int, ignore: list[str], quantize_embedding: bool) -> dict:
    """The `quantization_config` block a new checkpoint carries: only what describes its weights."""
    config = {key: copy.deepcopy(default) for key, (_, default) in FORMAT_KEYS.items()}
    config.update(
        method=method, group_size=group_size, ignore=list(ignore), quantize_embedding=quantize_embedding
    )
    return config


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


def group_view(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] as [N, K/g, g]: one row per group (ValueError if g does not divide K)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group size {group_size}")
    return weight.reshape(n, k // group_size, group_size)


def quantize_minmax(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max group-wise 4-bit quantization (docs/format.md).

    Returns (packed uint8 [N, K/2], scale bf16 [N, K/g], zero bf16 [N, K/g]). The math runs in
    fp32; codes are rounded against the bf16 scale and zero actually stored, so dequantization
    is as close to the source as the stored numbers allow.
    """
    groups = group_view(weight.float(), group_size)
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
    codes = round_to_codes(group_view(weight.float(), group_size), scale.float(), zero.float())
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
    """Why a [N, K] weight cannot be quantized at this group size (docs/format.md), or None."""
    if k % group_size:
        return f"K={k} is not a multiple of group size {group_size}"
    if n % ROW_MULTIPLE:
        return f"N={n} is not a multiple of {ROW_MULTIPLE}"
    return None


def is_router(module: str) -> bool:
    """Whether a linear picks experts (and so stays in full precision)."""
    return bool(ROUTER.search(module))


def expert_layer(module: str) -> str | None:
    """`<layer>.experts` for one expert's linear `<layer>.experts.<E>.<proj>`, else None."""
    match = EXPERT.match(module)
    return match["layer"] if match else None


def bits_per_weight(group_size: int) -> float:
    """Storage cost of one quantized weight: a 4-bit code plus its share of bf16 scale and zero."""
    return 4 + 2 * 16 / group_size


def parse_config(raw: object) -> tuple[dict, list[str]]:
    """Validate a `quantization_config` block; returns (settings with defaults, unknown keys).

    Raises ValueError naming the field for a value of the wrong type or out of range.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be a JSON object, not {type(raw).__name__}")
    settings = copy.deepcopy(CONFIG_DEFAULTS)
    unknown = sorted(str(k) for k in raw if k not in CONFIG_KEYS)
    for key, (kind, _) in CONFIG_KEYS.items():
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

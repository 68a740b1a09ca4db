"""Shared by tests: an output dequantizes to what the quantizer meant; weights and SNR for kernels."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from cpu_int4_vllm.format import dequantize, quantize_minmax
from safetensors.torch import load_file

BF16_REL = 2.0**-8  # bf16 keeps 8 significant bits: relative rounding of a stored scale or zero


def load_all(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def check_output(source: Path, out: Path) -> dict:
    """Assert docs/format.md for every tensor: quantized ones within half a step (plus bf16 rounding
    of scale/zero) with each group's min and max reproduced; the rest bit-identical."""
    src = load_all(source)
    dst = load_all(out)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    g = qconfig["group_size"]
    quantized = {k.removesuffix(".weight_packed") for k in dst if k.endswith(".weight_packed")}
    for module in quantized:
        w = src[f"{module}.weight"].float()
        scale, zero = dst[f"{module}.weight_scale"], dst[f"{module}.weight_zero"]
        assert scale.dtype == zero.dtype == torch.bfloat16
        deq = dequantize(dst[f"{module}.weight_packed"], scale, zero, g, torch.float32)
        n, k = w.shape
        s = scale.float().repeat_interleave(g, dim=1)
        rounding = BF16_REL * (zero.float().abs() + 8 * scale.float()) + 1e-7
        err = (deq - w).abs()
        assert (err <= s / 2 * (1 + 1e-5) + rounding.repeat_interleave(g, dim=1)).all(), module
        wg, dg = w.view(n, k // g, g), deq.view(n, k // g, g)
        assert ((dg.amin(-1) - wg.amin(-1)).abs() <= rounding).all(), f"{module}: group min"
        assert ((dg.amax(-1) - wg.amax(-1)).abs() <= rounding).all(), f"{module}: group max"
    kept = {k for k in dst if k.rsplit(".", 1)[-1] not in ("weight_packed", "weight_scale", "weight_zero")}
    for name in kept:
        tensor = dst[name]
        assert tensor.dtype == src[name].dtype, name
        assert torch.equal(tensor.view(torch.uint8), src[name].view(torch.uint8)), f"{name} changed"
    return {"quantized": quantized, "kept": kept}


# Every linear of SmolLM2-135M as vLLM sees it (fused qkv and gate_up), plus its vocab table.
DEMO_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
TAIL_SHAPES = [(16, 512), (48, 512), (80, 512), (2048, 512)]


def snr_db(ref: torch.Tensor, other: torch.Tensor) -> float:
    ref, other = ref.double(), other.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - other).pow(2).sum().clamp_min(1e-30)))


def quantized(n: int, k: int, g: int, seed: int = 0):
    """Min/max-quantized random weights [n, k]: (packed, scale, zero)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    return quantize_minmax(w, g)

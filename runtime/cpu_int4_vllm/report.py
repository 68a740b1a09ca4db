"""What a loaded model holds for its int4 layers: for checking memory from `LLM.apply_model`."""

from __future__ import annotations

import torch


def int4_memory_report(model: torch.nn.Module) -> dict:
    """Per int4 module: packed bytes expected for one copy, packed bytes held, tensor names.

    Run inside vLLM's worker with `llm.apply_model(int4_memory_report)`.
    """
    from .embedding import CpuInt4EmbeddingMethod
    from .linear import CpuInt4LinearMethod

    modules = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, CpuInt4LinearMethod):
            continue
        groups, n, _ = module.scales_and_zeros.shape
        one_copy = n * groups * method.config.group_size // 2
        held = sum(t.numel() for t in module.parameters() if t.dtype == torch.uint8)
        modules[name] = {
            "kind": "embedding" if isinstance(method, CpuInt4EmbeddingMethod) else "linear",
            "packed_bytes_one_copy": one_copy,
            "packed_bytes_held": held,
            "tensors": sorted(n for n, _ in module.named_parameters()),
        }
    # named_modules() lists a shared module once: a tied head shows up under the table's name.
    head = getattr(model, "lm_head", None)
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    return {"modules": modules, "lm_head_module": head_name}

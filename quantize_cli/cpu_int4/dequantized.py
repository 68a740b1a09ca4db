"""A cpu_int4 checkpoint read back as dense weights: the plain-PyTorch reference for evals."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from cpu_int4_vllm.format import PACKED_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX, dequantize
from safetensors.torch import load_file


def dequantized_state_dict(path: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor of a cpu_int4 checkpoint; quantized layers come back as `<module>.weight`
    through the runtime's own dequantizer (one definition of the format)."""
    group_size = json.loads((path / "config.json").read_text())["quantization_config"]["group_size"]
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        raw.update(load_file(f))
    state = {}
    for name, tensor in raw.items():
        module, _, leaf = name.rpartition(".")
        if leaf == PACKED_SUFFIX:
            scale, zero = raw[f"{module}.{SCALE_SUFFIX}"], raw[f"{module}.{ZERO_SUFFIX}"]
            state[f"{module}.weight"] = dequantize(tensor, scale, zero, group_size, dtype)
        elif leaf not in (SCALE_SUFFIX, ZERO_SUFFIX):
            state[name] = tensor
    return state


def load_reference_model(path: Path, dtype: torch.dtype = torch.bfloat16):
    """A transformers model with the dequantized weights of a cpu_int4 checkpoint.

    Loaded through `from_pretrained`, so transformers maps checkpoint names onto its modules
    as it does for any checkpoint (its MoE classes hold all experts of a layer in one tensor).
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model, info = model_class.from_pretrained(
        None,
        config=config,
        state_dict=dequantized_state_dict(path, dtype),
        dtype=dtype,
        output_loading_info=True,
    )
    missing = [m for m in info["missing_keys"] if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    unexpected = info["unexpected_keys"]
    if missing or unexpected or info["mismatched_keys"]:
        raise ValueError(
            f"reference model mismatch: missing {missing}, unexpected {unexpected},"
            f" mismatched {info['mismatched_keys']}"
        )
    return model.eval()


class Fp32Product(torch.nn.Module):
    """A linear layer that multiplies its (bf16) input by exact fp32 weights and rounds the
    product back: what the runtime's fp32 dense path computes (runtime dense.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.float(), self.weight).to(x.dtype)
        return out if self.bias is None else out + self.bias


def with_fp32_products(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """`model` (from load_reference_model) with each quantized linear, the tied head included,
    multiplying by its fp32 weights: the reference for hosts whose dense path is fp32."""
    exact = {n: w for n, w in dequantized_state_dict(path, torch.float32).items() if w.dtype == torch.float32}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = exact.get(f"{name}.weight")
        if weight is None and module.weight is model.get_input_embeddings().weight:
            weight = exact.get(next(n for n, p in model.named_parameters() if p is module.weight))
        if weight is not None:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, Fp32Product(weight, module.bias))
    return model

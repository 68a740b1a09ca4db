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
    """A transformers model with the dequantized weights of a cpu_int4 checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(dequantized_state_dict(path, dtype), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"reference model mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()

"""Tiny random checkpoints of real architectures, built offline from transformers configs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config


def tiny_llama(path: Path, dtype=torch.bfloat16, intermediate_size=128, max_shard_size=None, **kw) -> Path:
    """Llama with tied embeddings (like SmolLM2): hidden 64, 2 layers, vocab 256."""
    settings = dict(
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(**{**settings, **kw})
    return _save(config, path, dtype, max_shard_size)


def medium_llama(path: Path) -> Path:
    """~0.3 GB in bf16: quantizing takes seconds, long enough to be interrupted midway."""
    return tiny_llama(
        path,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
    )


def tiny_qwen2(path: Path, dtype=torch.bfloat16) -> Path:
    """Qwen2 with q/k/v biases and an untied lm_head."""
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    return _save(config, path, dtype, None)


def _save(config, path: Path, dtype, max_shard_size) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path

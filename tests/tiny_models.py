"""Tiny random checkpoints of real architectures, built offline from transformers configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, Qwen2Config


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
    auto = AutoModel if config.model_type == "bert" else AutoModelForCausalLM
    model = auto.from_config(config).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def sentence_bert(path: Path, tokenizer_from: Path) -> Path:
    """A sentence-transformers-style BERT encoder: mean pooling (1_Pooling/), then 2_Normalize/.

    Head dim 64 (vLLM's CPU attention has no kernel for 16); the tokenizer files are copied from
    `tokenizer_from`, whose vocabulary size the model takes.
    """
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=_vocab(tokenizer_from),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
    )
    _with_tokenizer(config, path, tokenizer_from)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 128,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return path


def splittable(path: Path, tokenizer_from: Path, arch: str) -> Path:
    """A random model vLLM can split over two ranks (4 heads of 64, 2 KV heads, untied head);
    arch "llama" or "qwen2" (q/k/v biases).

    Its token embeddings are drawn 25x wider than the layers (std 0.5, not 0.02), so each
    position's logits are set mostly by its own token and partly by the context the layers add:
    top-1 choices have clear winners that bf16 rounding differences between one rank and two
    do not flip, while a layer computed wrongly still changes them. The Llama's MLP width 704 is
    a multiple of 64 but 352 is not: its down projection cannot be int4 on two ranks at group
    size 64 unless it stays in bf16 (`--tp 2`).
    """
    config_class = LlamaConfig if arch == "llama" else Qwen2Config
    config = config_class(
        hidden_size=256,
        intermediate_size=704 if arch == "llama" else 512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=_vocab(tokenizer_from),
        tie_word_embeddings=False,
    )
    return _widen_embeddings(_with_tokenizer(config, path, tokenizer_from))


# Tiny mixture-of-experts models of the four families cpu_int4 serves: 8 experts, top-2,
# expert width 256 (Qwen2-MoE adds a shared expert of width 512).
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def tiny_moe(path: Path, tokenizer_from: Path, arch: str, expert_width: int = 256) -> Path:
    """A random MoE of `arch`, with embeddings drawn wide as in `splittable` (clear top-1s)."""
    from transformers import AutoConfig

    experts = {"num_local_experts": 8} if arch == "mixtral" else {"num_experts": 8}
    widths = {"intermediate_size": expert_width} if arch in ("mixtral", "olmoe") else {}
    if arch in ("qwen3_moe", "qwen2_moe"):
        widths = {"moe_intermediate_size": expert_width, "intermediate_size": 512}
    if arch == "qwen2_moe":
        widths["shared_expert_intermediate_size"] = 512
    config = AutoConfig.for_model(
        arch,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts_per_tok=2,
        vocab_size=_vocab(tokenizer_from),
        eos_token_id=0,  # the tokenizer's <|endoftext|> (OLMoE's default is outside the vocab)
        tie_word_embeddings=False,
        **experts,
        **widths,
    )
    return _widen_embeddings(_with_tokenizer(config, path, tokenizer_from))


def _widen_embeddings(path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_tokens.weight"] = (tensors["model.embed_tokens.weight"].float() * 25).bfloat16()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _vocab(tokenizer_from: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer_from))


def _with_tokenizer(config, path: Path, tokenizer_from: Path) -> Path:
    _save(config, path, torch.bfloat16, None)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return path

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


def split_smollm2(path: Path, demo: Path, arch: str) -> Path:
    """The demo model cut so vLLM can split it over two ranks; arch "llama" or "qwen2".

    SmolLM2-135M has 9 attention heads and 3 KV heads, which two ranks cannot share: keep 8 and
    2 (3 of the 8 then read another KV head than they were trained with; the model stays a
    trained one, with confident predictions, which a random model does not make). "llama" also
    keeps 1472 of the 1536 MLP channels: 1472 is a multiple of 64 but 736 is not, so the down
    projection cannot be int4 on two ranks at group size 64 (`--tp 2` keeps it in bf16).
    "qwen2" keeps the whole MLP, adds q/k/v biases and unties the head.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen2Config

    source = AutoConfig.from_pretrained(demo)
    mlp = 1472 if arch == "llama" else source.intermediate_size
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in load_file(demo / "model.safetensors").items():
        if name.endswith("q_proj.weight"):
            t = t[: 8 * 64]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            t = t[: 2 * 64]
        elif name.endswith("o_proj.weight"):
            t = t[:, : 8 * 64]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            t = t[:mlp]
        elif name.endswith("down_proj.weight"):
            t = t[:, :mlp]
        tensors[name] = t.contiguous()
    shape = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=mlp)
    if arch == "llama":
        config = source
        for key, value in shape.items():
            setattr(config, key, value)
    else:
        config = Qwen2Config(
            **shape,
            hidden_size=source.hidden_size,
            num_hidden_layers=source.num_hidden_layers,
            vocab_size=source.vocab_size,
            rms_norm_eps=source.rms_norm_eps,
            rope_parameters=source.rope_parameters,
            max_position_embeddings=source.max_position_embeddings,
            tie_word_embeddings=False,
            bos_token_id=source.bos_token_id,
            eos_token_id=source.eos_token_id,
        )
        config.architectures = ["Qwen2ForCausalLM"]
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
            rows = tensors[name].shape[0]
            bias = torch.randn(rows, generator=gen) * 0.05
            tensors[name.replace(".weight", ".bias")] = bias.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    for f in demo.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, path / f.name)
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

"""Synthetic checkpoints with Llama-2-7B layer shapes, written tensor by tensor (flat memory)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, MLP, VOCAB = 4096, 11008, 49152


def layer_shapes(index: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{index}"
    return {
        f"{p}.input_layernorm.weight": (HIDDEN,),
        f"{p}.post_attention_layernorm.weight": (HIDDEN,),
        **{f"{p}.self_attn.{n}.weight": (HIDDEN, HIDDEN) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
        f"{p}.mlp.gate_proj.weight": (MLP, HIDDEN),
        f"{p}.mlp.up_proj.weight": (MLP, HIDDEN),
        f"{p}.mlp.down_proj.weight": (HIDDEN, MLP),
    }


def build_synthetic(path: Path, layers: int = 4) -> Path:
    """A bf16 LlamaForCausalLM checkpoint of `layers` 7B-shaped layers, one shard per layer."""
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    groups = [{"model.embed_tokens.weight": (VOCAB, HIDDEN)}]
    groups += [layer_shapes(i) for i in range(layers)]
    groups += [{"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}]
    weight_map, total = {}, 0
    for i, shapes in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
        save_file(tensors, path / name, metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


if __name__ == "__main__":
    import sys

    build_synthetic(Path(sys.argv[1]), int(sys.argv[2]))

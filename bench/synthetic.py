"""Synthetic checkpoints with real models' layer shapes, written layer by layer (flat memory):
Llama-2-7B layers, and Qwen3-30B-A3B's mixture-of-experts layers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, MLP, VOCAB = 4096, 11008, 49152
# Qwen3-30B-A3B: hidden 2048, 32 query heads and 4 KV heads of 128, 128 experts of width 768,
# 8 active. Its vocabulary (151,936) is cut to VOCAB: the layers are what is measured.
MOE_HIDDEN, MOE_HEADS, MOE_KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_WIDTH, ACTIVE = 2048, 32, 4, 128, 128, 768, 8


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


def moe_layer_shapes(index: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{index}"
    experts = {}
    for e in range(EXPERTS):
        experts[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (EXPERT_WIDTH, MOE_HIDDEN)
        experts[f"{p}.mlp.experts.{e}.up_proj.weight"] = (EXPERT_WIDTH, MOE_HIDDEN)
        experts[f"{p}.mlp.experts.{e}.down_proj.weight"] = (MOE_HIDDEN, EXPERT_WIDTH)
    q, kv = MOE_HEADS * HEAD_DIM, MOE_KV_HEADS * HEAD_DIM
    return {
        f"{p}.input_layernorm.weight": (MOE_HIDDEN,),
        f"{p}.post_attention_layernorm.weight": (MOE_HIDDEN,),
        f"{p}.self_attn.q_proj.weight": (q, MOE_HIDDEN),
        f"{p}.self_attn.k_proj.weight": (kv, MOE_HIDDEN),
        f"{p}.self_attn.v_proj.weight": (kv, MOE_HIDDEN),
        f"{p}.self_attn.o_proj.weight": (MOE_HIDDEN, q),
        f"{p}.self_attn.q_norm.weight": (HEAD_DIM,),
        f"{p}.self_attn.k_norm.weight": (HEAD_DIM,),
        f"{p}.mlp.gate.weight": (EXPERTS, MOE_HIDDEN),
        **experts,
    }


def build_synthetic(path: Path, layers: int = 4) -> Path:
    """A bf16 LlamaForCausalLM checkpoint of `layers` 7B-shaped layers, one shard per layer."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    }
    return _build(path, config, [layer_shapes(i) for i in range(layers)], HIDDEN)


def build_synthetic_moe(path: Path, layers: int = 4) -> Path:
    """A bf16 Qwen3MoeForCausalLM checkpoint of `layers` Qwen3-30B-A3B-shaped layers."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": MOE_HIDDEN,
        "intermediate_size": 6144,
        "moe_intermediate_size": EXPERT_WIDTH,
        "num_experts": EXPERTS,
        "num_experts_per_tok": ACTIVE,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": layers,
        "num_attention_heads": MOE_HEADS,
        "num_key_value_heads": MOE_KV_HEADS,
        "head_dim": HEAD_DIM,
    }
    return _build(path, config, [moe_layer_shapes(i) for i in range(layers)], MOE_HIDDEN)


def _build(path: Path, config: dict, layers: list[dict], hidden: int) -> Path:
    """Write the checkpoint (random bf16 weights, std 0.02; one shard per layer) and its config."""
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    groups = [{"model.embed_tokens.weight": (VOCAB, hidden)}, *layers]
    groups += [{"model.norm.weight": (hidden,), "lm_head.weight": (VOCAB, hidden)}]
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
        **config,
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

    build = build_synthetic_moe if sys.argv[3:] == ["moe"] else build_synthetic
    build(Path(sys.argv[1]), int(sys.argv[2]))

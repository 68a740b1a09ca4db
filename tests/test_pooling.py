"""A sentence-transformers model keeps what makes it one: its 1_Pooling/ and 2_Normalize/
folders travel with the weights, and vLLM's pooling runner pools the int4 output as the
source model says (mean, normalized), matching a PyTorch reference of the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from cpu_int4.dequantized import dequantized_state_dict
from cpu_int4.quantize import quantize
from tiny_models import sentence_bert

pytestmark = pytest.mark.vllm

TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.", "def fibonacci(n): return n"]


def reference_embeddings(quant, ids: list[list[int]], pooling: str) -> torch.Tensor:
    """Embeddings from transformers' BertModel with the dequantized weights, pooled and normalized."""
    from transformers import AutoConfig, BertModel

    config = AutoConfig.from_pretrained(quant)
    del config.quantization_config
    model = BertModel(config, add_pooling_layer=False).to(torch.bfloat16).eval()
    model.load_state_dict(dequantized_state_dict(quant), strict=False)
    rows = []
    with torch.no_grad():
        for seq in ids:
            hidden = model(torch.tensor([seq])).last_hidden_state[0].float()
            rows.append(hidden.mean(0) if pooling == "mean" else hidden[0])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def test_int4_sentence_encoder_is_pooled_as_its_folder_says(demo_model, tmp_path):
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    src = sentence_bert(tmp_path / "st", tokenizer_from=demo_model)
    quant = tmp_path / "st-int4"
    summary = quantize(str(src), quant)
    assert json.loads((quant / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    assert (quant / "2_Normalize").is_dir() and (quant / "modules.json").is_file()
    qc = json.loads((quant / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in qc["ignore"]  # a BERT encoder has no head to keep
    # q, k, v, attention out, intermediate, output in 2 layers, and BERT's pooler (vLLM skips it)
    assert len(summary.plan.quantized) == 2 * 6 + 1

    tok = AutoTokenizer.from_pretrained(quant)
    ids = [tok.encode(t) for t in TEXTS]
    llm = LLM(
        model=str(quant),
        runner="pooling",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=1 << 28,
    )
    served = torch.tensor(
        [o.outputs.embedding for o in llm.embed([TokensPrompt(prompt_token_ids=i) for i in ids])]
    )
    mean = reference_embeddings(quant, ids, "mean")
    cls = reference_embeddings(quant, ids, "cls")
    agree_mean = torch.nn.functional.cosine_similarity(served, mean).min().item()
    agree_cls = torch.nn.functional.cosine_similarity(served, cls).max().item()
    print(f"\ncosine to the mean-pooled reference >= {agree_mean:.4f}; to CLS pooling <= {agree_cls:.4f}")
    assert agree_mean > 0.99
    assert agree_cls < 0.95  # the check can tell the pooling the folder asks for from vLLM's default

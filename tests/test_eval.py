"""`cpu-int4 eval` and `--method search`: the metrics, the error property, the two engines."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from cpu_int4.cli import app
from cpu_int4.evaluate import evaluate, kl_divergence, perplexity
from cpu_int4.methods import importance, quantize_search, weighted_error
from cpu_int4.quantize import quantize
from cpu_int4_vllm.format import quantize_minmax
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama
from typer.testing import CliRunner

WIKI_MAX_TOKENS = 2048


def test_kl_divergence_matches_torch_and_is_zero_for_itself():
    logp = torch.randn(8, 100).log_softmax(-1)
    logq = torch.randn(8, 100).log_softmax(-1)
    assert torch.allclose(kl_divergence(logp, logp), torch.zeros(8), atol=1e-6)
    expected = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl_divergence(logp, logq), expected, atol=1e-5)


def test_uniform_predictor_has_vocab_size_perplexity_and_zero_kld(tmp_path, demo_model, wiki):
    """A model whose head is all zeros predicts uniformly: PPL = vocab size, KLD(self) = 0."""
    from safetensors.torch import load_file, save_file

    src = tiny_llama(tmp_path / "uniform", vocab_size=49152, tie_word_embeddings=False)
    tensors = load_file(src / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model / name, src / name)
    quantize(str(src), tmp_path / "q")
    result = evaluate(src, tmp_path / "q", wiki, context=256, max_tokens=600)
    assert math.isclose(result.ppl_base, 49152, rel_tol=1e-4)
    assert math.isclose(result.ppl_quant, 49152, rel_tol=1e-4)
    assert abs(result.kld) < 1e-7
    assert result.positions == 597  # windows of 256, 256 and 88 tokens predict 255 + 255 + 87
    assert math.isclose(perplexity(torch.full((10,), math.log(7.0))), 7.0, rel_tol=1e-6)


def groups_strategy():
    """Random [rows, 64] weights: normal, with outliers, constant, tiny and huge magnitudes."""
    kind = st.sampled_from(["normal", "outliers", "constant", "tiny", "huge", "mixed"])
    return st.tuples(kind, st.integers(0, 2**31 - 1))


def make_groups(kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 128, generator=gen)
    if kind == "outliers":
        idx = torch.randint(0, w.numel(), (20,), generator=gen)
        w.view(-1)[idx] *= 40
    elif kind == "constant":
        w[:, :64] = w[:, :1]
    elif kind == "tiny":
        w *= 1e-30
    elif kind == "huge":
        w *= 1e30
    elif kind == "mixed":
        w[::2] *= 1e-3
        w[1::4, 64:] = 0.5
    return w.to(torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(groups_strategy(), st.sampled_from([32, 64]), st.booleans())
def test_search_error_never_above_minmax(case, g, with_channels):
    w = make_groups(*case)
    groups = w.float().view(w.shape[0], -1, g)
    channel = (
        torch.rand(w.shape[1], generator=torch.Generator().manual_seed(case[1])) + 0.1
        if with_channels
        else None
    )
    imp = importance(groups / groups.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    if channel is not None:
        imp = imp * channel.view(1, -1, g)
    _, s_mm, z_mm = quantize_minmax(w, g)
    _, s_se, z_se = quantize_search(w, g, channel)
    err_mm = weighted_error(groups, s_mm, z_mm, imp)
    err_se = weighted_error(groups, s_se, z_se, imp)
    assert torch.isfinite(err_se).all()
    assert (err_se <= err_mm).all()


def test_search_weighs_input_channels_by_their_norm_gain():
    from cpu_int4.plan import input_norm

    names = {
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    }
    assert (
        input_norm("model.layers.0.self_attn.k_proj", False, names) == "model.layers.0.input_layernorm.weight"
    )
    assert (
        input_norm("model.layers.0.mlp.up_proj", False, names)
        == "model.layers.0.post_attention_layernorm.weight"
    )
    assert input_norm("model.layers.0.mlp.down_proj", False, names) is None
    assert input_norm("lm_head", False, names) == "model.norm.weight"
    assert input_norm("model.embed_tokens", True, names) == "model.norm.weight"  # the tied head
    assert input_norm("model.embed_tokens", False, names) is None


def test_search_is_written_into_config_and_card(tmp_path):
    src = tiny_llama(tmp_path / "src")
    result = CliRunner().invoke(app, ["quantize", str(src), str(tmp_path / "out"), "--method", "search"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["method"] == "search"
    assert "| method | search |" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.vllm
def test_vllm_engine_agrees_with_reference_and_fills_the_card(demo_model, demo_quantized, tmp_path, wiki):
    quant = tmp_path / "q"
    shutil.copytree(demo_quantized, quant)
    runner = CliRunner()
    figures = {}
    for engine in ("torch", "vllm"):
        out = tmp_path / f"{engine}.json"
        args = [
            "eval",
            str(demo_model),
            str(quant),
            "--text",
            str(wiki),
            "--max-tokens",
            str(WIKI_MAX_TOKENS),
            "--engine",
            engine,
            "--json",
            str(out),
            "--card",
        ]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "verdict:" in result.output
        figures[engine] = json.loads(out.read_text())
    torch_ppl, vllm_ppl = figures["torch"]["ppl_quant"], figures["vllm"]["ppl_quant"]
    positions = figures["torch"]["positions"]
    print(f"\nPPL over {positions} positions: PyTorch reference {torch_ppl:.3f}, vLLM {vllm_ppl:.3f}")
    assert abs(vllm_ppl / torch_ppl - 1) < 0.01
    assert figures["vllm"]["kld"] is None and figures["torch"]["kld"] > 0
    card = (quant / "README.md").read_text()
    assert "## Quality" in card and f"{vllm_ppl:.3f}" in card and "vllm engine" in card
    assert "No evaluation was run" not in card

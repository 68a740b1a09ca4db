"""Mixture-of-experts models: what the plan quantizes, the experts' two compute paths, and the
four families served by vLLM against PyTorch models of the same weights.

Each engine runs in a process of its own (tests/serve_once.py), one model at a time.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checks import snr_db
from cpu_int4.cli import app
from cpu_int4.dequantized import load_reference_model
from cpu_int4.quantize import quantize
from cpu_int4_vllm import native
from cpu_int4_vllm.format import dequantize, expert_layer, is_router, quantize_minmax
from safetensors.torch import load_file, save_file
from serve_once import POSITIONS, launch, result
from tiny_models import MOE_ARCHS, tiny_moe
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def qwen3_moe(demo_model, tmp_path_factory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("qwen3_moe") / "bf16", demo_model, "qwen3_moe")


def test_routers_and_shared_expert_gates_are_recognised_by_one_rule():
    for router in (
        "model.layers.0.mlp.gate",
        "model.layers.3.block_sparse_moe.gate",
        "model.layers.0.mlp.router",
    ):
        assert is_router(router)
    assert is_router("model.layers.0.mlp.shared_expert_gate")
    for linear in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.experts.7.gate_proj", "lm_head"):
        assert not is_router(linear)
    assert (
        expert_layer("model.layers.2.block_sparse_moe.experts.5.w1")
        == "model.layers.2.block_sparse_moe.experts"
    )
    assert expert_layer("model.layers.2.mlp.shared_expert.gate_proj") is None


def test_experts_are_quantized_per_expert_and_routers_stay_bf16(qwen3_moe, tmp_path):
    summary = quantize(str(qwen3_moe), tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    for expert in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = f"model.layers.1.mlp.experts.{expert}.{proj}"
            assert tensors[f"{module}.weight_packed"].dtype == torch.uint8
            assert f"{module}.weight" not in tensors
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.gate.weight_packed" not in tensors
    count = summary.plan.experts()
    assert (count.layers, count.experts) == (2, 16)
    assert count.params == 2 * 8 * 3 * 256 * 256
    assert count.output_bytes * 8 / count.params == pytest.approx(4.5)  # g64: 4 + 32/64 bits


def test_experts_of_a_layer_stay_bf16_together(qwen3_moe, tmp_path):
    plan = quantize(
        str(qwen3_moe), tmp_path / "out", ignore=["model.layers.1.mlp.experts.3.up_proj"], dry_run=True
    ).plan
    kept = {c.module for c in plan.kept_layers}
    assert {m for m in kept if expert_layer(m)} == {
        f"model.layers.1.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")
    }
    # vLLM asks once for all experts of a layer: the ignore list names that layer.
    assert plan.ignore == ["model.layers.1.mlp.experts"]
    assert plan.experts().experts == 8  # layer 0's
    assert plan.kept_rows() == [
        (
            "model.layers.1.mlp.experts.*",
            "experts of model.layers.1.mlp.experts stay bf16 together"
            " (model.layers.1.mlp.experts.3.up_proj: --ignore)",
        )
    ]


def test_an_expert_width_the_group_size_does_not_divide_keeps_the_experts(demo_model, tmp_path):
    source = tiny_moe(tmp_path / "bf16", demo_model, "mixtral", expert_width=96)
    plan = quantize(str(source), tmp_path / "out", dry_run=True).plan
    assert plan.experts().experts == 0
    # vLLM builds Mixtral's token table without a quantization config: it stays bf16 too.
    assert plan.ignore == [
        "model.embed_tokens",
        "model.layers.0.block_sparse_moe.experts",
        "model.layers.1.block_sparse_moe.experts",
    ]
    rows = dict(plan.kept_rows())
    assert rows["model.embed_tokens.weight"] == "vLLM builds MixtralForCausalLM's table unquantized"
    assert "K=96 is not a multiple of group size 64" in rows["model.layers.0.block_sparse_moe.experts.*"]


def test_dry_run_counts_the_experts(qwen3_moe, tmp_path):
    result = CliRunner().invoke(
        app, ["quantize", str(qwen3_moe), str(tmp_path / "out"), "--dry-run"], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 0, result.output
    assert (
        "of which experts: 16 in 2 MoE layers (3.1M weights, 6.3 MB -> 1.8 MB, 4.50 bits/weight)"
        in result.output
    )
    assert not (tmp_path / "out").exists()


def test_fused_3d_experts_are_refused_in_one_line(qwen3_moe, tmp_path):
    tensors = load_file(qwen3_moe / "model.safetensors")
    gate_up = [tensors.pop(f"model.layers.0.mlp.experts.{e}.gate_proj.weight") for e in range(8)]
    for e in range(8):
        del tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack(gate_up).repeat(1, 2, 1)
    save_file(tensors, qwen3_moe.parent / "fused.safetensors")
    folder = tmp_path / "fused"
    folder.mkdir()
    (folder / "config.json").write_text((qwen3_moe / "config.json").read_text())
    (qwen3_moe.parent / "fused.safetensors").rename(folder / "model.safetensors")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(folder), str(out)], env={"COLUMNS": "400"})
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        "error: model.layers.0.mlp.experts.gate_up_proj holds all experts in one 3-D tensor"
    )
    assert not out.exists()


@pytest.fixture(scope="module")
def experts():
    """8 random int4 experts (hidden 256, width 128, g64): their checkpoint tensors, exact
    float64 weights, and 400 tokens routed top-2 (over 64 rows per expert)."""
    torch.manual_seed(0)
    count, hidden, width, g, tokens = 8, 256, 128, 64, 400

    def checkpoint(n, k):
        return [quantize_minmax(torch.randn(n, k) * 0.05, g) for _ in range(count)]

    w13, w2 = checkpoint(2 * width, hidden), checkpoint(hidden, width)
    weights, ids = torch.randn(tokens, count).softmax(-1).topk(2)
    return SimpleNamespace(
        x=torch.randn(tokens, hidden).bfloat16(),
        weights=weights,
        ids=ids,
        w13=w13,
        w2=w2,
        w13_exact=[dequantize(*t, g, torch.float64) for t in w13],
        w2_exact=[dequantize(*t, g, torch.float64) for t in w2],
        width=width,
        config=SimpleNamespace(group_size=g, use_custom_op=False, dequant_threshold=2, direct_dequant=True),
    )


def stacked(checkpoint, backend, config) -> SimpleNamespace:
    """A backend's tensors of every expert in `checkpoint`, stacked [E, ...] as moe.py holds them."""
    prepared = [backend.prepare(*tensors, config) for tensors in checkpoint]
    return SimpleNamespace(
        **{k: None if v is None else torch.stack([p[k] for p in prepared]) for k, v in prepared[0].items()}
    )


def run(case, rows=slice(None), weights=None, ids=None, x=None, backend=None, **kwargs) -> torch.Tensor:
    """The experts of `case` on a backend's kernels (native by default), through run_experts."""
    from cpu_int4_vllm import native_backend
    from cpu_int4_vllm.moe import run_experts
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    backend = backend or native_backend
    x = case.x if x is None else x
    weights = case.weights if weights is None else weights
    ids = case.ids if ids is None else ids
    return run_experts(
        x[rows],
        weights[rows],
        ids[rows],
        stacked(case.w13, backend, case.config),
        stacked(case.w2, backend, case.config),
        lambda inputs, experts, groups: backend.grouped_linear(inputs, experts, groups, case.config),
        MoEActivation.SILU,
        **kwargs,
    )


def test_expert_kernel_and_dequantize_paths_agree(experts):
    """The experts on one token at a time (int4 kernel) and on all 400 at once (dequantize +
    dense GEMM), against float64 math on the dequantized weights."""
    from cpu_int4_vllm.native_backend import MAX_KERNEL_ROWS

    assert torch.bincount(experts.ids.flatten()).min() >= MAX_KERNEL_ROWS
    batch = run(experts)
    alone = torch.cat([run(experts, slice(t, t + 1)) for t in range(len(experts.x))])
    exact = torch.zeros(batch.shape, dtype=torch.float64)
    for t, (x, weights, ids) in enumerate(zip(experts.x, experts.weights, experts.ids, strict=True)):
        for weight, e in zip(weights, ids, strict=True):
            h = x.double() @ experts.w13_exact[e].T
            act = torch.nn.functional.silu(h[: experts.width]) * h[experts.width :]
            exact[t] += weight.double() * (act @ experts.w2_exact[e].T)

    def snr(a, b):
        return 10 * torch.log10((b.double() ** 2).sum() / ((a.double() - b.double()) ** 2).sum()).item()

    print(f"\nkernel vs dequantize path {snr(alone, batch):.1f} dB; vs float64 {snr(alone, exact):.1f} dB")
    assert snr(alone, batch) >= 40
    assert snr(alone, exact) >= 40
    assert snr(batch, exact) >= 40


@pytest.mark.parametrize("isa", native.supported_isas(), ids=lambda isa: isa.name)
def test_one_native_call_runs_the_experts_as_run_experts_does(experts, isa):
    """Decode's single call (silu_experts) on each kernel path the CPU has, against run_experts
    on the host's, for 1, 2 and 31 tokens (62 pairs, the most it is given). What may differ:
    silu's exp in its last bits, the order of each token's k sums."""
    from cpu_int4_vllm import native_backend

    native.isa()  # loads the kernels
    w13, w2 = (stacked(w, native_backend, experts.config) for w in (experts.w13, experts.w2))
    for tokens in (1, 2, 31):
        rows = slice(0, tokens)
        one = torch.ops.cpu_int4_native.silu_experts(
            experts.x[rows],
            experts.weights[rows],
            experts.ids[rows],
            w13.int4_packed,
            w13.scales_and_zeros,
            w2.int4_packed,
            w2.scales_and_zeros,
            experts.config.group_size,
            int(isa),
        )
        glue = run(experts, rows)
        same, db = (one == glue).float().mean().item(), snr_db(glue, one)
        print(f"\n{isa.name}, {tokens} tokens: {db:.1f} dB, {same:.2%} of values identical")
        assert one.dtype == glue.dtype and one.shape == glue.shape
        assert db >= 50
        assert same >= 0.9


def test_the_tinygemm_backend_runs_the_same_experts(experts):
    """Where the native kernels cannot be built, PyTorch's int4 kernel runs the experts."""
    from cpu_int4_vllm import tinygemm_backend

    native, tinygemm = run(experts, slice(0, 8)), run(experts, slice(0, 8), backend=tinygemm_backend)
    noise = ((native.double() - tinygemm.double()) ** 2).sum()
    assert 10 * torch.log10((native.double() ** 2).sum() / noise) >= 40


def test_router_weight_on_the_input(experts):
    """Llama-4-style routing: top-1, the router's weight scales the expert's input instead."""
    top1, weight = experts.ids[:, :1], experts.weights[:, :1]
    on_input = run(experts, weights=weight, ids=top1, weight_on_input=True)
    scaled = (experts.x.float() * weight).bfloat16()
    assert torch.equal(on_input, run(experts, x=scaled, weights=torch.ones_like(weight), ids=top1))


# Served: one engine per (family, weights), each in a process of its own.


def serve(model: Path, ids_file: Path, tp: int = 1, *flags: str) -> subprocess.CompletedProcess:
    return launch(model, tp, 1, ids_file, "alone", *flags)


def torch_top1(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].float().argmax(-1)


@pytest.mark.vllm
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_family_serves_its_int4_experts_like_pytorch(arch, demo_model, ids_file, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny_moe(tmp_path / "bf16", demo_model, arch)
    quant = tmp_path / "int4"
    quantize(str(source), quant)
    ids = json.loads(ids_file.read_text())

    served = result(serve(quant, ids_file))
    reference = torch_top1(load_reference_model(quant), ids)
    agree = (torch.tensor(served["top1"]) == reference).float().mean().item()
    control_served = result(serve(source, ids_file))
    control_reference = torch_top1(AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16), ids)
    control = (torch.tensor(control_served["top1"]) == control_reference).float().mean().item()
    same = sum(a == b for a, b in zip(served["alone"], served["greedy"], strict=True))
    print(
        f"\n{arch}: {len(reference)} positions, cpu_int4 vLLM vs PyTorch (same dequantized weights)"
        f" {agree:.2%}; control bf16 vLLM vs PyTorch {control:.2%}; alone = in a batch for {same}/8"
    )
    assert len(reference) == POSITIONS
    assert agree >= control - 0.02
    assert same >= 7

    experts = {name: r for name, r in served["memory"]["modules"].items() if r["kind"] == "experts"}
    assert len(experts) == 2  # both MoE layers run the int4 method
    for name, r in experts.items():
        assert r["packed_bytes_held"] == r["packed_bytes_one_copy"], name  # no second copy
        assert r["tensors"] == [
            "w13_int4_packed",
            "w13_scales_and_zeros",
            "w2_int4_packed",
            "w2_scales_and_zeros",
        ]


@pytest.mark.vllm
def test_compiled_mode_serves_the_int4_experts(qwen3_moe, ids_file, tmp_path):
    """vLLM's default compilation: the experts run as one opaque op, as in eager mode."""
    quant = tmp_path / "int4"
    quantize(str(qwen3_moe), quant)
    compiled, eager = result(serve(quant, ids_file, 1, "compiled")), result(serve(quant, ids_file))
    agree = (torch.tensor(compiled["top1"]) == torch.tensor(eager["top1"])).float().mean().item()
    print(f"\nqwen3_moe compiled vs eager: top-1 agreement {agree:.2%}")
    assert agree >= 0.97
    assert all(len(tokens) == 16 for tokens in compiled["greedy"])


@pytest.mark.vllm
@pytest.mark.slow
def test_int4_experts_serve_across_two_ranks(qwen3_moe, ids_file, tmp_path):
    """TP=2 splits each expert's width (w13 along N, w2 along K) over the ranks' int4 shares."""
    quant = tmp_path / "int4"
    quantize(str(qwen3_moe), quant)
    one, two = result(launch(quant, 1, 1, ids_file, "alone")), result(launch(quant, 2, 1, ids_file, "alone"))
    agree = (torch.tensor(two["top1"]) == torch.tensor(one["top1"])).float().mean().item()
    same = sum(a == b for a, b in zip(one["greedy"], two["greedy"], strict=True))
    print(f"\nqwen3_moe TP=2 vs TP=1: top-1 agreement {agree:.2%}; greedy equal for {same}/8")
    assert agree >= 0.97
    assert same >= 7


@pytest.mark.vllm
@pytest.mark.slow
def test_experts_that_cannot_split_over_ranks_fail_at_load_in_one_line(demo_model, ids_file, tmp_path):
    """Expert width 192 is int4 on one rank at g64; on two, w2's K is 96 per rank. Planned for
    two ranks (`--tp 2`), those experts stay bf16 and the model serves."""
    source = tiny_moe(tmp_path / "bf16", demo_model, "qwen3_moe", expert_width=192)
    quant = tmp_path / "int4"
    assert quantize(str(source), quant).plan.tp_sizes == [1]
    proc = serve(quant, ids_file, tp=2)
    assert proc.returncode != 0
    expected = (
        "cpu_int4: model.layers.0.mlp.experts cannot be int4 here: expert width 192 over tp=2 is 96 per"
        " rank: K=96 is not a multiple of group size 64; requantize with `cpu-int4 quantize --tp 2`"
    )
    assert expected in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    planned = tmp_path / "int4-tp2"
    plan = quantize(str(source), planned, tp=2).plan
    assert plan.ignore == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert len(result(launch(planned, 2, 1, ids_file))["top1"]) == POSITIONS


@pytest.mark.vllm
def test_a_missing_expert_tensor_fails_at_load_naming_it(qwen3_moe, ids_file, tmp_path):
    quant = tmp_path / "int4"
    quantize(str(qwen3_moe), quant)
    tensors = load_file(quant / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight_scale"]
    save_file(tensors, quant / "model.safetensors", metadata={"format": "pt"})
    proc = serve(quant, ids_file)
    assert proc.returncode != 0
    expected = "cpu_int4: model.layers.1.mlp.experts.5.up_proj.weight_scale is missing from the checkpoint"
    assert expected in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]

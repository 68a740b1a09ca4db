"""`cpu-int4 quantize` end to end, on the real demo model and on tiny models built offline."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import check_output, load_all
from cpu_int4.cli import app
from tiny_models import tiny_llama, tiny_qwen2
from typer.testing import CliRunner

runner = CliRunner()


def run_cli(*args: str):
    return runner.invoke(app, ["quantize", *map(str, args)])


def test_demo_model_dequantizes_to_the_source(demo_model, demo_quantized):
    result = check_output(demo_model, demo_quantized)
    assert "model.embed_tokens" in result["quantized"]
    assert len(result["quantized"]) == 1 + 30 * 7  # table + 7 linears in each of 30 layers
    files = {p.name for p in demo_quantized.iterdir()}
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= files
    qc = json.loads((demo_quantized / "config.json").read_text())["quantization_config"]
    # Only what describes the weights: the fallback kernel's knobs stay out of new checkpoints.
    assert qc == {
        "quant_method": "cpu_int4",
        "method": "minmax",
        "group_size": 64,
        "ignore": [],
        "quantize_embedding": True,
    }


def test_transformers_loads_tokenizer_from_output(demo_quantized):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_quantized)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi" in text and tok.encode("hello world")


def test_tied_llama_drops_redundant_head(tmp_path):
    src = tiny_llama(tmp_path / "src")
    # A checkpoint that carries a copy of the tied head anyway: it must not be written.
    tensors = load_all(src)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    from safetensors.torch import save_file

    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    result = run_cli(src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "dropped lm_head.weight" in result.output
    out = load_all(tmp_path / "out")
    assert not any(k.startswith("lm_head") for k in out)
    assert "model.embed_tokens.weight_packed" in out


def test_qwen2_biases_and_untied_head(tmp_path):
    src = tiny_qwen2(tmp_path / "src")
    assert run_cli(src, tmp_path / "out").exit_code == 0
    result = check_output(src, tmp_path / "out")
    assert {"lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj"} <= result["quantized"]
    assert "model.layers.0.self_attn.q_proj.bias" in result["kept"]


def test_layer_breaking_shape_rule_is_kept_and_named(tmp_path):
    src = tiny_llama(tmp_path / "src", intermediate_size=96)  # down_proj K=96 % 64 != 0
    result = run_cli(src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "model.layers.0.mlp.down_proj.weight" in result.output and "K=96" in result.output
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    kept = check_output(src, tmp_path / "out")["kept"]
    assert "model.layers.1.mlp.down_proj.weight" in kept


def test_fused_siblings_are_kept_together(tmp_path):
    src = tiny_llama(tmp_path / "src")
    assert run_cli(src, tmp_path / "out", "--ignore", "model.layers.0.self_attn.k_proj").exit_code == 0
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert [m for m in qc["ignore"] if "layers.0.self_attn" in m] == [
        f"model.layers.0.self_attn.{p}" for p in ("k_proj", "q_proj", "v_proj")
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_inputs(tmp_path, dtype):
    src = tiny_llama(tmp_path / "src", dtype=dtype)
    assert run_cli(src, tmp_path / "out").exit_code == 0
    check_output(src, tmp_path / "out")  # kept tensors keep their dtype, bit for bit
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_sharded_input_and_output(tmp_path):
    src = tiny_llama(tmp_path / "src", max_shard_size="50KB")
    assert (src / "model.safetensors.index.json").is_file()
    result = run_cli(src, tmp_path / "out", "--max-shard-size", "40KB")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in load_all(out).values())
    check_output(src, out)


@pytest.mark.parametrize(
    "pattern", ["model.layers.1.mlp.up_proj", "mlp.up_proj", r"re:layers\.1\.mlp\.(up|gate)_proj"]
)
def test_ignore_pattern_forms(tmp_path, pattern):
    src = tiny_llama(tmp_path / "src")
    result = run_cli(src, tmp_path / "out", "--ignore", pattern)
    assert result.exit_code == 0, result.output
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.up_proj" in ignore
    assert "model.layers.1.mlp.gate_proj" in ignore  # fused with up_proj in vLLM
    assert "model.layers.1.mlp.down_proj" not in ignore
    assert ("model.layers.0.mlp.up_proj" in ignore) == (pattern == "mlp.up_proj")
    check_output(src, tmp_path / "out")


def test_no_quantize_embedding_keeps_table_and_tied_head(tmp_path):
    src = tiny_llama(tmp_path / "src")
    assert run_cli(src, tmp_path / "out", "--no-quantize-embedding").exit_code == 0
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quantize_embedding"] is False
    assert {"model.embed_tokens", "lm_head"} <= set(qc["ignore"])
    assert "model.embed_tokens.weight" in check_output(src, tmp_path / "out")["kept"]


def test_dry_run_writes_nothing(tmp_path):
    src = tiny_llama(tmp_path / "src")
    result = run_cli(src, tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "dry run" in result.output and "bits/weight" in result.output
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_overwrite_replaces_output(tmp_path):
    src = tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert run_cli(src, out).exit_code == 1
    assert run_cli(src, out, "--overwrite").exit_code == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_old_out_survives_a_failed_final_rename(tmp_path, monkeypatch):
    src = tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    real_rename = Path.rename

    def rename(self, target):
        if ".cpu-int4-staging-new" in self.name:  # the staged output moving into place
            raise OSError(errno.EXDEV, "simulated failure")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    result = run_cli(src, out, "--overwrite")
    assert result.exit_code == 1 and "nothing was written" in result.output
    assert (out / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_an_old_out_set_aside_by_a_killed_run_is_put_back(tmp_path):
    src = tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    # A run killed between its two renames left the old OUT under its staging name.
    aside = tmp_path / ".out.cpu-int4-staging-old-999999999"
    aside.mkdir()
    (aside / "keep.txt").write_text("old")
    assert run_cli(src, out).exit_code == 1  # OUT is back, and not empty
    assert (out / "keep.txt").read_text() == "old" and not aside.exists()


def test_every_non_weight_file_and_folder_is_copied(tmp_path):
    src = tiny_llama(tmp_path / "src")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (src / "2_Normalize").mkdir()
    (src / "modules.json").write_text("[]")
    (src / "extra").mkdir()
    (src / "extra" / "old_weights.bin").write_bytes(b"x")
    (src / "extra" / "notes.txt").write_text("n")
    (src / "pytorch_model.bin").write_bytes(b"x")
    (src / ".git").mkdir()
    assert run_cli(src, tmp_path / "out").exit_code == 0
    out = tmp_path / "out"
    assert (out / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert (out / "2_Normalize").is_dir() and (out / "modules.json").is_file()
    assert (out / "extra" / "notes.txt").is_file()
    assert not (out / "extra" / "old_weights.bin").exists() and not (out / "pytorch_model.bin").exists()
    assert not (out / ".git").exists()


def test_exit_code_and_one_line_error_from_the_console_script(tmp_path):
    proc = subprocess.run(
        [Path(sys.executable).parent / "cpu-int4", "quantize", str(tmp_path / "nope"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: MODEL {tmp_path / 'nope'} does not exist"]

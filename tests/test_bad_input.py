"""Bad input: one line naming the problem, a non-zero exit, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from cpu_int4.cli import app
from safetensors.torch import save_file
from tiny_models import tiny_llama
from typer.testing import CliRunner

runner = CliRunner()


@pytest.fixture
def src(tmp_path):
    return tiny_llama(tmp_path / "src")


def fails(tmp_path, model, *args, out=None, expect: str):
    """Run quantize, expect failure with `expect` in a one-line message, and nothing new on disk."""
    before = {p for p in tmp_path.rglob("*")}
    out = out or tmp_path / "out"
    result = runner.invoke(app, ["quantize", str(model), str(out), *args], env={"COLUMNS": "400"})
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert expect in lines[0], lines[0]
    assert {p for p in tmp_path.rglob("*")} == before
    return lines[0]


def test_missing_model(tmp_path):
    fails(tmp_path, tmp_path / "missing", expect="does not exist")


def test_model_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    fails(tmp_path, tmp_path / "f", expect="is not a directory")


def test_no_config(src, tmp_path):
    (src / "config.json").unlink()
    fails(tmp_path, src, expect="no config.json")


def test_only_pytorch_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, d / "pytorch_model.bin")
    fails(tmp_path, d, expect="convert them to safetensors")


def test_truncated_safetensors(src, tmp_path):
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    fails(tmp_path, src, expect="model.safetensors is not a readable safetensors file")


def test_garbled_safetensors_header(src, tmp_path):
    f = src / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"garbage!"
    f.write_bytes(bytes(data))
    fails(tmp_path, src, expect="not a readable safetensors file")


def test_index_names_missing_shard(tmp_path):
    src = tiny_llama(tmp_path / "src", max_shard_size="50KB")
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.unlink()
    fails(tmp_path, src, expect=f"names shard {shard.name}, which is missing")


@pytest.mark.parametrize("method", ["cpu_int4", "gptq"])
def test_already_quantized(src, tmp_path, method):
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (src / "config.json").write_text(json.dumps(config))
    fails(tmp_path, src, expect=f"already quantized (quant_method={method})")


@pytest.mark.parametrize("dtype,code", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.int8, "I8")])
def test_unsupported_dtype(src, tmp_path, dtype, code):
    from checks import load_all

    tensors = load_all(src)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(dtype)
    save_file(tensors, src / "model.safetensors")
    fails(tmp_path, src, expect=f"model.layers.0.mlp.up_proj.weight has unsupported dtype {code}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_weight(src, tmp_path, bad):
    from checks import load_all

    tensors = load_all(src)
    tensors["model.layers.1.self_attn.o_proj.weight"][3, 5] = bad
    save_file(tensors, src / "model.safetensors")
    fails(tmp_path, src, expect="model.layers.1.self_attn.o_proj.weight contains NaN or Inf")


def test_out_not_empty(src, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    fails(tmp_path, src, expect="pass --overwrite")


@pytest.mark.parametrize("where", ["inside", "same"])
def test_out_inside_model(src, tmp_path, where):
    out = src / "quantized" if where == "inside" else src
    fails(tmp_path, src, out=out, expect="inside MODEL")


def test_bad_group_size(src, tmp_path):
    fails(tmp_path, src, "--group-size", "48", expect="group size 48 is not supported")


def test_bad_regex(src, tmp_path):
    fails(tmp_path, src, "--ignore", "re:layers.(", expect="invalid --ignore regex")


@pytest.fixture
def eval_pair(src, tmp_path):
    """A tiny base model and its cpu_int4 output, plus a text."""
    from cpu_int4.quantize import quantize

    quantize(str(src), tmp_path / "quant")
    text = tmp_path / "text.txt"
    text.write_text("some words to score, enough of them")
    return src, tmp_path / "quant", text


def eval_fails(*args, expect: str) -> None:
    result = runner.invoke(app, ["eval", *map(str, args)], env={"COLUMNS": "400"})
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_eval_unparsable_config(eval_pair):
    base, quant, text = eval_pair
    (quant / "config.json").write_text("{not json")
    eval_fails(base, quant, "--text", text, expect="config.json is not valid JSON")


def test_eval_missing_files(eval_pair, tmp_path):
    base, quant, text = eval_pair
    eval_fails(tmp_path / "nope", quant, "--text", text, expect="BASE")
    eval_fails(base, quant, "--text", tmp_path / "nope.txt", expect="--text")
    (base / "config.json").unlink()
    eval_fails(base, quant, "--text", text, expect="has no config.json")


def test_eval_quant_that_is_not_cpu_int4(eval_pair):
    base, quant, text = eval_pair
    eval_fails(base, base, "--text", text, expect="not a cpu_int4 checkpoint")
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (quant / "config.json").write_text(json.dumps(config))
    eval_fails(base, quant, "--text", text, expect="quant_method is 'gptq'")


def test_eval_text_that_is_not_utf8(eval_pair):
    base, quant, text = eval_pair
    text.write_bytes(b"\xff\xfe\x00 binary")
    eval_fails(base, quant, "--text", text, expect="not UTF-8")


def test_eval_choices_are_checked_by_the_cli(eval_pair):
    base, quant, text = eval_pair
    result = runner.invoke(app, ["eval", str(base), str(quant), "--text", str(text), "--engine", "onnx"])
    assert result.exit_code == 2 and "onnx" in result.output

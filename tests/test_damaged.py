"""Damaged cpu_int4 checkpoints fail at load in vLLM, naming the tensor or field: never a kernel
crash, never garbage output. Each case loads a real engine in a child process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.vllm  # every test loads a real engine in a child process

LOAD = """
from vllm import LLM
llm = LLM(model={path!r}, enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=1 << 28)
print("LOADED-AND-SERVING", llm.generate(["Hello"])[0].outputs[0].text)
"""
LAYER = "model.layers.3.self_attn.k_proj"
# The engine's worker unpickles report.int4_memory_report: it must find bench/ from its start.
WITH_REPORT = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "bench")}


def damage_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def damage_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


CASES = {
    "missing weight_scale": (
        lambda f: damage_tensors(f, lambda t: t.pop(f"{LAYER}.weight_scale")),
        f"{LAYER}.weight_scale is missing from the checkpoint",
    ),
    "wrong shape": (
        lambda f: damage_tensors(
            f,
            lambda t: t.update({f"{LAYER}.weight_packed": t[f"{LAYER}.weight_packed"][:, :200].contiguous()}),
        ),
        f"{LAYER.replace('k_proj', 'qkv_proj')}.weight_packed has shape (192, 200), expected 288 columns",
    ),
    "wrong dtype": (
        lambda f: damage_tensors(
            f, lambda t: t.update({f"{LAYER}.weight_zero": t[f"{LAYER}.weight_zero"].float()})
        ),
        "weight_zero is torch.float32, expected torch.bfloat16",
    ),
    "group_size disagrees": (
        lambda f: damage_config(f, group_size=32),
        "does quantization_config.group_size (32) match the tensors?",
    ),
    "wrong type in config": (
        lambda f: damage_config(f, dequant_threshold="2"),
        "quantization_config.dequant_threshold must be int, got '2'",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_checkpoint_fails_at_load_naming_the_problem(case, demo_quantized, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(demo_quantized, folder)
    damage, expected = CASES[case]
    damage(folder)
    proc = subprocess.run(
        [sys.executable, "-c", LOAD.format(path=str(folder))], capture_output=True, text=True, timeout=600
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "LOADED-AND-SERVING" not in output
    assert expected in output, output[-3000:]
    assert "SIGILL" not in output and "Segmentation fault" not in output


REPORT = """
from report import int4_memory_report
print("INT4-MODULES", sorted(llm.apply_model(int4_memory_report)[0]["modules"]))
"""


def test_the_control_loads_with_ignored_layers_and_unknown_keys(demo_model, tmp_path):
    """The same harness on an intact checkpoint serves; `ignore`d layers run unquantized, and an
    unknown config key is ignored with a warning."""
    from cpu_int4.quantize import quantize

    folder = tmp_path / "intact"
    quantize(str(demo_model), folder, ignore=["model.layers.0.mlp.down_proj", "re:layers\\.1\\.self_attn"])
    damage_config(folder, colour="blue")
    proc = subprocess.run(
        [sys.executable, "-c", LOAD.format(path=str(folder)) + REPORT],
        capture_output=True,
        text=True,
        timeout=600,
        env=WITH_REPORT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED-AND-SERVING" in proc.stdout
    assert "ignoring unknown quantization_config keys ['colour']" in proc.stdout + proc.stderr
    modules = proc.stdout.split("INT4-MODULES", 1)[1]
    assert "'model.layers.0.mlp.gate_up_proj'" in modules  # quantized: only down_proj was ignored
    assert "'model.layers.0.mlp.down_proj'" not in modules
    assert (
        "'model.layers.1.self_attn.qkv_proj'" not in modules
        and "'model.layers.1.self_attn.o_proj'" not in modules
    )
    assert "'model.layers.2.self_attn.qkv_proj'" in modules


def test_serves_on_pytorchs_kernel_when_the_native_one_is_off(demo_quantized):
    """The fallback (tinygemm, learned layout) still serves when the native kernel is unavailable."""
    modules = "llm.apply_model(int4_memory_report)[0]['modules'].values()"
    report = f"\nprint('BACKENDS', {{m['backend'] for m in {modules}}})"
    proc = subprocess.run(
        [sys.executable, "-c", LOAD.format(path=str(demo_quantized)) + REPORT + report],
        capture_output=True,
        text=True,
        timeout=600,
        env={**WITH_REPORT, "CPU_INT4_NATIVE": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "native kernels unavailable (turned off by CPU_INT4_NATIVE=0)" in proc.stdout + proc.stderr
    assert "BACKENDS {'tinygemm'}" in proc.stdout
    assert len(proc.stdout.split("LOADED-AND-SERVING", 1)[1].split("INT4-MODULES")[0].strip()) > 0


def test_float16_activations_are_refused(demo_quantized):
    code = f"from vllm import LLM\nLLM(model={str(demo_quantized)!r}, dtype='float16', enforce_eager=True)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "torch.float16 is not supported for quantization method cpu_int4" in proc.stdout + proc.stderr

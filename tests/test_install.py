"""`pip install` without the Makefile: the wheel, a fresh venv, `cpu-int4 doctor`, the native
kernels built on first use, and vLLM serving the demo model through the installed plugin."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from cpu_int4.doctor import write_vllm_alias

REPO = Path(__file__).resolve().parents[1]
SERVE = """
from vllm import LLM
import cpu_int4_vllm
print("PLUGIN", cpu_int4_vllm.__file__)
llm = LLM(model={model!r}, enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=1 << 28)
print("TEXT", repr(llm.generate(["The capital of France is"])[0].outputs[0].text))
"""


def test_the_alias_makes_vllm_metadata_answer(tmp_path):
    info = write_vllm_alias(tmp_path, "0.32.0+cpu")
    found = [d for d in metadata.distributions(path=[str(tmp_path)]) if d.metadata["Name"] == "vllm"]
    assert [d.version for d in found] == ["0.32.0+cpu"] and info.name == "vllm-0.32.0+cpu.dist-info"


@pytest.mark.vllm
@pytest.mark.slow
def test_wheel_in_a_fresh_venv_serves_the_demo_model(demo_quantized, tmp_path):
    run = dict(capture_output=True, text=True, check=True, timeout=900)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp_path / "dist",
            REPO,
        ],
        **run,
    )
    wheel = next((tmp_path / "dist").glob("cpu_int4-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], **run)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], **run)
    # The heavy packages (torch, vllm, transformers) come from the project's venv, after the
    # fresh venv's own site-packages; that venv's editable cpu-int4 is shadowed by the wheel.
    Path(site.stdout.strip(), "project_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], **run)
    env = {**os.environ, "CPU_INT4_CACHE": str(tmp_path / "cache")}

    doctor = subprocess.run([venv / "bin" / "cpu-int4", "doctor"], env=env, **run)
    assert "building the native kernels" in doctor.stderr  # first use, one line
    assert "FAIL" not in doctor.stdout and "native kernels: AVX" in doctor.stdout, doctor.stdout

    served = subprocess.run(
        [python, "-c", SERVE.format(model=str(demo_quantized))], env=env, **{**run, "check": False}
    )
    assert served.returncode == 0, served.stderr[-3000:]
    plugin = served.stdout.split("PLUGIN ", 1)[1].splitlines()[0]
    assert plugin.startswith(str(venv)), plugin  # the wheel's plugin, loaded by entry point
    assert "building the native kernels" not in served.stderr  # the cache held them
    assert "Paris" in served.stdout

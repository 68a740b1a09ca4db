"""test_layout.py again, with PyTorch's AVX2 kernels forced: the other packed layout.

ATEN_CPU_CAPABILITY selects the kernels PyTorch dispatches to, so one AVX-512 host checks both
the 64-row layout and the AVX2 one (32-row blocks, 16-row tail) that a hard-coded reader would
get wrong.
"""

import os
import subprocess
import sys
from pathlib import Path


def test_layout_tests_pass_under_avx2_dispatch():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    isa = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert isa.stdout.strip() == "AVX2"
    module = Path(__file__).with_name("test_layout.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout and "skipped" not in run.stdout

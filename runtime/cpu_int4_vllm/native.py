"""cpu_int4's own compiled kernels (int4_kernels.cpp): build them once, load them.

The decode GEMV keeps one SIMD lane per output row and streams its layout front to back, at
the memory's speed on 2 cores; with its min/max pass the quantizer runs ~6x a plain PyTorch
one (bench/quantize.py). `make install` builds the library (`python -m cpu_int4_vllm.native`);
when it is missing, stale, turned off (CPU_INT4_NATIVE=0) or fails to load, the runtime says
so once and uses the PyTorch paths.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_kernels.cpp")
LIBRARY = Path(__file__).with_name("_int4_kernels.so")
AVX512_BF16, AVX2 = 2, 1  # the kernel's isa argument


def build(output: Path = LIBRARY) -> Path:
    """Compile the kernel against the installed torch; the library appears only when complete."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        staged = Path(tmp) / output.name
        command = [
            os.environ.get("CXX", "g++"),
            "-O3",
            "-std=c++20",
            "-Wno-psabi",  # the SIMD helpers pass vectors between functions of one ISA only
            "-ffp-contract=off",  # the quantizer must round exactly as PyTorch does
            "-shared",
            "-fPIC",
            "-fopenmp",  # at::parallel_for runs on torch's own OpenMP pool (same libgomp soname)
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]),
            str(SOURCE),
            *(f"-L{p}" for p in library_paths()),
            "-lc10",
            "-ltorch_cpu",
            "-o",
            str(staged),
        ]
        subprocess.run(command, check=True)
        os.replace(staged, output)
    return output


def host_isa() -> int | None:
    """The kernel path this CPU runs: AVX-512 with BF16 dot products, else AVX2, else None.

    Follows PyTorch's capability (so ATEN_CPU_CAPABILITY=avx2 forces the AVX2 path here too).
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return AVX512_BF16 if torch.cpu.get_capabilities().get("avx512_bf16", False) else AVX2
    return AVX2 if capability == "AVX2" else None


def problem() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    if os.environ.get("CPU_INT4_NATIVE", "1") == "0":
        return "turned off by CPU_INT4_NATIVE=0"
    if host_isa() is None:
        return f"this CPU offers {torch.backends.cpu.get_cpu_capability()}, the kernel needs AVX2"
    if not LIBRARY.exists():
        return f"{LIBRARY.name} is not built (run `python -m cpu_int4_vllm.native`)"
    if LIBRARY.stat().st_mtime < SOURCE.stat().st_mtime:
        return f"{LIBRARY.name} is older than {SOURCE.name} (run `python -m cpu_int4_vllm.native`)"
    return None


@functools.lru_cache(maxsize=1)
def isa() -> int | None:
    """Load the kernel once per process; its isa argument, or None to use tinygemm."""
    reason = problem()
    if reason is None:
        try:
            torch.ops.load_library(str(LIBRARY))
        except OSError as err:
            reason = f"{LIBRARY.name} failed to load: {err}"
    if reason is not None:
        logger.warning("cpu_int4: native kernels unavailable (%s); using the PyTorch paths", reason)
        return None
    return host_isa()


@functools.lru_cache(maxsize=1)
def request_amx() -> None:
    """Ask Linux for AMX tile state for this process, where the CPU has AMX.

    vLLM's CPU attention uses AMX but leaves that request to oneDNN's first bf16 GEMM. When
    the int4 paths (either kernel, or the fp32 dense path) serve a short first request, no such
    GEMM runs and the attention died with SIGILL (DESIGN §2's "AMX hazard", reproduced here
    with both kernels).
    """
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


if __name__ == "__main__":
    try:
        print(f"built {build()}")
    except (subprocess.CalledProcessError, OSError) as err:
        # The runtime falls back to tinygemm; an install must not fail for want of a compiler.
        print(
            f"cpu_int4: native kernel not built ({err}); PyTorch's int4 kernel will be used", file=sys.stderr
        )

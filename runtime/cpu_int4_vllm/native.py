"""cpu_int4's own compiled kernels (int4_kernels.cpp): the ISA paths, building and loading them.

The library is built on first use into a per-user cache, keyed by the source, the torch it is
built against and the compiler, so an edited kernel or a new torch gets a fresh build and a
plain `pip install` needs no extra step (`python -m cpu_int4_vllm.native` builds it ahead,
as `make install` does). When it cannot be built or loaded, when the CPU lacks AVX2, or with
CPU_INT4_NATIVE=0, the runtime says why once and uses PyTorch's tinygemm kernel instead.
"""

from __future__ import annotations

import enum
import fcntl
import functools
import hashlib
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
AMX_ENV = "CPU_INT4_AMX"  # "0": large batches through a dequantized W^T and oneDNN, not amx_linear


class Isa(enum.IntEnum):
    """The kernel's code paths; the values are those of `enum class Isa` in int4_kernels.cpp."""

    AVX2 = 1  # AVX2 + FMA (Haswell on, Zen 1-3)
    AVX512_BF16 = 2  # AVX-512 with BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later)
    AVX512 = 3  # AVX-512F + BW without BF16 (Skylake-SP, Cascade Lake, Ice Lake)
    # Both AVX-512 paths run the same 16-lane GEMV (same bits as AVX2's 8 lanes). They differ in
    # the dequantize (a bf16 rounding instruction) and in AMX (native.amx).


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _command(output: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        _compiler(),
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
        str(output),
    ]


def cache_dir() -> Path:
    """Where built libraries live: $CPU_INT4_CACHE, else $XDG_CACHE_HOME/cpu-int4 (~/.cache)."""
    if os.environ.get("CPU_INT4_CACHE"):
        return Path(os.environ["CPU_INT4_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cpu-int4"


def library_path() -> Path:
    """The library for this source, torch and compiler (a change in any means a new build)."""
    return cache_dir() / f"int4_kernels-{_build_key()}.so"


@functools.cache
def _build_key() -> str:
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join(_command(Path("out"))).encode())
    key.update(torch.__version__.encode())
    return key.hexdigest()[:16]


def build(output: Path | None = None) -> Path:
    """Compile the kernels; the library appears only when complete, under a lock so that
    processes starting together (vLLM's workers) build it once."""
    output = output or library_path()
    if output.exists():
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if output.exists():
            return output  # another process built it while this one waited
        logger.warning("cpu_int4: building the native kernels into %s (once, ~15 s)", output)
        with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
            staged = Path(tmp) / output.name
            subprocess.run(_command(staged), check=True, capture_output=True, text=True)
            os.replace(staged, output)
    return output


def supported_isas() -> list[Isa]:
    """Every kernel path this CPU can run."""
    caps = torch.cpu.get_capabilities()
    paths = [Isa.AVX2] if caps.get("avx2") and caps.get("fma3") else []
    if caps.get("avx512_f") and caps.get("avx512_bw"):
        paths.append(Isa.AVX512)
        if caps.get("avx512_bf16"):
            paths.append(Isa.AVX512_BF16)
    return paths


def host_isa() -> Isa | None:
    """The kernel path to run: $CPU_INT4_ISA when set (avx2, avx512 or avx512_bf16: how tests
    and benchmarks run the other paths on one host), else the widest this CPU has.

    Follows PyTorch's capability, so ATEN_CPU_CAPABILITY=avx2 forces the AVX2 path too.
    """
    forced = os.environ.get("CPU_INT4_ISA")
    if forced:
        return Isa.__members__.get(forced.upper())
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return Isa.AVX512_BF16 if Isa.AVX512_BF16 in supported_isas() else Isa.AVX512
    return Isa.AVX2 if capability == "AVX2" else None


def problem() -> str | None:
    """Why the kernels cannot run here before any build is tried, or None."""
    if os.environ.get("CPU_INT4_NATIVE", "1") == "0":
        return "turned off by CPU_INT4_NATIVE=0"
    forced = os.environ.get("CPU_INT4_ISA")
    if forced and host_isa() is None:
        return f"CPU_INT4_ISA={forced} is not one of {', '.join(i.name.lower() for i in Isa)}"
    if forced and host_isa() not in supported_isas():
        return f"CPU_INT4_ISA={forced}: this CPU cannot run that path"
    if host_isa() is None:
        return f"this CPU offers {torch.backends.cpu.get_cpu_capability()}, the kernel needs AVX2"
    return None


@functools.lru_cache(maxsize=1)
def isa() -> Isa | None:
    """Build if needed and load the kernels once per process; the path to run, or None to use
    tinygemm."""
    reason = problem()
    if reason is None:
        try:
            torch.ops.load_library(str(build()))
        except subprocess.CalledProcessError as err:
            reason = f"the build failed: {(err.stderr or '').strip().splitlines()[-1:] or err}"
        except OSError as err:  # no compiler, a read-only cache, a library that does not load
            reason = f"cannot build or load them: {err}"
    if reason is not None:
        logger.warning("cpu_int4: native kernels unavailable (%s); using PyTorch's int4 kernel", reason)
        return None
    torch.ops.cpu_int4_native.set_gemv_threads(gemv_threads())
    return host_isa()


@functools.cache
def amx() -> bool:
    """Whether batches that the dense path takes in bf16 run on cpu_int4's AMX kernel, which
    dequantizes into tiles kept in L2 instead of a W^T for oneDNN: where the AVX-512 BF16 path
    runs on a CPU with AMX-BF16, unless CPU_INT4_AMX=0.

    512 rows x 11008 x 4096 on 2 Sapphire Rapids cores: ~20-22 ms, against 28-33 ms through a
    dequantized W^T and 22-25 ms for vLLM's oneDNN GEMM on prepacked bf16 weights
    (bench/prefill.py).
    """
    if os.environ.get(AMX_ENV, "1") == "0" or isa() != Isa.AVX512_BF16:
        return False
    request_amx()
    return torch.cpu._is_amx_tile_supported()


def gemv_threads() -> int:
    """Threads of the GEMV's own parallel region: $CPU_INT4_THREADS (0: torch's intra-op
    threads), else every core this process may run on.

    Torch's thread count in vLLM's worker depends on the setup (2 with `nobind` on 2 cores, 1
    under OMP_NUM_THREADS=1); its own region gives the GEMV every core either way (and, with
    per-rank core binding under TP, each rank its own). docs/runtime.md, "Threads", has the
    measurements.
    """
    return int(os.environ.get("CPU_INT4_THREADS", len(os.sched_getaffinity(0))))


@functools.lru_cache(maxsize=1)
def request_amx() -> None:
    """Ask Linux for AMX tile state for this process, where the CPU has AMX.

    vLLM's CPU attention uses AMX but leaves that request to oneDNN's first bf16 GEMM. When
    the int4 paths (either kernel, or the fp32 dense path) serve a short first request, no such
    GEMM runs and the attention died with SIGILL (docs/runtime.md, reproduced here with both
    kernels).
    """
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")
    try:
        target = library_path()
        target.unlink(missing_ok=True)  # `make kernel`: always a fresh build
        print(f"built {build(target)}")
    except (subprocess.CalledProcessError, OSError) as err:
        # The runtime falls back to tinygemm; an install must not fail for want of a compiler.
        detail = getattr(err, "stderr", "") or err
        print(
            f"cpu_int4: native kernels not built ({detail}); PyTorch's int4 kernel will be used",
            file=sys.stderr,
        )

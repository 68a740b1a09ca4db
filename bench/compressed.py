"""The stock-vLLM peer: a compressed-tensors W4A16 checkpoint (int4, asymmetric, group 64,
`pack-quantized`) of the same bf16 weights, written with the installed `compressed_tensors`
package's own quantizer and compressor, as llm-compressor's RTN export would be.

    .venv/bin/python bench/compressed.py BF16_DIR OUT_DIR

vLLM serves it through its CPUWNA16 kernel, which is built for AVX-512 only: on AVX2 hosts the
first forward pass fails (DESIGN.md section 3).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import save_file

GROUP = 64
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def scheme() -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP)
    return QuantizationScheme(targets=["Linear"], weights=args)


def compress_weight(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight_packed / weight_scale / weight_zero_point / weight_shape of one linear's weight."""
    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme().weights)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
    return PackedQuantizationCompressor.compress(state, scheme())


def write_compressed(source: Path, out: Path) -> Path:
    """OUT: SOURCE's checkpoint with every decoder linear as compressed-tensors W4A16 (once)."""
    if (out / "config.json").is_file():
        return out
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    index = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors = {}
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                tensor = f.get_tensor(name)
                module, _, leaf = name.rpartition(".")
                if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
                    tensors.update({f"{module}.{k}": v for k, v in compress_weight(tensor).items()})
                else:
                    tensors[name] = tensor
        save_file(tensors, staging / shard.name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, shard.name))
    (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    for extra in source.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy(extra, staging / extra.name)
    config = json.loads((source / "config.json").read_text())
    quant = QuantizationConfig(
        config_groups={"group_0": scheme()},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    config["quantization_config"] = quant.model_dump(exclude_none=True)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(write_compressed(args.source, args.out))

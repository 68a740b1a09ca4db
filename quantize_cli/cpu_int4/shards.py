"""Writing safetensors shards in a stream: headers first, tensor bytes as they are produced.

Every output tensor's name, dtype and shape is known from the plan before any weight is read,
so each shard's header is written up front and each tensor's bytes go to their final offset
(`os.pwrite`). Memory stays bounded by what is being quantized now, not by the shard size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from cpu_int4_vllm.format import TensorSpec

from .checkpoint import INDEX_NAME


@dataclass(frozen=True)
class _Slot:
    file: Path
    offset: int  # absolute byte offset of the tensor's data in its file
    nbytes: int


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a plain byte count -> bytes."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    number = text.strip().upper().rstrip()
    for unit in sorted(units, key=len, reverse=True):
        if unit and number.endswith(unit):
            value, scale = number[: -len(unit)], units[unit]
            break
    else:
        value, scale = number, 1
    try:
        size = int(float(value) * scale)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 5GB, 500MB)") from None
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


class ShardWriter:
    """Lays out shards for a known set of tensors and writes each tensor's bytes into place."""

    def __init__(self, directory: Path, tensors: list[TensorSpec], max_shard_size: int):
        groups = _split(tensors, max_shard_size)
        count = len(groups)
        self.slots: dict[str, _Slot] = {}
        self.weight_map: dict[str, str] = {}
        self.total_size = sum(t.nbytes for t in tensors)
        self.files: list[Path] = []
        for i, group in enumerate(groups):
            name = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path = directory / name
            self._layout(path, group)
            self.files.append(path)
        self._fds = {path: os.open(path, os.O_WRONLY) for path in self.files}

    def _layout(self, path: Path, group: list[TensorSpec]) -> None:
        # Largest items first keeps every tensor aligned to its element size.
        group = sorted(group, key=lambda t: -t.torch_dtype.itemsize)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in group:
            header[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        start = 8 + len(blob)
        with open(path, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            f.truncate(start + offset)
        for t in group:
            begin = header[t.name]["data_offsets"][0]
            self.slots[t.name] = _Slot(path, start + begin, t.nbytes)
            self.weight_map[t.name] = path.name

    def write(self, name: str, tensor: torch.Tensor, byte_offset: int = 0) -> None:
        """Write a tensor (or a row range of it, starting `byte_offset` bytes in) into place."""
        slot = self.slots[name]
        data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
        if byte_offset + data.nbytes > slot.nbytes:
            raise ValueError(f"{name}: write past the end of its slot")
        fd = self._fds[slot.file]
        view = memoryview(data)
        written = 0
        while written < data.nbytes:
            written += os.pwrite(fd, view[written:], slot.offset + byte_offset + written)

    def close(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds = {}

    def write_index(self, directory: Path) -> None:
        """The HF index, needed only when there is more than one shard."""
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total_size},
                "weight_map": dict(sorted(self.weight_map.items())),
            }
            (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _split(tensors: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups

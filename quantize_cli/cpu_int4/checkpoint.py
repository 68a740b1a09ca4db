"""Reading a Hugging Face checkpoint: resolving MODEL, validating its files, listing its tensors."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from cpu_int4_vllm.format import TensorSpec
from safetensors import safe_open

from .errors import QuantizeError

INDEX_NAME = "model.safetensors.index.json"
# Weight files of any framework: never copied into the output (ours replace them).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")

FLOAT_DTYPES = {"BF16", "F16", "F32"}
# Integer buffers (position ids, masks) are carried over untouched; anything else (fp8, int8, ...)
# means the checkpoint is already quantized or is something this tool cannot read correctly.
CARRIED_DTYPES = {"I64", "I32", "BOOL"}


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    """One tensor of the source checkpoint, as its safetensors header describes it."""

    file: Path = Path()
    offset: int = 0  # absolute byte offset of the data in its file


@dataclass(frozen=True)
class Checkpoint:
    """A local checkpoint directory: its config and every tensor in its safetensors files."""

    path: Path
    config: dict
    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)


def resolve_model(model: str) -> Path:
    """Turn the MODEL argument into a local checkpoint directory."""
    path = Path(model).expanduser()
    if not path.exists():
        raise QuantizeError(f"MODEL {model} does not exist")
    if not path.is_dir():
        raise QuantizeError(f"MODEL {model} is not a directory")
    return path.resolve()


def open_checkpoint(path: Path) -> Checkpoint:
    """Read config.json and every safetensors header; refuse what cannot be quantized correctly."""
    config = _read_config(path)
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "unknown")
        raise QuantizeError(f"{path} is already quantized (quant_method={method}); start from the bf16 model")
    tensors = tuple(t for f in _weight_files(path) for t in _read_header(f))
    if not tensors:
        raise QuantizeError(f"{path} has safetensors files but no tensors in them")
    for t in tensors:
        if t.dtype not in FLOAT_DTYPES and t.dtype not in CARRIED_DTYPES:
            raise QuantizeError(
                f"tensor {t.name} has unsupported dtype {t.dtype}; expected bf16, fp16 or fp32"
            )
    return Checkpoint(path, config, tensors)


def _read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise QuantizeError(f"{path} has no config.json; is it a Hugging Face checkpoint?")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QuantizeError(f"{config_file} is not valid JSON: {err}") from err


def _weight_files(path: Path) -> list[Path]:
    index_file = path / INDEX_NAME
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise QuantizeError(f"{index_file} is not a valid safetensors index: {err}") from err
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise QuantizeError(f"{index_file.name} names shard {f.name}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise QuantizeError(
            f"{path} has only PyTorch pickle weights; convert them to safetensors first "
            "(AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir))"
        )
    raise QuantizeError(f"{path} has no *.safetensors weight files")


def _read_header(file: Path) -> list[TensorInfo]:
    # safe_open validates the file (header, offsets, size) the way every loader will.
    try:
        with safe_open(file, framework="pt"):
            pass
    except Exception as err:  # safetensors raises its own types for truncated or garbled files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise QuantizeError(f"{file.name} is not a readable safetensors file ({reason})") from err
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return [
        TensorInfo(name, meta["dtype"], tuple(meta["shape"]), file, 8 + length + meta["data_offsets"][0])
        for name, meta in header.items()
    ]


class TensorReader:
    """Reads tensors, or row ranges of them, with pread: no memory map, so pages already read do
    not stay in the process (with mmap, RSS grew to the checkpoint's size)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def rows(self, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor, read without touching the rest."""
        row_bytes = info.nbytes // info.shape[0]
        data = self.raw(info, start * row_bytes, (stop - start) * row_bytes)
        return data.view(info.torch_dtype).reshape(stop - start, *info.shape[1:])

    def raw(self, info: TensorInfo, begin: int, size: int) -> torch.Tensor:
        """`size` bytes of a tensor's data from byte `begin`, as uint8."""
        if info.file not in self._fds:
            self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        buffer = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        done = 0
        while done < size:
            got = os.preadv(self._fds[info.file], [view[done:]], info.offset + begin + done)
            if got == 0:
                raise QuantizeError(f"{info.file.name} ended early while reading {info.name}")
            done += got
        return buffer

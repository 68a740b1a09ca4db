"""The quantize flow: resolve -> plan -> quantize and write (streaming) -> move into place."""

from __future__ import annotations

import json
import shutil
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from cpu_int4_vllm.format import DEFAULT_GROUP_SIZE, DEFAULT_METHOD, GROUP_SIZES, format_config

from .card import write_card
from .checkpoint import (
    INDEX_NAME,
    WEIGHT_SUFFIXES,
    Checkpoint,
    TensorReader,
    open_checkpoint,
    resolve_model,
)
from .errors import QuantizeError
from .hub import download, looks_like_hub_id, push
from .methods import METHODS, NonFiniteWeights
from .outdir import OutputDir
from .plan import LayerChoice, Plan, compile_patterns, input_norm, make_plan, norm_offset
from .shards import ShardWriter, parse_size
from .summary import Summary

# Rows are quantized in slices of about this many fp32 bytes, so memory does not grow with
# the largest tensor (a 49152 x 4096 vocab table would be 0.8 GB in fp32 at once).
SLICE_BYTES = 32 * 2**20
READ_AHEAD = 2  # slices read before they are needed
WRITE_BEHIND = 2  # slices whose outputs may still be waiting to be written
DEFAULT_SHARD_SIZE = "5GB"
# Everything else of the source is copied, sub-folders too (a sentence-transformers model's
# 1_Pooling/ decides how vLLM pools); these are rewritten, and the README becomes our card.
REWRITTEN_FILES = {"config.json", INDEX_NAME, "README.md"}

Progress = Callable[[int, int], None]  # (source bytes just processed, total source bytes)


def quantize(
    model: str,
    out: str | Path,
    group_size: int = DEFAULT_GROUP_SIZE,
    ignore: list[str] | None = None,
    quantize_embedding: bool = True,
    method: str = DEFAULT_METHOD,
    tp: int = 1,
    max_shard_size: str = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    dry_run: bool = False,
    revision: str | None = None,
    push_to_hub: str | None = None,
    private: bool = False,
    command: str | None = None,
    progress: Progress | None = None,
) -> Summary:
    """Quantize the checkpoint MODEL (a local folder or a Hub id) into OUT in the cpu_int4 format,
    write its model card, and push it to the Hub when asked; returns a summary."""
    start = time.perf_counter()
    if method not in METHODS:
        raise QuantizeError(f"unknown method {method!r}; use one of {sorted(METHODS)}")
    if group_size not in GROUP_SIZES:
        raise QuantizeError(f"group size {group_size} is not supported; use one of {list(GROUP_SIZES)}")
    compile_patterns(ignore or [])
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as err:
        raise QuantizeError(f"--max-shard-size: {err}") from err
    base_model = model if looks_like_hub_id(model) else None
    source = None if base_model else resolve_model(model)
    out_dir = OutputDir(Path(out), overwrite, source)  # checked before a possibly long download
    if base_model:
        source = download(model, revision)
        out_dir.check_outside(source)
    ckpt = open_checkpoint(source)
    plan = make_plan(ckpt, group_size, ignore, quantize_embedding, tp)
    summary = Summary(
        source, out_dir.path, plan, ckpt.nbytes, plan.output_bytes(), ckpt.params, method, dry_run=dry_run
    )
    if dry_run:
        return summary
    with out_dir.staging() as tmp:
        _write_weights(ckpt, plan, tmp, shard_bytes, METHODS[method], progress)
        _write_config(ckpt, plan, method, tmp)
        summary.copied_files = _copy_support_files(source, tmp)
        write_card(tmp, summary, base_model, command or f"cpu-int4 quantize {model} {out}", push_to_hub)
    summary.seconds = time.perf_counter() - start
    if push_to_hub:
        try:
            summary.url = push(out_dir.path, push_to_hub, private=private)
        except QuantizeError as err:
            raise QuantizeError(f"wrote {out_dir.path}, but pushing it failed: {err}") from err
    return summary


@dataclass(frozen=True)
class _Slice:
    """Rows start:stop of one source tensor, and what to do with them."""

    choice: LayerChoice
    start: int
    stop: int


def _slices(plan: Plan) -> list[_Slice]:
    """The work in order: every kept or quantized tensor cut into slices of ~SLICE_BYTES."""
    slices = []
    for c in plan.choices:
        if c.action not in ("quantize", "keep"):
            continue
        if c.action == "quantize":
            n, k = c.info.shape
            step = max(1, SLICE_BYTES // (4 * k))  # fp32 bytes: the torch methods widen rows to fp32
        else:
            n, step = c.info.nbytes, SLICE_BYTES  # kept tensors are copied as bytes
        slices += [_Slice(c, start, min(n, start + step)) for start in range(0, n, step)]
    return slices


def _write_weights(
    ckpt: Checkpoint, plan: Plan, tmp: Path, shard_bytes: int, method, progress: Progress | None
) -> None:
    """Read ahead on one thread, quantize here, write behind on another: disk and CPU overlap.

    At most READ_AHEAD slices are read and WRITE_BEHIND slices' outputs pending, so memory stays
    flat in model size.
    """
    writer = ShardWriter(tmp, plan.output_tensors(), shard_bytes)
    by_name = {t.name: t for t in ckpt.tensors}
    names = set(by_name)
    offset = norm_offset(ckpt.config)
    slices = _slices(plan)
    try:
        with TensorReader() as reader, ThreadPoolExecutor(1) as reads, ThreadPoolExecutor(1) as writes:
            gains: dict[str, torch.Tensor] = {}  # touched by the read thread only

            def read(piece: _Slice) -> tuple[torch.Tensor, torch.Tensor | None]:
                """A slice's source bytes or rows, and its layer's input-channel importance."""
                c = piece.choice
                if c.action == "keep":
                    return reader.raw(c.info, piece.start, piece.stop - piece.start), None
                norm = input_norm(c.module, plan.tied, names)
                if norm is None:
                    return reader.rows(c.info, piece.start, piece.stop), None
                if norm not in gains:
                    gains[norm] = reader.rows(by_name[norm], 0, by_name[norm].shape[0])
                # An input channel's importance is its squared RMSNorm gain.
                channel = (gains[norm].float() + offset) ** 2
                return reader.rows(c.info, piece.start, piece.stop), channel

            ahead = deque(reads.submit(read, piece) for piece in slices[:READ_AHEAD])
            behind: deque = deque()
            for i, piece in enumerate(slices):
                data, channel = ahead.popleft().result()
                if i + READ_AHEAD < len(slices):
                    ahead.append(reads.submit(read, slices[i + READ_AHEAD]))
                c = piece.choice
                if c.action == "keep":
                    outputs = [(c.info.name, data, piece.start)]
                else:
                    outputs = _quantize_slice(plan, c, piece.start, data, method, channel)
                behind.append(writes.submit(_write_all, writer, outputs))
                while len(behind) > WRITE_BEHIND:
                    behind.popleft().result()
                if progress:
                    row_bytes = 1 if c.action == "keep" else c.info.nbytes // c.info.shape[0]
                    progress((piece.stop - piece.start) * row_bytes, ckpt.nbytes)
            for pending in behind:
                pending.result()
    finally:
        writer.close()
    writer.write_index(tmp)


def _write_all(writer: ShardWriter, outputs: list[tuple[str, torch.Tensor, int]]) -> None:
    for name, tensor, byte_offset in outputs:
        writer.write(name, tensor, byte_offset)


def _quantize_slice(
    plan: Plan,
    c: LayerChoice,
    start: int,
    rows: torch.Tensor,
    method,
    channel_importance: torch.Tensor | None,
) -> list[tuple[str, torch.Tensor, int]]:
    """The three output tensors' rows for source rows start:..., with their byte offsets."""
    try:
        tensors = method(rows, plan.group_size, channel_importance)
    except NonFiniteWeights as err:
        raise QuantizeError(f"tensor {c.info.name} contains NaN or Inf; refusing to quantize it") from err
    return [(spec.name, t, start * spec.row_bytes) for spec, t in zip(plan.outputs(c), tensors, strict=True)]


def _write_config(ckpt: Checkpoint, plan: Plan, method: str, tmp: Path) -> None:
    config = dict(ckpt.config)
    config["quantization_config"] = format_config(
        method, plan.group_size, plan.ignore, plan.quantize_embedding
    )
    # The runtime offers bf16 activations only (the kernel's fp32 path is ~30x slower).
    dtype_keys = [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]
    for key in dtype_keys:
        config[key] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _copy_support_files(source: Path, tmp: Path) -> list[str]:
    """Copy every file and folder of the source but its weights and what we rewrite; returns
    the top-level names copied. Hidden entries (.git, .cache) are not part of the model."""

    def skipped(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == source
        return {
            n
            for n in names
            if n.startswith(".") or n.endswith(WEIGHT_SUFFIXES) or (top and n in REWRITTEN_FILES)
        }

    entries = sorted(source.iterdir())
    skip = skipped(str(source), [e.name for e in entries])
    copied = []
    for entry in (e for e in entries if e.name not in skip):
        if entry.is_dir():
            shutil.copytree(entry, tmp / entry.name, ignore=skipped)
            copied.append(entry.name + "/")
        else:
            shutil.copy2(entry, tmp / entry.name)
            copied.append(entry.name)
    return copied

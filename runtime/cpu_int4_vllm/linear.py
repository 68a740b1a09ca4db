"""The linear method: vLLM parameters for the three checkpoint tensors, the int4 linear to run.

The kernel work is a backend's (native_backend.py, or tinygemm_backend.py where the native
kernels cannot run), chosen once per process.
"""

from __future__ import annotations

import functools

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from . import native, native_backend, tinygemm_backend
from .format import PACKED_SUFFIX, QUANTIZED_SUFFIXES, quantized_tensors, shape_problem
from .huge_pages import in_huge_pages


@functools.cache
def backend():
    """The backend module for this process: the native kernels when they run here."""
    return native_backend if native.isa() is not None else tinygemm_backend


def create_int4_weights(
    layer,
    config,
    input_size_per_partition: int,
    output_size_per_partition: int,
    input_size: int,
    output_size: int,
    weight_loader,
) -> None:
    """Register weight_packed / weight_scale / weight_zero as vLLM parameters (sharded by vLLM)."""
    n, k, g = output_size_per_partition, input_size_per_partition, config.group_size
    problem = shape_problem(n, k, g)
    if problem and (n, k) != (output_size, input_size):
        # This rank's share breaks a rule that the whole layer keeps: the tensor-parallel split.
        tp = max(output_size // n, input_size // k)
        split = f"K={input_size}" if k != input_size else f"N={output_size}"
        problem = f"{split} over tp={tp}: {problem}; requantize with `cpu-int4 quantize --tp {tp}`"
    if problem:
        raise ValueError(f"cpu_int4: layer {getattr(layer, 'prefix', '')} cannot be int4 here: {problem}")
    layer.int4_loaded_shards = {}  # tensor name -> shard ids loaded, to catch a missing tensor
    layer.int4_weight_shape = (n, k)
    # This rank's share, and the whole tensor's columns that the checkpoint must have.
    shares = quantized_tensors("", n, k, g)
    whole = quantized_tensors("", n, input_size, g)
    for share, full in zip(shares, whole, strict=True):
        name = share.name.lstrip(".")
        loader = _checked(layer, name, weight_loader, share.torch_dtype, full.shape[1], config)
        data = torch.empty(share.shape, dtype=share.torch_dtype)
        if name == PACKED_SUFFIX:
            param = PackedvLLMParameter(
                data=data, input_dim=1, output_dim=0, packed_factor=2, packed_dim=1, weight_loader=loader
            )
        else:
            param = GroupQuantScaleParameter(data=data, input_dim=1, output_dim=0, weight_loader=loader)
        layer.register_parameter(name, param)


def _checked(layer, name: str, loader, dtype: torch.dtype, columns: int, config):
    """Wrap vLLM's loader so a damaged checkpoint fails naming the tensor, not in an assert or kernel."""
    where = f"{getattr(layer, 'prefix', '') or 'layer'}.{name}"

    def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
        if loaded_weight.dtype != dtype:
            raise ValueError(f"cpu_int4: {where} is {loaded_weight.dtype}, expected {dtype}")
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != columns:
            hint = ""
            if name != PACKED_SUFFIX:
                hint = f"; does quantization_config.group_size ({config.group_size}) match the tensors?"
            raise ValueError(
                f"cpu_int4: {where} has shape {tuple(loaded_weight.shape)}, expected {columns} columns{hint}"
            )
        shard = args[0] if args else kwargs.get("loaded_shard_id")
        layer.int4_loaded_shards.setdefault(name, set()).add(shard)
        try:
            return loader(param, loaded_weight, *args, **kwargs)
        except AssertionError as err:
            shapes = f"{tuple(loaded_weight.shape)}, which does not fit {tuple(param.shape)}"
            raise ValueError(f"cpu_int4: {where} has shape {shapes}") from err

    return load


def check_all_loaded(layer, config) -> None:
    """Raise naming the checkpoint tensor if the checkpoint lacked one of this layer's tensors.

    vLLM counts a fused parameter as loaded once any shard arrived, so a missing
    `k_proj.weight_scale` would otherwise leave uninitialized memory in the fused qkv layer.
    """
    shards = max(1, len(getattr(layer, "output_partition_sizes", [None])))
    where = getattr(layer, "prefix", "") or "layer"
    for name in QUANTIZED_SUFFIXES:
        loaded = layer.int4_loaded_shards.get(name, set())
        if None in loaded or len(loaded) == shards:
            continue
        # Shard ids are "q"/"k"/"v" for attention, 0, 1, ... for other fused layers.
        got = {"qkv".index(s) if isinstance(s, str) else int(s) for s in loaded}
        missing = min(set(range(shards)) - got)
        parent, _, fused = where.rpartition(".")
        parts = config.packed_modules_mapping.get(fused, [])
        source = f"{parent}.{parts[missing]}" if len(parts) == shards else f"{where} (part {missing})"
        raise ValueError(f"cpu_int4: {source}.{name} is missing from the checkpoint")


def build_kernel_weights(layer, config, keep_rowmajor_for_lookup: bool = False) -> None:
    """Replace the checkpoint tensors by the backend's; the row-major ones stay only if needed."""
    check_all_loaded(layer, config)
    native.request_amx()
    tensors = backend().prepare(
        layer.weight_packed.data, layer.weight_scale.data, layer.weight_zero.data, config
    )
    for name, tensor in tensors.items():
        if tensor is not None:
            tensor = torch.nn.Parameter(in_huge_pages(tensor), requires_grad=False)
        setattr(layer, name, tensor)
    # The module itself, read in apply_int4: a plain attribute that torch.compile traces through
    # (calling backend() there made Dynamo trace into the kernel loading).
    layer.int4_backend = backend()
    del layer.int4_loaded_shards
    if keep_rowmajor_for_lookup:
        return
    for name in QUANTIZED_SUFFIXES:
        delattr(layer, name)


def apply_int4(layer, config, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) on this process's backend."""
    out = layer.int4_backend.linear(x.to(torch.bfloat16), layer, config)
    return out if bias is None else out + bias


@register_weight_loader_v2_supported_method
class CpuInt4LinearMethod(LinearMethodBase):
    """Linear layers stored as 4-bit codes with per-group bf16 scale and zero."""

    def __init__(self, config):
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        create_int4_weights(
            layer,
            self.config,
            input_size_per_partition,
            sum(output_partition_sizes),
            input_size,
            output_size,
            extra_weight_attrs["weight_loader"],
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        build_kernel_weights(layer, self.config)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return apply_int4(layer, self.config, x, bias)

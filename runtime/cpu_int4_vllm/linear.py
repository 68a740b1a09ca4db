"""The linear method: vLLM parameters for the three checkpoint tensors, the int4 linear to run."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from . import native
from .format import PACKED_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX, shape_problem
from .kernels import int4_linear, int4_linear_op, native_linear, native_linear_op, prepare_kernel_weights
from .native_layout import pack_native


def create_int4_weights(
    layer,
    config,
    input_size_per_partition: int,
    output_size_per_partition: int,
    input_size: int,
    weight_loader,
) -> None:
    """Register weight_packed / weight_scale / weight_zero as vLLM parameters (sharded by vLLM)."""
    n, k, g = output_size_per_partition, input_size_per_partition, config.group_size
    problem = shape_problem(n, k, g)
    if problem:
        raise ValueError(f"cpu_int4: layer {getattr(layer, 'prefix', '')} cannot be int4 here: {problem}")
    layer.int4_loaded_shards = {}  # tensor name -> shard ids loaded, to catch a missing tensor
    layer.int4_weight_shape = (n, k)
    packed = PackedvLLMParameter(
        data=torch.empty(n, k // 2, dtype=torch.uint8),
        input_dim=1,
        output_dim=0,
        packed_factor=2,
        packed_dim=1,
        weight_loader=_checked(layer, PACKED_SUFFIX, weight_loader, torch.uint8, input_size // 2, config),
    )
    layer.register_parameter(PACKED_SUFFIX, packed)
    for name in (SCALE_SUFFIX, ZERO_SUFFIX):
        param = GroupQuantScaleParameter(
            data=torch.empty(n, k // g, dtype=torch.bfloat16),
            input_dim=1,
            output_dim=0,
            weight_loader=_checked(layer, name, weight_loader, torch.bfloat16, input_size // g, config),
        )
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


def check_all_loaded(layer) -> None:
    """Raise naming the tensor if the checkpoint lacked one of this layer's tensors (or shards).

    vLLM counts a fused parameter as loaded once any shard arrived, so a missing
    `k_proj.weight_scale` would otherwise leave uninitialized memory in the fused qkv layer.
    """
    shards = max(1, len(getattr(layer, "output_partition_sizes", [None])))
    where = getattr(layer, "prefix", "") or "layer"
    for name in (PACKED_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX):
        loaded = layer.int4_loaded_shards.get(name, set())
        if None not in loaded and len(loaded) < shards:
            got = sorted(map(str, loaded))
            raise ValueError(
                f"cpu_int4: {where}.{name} is missing from the checkpoint (shards {got} of {shards})"
            )


def build_kernel_weights(layer, config, keep_rowmajor_for_lookup: bool = False) -> None:
    """Replace the checkpoint tensors by the kernel's; the row-major ones stay only if needed."""
    check_all_loaded(layer)
    packed, scale, zero = layer.weight_packed.data, layer.weight_scale.data, layer.weight_zero.data
    native.request_amx()
    layer.int4_native = native.isa() is not None
    if layer.int4_native:
        kernel_packed, scales_and_zeros = pack_native(packed, scale, zero)
        rowmajor = None  # the native layout is ours: nothing to distrust
    else:
        kernel_packed, scales_and_zeros, rowmajor = prepare_kernel_weights(
            packed, scale, zero, config.direct_dequant
        )
    layer.int4_packed = torch.nn.Parameter(kernel_packed, requires_grad=False)
    layer.scales_and_zeros = torch.nn.Parameter(scales_and_zeros, requires_grad=False)
    layer.int4_rowmajor = None if rowmajor is None else torch.nn.Parameter(rowmajor, requires_grad=False)
    del layer.int4_loaded_shards
    if keep_rowmajor_for_lookup:
        return
    for name in (PACKED_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX):
        delattr(layer, name)


def apply_int4(layer, config, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) through the custom op (or the plain function when use_custom_op is off)."""
    if layer.int4_native:
        fn = native_linear_op if config.use_custom_op else native_linear
        out = fn(x.to(torch.bfloat16), layer.int4_packed, layer.scales_and_zeros, config.group_size)
        return out if bias is None else out + bias
    fn = int4_linear_op if config.use_custom_op else int4_linear
    out = fn(
        x.to(torch.bfloat16),
        layer.int4_packed,
        layer.scales_and_zeros,
        config.group_size,
        config.dequant_threshold,
        layer.int4_rowmajor,
    )
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
            extra_weight_attrs["weight_loader"],
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        build_kernel_weights(layer, self.config)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return apply_int4(layer, self.config, x, bias)

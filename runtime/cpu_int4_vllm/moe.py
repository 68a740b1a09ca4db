"""The mixture-of-experts method: every expert int4, run through the linears' backend.

vLLM loads the per-expert checkpoint tensors (`experts.E.gate_proj.weight_packed`, ...) into
stacked parameters (`w13_weight_packed` [E, 2I, H/2], `w2_weight_scale` [E, H, I/g], ...). After
loading, each expert becomes the backend's kernel tensors, like a linear layer's, and the
stacked checkpoint copies go: experts stay int4 in memory.

A forward groups the batch's (token, expert) pairs by expert and runs only the experts chosen,
each through the backend's `linear`: the int4 kernel for a few rows (decode reads only the active
experts' weights), dequantize + dense GEMM for many (prefill). Decode's batches take all of it in
one native call (`native_backend.silu_experts`) where the experts allow.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation, apply_moe_activation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.utils import set_weight_attrs

from . import native
from .config import through_op
from .format import PACKED_SUFFIX, QUANTIZED_SUFFIXES, quantized_tensors, shape_problem
from .huge_pages import in_huge_pages
from .linear import backend
from .native_backend import MAX_KERNEL_ROWS


class CpuInt4MoEMethod(FusedMoEMethodBase):
    """Experts stored as 4-bit codes with per-group bf16 scale and zero, one set per expert."""

    def __init__(self, config, moe):
        super().__init__(moe)
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        h, i, g = hidden_size, intermediate_size_per_partition, self.config.group_size
        _check_supported(layer.layer_name, self.moe, h, i, g)
        layer.int4_loaded = {}  # parameter -> {(expert, shard id)} loaded, to catch a missing tensor
        loader = _checked(layer, extra_weight_attrs.pop("weight_loader"))
        for stem, n, k, columns_k in (
            ("w13", self.moe.w13_num_shards * i, h, h),
            ("w2", h, i, self.moe.intermediate_size),
        ):
            shares = quantized_tensors("", n, k, g)
            whole = quantized_tensors("", n, columns_k, g)  # the checkpoint's columns (w2 splits K)
            for share, full in zip(shares, whole, strict=True):
                suffix = share.name.lstrip(".")
                param = torch.nn.Parameter(
                    torch.empty(num_experts, *share.shape, dtype=share.torch_dtype), requires_grad=False
                )
                name = f"{stem}_{suffix}"
                layer.register_parameter(name, param)
                set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": loader})
                # What vLLM's expert loader needs to split scales and zeros like the codes.
                set_weight_attrs(param, {"int4_columns": full.shape[1]})
                if suffix != PACKED_SUFFIX:
                    set_weight_attrs(param, {"quant_method": FusedMoeWeightScaleSupported.GROUP.value})

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _check_all_loaded(layer, self.moe)
        native.request_amx()
        for stem in ("w13", "w2"):
            checkpoint = [getattr(layer, f"{stem}_{suffix}").data for suffix in QUANTIZED_SUFFIXES]
            for suffix in QUANTIZED_SUFFIXES:
                delattr(layer, f"{stem}_{suffix}")
            stacked = _kernel_experts(*checkpoint, self.config)
            del checkpoint
            # Registered: the layer's weights are its parameters, for vLLM and memory reports.
            for key, tensor in stacked.items():
                if tensor is not None:
                    layer.register_parameter(f"{stem}_{key}", torch.nn.Parameter(tensor, requires_grad=False))
            setattr(layer, f"int4_{stem}", SimpleNamespace(**stacked))
        layer.int4_backend = backend()
        # What decides whether decode's batches can take one native call; fixed per layer.
        layer.int4_silu_experts = (
            hasattr(layer.int4_backend, "silu_experts")
            and layer.activation == MoEActivation.SILU
            and layer.moe_config.is_act_and_mul
            and not layer.apply_router_weight_on_input
        )
        del layer.int4_loaded
        _LAYERS[layer.layer_name] = layer

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # no vLLM MoE kernel runs these experts

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts,
        shared_experts_input,
    ) -> torch.Tensor:
        # Shared experts, where the model has them, are run by vLLM's MoE runner.
        forward = experts_op if through_op(self.config) else experts_forward
        return forward(x, topk_weights, topk_ids, layer.layer_name)


# Each process's int4 expert layers by name, for the custom op below (the pattern of vLLM's own
# MoE op): an op takes tensors and plain values, not modules.
_LAYERS: dict[str, torch.nn.Module] = {}


def experts_forward(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str
) -> torch.Tensor:
    """The routed experts of layer `layer_name` on bf16 x [T, H] (run_experts)."""
    layer = _LAYERS[layer_name]
    config = layer.quant_method.config
    if _in_one_native_call(layer, topk_ids):
        return layer.int4_backend.silu_experts(
            x, topk_weights, topk_ids, layer.int4_w13, layer.int4_w2, config
        )
    return run_experts(
        x,
        topk_weights,
        topk_ids,
        layer.int4_w13,
        layer.int4_w2,
        lambda rows, experts, groups: layer.int4_backend.grouped_linear(rows, experts, groups, config),
        layer.activation,
        layer.moe_config.is_act_and_mul,
        layer.apply_router_weight_on_input,
    )


def _in_one_native_call(layer, topk_ids: torch.Tensor) -> bool:
    """Whether the native backend runs this batch's experts in one call: SiLU-gated experts, the
    router's weight on the output (layer.int4_silu_experts), and few enough (token, expert) pairs
    that every expert takes the kernel (decode). run_experts' ops and Python took 7% of a token
    on the MoE benchmark."""
    return layer.int4_silu_experts and topk_ids.numel() < MAX_KERNEL_ROWS


# experts_forward as an opaque op: vLLM's compiled mode traced into it and stopped at the
# data-dependent grouping ("Could not guard on data-dependent expression").
experts_op = torch.library.custom_op("cpu_int4::experts", experts_forward, mutates_args=())


@experts_op.register_fake
def _(x, topk_weights, topk_ids, layer_name):
    return torch.empty_like(x)


def run_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13,
    w2,
    grouped_linear,
    activation,
    gated: bool = True,
    weight_on_input: bool = False,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), for bf16 x [T, H].

    The (token, expert) pairs are sorted by expert, so each expert's rows are adjacent; then
    `grouped_linear(rows, w13, groups)` multiplies every row by its expert's w13 at once
    (groups: (expert, first row, rows) of each expert chosen), the activation runs on all rows,
    and likewise w2. Products are weighted and summed in fp32, as vLLM's own CPU MoE does.
    """
    tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # pair i of the sorted rows is (token, k) pair order[i]
    token_of = order // top_k
    groups, start = [], 0
    for expert, count in enumerate(torch.bincount(flat).tolist()):
        if count:
            groups.append((expert, start, count))
            start += count
    weights = topk_weights.flatten().index_select(0, order).float()[:, None]
    inputs = x.index_select(0, token_of)
    if weight_on_input:  # the router's weight scales the input instead of the output
        inputs = (inputs.float() * weights).to(x.dtype)
    hidden = grouped_linear(inputs, w13, groups).to(x.dtype)
    act = hidden.new_empty(len(order), hidden.shape[-1] // 2 if gated else hidden.shape[-1])
    apply_moe_activation(activation, act, hidden)
    product = grouped_linear(act, w2, groups)
    if not weight_on_input:
        product *= weights
    # Back in (token, k) order, then summed over k: in a fixed order, unlike index_add_, which
    # also took 1.1 ms per decode step inside vLLM (its parallel path waiting for a core).
    per_token = product.index_select(0, order.argsort()).view(tokens, top_k, -1)
    return per_token.sum(1).to(x.dtype)


def _kernel_experts(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, config) -> dict:
    """The backend's tensors of every expert, stacked [E, ...] (the grouped kernel's input)."""
    prepared = [backend().prepare(packed[e], scale[e], zero[e], config) for e in range(len(packed))]
    return {
        key: None if tensor is None else in_huge_pages(torch.stack([p[key] for p in prepared]))
        for key, tensor in prepared[0].items()
    }


def _check_supported(where: str, moe, hidden: int, intermediate: int, group_size: int) -> None:
    """Refuse, in one line, what these experts cannot run; the tensor-parallel split named."""
    if moe.has_bias:
        raise ValueError(f"cpu_int4: {where}: experts with biases are not supported")
    if moe.moe_parallel_config.use_ep:
        raise ValueError(f"cpu_int4: {where}: int4 experts do not support expert parallelism")
    problem = shape_problem(intermediate, hidden, group_size) or shape_problem(
        hidden, intermediate, group_size
    )
    if problem and intermediate != moe.intermediate_size:
        tp = moe.intermediate_size // intermediate
        problem = (
            f"expert width {moe.intermediate_size} over tp={tp} is {intermediate} per rank: {problem};"
            f" requantize with `cpu-int4 quantize --tp {tp}`"
        )
    if problem:
        raise ValueError(f"cpu_int4: {where} cannot be int4 here: {problem}")


def _checked(layer, loader):
    """vLLM's expert loader, refusing a tensor of the wrong dtype or width and recording what
    arrived, so a damaged checkpoint fails naming the tensor instead of leaving garbage."""

    def load(param, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int, **kwargs):
        where = f"{weight_name} (expert {expert_id})"
        if loaded_weight.dtype != param.dtype:
            raise ValueError(f"cpu_int4: {where} is {loaded_weight.dtype}, expected {param.dtype}")
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] != param.int4_columns:
            raise ValueError(
                f"cpu_int4: {where} has shape {tuple(loaded_weight.shape)}, expected {param.int4_columns}"
                " columns; does quantization_config.group_size match the tensors?"
            )
        loaded = loader(param, loaded_weight, weight_name, shard_id, expert_id, **kwargs)
        name = weight_name.rpartition(".")[2]
        layer.int4_loaded.setdefault(name, set()).add((expert_id, shard_id))
        return loaded

    return load


def _check_all_loaded(layer, moe) -> None:
    """Raise naming the checkpoint tensor of the first expert shard that never arrived."""
    proj = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}
    shards = {"w13": ("w1", "w3") if moe.is_act_and_mul else ("w1",), "w2": ("w2",)}
    for stem, ids in shards.items():
        for suffix in QUANTIZED_SUFFIXES:
            loaded = layer.int4_loaded.get(f"{stem}_{suffix}", set())
            for expert in range(moe.num_local_experts):
                for shard in ids:
                    if (expert, shard) not in loaded:
                        raise ValueError(
                            f"cpu_int4: {layer.layer_name}.{expert}.{proj[shard]}.{suffix}"
                            " is missing from the checkpoint"
                        )

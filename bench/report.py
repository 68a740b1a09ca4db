"""What a loaded model holds for its int4 layers: for tests and benchmarks, run inside vLLM's
worker with `LLM.apply_model`."""

from __future__ import annotations

import os

import torch
from cpu_int4_vllm.format import PACKED_SUFFIX, quantized_tensors

PACKED_CODE_TENSORS = (PACKED_SUFFIX, "int4_packed", "int4_rowmajor")  # the tensors holding codes


def int4_memory_report(model: torch.nn.Module) -> dict:
    """Per int4 module: packed bytes expected for one copy, packed bytes held, tensor names.

    Run inside vLLM's worker with `llm.apply_model(int4_memory_report)`.
    """
    from cpu_int4_vllm.embedding import CpuInt4EmbeddingMethod
    from cpu_int4_vllm.linear import CpuInt4LinearMethod
    from cpu_int4_vllm.moe import CpuInt4MoEMethod

    modules, ranges = {}, advised_ranges()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, CpuInt4MoEMethod):
            kind, one_copy = "experts", _experts_packed_bytes(module, method.config.group_size)
        elif isinstance(method, CpuInt4LinearMethod):
            n, k = module.int4_weight_shape
            one_copy = quantized_tensors(name, n, k, method.config.group_size)[0].nbytes  # the packed codes
            kind = "embedding" if isinstance(method, CpuInt4EmbeddingMethod) else "linear"
        else:
            continue
        # Experts hold theirs as w13_int4_packed, w2_int4_packed: the same names, prefixed.
        held = sum(t.nbytes for name, t in module.named_parameters() if name.endswith(PACKED_CODE_TENSORS))
        modules[name] = {
            "kind": kind,
            "packed_bytes_one_copy": one_copy,
            "packed_bytes_held": held,
            "backend": module.int4_backend.NAME if hasattr(module, "int4_backend") else None,
            "tensors": sorted(n for n, _ in module.named_parameters()),
            "huge_pages": {n: huge_page_bytes(t, ranges) for n, t in module.named_parameters()},
        }
    # named_modules() lists a shared module once: a tied head shows up under the table's name.
    head = getattr(model, "lm_head", None)
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    return {"modules": modules, "lm_head_module": head_name}


def huge_page_bytes(tensor: torch.Tensor, ranges: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """(bytes of `tensor` in memory advised MADV_HUGEPAGE, bytes of its whole 2 MiB pages);
    `ranges`: advised_ranges(), read anew when not given."""
    from cpu_int4_vllm.huge_pages import HUGE_PAGE

    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    ranges = advised_ranges() if ranges is None else ranges
    advised = sum(max(0, min(end, hi) - max(start, lo)) for lo, hi in ranges)
    return advised, tensor.nbytes // HUGE_PAGE * HUGE_PAGE


def advised_ranges() -> list[tuple[int, int]]:
    """This process's mappings advised MADV_HUGEPAGE ("hg" in their VmFlags)."""
    ranges, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                current = tuple(int(a, 16) for a in head.split("-"))
            elif head == "VmFlags:" and "hg" in line.split()[1:]:
                ranges.append(current)
    return ranges


def _experts_packed_bytes(module: torch.nn.Module, group_size: int) -> int:
    """Packed code bytes of one copy of a MoE layer's local experts (w13 and w2)."""
    hidden, width = module.hidden_size, module.intermediate_size_per_partition
    shards = module.moe_config.w13_num_shards
    per_expert = (
        quantized_tensors("", shards * width, hidden, group_size)[0].nbytes
        + quantized_tensors("", hidden, width, group_size)[0].nbytes
    )
    return module.local_num_experts * per_expert


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights the model holds: its parameters (shared ones once), plus every linear
    weight vLLM's CPU path moved out of its module.

    For bf16 linears vLLM hands the weight to a oneDNN/packed GEMM and leaves an empty
    `weight` behind, so parameters alone miss them; they are counted at their own size (one
    packed copy of the same dtype).
    """
    held = sum(p.nbytes for p in model.parameters())
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.numel() == 0
            and hasattr(module, "input_size_per_partition")
        ):
            rows = getattr(module, "output_size_per_partition", 0)
            held += rows * module.input_size_per_partition * weight.element_size()
    return held


def torch_threads(model: torch.nn.Module) -> int:
    """The intra-op threads of the worker holding `model` (for apply_model)."""
    return torch.get_num_threads()


def nice_values(model: torch.nn.Module) -> tuple[int, int]:
    """The nice values of the worker holding `model` and of its parent, vLLM's engine core (for
    apply_model)."""
    return os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, os.getppid())


def openmp_spin(model: torch.nn.Module) -> str | None:
    """$GOMP_SPINCOUNT in the worker holding `model` (for apply_model)."""
    return os.environ.get("GOMP_SPINCOUNT")


def record_step_calls(worker) -> None:
    """Have the worker (vLLM's wrapper, for collective_rpc) note each `sample_tokens` call:
    whether it came from inside `execute_model` (one call a step) or from the engine core, and
    whether a grammar came with it."""
    inner = worker.worker
    inner.step_calls, inside = [], []
    execute_model, sample_tokens = inner.execute_model, inner.sample_tokens

    def noted_execute_model(*args, **kwargs):
        inside.append(True)
        try:
            return execute_model(*args, **kwargs)
        finally:
            inside.pop()

    def noted_sample_tokens(grammar_output, *args, **kwargs):
        inner.step_calls.append({"inside_execute_model": bool(inside), "grammar": grammar_output is not None})
        return sample_tokens(grammar_output, *args, **kwargs)

    inner.execute_model, inner.sample_tokens = noted_execute_model, noted_sample_tokens


def step_calls(worker) -> list[dict]:
    """What record_step_calls noted (for collective_rpc)."""
    return worker.worker.step_calls


def compute_paths(model: torch.nn.Module) -> dict:
    """What the int4 layers of `model` run on in its worker: the kernel path and whether large
    prefills multiply in bf16."""
    from cpu_int4_vllm import dense, native

    isa = native.isa()
    return {"isa": isa.name if isa else None, "bf16_gemm": dense.fast_bf16_gemm()}

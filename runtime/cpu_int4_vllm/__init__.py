"""cpu_int4 runtime: the checkpoint format and the vLLM plugin that serves it on the CPU.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process it starts,
so it is idempotent, and it imports vLLM only when called: `cpu_int4_vllm.format` and
`cpu_int4_vllm.layout` stay usable with torch alone.
"""

_registered = False


def register() -> None:
    """Register the `cpu_int4` quantization config with vLLM (once per process), shorten the
    OpenMP spin of the processes vLLM starts (openmp_spin.py), have the engine core sleep while
    it waits for the workers (engine_wait.py), and lower its priority where
    $CPU_INT4_ENGINE_NICE asks for it (engine_priority.py)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .config import CpuInt4Config
    from .engine_priority import lower_engine_priority
    from .engine_wait import sleep_through_steps
    from .format import QUANT_METHOD
    from .one_call_step import sample_in_execute_model
    from .openmp_spin import shorten_openmp_spin

    register_quantization_config(QUANT_METHOD)(CpuInt4Config)
    shorten_openmp_spin()
    lower_engine_priority()
    sleep_through_steps()
    sample_in_execute_model()
    _registered = True

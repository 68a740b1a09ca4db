"""A decode step in one call from vLLM's engine core to its worker instead of two.

vLLM's engine core asks the worker for each step twice: `execute_model` (the forward pass) and,
when that returns nothing, `sample_tokens(grammar_output)`, so that it can build the
structured-output bitmask while the forward runs. Each call is a round trip through shared
memory between two processes: on 2 cores (Zen 4 EPYC, the 7B-shaped model of `bench/serve.py`)
the worker waited 0.7-1.1 ms between the two. When no request in the step uses structured
output the engine core's grammar output is None (`Scheduler.get_grammar_bitmask`), so the
worker samples at once with exactly that and returns the step's output from `execute_model`;
the engine core then skips `sample_tokens` (`EngineCore.step`). Steps with structured output
keep the two calls, and so do engines that overlap batches (pipeline parallelism, async
scheduling): their `step_with_batch_queue` calls `sample_tokens` whatever `execute_model`
returned. `CPU_INT4_ONE_CALL_STEP=0` turns it off. Measured in README.md
(`bench/alternate.py --switch step`: cpu_int4 5-8% less time a token).
"""

from __future__ import annotations

import multiprocessing
import os

ENV = "CPU_INT4_ONE_CALL_STEP"


def sample_in_execute_model() -> None:
    """In a worker of vLLM's multiprocessing executor on the CPU, make `execute_model` sample."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
    if value == "0" or not multiprocessing.current_process().name.startswith("VllmWorker-"):
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_worker import CPUWorker

    execute_model = CPUWorker.execute_model

    def execute_and_sample(self, scheduler_output):
        output = execute_model(self, scheduler_output)
        if output is None and one_call_will_do(self, scheduler_output):
            return self.sample_tokens(None)
        return output

    CPUWorker.execute_model = execute_and_sample


def one_call_will_do(worker, scheduler_output) -> bool:
    """True when the engine core would follow this step's `execute_model` with
    `sample_tokens(None)`: no structured output, and one batch at a time (the engine core's
    `step`, which it runs exactly when `max_concurrent_batches` is 1)."""
    one_batch = worker.vllm_config.max_concurrent_batches == 1
    return one_batch and not scheduler_output.has_structured_output_requests

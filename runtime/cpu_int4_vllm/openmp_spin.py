"""A shorter OpenMP spin for the processes vLLM starts on the CPU, so that idle compute threads
leave the engine a core.

After each parallel region libgomp's idle threads spin GOMP_SPINCOUNT times before they sleep:
300,000 by default, milliseconds. In vLLM's worker the GEMV's and torch's threads spin on through
the Python between regions and past the end of each step, while the engine core needs a core to
take the step's output and schedule the next one. On 2 cores (AMD EPYC, AVX2; the 7B-shaped
model of `bench/serve.py --compare spin`) 10,000 spins raised cpu_int4's decode by ~20%; the
figures are in README.md. libgomp reads the value once, when it loads, so it is set in the
environment of the first process that loads the plugin (`vllm serve` or `LLM()` parse their
arguments before they start the engine core and its workers), and those inherit it. A value
already in the environment wins.
"""

from __future__ import annotations

import os

ENV = "GOMP_SPINCOUNT"
SPINS = "10000"


def shorten_openmp_spin() -> None:
    """Set $GOMP_SPINCOUNT for the processes vLLM will start here, unless it is set already."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault(ENV, SPINS)

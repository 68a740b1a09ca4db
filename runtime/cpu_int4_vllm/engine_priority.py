"""An opt-in lower priority for vLLM's engine core, for machines with few cores.

The engine core waits for the worker's reply to each step by spinning on `sched_yield`
(`shm_broadcast.SpinCondition`, for 1 s after each read). When the worker computes on every
core, that spin shares a core with one of its threads: on 2 cores it held 22% of a core during
decode (`top -H`), and the GEMV thread beside it finished last. At a higher nice value the spin
gives way to the worker and still sees the reply as soon as the worker yields the core.
Opt-in, because it applies to every model the engine serves and would starve the engine on a
machine busy with other work. Measured in README.md (`bench/serve.py --compare nice`).
"""

from __future__ import annotations

import multiprocessing
import os

ENV = "CPU_INT4_ENGINE_NICE"


def lower_engine_priority() -> None:
    """From a worker of vLLM's multiprocessing executor, set its parent's (the engine core's)
    nice value to $CPU_INT4_ENGINE_NICE.

    The worker does it, not the engine core itself: the engine core starts the workers after
    loading plugins, they would inherit the value, and an unprivileged process cannot take it
    back. It reaches the engine core's main thread, the one that spins.
    """
    value = os.environ.get(ENV, "")
    if not value or not multiprocessing.current_process().name.startswith("VllmWorker-"):
        return
    if not value.isdigit() or not 1 <= int(value) <= 19:
        raise ValueError(f"{ENV}={value!r}: expected a nice value from 1 to 19")
    os.setpriority(os.PRIO_PROCESS, os.getppid(), int(value))

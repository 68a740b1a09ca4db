"""vLLM's engine core sleeps through most of each step while it waits for the worker's reply, so
that the worker's compute threads keep every core.

The engine core reads each step's output from a shared-memory queue. vLLM's reader spins on
`sched_yield` for 1 s after each read (`shm_broadcast.SpinCondition.wait`), so during decode it
never sleeps: on 2 cores (AMD EPYC, AVX2, the 7B-shaped model of `bench/serve.py`) it held 32%
of a core beside the worker's two GEMV threads, which then decoded 27.2 tok/s. Blocking on the
writer's notification (vLLM's idle mode) took ~0.5 ms to wake, and served it lost the wake-up
and waited out vLLM's 5 s recheck on every step. Sleeping 1 ms between checks cut the engine to
5% of a core (29-32 tok/s) but adds half a millisecond a step. So the reader sleeps, at most 1
ms at a time, until 90% of the time the same read took one step before has passed, and spins
from there as vLLM does: decode steps take about as long as the one before, so the reply is seen
at once. A step is one read, or two (`execute_model`, then `sample_tokens`: a long one and a
short one) where it needs a grammar or one_call_step.py is turned off, so the read to compare
with is the one two reads back. After 1 s the reader blocks as vLLM's does: sleeping on through
a 512-token prefill (5.5 s) made it 7.1-7.4 s. `CPU_INT4_ENGINE_WAIT=spin` keeps vLLM's spin.
Measured in README.md (`bench/serve.py --compare spin`).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import types

ENV = "CPU_INT4_ENGINE_WAIT"
SLEEP_S = 1e-3  # the longest sleep: what a reply can wait when a step is shorter than the last
SPIN_FROM = 0.9  # of the time the same read took one step before


def is_engine_core() -> bool:
    """True in the process vLLM starts for its engine core (named in vllm/v1/engine/utils.py)."""
    return multiprocessing.current_process().name.startswith("EngineCore")


def sleep_through_steps() -> None:
    """In the engine core, make the queue readers created from now on sleep while they wait.

    Called at plugin load, which vLLM's engine core does before it creates its executor and the
    queues. Workers forked from it inherit the patched class, so each reader checks its process.
    """
    value = os.environ.get(ENV, "sleep")
    if value not in ("sleep", "spin"):
        raise ValueError(f"{ENV}={value!r}: expected 'sleep' or 'spin'")
    from vllm.platforms import current_platform

    if value == "spin" or not is_engine_core() or not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    spinning_init = SpinCondition.__init__

    def init(self, *args, **kwargs):
        spinning_init(self, *args, **kwargs)
        if self.is_reader and is_engine_core():
            self.read_s = (0.0, 0.0)  # read-to-read times, the older first
            self.wait = types.MethodType(sleeping_wait, self)
            self.record_read = types.MethodType(timed_record_read, self)

    SpinCondition.__init__ = init


def timed_record_read(self) -> None:
    """`SpinCondition.record_read`, keeping the times of the last two reads."""
    now = time.monotonic()
    self.read_s = (self.read_s[1], now - self.last_read)
    self.last_read = now


def sleeping_wait(self, timeout_ms: int | None = None) -> None:
    """`SpinCondition.wait`, sleeping until the reply is due; idle readers block as in vLLM."""
    waited = time.monotonic() - self.last_read
    due = SPIN_FROM * self.read_s[0]
    if waited > self.busy_loop_s:
        type(self).wait(self, timeout_ms)
    elif waited < due:
        time.sleep(min(SLEEP_S, due - waited))
    else:
        os.sched_yield()

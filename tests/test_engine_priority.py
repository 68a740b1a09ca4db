"""CPU_INT4_ENGINE_NICE (runtime/cpu_int4_vllm/engine_priority.py): a real engine's core runs at
the value asked for while its worker keeps its own; nothing changes without it or outside a
worker; a bad value stops in one line."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from cpu_int4_vllm.engine_priority import ENV, lower_engine_priority
from serve_once import launch, result


@pytest.mark.vllm
def test_the_engine_core_runs_at_the_value_its_worker_sets(demo_quantized, ids_file):
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    asked = max(ours + 1, 7)
    default = result(launch(demo_quantized, 1, 1, ids_file))
    lowered = result(launch(demo_quantized, 1, 1, ids_file, env={ENV: str(asked)}))
    assert default["nice"] == [[ours, ours]]
    # The worker keeps ours: it was started before it lowered the engine core's.
    assert lowered["nice"] == [[ours, asked]]
    assert lowered["top1"] == default["top1"]


def test_outside_a_worker_nothing_changes(monkeypatch):
    before = os.getpriority(os.PRIO_PROCESS, os.getppid())
    monkeypatch.setenv(ENV, "19")
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    lower_engine_priority()
    assert os.getpriority(os.PRIO_PROCESS, os.getppid()) == before


@pytest.mark.parametrize("value", ["high", "0", "20", "-5"])
def test_a_bad_value_stops_in_one_line(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "VllmWorker-0")
    with pytest.raises(ValueError, match=f"^{ENV}='{value}': expected a nice value from 1 to 19$"):
        lower_engine_priority()

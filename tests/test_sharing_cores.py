"""How the engine's processes share the cores (runtime/cpu_int4_vllm/engine_priority.py,
openmp_spin.py): a real engine's core runs at the nice value asked for while its worker keeps its
own; the workers inherit the short OpenMP spin unless the environment sets one; nothing changes
outside a worker; a bad nice value stops in one line."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from cpu_int4_vllm.engine_priority import ENV, lower_engine_priority
from cpu_int4_vllm.openmp_spin import ENV as SPIN_ENV
from cpu_int4_vllm.openmp_spin import SPINS, shorten_openmp_spin
from serve_once import launch, result


@pytest.mark.vllm
def test_the_engine_core_runs_at_the_value_its_worker_sets(demo_quantized, ids_file, monkeypatch):
    monkeypatch.delenv(SPIN_ENV, raising=False)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    asked = max(ours + 1, 7)
    default = result(launch(demo_quantized, 1, 1, ids_file))
    lowered = result(launch(demo_quantized, 1, 1, ids_file, env={ENV: str(asked), SPIN_ENV: "300000"}))
    assert default["nice"] == [[ours, ours]]
    # The worker keeps ours: it was started before it lowered the engine core's.
    assert lowered["nice"] == [[ours, asked]]
    assert default["spin"] == [SPINS]
    assert lowered["spin"] == ["300000"]
    assert lowered["top1"] == default["top1"]


def test_a_spin_count_already_set_wins(monkeypatch):
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != SPIN_ENV})
    shorten_openmp_spin()
    assert os.environ[SPIN_ENV] == SPINS
    os.environ[SPIN_ENV] = "42"
    shorten_openmp_spin()
    assert os.environ[SPIN_ENV] == "42"


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

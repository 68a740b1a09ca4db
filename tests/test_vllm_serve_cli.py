"""`vllm serve OUT` on 127.0.0.1 with no flag and no import: the plugin loads by entry point.
One server for the module: a chat completion, then 64 requests under load."""

from __future__ import annotations

import pytest
from load import make_requests, run_load, serve

pytestmark = pytest.mark.vllm  # one engine (or server) shared by the module


@pytest.fixture(scope="module")
def server(demo_quantized, tmp_path_factory):
    with serve(demo_quantized, tmp_path_factory.mktemp("serve") / "vllm.log", name="demo") as running:
        yield running


def test_chat_completion_with_the_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server[0]}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.usage.completion_tokens > 0


def test_64_requests_at_concurrency_16_with_dropped_and_malformed_ones(server, demo_model, tmp_path):
    requests = make_requests(demo_model, 64)
    assert sum(r["stream"] for r in requests) == 32 and sum(r["drop"] for r in requests) == 8
    base, proc = server
    result = run_load(base, "demo", requests, proc, concurrency=16)
    print(f"\ncpu_int4 under load: {result}")
    assert result.errors == []
    assert result.completed == result.requests == 56  # every kept request, at exactly its max_tokens
    assert result.dropped == 8
    assert len(result.malformed_status) == 4 and all(400 <= s < 500 for s in result.malformed_status)
    assert result.healthy_after
    assert abs(result.rss_after_gb - result.rss_before_gb) <= 0.05 * result.rss_before_gb
    # The control: vLLM serving the bf16 model under the same load. Batching changes greedy
    # continuations for bf16 too, so cpu_int4 is held to the control's figure.
    with serve(demo_model, tmp_path / "bf16.log", name="demo") as (bf16_server, bf16_proc):
        control = run_load(bf16_server, "demo", requests, bf16_proc, concurrency=16)
    print(f"bf16 control under load: {control}")
    assert control.errors == [] and control.completed == 56
    assert result.same_first_16 >= control.same_first_16 

"""`vllm serve OUT` on 127.0.0.1 with no flag and no import: the plugin loads by entry point."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

STARTUP_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(demo_quantized, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    vllm = Path(sys.executable).parent / "vllm"
    cmd = [
        str(vllm),
        "serve",
        str(demo_quantized),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "demo",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"vllm serve exited early:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        else:
            pytest.fail(f"vllm serve not healthy after {STARTUP_S} s:\n{log.read_text()[-3000:]}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_chat_completion_with_the_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.usage.completion_tokens > 0

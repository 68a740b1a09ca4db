"""Hub download and push through the real huggingface_hub client, against a local fake Hub."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHubServer
from huggingface_hub import ModelCard
from tiny_models import tiny_llama

CLI = str(Path(sys.executable).with_name("cpu-int4"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SOURCE_CARD = "---\nlicense: apache-2.0\nlanguage: en\n---\n# A tiny model\n"


@pytest.fixture
def hub():
    with FakeHubServer() as server:
        yield server


@pytest.fixture
def source_repo(tmp_path, demo_model, hub):
    """org/name on the fake Hub: a sharded tiny Llama with real tokenizer files and a card."""
    folder = tiny_llama(tmp_path / "upstream", max_shard_size="50KB")
    for name in TOKENIZER_FILES:
        shutil.copy(demo_model / name, folder / name)
    (folder / "README.md").write_text(SOURCE_CARD)
    (folder / "pytorch_model.bin").write_bytes(b"not needed")  # must not be downloaded
    hub.hub.add_model("org/name", folder)
    return folder


def run(args, hub_url: str, home: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ.update(HF_ENDPOINT=hub_url, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", COLUMNS="300")
    environ.update(env)
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env=environ, timeout=300)


def one_error_line(proc) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_quantize_from_hub_then_push_in_one_commit(hub, source_repo, tmp_path):
    out = tmp_path / "name-cpu-int4"
    proc = run(
        ["quantize", "org/name", out, "--max-shard-size", "40KB"], hub.url, tmp_path / "hf", HF_TOKEN="t"
    )
    assert proc.returncode == 0, proc.stderr
    assert not any("pytorch_model.bin" in r for r in hub.hub.requests)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1

    proc = run(
        ["push", out, "me/name-cpu-int4", "--commit-message", "int4 weights"],
        hub.url,
        tmp_path / "hf",
        HF_TOKEN="t",
    )
    assert proc.returncode == 0, (hub.hub.requests, proc.stderr[-600:])
    assert f"{hub.url}/me/name-cpu-int4" in proc.stdout
    assert hub.hub.created[-1]["name"] == "name-cpu-int4"
    [commit] = hub.hub.commits
    assert (commit.repo, commit.revision, commit.summary) == ("me/name-cpu-int4", "main", "int4 weights")
    expected = {"config.json", "model.safetensors.index.json", "README.md", *shards, *TOKENIZER_FILES}
    assert expected <= set(commit.files)
    for name in expected:
        assert commit.files[name] == (out / name).read_bytes(), name


def test_card_metadata_parses(hub, source_repo, tmp_path):
    out = tmp_path / "out"
    assert run(["quantize", "org/name", out], hub.url, tmp_path / "hf").returncode == 0
    card = ModelCard.load(out / "README.md")
    data = card.data
    assert data.base_model == "org/name"
    assert data.base_model_relation == "quantized"
    assert data.library_name == "vllm"
    assert data.pipeline_tag == "text-generation"
    assert data.license == "apache-2.0"
    assert {"cpu-int4", "4-bit", "w4a16"} <= set(data.tags)
    text = card.text
    for needle in (
        "cpu-int4 quantize org/name",
        "group size | 64",
        "minmax",
        "vllm serve",
        "OpenAI(",
        "torch ",
    ):
        assert needle in text, needle


def test_quantize_and_push_in_one_command_to_a_branch(hub, source_repo, tmp_path):
    out = tmp_path / "out"
    proc = run(
        ["quantize", "org/name", out, "--push-to-hub", "me/pushed", "--private"],
        hub.url,
        tmp_path / "hf",
        HF_TOKEN="t",
    )
    assert proc.returncode == 0, proc.stderr
    assert hub.hub.created[-1]["visibility"] == "private"
    assert "README.md" in hub.hub.commits[-1].files
    proc = run(["push", out, "me/pushed", "--revision", "int4"], hub.url, tmp_path / "hf", HF_TOKEN="t")
    assert proc.returncode == 0, proc.stderr
    assert hub.hub.branches == [("me/pushed", "int4")]
    assert hub.hub.commits[-1].revision == "int4"


def test_offline_uses_the_cache(hub, source_repo, tmp_path):
    home = tmp_path / "hf"
    assert run(["quantize", "org/name", tmp_path / "first"], hub.url, home).returncode == 0
    seen = len(hub.hub.requests)
    hub.hub.fail_with = 404  # anything that still reached the server would now fail
    proc = run(["quantize", "org/name", tmp_path / "second"], hub.url, home, HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert len(hub.hub.requests) == seen
    first, second = snapshot(tmp_path / "first"), snapshot(tmp_path / "second")
    assert first.pop("README.md") != second.pop("README.md")  # the card records each command
    assert first == second


def test_offline_without_cache_says_so(hub, source_repo, tmp_path):
    proc = run(["quantize", "org/name", tmp_path / "out"], hub.url, tmp_path / "empty", HF_HUB_OFFLINE="1")
    assert "HF_HUB_OFFLINE=1 and org/name is not in the cache" in one_error_line(proc)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "status,expect",
    [(401, "rejected the token (401)"), (403, "403 forbidden"), (404, "not found on the Hub")],
)
def test_download_errors(hub, source_repo, tmp_path, status, expect):
    hub.hub.fail_with = status
    proc = run(["quantize", "org/name", tmp_path / "out"], hub.url, tmp_path / "hf", HF_TOKEN="t")
    assert expect in one_error_line(proc)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def local_out(tmp_path):
    src = tiny_llama(tmp_path / "src")
    out = tmp_path / "out"
    assert run(["quantize", src, out], "http://127.0.0.1:9", tmp_path / "hf").returncode == 0
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize(
    "status,expect",
    [
        (401, "rejected the token (401)"),
        (403, "may not push me/x (403 forbidden)"),
        (404, "not found on the Hub"),
    ],
)
def test_push_errors_leave_out_intact(hub, local_out, tmp_path, status, expect):
    before = snapshot(local_out)
    hub.hub.fail_with = status
    proc = run(["push", local_out, "me/x"], hub.url, tmp_path / "hf", HF_TOKEN="t")
    assert expect in one_error_line(proc)
    assert snapshot(local_out) == before


def test_push_without_token(hub, local_out, tmp_path):
    proc = run(["push", local_out, "me/x"], hub.url, tmp_path / "hf")
    assert "no Hugging Face token" in one_error_line(proc)
    assert hub.hub.requests == []


def test_push_invalid_repo_id(hub, local_out, tmp_path):
    proc = run(["push", local_out, "not a repo!"], hub.url, tmp_path / "hf", HF_TOKEN="t")
    assert "invalid repo id 'not a repo!'" in one_error_line(proc)


def test_hub_not_listening(local_out, tmp_path):
    with FakeHubServer() as server:
        url = server.url  # a port that was just free and is closed again below
    before = snapshot(local_out)
    proc = run(["push", local_out, "me/x"], url, tmp_path / "hf", HF_TOKEN="t")
    assert "cannot reach the Hub" in one_error_line(proc)
    assert snapshot(local_out) == before
    proc = run(["quantize", "org/name", tmp_path / "q"], url, tmp_path / "hf")
    assert "cannot reach the Hub" in one_error_line(proc)

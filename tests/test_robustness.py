"""The quantizer under kill -9, a full disk and a read-only destination: no partial OUT, ever."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import medium_llama, tiny_llama

CLI = str(Path(sys.executable).with_name("cpu-int4"))


def quantize_cmd(src: Path, out: Path) -> list[str]:
    return [CLI, "quantize", str(src), str(out)]


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real small (or read-only) filesystem: root mounts a tmpfs for the test."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def staging_dirs(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if ".cpu-int4-staging" in p.name]


def test_kill_9_leaves_no_out_and_the_rerun_cleans_up(tmp_path):
    src = medium_llama(tmp_path / "src")
    parent = tmp_path / "dest"
    parent.mkdir()
    out = parent / "out"
    proc = subprocess.Popen(quantize_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(f.stat().st_size for d in staging_dirs(parent) for f in d.glob("*.safetensors")):
        assert proc.poll() is None, "finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    assert len(staging_dirs(parent)) == 1  # what a kill -9 leaves: the staging folder, never OUT

    rerun = subprocess.run(quantize_cmd(src, out), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / "model.safetensors").is_file()
    assert staging_dirs(parent) == []


def test_sigterm_cleans_up(tmp_path):
    src = medium_llama(tmp_path / "src")
    out = tmp_path / "out"
    proc = subprocess.Popen(quantize_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not staging_dirs(tmp_path):
        assert proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert not out.exists() and staging_dirs(tmp_path) == []


def test_disk_full_gives_a_clean_error(tmp_path):
    src = tiny_llama(tmp_path / "src", hidden_size=128, vocab_size=32000)  # ~2.3 MB quantized
    with tmpfs(tmp_path / "small", "size=1m") as small:
        proc = subprocess.run(
            quantize_cmd(src, small / "out"),
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "300"},
        )
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "no space left on the device" in lines[0], proc.stderr
        assert list(small.iterdir()) == []


@pytest.mark.parametrize("nested", [False, True])
def test_read_only_parent_gives_a_clean_error(tmp_path, nested):
    src = tiny_llama(tmp_path / "src")
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        out = ro / "a" / "out" if nested else ro / "out"
        proc = subprocess.run(
            quantize_cmd(src, out), capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"}
        )
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Read-only file system" in lines[0], proc.stderr

"""Peak RSS of `cpu-int4 quantize` on a synthetic checkpoint of at least 2 GB.

    .venv/bin/python bench/quantize_memory.py [--layers 4]

Runs the real console script in a child process and reads its peak resident set size.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic import build_synthetic  # noqa: E402

CACHE = Path(__file__).resolve().parent.parent / ".cache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    source = build_synthetic(CACHE / f"synthetic-7b-shapes-{args.layers}l", args.layers)
    size = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    out = Path(tempfile.mkdtemp(dir=CACHE)) / "out"
    cli = Path(sys.executable).with_name("cpu-int4")
    start = time.perf_counter()
    subprocess.run([str(cli), "quantize", str(source), str(out)], check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(
        f"| checkpoint | {size / 1e9:.2f} GB bf16 ({args.layers} layers of Llama-2-7B shape, vocab 49152) |"
    )
    print(f"| output | {sum(f.stat().st_size for f in out.glob('*.safetensors')) / 1e9:.2f} GB |")
    print(f"| wall time | {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s of bf16 input) |")
    print(f"| peak RSS of `cpu-int4 quantize` | {peak / 2**20:.0f} MiB |")
    shutil.rmtree(out.parent)


if __name__ == "__main__":
    main()

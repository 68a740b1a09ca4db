"""Quantizer throughput and memory: `cpu-int4 quantize` against a plain PyTorch quantizer.

    .venv/bin/python bench/quantize.py [--layers 4] [--rounds 2]

The checkpoint: `--layers` Llama-2-7B-shaped layers plus a 49152-row vocab table and head
(bench/synthetic.py; 4 layers = 2.42 GB of bf16). Both quantizers run as child processes,
alternating, with the checkpoint in the page cache (read once before the first run), so the
figures are the quantizers' own rather than the disk's. The reference is what a plain script
does: load each shard, format.quantize_minmax each weight, save the outputs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache"


def reference_quantize(source: Path, out: Path, group_size: int = 64) -> None:
    """Plain PyTorch: every 2-D weight of every shard through format.quantize_minmax."""
    from cpu_int4_vllm.format import quantize_minmax
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for shard in sorted(source.glob("*.safetensors")):
        result = {}
        for name, tensor in load_file(shard).items():
            if tensor.dim() == 2:
                base = name.removesuffix(".weight")
                packed, scale, zero = quantize_minmax(tensor, group_size)
                result |= {f"{base}.weight_packed": packed, f"{base}.weight_scale": scale}
                result[f"{base}.weight_zero"] = zero
            else:
                result[name] = tensor
        save_file(result, out / shard.name)


def run_child(command: list[str]) -> tuple[float, float, int]:
    """(seconds of work as the child reports it, wall seconds, peak RSS bytes) of one child.

    The work time leaves out interpreter start-up and imports (~3 s of torch and friends here).
    """
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    took = re.search(r"took ([0-9.]+) s", stdout)
    if os.waitstatus_to_exitcode(status) != 0 or took is None:
        raise SystemExit(f"{command[0]} failed:\n{stdout[-2000:]}")
    return float(took.group(1)), wall, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reference", nargs=2, metavar=("SOURCE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference:
        start = time.perf_counter()
        reference_quantize(Path(args.reference[0]), Path(args.reference[1]))
        print(f"took {time.perf_counter() - start:.2f} s")
        return
    source = CACHE / f"synthetic-7b-shapes-{args.layers}l"
    # Built in its own process: a child's peak RSS (wait4) starts from its parent's at fork, and
    # building the checkpoint here once made the quantizer look 1.3 GB bigger than it is.
    synthetic = Path(__file__).with_name("synthetic.py")
    subprocess.run([sys.executable, str(synthetic), str(source), str(args.layers)], check=True)
    files = sorted(source.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    for f in files:  # into the page cache
        with open(f, "rb") as handle:
            while handle.read(64 * 2**20):
                pass
    cli = str(Path(sys.executable).with_name("cpu-int4"))
    commands = {
        "cpu-int4 quantize": lambda out: [cli, "quantize", str(source), str(out)],
        "plain PyTorch (load, quantize_minmax, save)": lambda out: [
            sys.executable,
            __file__,
            "--reference",
            str(source),
            str(out),
        ],
    }
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in commands}
    out_size = {}
    for _ in range(args.rounds):
        for name, command in commands.items():
            work = Path(tempfile.mkdtemp(dir=CACHE))
            runs[name].append(run_child(command(work / "out")))
            out_size[name] = sum(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
            shutil.rmtree(work)
    print(f"checkpoint: {size / 1e9:.2f} GB bf16, {args.layers} Llama-2-7B-shaped layers, vocab 49152\n")
    print("| quantizer | time (s) | GB/s of bf16 input | process wall (s) | peak RSS (MiB) | output (GB) |")
    print("|---|---|---|---|---|---|")
    for name, results in runs.items():
        took = [t for t, _, _ in results]
        wall = [w for _, w, _ in results]
        peak = max(r for _, _, r in results)
        rate = size / 1e9 / statistics.median(took)
        print(
            f"| {name} | {statistics.median(took):.2f} ({min(took):.2f}-{max(took):.2f}) | {rate:.2f} "
            f"| {statistics.median(wall):.2f} | {peak / 2**20:.0f} | {out_size[name] / 1e9:.2f} |"
        )
    print(f"\nmedian (min-max) of {args.rounds} runs each, alternating, checkpoint in the page cache")


if __name__ == "__main__":
    main()

"""Quality of min/max vs search at group sizes 32 and 64, on the demo model and WikiText-2.

    .venv/bin/python bench/quality.py [--max-tokens 32768] [--context 1024]

Quantizes the bf16 SmolLM2-135M-Instruct demo model four ways, times each quantization, and
scores each against the bf16 model with `cpu-int4 eval`'s PyTorch reference. Prints a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

from cpu_int4.evaluate import evaluate  # noqa: E402
from cpu_int4.quantize import quantize  # noqa: E402
from smollm2 import build_demo_model  # noqa: E402
from wikitext import wiki_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--methods", nargs="+", default=["minmax", "search"])
    args = parser.parse_args()
    base = build_demo_model()
    rows = []
    with tempfile.TemporaryDirectory(dir=REPO / ".cache") as tmp:
        for g in args.group_sizes:
            for method in args.methods:
                out = Path(tmp) / f"g{g}-{method}"
                start = time.perf_counter()
                quantize(str(base), out, group_size=g, method=method)
                seconds = time.perf_counter() - start
                r = evaluate(base, out, wiki_text(), context=args.context, max_tokens=args.max_tokens)
                rows.append((g, method, r, seconds))
                print(f"done g={g} {method}", file=sys.stderr, flush=True)
    print(
        f"\nSmolLM2-135M-Instruct, {rows[0][2].positions} positions of wiki.test.raw, context {args.context}"
    )
    print(f"bf16 PPL {rows[0][2].ppl_base:.3f}\n")
    print("| group | method | PPL | ΔPPL vs bf16 | mean KLD | top-1 agreement | quantize time |")
    print("|---|---|---|---|---|---|---|")
    for g, method, r, seconds in rows:
        print(
            f"| {g} | {method} | {r.ppl_quant:.3f} | {r.delta_ppl:+.3f} | {r.kld:.4f} "
            f"| {r.top1_agreement:.2%} | {seconds:.1f} s |"
        )


if __name__ == "__main__":
    main()

"""One call from vLLM's engine core to its worker a step (one_call_step.py) against vLLM's two,
alternated inside one engine, so that the VM's drift and each process's own luck cancel out.

    .venv/bin/python bench/step_calls.py [--model moe|dense] [--rounds 12] [--bf16]

Serves bench/serve.py's cpu_int4 model (and with --bf16 its bf16 checkpoint after it) eager, as
serve.py does, and times 128 greedy tokens at batch 1 per round in each mode, the worker's
`execute_model` switched between the plugin's and vLLM's own before each (the order alternates
round by round). Fresh processes per mode (`serve.py --compare step`) differed by less than their
own spread. Prints ms a token per mode (median, min-max), the median of the per-round ratios,
and the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel import cpu_description  # noqa: E402
from serve import DECODE_TOKENS, prepared_models  # noqa: E402

COMPARISON = {"moe": "moe", "dense": "int4"}  # serve.py's comparison holding each model


def use_one_call(worker, on: bool) -> None:
    """In the worker (for collective_rpc): the plugin's execute_model, or vLLM's own."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    plugin = vars(CPUWorker).get("execute_model") or CPUWorker.plugin_execute_model
    CPUWorker.plugin_execute_model = plugin
    if on:
        CPUWorker.execute_model = plugin
    elif "execute_model" in vars(CPUWorker):
        del CPUWorker.execute_model


def alternate(model: Path, rounds: int) -> dict[bool, list[float]]:
    """ms a token with one call (True) and two (False) a step, round by round."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=2048,
        enable_prefix_caching=False,
        seed=0,
        distributed_executor_backend="mp",
    )
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": list(range(100, 116))}
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    ms: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(rounds):
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            llm.collective_rpc(use_one_call, args=(on,))
            begin = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            ms[on].append(1000 * (time.perf_counter() - begin) / DECODE_TOKENS)
    del llm
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(COMPARISON), default="moe")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--bf16", action="store_true", help="the bf16 checkpoint too")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as serve.py's runs
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships a function
    checkpoints = prepared_models(COMPARISON[args.model], 4)
    print("| checkpoint | one call a step (ms/token) | two calls (ms/token) | two / one, per round |")
    print("|---|---|---|---|")
    for name in ("int4", "bf16") if args.bf16 else ("int4",):
        ms = alternate(checkpoints[name], args.rounds)
        ratios = [two / one for one, two in zip(ms[True], ms[False], strict=True)]
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in (ms[True], ms[False])]
        faster = f"{sum(r > 1 for r in ratios)}/{len(ratios)} > 1"
        print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.median(ratios):.3f} ({faster}) |")
    print(f"\n{args.rounds} rounds of {DECODE_TOKENS} tokens, the two modes alternating in one engine")
    print(cpu_description())


if __name__ == "__main__":
    main()

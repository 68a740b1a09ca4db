"""Two ways of serving alternated inside one engine, so that the VM's drift and each process's
own luck cancel out: fresh processes per way (`serve.py --compare step`) differed by less than
their own spread.

    .venv/bin/python bench/alternate.py [--switch step|pages|experts] [--model moe|dense]
                                        [--rounds 12] [--bf16]

`--switch step`: one call from vLLM's engine core to its worker a step (one_call_step.py)
against vLLM's two, the worker's `execute_model` switched between the plugin's and vLLM's own.
`--switch pages`: the int4 kernel tensors in their huge-page memory (huge_pages.py) against
copies of them in 4 KiB pages, made in the worker on first use. `--switch experts` (MoE):
decode's experts in one native call (`silu_experts`) against moe.run_experts' Python around
the grouped GEMV.

Serves bench/serve.py's cpu_int4 model (and with --bf16, for `step`, its bf16 checkpoint after
it) eager, as serve.py does, and times 128 greedy tokens at batch 1 per round each way (the
order alternates round by round). Prints ms a token each way (median, min-max), the median of
the per-round ratios, and the CPU.
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


def use_huge_pages(worker, on: bool) -> None:
    """In the worker (for collective_rpc): the int4 kernel tensors in huge pages, or in 4 KiB-page
    copies made on the first call."""
    if not hasattr(worker, "page_copies"):
        model = worker.worker.model_runner.model
        worker.page_copies = [
            (module, name, param.data, param.data.clone())
            for module in model.modules()
            for name, param in module.named_parameters(recurse=False)
            if name.endswith(("int4_packed", "scales_and_zeros"))
        ]
    for module, name, huge, plain in worker.page_copies:
        tensor = huge if on else plain
        getattr(module, name).data = tensor
        # Experts run from the same tensors held by their int4_w13 / int4_w2 namespaces.
        stem, _, key = name.partition("_")
        stacked = getattr(module, f"int4_{stem}", None)
        if stacked is not None:
            setattr(stacked, key, tensor)


def use_one_experts_call(worker, on: bool) -> None:
    """In the worker (for collective_rpc): decode's experts in one native call (moe.py's rule),
    or always through run_experts' Python."""
    from cpu_int4_vllm import moe

    if not hasattr(worker, "experts_rule"):
        worker.experts_rule = moe._in_one_native_call
    moe._in_one_native_call = worker.experts_rule if on else lambda layer, topk_ids: False


SWITCHES = {
    "step": (use_one_call, "one call a step", "two calls"),
    "pages": (use_huge_pages, "huge pages", "4 KiB pages"),
    "experts": (use_one_experts_call, "experts in one call", "run_experts"),
}


def alternate(model: Path, rounds: int, switch) -> dict[bool, list[float]]:
    """ms a token with `switch` on (True) and off (False), round by round."""
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
            llm.collective_rpc(switch, args=(on,))
            begin = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            ms[on].append(1000 * (time.perf_counter() - begin) / DECODE_TOKENS)
    del llm
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="step")
    parser.add_argument("--model", choices=sorted(COMPARISON), default="moe")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--bf16", action="store_true", help="the bf16 checkpoint too (--switch step)")
    args = parser.parse_args()
    if args.bf16 and args.switch != "step":
        parser.error(f"--switch {args.switch}: a bf16 checkpoint has no int4 layers")
    switch, on_name, off_name = SWITCHES[args.switch]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as serve.py's runs
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships a function
    checkpoints = prepared_models(COMPARISON[args.model], 4)
    print(
        f"| checkpoint | {on_name} (ms/token) | {off_name} (ms/token) | {off_name} / {on_name}, per round |"
    )
    print("|---|---|---|---|")
    for name in ("int4", "bf16") if args.bf16 else ("int4",):
        ms = alternate(checkpoints[name], args.rounds, switch)
        ratios = [off / on for on, off in zip(ms[True], ms[False], strict=True)]
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for v in (ms[True], ms[False])]
        faster = f"{sum(r > 1 for r in ratios)}/{len(ratios)} > 1"
        print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.median(ratios):.3f} ({faster}) |")
    print(f"\n{args.rounds} rounds of {DECODE_TOKENS} tokens, the two ways alternating in one engine")
    print(cpu_description())


if __name__ == "__main__":
    main()

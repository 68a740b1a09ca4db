"""Serve a checkpoint once at a tensor- and pipeline-parallel size and print what it computed:
the top-1 token at every prompt position of a token list, greedy continuations of prompts in
one batch, the nice values of each worker and of the engine core, and each worker's
$GOMP_SPINCOUNT; with `alone`, each prompt by itself too, and what the int4 modules hold in
memory; with `calls`, how the worker was called for each step of those continuations and of a
request with structured output, and that request's answer.
Eager, unless `compiled` asks for vLLM's default compilation.

    python tests/serve_once.py MODEL TP PP IDS.json [alone] [compiled] [calls]   # prints: RESULT {...}

A process of its own per engine: vLLM's distributed state (ranks, shared-memory broadcast) is
set up per process, and tests compare several sizes of the same checkpoint. Tests start it with
`launch` and read it with `result`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # report.py, for workers too
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships report.py's function

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "In 1905 Albert Einstein published four papers that",
    "def fibonacci(n):",
    "The three primary colors are red,",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his daughter. Every morning they",
    "Q: What is the boiling point of water at sea level? A:",
]
# The distributed tests compare these 4 across ranks: with all 8 above, the demo model at PP=2
# kept every top-1 but changed one or two continuations (flaky at "all but one").
RANK_PROMPTS = [
    "The capital of France is",
    "In 1905 Albert Einstein published four papers that",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest,",
]
GREEDY16 = dict(max_tokens=16, temperature=0.0)
CHOICES = ["Paris", "London", "Rome"]  # the structured-output request's answers
POSITIONS = 1024  # positions of wiki.test.raw the tests score (conftest's ids_file)


def launch(
    model: Path, tp: int, pp: int, ids_file: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """This script on `model` in a fresh process (flags: `alone`, `compiled`), with `env` added
    to this process's environment."""
    return subprocess.run(
        [sys.executable, __file__, model, str(tp), str(pp), ids_file, *flags],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )


def result(proc: subprocess.CompletedProcess) -> dict:
    """What a launched run printed; fails with its stderr when it did not finish."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def serve(
    model: str,
    tp: int,
    pp: int,
    ids: list[int],
    alone: bool = False,
    compiled: bool = False,
    calls: bool = False,
) -> dict:
    from report import nice_values, openmp_spin, record_step_calls, step_calls
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM 0.32's CPU runner allocates the buffers that carry activations between pipeline
    # stages only in its warm-up run, which eager mode skips: stage 2 then fails (AssertionError
    # in sync_and_gather_intermediate_tensors; bf16 checkpoints too). Dynamo with its plain
    # eager backend runs that warm-up and costs seconds, not inductor's minutes.
    mode = {"compilation_config": {"mode": 1, "backend": "eager"}} if pp > 1 else {"enforce_eager": True}
    llm = LLM(
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        **({} if compiled else mode),
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 28,
        seed=0,
    )
    scored = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    top1 = [next(t for t, lp in d.items() if lp.rank == 1) for d in scored.prompt_logprobs[1:]]
    if calls:
        llm.collective_rpc(record_step_calls)
    result = {
        "top1": top1,
        "greedy": _greedy(llm, PROMPTS if alone else RANK_PROMPTS),
        "nice": llm.apply_model(nice_values),
        "spin": llm.apply_model(openmp_spin),
    }
    if alone:
        from report import int4_memory_report

        result["alone"] = [_greedy(llm, [prompt])[0] for prompt in PROMPTS]
        result["memory"] = llm.apply_model(int4_memory_report)[0]
    if calls:
        result["choice"] = _choice(llm, "The capital of France is")
        result["calls"] = llm.collective_rpc(step_calls)[0]
    return result


def _greedy(llm, prompts: list[str]) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(**GREEDY16), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _choice(llm, prompt: str) -> str:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=CHOICES)
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


if __name__ == "__main__":
    model, tp, pp, ids_file = sys.argv[1:5]
    flags = set(sys.argv[5:])
    ids = json.loads(Path(ids_file).read_text())
    chosen = {flag: flag in flags for flag in ("alone", "compiled", "calls")}
    result = serve(model, int(tp), int(pp), ids, **chosen)
    print("RESULT " + json.dumps(result), flush=True)

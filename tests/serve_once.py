"""Serve a checkpoint once at a tensor- and pipeline-parallel size and print what it computed:
the top-1 token at every prompt position of a token list, and greedy continuations of prompts.

    python tests/serve_once.py MODEL TP PP IDS.json   # prints one line: RESULT {...}

A process of its own per engine: vLLM's distributed state (ranks, shared-memory broadcast) is
set up per process, and tests compare several sizes of the same checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "In 1905 Albert Einstein published four papers that",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest,",
]


def serve(model: str, tp: int, pp: int, ids: list[int]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM 0.32's CPU runner allocates the buffers that carry activations between pipeline
    # stages only in its warm-up run, which eager mode skips: stage 2 then fails (AssertionError
    # in sync_and_gather_intermediate_tensors; bf16 checkpoints too). Dynamo with its plain
    # eager backend runs that warm-up and costs seconds, not inductor's minutes.
    llm = LLM(
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        **({"compilation_config": {"mode": 1, "backend": "eager"}} if pp > 1 else {"enforce_eager": True}),
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 28,
        seed=0,
    )
    scored = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    top1 = [next(t for t, lp in d.items() if lp.rank == 1) for d in scored.prompt_logprobs[1:]]
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    return {"top1": top1, "greedy": [list(o.outputs[0].token_ids) for o in greedy]}


if __name__ == "__main__":
    model, tp, pp, ids_file = sys.argv[1:5]
    result = serve(model, int(tp), int(pp), json.loads(Path(ids_file).read_text()))
    print("RESULT " + json.dumps(result), flush=True)

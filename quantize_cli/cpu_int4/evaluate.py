"""`cpu-int4 eval`: what 4 bits cost, measured on a text against the base model.

Both sides run in PyTorch on the CPU; the quantized weights come back through the runtime's own
dequantizer (cpu_int4.dequantized). With engine="vllm" the quantized side is served by vLLM
instead (prompt logprobs), which gives PPL and top-k agreement but not full distributions, so
no KL divergence.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import torch
from cpu_int4_vllm.format import parse_config

from .errors import EvalError

Progress = Callable[[int, int], None]  # (positions just scored, total positions)
VLLM_TOP_K = 5


class Engine(str, Enum):
    """What runs the quantized side: the PyTorch reference or vLLM serving it."""

    torch = "torch"
    vllm = "vllm"


@dataclass
class EvalResult:
    """Figures over all scored positions."""

    positions: int
    ppl_base: float
    ppl_quant: float
    kld: float | None  # mean KL(base || quant), nats; None with the vLLM engine
    top1_agreement: float
    top5_containment: float  # base's top token within the quantized top 5
    engine: str

    @property
    def delta_ppl(self) -> float:
        return self.ppl_quant - self.ppl_base

    def as_dict(self) -> dict:
        return {**asdict(self), "delta_ppl": self.delta_ppl}


def kl_divergence(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log-probabilities [positions, vocab]."""
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def perplexity(nll: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood."""
    return float(nll.double().mean().exp())


def windows(ids: list[int], context: int) -> Iterator[list[int]]:
    """Consecutive windows of `context` tokens (stride = context); each predicts context-1 tokens."""
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context]
        if len(window) > 1:
            yield window


def check_inputs(base: Path, quant: Path, text: Path, context: int, max_tokens: int | None) -> None:
    """Refuse, in one line each, what would otherwise fail deep inside transformers or vLLM."""
    for path, what in ((base, "BASE"), (quant, "QUANT")):
        if not path.is_dir():
            raise EvalError(f"{what} {path} is not a checkpoint folder")
        config = _read_json(path / "config.json", what)
        has_quant = "quantization_config" in config
        if what == "BASE" and has_quant:
            raise EvalError(f"BASE {path} is quantized; pass the original checkpoint it was made from")
        if what == "QUANT":
            if not has_quant:
                raise EvalError(f"QUANT {path} is not a cpu_int4 checkpoint (no quantization_config)")
            try:
                parse_config(config["quantization_config"])
            except ValueError as err:
                raise EvalError(f"QUANT {path} is not a cpu_int4 checkpoint: {err}") from err
        if not any(path.glob("*.safetensors")):
            raise EvalError(f"{what} {path} has no *.safetensors weight files")
    if not text.is_file():
        raise EvalError(f"--text {text} is not a file")
    if context < 2:
        raise EvalError(f"--context must be at least 2 tokens, not {context}")
    if max_tokens is not None and max_tokens < 2:
        raise EvalError(f"--max-tokens must be at least 2, not {max_tokens}")


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EvalError(f"{what} {path.parent} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EvalError(f"{what} {path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise EvalError(f"{what} {path} is not a JSON object")
    return data


def load_tokens(tokenizer_dir: Path, text_file: Path, max_tokens: int | None) -> list[int]:
    from transformers import AutoTokenizer

    try:
        text = text_file.read_text()
    except UnicodeDecodeError as err:
        raise EvalError(f"--text {text_file} is not UTF-8 text: {err}") from err
    ids = AutoTokenizer.from_pretrained(tokenizer_dir).encode(text, add_special_tokens=False)
    ids = ids[:max_tokens] if max_tokens else ids
    if len(ids) < 2:
        raise EvalError(f"--text {text_file} has {len(ids)} tokens; at least 2 are needed to score one")
    return ids


def evaluate(
    base: Path,
    quant: Path,
    text: Path,
    context: int = 1024,
    max_tokens: int | None = None,
    engine: str = Engine.torch,
    progress: Progress | None = None,
) -> EvalResult:
    """Compare BASE and its cpu_int4 output QUANT on a text."""
    from transformers import AutoModelForCausalLM

    check_inputs(base, quant, text, context, max_tokens)
    engine = Engine(engine)
    from .dequantized import load_reference_model

    ids = load_tokens(quant, text, max_tokens)
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    quant_side = load_reference_model(quant) if engine == Engine.torch else _VllmScorer(quant, context)
    total = sum(len(w) - 1 for w in windows(ids, context))
    nll_b, nll_q, kld, agree, top5 = [], [], [], [], []
    for window in windows(ids, context):
        targets = torch.tensor(window[1:])
        logp_b = _torch_logprobs(base_model, window)
        top_b = logp_b.argmax(-1)
        nll_b.append(-logp_b.gather(1, targets[:, None])[:, 0])
        if engine == Engine.torch:
            logp_q = _torch_logprobs(quant_side, window)
            nll_q.append(-logp_q.gather(1, targets[:, None])[:, 0])
            kld.append(kl_divergence(logp_b, logp_q))
            top5_q = logp_q.topk(VLLM_TOP_K, dim=-1).indices
        else:
            nll, top5_q = quant_side.score(window)
            nll_q.append(nll)
        agree.append(top5_q[:, 0] == top_b)
        top5.append((top5_q == top_b[:, None]).any(dim=-1))
        if progress:
            progress(len(window) - 1, total)
    return EvalResult(
        positions=total,
        ppl_base=perplexity(torch.cat(nll_b)),
        ppl_quant=perplexity(torch.cat(nll_q)),
        kld=float(torch.cat(kld).mean()) if kld else None,
        top1_agreement=float(torch.cat(agree).float().mean()),
        top5_containment=float(torch.cat(top5).float().mean()),
        engine=engine.value,
    )


def verdict(result: EvalResult) -> str:
    """One line that says how much the quantization costs on this text."""
    rel = result.delta_ppl / result.ppl_base
    if rel < 0.01:
        level = "near-lossless"
    elif rel < 0.05:
        level = "a small loss"
    elif rel < 0.15:
        level = "a noticeable loss"
    else:
        level = "a large loss: try --group-size 32 or --method search"
    return f"verdict: {level} (PPL {result.ppl_base:.2f} -> {result.ppl_quant:.2f}, {rel:+.1%})"


def _torch_logprobs(model, window: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([window])).logits[0, :-1]
    return logits.float().log_softmax(dim=-1)


class _VllmScorer:
    """Prompt logprobs from a vLLM engine serving the quantized checkpoint."""

    def __init__(self, quant: Path, context: int):
        from vllm import LLM

        self.llm = LLM(
            model=str(quant), max_model_len=context + 1, enforce_eager=True, kv_cache_memory_bytes=1 << 30
        )

    def score(self, window: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """NLL of each next token and the top-5 token ids at each position."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=VLLM_TOP_K)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=window)], params, use_tqdm=False)[0]
        nll, top = [], []
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
            nll.append(-entry[window[i]].logprob)
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= VLLM_TOP_K)
            top.append([t for _, t in ranked][:VLLM_TOP_K])
        return torch.tensor(nll), torch.tensor(top)

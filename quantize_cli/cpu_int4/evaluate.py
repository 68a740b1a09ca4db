"""`cpu-int4 eval`: what 4 bits cost, measured on a text against the base model.

Both sides run in PyTorch on the CPU; the quantized weights come back through the runtime's own
dequantizer (cpu_int4.dequantized). With engine="vllm" the quantized side is served by vLLM
instead (prompt logprobs), which gives PPL and top-k agreement but not full distributions, so
no KL divergence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

Progress = Callable[[int, int], None]  # (positions just scored, total positions)
VLLM_TOP_K = 5


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


def load_tokens(tokenizer_dir: Path, text_file: Path, max_tokens: int | None) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir).encode(text_file.read_text(), add_special_tokens=False)
    return ids[:max_tokens] if max_tokens else ids


def evaluate(
    base: Path,
    quant: Path,
    text: Path,
    context: int = 1024,
    max_tokens: int | None = None,
    engine: str = "torch",
    progress: Progress | None = None,
) -> EvalResult:
    """Compare BASE and its cpu_int4 output QUANT on a text."""
    from transformers import AutoModelForCausalLM

    from .dequantized import load_reference_model

    ids = load_tokens(quant, text, max_tokens)
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    quant_side = load_reference_model(quant) if engine == "torch" else _VllmScorer(quant, context)
    total = sum(len(w) - 1 for w in windows(ids, context))
    nll_b, nll_q, kld, agree, top5 = [], [], [], [], []
    for window in windows(ids, context):
        targets = torch.tensor(window[1:])
        logp_b = _torch_logprobs(base_model, window)
        top_b = logp_b.argmax(-1)
        nll_b.append(-logp_b.gather(1, targets[:, None])[:, 0])
        if engine == "torch":
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
        engine=engine,
    )


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

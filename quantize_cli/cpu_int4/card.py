"""The model card (README.md) written into OUT: Hub metadata plus how it was made and served."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from .summary import Summary

CARD_TAGS = ["cpu-int4", "4-bit", "w4a16", "int4", "cpu", "vllm"]


def source_license(source: Path) -> str | None:
    """The license from the source model's card metadata, when it has one."""
    readme = source / "README.md"
    if not readme.is_file():
        return None
    try:
        return ModelCard.load(readme).data.license
    except Exception:  # a card without valid metadata simply has no license to carry over
        return None


def render_card(
    summary: Summary, base_model: str | None, command: str, repo_id: str | None, quality: str | None = None
) -> str:
    """The card text: YAML metadata that huggingface_hub parses, then the body."""
    data = ModelCardData(
        base_model=base_model,
        base_model_relation="quantized" if base_model else None,
        library_name="vllm",
        pipeline_tag="text-generation",
        tags=CARD_TAGS,
        license=source_license(summary.source),
    )
    plan = summary.plan
    name = base_model or summary.source.name
    kept = "\n".join(f"| `{name}` | {why} |" for name, why in plan.kept_rows())
    kept_table = f"| layer | why |\n|---|---|\n{kept}" if kept else "None: every linear layer is 4-bit."
    body = f"""
# {name} — cpu-int4 (4-bit, W4A16)

This is [{name}]({_link(base_model)}) quantized to 4-bit group-wise weights with
[cpu-int4](https://pypi.org/project/cpu-int4/), for fast single-stream decoding on CPUs with vLLM.
Activations stay bf16; weights are 4-bit codes with a bf16 scale and offset per group of
{plan.group_size} ({plan.bits_per_weight:.2f} bits per quantized weight).

## How it was made

```
{command}
```

| | |
|---|---|
| method | {summary.method} |
| group size | {plan.group_size} |
| quantized layers | {len(plan.quantized)} ({plan.quantized_params / 1e6:.1f}M weights) |
| embedding quantized | {_embedding_line(plan)} |{_experts_row(plan)}
| size | {_size(summary.input_bytes)} → {_size(summary.output_bytes)} |
| bits per weight, whole checkpoint | {summary.bits_per_weight_overall:.2f} |
| tensor-parallel sizes it serves at | {", ".join(map(str, plan.tp_sizes))} |
| tools | {_versions()} |

Layers kept in full precision:

{kept_table}

## Serve it

```
pip install "cpu-int4[serve]"
vllm serve {repo_id or summary.out.name}
```

`pip install` registers the cpu_int4 plugin with vLLM; no flag or import is needed. Then:

```python
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
reply = client.chat.completions.create(
    model=client.models.list().data[0].id,
    messages=[{{"role": "user", "content": "Hello!"}}],
)
print(reply.choices[0].message.content)
```

or `curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json'
-d '{{"model": "...", "messages": [{{"role": "user", "content": "Hello!"}}]}}'`.

## Quality

{quality or "No evaluation was run for this upload."}
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}").content


def write_card(
    folder: Path, summary: Summary, base_model: str | None, command: str, repo_id: str | None
) -> None:
    """Write README.md into the (staging) output folder."""
    (folder / "README.md").write_text(render_card(summary, base_model, command, repo_id))


def _embedding_line(plan) -> str:
    if not plan.quantize_embedding:
        return "no"
    return "yes, and the tied output head shares it" if plan.tied else "yes"


def _link(base_model: str | None) -> str:
    return f"https://huggingface.co/{base_model}" if base_model else "#"


def _experts_row(plan) -> str:
    """A table row for mixture-of-experts models; nothing for dense ones."""
    count = plan.experts()
    if not count.experts:
        return ""
    return f"\n| experts quantized | {count.experts} in {count.layers} MoE layers (routers stay bf16) |"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _versions() -> str:
    names = ["cpu-int4", "torch", "transformers", "safetensors", "huggingface_hub"]
    found = []
    for n in names:
        try:
            found.append(f"{n} {importlib.metadata.version(n)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


QUALITY_HEADING = "## Quality\n"


def add_quality_to_card(folder: Path, result, text: Path) -> None:
    """Replace the card's Quality section with the eval's figures."""
    card = folder / "README.md"
    kld = "n/a" if result.kld is None else f"{result.kld:.4f}"
    section = (
        f"{QUALITY_HEADING}\nMeasured with `cpu-int4 eval` on `{text.name}` ({result.positions} positions, "
        f"{result.engine} engine):\n\n"
        "| PPL base | PPL quantized | ΔPPL | mean KLD | top-1 agreement | base top-1 in quant top-5 |\n"
        "|---|---|---|---|---|---|\n"
        f"| {result.ppl_base:.3f} | {result.ppl_quant:.3f} | {result.delta_ppl:+.3f} | {kld} "
        f"| {result.top1_agreement:.2%} | {result.top5_containment:.2%} |\n"
    )
    head = card.read_text().split(QUALITY_HEADING)[0]
    card.write_text(head + section)

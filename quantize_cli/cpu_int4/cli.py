"""The `cpu-int4` command line: thin Typer commands over the library functions."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from cpu_int4_vllm.format import DEFAULT_GROUP_SIZE, DEFAULT_METHOD, GROUP_SIZES
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from .card import add_quality_to_card
from .errors import UserError
from .evaluate import Engine, verdict
from .hub import push
from .methods import Method
from .quantize import DEFAULT_SHARD_SIZE, quantize
from .summary import Summary

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Quantize HF checkpoints to 4-bit for vLLM on CPUs."
)
console = Console(stderr=True)


@app.callback()
def main() -> None:
    """cpu-int4: 4-bit group-wise (W4A16) checkpoints that vLLM serves on the CPU."""


@contextlib.contextmanager
def _progress_bar(description: str, bytes_: bool = True):
    """A transient Rich bar on stderr: over bytes (quantize) or positions (eval)."""
    columns = [DownloadColumn(), TransferSpeedColumn()] if bytes_ else [MofNCompleteColumn()]
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        *columns,
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        yield bar, bar.add_task(description, total=None)


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _terminate(signum, frame) -> None:
    # Turn SIGTERM into an exception so the staging directory is cleaned up on the way out.
    raise SystemExit(128 + signum)


@app.command("quantize")
def quantize_cmd(
    model: Annotated[str, typer.Argument(help="Local checkpoint folder, or a Hub id (org/name).")],
    out: Annotated[Path, typer.Argument(help="Output directory (created atomically).")],
    group_size: Annotated[
        int, typer.Option(help=f"Weights per scale/zero pair: one of {', '.join(map(str, GROUP_SIZES))}.")
    ] = DEFAULT_GROUP_SIZE,
    ignore: Annotated[
        list[str] | None,
        typer.Option(
            help="Keep a module in full precision: exact name, dotted suffix, or re:<regex>. Repeatable."
        ),
    ] = None,
    quantize_embedding: Annotated[
        bool, typer.Option(help="Quantize the token embedding (and a tied head).")
    ] = True,
    tp: Annotated[
        int,
        typer.Option(help="Tensor-parallel size to serve at: layers whose share would break keep bf16."),
    ] = 1,
    max_shard_size: Annotated[
        str, typer.Option(help="Largest output shard, e.g. 5GB or 500MB.")
    ] = DEFAULT_SHARD_SIZE,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it exists.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and write nothing.")] = False,
    method: Annotated[
        Method, typer.Option(help="minmax (fast, reproduces each group's extremes) or search (lower error).")
    ] = DEFAULT_METHOD,
    revision: Annotated[
        str | None, typer.Option(help="Branch, tag or commit when MODEL is a Hub id.")
    ] = None,
    push_to_hub: Annotated[
        str | None, typer.Option(help="Upload OUT to this Hub repo (org/name) when done.")
    ] = None,
    private: Annotated[bool, typer.Option(help="Create the Hub repo as private.")] = False,
) -> None:
    """Quantize MODEL (local folder or Hub id) into OUT: group-wise 4-bit codes, bf16 scale/zero."""
    signal.signal(signal.SIGTERM, _terminate)
    with _progress_bar("quantizing") as (bar, task):
        try:
            summary = quantize(
                model,
                out,
                group_size=group_size,
                ignore=ignore or [],
                quantize_embedding=quantize_embedding,
                max_shard_size=max_shard_size,
                overwrite=overwrite,
                dry_run=dry_run,
                method=Method(method).value,
                tp=tp,
                revision=revision,
                push_to_hub=push_to_hub,
                private=private,
                command=_command_line(),
                progress=lambda done, total: bar.update(task, advance=done, total=total),
            )
        except UserError as err:
            bar.stop()
            _fail(str(err))
    print_summary(summary)


@app.command("push")
def push_cmd(
    out: Annotated[Path, typer.Argument(help="A folder written by `cpu-int4 quantize`.")],
    repo_id: Annotated[str, typer.Argument(help="Hub repo to create or update, org/name.")],
    private: Annotated[bool, typer.Option(help="Create the repo as private.")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to push to (created if needed).")] = None,
    commit_message: Annotated[str | None, typer.Option(help="Message of the single commit.")] = None,
) -> None:
    """Upload OUT to the Hugging Face Hub in one commit (its README.md is the model card)."""
    try:
        url = push(out, repo_id, private=private, revision=revision, commit_message=commit_message)
    except UserError as err:
        _fail(str(err))
    Console().print(f"pushed {out} to {url}")


@app.command("eval")
def eval_cmd(
    base: Annotated[Path, typer.Argument(help="The original checkpoint.")],
    quant: Annotated[Path, typer.Argument(help="Its cpu_int4 output.")],
    text: Annotated[Path, typer.Option(help="UTF-8 text to score, e.g. WikiText-2's wiki.test.raw.")],
    context: Annotated[int, typer.Option(help="Tokens per window (stride = context).")] = 1024,
    max_tokens: Annotated[int | None, typer.Option(help="Score at most this many tokens.")] = None,
    engine: Annotated[
        Engine, typer.Option(help="torch (reference) or vllm (served) for the quantized side.")
    ] = Engine.torch,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the figures as JSON here.")
    ] = None,
    card: Annotated[bool, typer.Option(help="Add the figures to QUANT's model card (README.md).")] = False,
) -> None:
    """Perplexity, KL divergence and top-k agreement of QUANT against BASE on a text."""
    from .evaluate import evaluate

    if card and not (quant / "README.md").is_file():
        _fail(f"--card: {quant / 'README.md'} does not exist; quantize with cpu-int4 to get a card")
    with _progress_bar("scoring", bytes_=False) as (bar, task):
        try:
            result = evaluate(
                base,
                quant,
                text,
                context=context,
                max_tokens=max_tokens,
                engine=engine,
                progress=lambda done, total: bar.update(task, advance=done, total=total),
            )
        except UserError as err:
            bar.stop()
            _fail(str(err))
    print_eval(result)
    if json_out:
        json_out.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    if card:
        add_quality_to_card(quant, result, text)


@app.command("doctor")
def doctor_cmd(
    fix: Annotated[bool, typer.Option(help="Repair what can be repaired, and say what was done.")] = False,
) -> None:
    """Check that vLLM can serve cpu_int4 checkpoints here (metadata, companions, plugin, kernels)."""
    from .doctor import run_checks

    out = Console()
    checks = run_checks(fix=fix)
    for check in checks:
        mark = "[green]ok[/green]  " if check.ok else "[red]FAIL[/red]"
        out.print(f"{mark} {check.name}: {check.detail}", highlight=False, soft_wrap=True)
    if not all(check.ok for check in checks):
        raise typer.Exit(1)


def print_eval(result) -> None:
    """The eval table and a one-line verdict."""
    table = Table("metric", "value", box=None, padding=(0, 2))
    table.add_row("positions scored", f"{result.positions}")
    table.add_row("PPL base", f"{result.ppl_base:.3f}")
    table.add_row("PPL quantized", f"{result.ppl_quant:.3f}")
    table.add_row("ΔPPL", f"{result.delta_ppl:+.3f} ({result.delta_ppl / result.ppl_base:+.1%})")
    table.add_row(
        "mean KLD (base ‖ quant)", "n/a (vllm engine)" if result.kld is None else f"{result.kld:.4f}"
    )
    table.add_row("top-1 agreement", f"{result.top1_agreement:.2%}")
    table.add_row("base top-1 in quant top-5", f"{result.top5_containment:.2%}")
    out = Console()
    out.print(table)
    out.print(verdict(result))


def _command_line() -> str:
    """The command as the user typed it, for the model card."""
    return shlex.join(["cpu-int4", *sys.argv[1:]])


def print_summary(summary: Summary) -> None:
    """The end-of-run report: sizes, bits per weight, layers kept and why, time."""
    plan = summary.plan
    out = Console()
    title = "plan (dry run, nothing written)" if summary.dry_run else f"wrote {summary.out}"
    out.print(f"[bold]{title}[/bold]")
    out.print(
        f"  {_gb(summary.input_bytes)} -> {_gb(summary.output_bytes)}"
        f" ({summary.input_bytes / max(summary.output_bytes, 1):.2f}x smaller)"
    )
    out.print(
        f"  {len(plan.quantized)} layers quantized ({plan.quantized_params / 1e6:.1f}M weights)"
        f" at {plan.bits_per_weight:.2f} bits/weight, group size {plan.group_size}, {summary.method};"
        f" whole checkpoint {summary.bits_per_weight_overall:.2f} bits/weight"
    )
    experts = plan.experts()
    if experts.experts:
        out.print(
            f"  of which experts: {experts.experts} in {experts.layers} MoE layer{'s' * (experts.layers > 1)}"
            f" ({experts.params / 1e6:.1f}M weights,"
            f" {_gb(experts.source_bytes)} -> {_gb(experts.output_bytes)},"
            f" {8 * experts.output_bytes / experts.params:.2f} bits/weight); routers stay bf16"
        )
    sizes = ", ".join(map(str, plan.tp_sizes))
    out.print(f"  serves at tensor-parallel sizes {sizes} (vLLM's --tensor-parallel-size)")
    if plan.kept_layers:
        table = Table("kept in full precision", "why", box=None, padding=(0, 2))
        for name, why in plan.kept_rows():
            table.add_row(name, why)
        out.print(table)
    dropped = [c for c in plan.choices if c.action == "drop"]
    for c in dropped:
        out.print(f"  dropped {c.info.name} ({c.reason})")
    if not summary.dry_run:
        out.print(f"  copied {', '.join(summary.copied_files) or 'no other files'}")
        out.print(f"  took {summary.seconds:.2f} s")
    if summary.url:
        out.print(f"  pushed to {summary.url}")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"

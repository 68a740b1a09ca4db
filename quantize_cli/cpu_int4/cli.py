"""The `cpu-int4` command line: thin Typer commands over the library functions."""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .errors import QuantizeError
from .hub import push
from .quantize import Summary, quantize

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Quantize HF checkpoints to 4-bit for vLLM on CPUs."
)
console = Console(stderr=True)


@app.callback()
def main() -> None:
    """cpu-int4: 4-bit group-wise (W4A16) checkpoints that vLLM serves on the CPU."""


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _terminate(signum, frame) -> None:
    # Turn SIGTERM into an exception so the staging directory is cleaned up on the way out.
    raise SystemExit(128 + signum)


@app.command("quantize")
def quantize_cmd(
    model: Annotated[str, typer.Argument(help="Local HF checkpoint directory.")],
    out: Annotated[Path, typer.Argument(help="Output directory (created atomically).")],
    group_size: Annotated[int, typer.Option(help="Weights per scale/zero pair: 32, 64, 128 or 256.")] = 64,
    ignore: Annotated[
        list[str] | None,
        typer.Option(
            help="Keep a module in full precision: exact name, dotted suffix, or re:<regex>. Repeatable."
        ),
    ] = None,
    quantize_embedding: Annotated[
        bool, typer.Option(help="Quantize the token embedding (and a tied head).")
    ] = True,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB or 500MB.")] = "5GB",
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it exists.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and write nothing.")] = False,
    revision: Annotated[
        str | None, typer.Option(help="Branch, tag or commit when MODEL is a Hub id.")
    ] = None,
    push_to_hub: Annotated[
        str | None, typer.Option(help="Upload OUT to this Hub repo (org/name) when done.")
    ] = None,
    private: Annotated[bool, typer.Option(help="Create the Hub repo as private.")] = False,
) -> None:
    """Quantize MODEL (local folder or Hub id) into OUT: min/max group-wise 4-bit, bf16 scale/zero."""
    signal.signal(signal.SIGTERM, _terminate)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("quantizing", total=None)
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
                revision=revision,
                push_to_hub=push_to_hub,
                private=private,
                command=_command_line(),
                progress=lambda done, total: bar.update(task, advance=done, total=total),
            )
        except QuantizeError as err:
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
    except QuantizeError as err:
        _fail(str(err))
    Console().print(f"pushed {out} to {url}")


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
        f" at {plan.bits_per_weight:.2f} bits/weight, group size {plan.group_size};"
        f" whole checkpoint {summary.bits_per_weight_overall:.2f} bits/weight"
    )
    if plan.kept_layers:
        table = Table("kept in full precision", "why", box=None, padding=(0, 2))
        for c in plan.kept_layers:
            table.add_row(c.info.name, c.reason)
        out.print(table)
    dropped = [c for c in plan.choices if c.action == "drop"]
    for c in dropped:
        out.print(f"  dropped {c.info.name} ({c.reason})")
    if not summary.dry_run:
        out.print(f"  copied {', '.join(summary.copied_files) or 'no other files'}")
        out.print(f"  took {summary.seconds:.1f} s")
    if summary.url:
        out.print(f"  pushed to {summary.url}")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"

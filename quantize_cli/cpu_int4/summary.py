"""What a quantize run did: the record the CLI prints and the model card describes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cpu_int4_vllm.format import DEFAULT_METHOD

from .plan import Plan


@dataclass
class Summary:
    """What a run did (or, with dry_run, would do)."""

    source: Path
    out: Path
    plan: Plan
    input_bytes: int
    output_bytes: int
    total_params: int
    method: str = DEFAULT_METHOD
    seconds: float = 0.0
    dry_run: bool = False
    url: str | None = None  # the Hub repo, when pushed
    copied_files: list[str] = field(default_factory=list)

    @property
    def bits_per_weight_overall(self) -> float:
        return 8 * self.output_bytes / max(self.total_params, 1)

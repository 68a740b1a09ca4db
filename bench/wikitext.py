"""Where tests and benchmarks find the WikiText-2 test text: one setting, one clear message.

`CPU_INT4_WIKITEXT` names the file; by default it is `wiki.test.raw` in the project's data
folder, `../shared/data/` beside the checkout (SHA-256 4f3e427e...4103c, CC BY-SA 3.0 / GFDL).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wiki.test.raw"


def wiki_text() -> Path:
    """The text file, or FileNotFoundError saying how to point at it."""
    path = Path(os.environ.get("CPU_INT4_WIKITEXT") or DEFAULT)
    if not path.is_file():
        raise FileNotFoundError(
            f"WikiText-2 test text not found at {path}; set CPU_INT4_WIKITEXT to a copy of wiki.test.raw"
        )
    return path

"""The output directory, written atomically: staged beside OUT, moved into place at the end."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import QuantizeError

_STAGING = ".cpu-int4-staging"


class OutputDir:
    """Validates OUT up front and hands out a staging directory that becomes OUT on success."""

    def __init__(self, path: Path, overwrite: bool, source: Path | None = None):
        self.path = path.expanduser().absolute()
        if source is not None:
            self.check_outside(source)
        self._remove_stale()  # first: it may put back an OUT that a killed run had set aside
        if self.path.exists():
            if not self.path.is_dir():
                raise QuantizeError(f"OUT {path} exists and is not a directory")
            if any(self.path.iterdir()) and not overwrite:
                raise QuantizeError(f"OUT {path} exists and is not empty; pass --overwrite to replace it")

    def check_outside(self, source: Path) -> None:
        """Refuse an OUT that is MODEL itself or inside it (replacing it would destroy the input)."""
        resolved = self.path.resolve()
        if resolved == source or source in resolved.parents:
            raise QuantizeError(f"OUT {self.path} is inside MODEL {source}; choose a directory outside it")

    def _sibling(self, kind: str, pid: int) -> Path:
        return self.path.parent / f".{self.path.name}{_STAGING}-{kind}-{pid}"

    def _remove_stale(self) -> None:
        """Clean up after a run that was killed (its process is gone): its new output is
        removed; its set-aside old OUT is put back if OUT is missing, so no run loses it."""
        for stale in sorted(self.path.parent.glob(f".{self.path.name}{_STAGING}-*")):
            kind, _, pid = stale.name.removeprefix(f".{self.path.name}{_STAGING}-").partition("-")
            if _alive(int(pid) if pid.isdigit() else 0):
                continue
            if kind == "old" and not self.path.exists():
                stale.rename(self.path)
            else:
                shutil.rmtree(stale, ignore_errors=True)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """Yield an empty staging directory; on success it replaces OUT, on any failure it is removed."""
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp = self._sibling("new", os.getpid())
            tmp.mkdir()
        except OSError as err:
            raise QuantizeError(f"cannot create OUT in {parent}: {err.strerror}") from err
        try:
            yield tmp
            self._move_into_place(tmp)
        except OSError as err:
            raise QuantizeError(_describe_os_error(err, self.path)) from err
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _move_into_place(self, tmp: Path) -> None:
        """Two renames; if the second fails, the old OUT is renamed back before the error."""
        old = self._sibling("old", os.getpid())
        if not self.path.exists():
            tmp.rename(self.path)
            return
        self.path.rename(old)
        try:
            tmp.rename(self.path)
        except OSError:
            old.rename(self.path)
            raise
        shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def _describe_os_error(err: OSError, out: Path) -> str:
    if err.errno == errno.ENOSPC:
        return f"no space left on the device while writing {out}; nothing was written"
    return f"writing {out} failed: {err.strerror or err}; nothing was written"

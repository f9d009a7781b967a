"""Atomic file output: a file either appears complete under its final name or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success fsync it and rename it to ``path``.

    On any exception the temporary file is removed and ``path`` is left untouched, so an
    interrupted run never leaves a file that looks complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual mode
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_readable_file(path: str | os.PathLike, argument: str) -> Path:
    """Return ``path`` as a Path, or raise ValueError naming the argument when it is not a readable file."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{argument}: file not found: {str(p)!r}")
    if not p.is_file():
        raise ValueError(f"{argument}: not a regular file: {str(p)!r}")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{argument}: file is not readable: {str(p)!r}")
    return p


def read_text_range(path: str | os.PathLike, start: int, end: int) -> tuple[str, bool]:
    """Bytes ``[start, end)`` of a file as UTF-8 text; invalid bytes become U+FFFD (then the flag is True)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True

"""A named pipe for tests of commands that read a file once from its start (``<(cmd)``, a FIFO), and a
text stream that says it is a terminal."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fifo_holding(path: Path, data: bytes) -> Iterator[Path]:
    """A FIFO at ``path`` that a thread fills with ``data`` once a reader opens it; on the way out a
    writer still waiting (the command refused the path without opening it) is let go."""
    os.mkfifo(path)

    def write():
        try:
            with open(path, "wb") as f:  # waits for the reader
                f.write(data)
        except OSError:
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        if writer.is_alive():
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(10)


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: tqdm draws its bar there (``disable=None``)."""

    def isatty(self) -> bool:
        return True

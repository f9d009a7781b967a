"""Freed by reference counts alone: Python's cyclic garbage collector held off for a block."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic collector off for the block (on again after it, where it was on): an object
    dropped inside is freed at once or not at all there, so one that a reference cycle holds
    stays alive, whenever a collection would have come."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()

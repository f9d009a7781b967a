"""The checks of layer options, for layers and configs alike: a string choice (``norm``, ``ffn``,
``attn_impl``, ...), a size, a positive number. A layer built with a wrong one would otherwise fail
only at its first forward (``MultiHeadAttention(16, 2.0)``: a reshape TypeError) or compute NaN
(``RMSNorm(4, eps=-1)``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    """Raise ``ValueError("{name} must be one of {allowed}, got {value!r}")`` unless ``value`` is allowed."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_size(name: str, value: object) -> None:
    """Raise ``ValueError("{name} must be a positive integer, got {name}={value!r}")`` unless ``value`` is
    a whole number > 0 (not a bool, not a float such as 2.0)."""
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")


def check_positive(name: str, value: object) -> None:
    """Raise ``ValueError("{name} must be a positive finite number, got {name}={value!r}")`` unless
    ``value`` is a real number in (0, inf)."""
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf):
        raise ValueError(f"{name} must be a positive finite number, got {name}={value!r}")

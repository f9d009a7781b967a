"""Checks of arguments shared by the layers, the data and the configs, one message for each kind:
``"{name} must be a positive integer, got {name}={value!r}"`` and the like."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

# torch.manual_seed takes [-2**63, 2**64 - 1] (a negative seed is the same as 2**64 + seed) and numpy's
# PCG64, which draws the training windows, refuses negative seeds: a seed is a whole number in [0, 2**64 - 1].
SEED_MAX = 2**64 - 1


def is_count(value: object, minimum: int = 0) -> bool:
    """Whether ``value`` is an integer (numpy's too; not a bool, not a float such as 2.0) of at
    least ``minimum``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def check_size(name: str, value: object) -> None:
    """Raise ``ValueError("{name} must be a positive integer, got {name}={value!r}")`` unless
    :func:`is_count` ``(value, 1)``."""
    if not is_count(value, 1):
        raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")


def as_real(value: object) -> float | None:
    """``value`` as a float if it is a real number (numpy's too) or a one-element real tensor (torch's
    optimizers take a tensor ``lr``); None for anything else, a bool included (``True`` is no rate)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    dtype = getattr(value, "dtype", None)
    if getattr(dtype, "is_floating_point", False) and value.numel() == 1:  # a torch tensor: read once
        return float(value.item())
    return None


def check_positive(name: str, value: object) -> None:
    """Raise ``ValueError("{name} must be a positive finite number, got {name}={value!r}")`` unless
    ``value`` is a real number in (0, inf) (:func:`as_real`: a one-element tensor too)."""
    real = as_real(value)
    if real is None or not 0 < real < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {name}={value!r}")


def check_non_negative(name: str, value: object, where: str = "") -> None:
    """Raise ``ValueError("{where}{name} must be a finite number >= 0, got {name}={value!r}")`` unless
    ``value`` is one (:func:`as_real`: a one-element tensor too); NaN and inf are not."""
    real = as_real(value)
    if real is None or not 0 <= real < math.inf:
        raise ValueError(f"{where}{name} must be a finite number >= 0, got {name}={value!r}")


def check_flag(name: str, value: object, *, none_ok: bool = False) -> None:
    """Raise ``ValueError("{name} must be True or False, got {name}={value!r}")`` unless ``value`` is
    a bool (numpy's too; or None with ``none_ok``): a string is truthy, so ``compile="no"`` compiled."""
    if not (isinstance(value, (bool, np.bool_)) or none_ok and value is None):
        raise ValueError(f"{name} must be True or False{' or None' if none_ok else ''}, got {name}={value!r}")


def check_dropout(value: object, name: str = "dropout") -> None:
    """Raise ``ValueError("{name} must be a number in [0, 1), got {value!r}")`` unless it is one (a
    dropout of 1 drops everything; NaN fails every comparison)."""
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 <= value < 1):
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")


def check_seed(seed: Any, argument: str) -> int:
    """``seed`` as an int if it is a whole number in [0, 2**64 - 1], else a ValueError naming ``argument``."""
    if not (is_count(seed) and seed <= SEED_MAX):
        raise ValueError(f"{argument}: must be a whole number in [0, 2**64-1], got {seed!r}")
    return int(seed)


def check_rank(rank: object, world_size: int) -> None:
    """Raise ``ValueError("rank must be an integer in [0, world_size=N), got rank=...")`` unless it is one."""
    if not is_count(rank) or rank >= world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got rank={rank!r}")


def check_callback(name: str, value: object) -> None:
    """Raise ``ValueError("{name} must be a callable or None, got {name}={value!r}")`` unless ``value``
    is None or callable: ``on_token=5`` had failed only when the first token was chosen."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be a callable or None, got {name}={value!r}")

"""Checks of arguments shared by the layers, the data and the configs, one message for each kind:
``"{name} must be a positive integer, got {name}={value!r}"`` and the like."""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

# torch.manual_seed takes [-2**63, 2**64 - 1] (a negative seed is the same as 2**64 + seed) and numpy's
# PCG64, which draws the training windows, refuses negative seeds: a seed is a whole number in [0, 2**64 - 1].
SEED_MAX = 2**64 - 1


def is_count(value: object, minimum: int = 0) -> bool:
    """Whether ``value`` is an integer (numpy's too; not a bool, not a float such as 2.0) of at
    least ``minimum``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def is_real(x) -> bool:  # (a tensor is no sampling argument: generate() and the server take numbers)
    """A real number (a Python or numpy int or float), not a bool (``True`` is not a temperature)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


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
    if not (is_real(value) and 0 <= value < 1):
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


# -- decoding arguments: here, without torch, so that a command line can refuse a bad flag before
# importing torch (seconds) and loading a model; lm.generate checks the same way with the same words


def as_integer(x) -> int | None:
    """``x`` as an int when it is an integer (an int, a numpy integer: ``operator.index``) but not a
    bool; else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def check_sampling_args(temperature: float, top_p: float, top_k: int | None) -> None:
    """A ValueError naming the argument and its value unless ``temperature`` is a finite real number
    >= 0, ``top_p`` one in (0, 1] (neither a bool) and ``top_k`` None or a positive integer (an int or
    a numpy integer). A None or a string had raised a TypeError from the comparison, naming nothing."""
    if not is_real(temperature) or not 0 <= temperature < float("inf"):  # also rejects NaN; inf samples uniformly
        raise ValueError(f"temperature must be a finite number >= 0, got temperature={temperature!r}")
    check_top_p(top_p)
    check_top_k(top_k, none_ok=True)


def check_top_p(top_p: float) -> None:
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got top_p={top_p!r}")


def check_top_k(top_k: int | None, *, none_ok: bool) -> None:
    if (top_k is not None or not none_ok) and (as_integer(top_k) is None or top_k < 1):
        raise ValueError(f"top_k must be a positive integer{' or None' if none_ok else ''}, got top_k={top_k!r}")


MAX_ALPHA = 10.0  # GNMT tuned alpha in [0.6, 1.0]; up to 10 the length penalty is finite at any context length


def check_alpha(alpha: float) -> None:
    """The length penalty's exponent is a finite number in [0, :data:`MAX_ALPHA`]: ``((5 + L) / 6) **
    alpha`` overflows a float for larger ones on long targets (alpha 300 at 63 tokens), which was a
    traceback mid-search."""
    if not is_real(alpha) or not math.isfinite(alpha) or alpha < 0:  # '0.6' had been math.isfinite's TypeError
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    if alpha > MAX_ALPHA:
        raise ValueError(f"alpha must be at most {MAX_ALPHA:g}, got {alpha!r} (GNMT used 0.6 to 1.0; the length "
                         "penalty ((5 + length) / 6) ** alpha overflows for large ones)")


_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?")


def check_origins(origins: Sequence[str], argument: str = "allowed_origins") -> tuple[str, ...]:
    """``allowed_origins`` checked (:func:`lm.serve.app.create_app`, ``lm serve --allowed-origins``): each
    ``*`` or an origin as a browser sends it (``scheme://host[:port]``, no path, no trailing slash, which
    would never match); an error names ``argument``. Here, not in lm.serve, whose modules import torch:
    ``lm serve`` refuses a wrong origin before that import."""
    if isinstance(origins, str):
        raise ValueError(f"{argument}: a list of origins, got the string {origins!r}")
    out = []
    for origin in origins:
        if not isinstance(origin, str) or not (origin == "*" or _ORIGIN.fullmatch(origin)):
            raise ValueError(f"{argument}: {origin!r} is not an origin: give scheme://host[:port] "
                             "(http://localhost:3000; no path, no trailing slash) or *")
        out.append(origin.lower() if origin != "*" else origin)
    return tuple(out)

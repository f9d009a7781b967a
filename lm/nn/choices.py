"""The one check of a string option (``norm``, ``ffn``, ``attn_impl``, ...) for layers and configs
alike (sizes and numbers: :mod:`lm.checks`)."""

from __future__ import annotations

from collections.abc import Iterable


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    """Raise ``ValueError("{name} must be one of {allowed}, got {value!r}")`` unless ``value`` is allowed."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


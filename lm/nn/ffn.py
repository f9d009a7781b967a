"""Position-wise feed-forward networks: SwiGLU and the classic two-matrix MLP."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from lm.checks import check_size, is_count
from lm.device import check_dtype
from lm.nn.choices import check_choice
from lm.nn.functional import gelu, relu, silu
from lm.nn.linear import Linear

FFN_TYPES = ("swiglu", "silu", "relu", "gelu")


def ffn_hidden_dim(d_model: int, ffn: str = "swiglu", multiple_of: int = 64) -> int:
    """The default ``d_ff``: ``8/3 · d_model`` rounded up to a multiple of 64 for SwiGLU
    (three matrices cost as much as two of width ``4 · d_model``), else ``4 · d_model``.

    >>> ffn_hidden_dim(256), ffn_hidden_dim(256, "gelu")
    (704, 1024)
    """
    check_choice("ffn", ffn, FFN_TYPES)
    for name, value in (("d_model", d_model), ("multiple_of", multiple_of)):
        if not is_count(value, 1):  # 1.5 had given 43.5, 0 a ZeroDivisionError, -64 a width of 0
            raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
    if ffn != "swiglu":
        return 4 * d_model
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


class SwiGLU(torch.nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        check_size("d_model", d_model)
        check_size("d_ff", d_ff)
        check_dtype("dtype", dtype)
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class MLP(torch.nn.Module):
    """``w2(act(w1 x))`` with ``act`` one of silu, relu, gelu (Vaswani et al. use relu)."""

    _ACTIVATIONS = {"silu": silu, "relu": relu, "gelu": gelu}

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", device=None, dtype=None):
        super().__init__()
        check_size("d_model", d_model)
        check_size("d_ff", d_ff)
        check_dtype("dtype", dtype)
        check_choice("activation", activation, self._ACTIVATIONS)
        self.activation = activation
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.w2(self._ACTIVATIONS[self.activation](self.w1(x)))

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


def make_ffn(ffn: str, d_model: int, d_ff: int, device=None, dtype=None) -> torch.nn.Module:
    check_choice("ffn", ffn, FFN_TYPES)
    if ffn == "swiglu":
        return SwiGLU(d_model, d_ff, device=device, dtype=dtype)
    return MLP(d_model, d_ff, activation=ffn, device=device, dtype=dtype)

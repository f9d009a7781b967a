"""A bias-free linear layer: ``y = x Wᵀ`` with ``W`` stored ``(out_features, in_features)``."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from lm.checks import check_size
from lm.device import check_dtype
from lm.nn.functional import last_dim_error, linear


class Linear(torch.nn.Module):
    """``y = x Wᵀ`` without a bias, ``W`` stored ``(out_features, in_features)``, truncated-normal init."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        check_size("in_features", in_features)
        check_size("out_features", out_features)
        check_dtype("dtype", dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Truncated normal with variance 2 / (fan_in + fan_out), cut at ±3σ.
        std = math.sqrt(2.0 / (self.in_features + self.out_features))
        torch.nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        if x.shape[-1:] != self.weight.shape[1:]:  # einsum's message named subscripts, not the layer's width
            raise last_dim_error("x", x, "in_features", self.weight.shape[1])
        return linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

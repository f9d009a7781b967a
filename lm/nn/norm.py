"""Normalisation layers. Both compute in float32 (float64 for float64 inputs, so gradient checks in
float64 hold) and return the input dtype."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from lm.checks import check_positive, check_size
from lm.device import check_dtype
from lm.nn.functional import check_float_dtype, last_dim_error


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dimension."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        check_size("d_model", d_model)
        check_positive("eps", eps)
        check_dtype("dtype", dtype)
        self.d_model, self.eps = d_model, eps
        self.weight = torch.nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        check_float_dtype("x", x)  # an integer x came back as zeros (apifuzz19)
        if x.shape[-1:] != self.weight.shape:
            raise last_dim_error("x", x, "d_model", self.weight.shape[0])
        in_dtype = x.dtype
        x = x.to(torch.promote_types(in_dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * self.weight.to(x.dtype)).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class LayerNorm(torch.nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (biased variance)."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        check_size("d_model", d_model)
        check_positive("eps", eps)
        check_dtype("dtype", dtype)
        self.d_model, self.eps = d_model, eps
        self.weight = torch.nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        check_float_dtype("x", x)
        if x.shape[-1:] != self.weight.shape:
            raise last_dim_error("x", x, "d_model", self.weight.shape[0])
        in_dtype = x.dtype
        x = x.to(torch.promote_types(in_dtype, torch.float32))
        mean = x.mean(dim=-1, keepdim=True)
        var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(var + self.eps)
        return (x * self.weight.to(x.dtype) + self.bias.to(x.dtype)).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class Identity(torch.nn.Module):
    """Stands in for a norm when ``norm="none"``; has no parameters."""

    def forward(self, x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
        return x

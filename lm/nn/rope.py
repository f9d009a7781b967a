"""Rotary position embedding (RoFormer): rotate interleaved pairs ``(x[2i], x[2i+1])``
by the angle ``pos · theta^(-2i/d_k)``."""

from __future__ import annotations

import numbers

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lm.checks import check_positive, check_size
from lm.device import is_meta
from lm.nn.functional import check_float_dtype, check_integer_dtype, index_rows, last_dim_error, rearrange


class RotaryEmbedding(torch.nn.Module):
    """Rotates each interleaved pair of ``x``'s last dimension by ``position · theta^(-2i/d_k)``."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None):
        super().__init__()
        # theta = 0 would build NaN tables without a word (0 ** negative = inf, then inf * 0 = NaN).
        check_positive("theta", theta)
        if not (isinstance(d_k, numbers.Integral) and not isinstance(d_k, bool) and d_k > 0 and d_k % 2 == 0):
            raise ValueError(f"d_k must be a positive even int for RoPE (it rotates pairs), got d_k={d_k!r}")
        check_size("max_seq_len", max_seq_len)
        self.theta, self.d_k, self.max_seq_len = theta, d_k, max_seq_len
        self._build_tables(device)

    def _build_tables(self, device, dtype: torch.dtype = torch.float32) -> None:
        # Tables are derived from (theta, d_k, max_seq_len), so they are not saved in the state dict.
        if is_meta(device):  # a model of shapes only: no angles to compute (lm.device.is_meta)
            cos, sin = (torch.empty(self.max_seq_len, self.d_k // 2, device="meta", dtype=dtype) for _ in "cs")
        else:
            inv_freq = self.theta ** (-torch.arange(0, self.d_k, 2, device=device, dtype=torch.float64) / self.d_k)
            angles = torch.arange(self.max_seq_len, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would round the tables too; rebuild them in float32 instead,
        # on whatever device they were moved to (model.double(): in float64 from the angles, not
        # the float32 tables widened).
        before = self.cos.dtype
        super()._apply(fn, recurse)
        if self.cos.dtype != before or self.cos.dtype not in (torch.float32, torch.float64):
            self._build_tables(self.cos.device, torch.float64 if self.cos.dtype == torch.float64 else torch.float32)
        return self

    def forward(
        self, x: Float[Tensor, "... seq d_k"], token_positions: Int[Tensor, "... seq"]
    ) -> Float[Tensor, "... seq d_k"]:
        """``(x[2i], x[2i+1]) ↦ (x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos)``, in float32
        (float64 for float64 inputs, with float64 tables after ``.double()``).

        A position outside ``[0, max_seq_len)`` raises an ``IndexError`` naming it (on a CPU; on a
        GPU the kernel asserts) instead of ``cos[-1]`` reading the last position's angles: checked
        by the gather's kernel, with no read back to the host."""
        check_float_dtype("x", x)  # an integer x came back rotated and truncated (apifuzz19)
        check_integer_dtype("token_positions", token_positions)
        if x.shape[-1:] != (self.d_k,):
            raise last_dim_error("x", x, "d_k", self.d_k)
        if x.dim() < 2 or token_positions.shape[-1:] != x.shape[-2:-1]:
            raise ValueError(f"token_positions must hold one position for each of x's seq rows (x: (..., seq, d_k)), "
                             f"got shape {tuple(token_positions.shape)} for x of shape {tuple(x.shape)}")
        cos = index_rows(self.cos, token_positions, "token_positions", "max_seq_len")
        sin = index_rows(self.sin, token_positions)  # in range: the cos lookup has read the same rows
        compute = torch.promote_types(torch.promote_types(x.dtype, torch.float32), cos.dtype)
        pairs = rearrange(x.to(compute), "... seq (half two) -> ... seq half two", two=2)
        x_even, x_odd = pairs.unbind(-1)
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rearrange(rotated, "... seq half two -> ... seq (half two)").to(x.dtype)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"

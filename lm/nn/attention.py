"""Causal multi-head self-attention, optionally with RoPE and a KV cache."""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from lm.nn.functional import scaled_dot_product_attention
from lm.nn.linear import Linear
from lm.nn.rope import RotaryEmbedding

ATTN_IMPLS = ("einsum", "sdpa")


class MultiHeadSelfAttention(torch.nn.Module):
    """Heads are consecutive row blocks of ``q_proj``/``k_proj``/``v_proj``.

    ``attn_impl="einsum"`` is the hand-written reference; ``"sdpa"`` calls torch's fused
    attention kernel (same result, less memory, faster).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryEmbedding | None = None,
        device=None,
        dtype=None,
        *,
        attn_impl: str = "einsum",
    ):
        super().__init__()
        if num_heads < 1 or d_model % num_heads != 0:
            raise ValueError(f"d_model must be divisible by num_heads, got d_model={d_model}, num_heads={num_heads}")
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        if rope is not None and rope.d_k != self.head_dim:
            raise ValueError(f"rope.d_k must equal the head dimension {self.head_dim}, got {rope.d_k}")
        self.rope = rope
        self.attn_impl = attn_impl
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Int[Tensor, "... seq"] | None = None,
        kv_cache=None,
    ) -> Float[Tensor, "... seq d_model"]:
        """``kv_cache`` is one layer of :class:`lm.generate.KVCache`: the new keys and values
        are written into it and attention runs over everything cached so far."""
        seq = x.shape[-2]
        # Three matmuls on the separate weights: concatenating them into one q/k/v matmul
        # measured slower on CPU (the weight copy outweighs the saved pass over x).
        q, k, v = (
            rearrange(proj(x), "... seq (h d) -> ... h seq d", h=self.num_heads)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.rope is not None:
            if token_positions is None:
                token_positions = torch.arange(seq, device=x.device)
            positions = rearrange(token_positions, "... seq -> ... 1 seq")  # the same for every head
            q, k = self.rope(q, positions), self.rope(k, positions)
        if kv_cache is None:
            out = scaled_dot_product_attention(q, k, v, is_causal=True, impl=self.attn_impl)
        else:
            k, v, mask = kv_cache.update(k, v)  # mask None: plain causal, no padding to hide
            out = scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None, impl=self.attn_impl)
        return self.output_proj(rearrange(out, "... h seq d -> ... seq (h d)"))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, attn_impl={self.attn_impl!r}"

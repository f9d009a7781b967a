"""Multi-head attention: self-attention (causal or not) and cross-attention, one module.

The same module serves the decoder-only LM (:class:`MultiHeadSelfAttention`: causal
self-attention with RoPE and a KV cache), the encoder (self-attention over the whole source,
padding masked out) and the decoder of an encoder–decoder (cross-attention: queries from the
decoder, keys and values from the encoder output, computed once per sentence at inference).

Caches talk to attention through the two protocols below, defined here and nowhere else.
"""

from __future__ import annotations

from typing import Protocol

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lm.checks import check_size
from lm.device import check_dtype
from lm.nn.choices import check_choice
from lm.nn.functional import rearrange, scaled_dot_product_attention
from lm.nn.linear import Linear
from lm.nn.rope import RotaryEmbedding

ATTN_IMPLS = ("einsum", "sdpa")
# The layers default to the hand-written einsum, as lm.nn promises (no torch.nn.functional); the model
# configs choose torch's fused kernel, "sdpa" (the same result, less memory, faster), unless told otherwise.
DEFAULT_ATTN_IMPL = "einsum"
MODEL_ATTN_IMPL = "sdpa"


class LayerKVCache(Protocol):
    """One layer's self-attention cache (:class:`lm.generate.KVCache` hands these out).

    ``update`` stores the keys and values of the new positions and returns every cached key and
    value so far with the mask the new queries use (None: plain causal, nothing to hide).
    """

    def update(
        self, k: Float[Tensor, "batch h seq d"], v: Float[Tensor, "batch h seq d"]
    ) -> tuple[Float[Tensor, "batch h total d"], Float[Tensor, "batch h total d"], Bool[Tensor, "batch 1 seq total"]
               | None]: ...


class CrossKVCache(Protocol):
    """One layer's cross-attention keys and values, computed from the encoder output once."""

    def get(self, layer: int) -> tuple[Tensor, Tensor] | None: ...

    def put(self, layer: int, k: Tensor, v: Tensor) -> None: ...


class MultiHeadAttention(torch.nn.Module):
    """Multi-head attention, self or cross; heads are consecutive row blocks of ``q_proj``/``k_proj``/``v_proj``.

    ``forward(x)`` is self-attention (``causal`` by default); ``forward(x, context=memory)`` is
    cross-attention, never causal, without RoPE. ``key_padding_mask`` (``True`` = a real token)
    hides padded keys. ``attn_impl="einsum"`` (the default) is the hand-written reference;
    ``"sdpa"`` (the model configs' default) calls torch's fused kernel (same result, less memory).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryEmbedding | None = None,
        device=None,
        dtype=None,
        *,
        attn_impl: str = DEFAULT_ATTN_IMPL,
        causal: bool = True,
    ):
        super().__init__()
        check_size("d_model", d_model)
        check_size("num_heads", num_heads)
        if d_model % num_heads != 0:
            raise ValueError(f"d_model must be divisible by num_heads, got d_model={d_model}, num_heads={num_heads}")
        check_choice("attn_impl", attn_impl, ATTN_IMPLS)
        check_dtype("dtype", dtype)
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        if rope is not None and rope.d_k != self.head_dim:
            raise ValueError(f"rope.d_k must equal the head dimension {self.head_dim}, got {rope.d_k}")
        self.rope = rope
        self.attn_impl = attn_impl
        self.causal = causal
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)

    def _heads(self, t: Tensor) -> Tensor:
        return rearrange(t, "... seq (h d) -> ... h seq d", h=self.num_heads)

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Int[Tensor, "... seq"] | None = None,
        kv_cache: LayerKVCache | None = None,
        *,
        context: Float[Tensor, "... ctx d_model"] | None = None,
        key_padding_mask: Bool[Tensor, "... keys"] | None = None,
        cross_cache: CrossKVCache | None = None,
        layer: int = 0,
    ) -> Float[Tensor, "... seq d_model"]:
        """Self-attention over ``x`` (with ``kv_cache``: over everything cached so far too), or
        cross-attention to ``context``, whose projected keys and values ``cross_cache`` keeps
        under ``layer`` after the first call. With RoPE and a ``kv_cache``, ``token_positions`` is
        required: the cache does not say where the new tokens start."""
        # Three matmuls on the separate weights: one q/k/v matmul would copy (concatenate) the
        # weights at every call (slower on CPU, docs/benchmarks.md).
        q = self._heads(self.q_proj(x))
        if context is not None or cross_cache is not None:
            kv = cross_cache.get(layer) if cross_cache is not None else None
            if kv is None:
                if context is None:  # self.k_proj(None) would fail deep in einops
                    raise ValueError(f"context (the memory) is required: cross_cache holds no keys and values "
                                     f"for layer {layer} yet")
                kv = self._heads(self.k_proj(context)), self._heads(self.v_proj(context))
                if cross_cache is not None:
                    cross_cache.put(layer, *kv)
            k, v = kv
            out = scaled_dot_product_attention(q, k, v, _padding(key_padding_mask), impl=self.attn_impl)
            return self.output_proj(rearrange(out, "... h seq d -> ... seq (h d)"))
        k, v = self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if self.rope is not None:
            if token_positions is None and kv_cache is not None:  # arange would rotate them as 0, 1, ...
                raise ValueError("token_positions is required with kv_cache and RoPE: the positions of the new "
                                 "tokens, after the cached ones")
            if token_positions is None:
                if x.shape[-2] > self.rope.max_seq_len:  # a shape: checked for free (api22: a bare IndexError)
                    raise ValueError(f"x has {x.shape[-2]} positions, more than the rope's max_seq_len="
                                     f"{self.rope.max_seq_len}")
                token_positions = torch.arange(x.shape[-2], device=x.device)
            positions = rearrange(token_positions, "... seq -> ... 1 seq")  # the same for every head
            q, k = self.rope(q, positions), self.rope(k, positions)
        mask = _padding(key_padding_mask)
        if kv_cache is not None:
            k, v, cache_mask = kv_cache.update(k, v)  # None: plain causal, no padding to hide
            mask = cache_mask if mask is None else (mask if cache_mask is None else mask & cache_mask)
        out = scaled_dot_product_attention(q, k, v, mask, is_causal=self.causal, impl=self.attn_impl)
        return self.output_proj(rearrange(out, "... h seq d -> ... seq (h d)"))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, attn_impl={self.attn_impl!r}, " \
               f"causal={self.causal}"


def _padding(key_padding_mask: Tensor | None) -> Tensor | None:
    """``(batch, keys)`` → ``(batch, 1, 1, keys)``: the same keys hidden for every head and query."""
    return None if key_padding_mask is None else key_padding_mask[..., None, None, :]


class MultiHeadSelfAttention(MultiHeadAttention):
    """Causal multi-head self-attention (the decoder-only LM's attention), optionally with RoPE.

    ``forward(x, token_positions=None, kv_cache=None)``; the parameters are those of the CS336 interface.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryEmbedding | None = None,
        device=None,
        dtype=None,
        *,
        attn_impl: str = DEFAULT_ATTN_IMPL,
    ):
        super().__init__(d_model, num_heads, rope, device, dtype, attn_impl=attn_impl, causal=True)

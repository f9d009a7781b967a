"""One Transformer layer: attention then feed-forward, each in a residual branch with a norm."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lm.checks import check_dropout
from lm.device import check_dtype
from lm.nn.attention import DEFAULT_ATTN_IMPL, CrossKVCache, LayerKVCache, MultiHeadAttention
from lm.nn.choices import check_choice
from lm.nn.ffn import make_ffn
from lm.nn.functional import dropout
from lm.nn.norm import Identity, LayerNorm, RMSNorm
from lm.nn.rope import RotaryEmbedding

NORM_TYPES = ("rmsnorm", "layernorm", "none")
NORM_PLACEMENTS = ("pre", "post")


def make_norm(norm: str, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> torch.nn.Module:
    check_choice("norm", norm, NORM_TYPES)
    if norm == "rmsnorm":
        return RMSNorm(d_model, eps=eps, device=device, dtype=dtype)
    if norm == "layernorm":
        return LayerNorm(d_model, eps=eps, device=device, dtype=dtype)
    return Identity()


class TransformerBlock(torch.nn.Module):
    """Pre-norm (default): ``h = x + attn(ln1(x)); y = h + ffn(ln2(h))``.
    Post-norm (Vaswani et al.): ``h = ln1(x + attn(x)); y = ln2(h + ffn(h))``.

    ``theta=None`` builds the block without RoPE; pass ``rope`` to share one table
    between layers. ``dropout`` > 0 applies dropout to each branch's output (``attn(...)``,
    ``ffn(...)``) in training mode. ``causal=False`` makes it an encoder layer, whose
    ``key_padding_mask`` (``True`` = a real token) hides the padding.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int,
        theta: float | None = 10000.0,
        device=None,
        dtype=None,
        *,
        rope: RotaryEmbedding | None = None,
        norm: str = "rmsnorm",
        norm_placement: str = "pre",
        norm_eps: float = 1e-5,
        ffn: str = "swiglu",
        attn_impl: str = DEFAULT_ATTN_IMPL,
        dropout: float = 0.0,
        causal: bool = True,
    ):
        super().__init__()
        check_dropout(dropout)  # as ModelConfig, before any weight: 1.5 or NaN had been kept until training
        check_choice("norm_placement", norm_placement, NORM_PLACEMENTS)
        check_dtype("dtype", dtype)
        # num_heads < 1 (or not dividing d_model) is left to MultiHeadAttention's ValueError: here it
        # would divide by zero.
        if rope is None and theta is not None and num_heads >= 1 and d_model % num_heads == 0:
            if (d_model // num_heads) % 2 != 0:
                raise ValueError(f"head dimension d_model/num_heads must be even for RoPE, got {d_model}/{num_heads}")
            rope = RotaryEmbedding(theta, d_model // num_heads, max_seq_len, device=device)
        self.pre_norm = norm_placement == "pre"
        self.ln1 = make_norm(norm, d_model, norm_eps, device=device, dtype=dtype)
        self.attn = MultiHeadAttention(d_model, num_heads, rope, device=device, dtype=dtype, attn_impl=attn_impl,
                                       causal=causal)
        self.ln2 = make_norm(norm, d_model, norm_eps, device=device, dtype=dtype)
        self.ffn = make_ffn(ffn, d_model, d_ff, device=device, dtype=dtype)
        self.dropout = dropout

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Int[Tensor, "... seq"] | None = None,
        kv_cache: LayerKVCache | None = None,
        *,
        key_padding_mask: Bool[Tensor, "... seq"] | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        p, training = self.dropout, self.training  # residual dropout (the identity when p = 0 or in eval)

        def attn(h: Tensor) -> Tensor:
            return dropout(self.attn(h, token_positions, kv_cache, key_padding_mask=key_padding_mask), p, training)

        if self.pre_norm:
            h = x + attn(self.ln1(x))
            return h + dropout(self.ffn(self.ln2(h)), p, training)
        h = self.ln1(x + attn(x))
        return self.ln2(h + dropout(self.ffn(h), p, training))


class DecoderBlock(torch.nn.Module):
    """A decoder layer of an encoder–decoder: masked self-attention, cross-attention, feed-forward.

    Post-norm (Vaswani et al., the default here): ``a = ln1(x + self_attn(x)); c = ln2(a +
    cross_attn(a, memory)); y = ln3(c + ffn(c))``; pre-norm puts each norm at the branch's
    input instead. Submodules ``.ln1 .self_attn .ln2 .cross_attn .ln3 .ffn``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        device=None,
        dtype=None,
        *,
        rope: RotaryEmbedding | None = None,
        norm: str = "layernorm",
        norm_placement: str = "post",
        norm_eps: float = 1e-5,
        ffn: str = "relu",
        attn_impl: str = DEFAULT_ATTN_IMPL,
        dropout: float = 0.0,
    ):
        super().__init__()
        check_dropout(dropout)  # as ModelConfig, before any weight: 1.5 or NaN had been kept until training
        check_choice("norm_placement", norm_placement, NORM_PLACEMENTS)
        check_dtype("dtype", dtype)
        self.pre_norm = norm_placement == "pre"
        self.ln1 = make_norm(norm, d_model, norm_eps, device=device, dtype=dtype)
        self.self_attn = MultiHeadAttention(d_model, num_heads, rope, device=device, dtype=dtype,
                                            attn_impl=attn_impl, causal=True)
        self.ln2 = make_norm(norm, d_model, norm_eps, device=device, dtype=dtype)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, None, device=device, dtype=dtype,
                                             attn_impl=attn_impl, causal=False)
        self.ln3 = make_norm(norm, d_model, norm_eps, device=device, dtype=dtype)
        self.ffn = make_ffn(ffn, d_model, d_ff, device=device, dtype=dtype)
        self.dropout = dropout

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        memory: Float[Tensor, "... src d_model"] | None,
        *,
        memory_mask: Bool[Tensor, "... src"] | None = None,
        tgt_mask: Bool[Tensor, "... seq"] | None = None,
        token_positions: Int[Tensor, "... seq"] | None = None,
        kv_cache: LayerKVCache | None = None,
        cross_cache: CrossKVCache | None = None,
        layer: int = 0,
    ) -> Float[Tensor, "... seq d_model"]:
        """``memory_mask``/``tgt_mask``: ``True`` = a real token. With ``cross_cache`` the keys and
        values of ``memory`` are projected once and reused (``memory`` may then be None)."""
        if memory is None and cross_cache is None:  # cross-attention would attend over x itself
            raise ValueError("memory is required unless cross_cache holds the memory's keys and values")
        p, training = self.dropout, self.training

        def self_attn(h: Tensor) -> Tensor:
            out = self.self_attn(h, token_positions, kv_cache, key_padding_mask=tgt_mask)
            return dropout(out, p, training)

        def cross_attn(h: Tensor) -> Tensor:
            out = self.cross_attn(h, context=memory, key_padding_mask=memory_mask, cross_cache=cross_cache,
                                  layer=layer)
            return dropout(out, p, training)

        if self.pre_norm:
            h = x + self_attn(self.ln1(x))
            h = h + cross_attn(self.ln2(h))
            return h + dropout(self.ffn(self.ln3(h)), p, training)
        h = self.ln1(x + self_attn(x))
        h = self.ln2(h + cross_attn(h))
        return self.ln3(h + dropout(self.ffn(h), p, training))

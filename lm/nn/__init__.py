"""Hand-written layers: einops and plain tensor ops, no ``torch.nn`` layers or ``torch.nn.functional``."""

from lm.nn.attention import (
    ATTN_IMPLS,
    DEFAULT_ATTN_IMPL,
    CrossKVCache,
    LayerKVCache,
    MultiHeadAttention,
    MultiHeadSelfAttention,
)
from lm.nn.block import NORM_PLACEMENTS, NORM_TYPES, DecoderBlock, TransformerBlock, make_norm
from lm.nn.embedding import Embedding
from lm.nn.ffn import FFN_TYPES, MLP, SwiGLU, ffn_hidden_dim, make_ffn
from lm.nn.functional import (
    causal_mask,
    cross_entropy,
    dropout,
    gelu,
    linear_cross_entropy,
    relu,
    scaled_dot_product_attention,
    silu,
    softmax,
)
from lm.nn.linear import Linear
from lm.nn.norm import Identity, LayerNorm, RMSNorm
from lm.nn.rope import RotaryEmbedding

__all__ = [
    "ATTN_IMPLS",
    "DEFAULT_ATTN_IMPL",
    "FFN_TYPES",
    "MLP",
    "CrossKVCache",
    "DecoderBlock",
    "LayerKVCache",
    "MultiHeadAttention",
    "NORM_PLACEMENTS",
    "NORM_TYPES",
    "Embedding",
    "Identity",
    "LayerNorm",
    "Linear",
    "MultiHeadSelfAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TransformerBlock",
    "causal_mask",
    "cross_entropy",
    "dropout",
    "ffn_hidden_dim",
    "gelu",
    "linear_cross_entropy",
    "make_ffn",
    "make_norm",
    "relu",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
]

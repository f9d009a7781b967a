"""Hand-written layers: einops and plain tensor ops, no ``torch.nn`` layers or ``torch.nn.functional``
(but for the attention layers' opt-in ``attn_impl="sdpa"``, torch's fused kernel, which the model
configs choose by default: the same result as the einsum, less memory)."""

from lm.nn.attention import (
    CrossKVCache,
    LayerKVCache,
    MultiHeadAttention,
    MultiHeadSelfAttention,
)
from lm.nn.block import DecoderBlock, TransformerBlock
from lm.nn.embedding import Embedding
from lm.nn.ffn import MLP, SwiGLU, ffn_hidden_dim
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
from lm.nn.norm import LayerNorm, RMSNorm
from lm.nn.rope import RotaryEmbedding

__all__ = [
    "MLP",
    "CrossKVCache",
    "DecoderBlock",
    "LayerKVCache",
    "MultiHeadAttention",
    "Embedding",
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
    "relu",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
]

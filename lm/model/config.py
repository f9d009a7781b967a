"""``ModelConfig``: the single source of truth for a model's shape and architecture variant.

Round-trips through JSON and TOML. The defaults give the pre-norm RMSNorm / RoPE /
SwiGLU model of the CS336 interface (its names and state-dict keys); the Transformer of "Attention Is All You Need" is
``ModelConfig(..., norm="layernorm", norm_placement="post", positions="sinusoidal", ffn="relu")``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from lm.checks import check_dropout, is_count
from lm.nn.attention import ATTN_IMPLS, MODEL_ATTN_IMPL
from lm.nn.block import NORM_PLACEMENTS, NORM_TYPES
from lm.nn.choices import check_choice
from lm.nn.ffn import FFN_TYPES, ffn_hidden_dim
from lm.tomlio import dump_table, loads

POSITION_TYPES = ("rope", "sinusoidal", "learned", "none")


MAX_SIZE = 2**31 - 1  # the largest size (vocabulary, width, layers, context) a model config accepts


def check_architecture(cfg, sizes: tuple[str, ...]) -> None:
    """The checks every model config shares: positive sizes, known choices, heads that divide
    ``d_model``, even widths for RoPE and sinusoids, ``d_ff`` resolved to its default, a positive
    finite ``rope_theta`` and ``norm_eps``, and a bool ``tie_embeddings``.

    A numpy scalar in any field (a sweep over ``np.logspace``, a value read from an array) becomes
    the Python value it holds first: the checks then take ``np.float32(0.1)`` as ``0.1`` (not
    "must be a number, got np.float32(0.1)"), and the config is written as JSON and TOML."""
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, np.generic):
            setattr(cfg, field.name, value.item())
    for name in sizes:
        value = getattr(cfg, name)
        if not is_count(value, 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        value = int(value)  # any other Integral too (numpy's are ints already, above), kept as an int:
        setattr(cfg, name, value)  # the config is written as TOML and JSON
        if value > MAX_SIZE:  # torch's sizes are int64, and no real model comes near: refused, not a C++ error
            raise ValueError(f"{name} must be at most 2**31 - 1, got {value:,}")
    for name, allowed in (("norm", NORM_TYPES), ("norm_placement", NORM_PLACEMENTS), ("positions", POSITION_TYPES),
                          ("ffn", FFN_TYPES), ("attn_impl", ATTN_IMPLS)):
        check_choice(name, getattr(cfg, name), allowed)
    if cfg.d_model % cfg.num_heads != 0:
        raise ValueError(
            f"d_model must be divisible by num_heads, got d_model={cfg.d_model}, num_heads={cfg.num_heads}"
        )
    if cfg.positions == "rope" and cfg.head_dim % 2 != 0:
        raise ValueError(f"head dimension must be even for RoPE, got d_model/num_heads={cfg.head_dim}")
    if cfg.positions == "sinusoidal" and cfg.d_model % 2 != 0:
        raise ValueError(f"d_model must be even for sinusoidal positions, got d_model={cfg.d_model}")
    if cfg.d_ff is None:
        cfg.d_ff = ffn_hidden_dim(cfg.d_model, cfg.ffn)
    if not is_count(cfg.d_ff, 1) or cfg.d_ff > MAX_SIZE:
        raise ValueError(f"d_ff must be a positive integer of at most 2**31 - 1, got {cfg.d_ff!r}")
    cfg.d_ff = int(cfg.d_ff)
    theta = cfg.rope_theta  # NaN would pass a `<= 0` test and reach RotaryEmbedding, or be saved unused
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_theta must be a positive finite number, got {theta!r}")
    if not isinstance(cfg.tie_embeddings, bool):  # "no" would be truthy and tie the weights
        raise ValueError(f"tie_embeddings must be a bool, got {cfg.tie_embeddings!r}")
    eps = cfg.norm_eps  # a norm divides by sqrt(variance + eps): eps <= 0 can make every logit NaN
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"norm_eps must be a finite number > 0, got {eps!r}")


class ConfigIO:
    """JSON and TOML round trips for a flat dataclass config (every field a scalar)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = {k: v for k, v in d.items() if k not in known}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))

    def to_toml(self) -> str:
        """Flat ``key = value`` lines."""
        return dump_table(self.to_dict())

    @classmethod
    def from_toml(cls, text: str):
        return cls.from_dict(loads(text))

    def save(self, path: str | Path) -> None:
        """Write TOML for a ``.toml`` path, else JSON."""
        from lm.io import atomic_write

        path = Path(path)
        text = self.to_toml() if path.suffix == ".toml" else self.to_json()
        with atomic_write(path) as f:
            f.write(text)

    @classmethod
    def load(cls, path: str | Path):
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        return cls.from_toml(text) if path.suffix == ".toml" else cls.from_json(text)



@dataclass
class ModelConfig(ConfigIO):
    """The decoder-only LM (architecture ``decoder_lm``)."""

    architecture: ClassVar[str] = "decoder_lm"
    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    # None means the default for the FFN type: 8/3·d_model rounded up to a multiple of 64
    # for swiglu, else 4·d_model. Resolved to an int on construction.
    d_ff: int | None = None
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"  # rmsnorm | layernorm | none
    norm_placement: str = "pre"  # pre | post (post: no final norm, as in Vaswani et al.)
    norm_eps: float = 1e-5
    positions: str = "rope"  # rope | sinusoidal | learned | none
    ffn: str = "swiglu"  # swiglu | silu | relu | gelu
    tie_embeddings: bool = False  # lm_head shares token_embeddings.weight
    # sdpa: torch's fused attention kernel (fast, never materialises the seq × seq scores);
    # einsum: the hand-written reference it is tested against. Same parameters, same results.
    attn_impl: str = MODEL_ATTN_IMPL
    # Dropout rate, in training mode only, on the embeddings and on the output of every
    # attention and feed-forward branch (nanoGPT's embedding and residual dropout). A
    # regulariser for small data, such as Tiny Shakespeare; 0 is the usual for large corpora.
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_architecture(self, ("vocab_size", "context_length", "d_model", "num_layers", "num_heads"))
        check_dropout(self.dropout)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

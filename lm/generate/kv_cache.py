"""A preallocated key/value cache for incremental decoding.

Sequences of different lengths share one cache by *left padding*: row ``b`` starts with
``pad_lengths[b]`` unused slots. Every row then has the same number of slots filled, so one
forward of the model advances all rows by the same number of positions. Real tokens never
attend to padding slots, and their positions (for RoPE or position embeddings) start at 0
after their padding, so a padded row computes what it would compute alone.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lm.checks import check_size


class KVCache:
    """Keys and values of ``num_layers`` layers, each ``(batch, heads, max_len, head_dim)``."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        max_len: int,
        head_dim: int,
        *,
        pad_lengths: Int[Tensor, " batch"] | list[int] | None = None,
        device=None,
        dtype=torch.float32,
    ):
        shape = (num_layers, batch_size, num_heads, max_len, head_dim)
        for name, size in zip(("num_layers", "batch_size", "num_heads", "max_len", "head_dim"), shape):
            check_size(name, size)  # -1 or 2.0 had failed inside torch.zeros
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # slots filled in every row (padding included)
        if pad_lengths is None:
            pad_lengths = [0] * batch_size
        # from a list (generate's), without reading a tensor back from the device
        self._padded = bool((pad_lengths > 0).any()) if isinstance(pad_lengths, Tensor) else any(pad_lengths)
        self.pad_lengths = torch.as_tensor(pad_lengths, dtype=torch.long, device=device)
        self._slot = torch.arange(max_len, device=device)
        self._key_valid = self._slot[None, :] >= self.pad_lengths[:, None]  # (batch, max_len)
        self.step_mask: Tensor | None = None  # this step's mask (None: plain causal), set by start_step

    layers_field = "num_layers"  # the model config's number of layers with a cache

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, pad_lengths=None) -> KVCache:
        """A cache shaped for ``model`` (a :class:`lm.model.TransformerLM`), holding up to
        ``max_len`` (default ``context_length``) positions."""
        cfg = model.config
        weight = model.output_weight
        return cls(
            getattr(cfg, cls.layers_field),
            batch_size,
            cfg.num_heads,
            cfg.context_length if max_len is None else max_len,
            cfg.head_dim,
            pad_lengths=pad_lengths,
            device=weight.device,
            dtype=weight.dtype,
        )

    def start_step(self, seq: int) -> Int[Tensor, "batch seq"]:
        """Begin a forward of ``seq`` new positions: return their token positions (0 at each row's
        first real token) and set :attr:`step_mask`, the attention mask they use in every layer."""
        if self.length + seq > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {seq} new > max_len={self.max_len}")
        slots = self._slot[self.length : self.length + seq]
        if not self._padded:
            # No padding: attention is plain causal over the cache, which the fused kernel does
            # without a mask tensor.
            self.step_mask = None
            return slots[None, :].expand(len(self.pad_lengths), seq)
        end = self.length + seq
        causal = self._slot[None, :end] <= slots[:, None]  # (seq, end)
        # A padding slot attends to itself only, so its (unused) output is finite, never NaN.
        is_self = self._slot[None, :end] == slots[:, None]
        valid = self._key_valid[:, None, :end] | is_self[None]  # (batch, seq, end)
        self.step_mask = (causal[None] & valid)[:, None]  # (batch, 1, seq, end): broadcast over heads
        return (slots[None, :] - self.pad_lengths[:, None]).clamp_min(0)

    def layer(self, i: int) -> _LayerCache:
        return _LayerCache(self, i)

    def select(self, rows: Int[Tensor, " rows"]) -> None:
        """Keep (and reorder, repeat) the batch rows ``rows``, with their padding: a finished row
        leaving the batch, or beam search's reshuffle of hypotheses."""
        # one after the other, each old tensor freed as its copy is made: the peak is 1.5 caches, not 2
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]
        self.pad_lengths = self.pad_lengths[rows]
        self._key_valid = self._key_valid[rows]
        self._padded = bool((self.pad_lengths > 0).any())

    def advance(self, seq: int) -> None:
        self.length += seq


class _LayerCache:
    """One layer's view: what :class:`lm.nn.MultiHeadSelfAttention` talks to."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(
        self, k: Float[Tensor, "batch h seq d"], v: Float[Tensor, "batch h seq d"]
    ) -> tuple[Float[Tensor, "batch h total d"], Float[Tensor, "batch h total d"], Bool[Tensor, "batch 1 seq total"]]:
        c = self.cache
        start, end = c.length, c.length + k.shape[-2]
        c.k[self.index, :, :, start:end] = k
        c.v[self.index, :, :, start:end] = v
        return c.k[self.index, :, :, :end], c.v[self.index, :, :, :end], c.step_mask

"""The decoder-only Transformer language model."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lm.device import check_dtype, is_meta
from lm.model.config import ModelConfig
from lm.nn import Embedding, Linear, RotaryEmbedding, TransformerBlock, dropout, linear_cross_entropy
from lm.nn.block import make_norm
from lm.nn.functional import IntegerDtypeError, check_integer_dtype, index_rows, is_compiling, unbatched


def sinusoidal_table(num_positions: int, d_model: int, dtype: torch.dtype = torch.float32
                     ) -> Float[Tensor, "pos d_model"]:
    """Vaswani et al.: ``PE[p, 2i] = sin(p / 10000^(2i/d))``, ``PE[p, 2i+1] = cos(...)``, computed in
    float64 and given in ``dtype``."""
    if d_model % 2 != 0:  # the sin/cos pairs would give d_model + 1 columns
        raise ValueError(f"d_model must be even for sinusoidal positions, got d_model={d_model}")
    if num_positions < 0:
        raise ValueError(f"num_positions must be >= 0, got num_positions={num_positions}")
    if is_meta():  # made on torch's default device: under torch.device("meta"), a shape (lm.device.is_meta)
        return torch.empty(num_positions, d_model, dtype=dtype)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).to(dtype)


_TRUST_LOCK = threading.Lock()


@contextlib.contextmanager
def trusting(model) -> Iterator[None]:
    """``model.validate_ids`` off within the block, back as it was once the last of the blocks that
    overlap (two threads', or nested) ends. Each had restored what it found: thread A in, thread B
    in (finding it off), A out (on again, under B), B out (off for good)."""
    with _TRUST_LOCK:
        held = model.__dict__.get("_trusting", 0)
        if held == 0:
            model.__dict__["_validate_before"] = model.validate_ids
            model.validate_ids = False
        model.__dict__["_trusting"] = held + 1
    try:
        yield
    finally:
        with _TRUST_LOCK:
            model.__dict__["_trusting"] -= 1
            if model.__dict__["_trusting"] == 0:
                model.validate_ids = model.__dict__.pop("_validate_before")


class _SinusoidalTable:
    """A model's sinusoidal ``position_table`` (a buffer, when it has one) follows the model as
    RoPE's tables do: ``model.double()`` (and a model built in float64) rebuilds it in float64 from
    the angles (the float32 table widened was off by up to 3e-8: numerics20), another dtype
    (``model.to(torch.bfloat16)``) keeps it in float32; the sum with the embeddings is in their
    dtype either way."""

    def _apply(self, fn, recurse=True):
        table = getattr(self, "position_table", None)
        before = None if table is None else table.dtype
        super()._apply(fn, recurse)
        table = getattr(self, "position_table", None)
        if table is not None and (table.dtype != before or table.dtype not in (torch.float32, torch.float64)):
            dtype = torch.float64 if table.dtype == torch.float64 else torch.float32
            self.position_table = sinusoidal_table(*table.shape, dtype=dtype).to(table.device)
        return self


# The integer dtypes whose range can be read (min/max) and that index (index_select after .long()):
# torch's uint16, uint32 and uint64 have neither min nor max.
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_index_dtype(name: str, values: Tensor) -> None:
    """Refuse ids (or targets, positions) that are not integers, or of an integer dtype the
    models cannot read, naming the argument and the dtype."""
    check_integer_dtype(name, values)  # floats and bools: "must be an integer tensor"
    if values.dtype not in INDEX_DTYPES:
        raise IntegerDtypeError(f"{name}: dtype {values.dtype} is not supported; use int64 (long) or int32")


def check_range(values: Tensor, name: str, bound_name: str, bound: int, what: str) -> None:
    """Refuse ``values`` outside ``[0, bound)``, naming the argument: reads their minimum and
    maximum back from the device (two syncs on a GPU), so callers skip it under ``trusted_ids``.
    Under ``torch.func.vmap`` (whose tensors' values cannot be read) the whole batch is checked."""
    values = unbatched(values)
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= bound:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} must be in [0, {bound_name}={bound}), got {what} {bad}")


class TransformerLM(_SinusoidalTable, torch.nn.Module):
    """token_embeddings → (positions) → layers → ln_final → lm_head, returning unnormalised logits.

    The positional arguments are those of the CS336 interface; the keyword arguments select the
    architecture variant (see :class:`ModelConfig`) and their defaults give exactly the
    CS336 model. ``TransformerLM.from_config(cfg)`` builds from a config; ``model.config``
    returns it.
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int | None,
        rope_theta: float = 10000.0,
        device=None,
        dtype=None,
        **variant,
    ):
        super().__init__()
        cfg = ModelConfig(vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta, **variant)
        check_dtype("dtype", dtype)
        self.config = cfg
        # Every forward checks that the ids are in the vocabulary (and given token_positions in the
        # context; loss, its targets too), which reads two numbers back from the device; callers
        # that checked them on the host turn it off: the trainer (its data was checked when
        # opened) for good, generation and evaluation by trusted_ids().
        self.validate_ids = True
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        if cfg.positions == "learned":
            self.position_embeddings = Embedding(context_length, d_model, device=device, dtype=dtype)
            self.position_embeddings.ids_name = "token_positions"
        elif cfg.positions == "sinusoidal":
            self.register_buffer(
                "position_table", sinusoidal_table(context_length, d_model).to(device), persistent=False
            )
        # One RoPE table shared by every layer (a non-persistent buffer: not in the state dict).
        rope = (
            RotaryEmbedding(rope_theta, cfg.head_dim, context_length, device=device)
            if cfg.positions == "rope"
            else None
        )
        self.layers = torch.nn.ModuleList(
            TransformerBlock(
                d_model,
                num_heads,
                cfg.d_ff,
                context_length,
                None,
                device=device,
                dtype=dtype,
                rope=rope,
                norm=cfg.norm,
                norm_placement=cfg.norm_placement,
                norm_eps=cfg.norm_eps,
                ffn=cfg.ffn,
                attn_impl=cfg.attn_impl,
                dropout=cfg.dropout,
            )
            for _ in range(num_layers)
        )
        # Post-norm layers already end in a norm, so a final one would be redundant.
        norm = cfg.norm if cfg.norm_placement == "pre" else "none"
        self.ln_final = make_norm(norm, d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            # The shared matrix keeps the Linear init (σ² = 2/(vocab+d)): the embedding's σ = 1
            # would make the initial logits ~sqrt(d_model) times too large.
            self.token_embeddings.weight = self.lm_head.weight
        if self.output_weight.dtype == torch.float64:  # built in float64: its tables too, as .double() makes them
            self.to(torch.float64)

    @property
    def output_weight(self) -> Tensor:
        """The pre-softmax projection ``(vocab, d_model)`` (``lm_head.weight``)."""
        return self.lm_head.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @contextlib.contextmanager
    def trusted_ids(self) -> Iterator[TransformerLM]:
        """Within the block ``forward`` does not check that every id is in ``[0, vocab_size)`` (nor
        given ``token_positions`` in ``[0, context_length)``, nor ``loss`` its targets), a check that
        reads two numbers back from the device (on a GPU, two syncs per forward). For callers that
        checked the ids where they had them on the host: generation (the prompt; the sampled ids
        are in range by construction), the serving engine, ``evaluate_tokens``."""
        with trusting(self):
            yield self

    def new_cache(self, batch_size: int, max_len: int | None = None, pad_lengths=None):
        """An empty :class:`lm.generate.KVCache` for decoding with this model: ``batch_size`` rows of up
        to ``max_len`` (default ``context_length``) positions, row ``i`` left-padded by ``pad_lengths[i]``."""
        from lm.generate.kv_cache import KVCache  # generation builds on the model, not the reverse

        return KVCache.for_model(self, batch_size, max_len, pad_lengths)

    @classmethod
    def from_config(cls, config: ModelConfig, device=None, dtype=None) -> TransformerLM:
        d = config.to_dict()
        positional = [d.pop(k) for k in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")]
        return cls(*positional, d.pop("rope_theta"), device=device, dtype=dtype, **d)

    def forward(
        self,
        ids: Int[Tensor, "batch seq"] | None = None,
        token_positions: Int[Tensor, "batch seq"] | None = None,
        *,
        kv_cache=None,
        last_only: bool = False,
        targets: Int[Tensor, "batch seq"] | None = None,
        batch=None,
    ) -> Float[Tensor, "batch seq vocab"] | Float[Tensor, ""]:
        """``kv_cache`` (an :class:`lm.generate.KVCache`) makes ``ids`` the *next* positions of
        the cached sequences; positions then come from the cache. ``last_only=True`` returns
        the logits of the last position only (``seq`` = 1), which is all sampling needs.
        With ``targets``, returns :meth:`loss` instead of the logits: the way to get the fused
        loss through a wrapper such as DistributedDataParallel, which only sees ``forward``;
        ``batch`` (an :class:`lm.data.batch.LMBatch`) does the same with its ids and targets."""
        if batch is not None:
            return self.loss(batch.ids, batch.targets)
        if targets is not None:
            return self.loss(ids, targets, token_positions)
        h = self.hidden_states(ids, token_positions, kv_cache=kv_cache)
        if last_only:
            h = h[..., -1:, :]
        return self.lm_head(h)

    def loss(
        self,
        ids: Int[Tensor, "batch seq"],
        targets: Int[Tensor, "batch seq"],
        token_positions: Int[Tensor, "batch seq"] | None = None,
    ) -> Float[Tensor, ""]:
        """Mean next-token cross-entropy, ``cross_entropy(self(ids), targets)``, computed with
        :func:`lm.nn.linear_cross_entropy` so the full logits tensor is never materialised
        (faster and smaller; same value and gradients). Every target must be in ``[0, vocab_size)``
        (there is no ``ignore_index``), checked as the ids are."""
        if targets.shape != ids.shape:
            raise ValueError(f"targets must have the shape of ids {tuple(ids.shape)}, got {tuple(targets.shape)}")
        if self.validate_ids and not is_compiling():  # skipped with the ids' check: no device sync
            check_index_dtype("targets", targets)  # before reading a float's range as ids
            check_range(targets, "targets", "vocab_size", self.config.vocab_size, "target")
        return linear_cross_entropy(self.hidden_states(ids, token_positions), self.lm_head.weight, targets)

    def hidden_states(
        self,
        ids: Int[Tensor, "batch seq"],
        token_positions: Int[Tensor, "batch seq"] | None = None,
        *,
        kv_cache=None,
    ) -> Float[Tensor, "batch seq d_model"]:
        """Everything before ``lm_head``: the final (normalised) residual stream."""
        seq = ids.shape[-1]
        self._check_input(ids, kv_cache, token_positions)
        if token_positions is None:
            if kv_cache is not None:
                token_positions = kv_cache.start_step(seq)
            else:
                token_positions = torch.arange(seq, device=ids.device)
        x = self.token_embeddings(ids)
        if self.config.positions == "learned":
            x = x + self.position_embeddings(token_positions)
        elif self.config.positions == "sinusoidal":
            # index_rows, as the learned and RoPE tables: table[-1] would read the last row.
            x = x + index_rows(self.position_table, token_positions, "token_positions", "context_length").to(x.dtype)
        x = dropout(x, self.config.dropout, self.training)
        for i, layer in enumerate(self.layers):
            x = layer(x, token_positions, None if kv_cache is None else kv_cache.layer(i))
        if kv_cache is not None:
            kv_cache.advance(seq)
        return self.ln_final(x)

    def _check_input(self, ids: Tensor, kv_cache, token_positions: Tensor | None = None) -> None:
        check_index_dtype("ids", ids)
        seq = ids.shape[-1]
        if token_positions is not None:
            check_index_dtype("token_positions", token_positions)
            if token_positions.ndim == 0 or token_positions.shape[-1] != seq:
                raise ValueError(f"token_positions must end in the sequence dimension of ids ({seq}), "
                                 f"got shape {tuple(token_positions.shape)}")
        compiling = is_compiling()
        # Compiled, a cache's length (a Python int) would recompile the graph at every step: the
        # compiled caller (lm.generate.static.DecodeStep) checks it instead. Data-dependent id
        # checks would break the graph.
        total = seq if kv_cache is None or compiling else kv_cache.length + seq
        if total > self.config.context_length:
            raise ValueError(
                f"sequence length {total} exceeds context_length={self.config.context_length}"
                + ("" if kv_cache is None else f" (cached {kv_cache.length} + new {seq})")
            )
        if compiling or not self.validate_ids:
            return
        check_range(ids, "ids", "vocab_size", self.config.vocab_size, "id")
        # Out-of-range positions would index the position tables from the end (-1 reads the last
        # position's encoding) or past it; a model without positions does not read them.
        if token_positions is not None and self.config.positions != "none":
            check_range(token_positions, "token_positions", "context_length", self.config.context_length, "position")

    # -- accounting --------------------------------------------------------------------
    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Unique parameters (``parameters()`` yields a tied tensor once). ``include_embeddings=False``
        leaves out the token and learned position embedding tables (lookups, no FLOPs); ``lm_head``
        counts as a matmul, a tied matrix once, as the output projection (as nanoGPT's
        ``get_num_params``): the matrices :meth:`flops_per_token` counts, plus the norms' weights
        (and biases)."""
        excluded = set()
        if not include_embeddings:
            if not self.config.tie_embeddings:
                excluded.add(id(self.token_embeddings.weight))
            if hasattr(self, "position_embeddings"):
                excluded.add(id(self.position_embeddings.weight))
        return sum(p.numel() for p in self.parameters() if id(p) not in excluded)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Matmul FLOPs of one forward pass, per token, at sequence length ``seq_len``
        (default ``context_length``): ``2 ×`` every weight matrix (q, k, v, output, the FFN
        matrices, lm_head) plus ``2 × 2 × num_layers × seq_len × d_model`` for ``QKᵀ`` and
        ``AV`` (counted over the full window, the PaLM/nanoGPT convention, not halved for
        causality). Norms, softmax and activations are ignored; multiply by 3 for a training step.
        """
        config = self.config
        seq_len = config.context_length if seq_len is None else seq_len
        d, L = config.d_model, config.num_layers
        ffn_matrices = 3 if config.ffn == "swiglu" else 2
        per_layer = 4 * d * d + ffn_matrices * d * config.d_ff
        weights = L * per_layer + d * config.vocab_size
        return 2 * weights + 2 * 2 * L * seq_len * d

    def estimate_mfu(self, tokens_per_second: float, peak_flops: float, seq_len: int | None = None) -> float:
        """Model FLOPs utilisation of a training run: ``3 × forward FLOPs`` (forward + backward) per token."""
        return 3 * self.flops_per_token(seq_len) * tokens_per_second / peak_flops

"""The encoder–decoder Transformer of "Attention Is All You Need", from the same ``lm.nn`` layers.

source ids → embeddings · √d_model + positions → encoder layers (self-attention over the whole
source, padding masked) → ``encoder_norm`` = memory;
target ids → embeddings · √d_model + positions → decoder layers (masked self-attention,
cross-attention to the memory, feed-forward) → ``decoder_norm`` → the shared embedding
matrix as the pre-softmax projection → logits.

The defaults are the paper's: post-norm LayerNorm blocks, sinusoidal positions, a ReLU
feed-forward, one matrix for both embeddings and the output projection, dropout 0.1 and label
smoothing 0.1. Like ``torch.nn.Transformer`` the encoder and the decoder each end in a
LayerNorm (whatever the norm placement), so weights copied into it give the same outputs;
the tests hold the two to 1e-5. No layer has a bias.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lm.device import check_dtype
from lm.model.config import ConfigIO, check_architecture
from lm.model.transformer import _SinusoidalTable, check_index_dtype, check_range, sinusoidal_table, trusting
from lm.nn import (
    DecoderBlock,
    Embedding,
    Linear,
    RotaryEmbedding,
    TransformerBlock,
    dropout,
    linear_cross_entropy,
)
from lm.nn.attention import MODEL_ATTN_IMPL
from lm.nn.block import make_norm
from lm.nn.choices import check_choice
from lm.nn.functional import index_rows, is_compiling, linear

IGNORE = -100  # the target of a padding position: left out of the loss


def _embedding_init(weight: torch.Tensor) -> None:
    """σ = d^-0.5 (as fairseq): the √d scale makes the embedded tokens unit-sized, and as the output
    projection the same matrix gives logits of unit size too. A meta weight (a model of shapes only,
    lm.device.is_meta) has no values to draw, and normal_ on meta would import torch._dynamo."""
    if not weight.is_meta:
        torch.nn.init.normal_(weight, 0.0, weight.shape[-1] ** -0.5)


@dataclass
class Seq2SeqConfig(ConfigIO):
    """An encoder–decoder (architecture ``encoder_decoder``); the defaults are Vaswani et al.'s."""

    vocab_size: int
    context_length: int  # the longest source or target, in tokens (with <bos>/<eos>)
    d_model: int
    encoder_layers: int
    decoder_layers: int
    num_heads: int
    d_ff: int | None = None  # default: 4 · d_model (8/3 · d_model up to a multiple of 64 for swiglu)
    dropout: float = 0.1  # on the embeddings and every residual branch, in training only
    label_smoothing: float = 0.1  # the training loss's; evaluation reports the plain loss
    norm: str = "layernorm"  # layernorm | rmsnorm | none
    norm_placement: str = "post"  # post (the paper) | pre
    norm_eps: float = 1e-5
    positions: str = "sinusoidal"  # sinusoidal | learned | rope | none
    rope_theta: float = 10000.0
    ffn: str = "relu"  # relu | gelu | silu | swiglu
    tie_embeddings: bool = True  # one matrix: source and target embeddings and the output projection
    embed_scale: bool = True  # embeddings · √d_model
    attn_impl: str = MODEL_ATTN_IMPL  # sdpa | einsum: the same results
    pad_id: int = 0  # the ids of the tokenizer's <pad>, <bos> and <eos>
    bos_id: int = 1
    eos_id: int = 2
    architecture: str = "encoder_decoder"

    def __post_init__(self) -> None:
        check_architecture(self, ("vocab_size", "context_length", "d_model", "encoder_layers", "decoder_layers",
                                  "num_heads"))
        if self.architecture != "encoder_decoder":
            raise ValueError(f"architecture must be 'encoder_decoder' for this config, got {self.architecture!r}")
        if not isinstance(self.embed_scale, bool):  # "no" would be truthy and scale the embeddings
            raise ValueError(f"embed_scale must be a bool, got {self.embed_scale!r}")
        for name in ("dropout", "label_smoothing"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} must be an id in [0, vocab_size={self.vocab_size}), got {value!r}")
        # Decoding never emits <pad> or <bos> (their logits are -inf): an <eos> that shared an id
        # with either could never end a target.
        if len({self.pad_id, self.bos_id, self.eos_id}) < 3:
            raise ValueError(f"pad_id, bos_id and eos_id must be distinct, got pad_id={self.pad_id}, "
                             f"bos_id={self.bos_id}, eos_id={self.eos_id}")

    def special_ids_problem(self, specials: Mapping[str, int], prefix: str = "",
                            tokenizer: str = "the tokenizer") -> str | None:
        """Why ``pad_id``, ``bos_id`` and ``eos_id`` are not the special tokens of the tokenizer
        whose special tokens are ``specials`` (each one's text to its id), or None when they are.

        Each must be a special token: a model whose ``<eos>`` is an ordinary token (a byte, say)
        learns to end each target with that byte and cuts a sentence that holds it. A special
        token named ``<pad>``, ``<bos>`` or ``<eos>`` must be the id of that name (a tokenizer
        trained with its special tokens in another order than the config's ids). ``prefix`` is put
        before the names in the message (``"model."``), which calls the tokenizer ``tokenizer``."""
        by_id = {i: t for t, i in specials.items()}
        listed = ", ".join(f"{t} {i}" for i, t in sorted(by_id.items())) or "none"
        for key, name in (("pad_id", "<pad>"), ("bos_id", "<bos>"), ("eos_id", "<eos>")):
            i = getattr(self, key)
            if name in specials and specials[name] != i:
                return f"{prefix}{key} is {i}, but {name} is id {specials[name]} in {tokenizer}"
            if i not in by_id:
                return f"{prefix}{key} {i} is not a special token of {tokenizer} (its special tokens: {listed})"
        return None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


class EncoderDecoder(_SinusoidalTable, torch.nn.Module):
    """``encode(src, src_mask)`` → memory; ``decode(tgt, memory, memory_mask)`` → hidden states;
    ``logits(hidden)``; ``loss(batch)``. Masks are ``True`` at real tokens, ``False`` at padding.

    State-dict keys: ``embeddings.weight`` (tied; else ``src_embeddings``, ``tgt_embeddings``,
    ``lm_head``), ``encoder.{i}.{ln1,attn,ln2,ffn}``, ``encoder_norm``,
    ``decoder.{i}.{ln1,self_attn,ln2,cross_attn,ln3,ffn}``, ``decoder_norm``, and
    ``src_positions``/``tgt_positions`` for learned positions.
    """

    def __init__(self, config: Seq2SeqConfig, device=None, dtype=None):
        super().__init__()
        check_dtype("dtype", dtype)
        self.config = cfg = config
        # As TransformerLM's: encode and decode check their ids against the vocabulary (two reads
        # from the device each) unless the trainer turned it off or the caller is in trusted_ids().
        self.validate_ids = True
        d = cfg.d_model
        if cfg.tie_embeddings:
            self.embeddings = Embedding(cfg.vocab_size, d, device=device, dtype=dtype)
            _embedding_init(self.embeddings.weight)
        else:
            self.src_embeddings = Embedding(cfg.vocab_size, d, device=device, dtype=dtype)
            self.tgt_embeddings = Embedding(cfg.vocab_size, d, device=device, dtype=dtype)
            for e in (self.src_embeddings, self.tgt_embeddings):
                _embedding_init(e.weight)
            self.lm_head = Linear(d, cfg.vocab_size, device=device, dtype=dtype)
        if cfg.positions == "learned":
            self.src_positions = Embedding(cfg.context_length, d, device=device, dtype=dtype)
            self.tgt_positions = Embedding(cfg.context_length, d, device=device, dtype=dtype)
            self.src_positions.ids_name = self.tgt_positions.ids_name = "positions"
        elif cfg.positions == "sinusoidal":
            table = sinusoidal_table(cfg.context_length, d).to(device)
            self.register_buffer("position_table", table, persistent=False)
        rope = RotaryEmbedding(cfg.rope_theta, cfg.head_dim, cfg.context_length, device=device) \
            if cfg.positions == "rope" else None
        common = dict(device=device, dtype=dtype, norm=cfg.norm, norm_placement=cfg.norm_placement,
                      norm_eps=cfg.norm_eps, ffn=cfg.ffn, attn_impl=cfg.attn_impl, dropout=cfg.dropout)
        self.encoder = torch.nn.ModuleList(
            TransformerBlock(d, cfg.num_heads, cfg.d_ff, cfg.context_length, None, rope=rope, causal=False, **common)
            for _ in range(cfg.encoder_layers)
        )
        self.encoder_norm = make_norm(cfg.norm, d, cfg.norm_eps, device=device, dtype=dtype)
        self.decoder = torch.nn.ModuleList(
            DecoderBlock(d, cfg.num_heads, cfg.d_ff, rope=rope, **common) for _ in range(cfg.decoder_layers)
        )
        self.decoder_norm = make_norm(cfg.norm, d, cfg.norm_eps, device=device, dtype=dtype)
        if self.output_weight.dtype == torch.float64:  # built in float64: its tables too, as .double() makes them
            self.to(torch.float64)

    @classmethod
    def from_config(cls, config: Seq2SeqConfig, device=None, dtype=None) -> EncoderDecoder:
        return cls(config, device=device, dtype=dtype)

    # -- the parts ------------------------------------------------------------------------------
    @property
    def output_weight(self) -> Tensor:
        """The pre-softmax projection ``(vocab, d_model)``: the shared embedding matrix when tied."""
        return self.embeddings.weight if self.config.tie_embeddings else self.lm_head.weight

    @property
    def device(self) -> torch.device:
        return self.output_weight.device

    @contextlib.contextmanager
    def trusted_ids(self) -> Iterator[EncoderDecoder]:
        """Within the block ``encode`` and ``decode`` do not check that every id is in
        ``[0, vocab_size)`` (on a GPU, two syncs a call), as :meth:`TransformerLM.trusted_ids`: for
        callers that checked the sources on the host and feed the decoder ``<bos>`` and the ids
        it chose (greedy decoding, beam search, the decode step)."""
        with trusting(self):
            yield self

    def new_cache(self, batch_size: int, max_len: int | None = None):
        """An empty :class:`lm.generate.Seq2SeqCache` for decoding with this model: ``batch_size`` rows
        of up to ``max_len`` (default ``context_length``) target positions."""
        from lm.generate.seq2seq import Seq2SeqCache  # generation builds on the model, not the reverse

        return Seq2SeqCache.for_model(self, batch_size, max_len)

    def embed(
        self, ids: Int[Tensor, "batch seq"], side: str, positions: Int[Tensor, " seq"]
    ) -> Float[Tensor, "batch seq d_model"]:
        """What the ``side`` (``"src"`` or ``"tgt"``) stack starts from: the token embeddings (scaled by
        ``sqrt(d_model)`` with ``embed_scale``) plus the positions' encodings, then dropout."""
        check_choice("side", side, ("src", "tgt"))
        cfg = self.config
        table = self.embeddings if cfg.tie_embeddings else getattr(self, f"{side}_embeddings")
        x = table(ids)
        if cfg.embed_scale:
            x = x * math.sqrt(cfg.d_model)
        if cfg.positions == "sinusoidal":
            x = x + index_rows(self.position_table, positions, "positions", "context_length").to(x.dtype)
        elif cfg.positions == "learned":
            x = x + getattr(self, f"{side}_positions")(positions)
        return dropout(x, cfg.dropout, self.training)

    def _check(self, ids: Tensor, name: str, what: str, offset: int = 0) -> None:
        check_index_dtype(name, ids)
        if ids.shape[-1] + offset > self.config.context_length:
            length = ids.shape[-1] + offset
            raise ValueError(f"{what} length {length} exceeds context_length={self.config.context_length}")
        if self.validate_ids and not is_compiling():  # a data-dependent check would break the graph
            check_range(ids, name, "vocab_size", self.config.vocab_size, "id")

    def encode(
        self, src: Int[Tensor, "batch src"], src_mask: Bool[Tensor, "batch src"] | None = None
    ) -> Float[Tensor, "batch src d_model"]:
        """The memory: the encoder's output for every source position."""
        self._check(src, "src", "source")
        positions = torch.arange(src.shape[-1], device=src.device)
        x = self.embed(src, "src", positions)
        for layer in self.encoder:
            x = layer(x, positions, key_padding_mask=src_mask)
        return self.encoder_norm(x)

    def decode(
        self,
        tgt: Int[Tensor, "batch tgt"],
        memory: Float[Tensor, "batch src d_model"] | None,
        memory_mask: Bool[Tensor, "batch src"] | None = None,
        tgt_mask: Bool[Tensor, "batch tgt"] | None = None,
        *,
        cache=None,
    ) -> Float[Tensor, "batch tgt d_model"]:
        """Hidden states of the target positions (before the output projection).

        With ``cache`` (a :class:`lm.generate.Seq2SeqCache`) ``tgt`` holds the *next* positions:
        the decoder's self-attention keys and values are kept, and the memory's keys and values
        are projected on the first call and reused after (``memory`` may then be None). A
        :class:`lm.generate.StaticSeq2SeqCache` holds them from the start, every row at its own
        position.
        """
        if memory is None and cache is None:  # cross-attention would attend over the target instead
            raise ValueError("memory is required unless cache already holds the memory's keys and values")
        # Compiled, a cache's length (a Python int) would recompile the graph at every step: the
        # compiled caller (lm.generate.DecodeStep) checks it instead.
        offset = 0 if cache is None or is_compiling() else cache.length
        self._check(tgt, "tgt", "target", offset)
        if cache is None:
            positions = torch.arange(tgt.shape[-1], device=tgt.device)
        else:  # (batch, tgt): each row's own, for a cache whose rows have different lengths
            positions = cache.start_step(tgt.shape[-1])
        x = self.embed(tgt, "tgt", positions)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, memory_mask=memory_mask, tgt_mask=tgt_mask, token_positions=positions,
                      kv_cache=None if cache is None else cache.layer(i), cross_cache=cache, layer=i)
        if cache is not None:
            cache.advance(tgt.shape[-1])
        return self.decoder_norm(x)

    def logits(self, hidden: Float[Tensor, "... d_model"]) -> Float[Tensor, "... vocab"]:
        return linear(hidden, self.output_weight)  # lm.nn's matmul: batch-invariant where asked

    # -- the model seam: what the trainer, evaluation and generation ask for -----------------------
    def forward(
        self,
        src: Int[Tensor, "batch src"] | None = None,
        tgt: Int[Tensor, "batch tgt"] | None = None,
        src_mask: Bool[Tensor, "batch src"] | None = None,
        tgt_mask: Bool[Tensor, "batch tgt"] | None = None,
        *,
        batch=None,
    ) -> Float[Tensor, "batch tgt vocab"] | Float[Tensor, ""]:
        """Logits of ``tgt`` given ``src`` (teacher forcing); with ``batch`` (a
        :class:`lm.data.pairs.PairBatch`), its training loss: the way the fused loss gets through
        a wrapper such as DistributedDataParallel, which only sees ``forward``."""
        if batch is not None:
            return self.loss(batch)
        memory = self.encode(src, src_mask)
        return self.logits(self.decode(tgt, memory, src_mask, tgt_mask))

    def loss(self, batch, label_smoothing: float | None = None) -> Float[Tensor, ""]:
        """Mean cross-entropy over the real target tokens of ``batch`` (padding ignored), with the
        config's label smoothing unless given; the logits are never all held at once."""
        eps = self.config.label_smoothing if label_smoothing is None else label_smoothing
        memory = self.encode(batch.src, batch.src_mask)
        hidden = self.decode(batch.tgt_in, memory, batch.src_mask, batch.tgt_mask)
        targets = batch.tgt_out.masked_fill(~batch.tgt_mask, IGNORE)
        return linear_cross_entropy(hidden, self.output_weight, targets, label_smoothing=eps, ignore_index=IGNORE)

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Unique parameters; ``include_embeddings=False`` leaves out the embedding tables (a tied
        matrix counts once, as the output projection)."""
        excluded = set()
        if not include_embeddings and not self.config.tie_embeddings:
            excluded |= {id(self.src_embeddings.weight), id(self.tgt_embeddings.weight)}
        if not include_embeddings and self.config.positions == "learned":
            excluded |= {id(self.src_positions.weight), id(self.tgt_positions.weight)}
        return sum(p.numel() for p in self.parameters() if id(p) not in excluded)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Forward matmul FLOPs per target token, with a source as long as the target: the encoder
        (4d² + 2·d·d_ff per layer), the decoder (8d² + 2·d·d_ff: two attentions), the output
        projection, and the attention scores over ``seq_len`` (default ``context_length``). The
        trainer's MFU takes the default: on batches of short sentences (Multi30k's) that is a rough
        yardstick (its attention term about 7% high there; the padding, not counted, pulls the other way)."""
        cfg = self.config
        s = cfg.context_length if seq_len is None else seq_len
        d, f = cfg.d_model, cfg.d_ff
        mats = 3 if cfg.ffn == "swiglu" else 2
        enc = cfg.encoder_layers * (4 * d * d + mats * d * f)
        dec = cfg.decoder_layers * (8 * d * d + mats * d * f)
        weights = enc + dec + d * cfg.vocab_size
        scores = 2 * s * d * (cfg.encoder_layers + 2 * cfg.decoder_layers)
        return 2 * weights + 2 * scores


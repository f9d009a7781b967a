"""A fixed-shape decode step: every row advances one token at its own position, in one shape.

Decoding one token is a small amount of arithmetic wrapped in a few hundred tensor operations,
so in eager mode a batch-1 step spends most of its time in Python and dispatch, not in the
matmuls. A step whose shapes never change can be compiled once (``torch.compile``; on CUDA,
captured as a CUDA graph by its ``reduce-overhead`` mode) and replayed for every token:

* :class:`StaticKVCache` holds ``rows`` independent sequences, each layer's keys and values in
  their own ``(rows, heads, max_len, head_dim)`` tensor (a per-layer tensor, not a slice of one
  big one: a compiled graph writes into it in place instead of copying it), and each row's
  length in a tensor. A step writes the new key and value of row ``b`` at ``lengths[b]`` and
  attends over all ``max_len`` positions with the row's unused ones masked, so the shapes are the
  same at every step; :class:`StaticSeq2SeqCache`, for an encoder–decoder, also holds each row's
  source (its cross-attention keys and values, masked past its end) in ``max_len`` positions;
* :class:`DecodeStep` is ``(ids, lengths) -> logits`` over such a cache, through the model's own
  ``forward`` (an encoder–decoder's ``decode``: the same layers as training and the eager path),
  compiled or not.

A row's result does not depend on the other rows or on where it sits in the batch (torch's CPU
matmul gives a row the same bits in any position of one shape), which is what lets the server
batch requests without changing their tokens. Compiled on a CPU, the step's matmuls are also
written so that a row's bits do not depend on the number of rows (:func:`lm.nn.functional.
batch_invariant`): a one-row step and a sixteen-row step give a row the same logits, so the
server can decode few requests in a small step (:mod:`lm.serve.engine` checks which sizes agree:
torch.compile builds the one-row graph apart, specialised to one row, and when steps read the
whole cache its attention summed the keys of a model with 8-wide heads in another order past 24
positions; compiled for any span, both graphs agree there).

Compiled, a step attends over a *span*, the power of two that holds its longest row (16
positions at least), not the whole cache: short sequences do not read every position at every
step (the sixteen-row step of the demo model at positions 20–119: 1.13 ms against 1.52). The
span is a symbolic size of the compiled graph, and the unused positions within it add exact
zeros to sums whose order the compiled kernel fixes, so a row's bits do not depend on the span,
that is on the other rows' lengths. Eager steps read the whole cache: BLAS's batched matmul
sums a row's keys in an order that depends on how many there are.
"""

from __future__ import annotations

import contextlib
import math
import types
import weakref

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from lm.checks import check_flag, check_size
from lm.device import AUTOCAST_DTYPES, autocast, check_dtype
from lm.generate.kv_cache import KVCache
from lm.nn.functional import batch_invariant

MIN_SPAN = 16  # the shortest span a step attends over


def span_for(n: int, max_len: int) -> int:
    """The span a step attends over when its rows hold at most ``n`` positions: the power of two
    that holds them (16 at least), or all ``max_len``."""
    return min(max_len, max(MIN_SPAN, 1 << (max(n, 1) - 1).bit_length()))


class StaticKVCache:
    """Keys and values of ``rows`` sequences, row ``b`` filled from position 0 to ``lengths[b]``.

    Speaks the cache protocol of :class:`lm.model.TransformerLM` (``start_step``, ``layer(i)``,
    ``advance``, ``length``) for one-token steps of every row at its own position. A step attends
    over the first :attr:`span` positions of every row: all ``max_len``, or with ``bucketed``
    lengths (:meth:`set_lengths`) the power of two that holds the longest row (:func:`span_for`),
    so that short sequences do not read the whole cache at every step; a row's unused positions
    within the span are masked, which leaves its result the same bit for bit (the serving engine
    checks it at start).
    """

    def __init__(self, num_layers: int, rows: int, num_heads: int, max_len: int, head_dim: int, *,
                 device=None, dtype=torch.float32):
        for name, size in (("num_layers", num_layers), ("rows", rows), ("num_heads", num_heads), ("max_len", max_len),
                           ("head_dim", head_dim)):
            check_size(name, size)  # -1 or 2.0 had failed inside torch.zeros
        shape = self.tensor_shape(rows, num_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.rows, self.max_len = rows, max_len
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.length = 0  # the longest row (the model's context check); kept outside compiled code
        self._row = torch.arange(rows, device=device)
        self._slot = torch.arange(max_len, device=device)
        self._span = self._slot  # its length is the span: compiled code reads it as a (dynamic) size
        self.step_mask: Tensor | None = None

    layers_field = "num_layers"  # the model config's number of layers with a cache

    @staticmethod
    def tensor_shape(rows: int, num_heads: int, max_len: int, head_dim: int) -> tuple[int, int, int, int]:
        """The shape of one layer's keys (and of its values). One position more than a row can
        hold: a span, even the whole ``max_len``, is then never the whole tensor, which
        torch.compile would treat as a case of its own (another compilation)."""
        return rows, num_heads, max_len + 1, head_dim

    @classmethod
    def _sizes(cls, model, max_len: int | None) -> tuple[int, int, int, int]:
        """``model``'s layers with a cache, heads, positions (the context unless ``max_len``) and head size."""
        cfg = model.config
        return (getattr(cfg, cls.layers_field), cfg.num_heads, cfg.context_length if max_len is None else max_len,
                cfg.head_dim)

    @classmethod
    def for_model(cls, model, rows: int, max_len: int | None = None) -> StaticKVCache:
        layers, heads, max_len, head_dim = cls._sizes(model, max_len)
        weight = model.output_weight
        return cls(layers, rows, heads, max_len, head_dim, device=weight.device, dtype=weight.dtype)

    @classmethod
    def bytes_for(cls, model, rows: int, max_len: int | None = None) -> int:
        """Bytes of the keys and values of :meth:`for_model`'s cache, counted without allocating
        it: ``lm serve`` refuses a ``--max-batch`` that cannot fit (2**70 rows was a traceback, ten
        million an allocator error) before it tries."""
        layers, heads, max_len, head_dim = cls._sizes(model, max_len)
        shape = cls.tensor_shape(rows, heads, max_len, head_dim)
        return 2 * layers * math.prod(shape) * model.output_weight.element_size()

    def leading(self, rows: int) -> StaticKVCache:
        """A cache over this one's first ``rows`` rows: the same memory (a step over it reads and
        writes these rows), its own lengths."""
        if not 1 <= rows <= self.rows:
            raise ValueError(f"rows: need a number in [1, {self.rows}], got {rows}")
        view = object.__new__(type(self))
        view.k, view.v = [t[:rows] for t in self.k], [t[:rows] for t in self.v]
        view.rows, view.max_len, view.length, view.step_mask = rows, self.max_len, 0, None
        view.lengths, view._row, view._slot = self.lengths[:rows].clone(), self._row[:rows], self._slot
        view._span = self._slot
        return view

    def tensors(self) -> list[Tensor]:
        """Every tensor a step reads or writes (a CUDA graph needs their addresses fixed)."""
        return [*self.k, *self.v, self.lengths]

    def move(self, source: int, row: int, length: int) -> None:
        """Copy row ``source``'s first ``length`` positions into ``row``."""
        for t in (*self.k, *self.v):
            t[row, :, :length] = t[source, :, :length]

    def release(self, row: int) -> None:
        """``row`` holds nothing any more (its contents are left; nothing reads them)."""

    def clear(self, row: int) -> None:
        """Zero ``row``'s keys and values. A step masks a row's positions past its length, but a
        masked weight of 0 times a NaN value left there by a row whose model overflowed is NaN:
        the serving engine clears such a row before the slot is used again."""
        for t in self.tensors():
            if t.dim() > 1:
                t[row] = 0

    def set_lengths(self, lengths: list[int], bucketed: bool = False) -> None:
        """Every row's length before the next step (its new token goes at that position), and the
        span the step attends over: ``max_len``, or with ``bucketed`` :func:`span_for` the longest
        row and its new token."""
        if len(lengths) != self.rows or min(lengths) < 0 or max(lengths) >= self.max_len:
            raise ValueError(f"lengths: need {self.rows} values in [0, {self.max_len}), got {lengths}")
        self.lengths.copy_(torch.tensor(lengths, dtype=torch.long))
        self.length = max(lengths)
        self._span = self._slot[:span_for(self.length + 1, self.max_len) if bucketed else self.max_len]

    @property
    def span(self) -> int:
        """The positions of every row the next step attends over."""
        return self._span.shape[0]

    def spans(self) -> list[Tensor]:
        """The tensors whose lengths are this step's spans (compiled: marked dynamic)."""
        return [self._span]

    def fill(self, row: int, k: Float[Tensor, "layers heads seq d"], v: Float[Tensor, "layers heads seq d"]) -> None:
        """Put a prefilled sequence's keys and values into ``row`` (positions ``0 .. seq-1``)."""
        n = k.shape[-2]
        for i in range(len(self.k)):
            self.k[i][row, :, :n] = k[i]
            self.v[i][row, :, :n] = v[i]

    def fill_from(self, row: int, cache: KVCache, source_row: int = 0) -> None:
        """Copy row ``source_row`` of a (left-padding-free) :class:`KVCache` into ``row``."""
        n = cache.length
        self.fill(row, cache.k[:, source_row, :, :n], cache.v[:, source_row, :, :n])

    # -- the protocol the model and attention use (traced when compiled: tensors only) ----------
    def start_step(self, seq: int) -> Int[Tensor, "rows 1"]:
        """Begin a one-token step of every row: its positions (each row's length), and
        :attr:`step_mask`."""
        if seq != 1:
            raise ValueError(f"a StaticKVCache steps one token at a time, got {seq}")
        # Row b's query, at position lengths[b], sees its own keys 0 .. lengths[b] and nothing else.
        self.step_mask = (self._span[None, :] <= self.lengths[:, None])[:, None, None, :]
        return self.lengths[:, None]

    def layer(self, i: int) -> _StaticLayer:
        return _StaticLayer(self, i)

    def advance(self, seq: int) -> None:
        pass  # the caller sets every row's length before each step


class _StaticLayer:
    def __init__(self, cache: StaticKVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c, i = self.cache, self.index
        # Under autocast the keys come in its dtype; the cache keeps the weights' (as KVCache does).
        c.k[i][c._row, :, c.lengths] = k[:, :, 0].to(c.k[i].dtype)
        c.v[i][c._row, :, c.lengths] = v[:, :, 0].to(c.v[i].dtype)
        n = c.span
        return c.k[i][:, :, :n], c.v[i][:, :, :n], c.step_mask


class StaticSeq2SeqCache(StaticKVCache):
    """A :class:`StaticKVCache` of an encoder–decoder's decoder, plus each row's cross-attention
    keys and values: layer ``i``'s in ``cross_k[i]``/``cross_v[i]`` ``(rows, heads, max_len,
    head_dim)``, row ``b``'s source in its first positions and :attr:`memory_mask` ``(rows,
    max_len + 1)`` ``True`` there. A step attends over the first ``source_span`` source positions of
    every row (all ``max_len``, or bucketed, the power of two that holds the longest source) with
    the row's unused ones masked, so a row's result does not depend on the other rows' sources.

    Speaks the cache protocols of :meth:`lm.model.EncoderDecoder.decode` (the self-attention one
    and the cross-attention ``get``, the keys and values put there by :meth:`fill_from`).
    """

    layers_field = "decoder_layers"

    def __init__(self, num_layers: int, rows: int, num_heads: int, max_len: int, head_dim: int, *,
                 device=None, dtype=torch.float32):
        super().__init__(num_layers, rows, num_heads, max_len, head_dim, device=device, dtype=dtype)
        shape = self.tensor_shape(rows, num_heads, max_len, head_dim)  # as the decoder's
        self.cross_k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.cross_v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.memory_mask = torch.zeros(rows, max_len + 1, dtype=torch.bool, device=device)
        self.source_lengths = [0] * rows  # each row's source, in positions (shared with leading views)
        self._source_span = self._slot

    @classmethod
    def bytes_for(cls, model, rows: int, max_len: int | None = None) -> int:
        """:meth:`StaticKVCache.bytes_for`, the cross-attention's keys and values too (as many)."""
        return 2 * super().bytes_for(model, rows, max_len)

    def leading(self, rows: int) -> StaticSeq2SeqCache:
        view = super().leading(rows)
        view.cross_k, view.cross_v = [t[:rows] for t in self.cross_k], [t[:rows] for t in self.cross_v]
        view.memory_mask = self.memory_mask[:rows]
        view.source_lengths, view._source_span = self.source_lengths, self._slot
        return view

    def set_lengths(self, lengths: list[int], bucketed: bool = False) -> None:
        super().set_lengths(lengths, bucketed)
        longest = max(self.source_lengths[:self.rows])
        self._source_span = self._slot[:span_for(longest, self.max_len) if bucketed else self.max_len]

    @property
    def source_span(self) -> int:
        """The source positions of every row the next step attends over."""
        return self._source_span.shape[0]

    def spans(self) -> list[Tensor]:
        return [*super().spans(), self._source_span]

    @property
    def step_memory_mask(self) -> Tensor:
        """:attr:`memory_mask` over this step's source span."""
        return self.memory_mask[:, :self.source_span]

    def tensors(self) -> list[Tensor]:
        return [*super().tensors(), *self.cross_k, *self.cross_v, self.memory_mask]

    def move(self, source: int, row: int, length: int) -> None:
        """Copy row ``source``'s first ``length`` target positions and its whole source into ``row``."""
        super().move(source, row, length)
        for t in (*self.cross_k, *self.cross_v, self.memory_mask):
            t[row] = t[source]
        self.source_lengths[row] = self.source_lengths[source]

    def release(self, row: int) -> None:
        """``row`` holds no source any more: it no longer widens the source span."""
        self.source_lengths[row] = 0

    def fill_from(self, row: int, cache, source_row: int = 0) -> None:
        """Copy row ``source_row`` of a :class:`lm.generate.Seq2SeqCache` (its decoder keys and
        values, and its cross-attention ones, unpadded) into ``row``."""
        super().fill_from(row, cache, source_row)
        n = cache.cross[0][0].shape[-2]
        if n > self.max_len:
            raise ValueError(f"source: {n} positions, the cache holds {self.max_len}")
        for i, (k, v) in cache.cross.items():
            self.cross_k[i][row].zero_()
            self.cross_v[i][row].zero_()
            self.cross_k[i][row, :, :n] = k[source_row]
            self.cross_v[i][row, :, :n] = v[source_row]
        self.memory_mask[row, :self.max_len] = self._slot < n
        self.source_lengths[row] = n

    # -- the cross-attention protocol (read only: the keys and values come from fill_from) --------
    def get(self, layer: int) -> tuple[Tensor, Tensor]:
        n = self.source_span
        return self.cross_k[layer][:, :, :n], self.cross_v[layer][:, :, :n]

    def put(self, layer: int, k: Tensor, v: Tensor) -> None:
        raise RuntimeError("a StaticSeq2SeqCache takes its cross-attention keys and values from fill_from")


class DecodeStep:
    """``step(ids, lengths) -> logits``: one new token for each of ``rows`` sequences held in
    :attr:`cache` (a :class:`StaticKVCache`; for an encoder–decoder a :class:`StaticSeq2SeqCache`,
    filled by the caller), row ``b``'s token at position ``lengths[b]``.

    ``compile=True`` compiles the step with ``torch.compile`` on its first call (seconds; on
    CUDA in ``reduce-overhead`` mode, which replays it as a CUDA graph); every later call reuses
    it, since the shapes never change. On a CPU it runs within :func:`lm.nn.functional.
    batch_invariant` (:attr:`batch_invariant`): a row's logits do not depend on its slot, nor,
    compiled without autocast, on the number of rows.
    ``dtype`` runs the step under autocast. ``share``: use that compiled step's compiled code (same
    model and dtype, another number of rows): one compilation for the first row count, one more
    with the rows symbolic for all the others, instead of one each.
    """

    def __init__(self, model, rows: int, *, compile: bool = False, dtype: torch.dtype | None = None,
                 cache: StaticKVCache | None = None, share: DecodeStep | None = None):
        architecture = getattr(model.config, "architecture", "decoder_lm")
        if architecture not in ("decoder_lm", "encoder_decoder"):
            raise ValueError(f"DecodeStep needs a decoder_lm or encoder_decoder model, got {architecture!r}")
        check_size("rows", rows)  # 0 had been taken, and failed at the first call
        check_flag("compile", compile)
        check_dtype("dtype", dtype, AUTOCAST_DTYPES)
        if cache is not None and cache.rows != rows:
            raise ValueError(f"rows: the cache holds {cache.rows} rows, got rows={rows!r}")
        if share is not None and not (compile and share.compiled and share.model is model and share.dtype == dtype):
            raise ValueError("share: needs a compiled DecodeStep of the same model and dtype, and compile=True")
        seq2seq = architecture == "encoder_decoder"
        self._model = model  # None once held weakly (_hold_model_weakly)
        self._model_ref = weakref.ref(model)
        if cache is None:
            cache = (StaticSeq2SeqCache if seq2seq else StaticKVCache).for_model(model, rows)
        elif seq2seq != isinstance(cache, StaticSeq2SeqCache):
            raise ValueError(f"cache: a {architecture} model needs a "
                             f"{'StaticSeq2SeqCache' if seq2seq else 'StaticKVCache'}, got {type(cache).__name__}")
        self.cache = cache
        self.rows = self.cache.rows
        self.device = model.output_weight.device
        self.dtype = dtype
        self.compiled = compile
        self.in_use = False  # generate(compile=True) holds a kept step for a call (lm.generate.engine)
        # Compiled: attend over the positions in use (a power-of-two span), not the whole cache. The
        # compiled kernels, one for every span, sum a row's keys in the same order at any span (the
        # unused ones add exact zeros); eager BLAS does not (measured: a 3-row step over 32
        # positions and over 64 gave a row other last bits), so eager steps read the whole cache.
        self.bucketed = compile
        # On a CPU: a row's bits the same in any slot (einsum attention) and, compiled without
        # autocast, at any number of rows (the product-sum matmuls, measured as fast as BLAS here).
        # CUDA keeps its own kernels, autocast its own matmuls: the serving engine's start-up probe keeps
        # the step sizes whose rows agree there (an H200, torch 2.11: eager float32 the 16-row step
        # alone, bfloat16 autocast all five, compiled float32 2 and 4 of 1, 2, 4).
        self.batch_invariant = self.device.type == "cpu"
        self._invariant_matmuls = compile and dtype is None
        self._ids = torch.zeros(self.rows, 1, dtype=torch.long, device=self.device)
        # Both models check ids on the host unless told they are trusted (a sync a step).
        self._trusted = hasattr(model, "trusted_ids")

        # The model is an argument, not a closure's cell: a step kept on its model (decode_step_for)
        # holds it weakly, so that a dropped model is freed at once, not at the next cyclic collection.
        if seq2seq:
            # memory: the cache's cross keys/values
            def step(model: nn.Module, ids: Tensor, cache: StaticSeq2SeqCache) -> Tensor:
                return model.logits(model.decode(ids, None, cache.step_memory_mask, cache=cache)[:, -1])
        else:
            def step(model: nn.Module, ids: Tensor, cache: StaticKVCache) -> Tensor:
                return model(ids, kv_cache=cache, last_only=True)[:, -1]

        self._fn = step
        if compile:
            if self.device.type == "cuda":  # a CUDA graph replays fixed addresses: the cache stays put
                for t in (*self.cache.tensors(), self._ids):
                    torch._dynamo.mark_static_address(t)
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            # Automatic dynamic shapes: a step alone compiles for its one shape; steps that share
            # it (other row counts) make torch.compile recompile once with the rows symbolic.
            self._fn = share._fn if share is not None else \
                torch.compile(_own_code(step), dynamic=None, fullgraph=True, mode=mode)

    @property
    def model(self) -> nn.Module:
        """The model this step runs."""
        model = self._model if self._model is not None else self._model_ref()
        if model is None:
            raise RuntimeError("this DecodeStep's model is gone (a step kept on a model holds it weakly)")
        return model

    def _hold_model_weakly(self) -> None:
        """Hold the model through a weak reference only: for a step kept on the model itself, which
        would otherwise make a reference cycle (model -> its steps -> model)."""
        self._model = None

    @torch.inference_mode()
    def __call__(self, ids: list[int] | Tensor, lengths: list[int], *, full_span: bool = False
                 ) -> Float[Tensor, "rows vocab"]:
        """Write each row's token at its length, and return every row's next-token logits.

        Idle rows may hold anything (length 0, token 0): they do not touch the other rows. The
        step attends over the span that holds the longest row (:attr:`bucketed`), or with
        ``full_span`` (and without :attr:`bucketed`) over the whole cache.
        """
        n = ids.numel() if isinstance(ids, Tensor) else len(ids)  # a size, not a read from the device
        if n != self.rows:  # before the cache is touched (set_lengths checks lengths the same way)
            raise ValueError(f"ids: need {self.rows} token ids (one per row), got {n}")
        self.cache.set_lengths(list(lengths), bucketed=self.bucketed and not full_span)
        if self.compiled:
            for t in self.cache.spans():  # one compiled graph for every span, not one each
                if t.shape[0] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        self._ids.copy_(torch.as_tensor(ids, dtype=torch.long).reshape(self.rows, 1))
        invariant = batch_invariant(self._invariant_matmuls) if self.batch_invariant else contextlib.nullcontext()
        model = self.model
        trusted = model.trusted_ids() if self._trusted else contextlib.nullcontext()
        with autocast(self.device, self.dtype), trusted, invariant:
            logits = self._fn(model, self._ids, self.cache)  # callers pass sampled ids (trusted_ids: no host check)
        return logits.clone() if self.compiled and self.device.type == "cuda" else logits


def _own_code(fn):
    """``fn`` with a code object of its own. torch.compile keeps its graphs per code object and
    gives up (back to eager) after 8 of them; every step, for every model, gets its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)

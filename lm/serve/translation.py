"""Serving an encoder–decoder (translation) checkpoint through the same server and API.

``POST /v1/completions`` with a translation model takes the source sentence as ``prompt`` and
answers with its translation: ``temperature`` 0 (greedy) or sampled with ``top_p`` and ``seed``,
``max_tokens`` capping the target (by default the model's own limit, the source's length + 50),
``n`` choices, streaming, stop strings: the decoder-only server's fields, the same errors.

:class:`TranslationEngine` is the decoder-only :class:`~lm.serve.engine.Engine` (its queue,
thread, slots, continuous batching, step sizes, probe, cancellation, draining and metrics) with
another slot: a row of a :class:`lm.generate.StaticSeq2SeqCache`, which holds the decoder's
keys and values and the projected keys and values of the row's own source (the cross-attention
memory, masked past the source's end). A request is prefilled alone (its source encoded, ``<bos>``
decoded: the first token's logits) and joins the running batch at the next step; each step
decodes one target token of every row, each at its own position and over its own source, as
:func:`lm.generate.greedy_decode` does for one sentence. ``<pad>`` and ``<bos>`` are never
sampled, and ``<eos>`` ends a choice without being part of it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lm.device import autocast
from lm.generate.kv_cache import KVCache
from lm.generate.seq2seq import banned_index, max_target_length, source_batch
from lm.generate.static import StaticSeq2SeqCache
from lm.serve.engine import Engine, Request


class TranslationEngine(Engine):
    """An :class:`Engine` for ``encoder_decoder`` models (see the module): the same arguments, and
    a choice ends at the model's ``eos_id``; ``banned_ids`` are never chosen, as in
    :func:`lm.generate.greedy_decode` (``lm serve`` bans :func:`lm.generate.seq2seq.line_break_ids`,
    as ``lm translate`` does: a translation is one line)."""

    architecture = "encoder_decoder"
    sends_eos = False  # <eos> ends a translation; it is not a token of the text
    cache_class = StaticSeq2SeqCache

    def __init__(self, model, *, max_batch: int = 16, max_queue: int = 256, eos_id: int | None = None,
                 dtype: torch.dtype | None = None, vocab_size: int | None = None, compile: bool = False,
                 step_sizes: list[int] | None = None, banned_ids: list[int] | None = None):
        own = getattr(model.config, "eos_id", None)
        if eos_id not in (None, own):
            raise ValueError(f"eos_id: a translation ends at the model's <eos> ({own}), got {eos_id!r}")
        self.banned = banned_index(model, banned_ids)  # <pad>, <bos> and banned_ids (checked)
        super().__init__(model, max_batch=max_batch, max_queue=max_queue, eos_id=own, dtype=dtype,
                         vocab_size=vocab_size, compile=compile, step_sizes=step_sizes)

    def _check_lengths(self, request: Request) -> None:
        src, cfg = request.prompt_ids, self.model.config
        if len(src) + 1 > cfg.context_length:  # the source ends in <eos>
            raise ValueError(f"prompt: {len(src)} tokens, and the model reads at most {cfg.context_length - 1}")
        if request.params.max_tokens > cfg.context_length - 1:  # the target starts with <bos>
            raise ValueError(f"max_tokens: this model writes at most {cfg.context_length - 1} tokens, "
                             f"got {request.params.max_tokens}")
        if request.params.ignore_eos:
            raise ValueError("ignore_eos: a translation ends at its <eos>; not supported for a translation model")
        if request.params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: only a language model gives its prompt's tokens log-probabilities")

    def _limit(self, request: Request) -> int:
        return min(request.params.max_tokens, max_target_length(self.model, len(request.prompt_ids)))

    def _allowed(self, logits: Tensor) -> Tensor:
        """A target never holds ``<pad>``, a second ``<bos>`` or a banned id (as
        :func:`lm.generate.greedy_decode`)."""
        logits = logits[:self.vocab_size].float().clone()
        logits[self.banned] = float("-inf")
        return logits

    def _prefilled(self, prompt_ids: list[int]) -> tuple[Tensor, KVCache]:
        """The source encoded alone and ``<bos>`` decoded: the first target token's logits, and
        the one-row cache holding ``<bos>``'s keys and values and the source's projected ones."""
        return self._decoded(prompt_ids, [self.model.config.bos_id])

    def _probe_cache(self, g: torch.Generator, n: int) -> KVCache:
        """A random source of ``n`` ids encoded, and a random target of ``n`` positions (``<bos>``
        first) decoded into a one-row cache."""
        source = torch.randint(0, self.vocab_size, (n,), generator=g).tolist()
        target = [self.model.config.bos_id, *torch.randint(0, self.vocab_size, (n - 1,), generator=g).tolist()]
        return self._decoded(source, target)[1]

    def _decoded(self, source: list[int], target: list[int]) -> tuple[Tensor, KVCache]:
        """``source`` encoded (with its ``<eos>``) and ``target`` decoded over it, alone: the last
        target position's logits and the one-row cache holding them."""
        cfg = self.model.config
        src, mask = source_batch([source], cfg.eos_id, cfg.pad_id, self.device)
        tgt = torch.tensor([target], dtype=torch.long, device=self.device)
        one = self.model.new_cache(1, max_len=len(target))
        with autocast(self.device, self.dtype), self.model.trusted_ids():  # ids checked by check(), or drawn
            hidden = self.model.decode(tgt, self.model.encode(src, mask), mask, cache=one)
            return self.model.logits(hidden[0, -1]), one

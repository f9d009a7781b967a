"""Serving an encoder–decoder (translation) checkpoint through the same server and API.

``POST /v1/completions`` with a translation model takes the source sentence as ``prompt`` and
answers with its translation: ``temperature`` 0 (greedy) or sampled with ``top_p`` and ``seed``,
``max_tokens`` capping the target (by default the model's own limit, the source's length + 50),
``n`` choices, streaming, stop strings: the decoder-only server's fields, the same errors.

:class:`TranslationEngine` keeps the decoder-only :class:`~lm.serve.engine.Engine`'s queue,
thread, cancellation, draining and metrics, and replaces its scheduler: it translates one
choice at a time with :func:`lm.generate.greedy_decode` (cached cross-attention keys and
values, the decoder's own KV cache), each alone, so a seeded request's text never depends on
what else is queued. Translation requests are short (a sentence of 10–30 tokens on Multi30k),
so a request waits for the ones before it instead of joining a running batch.
"""

from __future__ import annotations

import time

import torch

from lm.device import autocast
from lm.generate.seq2seq import greedy_decode, max_target_length
from lm.serve.engine import Engine, Request


class _Stop(Exception):
    """Raised from the token callback to end a choice early: cancelled, or ``max_tokens``."""

    def __init__(self, reason: str):
        self.reason = reason


class TranslationEngine(Engine):
    """An :class:`Engine` for ``encoder_decoder`` models: one choice translated at a time."""

    architecture = "encoder_decoder"

    def _set_up_decoding(self, compile: bool, step_sizes: list[int] | None) -> None:
        if compile:
            raise ValueError("compile: the translation engine decodes eagerly (no compiled step for "
                             "encoder-decoder models)")
        if step_sizes is not None:
            raise ValueError("step_sizes: the translation engine decodes one choice at a time (no batched step)")

    def _check_lengths(self, request: Request) -> None:
        src, cfg = request.prompt_ids, self.model.config
        if len(src) + 1 > cfg.context_length:  # the source ends in <eos>
            raise ValueError(f"prompt: {len(src)} tokens, and the model reads at most {cfg.context_length - 1}")
        if request.params.max_tokens > cfg.context_length - 1:  # the target starts with <bos>
            raise ValueError(f"max_tokens: this model writes at most {cfg.context_length - 1} tokens, "
                             f"got {request.params.max_tokens}")

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.stats.batch_size > 0

    @torch.inference_mode()
    def step(self) -> bool:
        """Translate the next waiting request (all its choices). Returns whether there was one."""
        with self._lock:
            request = self.waiting.popleft() if self.waiting else None
            self.stats.queue_depth = len(self.waiting)
            self.stats.batch_size = 1 if request is not None else 0
        if request is None:
            return False
        try:
            self.stats.prompt_tokens += len(request.prompt_ids)
            p = request.params
            limit = min(p.max_tokens, max_target_length(self.model, len(request.prompt_ids)))
            for index, generator in enumerate(p.choice_generators(request.n)):
                try:
                    self._translate_one(request, index, generator, limit)
                except BaseException:  # the model failed: this request's clients must not wait forever
                    for rest in range(index, request.n):
                        self._finish_one(request, rest, "error")
                    raise
        finally:
            self.stats.batch_size = 0
        return True

    def _translate_one(self, request: Request, index: int, generator: torch.Generator, limit: int) -> None:
        if request.is_cancelled(index):
            return self._finish_one(request, index, "cancelled")
        p = request.params
        made = 0

        def on_token(row: int, token: int) -> None:
            nonlocal made
            if request.first_token_at is None:
                request.first_token_at = time.perf_counter()
                self.stats.time_to_first_token(request.first_token_at - request.arrival)
            made += 1
            self.stats.generated_tokens += 1
            self.stats.steps[1] += 1  # one row a step
            self.stats.step_rows += 1
            if request.on_token is not None:
                request.on_token(index, token)
            if request.is_cancelled(index):
                raise _Stop("cancelled")
            if made >= p.max_tokens:
                raise _Stop("length")

        try:
            with autocast(self.device, self.dtype):
                greedy_decode(self.model, [request.prompt_ids], temperature=p.temperature, top_p=p.top_p,
                              generator=generator, on_token=on_token)
            reason = "length" if made >= limit else "stop"  # the model's own limit, or <eos>
        except _Stop as stop:
            reason = stop.reason
        self._finish_one(request, index, reason)

    def _finish_one(self, request: Request, index: int, reason: str) -> None:
        self.stats.ended(reason)
        if request.on_finish is not None:
            request.on_finish(index, reason)

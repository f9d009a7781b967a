"""Autoregressive generation with a KV cache.

The prompt is prefilled in one forward pass; after that every new token costs one position of
compute until the context is full (past it, see below: with the default ``window_shift=1`` each
token re-runs the whole window). The loop knows nothing about tokenization: ids in, ids out.

**Past ``context_length``** the window slides: each new token is predicted from at most
the last ``context_length`` tokens, exactly as if the model were re-run on
``ids[-context_length:]``. When the cache is full it is rebuilt by one forward over the last
``context_length - window_shift + 1`` tokens. With the default ``window_shift=1`` that rebuild
happens for every token once the window is full (exact, but each token then costs a forward over
``context_length`` positions); a larger shift rebuilds less often, and a token is then conditioned
on between ``context_length - window_shift + 1`` (one at ``window_shift = context_length``) and
``context_length`` tokens.
``window_shift`` may be ``context_length`` itself, the only value for a model of ``context_length``
1 (each token predicted from the one before it).

**A batch** of prompts of different lengths is left-padded into one cache, and the window slides
for the whole batch at once, when its longest row fills the cache. With ``window_shift=1`` that
changes no row's logits: each row still sees its own last ``context_length`` tokens, so a row
computes the logits it would alone (to float rounding), and greedy decoding (``temperature=0``)
gives it the same tokens. Sampled, it does not generate what it would alone: every row draws from
the one ``generator``, so a row's draws depend on the other rows of the batch (``lm serve`` gives
each row a generator of its own). With a larger shift, a shorter row's window slides at other
tokens than it would alone (each token is still conditioned on between ``context_length -
window_shift`` and ``context_length`` tokens).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from lm.checks import check_callback, check_flag
from lm.generate.sampling import (
    NonFiniteLogitsError,
    as_integer,
    check_eos_id,
    check_generator,
    check_sampling_args,
    check_vocab_limit,
    next_token_and_finite,
)
from lm.generate.static import DecodeStep, StaticKVCache


def _as_prompt_list(prompt_ids) -> tuple[list[list[int]], bool]:
    """Normalise to a list of prompts; the flag says whether a single prompt was given. A numpy array
    is taken as a tensor is: 1-D one prompt, 2-D a batch."""
    if isinstance(prompt_ids, (torch.Tensor, np.ndarray)):
        if prompt_ids.ndim not in (1, 2):
            raise ValueError(f"prompt_ids must be 1-D or 2-D, got shape {tuple(prompt_ids.shape)}")
        single = prompt_ids.ndim == 1
        prompts = [_token_ids(prompt_ids)] if single else [_token_ids(p) for p in prompt_ids]
        return prompts, single
    prompt_ids = list(prompt_ids)
    if prompt_ids and all(isinstance(p, Sequence) or isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim
                          for p in prompt_ids):
        return [_token_ids(p) for p in prompt_ids], False
    return [_token_ids(prompt_ids)], True


def _token_ids(prompt, where: str = "prompt_ids") -> list[int]:
    """One prompt's ids as ints. A float had been truncated to an id (1.7 became 1), as the embedding
    cannot be indexed by one: like transformers' ``generate``, anything but integers is refused, in
    a message that starts with ``where`` (the translation decoders' ``source 0``)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(f"{where}: token ids must be integers, got a tensor of {prompt.dtype}")
        if prompt.dim() != 1:
            raise ValueError(f"{where}: a prompt must be 1-D, got a tensor of shape {tuple(prompt.shape)}")
        return prompt.tolist()
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(f"{where}: a prompt must be 1-D, got an array of shape {prompt.shape}")
    return [_token_id(t, where) for t in prompt]


def _token_id(t, where: str = "prompt_ids") -> int:
    """``t`` as an id: an int, a numpy integer or a one-element integer tensor, but not a bool."""
    if not (isinstance(t, bool) or isinstance(t, torch.Tensor) and t.dtype == torch.bool):
        with contextlib.suppress(TypeError):
            return operator.index(t)
    raise ValueError(f"{where}: token ids must be integers, got {t!r}")


def _in_eval_mode(fn):
    """Run ``fn(model, ...)`` with ``model`` in eval mode (no dropout), then restore its mode."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        was_training = model.training
        model.eval()
        try:
            return fn(model, *args, **kwargs)
        finally:
            model.train(was_training)

    return wrapper


@_in_eval_mode
@torch.inference_mode()  # like no_grad, and it skips autograd's version counting (docs/benchmarks.md)
def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    window_shift: int = 1,
    on_token: Callable[[int, int], None] | None = None,
    vocab_size: int | None = None,
    compile: bool = False,
) -> list[int] | list[list[int]]:
    """Sample up to ``max_new_tokens`` new tokens after ``prompt_ids`` and return them
    (the new tokens only, ending with ``eos_id`` if it was emitted: one token id, or None for none).

    ``prompt_ids`` is one prompt (a list of ids, a 1-D tensor or numpy array) → ``list[int]``, or a
    batch of prompts of any lengths (a list of lists, a 2-D tensor or array) → ``list[list[int]]``. ``on_token``,
    when given, is called with ``(row, token)`` for every new token as soon as it is chosen,
    so a caller can stream text while the rest is generated. ``vocab_size``, when given, samples
    only ids below it: a tokenizer with fewer tokens than the model's (padded) vocabulary has no
    text for the others.

    The prompt is prefilled in one forward; each new token then costs one position of compute until
    the context is full. Past ``context_length`` the window slides, ``window_shift`` tokens at a time
    (an integer in ``[1, context_length]``; see the module's docstring): with the default 1 every
    token re-runs the last ``context_length`` tokens, with a larger shift one token in
    ``window_shift`` re-runs the last ``context_length - window_shift + 1``.

    A row of a batch computes the logits it would alone (with ``window_shift`` 1; a batch slides
    together), so greedy decoding gives it the same tokens; sampled, every row draws from the one
    ``generator``, so a row's tokens depend on the other rows. ``temperature``, ``top_p`` and
    ``top_k`` are checked as :func:`~lm.generate.sample_next_token` checks them (a ValueError naming
    the argument and its value). A model whose logits are not finite
    (NaN or inf) raises :class:`~lm.generate.sampling.NonFiniteLogitsError` before its token is
    passed on.

    ``compile=True`` decodes with a compiled fixed-shape step (:mod:`lm.generate.static`):
    seconds to compile on the first call of a shape, then several times faster per token on a
    CPU; the same tokens (the prompts of each length are prefilled together, with no padding,
    then every row steps at its own position). The compiled step is kept with the model for
    later calls of the same batch size and length.
    """
    check_sampling_args(temperature, top_p, top_k)
    check_flag("compile", compile)  # a string is truthy: compile="no" had compiled
    check_generator(generator)
    check_callback("on_token", on_token)  # not only when the first token is chosen
    temperature, top_p, top_k = float(temperature), float(top_p), None if top_k is None else operator.index(top_k)
    if as_integer(max_new_tokens) is None or max_new_tokens < 0:
        raise ValueError(
            f"max_new_tokens must be a non-negative integer, got max_new_tokens={max_new_tokens!r}"
        )
    max_new_tokens = operator.index(max_new_tokens)
    cfg = model.config
    ctx = cfg.context_length
    # ctx itself is allowed: the rebuild is then over the last token alone (prefill(1)), the only
    # shift a model of context_length 1 has.
    if as_integer(window_shift) is None or not 1 <= window_shift <= ctx:
        raise ValueError(
            f"window_shift must be an integer in [1, context_length={ctx}], got window_shift={window_shift!r}"
        )
    window_shift = operator.index(window_shift)
    check_vocab_limit(vocab_size, cfg.vocab_size)
    check_eos_id(eos_id, vocab_size or cfg.vocab_size)  # one at or past the sampling limit never comes (generate20)
    eos_id = None if eos_id is None else operator.index(eos_id)
    prompts, single = _as_prompt_list(prompt_ids)
    if not prompts:
        raise ValueError("prompt_ids: got an empty batch of prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt_ids: prompt {i} is empty; generation needs at least one token")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: id {bad[0]} is outside [0, vocab_size={cfg.vocab_size})")

    history = [list(p) for p in prompts]  # every row's full token sequence
    new_tokens: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return new_tokens[0] if single else new_tokens
    done = [False] * len(prompts)
    with model.trusted_ids(), contextlib.ExitStack() as stack:  # prompts checked above; sampled ids below vocab
        rows = (_StaticRows if compile else _PaddedRows)(model, history, max_new_tokens)
        stack.callback(rows.close)
        logits = rows.prefill(ctx)
        for step in range(max_new_tokens):
            if vocab_size is not None:
                logits = logits[..., :vocab_size]
            tokens, finite = next_token_and_finite(
                logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator
            )
            next_ids, finite = torch.stack([tokens, finite.to(tokens.dtype)]).tolist()  # one read for both
            bad = [row for row, ok in enumerate(finite) if not ok and not done[row]]
            if bad:
                raise NonFiniteLogitsError(step + 1, None if single else bad[0])
            for row, tok in enumerate(next_ids):
                history[row].append(tok)
                if not done[row]:
                    new_tokens[row].append(tok)
                    if on_token is not None:  # streaming: called with (row, token) as each token is chosen
                        on_token(row, tok)
                    done[row] = eos_id is not None and tok == eos_id
            if all(done) or step == max_new_tokens - 1:
                break
            # The window slides for every row at once when the (padded) cache is full, that is when
            # the longest row fills it (the module's docstring says what that means for window_shift > 1).
            logits = rows.prefill(ctx - window_shift + 1) if rows.full else rows.step(next_ids)
    return new_tokens[0] if single else new_tokens


class _PaddedRows:
    """The eager loop's cache: every row left-padded to the longest, so one forward steps them all."""

    def __init__(self, model, history: list[list[int]], max_new_tokens: int):
        self.model, self.history = model, history

    @property
    def full(self) -> bool:
        return self.cache.length == self.model.config.context_length

    def prefill(self, window: int) -> torch.Tensor:
        """A fresh cache holding the last ``window`` tokens of every row; returns the last logits."""
        rows = [h[-window:] for h in self.history]
        width = max(len(r) for r in rows)
        pad = [width - len(r) for r in rows]
        ids = torch.tensor([[0] * n + r for n, r in zip(pad, rows)], dtype=torch.long, device=self.model.device)
        self.cache = self.model.new_cache(len(rows), pad_lengths=pad)
        return self.model(ids, kv_cache=self.cache, last_only=True)[:, -1]

    def step(self, next_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.model.device)[:, None]
        return self.model(ids, kv_cache=self.cache, last_only=True)[:, -1]

    def close(self) -> None:
        pass


class _StaticRows:
    """``compile=True``: each row prefilled (with the rows of its length) into its row of a static
    cache, then stepped at its own position by the model's compiled :class:`DecodeStep`. ``width``
    follows the padded cache of :class:`_PaddedRows`, so the window slides at the same tokens."""

    def __init__(self, model, history: list[list[int]], max_new_tokens: int):
        self.model, self.history = model, history
        ctx = model.config.context_length
        need = max(len(h) for h in history) + max_new_tokens
        max_len = min(ctx, 64 * -(-need // 64))  # rounded up, so that nearby requests share one compiled step
        kept = decode_step_for(model, len(history), max_len)
        with _IN_USE:
            self._kept = None if kept.in_use else kept
            if self._kept is not None:
                kept.in_use = True
        # The kept step's cache is one call's: a call while another uses it (another thread, or one made
        # from on_token) had cleared and refilled its rows under the other, whose tokens then came from
        # the wrong keys and values (generate20). It gets a cache of its own, and the same compiled code.
        self.decode = kept if self._kept is not None else DecodeStep(
            model, len(history), compile=True, cache=StaticKVCache.for_model(model, len(history), max_len), share=kept)

    def close(self) -> None:
        """The kept step is free for the next call."""
        if self._kept is not None:
            self._kept.in_use = False
            self._kept = None

    @property
    def full(self) -> bool:
        return self.width == self.model.config.context_length

    def prefill(self, window: int) -> torch.Tensor:
        """Each row's last ``window`` tokens into its row of the static cache; the last logits.
        Rows of one length are prefilled by one forward (sixteen prompts of 32 tokens: one
        eager forward instead of sixteen, each mostly Python and dispatch on a GPU)."""
        rows = [h[-window:] for h in self.history]
        self.lengths = [len(r) for r in rows]
        by_length: dict[int, list[int]] = {}
        for b, n in enumerate(self.lengths):
            by_length.setdefault(n, []).append(b)
        last: list[torch.Tensor | None] = [None] * len(rows)
        for n, group in by_length.items():
            ids = torch.tensor([rows[b] for b in group], device=self.model.device)
            cache = self.model.new_cache(len(group), max_len=n)
            out = self.model(ids, kv_cache=cache, last_only=True)[:, -1]
            for j, b in enumerate(group):
                # the cache is kept with the model: past this row's length it holds an earlier call's keys and
                # values, masked but read (0 x a NaN that an overflowing prompt left there is NaN: decode8)
                self.decode.cache.clear(b)
                self.decode.cache.fill_from(b, cache, source_row=j)
                last[b] = out[j]
        self.width = max(self.lengths)
        return torch.stack(last)

    def step(self, next_ids: list[int]) -> torch.Tensor:
        logits = self.decode(next_ids, self.lengths)
        self.lengths, self.width = [n + 1 for n in self.lengths], self.width + 1
        return logits


class _Steps(dict):
    """A model's compiled decode steps, ``{shape: DecodeStep}``, kept on the model itself: they go
    when it goes, at once (each holds the model weakly), and are neither copied nor pickled with it."""

    def __deepcopy__(self, memo) -> _Steps:
        return _Steps()

    def __reduce__(self):
        return _Steps, ()


_IN_USE = threading.Lock()  # guards DecodeStep.in_use of the kept steps


def decode_step_for(model, rows: int, max_len: int) -> DecodeStep:
    """The model's compiled :class:`DecodeStep` for ``rows`` rows of ``max_len`` positions,
    made (and compiled, on its first call) once and kept while the model lives."""
    weight = model.output_weight
    key = (rows, max_len, weight.dtype, weight.device, torch.is_autocast_enabled(weight.device.type))
    steps = model.__dict__.get("_decode_steps")
    if steps is None:
        steps = model.__dict__["_decode_steps"] = _Steps()
    if key not in steps:
        step = DecodeStep(model, rows, compile=True, cache=StaticKVCache.for_model(model, rows, max_len))
        step._hold_model_weakly()  # the model holds it: a strong edge back would be a cycle (cyc25 F2)
        steps[key] = step
    return steps[key]

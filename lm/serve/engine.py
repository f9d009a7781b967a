"""The serving engine: one scheduler thread owns the model and decodes many requests at once.

**Continuous batching.** The engine keeps ``max_batch`` slots; a slot is one row of a key/value
cache of ``context_length`` positions. A request waits in a queue until enough slots are free
(one per choice, ``n``). It then has its prompt prefilled (one forward over the prompt, alone),
its keys and values copied into its slots, and it joins the rows already decoding at the next
step. Each step advances every active row by one token. A row that finishes (end of text,
``max_tokens``, a stop string the server saw) or is cancelled (its client gone) gives its slot back
at once, to the next request in the queue; a request cancelled while it waits leaves the queue at
once, so that ``max_queue`` counts live requests only. A request of ``max_tokens`` 0 takes no slot:
its prompt is scored (``prompt_logprobs``) and nothing generated.

**Batch invariance.** A row's tokens must not depend on which other rows share the batch: a
request with a ``seed`` returns the same text alone or beside fifteen others. torch's CPU matmul
is not batch invariant: a row of ``x @ W.T`` changes in its last bits with the number of rows
(measured on this machine: 1 row, 2–3 rows and 4 or more rows give three different results). For
one shape, though, a row's result is the same whatever the other rows hold, and in any position
for most shapes (not here for 5-7 or 9-11 rows, whose last rows BLAS computes apart; the largest
step then gets idle rows beyond the slots, 8 or 12). So a decode step has one of a few fixed
shapes, its *step sizes* (by default the powers of two up to ``max_batch``, and ``max_batch``):
the active rows are kept in the lowest slots (a row whose neighbour leaves moves down, its cache
copied), and each step runs the smallest size that holds them, idle rows decoding a dummy token,
attention over all ``context_length`` positions (compiled: over the power-of-two span that holds
the longest row) with a row's unused ones masked out. At start the engine runs every size on
probe sequences in every row (short, half the context, all of it) and keeps only the sizes whose
rows all give the largest step's logits over the whole context bit for bit (eager on a CPU: 4
rows and more; compiled on a CPU every size, through the batch-invariant matmuls of
:class:`lm.generate.DecodeStep` and its kernels compiled for any span; the one-row graph, which
torch.compile builds apart, summed the tests' tiny model's keys in another order when steps read
the whole cache, and the probe would drop it).
A prefill runs alone, so it is the same whatever else is running. Each row samples from its own
logits with its own ``torch.Generator``. ``tests/test_serve.py`` checks the invariance bit for bit.

The engine knows ids only; text (decoding, stop strings) is the server's.
"""

from __future__ import annotations

import hashlib
import numbers
import operator
import secrets
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lm.checks import check_callback, check_flag, is_count
from lm.device import AUTOCAST_DTYPES, autocast, check_dtype
from lm.generate.engine import _token_ids
from lm.generate.kv_cache import KVCache
from lm.generate.sampling import (
    GENERATOR_SEED_BITS,
    NonFiniteLogitsError,
    check_eos_id,
    check_sampling_args,
    check_vocab_limit,
    next_token_and_finite,
)
from lm.generate.static import DecodeStep, StaticKVCache
from lm.io import clear_error_frames

MAX_LOGPROBS = 20  # the most alternatives a request may ask for at each position (vLLM's default)

# A position's log-probabilities: the token's own, and the ``logprobs`` most likely tokens' (id, value),
# most likely first. From the model's distribution (``log_softmax`` of its logits), not the one
# temperature and top-p sample from, as vLLM's and OpenAI's.
TokenLogprobs = tuple[float, list[tuple[int, float]]]


def _widths(max_batch: int) -> list[int]:
    """The widths the largest step may take, narrowest first: ``max_batch``, then (when its rows are
    not interchangeable) the next multiple of four and the next power of two."""
    return sorted({max_batch, -(-max_batch // 4) * 4, 1 << (max_batch - 1).bit_length()})


def default_step_sizes(max_batch: int) -> list[int]:
    """The powers of two below ``max_batch``, and ``max_batch``: 1, 2, 4, 8, 16 for 16."""
    return sorted({*(1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch), max_batch})


class QueueFull(RuntimeError):
    """The engine's queue holds ``max_queue`` requests already; try again later."""


class EngineStopped(RuntimeError):
    """The engine no longer takes requests (it is draining or stopped)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: ``temperature`` 0 is greedy; ``seed`` makes it repeatable;
    ``ignore_eos`` keeps going past the end-of-text token until ``max_tokens`` (as vLLM's does).
    ``logprobs`` (0 to :data:`MAX_LOGPROBS`) records every generated token's log-probability and
    that many alternatives (:attr:`Request.logprobs`); ``prompt_logprobs`` the same for the prompt's
    tokens after the first (:attr:`Request.prompt_logprobs`; decoder-only models)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    top_k: int | None = None  # sample from the top_k most likely tokens only (before top_p)

    def __post_init__(self) -> None:
        check_sampling_args(self.temperature, self.top_p, self.top_k)
        # 0: nothing generated, the prompt only scored (OpenAI's and vLLM's echo with max_tokens 0)
        # whole numbers, numpy's too (kept as ints): np.int64(3) had been "must be a whole number, got np.int64(3)"
        if not is_count(self.max_tokens):
            raise ValueError(f"max_tokens must be a whole number >= 0, got {self.max_tokens!r}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # (frozen: set once, here)
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (is_count(k) and k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or a whole number in [0, {MAX_LOGPROBS}], got {k!r}")
            object.__setattr__(self, name, None if k is None else int(k))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", int(self.top_k))

    def choice_generators(self, n: int) -> list[torch.Generator]:
        """A generator for each of ``n`` choices, from ``seed`` (a fresh random one without): choice
        ``j`` draws from the stream :func:`choice_seed` gives (seed, j)."""
        seed = self.seed if self.seed is not None else secrets.randbits(64)
        return [torch.Generator(device="cpu").manual_seed(choice_seed(seed, j)) for j in range(n)]


def choice_seed(seed: int, index: int) -> int:
    """The generator seed of choice ``index`` of a request seeded ``seed`` (any integer): a hash of
    the pair, so each (seed, choice) has a stream of its own unless two hashes meet (seed + j would
    be the first choice of seed + j; ``seed << 8 | j`` made seeds 2**55 apart the same and choice 256
    choice 0). torch's CPU generator keeps only the low 32 bits of its seed, so the hash is cut to
    those 32 bits (the streams are those of the 64-bit hash this returned before): any two pairs share
    a stream with probability 2**-32, which is small but not never."""
    digest = hashlib.blake2b(f"{seed},{index}".encode(), digest_size=8, person=b"lm-choice").digest()
    return int.from_bytes(digest, "little") & (2**GENERATOR_SEED_BITS - 1)


# Events the engine sends a request, from its own thread: a new token of choice ``index``, or the
# end of that choice with a finish reason ("stop": end of text, or ended by Request.stop, a stop
# string; "length": max_tokens; "cancelled": the client went away; "error": the engine failed).
OnToken = Callable[[int, int], None]
OnFinish = Callable[[int, str], None]


@dataclass
class Request:
    """A prompt (ids) to complete ``n`` times. ``on_token(index, id)`` and ``on_finish(index,
    reason)`` are called from the engine's thread; they must return quickly. The prompt may be a
    list of ids, a 1-D tensor or numpy array; it is kept as a list of ints (floats and bools refused,
    as :func:`lm.generate.generate` refuses them). With
    ``params.logprobs`` the engine appends each token's :data:`TokenLogprobs` to ``logprobs[index]``
    before it calls ``on_token``; with ``params.prompt_logprobs`` it sets ``prompt_logprobs`` (None
    for the first token, which nothing predicts) before the first ``on_token`` or ``on_finish``.
    :meth:`cancel` (the client went away) and :meth:`stop` (the server saw a stop string) end
    choices early, from any thread."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    on_token: OnToken | None = None
    on_finish: OnFinish | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Set from the server's thread, read by the engine's: each is replaced whole, never changed in place.
    _ended: dict[int, str] = field(default_factory=dict, init=False, repr=False)  # choice -> why it ends early
    _cancelled: bool = field(default=False, init=False, repr=False)  # every choice
    # set by submit; weak, so that requests a caller keeps (to read their logprobs) do not keep a
    # stopped engine alive, its model, cache and decode steps with it (cyc25)
    _engine: weakref.ref[Engine] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got params={self.params!r}")
        prompt = self.prompt_ids
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise ValueError(f"prompt_ids must be a list of token ids, a 1-D tensor or array, got {prompt!r}")
        self.prompt_ids = _token_ids(prompt)  # generate()'s rules: ints, numpy's and 1-D tensors' too
        check_callback("on_token", self.on_token)  # 5 had failed every request of the engine's step
        check_callback("on_finish", self.on_finish)

    def cancel(self, index: int | None = None) -> None:
        """Stop choice ``index`` (all choices when None) at the next step, as ``"cancelled"``; safe
        from any thread. A request cancelled whole while it waits leaves the queue at once."""
        if index is not None:
            return self._end(index, "cancelled")
        self._cancelled = True  # before reading _engine: submit sets _engine, then reads _cancelled
        engine = self._engine() if self._engine is not None else None
        if engine is not None:
            engine._withdraw(self)

    def stop(self, index: int) -> None:
        """End choice ``index`` at the next step as finished (``"stop"``: the server found a stop
        string in its text), its row freed at once; safe from any thread."""
        self._end(index, "stop")

    def _end(self, index: int, reason: str) -> None:
        if index not in self._ended:
            self._ended = {**self._ended, index: reason}

    def ended(self, index: int) -> str | None:
        """Why choice ``index`` is to end before its time (``"stop"``, ``"cancelled"``), or None."""
        return self._ended.get(index, "cancelled" if self._cancelled else None)


@dataclass
class _Row:
    request: Request
    index: int  # which choice of the request
    generator: torch.Generator
    length: int  # tokens in the slot's cache
    limit: int  # the most tokens it may generate (max_tokens, or less where the model says so)
    generated: int = 0
    last: int = 0  # the token to feed at the next step


class Stats:
    """What ``/metrics`` reports; updated by the engine's thread, read by the server's."""

    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self) -> None:
        self.requests = {"finished": 0, "cancelled": 0, "rejected": 0, "failed": 0}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps: Counter[int] = Counter()  # decode steps run, by step size (rows)
        self.step_rows = 0  # rows decoded, summed over steps: their mean batch size
        self.ttft_counts = [0] * (len(self.TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.queue_depth = 0
        self.batch_size = 0

    def ended(self, reason: str, choices: int = 1) -> None:
        """``choices`` choices ended: ``cancelled``, ``error`` (failed) or finished (``stop``: end of
        text or a stop string; ``length``). :attr:`requests` counts choices (a request of ``n``
        counts ``n``), whether they ran or ended waiting."""
        outcome = "cancelled" if reason == "cancelled" else "failed" if reason == "error" else "finished"
        self.requests[outcome] += choices

    def time_to_first_token(self, seconds: float) -> None:
        i = next((j for j, b in enumerate(self.TTFT_BUCKETS) if seconds <= b), len(self.TTFT_BUCKETS))
        self.ttft_counts[i] += 1
        self.ttft_sum += seconds


class Engine:
    """Continuous batching over ``max_batch`` slots for a decoder-only model (see the module).

    ``submit(request)`` queues a request (``QueueFull`` past ``max_queue`` waiting); ``step()``
    admits what fits and decodes one token of every active row; ``start()`` runs steps in a
    background thread until ``stop()``, which is for good (``with Engine(model) as engine:`` does
    both). ``step_sizes`` are the decode steps' numbers of rows
    (default :func:`default_step_sizes`); those kept after the start-up probe are
    :attr:`step_sizes`, the others :attr:`dropped_sizes`. ``compile`` compiles every size here.
    :attr:`bucketed`: whether a step attends over the positions in use only (the probe found it
    exact), or over the whole context.
    """

    architecture = "decoder_lm"  # the models this engine runs
    sends_eos = True  # the end-of-text token is a token of the completion (as vLLM's), and counted
    cache_class = StaticKVCache  # the slots: one cache row each

    def __init__(self, model, *, max_batch: int = 16, max_queue: int = 256, eos_id: int | None = None,
                 dtype: torch.dtype | None = None, vocab_size: int | None = None, compile: bool = False,
                 step_sizes: list[int] | None = None):
        if getattr(model.config, "architecture", "decoder_lm") != self.architecture:
            raise ValueError(f"{type(self).__name__} serves {self.architecture} models, got architecture "
                             f"{model.config.architecture!r}")
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue)):
            if not is_count(value, 1):  # numpy's integers too
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        max_batch, max_queue = int(max_batch), int(max_queue)
        check_vocab_limit(vocab_size, model.config.vocab_size)
        check_eos_id(eos_id, vocab_size or model.config.vocab_size)  # past the sampling limit it never comes
        check_flag("compile", compile)  # a string is truthy: compile="no" had compiled every step
        check_dtype("dtype", dtype, AUTOCAST_DTYPES)  # torch.int64 had only warned that autocast was off
        self.model = model.eval()
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos_id = None if eos_id is None else operator.index(eos_id)
        cfg = model.config
        self.vocab_size = vocab_size or cfg.vocab_size  # sample ids below it: the tokenizer's size
        self.context_length = cfg.context_length
        weight = model.output_weight
        self.device = weight.device
        self.rows: list[_Row | None] = [None] * max_batch
        self.dtype = dtype  # autocast's, None for the weights' own
        self._set_up_decoding(compile, step_sizes)
        self.waiting: deque[Request] = deque()  # live requests only: a cancelled one leaves at once
        self._withdrawn: list[Request] = []  # cancelled while waiting: the engine's thread ends their choices
        self.stats = Stats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.accepting = True
        self.error: BaseException | None = None
        # Called on the engine's thread with the exception when a step fails (every request in
        # has been failed by then, and no new one is taken): `lm serve` logs it and exits.
        self.on_error: Callable[[BaseException], None] | None = None
        # Called on the engine's thread when one row cannot go on (its logits are not finite): that
        # choice ends with "error" (a 500 for its request) and the other rows go on.
        self.on_row_error: Callable[[Request, BaseException], None] | None = None

    def _set_up_decoding(self, compile: bool, step_sizes: list[int] | None) -> None:
        """A :class:`DecodeStep` for each step size, over the leading rows of one cache (compiled
        when ``compile``, here: the smallest size, then the others at once), then the probe that
        keeps the invariant ones."""
        sizes = default_step_sizes(self.max_batch) if step_sizes is None else step_sizes
        bad = next((b for b in sizes if not is_count(b, 1) or b > self.max_batch), None)
        if bad is not None:
            raise ValueError(f"step_sizes: each must be a whole number in [1, max_batch={self.max_batch}], got {bad!r}")
        sizes = [int(b) for b in sizes]
        # The largest step holds every slot. If its rows are not interchangeable (a BLAS kernel
        # that computes some rows apart: on this CPU 5-7 and 9-11 rows), a wider one (idle rows
        # beyond the slots) that is takes its place, so that a row's bits never depend on its slot.
        for top in _widths(self.max_batch):
            self._make_steps(sizes, top, compile)
            self.step_sizes, self.dropped_sizes = self._invariant_sizes()
            if self.slot_invariant:
                break
        else:  # none: the max_batch step alone, rows as they fall (gpu_check reports slot_invariant)
            if top != self.max_batch:  # (not made again when it was the only width: no second compilation)
                self._make_steps(sizes, self.max_batch, compile)
                self.step_sizes, self.dropped_sizes = self._invariant_sizes()
        for slot in range(self.cache.rows):  # the probe's sequences are gone
            self.cache.release(slot)

    def _make_steps(self, sizes: list[int], top: int, compile: bool) -> None:
        """The steps of ``sizes`` and of ``top`` rows (>= max_batch), over one cache of ``top`` rows."""
        self.cache = self.cache_class.for_model(self.model, top)
        self.steps: dict[int, DecodeStep] = {}
        for b in sorted({*sizes, top}):  # compiled: the sizes share the compiled code
            first = next(iter(self.steps.values()), None) if compile else None
            self.steps[b] = DecodeStep(self.model, b, compile=compile, dtype=self.dtype, cache=self.cache.leading(b),
                                       share=first)

    @torch.inference_mode()
    def _invariant_sizes(self) -> tuple[list[int], list[int]]:
        """Run every step size on probe sequences in all its rows (random ids prefilled, then a few steps; a
        short sequence, one of half the context and one that fills it, so that every reduction over
        the key positions runs in full); keep the sizes whose rows all give the logits of the
        largest step's first row over the whole cache, bit for bit. Returns the sizes kept and those
        dropped. If the largest step's own rows disagree with one another, rows are not invariant to
        their slot there: :attr:`slot_invariant` is False and only that step is used
        (:meth:`_set_up_decoding` then tries a wider one). If its logits over a short span
        (:attr:`DecodeStep.bucketed`) differ from those over the whole cache, every step attends
        over the whole cache (:attr:`bucketed` False) and the sizes are probed again."""
        ctx, top = self.context_length, max(self.steps)
        if ctx < 2:  # no request fits (a prompt and a token): nothing to probe
            self.slot_invariant = False
            return [top], [b for b in self.steps if b != top]
        g = torch.Generator().manual_seed(0)
        logits: dict[int, list[Tensor]] = {b: [] for b in self.steps}
        full: list[Tensor] = []  # the largest step over the whole cache: the reference
        for n in sorted({max(1, min(12, ctx // 2)), max(1, ctx // 2), max(1, ctx - 3)}):
            one = self._probe_cache(g, n)
            tokens = torch.randint(0, self.vocab_size, (min(3, ctx - n),), generator=g).tolist()
            for slot in range(top):
                self.cache.fill_from(slot, one)
            for b, step in self.steps.items():  # (first: compiled, the spans are then symbolic)
                logits[b] += [step([t] * b, [n + i] * b) for i, t in enumerate(tokens)]
            full += [self.steps[top]([t] * top, [n + i] * top, full_span=True) for i, t in enumerate(tokens)]
        reference = torch.stack(full)  # (probe steps, rows, vocab)
        out = {b: torch.stack(steps) for b, steps in logits.items()}
        self.slot_invariant = bool((reference == reference[:, :1]).all())
        if not self.slot_invariant:
            return [top], [b for b in self.steps if b != top]
        if self.bucketed and not bool((out[top] == reference).all()):
            for step in self.steps.values():
                step.bucketed = False
            return self._invariant_sizes()
        agree = {b: bool((o == reference[:, :1]).all()) for b, o in out.items()}
        return [b for b in self.steps if agree[b]], [b for b in self.steps if not agree[b]]

    @property
    def bucketed(self) -> bool:
        """Whether the steps attend over the positions in use only (:attr:`DecodeStep.bucketed`)."""
        return all(step.bucketed for step in self.steps.values())

    def _probe_cache(self, g: torch.Generator, n: int) -> KVCache:
        """A one-row cache of ``n`` positions of random ids, as a request's prefill leaves it."""
        return self._prefilled(torch.randint(0, self.vocab_size, (n,), generator=g).tolist())[1]

    # -- the request side (any thread) -------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raise ``ValueError`` (naming the field) if ``request`` can never run here."""
        p = request.prompt_ids
        if not p:
            raise ValueError("prompt: empty; give at least one token")
        vocab = self.model.config.vocab_size
        bad = next((t for t in p if not 0 <= t < vocab), None)  # ints: Request made them so
        if bad is not None:
            raise ValueError(f"prompt: token id {bad!r} is outside [0, {vocab})")
        if not is_count(request.n, 1) or request.n > self.max_batch:  # numpy's integers too (generate20)
            raise ValueError(f"n: must be a whole number in [1, {self.max_batch}], got {request.n!r}")
        request.n = int(request.n)
        self._check_lengths(request)

    def _check_lengths(self, request: Request) -> None:
        p = request.prompt_ids
        total = len(p) + request.params.max_tokens
        if total > self.context_length:
            raise ValueError(
                f"max_tokens: the context is {self.context_length} tokens, and this request asks for {total} "
                f"({len(p)} in the prompt + {request.params.max_tokens} to generate)"
            )

    def submit(self, request: Request) -> None:
        """Queue ``request``: :class:`QueueFull` when ``max_queue`` requests wait already."""
        self.submit_all([request])

    def submit_all(self, requests: list[Request]) -> None:
        """Queue ``requests`` (the prompts of one API call) all or none: :class:`QueueFull`, every
        choice counted rejected, when they do not all fit in the queue; ``ValueError`` if one can
        never run."""
        for request in requests:
            self.check(request)
        with self._lock:
            if not self.accepting:
                raise EngineStopped("the engine is stopped" if self._stop else "the server is shutting down")
            if len(self.waiting) + len(requests) > self.max_queue:
                self.stats.requests["rejected"] += sum(r.n for r in requests)
                these = f", and this request has {len(requests)} prompts" if len(requests) > 1 else ""
                raise QueueFull(f"{len(self.waiting)} requests are waiting already{these} "
                                f"(max_queue={self.max_queue})")
            for request in requests:
                request._engine = weakref.ref(self)
                (self._withdrawn if request._cancelled else self.waiting).append(request)
            self.stats.queue_depth = len(self.waiting)
            self._wake.notify()

    def _withdraw(self, request: Request) -> None:
        """Take a request cancelled whole out of the queue, if it waits there (any thread); the
        engine's thread then ends its choices. One that runs ends at the next step."""
        with self._lock:
            at = next((i for i, r in enumerate(self.waiting) if r is request), None)  # `is`: requests compare by value
            if at is None:
                return
            del self.waiting[at]
            self.stats.queue_depth = len(self.waiting)
            self._withdrawn.append(request)
            self._wake.notify()

    @property
    def busy(self) -> bool:
        """Whether any request is waiting, decoding, or cancelled and not yet told."""
        return bool(self.waiting or self._withdrawn) or any(r is not None for r in self.rows)

    # -- the scheduler (the engine's thread) -------------------------------------------------
    @torch.inference_mode()
    def step(self) -> bool:
        """Admit waiting requests into free slots, then decode one token of every active row.
        Returns whether there was anything to do."""
        self._drop_ended()
        self._admit()
        self._compact()
        active = [i for i, r in enumerate(self.rows) if r is not None]
        self.stats.batch_size = len(active)
        if not active:
            return False
        size = next(b for b in self.step_sizes if b > active[-1])
        rows = self.rows[:size] + [None] * (size - self.max_batch)  # a step wider than the slots: idle rows
        logits = self.steps[size]([r.last if r is not None else 0 for r in rows],
                                  [r.length if r is not None else 0 for r in rows])
        self.stats.steps[size] += 1
        self.stats.step_rows += len(active)
        for i in active:
            row = self.rows[i]
            row.length += 1
            self._emit(i, row, logits[i])
        return True

    def _compact(self) -> None:
        """Move rows down into free slots below them, so that the active rows are the lowest
        ones and the step that holds them is as small as it can be (with only the ``max_batch``
        size, rows stay where they are)."""
        if len(self.step_sizes) == 1:
            return
        free = [i for i, r in enumerate(self.rows) if r is None]
        for slot in free:
            last = max((i for i, r in enumerate(self.rows) if r is not None), default=-1)
            if last < slot:
                break
            row = self.rows[last]
            self.cache.move(last, slot, row.length)
            self.cache.release(last)
            self.rows[slot], self.rows[last] = row, None

    def _admit(self) -> None:
        """End the choices of the requests cancelled while they waited, then prefill waiting
        requests into free slots, first come first served (``max_tokens`` 0 needs none)."""
        while True:
            free = [i for i, r in enumerate(self.rows) if r is None]  # rows change on this thread only
            with self._lock:
                withdrawn, self._withdrawn = self._withdrawn, []
                request = self.waiting[0] if self.waiting else None
                need = 0 if request is None or request.params.max_tokens == 0 else request.n
                if request is not None and len(free) >= need:
                    self.waiting.popleft()
                    self.stats.queue_depth = len(self.waiting)
                else:
                    request = None
            for cancelled in withdrawn:  # (callbacks outside the lock: one may cancel a request)
                self._finish_all(cancelled, "cancelled")
            if request is None:
                return
            self._prefill(request, free[:need])

    def _prefilled(self, prompt_ids: list[int]) -> tuple[Tensor, KVCache]:
        """The prompt run alone: its last position's logits, and the one-row cache holding it."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        one = self.model.new_cache(1, max_len=len(prompt_ids))
        with autocast(self.device, self.dtype), self.model.trusted_ids():  # ids checked by check(), or drawn
            return self.model(ids, kv_cache=one, last_only=True)[0, -1], one

    def _prefill(self, request: Request, slots: list[int]) -> None:
        """Run the prompt and start a row in each slot (none: ``max_tokens`` 0, the prompt only
        scored with ``prompt_logprobs``, every choice ended with ``"length"``)."""
        self.stats.prompt_tokens += len(request.prompt_ids)
        if request.params.logprobs is not None:
            request.logprobs = [[] for _ in range(request.n)]
        if request.params.prompt_logprobs is not None:
            try:
                request.prompt_logprobs = self._prompt_logprobs(request.prompt_ids, request.params.prompt_logprobs)
            except NonFiniteLogitsError as e:  # the request fails, as a row does in _emit; the others go on
                if self.on_row_error is not None:
                    self.on_row_error(request, e)
                return self._finish_all(request, "error")
        if not slots:
            return self._finish_all(request, "length")
        logits, one = self._prefilled(request.prompt_ids)
        generators = request.params.choice_generators(len(slots))
        for index, (slot, generator) in enumerate(zip(slots, generators)):
            self.cache.fill_from(slot, one)
            row = _Row(request, index, generator, length=one.length, limit=self._limit(request))
            self.rows[slot] = row
            self._emit(slot, row, logits)

    def _prompt_logprobs(self, prompt_ids: list[int], k: int) -> list[TokenLogprobs | None]:
        """Each prompt token's log-probability given the ones before it (and ``k`` alternatives), from
        one plain forward over the prompt (every position's logits; the prefill keeps only the last).
        :class:`NonFiniteLogitsError` if a logit is NaN or infinite: with ``max_tokens`` 0 no token is
        sampled, so :meth:`_emit`'s check never runs, and NaN is no JSON (a 500 "internal error", or
        bare ``NaN`` in a stream, counted finished)."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        with autocast(self.device, self.dtype), self.model.trusted_ids():
            logits = self._allowed(self.model(ids)[0, :-1])
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogitsError()
        return [None, *_logprobs(logits, ids[0, 1:], k)]

    def _limit(self, request: Request) -> int:
        """The most tokens a choice of ``request`` may generate."""
        return request.params.max_tokens

    def _allowed(self, logits: Tensor) -> Tensor:
        """The logits a row samples from (here the model's own, up to the tokenizer's size), of one
        position or several."""
        return logits[..., :self.vocab_size]

    def _emit(self, slot: int, row: _Row, logits: Tensor) -> None:
        """Sample the row's next token from its logits, send it, and free the slot if it is done.
        The end-of-text token is sent as a token unless :attr:`sends_eos` is False."""
        request, p = row.request, row.request.params
        if (early := request.ended(row.index)) is not None:
            return self._free(slot, early)
        allowed = self._allowed(logits)
        token, finite = next_token_and_finite(allowed[None], temperature=p.temperature, top_p=p.top_p,
                                              top_k=p.top_k, generator=row.generator)
        token, finite = torch.stack([token[0], finite[0].to(token.dtype)]).tolist()  # one read for both
        if not finite:  # this row's logits overflowed (NaN or inf): its request fails, the others go on
            if self.on_row_error is not None:
                self.on_row_error(request, NonFiniteLogitsError(row.generated + 1))
            self.cache.clear(slot)  # its NaN keys would reach the next row in the slot through the mask
            return self._free(slot, "error")
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
            self.stats.time_to_first_token(request.first_token_at - request.arrival)
        ends = self.eos_id is not None and token == self.eos_id and not p.ignore_eos
        if ends and not self.sends_eos:
            return self._free(slot, "stop")
        row.generated += 1
        row.last = token
        self.stats.generated_tokens += 1
        if p.logprobs is not None:
            request.logprobs[row.index] += _logprobs(allowed[None], torch.tensor([token]), p.logprobs)
        if request.on_token is not None:
            request.on_token(row.index, token)
        if ends:
            self._free(slot, "stop")
        elif row.generated >= row.limit:
            self._free(slot, "length")

    def _free(self, slot: int, reason: str) -> None:
        row = self.rows[slot]
        self.rows[slot] = None
        self.cache.release(slot)
        self.stats.batch_size = sum(r is not None for r in self.rows)  # counted before the client hears
        self.stats.ended(reason)
        if row.request.on_finish is not None:
            row.request.on_finish(row.index, reason)

    def _drop_ended(self) -> None:
        """Free the rows that :meth:`Request.cancel` or :meth:`Request.stop` ended."""
        for slot, row in enumerate(self.rows):
            if row is not None and (early := row.request.ended(row.index)) is not None:
                self._free(slot, early)

    def _finish_all(self, request: Request, reason: str) -> None:
        self.stats.ended(reason, request.n)  # counted before the client hears, as in _free
        if request.on_finish is not None:
            for index in range(request.n):
                request.on_finish(index, reason)

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        """Run the scheduler in a background thread (once: a stopped engine stays stopped)."""
        if self._stop:
            raise EngineStopped("the engine is stopped: make a new Engine to serve again")
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="lm-engine", daemon=True)
        self._thread.start()

    def __enter__(self) -> Engine:
        """``with Engine(model) as engine:`` runs the thread for the block and stops it after (an
        engine started and never stopped lives, its model and cache with it, while its thread runs)."""
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self.busy:
                        self._wake.wait()
                    if self._stop:
                        break
                self.step()
        except BaseException as e:  # a failing model must not leave clients waiting forever
            self.error = e
            self._fail_everything()
            if self.on_error is not None:
                self.on_error(e)
            # The error (kept as .error) holds its traceback, whose frames hold the engine: a cycle that
            # kept a failed engine, its model and cache, until a collection. Their locals go (the
            # lines stay, for a traceback printed later), and this frame lets go of the engine.
            clear_error_frames(e)  # and those of the errors it was raised from or during
            del self

    def _fail_everything(self) -> None:
        with self._lock:
            self.accepting = False
            waiting, self.waiting = list(self.waiting), deque()
            withdrawn, self._withdrawn = self._withdrawn, []
            self.stats.queue_depth = 0
        for slot, row in enumerate(self.rows):
            if row is not None:
                self._free(slot, "error")
        for request in waiting:
            self._finish_all(request, "error")
        for request in withdrawn:
            self._finish_all(request, "cancelled")

    def stop_accepting(self) -> None:
        """New requests get :class:`EngineStopped`; the ones already in go on to the end."""
        with self._lock:
            self.accepting = False

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread (requests still in are finished with ``cancelled``) for good: later
        requests get :class:`EngineStopped` (they had waited for ever for a thread that is gone)."""
        with self._lock:
            self._stop = True
            self.accepting = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for slot, row in enumerate(self.rows):
            if row is not None:
                self._free(slot, "cancelled")
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
            waiting += self._withdrawn
            self._withdrawn = []
            self.stats.queue_depth = 0
        for request in waiting:
            self._finish_all(request, "cancelled")


def _logprobs(logits: Tensor, tokens: Tensor, k: int) -> list[TokenLogprobs]:
    """Row ``i``'s :data:`TokenLogprobs` for ``tokens[i]`` under ``logits[i]`` (``log_softmax`` in
    float32), with its ``k`` most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    own = logp.gather(-1, tokens.to(logp.device)[:, None])[:, 0].tolist()
    values, ids = logp.topk(k, dim=-1)
    return [(lp, list(zip(i, v))) for lp, i, v in zip(own, ids.tolist(), values.tolist())]

"""Turning next-token logits into a token: temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import hashlib
import operator

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lm.checks import as_integer, as_real, check_sampling_args, check_top_k, check_top_p
from lm.nn import softmax

# Below this temperature sampling is greedy, as in vLLM: dividing the logits by a temperature far
# smaller overflows float32 (1e-300 is 0 in float32, and 100 / 1e-37 is inf), and softmax then
# gives NaN; at 1e-5 a logit 1e-4 below the largest is already e^-10 as likely.
GREEDY_BELOW = 1e-5


def check_generator(generator) -> None:
    """``generator`` is a ``torch.Generator`` or None (an int had raised an AttributeError on ``.device``)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got generator={generator!r}")


# The seed torch's CPU generator (mt19937) uses is the low 32 bits of the one it is given.
GENERATOR_SEED_BITS = 32


def generator_seed(seed: int) -> int:
    """The seed to give torch's CPU generator for a user's ``seed`` in [0, 2**64 - 1]: ``seed`` itself
    below 2**32, a 32-bit hash of it from 2**32 on.

    torch's CPU generator keeps only the low 32 bits of its seed, so seeds 2**32 apart (5 and 2**32 + 5)
    had drawn the same tokens. A seed below 2**32 keeps its samples; seeds that differ only in their
    high bits now get different streams. The generator still has 2**32 seeds, so two of the 2**64 can
    share a stream (any given pair with probability about 2**-32)."""
    s = as_integer(seed)
    if s is None or not 0 <= s < 2**64:
        raise ValueError(f"seed must be a whole number in [0, 2**64-1], got seed={seed!r}")
    if s < 2**GENERATOR_SEED_BITS:
        return s
    digest = hashlib.blake2b(s.to_bytes(8, "little"), digest_size=GENERATOR_SEED_BITS // 8, person=b"lm-seed")
    return int.from_bytes(digest.digest(), "little")


def check_vocab_limit(vocab_size: int | None, model_vocab_size: int) -> None:
    """``vocab_size`` (sample only ids below it, the tokenizer's size) is None or in [1, the model's]."""
    if vocab_size is not None and (as_integer(vocab_size) is None or not 1 <= vocab_size <= model_vocab_size):
        raise ValueError(f"vocab_size must be in [1, {model_vocab_size}] (the model's), got vocab_size={vocab_size!r}")


def check_eos_id(eos_id: int | None, vocab_size: int) -> None:
    """``eos_id`` is None or one token id (an int or a numpy integer, not a bool) in [0, ``vocab_size``)."""
    if eos_id is not None and (as_integer(eos_id) is None or not 0 <= eos_id < vocab_size):
        list_of_ids = isinstance(eos_id, (list, tuple, set)) or isinstance(eos_id, torch.Tensor) and eos_id.dim()
        raise ValueError(f"eos_id must be None or one token id in [0, vocab_size={vocab_size}), got "
                         f"eos_id={eos_id!r}" + (" (one id, not a list of them)" if list_of_ids else ""))


def top_p_filter(probs: Float[Tensor, "... vocab"], top_p: float) -> Float[Tensor, "... vocab"]:
    """Zero every probability outside the smallest set of most likely tokens whose total
    mass is ≥ ``top_p``, and renormalise. ``top_p`` is checked as :func:`sample_next_token` checks it
    (a NaN, 0 or negative one had kept the likeliest token alone: greedy, silently).

    ``top_p`` is a number, or a tensor of one per row: of ``probs``' shape without the vocabulary
    (``(rows,)``) or with it as 1 (``(rows, 1)``)."""
    if isinstance(top_p, Tensor) and top_p.numel() > 1:  # one per row: every one in (0, 1]
        rows = probs.shape[:-1]
        if top_p.shape == rows:  # (rows,) had been lined up against the vocabulary, not the rows
            top_p = top_p.unsqueeze(-1)
        elif top_p.shape != (*rows, 1):
            raise ValueError(f"top_p: one per row needs shape {tuple(rows)} or {(*rows, 1)} for probs of shape "
                             f"{tuple(probs.shape)}, got {tuple(top_p.shape)}")
        if top_p.dtype.is_floating_point and bool(((top_p > 0) & (top_p <= 1)).all()):
            return _top_p_filter(probs, top_p)
        raise ValueError(f"top_p must be in (0, 1], got a tensor of top_p values of dtype {top_p.dtype} with "
                         f"some outside it: {top_p.flatten()[:8].tolist()}")
    if isinstance(top_p, Tensor):  # one for all rows, as a tensor
        real = as_real(top_p)
        if real is None or not 0 < real <= 1:
            raise ValueError(f"top_p must be in (0, 1], got top_p={top_p!r}")
        return _top_p_filter(probs, real)
    check_top_p(top_p)
    return _top_p_filter(probs, float(top_p))


def top_k_filter(logits: Float[Tensor, "... vocab"], top_k: int) -> Float[Tensor, "... vocab"]:
    """Keep the ``top_k`` largest logits and any tied with the k-th (``-inf`` elsewhere).

    Ties are kept as Hugging Face's ``TopKLogitsWarper`` and vLLM keep them: which of tied tokens
    ``topk`` returns is arbitrary, and bfloat16 logits tie often. ``top_k`` is a positive integer
    (numpy's too), checked as :func:`sample_next_token` checks it."""
    check_top_k(top_k, none_ok=False)
    return _top_k_filter(logits, operator.index(top_k))


# The filters unchecked: sample_next_token checks its arguments once, before it calls them.
def _top_p_filter(probs: Float[Tensor, "... vocab"], top_p: float) -> Float[Tensor, "... vocab"]:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True  # the likeliest token always (a top_p below float32's least is 0 there)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_k_filter(logits: Float[Tensor, "... vocab"], top_k: int) -> Float[Tensor, "... vocab"]:
    if top_k >= logits.shape[-1]:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def sample_next_token(
    logits: Float[Tensor, "... vocab"],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, "*shape"]:
    """One token id per row. ``temperature`` 0 (or below :data:`GREEDY_BELOW`) is greedy (argmax;
    top-k/top-p are moot).

    Logits that are not finite are not checked here (on a GPU that is a read from the device of its
    own): greedy picks a token anyway, sampling raises torch's error. :func:`next_token_and_finite`
    returns the tokens with a flag to read with them."""
    check_sampling_args(temperature, top_p, top_k)
    check_generator(generator)
    temperature, top_p, top_k = float(temperature), float(top_p), None if top_k is None else operator.index(top_k)
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        logits = _top_k_filter(logits, top_k)
    probs = softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = _top_p_filter(probs, top_p)
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        # A CPU generator with a GPU model: draw on the CPU, so a seed gives the same tokens anywhere.
        return torch.multinomial(flat.cpu(), 1, generator=generator).to(probs.device).reshape(probs.shape[:-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


class NonFiniteLogitsError(ValueError):
    """The model's next-token logits hold NaN or +inf (or are -inf for every token), so no token can be
    chosen: a model that diverged, or that overflows. Sampled, ``multinomial`` had raised torch's own
    error; greedy, ``argmax`` had picked a token anyway (text that means nothing)."""

    def __init__(self, token: int | None = None, prompt: int | None = None, *, where: str | None = None):
        self.token, self.prompt = token, prompt  # prompt: the row's index in the batch the decoder was given
        where = where or ("" if prompt is None else f"prompt {prompt}")
        at = "" if token is None else f" at new token {token}" + (f" of {where}" if where else "")
        super().__init__(f"the model's logits are not finite (NaN or inf){at}")

    def naming(self, rows: list[int], what: str) -> NonFiniteLogitsError:
        """The same error with its prompt named as the user gave it: ``what`` and ``rows[prompt]``
        (``"--input line"`` and the 1-based line numbers of the batch's rows), not its place in the batch."""
        if self.prompt is None:
            return self
        return NonFiniteLogitsError(self.token, self.prompt, where=f"{what} {rows[self.prompt]}")


def next_token_and_finite(
    logits: Float[Tensor, "... vocab"],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "*shape"], Bool[Tensor, "*shape"]]:
    """:func:`sample_next_token`'s token per row, and whether the row could be chosen from: its largest
    logit (after the temperature) is finite, so no NaN, no +inf, and not every token at -inf (a -inf
    where top-k or a decoder rules a token out is fine). Both stay on the logits' device: a loop that
    reads its tokens back reads the flags in the same transfer, not in a second sync
    (:func:`lm.generate.generate`); a row that is not finite gets an arbitrary token."""
    check_sampling_args(temperature, top_p, top_k)
    check_generator(generator)
    temperature = float(temperature)
    top = logits.amax(dim=-1).float()
    if temperature < GREEDY_BELOW:
        return sample_next_token(logits, temperature=temperature), torch.isfinite(top)
    finite = torch.isfinite(top / temperature)  # the temperature can overflow a finite logit
    logits = torch.where(finite[..., None], logits, 0)  # or multinomial refuses the whole batch
    tokens = sample_next_token(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
    return tokens, finite

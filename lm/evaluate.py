"""Evaluate a language model on a whole token sequence (loss, perplexity and bits per byte), and a
translation model on sentence pairs (loss, BLEU and chrF: ``evaluate_pairs``, ``bleu_chrf``).

Every token but the first is predicted exactly once. By default the sequence is cut into
consecutive windows of ``context_length`` inputs, so a token sees as much left context as its
window gives (none at a window's start). With ``stride`` < ``context_length`` the windows slide
by ``stride`` tokens and each scores only the tokens the previous one did not, so every token
after the first window sees at least ``context_length - stride`` tokens of context: the
sliding-window evaluation of Hugging Face's perplexity guide, at ``context_length / stride``
times the compute.
Bits per byte divide the summed loss (in bits) by the bytes of the text it was summed over,
which makes tokenizers of different vocabularies comparable. Given each token's byte length
(``token_bytes``), the bytes are those of the tokens actually scored: a prefix cut by
``max_tokens`` can have quite another bytes per token than the whole file, and the first token,
never predicted, is not counted. A ``bytes_per_token`` ratio is an estimate of the scored text's.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from lm.checks import as_real, check_positive, check_size, is_count
from lm.data.batch import _check_tokens

__all__ = ["bits_per_byte", "bleu_chrf", "collate_pairs", "evaluate_pairs", "evaluate_tokens", "perplexity",
           "token_byte_lengths"]


def _check_loss(loss: float) -> None:
    """A mean cross-entropy: a number >= 0 (inf an overflowed one, NaN a diverged one: both passed
    on as they are); a negative one is no cross-entropy (``perplexity(-1.0)`` had been 0.37)."""
    real = as_real(loss)
    if real is None or real < 0:
        raise ValueError(f"loss must be a number >= 0 (a mean cross-entropy), got loss={loss!r}")


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean loss in nats per token (capped where ``exp`` would overflow)."""
    _check_loss(loss)
    return math.exp(min(as_real(loss), 700.0))


def bits_per_byte(loss: float, bytes_per_token: float | None) -> float | None:
    """A mean loss in nats per token as bits per byte of the text (None without a byte count), the
    measure that does not depend on the tokenizer."""
    _check_loss(loss)
    if bytes_per_token is None or bytes_per_token == 0:  # no byte count (a file of no text: none either)
        return None
    check_positive("bytes_per_token", bytes_per_token)
    return as_real(loss) / math.log(2) / as_real(bytes_per_token)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """The length in bytes of each token id's text (0 for an id the vocabulary lacks): the
    ``token_bytes`` of :func:`evaluate_tokens`. A special token counts as the bytes of its text,
    as it stands in the source file."""
    vocab = tokenizer.vocab
    return np.array([len(vocab.get(i, b"")) for i in range(tokenizer.vocab_size)], dtype=np.int64)


@torch.no_grad()
def evaluate_tokens(
    model: torch.nn.Module,
    tokens: np.ndarray,
    *,
    batch_size: int = 8,
    max_tokens: int | None = None,
    bytes_per_token: float | None = None,
    token_bytes: np.ndarray | None = None,
    stride: int | None = None,
    progress: bool = False,
) -> dict[str, float | int | None]:
    """Mean next-token loss of ``model`` over ``tokens`` (a 1-D id array, a memmap is fine).

    ``stride`` (default ``context_length``): how far each window moves on (see the module doc).
    Bits per byte count the bytes of the scored tokens with ``token_bytes`` (each id's byte
    length, :func:`token_byte_lengths`), else estimate them with ``bytes_per_token``; the result's
    ``bytes`` is the count used (None for an estimate).

    A model whose logits are not finite (NaN or inf) raises
    :class:`~lm.generate.NonFiniteLogitsError` naming the first tokens (positions in ``tokens``,
    from 0) whose loss is not: a loss of NaN is no measurement."""
    if bytes_per_token is not None and token_bytes is not None:
        raise ValueError("bytes_per_token: give it or token_bytes, not both")
    _check_tokens(tokens, "tokens")  # a float id had been truncated, a 2-D array scored as a batch of rows
    if bytes_per_token is not None and bytes_per_token != 0:  # 0: no byte count, as bits_per_byte takes it
        check_positive("bytes_per_token", bytes_per_token)
    lengths = None if token_bytes is None else _byte_lengths(token_bytes)
    check_size("batch_size", batch_size)
    if max_tokens is not None:
        check_size("max_tokens", max_tokens)
    ctx = model.config.context_length
    stride = ctx if stride is None else stride
    if not is_count(stride, 1) or stride > ctx:
        raise ValueError(f"stride: must be between 1 and the context length {ctx}, got {stride}")
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    if n < 2:
        raise ValueError(f"data: needs at least 2 tokens to predict one, got {n}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    # (begin, end, first): inputs tokens[begin:end], targets tokens[begin + 1 : end + 1], of
    # which those from offset `first` on are scored (the earlier ones were, by the previous window)
    windows, begin, done = [], 0, 0
    while done < n - 1:
        end = min(begin + ctx, n - 1)
        windows.append((begin, end, done - begin))
        done, begin = end, begin + stride
    total, count, nbytes = 0.0, 0, 0
    bar = tqdm(total=n - 1, unit="tok", unit_scale=True, desc="eval",
               disable=None if progress else True, file=sys.stderr)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    # the ids are checked here, on the host, not by every forward on the device (two syncs each)
    trusted = model.trusted_ids() if hasattr(model, "trusted_ids") else contextlib.nullcontext()
    try:
        with trusted:
            # a batch: up to batch_size consecutive windows of one shape (length, first)
            for (length, first), same in itertools.groupby(windows, key=lambda w: (w[1] - w[0], w[2])):
                same = list(same)
                for i in range(0, len(same), batch_size):
                    batch = same[i : i + batch_size]
                    rows = _window_rows(tokens, batch, vocab)
                    total, count = _add(model, rows, first, device, total, count)
                    if not math.isfinite(total):  # read with the batch's loss: no other sync
                        raise _not_finite(f"the loss of tokens {batch[0][0] + first + 1:,}-{batch[-1][1]:,} "
                                          f"(of 0-{n - 1:,}) is {total}")
                    if lengths is not None:
                        nbytes += _scored_bytes(rows[:, first + 1 :], lengths)
                    bar.update(rows.shape[0] * (length - first))
    finally:
        bar.close()
        model.train(was_training)
    loss = total / count
    if lengths is not None:
        bytes_per_token = nbytes / count
    return {
        "loss": loss,
        "perplexity": perplexity(loss),
        "bits_per_byte": bits_per_byte(loss, bytes_per_token),
        "bytes_per_token": bytes_per_token,
        "tokens": count,
        "bytes": None if lengths is None else nbytes,
    }


def _byte_lengths(token_bytes) -> np.ndarray:
    """Each id's byte length, checked: integers >= 0 (2.5 had counted as 2, -1 given a negative bpb)."""
    lengths = np.asarray(token_bytes)
    if lengths.ndim != 1 or not (np.issubdtype(lengths.dtype, np.integer) or lengths.size == 0):
        raise ValueError(f"token_bytes must be a 1-D array of integers (each id's byte length), got "
                         f"{lengths.ndim} dimension(s) of dtype {lengths.dtype}")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"token_bytes: byte lengths must be >= 0, got {int(lengths.min())} for id "
                         f"{int(lengths.argmin())}")
    return lengths.astype(np.int64, copy=False)


def _not_finite(where: str) -> ValueError:
    """A :class:`~lm.generate.NonFiniteLogitsError` (what the decoders raise for the same model) that
    says ``where``: the logits are read only through the loss here, so an overflow in the loss
    itself (logits too far apart for float32) is reported alike."""
    from lm.generate.sampling import NonFiniteLogitsError

    error = NonFiniteLogitsError()
    error.args = (f"{error} or overflow: {where}",)
    return error


def _scored_bytes(targets: np.ndarray, lengths: np.ndarray) -> int:
    """The bytes of the scored target ids (already checked against the model's vocabulary)."""
    hi = int(targets.max())
    if hi >= len(lengths):
        raise ValueError(f"token_bytes: has {len(lengths)} entries, no byte length for id {hi}")
    return int(lengths[targets].sum())


def _window_rows(tokens: np.ndarray, windows, vocab: int | None) -> np.ndarray:
    """The windows' ids (inputs and targets) as one int64 array, checked against the vocabulary here."""
    rows = np.stack([np.asarray(tokens[b : e + 1], dtype=np.int64) for b, e, _ in windows])
    lo, hi = int(rows.min()), int(rows.max())
    if vocab is not None and (lo < 0 or hi >= vocab):
        raise ValueError(f"data: id {lo if lo < 0 else hi} is outside the model's vocabulary [0, vocab_size={vocab})")
    return rows


def _add(model, rows: np.ndarray, first: int, device, total: float, count: int) -> tuple[float, int]:
    """Add the summed loss of the targets from offset ``first`` on of a batch of windows."""
    xy = torch.from_numpy(rows).to(device)
    x, y = xy[:, :-1], xy[:, first + 1 :]
    if hasattr(model, "hidden_states") and hasattr(model, "output_weight"):
        from lm.nn import linear_cross_entropy

        loss = linear_cross_entropy(model.hidden_states(x)[:, first:], model.output_weight, y)
    else:
        loss = _ce(model(x)[:, first:], y)
    k = y.numel()
    return total + float(loss) * k, count + k


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from lm.nn import cross_entropy

    return cross_entropy(logits.float(), targets)


# -- translation ----------------------------------------------------------------------------------

def collate_pairs(sources, targets, *, pad_id: int, bos_id: int, eos_id: int, device="cpu"):
    """A :class:`lm.data.pairs.PairBatch` from lists of source and target ids (``<eos>``/``<bos>`` added):
    as many sources as targets, ids integers (a float had been truncated), ``pad_id``, ``bos_id`` and
    ``eos_id`` distinct ids (``>= 0``)."""
    from lm.data.pairs import PairBatch

    specials = {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}
    for name, value in specials.items():
        if not is_count(value):
            raise ValueError(f"{name} must be an integer >= 0, got {name}={value!r}")
    if len(set(specials.values())) < 3:
        raise ValueError(f"pad_id, bos_id and eos_id must be distinct, got {specials}")
    sources, targets = list(sources), list(targets)
    if len(sources) != len(targets):
        raise ValueError(f"sources and targets: {len(sources)} sources but {len(targets)} targets; a pair is one "
                         "of each")
    if not sources:
        raise ValueError("sources: no pairs to collate")
    sources = [_ids(s, f"sources[{i}]") for i, s in enumerate(sources)]
    targets = [_ids(t, f"targets[{i}]") for i, t in enumerate(targets)]
    src = [s + [eos_id] for s in sources]
    t_in = [[bos_id] + t for t in targets]
    t_out = [t + [eos_id] for t in targets]

    def pad(rows):
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask = torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]
        return ids, mask

    (s, s_mask), (ti, t_mask), (to, _) = pad(src), pad(t_in), pad(t_out)
    return PairBatch(src=s, src_mask=s_mask, tgt_in=ti, tgt_out=to, tgt_mask=t_mask).to(device)


def _ids(row, where: str) -> list[int]:
    """A row of ids as ints (:func:`lm.generate.engine._token_ids`), refused, naming ``where``, unless
    they are integers >= 0."""
    from lm.generate.engine import _token_ids

    try:
        ids = _token_ids(row, where)
    except TypeError as e:  # not a row of ids at all (an int)
        raise ValueError(f"{where}: {e}") from None
    if any(t < 0 for t in ids):
        raise ValueError(f"{where}: token ids must be >= 0, got {min(ids)}")
    return ids


@torch.no_grad()
def evaluate_pairs(model: torch.nn.Module, batches) -> dict[str, float | int]:
    """Mean cross-entropy per target token (no label smoothing) over :class:`PairBatch` es, and perplexity.

    A model whose logits are not finite (NaN or inf) raises :class:`~lm.generate.NonFiniteLogitsError`
    naming the first batch (from 1) whose loss is not."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for k, batch in enumerate(batches, 1):
            n = batch.num_tokens
            total += float(model.loss(batch, label_smoothing=0.0)) * n
            count += n
            if not math.isfinite(total):
                raise _not_finite(f"the loss of batch {k} of the pairs is {total}")
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("data: no target tokens to evaluate")
    loss = total / count
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": count}


def bleu_chrf(hypotheses: list[str], references: list[str]) -> dict[str, float | str]:
    """Corpus BLEU and chrF of detokenized text with sacrebleu's defaults, and their signatures:
    one reference per hypothesis, both lists of strings (more of one than of the other had given
    a BLEU of 100 for the pairs they had in common)."""
    import sacrebleu

    for name, texts in (("hypotheses", hypotheses), ("references", references)):
        if not isinstance(texts, Sequence) or isinstance(texts, str):
            raise ValueError(f"{name} must be a list of strings (one sentence each), got {type(texts).__name__}")
        if not all(isinstance(t, str) for t in texts):
            bad = next(t for t in texts if not isinstance(t, str))
            raise ValueError(f"{name} must be a list of strings (one sentence each), got one holding {bad!r}")
    if len(hypotheses) != len(references):
        raise ValueError(f"hypotheses and references: {len(hypotheses)} hypotheses but {len(references)} "
                         "references; each hypothesis needs its reference")
    if not hypotheses:
        raise ValueError("hypotheses: no sentences to score")

    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return {"bleu": b.score, "chrf": c.score, "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}

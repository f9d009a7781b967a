"""Decoding an encoder–decoder: batched greedy or sampled decoding, and beam search.

The source is encoded once. The decoder keeps its self-attention keys and values in a
:class:`Seq2SeqCache` and projects the memory's cross-attention keys and values on the first
step only, so each new target token costs one position of decoder compute. Like
:func:`lm.generate.generate` the functions know nothing of text: ids in, ids out, without the
``<bos>`` that starts every target and without the ``<eos>`` that ends it; ``<pad>`` and
``<bos>`` are never chosen, nor the ``banned_ids`` a caller gives (:func:`line_break_ids`: a
translation is one line of text, as every target in training was).

Beam search follows Wu et al. (GNMT) as Vaswani et al. used it: hypotheses are ranked by
``log P(y) / lp(y)`` with ``lp(y) = ((5 + |y|) / 6) ** alpha`` (``|y|`` counts the tokens of
``y`` including its ``<eos>``); a hypothesis that emits ``<eos>`` is set apart as finished,
and a sentence stops once no live hypothesis can still beat its ``beam_size``-th finished one.
A target may be ``len(source) + 50`` tokens long at most (and never past the context).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, cast

import numpy as np
import torch
from torch import Tensor

from lm.checks import check_alpha, check_callback, check_flag, is_count
from lm.generate.kv_cache import KVCache
from lm.generate.sampling import (
    NonFiniteLogitsError,
    check_sampling_args,
    check_vocab_limit,
    next_token_and_finite,
)
from lm.nn.choices import check_choice


class Seq2SeqCache(KVCache):
    """The decoder's self-attention cache plus each layer's cross-attention keys and values."""

    layers_field = "decoder_layers"

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, max_len: int, head_dim: int, *,
                 pad_lengths: Tensor | list[int] | None = None, device=None, dtype=torch.float32):
        super().__init__(num_layers, batch_size, num_heads, max_len, head_dim, pad_lengths=pad_lengths,
                         device=device, dtype=dtype)
        self.cross: dict[int, tuple[Tensor, Tensor]] = {}

    def get(self, layer: int) -> tuple[Tensor, Tensor] | None:
        return self.cross.get(layer)

    def put(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.cross[layer] = (k, v)

    def select(self, rows: Tensor) -> None:
        """:meth:`KVCache.select`, the cross-attention keys and values too."""
        super().select(rows)
        for i in list(self.cross):  # one tensor at a time, the old one freed as its copy is made
            k, v = self.cross.pop(i)
            k = k[rows]
            v = v[rows]
            self.cross[i] = (k, v)


def source_batch(src_ids: Sequence[Sequence[int]], eos_id: int, pad_id: int, device) -> tuple[Tensor, Tensor]:
    """Right-padded sources, each ending in ``<eos>`` (as in training), and their masks."""
    rows = [list(s) + [eos_id] for s in src_ids]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    mask = torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]
    return ids.to(device), mask.to(device)


def check_source_length(where: str, length: int, context_length: int) -> None:
    """A one-line ValueError for a source of ``length`` tokens that does not fit; nothing when it fits.

    A source ends in ``<eos>`` (see :func:`source_batch`), so it holds at most ``context_length - 1``
    tokens of its own. ``where`` names the source (``"--input: line 3"``). `lm translate`,
    `lm eval` and ``scripts/multi30k.py`` refuse such a source with this message before any work."""
    if length + 1 > context_length:
        raise ValueError(f"{where} has {length} tokens, more than the {context_length - 1} a source may hold "
                         f"(the model's context is {context_length}, one kept for <eos>)")


def _check(model, src_ids, max_extra: int) -> list[list[int]]:
    """The sources as lists of ints, each checked on the host (so the model need not check them)."""
    from lm.generate.engine import _token_ids

    if not is_count(max_extra):  # numpy's integers too
        raise ValueError(f"max_extra must be a non-negative integer, got max_extra={max_extra!r}")
    max_extra = int(max_extra)
    cfg = model.config
    # integers only (5.7 had been taken as 5, "5" and True as 5 and 1)
    src = [_token_ids(s, f"source {i}") for i, s in enumerate(_sources(src_ids))]
    if not src:
        raise ValueError("src_ids: got an empty batch of sources")
    for i, s in enumerate(src):
        if not s:
            raise ValueError(f"source {i} is empty")
        check_source_length(f"source {i}", len(s), cfg.context_length)
        bad = [t for t in s if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"source {i}: id {bad[0]} is outside [0, vocab_size={cfg.vocab_size})")
    return src


def _sources(src_ids) -> list:
    """The sources of a batch: a 2-D tensor or array is one a row; a flat list of ids (one source, not a
    batch of them) is refused by name, not with "'int' object is not iterable"."""
    if isinstance(src_ids, (Tensor, np.ndarray)):
        if src_ids.ndim != 2:
            raise ValueError(f"src_ids must be a batch of sources (2-D), got shape {tuple(src_ids.shape)}")
        return list(src_ids)
    sources = list(src_ids)
    for s in sources:  # any iterable of ids is a source (a map, a generator), but not an id or a text
        if isinstance(s, (str, bytes)) or not isinstance(s, (Iterable, Tensor, np.ndarray)):
            raise ValueError(f"src_ids must be a batch of sources (a list of lists of ids), got a list holding "
                             f"{s!r}" + (" (one source? pass [ids])" if isinstance(s, numbers.Integral) else ""))
    return sources


def line_break_ids(tokenizer) -> list[int]:
    """The ids whose text holds a line break (``\\n``): the ``banned_ids`` of a translation.

    A line of a parallel corpus never holds one (:func:`lm.data.pairs.read_parallel` splits at
    ``\\n``), so no target in training did; a model that emits one anyway would break the one
    translation a line of ``lm translate --input``. A byte-level BPE always has ``\\n`` among its
    256 byte tokens, and may have merged tokens holding it."""
    return sorted(i for i, text in tokenizer.vocab.items() if b"\n" in text)


def banned_index(model, banned_ids: Sequence[int] | None) -> Tensor:
    """``<pad>``, ``<bos>`` and ``banned_ids``, checked, as one index on the model's device."""
    cfg = model.config
    banned = [_banned_id(i) for i in (() if banned_ids is None else banned_ids)]
    for i in banned:
        if not 0 <= i < cfg.vocab_size:
            raise ValueError(f"banned_ids: id {i} is outside [0, vocab_size={cfg.vocab_size})")
        if i == cfg.eos_id:
            raise ValueError(f"banned_ids: holds <eos> ({i}), which ends every target")
    return torch.tensor(sorted({cfg.pad_id, cfg.bos_id, *banned}), dtype=torch.long, device=model.device)


def _banned_id(i) -> int:
    """One banned id, an integer (3.9 had banned 3)."""
    if isinstance(i, bool) or not isinstance(i, (numbers.Integral, Tensor)) or \
            isinstance(i, Tensor) and (i.numel() != 1 or i.dtype.is_floating_point or i.dtype == torch.bool):
        raise ValueError(f"banned_ids: ids must be integers, got {i!r}")
    return int(i)


def _never_banned(logits: Tensor, banned: Tensor, vocab_size: int | None = None) -> Tensor:
    """A target never holds ``<pad>``, a second ``<bos>`` (as in fairseq) or a banned id (see
    :func:`banned_index`), nor an id at or past ``vocab_size`` (the tokenizer's, when the model's
    vocabulary is larger): their logits are -inf."""
    logits[:, banned] = float("-inf")
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits[:, vocab_size:] = float("-inf")
    return logits


def _check_target_vocab(vocab_size: int | None, cfg) -> None:
    """``vocab_size`` (the tokenizer's size) in [1, the model's], and past ``<eos>``: a limit that
    rules out ``<eos>`` rules out every token a target may hold (``<pad>`` and ``<bos>`` never come
    either), which had been reported as logits that are not finite ("NaN or inf")."""
    check_vocab_limit(vocab_size, cfg.vocab_size)
    if vocab_size is not None and cfg.eos_id >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} leaves out <eos> (id {cfg.eos_id}), which ends every target; "
                         "pass the tokenizer's size")


def _check_beam_size(beam_size: int) -> int:
    """``beam_size`` as an int: a positive integer, numpy's too."""
    if not is_count(beam_size, 1):
        raise ValueError(f"beam_size must be a positive integer, got {beam_size!r}")
    return int(beam_size)


def _check_beam_options(alpha: float, stopping: str) -> None:
    check_alpha(alpha)
    check_choice("stopping", stopping, ("exact", "heuristic"))


def max_target_length(model, src_len: int, extra: int = 50) -> int:
    """``src_len + extra`` new tokens, within the context (which also holds ``<bos>``)."""
    return min(src_len + extra, model.config.context_length - 1)


# What decoding holds besides the tensors decoding_bytes counts (allocator slack, masks, the
# hypotheses' token lists, the choice's temporaries): with it the count was 1.05 to 1.5 times the
# peak RSS decoding added, for greedy decoding and beam search over vocabularies of 100 to 30,000,
# 1 to 6 layers, d_model 32 to 256, 5 to 20,000 sentences and beams up to 20,000 (float32, cpu)
DECODING_SLACK = 1.25


def decoding_bytes(model, src_lengths: Sequence[int], beam_size: int = 1, max_extra: int = 50) -> int:
    """Bytes that decoding sources of ``src_lengths`` tokens together at ``beam_size`` (greedy
    decoding: 1) holds at its peak, counted before anything is allocated, so a size that cannot fit
    is refused with the numbers: one past what torch can index (``--beam`` 2**63) was a
    traceback, and beams that the first count (of the first step only, half the real peak) let
    through were killed by the OS.

    The peak comes when the cache's rows are copied (:meth:`Seq2SeqCache.select`: the finished rows
    leave, beam search reorders its hypotheses): the decoder's key/value cache and a copy of its
    keys or values (1.5 caches), the cross-attention's keys and values with a copy of one layer's
    (its keys or values), and the memory of every hypothesis; plus the float32 logits of a step and
    what is made from them (greedy: the choice's masks and probabilities, four rows; beam search:
    the log-softmax and the candidates' scores, three), all times :data:`DECODING_SLACK`."""
    cfg = model.config
    rows = len(src_lengths) * beam_size
    max_len = max(max_target_length(model, n, max_extra) for n in src_lengths) + 1
    src_len = max(src_lengths) + 1  # with its <eos>
    size = model.output_weight.element_size()  # the cache's, and the activations' (at most: autocast's are 2)
    cache = 2 * cfg.decoder_layers * cfg.num_heads * max_len * cfg.head_dim * size
    memory = cfg.d_model * src_len * size  # as large as one layer's cross-attention keys (or values)
    cross = 2 * cfg.decoder_layers * memory
    logits = (3 if beam_size > 1 else 4) * cfg.vocab_size * 4
    per_row = 3 * cache // 2 + cross + memory + memory + logits  # the copy of one layer's keys, and the memory
    return math.ceil(rows * per_row * DECODING_SLACK)


@torch.inference_mode()
def greedy_decode(
    model,
    src_ids: Sequence[Sequence[int]],
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    max_extra: int = 50,
    on_token: Callable[[int, int], None] | None = None,
    vocab_size: int | None = None,
    banned_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Translate a batch of sources token by token: greedy (``temperature=0``) or sampled.
    ``vocab_size`` (the tokenizer's size) limits the target to ids below it; ``banned_ids`` are
    never chosen (:func:`line_break_ids`).

    ``use_cache=False`` re-runs the decoder over the whole prefix at every step (the reference
    the tests compare the cached loop with). Returns each row's tokens without ``<bos>``/``<eos>``.
    ``on_token(row, token)`` is called for every target token as it is chosen (a server streams
    them); an exception it raises stops the decoding and propagates.
    """
    check_sampling_args(temperature, top_p, top_k)
    check_flag("use_cache", use_cache)  # a string is truthy: use_cache="no" had used it
    check_callback("on_token", on_token)
    cfg = model.config
    _check_target_vocab(vocab_size, cfg)
    src = _check(model, src_ids, max_extra)
    banned = banned_index(model, banned_ids)
    was_training = model.training
    model.eval()
    try:
        with model.trusted_ids():  # the sources were checked above; the decoder reads <bos> and its own ids
            ids, mask = source_batch(src, cfg.eos_id, cfg.pad_id, model.device)
            memory = model.encode(ids, mask)
            limits = [max_target_length(model, len(s), max_extra) for s in src]
            out: list[list[int]] = [[] for _ in src]
            alive = list(range(len(src)))  # the source of each batch row; a finished row leaves the batch
            prefix = torch.full((len(src), 1), cfg.bos_id, dtype=torch.long, device=model.device)
            cache = model.new_cache(len(src), max_len=max(limits) + 1) if use_cache else None
            step_ids = prefix
            for step in range(max(limits)):
                if use_cache:
                    hidden = model.decode(step_ids, memory if step == 0 else None, mask, cache=cache)
                    memory = None  # its keys and values are in the cache now
                else:
                    hidden = model.decode(prefix, memory, mask)
                logits = _never_banned(model.logits(hidden[:, -1]).float(), banned, vocab_size)
                del hidden
                next_ids, finite = next_token_and_finite(logits, temperature=temperature, top_p=top_p,
                                                         top_k=top_k, generator=generator)
                del logits  # freed before the cache's rows are copied (decoding_bytes counts the peak)
                chosen, finite = torch.stack([next_ids, finite.to(next_ids.dtype)]).tolist()  # one read
                if not all(finite):
                    raise NonFiniteLogitsError(step + 1, alive[finite.index(0)])
                keep = []
                for j, t in enumerate(chosen):
                    r = alive[j]
                    if t != cfg.eos_id:
                        out[r].append(t)
                        if on_token is not None:
                            on_token(r, t)
                        if len(out[r]) < limits[r]:
                            keep.append(j)
                if not keep:
                    break
                if len(keep) < len(alive):  # drop the finished rows: their cache, memory and mask rows
                    sel = torch.tensor(keep, device=model.device)
                    alive = [alive[j] for j in keep]
                    next_ids, mask, prefix = next_ids[sel], mask[sel], prefix[sel]
                    if use_cache:
                        cache.select(sel)
                    else:
                        memory = memory[sel]
                step_ids = next_ids[:, None]
                prefix = torch.cat([prefix, step_ids], dim=1)
            return out
    finally:
        model.train(was_training)


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ``((5 + length) / 6) ** alpha``."""
    return ((5.0 + length) / 6.0) ** alpha


class Hypothesis(NamedTuple):
    """A finished hypothesis of :func:`beam_search_nbest`: its ``tokens`` (without ``<bos>`` and
    ``<eos>``), ``score`` = ``logprob / lp(length)`` by which beam search ranks it, and ``logprob``,
    the sum of its tokens' log-probabilities (its ``<eos>``'s included; a hypothesis cut at the length
    limit has none). ``length`` in ``lp`` counts the tokens with the ``<eos>``."""

    tokens: list[int]
    score: float
    logprob: float


@torch.inference_mode()
def beam_search(
    model,
    src_ids: Sequence[Sequence[int]],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_extra: int = 50,
    on_sentence: Callable[[int, list[int]], None] | None = None,
    stopping: str = "heuristic",
    vocab_size: int | None = None,
    banned_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """The best hypothesis of each source by ``log P / lp`` (see the module doc), batched.

    ``stopping`` says when a sentence is decided, once it has ``beam_size`` finished hypotheses:
    ``"exact"`` when no live hypothesis could beat the worst of them at any allowed length (its
    log-probability only falls, and ``lp`` is largest at the length limit), so a beam as large
    as the search space finds the best sequence; ``"heuristic"`` (the default) when none beats it
    were it to end at the next token, which stops long before the limit: Hugging Face's rule with
    ``early_stopping=False``. (fairseq's ``SequenceGenerator`` compares no scores: it decides a
    sentence as soon as it has ``beam_size`` finished hypotheses, or at the length limit, where it
    forces ``<eos>``; here a hypothesis cut at the limit has none.)

    Every sentence keeps ``beam_size`` live hypotheses in one cache (``sentences × beam`` rows,
    reordered by :meth:`Seq2SeqCache.select` after each step). ``on_sentence(i, tokens)`` is called
    as soon as sentence ``i`` is decided. ``vocab_size`` (the tokenizer's size) limits the target
    to ids below it; ``banned_ids`` are never chosen (:func:`line_break_ids`).
    """
    check_callback("on_sentence", on_sentence)
    best = None if on_sentence is None else lambda i, hyps: on_sentence(i, _best(hyps))
    nbest = beam_search_nbest(model, src_ids, nbest=1, beam_size=beam_size, alpha=alpha, max_extra=max_extra,
                              on_sentence=best, stopping=stopping, vocab_size=vocab_size, banned_ids=banned_ids)
    return [_best(hyps) for hyps in nbest]


def _best(hyps: list[Hypothesis]) -> list[int]:
    # never empty: a finite candidate is finished at the latest at its limit, and a row with none (every
    # token ruled out) has NaN log-probabilities, refused as NonFiniteLogitsError
    return hyps[0].tokens


@torch.inference_mode()
def beam_search_nbest(
    model,
    src_ids: Sequence[Sequence[int]],
    *,
    nbest: int | None = None,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_extra: int = 50,
    on_sentence: Callable[[int, list[Hypothesis]], None] | None = None,
    stopping: str = "heuristic",
    vocab_size: int | None = None,
    banned_ids: Sequence[int] | None = None,
) -> list[list[Hypothesis]]:
    """The ``nbest`` best finished hypotheses of each source (default: ``beam_size`` of them), best
    first, as :class:`Hypothesis` tuples: the search of :func:`beam_search` (the first of each list
    is its answer), which keeps the ``beam_size`` best finished hypotheses of a sentence until it is
    decided, as fairseq's ``--nbest`` does. ``nbest`` is at most ``beam_size``; a sentence may have
    fewer (every candidate ruled out before that many finished). With ``stopping="exact"`` and a beam
    as large as the search space they are the ``nbest`` best targets of all. ``on_sentence(i, hyps)``
    is called as soon as sentence ``i`` is decided; the other arguments are :func:`beam_search`'s.
    """
    beam_size = _check_beam_size(beam_size)
    if nbest is None:
        nbest = beam_size
    if not is_count(nbest, 1) or nbest > beam_size:
        raise ValueError(f"nbest must be a whole number in [1, beam_size={beam_size}] (beam search keeps beam_size "
                         f"finished hypotheses), got nbest={nbest!r}")
    _check_beam_options(alpha, stopping)
    check_callback("on_sentence", on_sentence)
    _check_target_vocab(vocab_size, model.config)
    src = _check(model, src_ids, max_extra)
    banned = banned_index(model, banned_ids)
    was_training = model.training
    model.eval()
    try:
        with model.trusted_ids():  # the sources were checked above; the decoder reads <bos> and its own ids
            return _beam_search(model, src, beam_size, int(nbest), alpha, max_extra, on_sentence, stopping == "exact",
                                vocab_size, banned)
    finally:
        model.train(was_training)


def _beam_search(model, src, k, nbest: int, alpha, max_extra, on_sentence, exact: bool,
                 vocab_size: int | None, banned: Tensor) -> list[list[Hypothesis]]:
    cfg = model.config
    dev = model.device
    ids, mask = source_batch(src, cfg.eos_id, cfg.pad_id, dev)
    memory = model.encode(ids, mask)
    n = len(src)
    limits = [max_target_length(model, len(s), max_extra) for s in src]
    # the largest allocation first: a beam too large for memory fails here, at once
    cache = model.new_cache(n * k, max_len=max(limits) + 1)
    # live hypotheses: sentence i owns rows [i*k, (i+1)*k); at the start only its first row is real
    rows = torch.arange(n, device=dev).repeat_interleave(k)
    memory, mask = memory[rows], mask[rows]
    scores = torch.full((n, k), float("-inf"), device=dev)
    scores[:, 0] = 0.0
    tokens: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(n)]
    finished: list[list[Hypothesis]] = [[] for _ in range(n)]
    results: list[list[Hypothesis] | None] = [None] * n
    step_ids = torch.full((n * k, 1), cfg.bos_id, dtype=torch.long, device=dev)
    alive = list(range(n))  # the sentence of each block of k rows; a decided sentence leaves the batch
    for step in range(max(limits)):
        hidden = model.decode(step_ids, memory if step == 0 else None, mask, cache=cache)
        memory = None  # its keys and values are in the cache now
        logits = _never_banned(model.logits(hidden[:, -1]).float(), banned, vocab_size)
        del hidden
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        logp = logp.view(len(alive), k, -1)
        vocab = logp.shape[-1]
        cand = (scores[..., None] + logp).view(len(alive), -1)  # (sentences, k * vocab)
        del logp  # freed before the cache's rows are copied (decoding_bytes counts the peak)
        top_scores, top_idx = cand.topk(min(2 * k, cand.shape[-1]), dim=-1)
        del cand
        top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
        for j, i in enumerate(alive):  # NaN logits (a model that overflows) rank first in topk
            if any(math.isnan(score) for score in top_scores[j]):
                raise NonFiniteLogitsError(step + 1, i)
        new_rows, new_tokens, new_scores, new_lists, still = [], [], [], [], []
        length = step + 1  # tokens of a hypothesis after this step, its <eos> included
        for j, i in enumerate(alive):
            picked: list[tuple[int, int, float]] = []
            for score, idx in zip(top_scores[j], top_idx[j]):
                if score == float("-inf"):
                    break
                beam, tok = divmod(idx, vocab)
                if tok == cfg.eos_id or length >= limits[i]:
                    seq = tokens[j][beam] + ([] if tok == cfg.eos_id else [tok])
                    finished[i].append(Hypothesis(seq, score / length_penalty(length, alpha), score))
                else:
                    picked.append((beam, tok, score))
                if len(picked) == k:
                    break
            finished[i].sort(key=lambda f: -f.score)
            del finished[i][k:]
            best_live = picked[0][2] if picked else float("-inf")
            # the best a live hypothesis can still reach: exactly, its log-probability only falls and
            # lp is largest at the longest allowed length; heuristically, it ends at the next token
            reach = limits[i] if exact else length + 1
            bound = best_live / length_penalty(reach, alpha) if best_live < 0 else best_live
            if not picked or length >= limits[i] or (len(finished[i]) == k and finished[i][-1].score >= bound):
                results[i] = finished[i][:nbest]
                if on_sentence is not None:
                    on_sentence(i, results[i])
                continue
            still.append(i)
            picked += [(0, cfg.pad_id, float("-inf"))] * (k - len(picked))  # too few candidates: dead slots
            for beam, tok, score in picked:
                new_rows.append(j * k + beam)
                new_tokens.append(tok)
                new_scores.append(score)
                new_lists.append(tokens[j][beam] + [tok])
        if not still:
            break
        alive = still
        sel = torch.tensor(new_rows, device=dev)
        cache.select(sel)
        mask = mask[sel]
        scores = torch.tensor(new_scores, device=dev).view(len(alive), k)
        tokens = [new_lists[j * k : (j + 1) * k] for j in range(len(alive))]
        step_ids = torch.tensor(new_tokens, dtype=torch.long, device=dev)[:, None]
    # every sentence was decided by the last step at the latest (its length then reaches its limit)
    return cast(list[list[Hypothesis]], results)


# greedy_decode's options that beam search has not (it samples nothing), and beam search's that it has not
_GREEDY_ONLY = ("temperature", "top_p", "top_k", "generator", "use_cache", "on_token")
_BEAM_ONLY = ("on_sentence",)


def translate(model, src_ids: Sequence[Sequence[int]], *, beam_size: int = 1, alpha: float = 0.6,
              stopping: str = "heuristic", **kwargs) -> list[list[int]]:
    """Beam search for ``beam_size`` > 1, else greedy (or sampled, with ``temperature``) decoding.

    ``alpha`` and ``stopping`` are beam search's; with ``beam_size=1`` they are checked and have no
    effect (a beam of one is greedy whatever they are), so a sweep over beam sizes can keep them.
    The other keyword arguments go to :func:`beam_search` or :func:`greedy_decode`; one that only
    the other takes (``temperature``, ``top_p``, ``top_k``, ``generator``, ``use_cache`` and
    ``on_token`` are greedy decoding's, ``on_sentence`` beam search's) is a ValueError naming it."""
    beam_size = _check_beam_size(beam_size)
    other, needs = (_GREEDY_ONLY, "beam_size=1 only (greedy or sampled decoding)") if beam_size > 1 else \
        (_BEAM_ONLY, "beam_size > 1 only (beam search)")
    name = next((k for k in other if k in kwargs), None)
    if name is not None:
        raise ValueError(f"{name} applies to {needs}, got {name}={kwargs[name]!r} with beam_size={beam_size}")
    if beam_size > 1:
        return beam_search(model, src_ids, beam_size=beam_size, alpha=alpha, stopping=stopping, **kwargs)
    _check_beam_options(alpha, stopping)
    return greedy_decode(model, src_ids, **kwargs)

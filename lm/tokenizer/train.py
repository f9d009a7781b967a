"""Byte-level BPE training.

Two phases:

1. Pre-tokenization. The input is read in chunks cut at document boundaries (special
   tokens) so that no pre-token crosses a cut; worker processes split out special tokens,
   run the GPT-2 regex and count pre-tokens. Memory grows with the number of *distinct*
   pre-tokens, never with the corpus size.
2. Merging. Each distinct pre-token becomes a list of byte ids with its count. Pair counts
   are kept up to date incrementally: merging a pair touches only the words that hold it
   (found through an index from pair to words), and a lazy max-heap of counts gives the
   next pair without re-scanning all pairs.
"""

from __future__ import annotations

import heapq
import numbers
import os
import resource
import sys
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from lm.checks import check_size
from lm.io import (
    FileChangedError,
    check_readable_file,
    file_state,
    invalid_utf8_place,
    read_text_range,
    replaced_utf8_message,
    unchanged_while,
)
from lm.tokenizer.pretokenize import (
    LONG_CHUNK_BYTES,
    check_special_tokens,
    chunk_boundaries,
    next_safe_cut,
    pretokenize,
    special_tokens_regex,
    split_on_special,
    warn_long_chunk,
)
from lm.tokenizer.workers import parallel_map

PathLike = str | os.PathLike
# below this many input bytes, starting worker processes costs more than it saves
MIN_PARALLEL_BYTES = 4 << 20


@dataclass
class TrainStats:
    """What a training run measured: filled in by :func:`train_bpe` when passed ``stats=``."""

    input_bytes: int = 0
    distinct_pretokens: int = 0
    num_merges: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    invalid_utf8_bytes: int = 0


# ---------------------------------------------------------------- phase 1: counting pre-tokens


def _count_chunk(args: tuple[int, str, int, int, tuple[str, ...]]) -> tuple[Counter, int, int, int]:
    """The pre-token counts of one chunk, its size, its invalid UTF-8 bytes, and its index in the
    tasks (the results come in any order; the warning names the first chunk that held bad bytes)."""
    index, path, start, end, specials = args
    text, invalid = read_text_range(path, start, end)
    special_re = special_tokens_regex(specials)
    segments = split_on_special(text, special_re)[::2]
    words: list[str] = []
    for seg in segments:
        if seg:
            words += pretokenize(seg)
    return Counter(words), end - start, invalid, index


def count_pretokens(
    ranges: Sequence[tuple[str, int, int]],
    special_tokens: Sequence[str],
    *,
    num_workers: int | None = None,
    chunk_bytes: int | None = None,
    progress: bool = False,
    stats: TrainStats | None = None,
) -> Counter:
    """Count the GPT-2 pre-tokens in byte ranges of files, in parallel (special tokens excluded)."""
    special_tokens = check_special_tokens(special_tokens)
    total = sum(e - s for _, s, e in ranges)
    workers = max(1, num_workers if num_workers is not None else (os.cpu_count() or 1))
    if chunk_bytes is None:
        # enough chunks to balance the workers and show progress, few enough to merge cheaply
        chunk_bytes = min(16 << 20, max(1 << 20, total // (workers * 8) + 1))
    # the workers read the files by offsets: each must stay the file it was (rest26 R2)
    states = {str(path): file_state(path) for path, _, _ in ranges}
    for path, _, end in ranges:
        if states[str(path)].size < end:  # shorter than when the ranges were cut (holdout_split)
            raise FileChangedError(f"input: {str(path)!r} is {states[str(path)].size:,} bytes, shorter than the range "
                                   f"to byte {end:,} to be read from it: was it changed since the ranges were cut?")
    tasks = []
    for path, start, end in ranges:
        bounds = chunk_boundaries(path, special_tokens, chunk_bytes, start, end)
        warn_long_chunk(path, bounds, chunk_bytes, "pre-tokenized", limit=LONG_CHUNK_BYTES)
        tasks += [(len(tasks) + i, str(path), a, b, tuple(special_tokens)) for i, (a, b) in enumerate(bounds)]
    counts: Counter = Counter()
    invalid: Counter = Counter()  # per file
    first_bad = None  # the index of the first task (in file order, then offset) that held bad bytes
    # changed in place or replaced while read: counts of no one file's text
    with unchanged_while(states, "input", "read"), \
            tqdm(total=total, unit="B", unit_scale=True, desc="pre-tokenize", disable=None if progress else True,
                 file=sys.stderr) as bar, \
            parallel_map(_count_chunk, tasks, workers, ordered=False, serial=total < MIN_PARALLEL_BYTES) as results:
        for c, nbytes, bad, index in results:
            counts.update(c)
            if bad:
                invalid[tasks[index][1]] += bad
                first_bad = index if first_bad is None else min(first_bad, index)
            bar.update(nbytes)
    if invalid:
        _warn_invalid_utf8(invalid, *tasks[first_bad][1:4])
    if stats is not None:
        stats.invalid_utf8_bytes = sum(invalid.values())
        stats.input_bytes = total
    return counts


def _warn_invalid_utf8(invalid: dict[str, int], path: str, start: int, end: int, after: str = "") -> None:
    """Warn, for the caller's caller, of the bytes (``invalid``: their count per file) that became
    U+FFFD, naming where the first is: ``path``, in its chunk ``[start, end)``; ``after`` ends the
    line. It had said "--input: 3 bytes are not valid UTF-8", naming neither the file, among several,
    nor the place (cli21 F2); ``lm tokenize`` says the same of its one file."""
    line, column = invalid_utf8_place(path, start, end) or (0, 0)
    warnings.warn(replaced_utf8_message("input", invalid, path, line, column, after=after), stacklevel=3)


# ---------------------------------------------------------------- phase 2: merging


def merge_counts(
    word_counts: dict[bytes, int] | Counter,
    num_merges: int,
    *,
    progress: bool = False,
) -> list[tuple[bytes, bytes]]:
    """Learn up to ``num_merges`` BPE merges from pre-token counts.

    ``word_counts`` maps a pre-token (``str`` or ``bytes``) to its count. Each step merges
    the most frequent adjacent pair; ties go to the lexicographically greater pair of
    ``bytes``. Stops early when no pair is left.

    >>> merge_counts({b"low": 5, b"lower": 2, b"newest": 6, b"widest": 3}, 3)
    [(b's', b't'), (b'e', b'st'), (b'o', b'w')]
    """
    tokens: list[bytes] = [bytes([i]) for i in range(256)]
    index = _PairIndex(word_counts)
    merges: list[tuple[bytes, bytes]] = []
    with tqdm(total=num_merges, unit="merge", desc="merge", disable=None if progress else True, file=sys.stderr,
              mininterval=0.5) as bar:
        while len(merges) < num_merges:
            pair = index.most_frequent()
            if pair is None:
                break
            a, b = pair
            tokens.append(tokens[a] + tokens[b])
            merges.append((tokens[a], tokens[b]))
            index.merge(a, b, len(tokens) - 1)
            if len(merges) % 64 == 0:
                bar.update(64)
        bar.update(len(merges) - bar.n)
    return merges


# The heap's tie-break: the greater pair of bytes must come first in a min-heap, so each token has a key
# that orders the other way round: each byte b as chr(256 - b), then chr(257), greater than every byte's
# character, so that a token sorts after every longer token that starts with it (as bytes sort before).
_REVERSED_BYTES = {b: 256 - b for b in range(256)}
_END = chr(257)


def _reversed_key(token: bytes) -> str:
    """A key that sorts in the opposite order to ``token``: ``x < y`` exactly when ``key(x) > key(y)``."""
    return token.decode("latin-1").translate(_REVERSED_BYTES) + _END


class _PairIndex:
    """The words as token-id lists with their counts, every adjacent pair's total count, an index
    from each pair to the words that hold it, and a lazy heap of the pairs, most frequent on top
    (among equal counts, the greater pair of bytes)."""

    def __init__(self, word_counts: dict[bytes, int] | Counter):
        self.words: list[list[int]] = []
        self.freqs: list[int] = []
        for w, c in word_counts.items():
            b = w.encode("utf-8") if isinstance(w, str) else w
            if len(b) >= 2:
                self.words.append(list(b))
                self.freqs.append(c)
        self.pair_counts: dict[tuple[int, int], int] = defaultdict(int)
        self.where: dict[tuple[int, int], set[int]] = defaultdict(set)
        for wi, (w, f) in enumerate(zip(self.words, self.freqs)):
            for p in zip(w, w[1:]):
                self.pair_counts[p] += f
                self.where[p].add(wi)
        # each token id's _reversed_key; a merged token's is its left part's without the end, then its right part's
        self.keys: list[str] = [_reversed_key(bytes([i])) for i in range(256)]
        keys = self.keys
        # (-count, key of left, key of right, left, right): the top is the pair to merge next. The keys differ
        # for pairs of different bytes; two ids of the same bytes (a merge may make a token again) tie on
        # them, and then the lower ids come first.
        self.heap = [(-c, keys[a], keys[b], a, b) for (a, b), c in self.pair_counts.items()]
        heapq.heapify(self.heap)

    def most_frequent(self) -> tuple[int, int] | None:
        """The pair to merge next: the highest count, ties to the greater pair of bytes; None when
        no pair is left."""
        heap, pair_counts = self.heap, self.pair_counts
        # Lazy heap: an entry whose count is stale (changed since it was pushed) is dropped when it reaches
        # the top; the pair's current count has its own entry.
        while heap:
            c, _, _, a, b = heapq.heappop(heap)
            if pair_counts.get((a, b)) == -c:
                return a, b
        return None

    def merge(self, a: int, b: int, new: int) -> None:
        """Replace the pair ``(a, b)`` by ``new`` in every word that holds it, and update the counts."""
        words, freqs, where, pair_counts, keys = self.words, self.freqs, self.where, self.pair_counts, self.keys
        if new != len(keys):
            raise ValueError(f"merge: the new token's id must be {len(keys)}, got {new}")
        keys.append(keys[a][:-1] + keys[b])
        del pair_counts[(a, b)]
        delta: dict[tuple[int, int], int] = defaultdict(int)
        for wi in where.pop((a, b)):
            w = words[wi]
            n = len(w)
            nw: list[int] = []
            i = 0
            while i < n:
                x = w[i]
                if x == a and i + 1 < n and w[i + 1] == b:
                    nw.append(new)
                    i += 2
                else:
                    nw.append(x)
                    i += 1
            if len(nw) == n:  # stale index entry: the pair left this word earlier
                continue
            f = freqs[wi]
            for p in zip(w, w[1:]):
                delta[p] -= f
            for p in zip(nw, nw[1:]):
                delta[p] += f
                if p[0] == new or p[1] == new:
                    where[p].add(wi)
            words[wi] = nw
        for p, d in delta.items():
            if d and p != (a, b):
                c = pair_counts.get(p, 0) + d
                if c > 0:
                    pair_counts[p] = c
                    heapq.heappush(self.heap, (-c, keys[p[0]], keys[p[1]], p[0], p[1]))
                else:
                    pair_counts.pop(p, None)


# ---------------------------------------------------------------- the public entry point


def _input_ranges(input_path: PathLike | Sequence[PathLike]) -> list[tuple[str, int, int]]:
    paths = [input_path] if isinstance(input_path, (str, os.PathLike)) else list(input_path)
    if not paths:
        raise ValueError("input_path: no input file given")
    ranges = []
    for p in paths:
        p = check_readable_file(p, "input_path")
        ranges.append((str(p), 0, p.stat().st_size))
    if sum(e for _, _, e in ranges) == 0:
        raise ValueError(f"input_path: input is empty: {', '.join(str(p) for p, _, _ in ranges)}")
    return ranges


def build_vocab(special_tokens: Sequence[str], merges: Sequence[tuple[bytes, bytes]]) -> dict[int, bytes]:
    """Ids: special tokens first, then the 256 bytes, then one per merge in order."""
    vocab: dict[int, bytes] = {}
    for t in special_tokens:
        vocab[len(vocab)] = t.encode("utf-8")
    for i in range(256):
        vocab[len(vocab)] = bytes([i])
    for a, b in merges:
        vocab[len(vocab)] = a + b
    return vocab


def train_bpe(
    input_path: PathLike | Sequence[PathLike],
    vocab_size: int,
    special_tokens: Sequence[str],
    *,
    num_workers: int | None = None,
    progress: bool = False,
    stats: TrainStats | None = None,
    byte_ranges: Sequence[tuple[str, int, int]] | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on one or more UTF-8 text files.

    Returns ``(vocab, merges)``: ``vocab`` maps id -> token bytes (special tokens first,
    then the 256 single bytes, then the merges in order); ``merges`` lists the merged pairs
    in the order they were learned. Special tokens are split out before pre-tokenization,
    so no merge crosses them. ``num_workers`` defaults to the CPU count. ``byte_ranges``, a list
    of ``(path, start, end)``, trains on those byte ranges of the files instead of the whole of
    ``input_path`` (``lm tokenizer train`` holds out the end of the last file this way); each
    range must start and end at a point no pre-token crosses.

    Any non-empty, distinct special tokens are taken: the vocab is right in memory whatever they
    are. A few ("@", a single byte; "Ġthe", GPT-2's spelling of a token training may learn) could
    not be kept apart from an ordinary token in ``vocab.json`` or ``tokenizer.json``;
    :func:`lm.tokenizer.files.check_special_tokens_savable` refuses those before training, as
    ``lm tokenizer train`` does, so that saving does not fail after the work.
    """
    special_tokens = check_special_tokens(special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):  # numpy's too
        raise ValueError(f"vocab_size: expected an integer, got {vocab_size!r}")
    vocab_size = int(vocab_size)
    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size: {vocab_size} is below 256 bytes + {len(special_tokens)} special token(s) = {minimum}"
        )
    if num_workers is not None:
        check_size("num_workers", num_workers)
    ranges = list(byte_ranges) if byte_ranges is not None else _input_ranges(input_path)
    stats = stats if stats is not None else TrainStats()

    t0 = time.perf_counter()
    counts = count_pretokens(ranges, special_tokens, num_workers=num_workers, progress=progress, stats=stats)
    t1 = time.perf_counter()
    merges = merge_counts(counts, vocab_size - minimum, progress=progress)
    t2 = time.perf_counter()
    stats.distinct_pretokens = len(counts)
    stats.num_merges = len(merges)
    stats.seconds.update(pretokenize=t1 - t0, merge=t2 - t1)
    return build_vocab(special_tokens, merges), merges


__all__ = ["train_bpe", "count_pretokens", "merge_counts", "build_vocab", "TrainStats"]


# ---------------------------------------------------------------- what `lm tokenizer train` builds on


def holdout_split(paths: Sequence[PathLike], special_tokens: Sequence[str], holdout_bytes: int
                  ) -> tuple[list[tuple[str, int, int]], tuple[str, int, int] | None]:
    """Training byte ranges ``(path, start, end)`` of ``paths``, and the held-out tail of the last
    file (about ``holdout_bytes``, at most a tenth of the input, cut where no pre-token crosses),
    or None when there is too little text. Pass the ranges to :func:`train_bpe`'s ``byte_ranges``."""
    ranges = [(str(p), 0, Path(p).stat().st_size) for p in paths]
    total = sum(e for _, _, e in ranges)
    holdout = min(holdout_bytes, total // 10)
    last, _, size = ranges[-1]
    if holdout <= 0 or size <= holdout:
        return ranges, None
    with open(last, "rb") as f:
        cut = next_safe_cut(f, size - holdout, size, [s.encode() for s in special_tokens])
    if cut <= 0:
        return ranges, None
    return ranges[:-1] + [(last, 0, cut)], (last, cut, size)


def peak_rss_mb() -> float:
    """The peak resident memory of this process or its largest child (the workers), in MB."""
    kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def training_summary(tokenizer, stats: TrainStats, inputs: Sequence[PathLike],
                     heldout: tuple[str, int, int] | None, seconds: dict[str, float]) -> dict:
    """The ``summary.json`` of a trained tokenizer: sizes, timings, memory, the longest learned token
    (not a special token), and the bytes per token of the held-out text (encoded here). ``seconds``
    holds ``save`` and ``since_start`` (the time from the start of training to now)."""
    t0 = time.perf_counter()
    bytes_per_token = None
    if heldout is not None:
        path, a, b = heldout
        try:
            text, invalid = read_text_range(path, a, b)
        except FileChangedError as e:  # read last, minutes after the check of the counting: name the input
            raise FileChangedError(f"input: {e} (the held-out tail, read after the training)") from None
        if invalid:  # counting never read the tail: its bad bytes had gone unsaid, and uncounted (walk26)
            stats.invalid_utf8_bytes += invalid
            _warn_invalid_utf8({path: invalid}, path, a, b,
                               after=" (in the held-out tail that measures bytes per token)")
        bytes_per_token = (b - a) / max(1, len(tokenizer.encode(text)))
    heldout_eval = time.perf_counter() - t0
    # what training learned: a special token (the user's own "<|endoftext|>") is not one of them
    # (the 256 single bytes are no lesson: with no merge learned there is none, not byte 0x00)
    longest = max((a + b for a, b in tokenizer.merges), key=len, default=None)
    return {
        "vocab_size": len(tokenizer.vocab),
        "num_merges": len(tokenizer.merges),
        "special_tokens": list(tokenizer.special_tokens),
        "inputs": [str(p) for p in inputs],
        "train_bytes": stats.input_bytes,
        "heldout_bytes": 0 if heldout is None else heldout[2] - heldout[1],
        "distinct_pretokens": stats.distinct_pretokens,
        "seconds": {
            "pretokenize": round(stats.seconds["pretokenize"], 3),
            "merge": round(stats.seconds["merge"], 3),
            "save": round(seconds["save"], 3),
            "heldout_eval": round(heldout_eval, 3),
            "total": round(seconds["since_start"] + heldout_eval, 3),
        },
        "pretokenize_mb_per_s": round(stats.input_bytes / 1e6 / max(stats.seconds["pretokenize"], 1e-9), 2),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "longest_token": None if longest is None else {"bytes": len(longest),
                                                       "text": longest.decode("utf-8", errors="replace")},
        "bytes_per_token_heldout": None if bytes_per_token is None else round(bytes_per_token, 4),
        "invalid_utf8_bytes": stats.invalid_utf8_bytes,
    }

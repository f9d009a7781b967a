"""Encoding and decoding with a trained byte-level BPE (its files: :mod:`lm.tokenizer.files`).

Encoding a text: split out special tokens (the longest wins where two overlap), cut the
rest into pre-tokens with the GPT-2 regex, and apply the merges to each pre-token in
rank order. Pre-tokens repeat a lot in natural text, so their ids are cached. That is the
reference path (``Tokenizer._encode_chars``). Text that UTF-8 can encode (all but lone
surrogates: accented letters, CJK, emoji, the Unicode spaces...) takes a
vectorised path that gives the same ids without a Python step per pre-token
(:mod:`lm.tokenizer.vectorized`); tests check the two against each other.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import numbers
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import regex

from lm.tokenizer.pretokenize import (
    GPT2_REGEX,
    check_special_tokens,
    plain_stretches,
    pretokenize,
    special_tokens_regex,
    split_on_special,
)
from lm.tokenizer.vectorized import BatchBPE, HashedEncoder

# a character of a whitespace run, as the GPT-2 pattern's \s sees it
_WHITESPACE = regex.compile(r"\s")

EOT = "<|endoftext|>"  # the end-of-text special token, as GPT-2's: documents end with it

_T = TypeVar("_T")
# Bound on cached pre-tokens, so that encoding an endless stream runs in constant memory.
_CACHE_LIMIT = 1 << 20
# Plain text goes to the vectorised path in blocks of about this many bytes: larger blocks batch
# more new words, smaller ones keep its arrays in the CPU cache (about 1 MiB was fastest).
_FAST_BLOCK = 1 << 20
# Texts shorter than this many characters go through the regex path and its cache: the vectorised
# path's set-up costs more than it saves there (a 60-character line: 4 us against 115 us, warm; the
# paths cross between 4,096 and 16,384 characters, warm or cold: docs/benchmarks.md).
_SHORT_TEXT = 2048
_LINE_END_SPACE = "\t\n\x0b\x0c\r "  # what a safe cut (pretokenize.plain_stretches) may fall before
# encode_iterable emits ids once this much text has been buffered.
_STREAM_BUFFER_CHARS = 1 << 16
# the largest id a character can stand for (see Tokenizer._encode_chars)
MAX_ID = sys.maxunicode
_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"  # native uint32
# pre-tokens longer than this take the heap form of BPE (Tokenizer._bpe_long), O(n log n); the two
# forms cost about the same near this length, and the list form is faster below it
_LONG_WORD = 48
# rank entry of a pair that has no merge: greater than every real ``rank << shift | id``
_NO_MERGE = 1 << 80


def _replace_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (which UTF-8 cannot encode) replaced by U+FFFD, and each
    pair of surrogates joined into the character they stand for: what tiktoken does."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_id_type(t: type) -> bool:
    """Whether elements of type ``t`` are token ids: integers, but not booleans."""
    return issubclass(t, (int, np.integer)) and not issubclass(t, bool)


def _is_integer_dtype(dtype) -> bool:
    """Whether a numpy or torch dtype holds integers (not booleans)."""
    if isinstance(dtype, np.dtype):
        return dtype.kind in "iu"
    return (getattr(dtype, "is_floating_point", True) is False and getattr(dtype, "is_complex", True) is False
            and str(dtype) != "torch.bool")


def check_byte_level(
    tokens: Container[bytes],
    merges: Sequence[tuple[bytes, bytes]],
    vocab: str = "vocab",
    merge: Callable[[int], str] = lambda rank: f"merges: merge {rank}",
    in_vocab: str = "the vocab",
) -> None:
    """A one-line ValueError unless ``tokens`` hold all 256 single bytes and every merge's parts and
    result. ``vocab`` starts the message about bytes, ``merge(rank)`` the one about a merge (what
    :func:`lm.tokenizer.files.read_gpt2_files` makes name its files and lines), ``in_vocab`` names the vocab."""
    missing = [bytes([i]) for i in range(256) if bytes([i]) not in tokens]
    if missing:
        raise ValueError(f"{vocab}: {len(missing)} single bytes are missing (e.g. {missing[0]!r}); "
                         "a byte-level vocab holds all 256")
    for rank, (a, b) in enumerate(merges):
        for t in (a, b, a + b):
            if t not in tokens:
                raise ValueError(f"{merge(rank)} ({a!r}, {b!r}) needs token {t!r}, which is not in {in_vocab}; "
                                 "vocab and merges do not belong together")


def _keep_specials_whole(stretches: list[tuple[bool, int, int]], text: str, special_re: regex.Pattern,
                         longest: int) -> list[tuple[bool, int, int]]:
    """``stretches`` (:func:`plain_stretches` of ``text``, in order, end to end) with each cut that
    falls inside an occurrence of a special token (``special_re``, the longest ``longest``
    characters) moved left to that occurrence's start, and again while the new cut lies inside one
    (they may overlap): a cut inside none lies inside no special token the whole text's split finds,
    and both sides then split as the whole does (text is split at special tokens first). Where that
    leaves a stretch empty, the two are joined (plain if both are). Only the text around each cut is
    searched, not the whole text. The characters a cut moves across belong to a special token,
    which neither path classifies.

    >>> import regex
    >>> _keep_specials_whole([(True, 0, 6), (True, 6, 12), (False, 12, 14)], "abcd<s> efgh??",
    ...                      regex.compile("(<s> )"), 4)
    [(True, 0, 4), (True, 4, 12), (False, 12, 14)]
    """
    out = [stretches[0]]
    for plain, a, b in stretches[1:]:
        was_plain, start, _ = out[-1]
        cut = a
        while cut > start:
            window = special_re.finditer(text, max(start, cut - longest + 1), cut + longest - 1, overlapped=True)
            inside = [m.start() for m in window if m.start() < cut < m.end()]
            if not inside:
                break
            cut = min(inside)
        if cut > start:
            out[-1] = (was_plain, start, cut)
            out.append((plain, cut, b))
        else:  # the stretch before holds nothing but part of a special token
            out[-1] = (was_plain and plain, start, b)
    return out


def _weak_method(method: Callable[..., _T]) -> Callable[..., _T]:
    """The bound ``method`` as a function that does not keep its object alive. The encoders a
    tokenizer holds call back into it; holding its bound methods made a cycle that only the cyclic
    garbage collector frees, so a dropped tokenizer that had encoded kept its tables (a GPT-2 one,
    about 37 MiB) until a full collection: 40 made in a loop had reached 1.5 GB (tok25)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        return ref()(*args)

    return call


def _describe(value, limit: int = 60) -> str:
    """A value for an error message: "the bytes b'abc'", its type and its repr (cut at ``limit`` characters)."""
    if value is None:
        return "None"
    r = repr(value)
    return f"the {type(value).__name__} {r if len(r) <= limit else r[:limit] + '...'}"


def _check_text(text) -> None:
    """A one-line ValueError unless ``text`` is a str (bytes would need decoding first)."""
    if not isinstance(text, str):
        hint = "; decode it first" if isinstance(text, (bytes, bytearray)) else ""
        raise ValueError(f"text: expected a str, got {_describe(text)}{hint}")


def _check_merges(merges) -> list[tuple[bytes, bytes]]:
    """``merges`` as a list of pairs of bytes, or a one-line ValueError naming the first bad item."""
    if isinstance(merges, (str, bytes, bytearray)):
        raise ValueError(f"merges: expected a sequence of pairs of bytes, got {_describe(merges)}")
    checked = []
    for rank, m in enumerate(merges):
        if not (isinstance(m, (tuple, list)) and len(m) == 2
                and all(isinstance(x, (bytes, bytearray, memoryview)) for x in m)):
            raise ValueError(f"merges: each merge must be a pair of bytes, got {_describe(m)} at merge {rank}")
        checked.append((bytes(m[0]), bytes(m[1])))
    return checked


def _is_key(mapping: dict, key) -> bool:
    """``key in mapping``, False for an unhashable key."""
    try:
        return key in mapping
    except TypeError:
        return False


class Tokenizer:
    """A byte-level BPE tokenizer.

    Args:
        vocab: id -> token bytes.
        merges: the merged pairs in rank order (earlier merges apply first).
        special_tokens: strings that are always encoded as one token; those not yet in
            ``vocab`` are appended to it.

    One tokenizer may be shared by threads (its caches are filled one ``encode`` at a time); a
    copy or a pickle of it is a tokenizer of its own.
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Sequence[str] | None = None,
    ):
        self.vocab: dict[int, bytes] = {}
        self.merges: list[tuple[bytes, bytes]] = _check_merges(merges)
        self.special_tokens: list[str] = check_special_tokens(special_tokens)
        self.token_to_id: dict[bytes, int] = {}
        for i, tok in dict(vocab).items():
            # numpy's integers too, kept as ints (np.int64(0) had been "must be integers"); not a bool
            # (True had been id 1)
            if type(i) is not int and (isinstance(i, bool) or not isinstance(i, numbers.Integral)) \
                    or not 0 <= i <= MAX_ID:
                raise ValueError(f"vocab: ids must be integers in [0, {MAX_ID}], got {i!r}")
            i = int(i)
            self.vocab[i] = tok
            if not isinstance(tok, bytes):
                raise ValueError(f"vocab: each token must be bytes, got {_describe(tok)} for id {i}")
            self.token_to_id.setdefault(tok, i)
        for t in self.special_tokens:
            b = t.encode("utf-8")
            if b not in self.token_to_id:
                i = max(self.vocab, default=-1) + 1
                self.vocab[i] = b
                self.token_to_id[b] = i
        check_byte_level(self.token_to_id, self.merges)
        self._vocab_size = max(self.vocab) + 1  # the vocab is complete: fixed from here on
        # (left id, right id) -> (rank, merged id)
        self._ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self.merges):
            ia, ib, ic = self.token_to_id[a], self.token_to_id[b], self.token_to_id[a + b]
            self._ranks.setdefault((ia, ib), (rank, ic))
        # the same as ints for _bpe: (left id << shift | right id) -> rank << shift | merged id. The shift
        # is 16 where every id fits in 16 bits: smaller ints hash, compare and stay in the CPU cache
        # better (an encode per sentence of German, cold: 6-11% faster than with 32; docs/benchmarks.md)
        self._shift = 16 if self._vocab_size <= 1 << 16 else 32
        shift = self._shift
        self._pair_ranks = {a << shift | b: rank << shift | c for (a, b), (rank, c) in self._ranks.items()}
        self._byte_ids = [self.token_to_id[bytes([i])] for i in range(256)]
        self._special_ids = {t: self.token_to_id[t.encode("utf-8")] for t in self.special_tokens}
        self._special_re = special_tokens_regex(self.special_tokens)
        # whether a text may hold one, asked first: the standard library's engine answers in a quarter
        # of the time that `regex` takes to split a sentence that holds none
        self._has_special = re.compile("|".join(map(re.escape, self.special_tokens))).search \
            if self.special_tokens else None
        self._new_caches()
        self._special_bytes_re = special_tokens_regex(self.special_tokens, as_bytes=True)
        # plain_stretches may cut at the start of a line end's whitespace run ("[\t\v\f\r ]*\n"), which
        # must not fall inside a special token: not only one holding "\n" ("<sep> " before a line end had
        # been cut in two past 1 MiB of text, and encoded as ordinary text: tokenizer20). Such a cut is
        # moved to the special token's start (_keep_specials_whole); turning cutting off had made a long
        # text one block, of ~20 bytes a character (tokexp22)
        self._specials_may_span_cuts = any(c in t for t in self.special_tokens for c in _LINE_END_SPACE)

    # ------------------------------------------------------------ files

    @classmethod
    def from_files(
        cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike, special_tokens: Sequence[str] | None = None
    ) -> Tokenizer:
        """Read a GPT-2 style ``vocab.json`` + ``merges.txt`` (also GPT-2's ``encoder.json`` + ``vocab.bpe``)."""
        from lm.tokenizer.files import read_gpt2_files

        return cls(*read_gpt2_files(vocab_path, merges_path, special_tokens), special_tokens)

    def save(self, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
        """Write GPT-2 style files: ``{token_string: id}`` JSON and one merge per line."""
        from lm.tokenizer.files import write_gpt2_files

        write_gpt2_files(self, vocab_path, merges_path)

    def checksum(self) -> str:
        """SHA-256 over the vocab, merges and special tokens: identifies the tokenizer in token files."""
        h = hashlib.sha256()
        for i, tok in sorted(self.vocab.items()):
            h.update(f"{i}:".encode() + tok.hex().encode() + b"\n")
        for a, b in self.merges:
            h.update(a.hex().encode() + b" " + b.hex().encode() + b"\n")
        h.update(json.dumps(self.special_tokens).encode())
        return h.hexdigest()

    @property
    def vocab_size(self) -> int:
        """The largest id plus one (counted once, when the tokenizer is made: ``max`` over the vocab
        was 0.1 ms of every ``encode_to_numpy`` call into ``uint16``)."""
        return self._vocab_size

    @property
    def eot_id(self) -> int | None:
        """The id of :data:`EOT` (``<|endoftext|>``), which ends documents and generation; None
        when this tokenizer has no such token."""
        return self.token_to_id.get(EOT.encode())

    @property
    def special_ids(self) -> dict[str, int]:
        """Each special token's text and its id, in the order of :attr:`special_tokens`."""
        return {t: self.token_to_id[t.encode("utf-8")] for t in self.special_tokens}

    # ------------------------------------------------------------ encoding

    def _bpe(self, word: bytes) -> list[int]:
        """Apply the merges to one pre-token: repeatedly merge the leftmost adjacent pair of lowest rank.

        ``rank[i]`` describes the pair at positions (i, i+1) as ``rank << shift | merged id``
        (one int, so ``min`` compares fast; ``shift`` is 16 or 32, see ``__init__``); after a
        merge only its two neighbours change.
        Each merge scans the whole list, which is fastest for the short words of ordinary
        text but quadratic in the length; long pre-tokens (a DNA line, a ruler of dashes, a
        hex dump) go to :meth:`_bpe_long` instead.
        """
        if len(word) > _LONG_WORD:
            return self._bpe_long(word)
        ids = list(map(self._byte_ids.__getitem__, word))
        get = self._pair_ranks.get
        shift, no_merge = self._shift, _NO_MERGE
        mask = (1 << shift) - 1
        rank = [get(a << shift | b, no_merge) for a, b in zip(ids, ids[1:])]
        while rank:
            best = min(rank)
            if best == no_merge:
                break
            i = rank.index(best)
            ids[i] = best & mask
            del ids[i + 1]
            del rank[i]
            if i > 0:
                rank[i - 1] = get(ids[i - 1] << shift | ids[i], no_merge)
            if i < len(rank):
                rank[i] = get(ids[i] << shift | ids[i + 1], no_merge)
        return ids

    def _bpe_many(self, words: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_bpe` of many pre-tokens at once (numpy, :class:`~lm.tokenizer.vectorized.BatchBPE`):
        their ids, flat, and how many each has."""
        if self._batch_bpe is None:
            self._batch_bpe = BatchBPE(self._byte_ids, self._pair_ranks, _weak_method(self._bpe), shift=self._shift)
        return self._batch_bpe(words)

    def _bpe_long(self, word: bytes) -> list[int]:
        """:meth:`_bpe` in O(n log n) for a long pre-token: the same merges in the same order.

        The symbols form a linked list (``nxt``/``prv`` over their first byte's position; a
        merged-away symbol gets id -1), and a heap holds ``rank << 32 | position`` for the
        pairs that have a merge, so the lowest rank pops first and, among equal ranks (the
        same pair), the leftmost. A merge changes the pairs on either side; their old heap
        entries are not removed but skipped when popped, as Hugging Face ``tokenizers``
        does: an entry is stale when its position no longer starts a pair of that rank (a
        symbol's id only ever grows into a longer token, so a stale pair never comes back).
        """
        ids = list(map(self._byte_ids.__getitem__, word))
        n = len(ids)
        get = self._pair_ranks.get
        shift = self._shift
        mask = (1 << shift) - 1
        nxt = list(range(1, n + 1))  # n: no next symbol
        prv = list(range(-1, n - 1))  # -1: no previous symbol
        heap = []
        for i in range(n - 1):
            r = get(ids[i] << shift | ids[i + 1])
            if r is not None:
                heap.append(r >> shift << 32 | i)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            entry = pop(heap)
            i = entry & 0xFFFFFFFF
            left = ids[i]
            j = nxt[i]
            if left < 0 or j == n:
                continue
            r = get(left << shift | ids[j])
            if r is None or r >> shift != entry >> 32:
                continue  # stale: the pair at i changed since this entry was pushed
            ids[i] = merged = r & mask
            ids[j] = -1
            k = nxt[i] = nxt[j]
            if k < n:
                prv[k] = i
                r = get(merged << shift | ids[k])
                if r is not None:
                    push(heap, r >> shift << 32 | i)
            h = prv[i]
            if h >= 0:
                r = get(ids[h] << shift | merged)
                if r is not None:
                    push(heap, r >> shift << 32 | h)
        return [t for t in ids if t >= 0]

    def _encode_ordinary(self, text: str) -> str:
        """Encode text that holds no special tokens, as a string of ``chr(id)`` (see ``_encode_chars``).

        The pre-tokens are looked up in the cache with one ``map`` and joined with one
        ``str.join``, both at C speed; the ones not seen before go through the merges together
        (:meth:`_bpe_many`) and join the cache.
        """
        words = pretokenize(text)
        pieces = list(map(self._cache.get, words))
        missing = pieces.count(None)  # pre-tokens not cached yet
        if not missing:
            return "".join(pieces)
        cache = self._cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        if missing >= BatchBPE.MIN_ROWS:  # many new words: through the merges in one numpy batch first
            new = list(dict.fromkeys(w for w, p in zip(words, pieces) if p is None))  # distinct, in order
            if len(new) >= BatchBPE.MIN_ROWS:  # else too few to repay numpy's per-call cost
                flat, n_ids = self._bpe_many([w.encode("utf-8") for w in new])
                chars = flat.tobytes().decode(_UTF32, "surrogatepass")
                start = 0
                for w, end in zip(new, np.cumsum(n_ids).tolist()):
                    cache[w] = chars[start:end]
                    start = end
        i = -1
        for _ in range(missing):  # each in place, found at C speed (a sentence has one or two)
            i = pieces.index(None, i + 1)
            w = words[i]
            piece = cache.get(w)  # batched above, or the same word earlier in this text
            if piece is None:
                piece = cache[w] = "".join(map(chr, self._bpe(w.encode("utf-8"))))
            pieces[i] = piece
        return "".join(pieces)

    def _encode_chars(self, text: str) -> str:
        """The ids of ``text`` as a string whose characters are ``chr(id)``: the regex path.

        Strings join and convert at C speed (``str.join``, ``str.encode``), so the cache maps
        each pre-token to such a string, and a text's ids never exist as Python ints. Ids in
        the surrogate range stay single characters here and are converted with ``surrogatepass``.
        """
        if self._has_special is None or self._has_special(text) is None:
            return self._encode_ordinary(text)
        parts: list[str] = []
        for i, seg in enumerate(split_on_special(text, self._special_re)):
            if i % 2:
                parts.append(chr(self._special_ids[seg]))
            elif seg:
                parts.append(self._encode_ordinary(seg))
        return "".join(parts)

    def _encode_array(self, text: str) -> np.ndarray:
        """The ids of ``text`` as native ``uint32``: a short text (under ``_SHORT_TEXT``
        characters) through the regex path; in a longer one plain stretches through the vectorised
        path, the rest (and any stretch where a hash collided) through the regex path.

        Lone surrogates, which UTF-8 cannot encode, become U+FFFD first, as in tiktoken: the
        encoder meets them only where it encodes a pre-token, so the check costs nothing on other text."""
        return self._locked(self._encode_valid, text)

    def _locked(self, encode: Callable[[str], _T], text: str) -> _T:
        """``encode(text)`` under the lock; a text with lone surrogates (UnicodeEncodeError) again with
        them replaced by U+FFFD."""
        with self._lock:  # the caches are not safe to share: threads had got each other's ids (tokenizer20)
            try:
                return encode(text)
            except UnicodeEncodeError:
                return encode(_replace_surrogates(text))

    # What encoding fills (and its lock) is left out of a copy or a pickle, which makes its own: a
    # lock neither pickles nor copies, and a copy.copy that shared the caches under a lock of its own
    # had given threads each other's ids again (review20). A pickle sent to a worker is smaller too.
    _OWN = ("_lock", "_cache", "_fast", "_batch_bpe")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._OWN}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._new_caches()

    def _new_caches(self) -> None:
        """Empty caches of encoding, and the lock that guards them."""
        self._cache: dict[str, str] = {}  # pre-token -> its ids as a string of chr(id) (see _encode_chars)
        # the fast path (lm.tokenizer.vectorized)
        self._fast = HashedEncoder(_weak_method(self._bpe_many), _CACHE_LIMIT)
        self._batch_bpe: BatchBPE | None = None  # made when first needed
        # Encoding fills both caches (and the fast path's tables): one call at a time, so that a tokenizer
        # can be shared by threads (as tiktoken's and Hugging Face's are); most of the work holds the GIL anyway
        self._lock = threading.Lock()

    def _encode_valid(self, text: str) -> np.ndarray:
        """:meth:`_encode_array` of a text that UTF-8 can encode (else UnicodeEncodeError).

        Plain stretches go to the vectorised path joined into blocks of about ``_FAST_BLOCK``
        bytes: they begin and end at safe cuts (a line end's whitespace run after a character that
        is not whitespace), so a join is a safe cut too and each stretch's ids are the ones it has
        alone. A block's words new to the cache go through the merges in one batch, and its arrays
        stay in cache.
        """
        if len(text) < _SHORT_TEXT:  # a copy: the regex path's ids are a read-only view of bytes
            return self._encode_regex(text).copy()
        stretches = list(plain_stretches(text, max_plain=_FAST_BLOCK, fast=True))
        if self._specials_may_span_cuts and len(stretches) > 1:
            stretches = _keep_specials_whole(stretches, text, self._special_re,
                                             max(map(len, self.special_tokens)))
        parts: list[np.ndarray | None] = [None] * len(stretches)
        block: list[tuple[int, bytes]] = []  # (index in stretches, UTF-8)
        held = 0
        for k, (plain, a, b) in enumerate(stretches):
            if plain:
                data = text[a:b].encode("utf-8")
                block.append((k, data))
                held += len(data)
                if held < _FAST_BLOCK and k + 1 < len(stretches):
                    continue
            else:
                parts[k] = self._encode_regex(text[a:b])
            if block and (held >= _FAST_BLOCK or k + 1 == len(stretches)):
                self._encode_block(text, stretches, block, parts)
                block, held = [], 0
        if len(parts) == 1:  # a view of the regex path's bytes is read-only: the caller's array is its own
            return parts[0] if parts[0].flags.writeable else parts[0].copy()
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def _encode_block(self, text: str, stretches: list[tuple[bool, int, int]], block: list[tuple[int, bytes]],
                      parts: list[np.ndarray | None]) -> None:
        """Encode plain stretches joined (see :meth:`_encode_valid`) into their places in ``parts``."""
        data = b"".join(d for _, d in block)
        specials = []
        if self._special_bytes_re is not None:
            found = self._special_bytes_re.finditer(data)
            specials = [(m.start(), m.end(), self.token_to_id[m.group()]) for m in found]
        cuts = np.cumsum([len(d) for _, d in block[:-1]]).tolist()
        pieces = self._fast.encode_pieces(data, cuts, specials)
        for j, (k, _) in enumerate(block):
            if pieces is not None:
                parts[k] = pieces[j]
            else:  # a hash collision
                _, a, b = stretches[k]
                parts[k] = self._encode_regex(text[a:b])

    def _encode_regex(self, text: str) -> np.ndarray:
        """The regex path's ids of ``text`` (:meth:`_encode_chars`) as native ``uint32``."""
        return np.frombuffer(self._encode_chars(text).encode(_UTF32, "surrogatepass"), dtype=np.uint32)

    def encode(self, text: str) -> list[int]:
        """Encode a string into token ids; a lone surrogate (not valid Unicode text) encodes as U+FFFD."""
        _check_text(text)
        if len(text) < _SHORT_TEXT:  # the regex path's ids straight to ints: no array (one encode per sentence)
            return list(map(ord, self._locked(self._encode_chars, text)))
        return self._encode_array(text).tolist()

    def encode_to_numpy(self, text: str, dtype: npt.DTypeLike = np.uint32) -> np.ndarray:
        """Encode a string into a 1-D array of ids of ``dtype`` (``uint16`` or ``uint32``).

        Faster than ``np.array(encode(text))``: the ids never become Python ints.
        ``uint16`` needs every id below 65,536.
        """
        _check_text(text)
        try:  # None is numpy's float64, and "bogus" a TypeError: neither names dtype
            dt = None if dtype is None else np.dtype(dtype)
        except TypeError:
            dt = None
        if dt is None:
            raise ValueError(f"dtype: must be uint16 or uint32, got {dtype!r}")
        if dt.kind != "u" or dt.itemsize not in (2, 4):
            raise ValueError(f"dtype: must be uint16 or uint32, got {dt}")
        if dt.itemsize == 2 and self.vocab_size > 1 << 16:
            raise ValueError(f"dtype: uint16 cannot hold the ids of a vocab of size {self.vocab_size}")
        return self._encode_array(text).astype(dt, copy=False)

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Encode a stream of strings (e.g. a file's lines) lazily, in constant memory.

        Gives the same ids as ``encode("".join(iterable))``: text is held back until it is
        certain that no pre-token or special token crosses the point where it is cut (so a
        pre-token longer than the buffer, 64K characters, is held whole).
        """
        try:
            pieces = iter(iterable)
        except TypeError:
            pieces = None
        if pieces is None or isinstance(iterable, (bytes, bytearray)):
            raise ValueError(f"iterable: expected an iterable of str, got {_describe(iterable)}")
        return self._encode_stream(pieces)

    def _encode_stream(self, iterable: Iterable[str]) -> Iterator[int]:
        """:meth:`encode_iterable`, once its argument is checked (a generator checks nothing until used).

        The text is looked at for a cut once ``_STREAM_BUFFER_CHARS`` are held, and after that
        once the held text is twice what the last look left: a pre-token longer than the buffer
        (a DNA line, a base64 blob) that arrives in small pieces cannot be cut, and looking at
        all of it again for every piece was quadratic; doubling makes the work linear (each
        look costs at most twice the text that arrived since the one before)."""
        parts: list[str] = []  # joined only when looked at: ``buf += piece`` may copy buf every time
        held = 0
        wait = 0  # held text that the last look left uncut; the next looks once there is twice as much
        for piece in iterable:
            if not isinstance(piece, str):
                raise ValueError(f"iterable: expected pieces of str, got {_describe(piece)}")
            parts.append(piece)
            held += len(piece)
            if held < max(_STREAM_BUFFER_CHARS, 2 * wait, 1):
                continue
            buf = "".join(parts)
            # A high surrogate at the end may pair with the next piece, into a character that may join
            # the pre-token before it (a letter): the cut is one that no text after the rest could move.
            pending = "\ud800" <= buf[-1] <= "\udbff"
            if not buf.isascii() and _SURROGATE.search(buf):
                # as encode does, before the cut: a pair of surrogates is one character (a letter, maybe)
                buf = _replace_surrogates(buf[:-1]) + buf[-1] if pending else _replace_surrogates(buf)
            cut = self._safe_prefix_len(buf[:-1] if pending else buf)
            if cut > 0:
                yield from self._encode_array(buf[:cut]).tolist()
                buf = buf[cut:]
            parts = [buf]
            held = wait = len(buf)
        buf = "".join(parts)
        if buf:
            yield from self._encode_array(buf).tolist()

    def _safe_prefix_len(self, text: str) -> int:
        """Length of a prefix of ``text`` whose ids cannot change whatever text follows."""
        # Hold back a tail that could be the start of a special token (or of a longer one).
        hold = 0
        for t in self.special_tokens:
            for k in range(min(len(t), len(text)), 0, -1):
                if k > hold and t.startswith(text[-k:]):
                    hold = k
                    break
        end = len(text) - hold
        start = 0
        if self._special_re is not None:
            # Special tokens are matched over the whole text, as encode does: one that is complete in
            # the text but cut by the held tail (" <sep> " when " <" is held for another " <sep> ")
            # moves the end of the head before it; the head's pre-tokens start after the last one.
            last = None
            for m in self._special_re.finditer(text):
                if m.end() <= end:
                    last = m
                    continue
                if m.start() < end:
                    end = m.start()
                break
            if last is not None and last.end() <= end:
                start = last.end()
        head = text[:end]
        # Every pre-token but the last is final: the regex decides where a token ends by looking
        # no further than the first character after it that it cannot take (after a whitespace
        # run, the first non-space), which for all but the last lies in ``head``. A cut before
        # the last pre-token also needs the ones before it to come out the same at the end of the
        # prefix, which two kinds may not: a whitespace token ("\n\tHi" splits as "\n", "\t", "Hi"
        # only because "H" follows; "\n\t" at the end stays whole), and one that starts with an
        # apostrophe ("'l" splits as "'", "l" until a second "l" makes the contraction "'ll"). So
        # the cut moves back before every such token that precedes it.
        words = list(GPT2_REGEX.finditer(head, start))
        if not words:
            return start
        k = len(words) - 1
        while k > 0 and (_WHITESPACE.match(words[k - 1].group()[-1]) or words[k - 1].group().startswith("'")):
            k -= 1
        return words[k].start()

    # ------------------------------------------------------------ decoding

    def decode(self, ids: Iterable[int]) -> str:
        """Decode token ids (any iterable of ints, or a 1-D integer tensor or numpy array) to text;
        byte sequences that are not valid UTF-8 become U+FFFD.

        >>> tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
        >>> tok.decode(iter([104, 105])), tok.decode(np.array([104, 105]))
        ('hi', 'hi')
        """
        dtype = None
        integers = False  # known to hold only ints: an array of an integer dtype
        if hasattr(ids, "tolist"):  # a tensor or an array: its elements as Python ints, not 0-d tensors
            dtype = getattr(ids, "dtype", None)
            integers = _is_integer_dtype(dtype)
            shape = getattr(ids, "shape", None)
            if shape is not None and len(shape) > 1:
                raise ValueError(f"ids: expected a 1-D sequence of token ids, got an array of shape {tuple(shape)}")
            ids = ids.tolist()
            if not isinstance(ids, list):
                raise ValueError(f"ids: expected a 1-D sequence of token ids, got the scalar {ids!r}")
        elif not isinstance(ids, (list, tuple)):
            try:
                ids = list(ids)  # an iterator is used up by one pass; the errors below need a second
            except TypeError:  # decode(5) had been "'int' object is not iterable"
                raise ValueError(f"ids: expected a sequence of token ids, got {_describe(ids)}") from None
        vocab = self.vocab
        try:
            data = b"".join(map(vocab.__getitem__, ids))
        except (KeyError, TypeError):
            data = None
        if not integers:  # a float (or True) finds the int key of equal value: refuse it, as tiktoken does
            types = set(map(type, ids))
            if not types <= {int} and not all(map(_is_id_type, types)):
                bad = next(i for i in ids if not _is_id_type(type(i)))
                of = "the" if dtype is None else f"an array of dtype {dtype}, holding"
                value = bad.item() if isinstance(bad, np.generic) else bad  # 2.5, not np.float64(2.5)
                raise ValueError(f"ids: token ids must be integers, got {of} {type(bad).__name__} {value!r}")
        if data is None:
            bad = next(i for i in ids if not _is_key(vocab, i))
            raise ValueError(f"ids: {bad!r} is not a token id of this vocab (size {self.vocab_size})")
        return data.decode("utf-8", errors="replace")

    # ------------------------------------------------------------ interop

    def to_hf_json(self) -> dict:
        """A Hugging Face ``tokenizer.json`` document that encodes exactly like this tokenizer."""
        from lm.tokenizer.files import hf_json

        return hf_json(self)

    def save_hf(self, path: str | os.PathLike) -> None:
        """Write a Hugging Face ``tokenizer.json`` (loadable with ``tokenizers.Tokenizer.from_file``)."""
        from lm.tokenizer.files import write_hf_json

        write_hf_json(self, path)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"special_tokens={self.special_tokens})"
        )


r"""Encoding without a Python step per pre-token: the GPT-2 pre-tokens of plain text found with
numpy, and their ids looked up in a hash table held in numpy arrays.

This is the fast path of :class:`lm.tokenizer.Tokenizer` for any text UTF-8 can encode (all but
lone surrogates): ASCII, accented Latin letters, Greek, Cyrillic, Hebrew, Arabic, Devanagari, Thai,
CJK, punctuation, emoji, the Unicode spaces (NBSP, U+3000...). On that text the GPT-2 pattern
reduces to rules about classes of bytes — letters, digits, space, other whitespace, anything else;
a multi-byte character's class comes from a table by code point (:func:`plane_classes`) — that
numpy applies to a whole chunk at once (:func:`pretoken_starts`, tested equal to the regex). Each
pre-token then gets a 64-bit key: a pre-token of up to 7 bytes (most words with their space) is its
own key, its bytes and its length packed into one integer, read with one 8-byte load; a longer one
is hashed from its bytes, and a hit is checked byte for byte against the word stored with the
entry, so a hash collision cannot give wrong ids (the caller falls back to the regex path).
Pre-tokens not yet in the table get their ids from the tokenizer's BPE, all of a call's new words
at once (:class:`BatchBPE`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import regex

# byte classes
_LETTER, _DIGIT, _OTHER, _SPACE, _WS, _SPECIAL = 0, 1, 2, 3, 4, 5
_CLASS = np.full(256, _OTHER, dtype=np.uint8)  # bytes >= 0x80: pretoken_starts classes their characters
_CLASS[ord("a") : ord("z") + 1] = _LETTER
_CLASS[ord("A") : ord("Z") + 1] = _LETTER
_CLASS[ord("0") : ord("9") + 1] = _DIGIT
_CLASS[ord(" ")] = _SPACE
for _c in "\t\n\x0b\x0c\r":
    _CLASS[ord(_c)] = _WS


@functools.cache
def plane_classes(plane: int) -> np.ndarray:
    """The class of every code point of Unicode plane ``plane`` (0, the BMP: the characters of up to
    three UTF-8 bytes; 1-16: of four, emoji among them) as the GPT-2 pattern sees it: ``\\p{L}``,
    ``\\p{N}``, ``\\s`` (``_WS``) or none of them (``_OTHER``), from the `regex` module's tables, which
    the regex path uses. Built on first use (a scan of the plane, some 30 ms). The whitespace above
    ASCII never reaches this path (``pretokenize._fast_patterns``; Unicode has none above the BMP,
    a test checks), nor do the surrogates; the ASCII rows are ``_CLASS``'s."""
    chars = "".join(map(chr, range(plane << 16, (plane + 1) << 16)))
    out = np.full(0x10000, _OTHER, dtype=np.uint8)
    for pattern, cls in ((r"\p{L}", _LETTER), (r"\p{N}", _DIGIT), (r"\s", _WS)):
        out[np.fromiter((m.start() for m in regex.finditer(pattern, chars)), dtype=np.intp)] = cls
    return out


def bmp_classes() -> np.ndarray:
    """:func:`plane_classes` of the BMP (U+0000-U+FFFF)."""
    return plane_classes(0)


def non_ascii_spaces() -> list[int]:
    """The code points above ASCII and below U+10000 that the GPT-2 pattern takes for whitespace
    (``\\s``): this path does not take them (``pretokenize._fast_patterns``)."""
    return (np.flatnonzero(bmp_classes()[0x80:] == _WS) + 0x80).tolist()


_APOSTROPHE = ord("'")
# second (and third) letters of the contractions '(?:[sdmt]|ll|ve|re)
_ONE_LETTER_CONTRACTION = np.zeros(256, dtype=bool)
_ONE_LETTER_CONTRACTION[[ord(c) for c in "sdmt"]] = True
_TWO_LETTER_CONTRACTIONS = {(ord("l"), ord("l")), (ord("v"), ord("e")), (ord("r"), ord("e"))}


def pretoken_starts(
    b: np.ndarray, special: np.ndarray | None = None, special_starts: np.ndarray | None = None
) -> np.ndarray:
    r"""Offsets where the GPT-2 pre-tokens of the UTF-8 bytes ``b`` start.

    ``b`` must be valid UTF-8 (each character above ASCII classed by its code point,
    :func:`plane_classes`).
    ``special``, if given, marks the bytes of special tokens and ``special_starts`` holds where
    each of them starts: around them the text is pre-tokenized as if they cut it into separate texts.
    """
    n = len(b)
    if n == 0:
        return np.zeros(0, dtype=np.intp)
    c = _CLASS[b]
    lead = np.flatnonzero(b >= 0xC2)  # the first byte of a character of two to four bytes
    wide_space = False  # whitespace of two or three bytes (U+0085, NBSP, U+2000-U+200A, U+3000...)
    if lead.size:
        first = b[lead].astype(np.intp)
        second = (b[lead + 1] & 0x3F).astype(np.intp)
        three = first >= 0xE0  # three or four bytes
        cp = np.where(three, (first & 0x0F) << 12 | second << 6, (first & 0x1F) << 6 | second)
        lead3 = lead[three]
        cp[three] |= b[lead3 + 2] & 0x3F
        four = first >= 0xF0
        if four.any():  # (first & 0x07) << 18 | second << 12 | third << 6 | fourth
            lead4 = lead[four]
            cp[four] = (first[four] & 0x07) << 18 | (cp[four] & 0xFFF) << 6 | b[lead4 + 3] & 0x3F
            plane = cp >> 16
            cls = np.empty(lead.size, dtype=np.uint8)
            for p in np.unique(plane).tolist():
                at = plane == p
                cls[at] = plane_classes(p)[cp[at] & 0xFFFF]
            c[lead4 + 3] = cls[four]
        else:
            cls = bmp_classes()[cp]
        c[lead] = cls
        c[lead + 1] = cls
        c[lead3 + 2] = cls[three]
        wide_space = bool((cls == _WS).any())
    if special is not None:
        c[special] = _SPECIAL
    ws = c >= _SPACE
    ws &= c != _SPECIAL
    run = np.where(ws, _SPACE, c)
    start = np.empty(n, dtype=bool)
    start[0] = True
    np.not_equal(run[1:], run[:-1], out=start[1:])
    # \s+(?!\S): a whitespace run of two or more followed by a non-space leaves its last
    # character to the next token (not when a special token or the end follows: that is the end)
    if wide_space:  # the last character may be of several bytes: by characters, not bytes
        at = np.flatnonzero(ws & ((b & 0xC0) != 0x80))  # whitespace characters' first bytes
        at = at[at > 0]
        at = at[ws[at - 1]]  # after whitespace
        nxt = at + np.where(b[at] < 0x80, 1, np.where(b[at] < 0xE0, 2, 3))  # the next character
        nxt_ok = nxt < n
        at, nxt = at[nxt_ok], nxt[nxt_ok]
        start[at[(c[nxt] != _SPECIAL) & ~ws[nxt]]] = True
    elif n > 2:
        follow = (c[2:] != _SPECIAL) & ~ws[2:]
        start[1:-1] |= ws[1:-1] & ws[:-2] & follow
    # " ?\p{L}+" etc.: a space just before letters, digits or other characters joins their token
    # (the class, not the byte: the last space of a special token such as "<sep> " is no such space)
    attach = start[1:] & (c[1:] <= _OTHER) & (c[:-1] == _SPACE)  # attach[k]: position k + 1
    start[1:] &= ~attach
    start[:-1] |= attach
    # '(?:[sdmt]|ll|ve|re): a token that starts at an apostrophe followed by a letter (an apostrophe
    # of the text: not a special token "'")
    ap = np.flatnonzero(start[:-1] & (b[:-1] == _APOSTROPHE) & (c[:-1] == _OTHER) & (c[1:] == _LETTER))
    if ap.size:
        nxt = b[ap + 1]
        after = np.zeros(ap.size, dtype=np.int64)
        ok = ap + 2 < n
        ok[ok] = c[ap[ok] + 2] != _SPECIAL
        after[ok] = b[ap[ok] + 2]
        two = np.zeros(ap.size, dtype=bool)
        for x, y in _TWO_LETTER_CONTRACTIONS:
            two |= (nxt == x) & (after == y)
        length = np.where(_ONE_LETTER_CONTRACTION[nxt], 2, np.where(two, 3, 0))
        ap, length = ap[length > 0], length[length > 0]
        start[ap + 1] = False  # the letter run now starts inside the contraction...
        end = ap + length
        end = end[end < n]
        start[end[c[end] == _LETTER]] = True  # ...and goes on after it, if it is longer
    if special_starts is not None:
        start[special_starts] = True  # special tokens side by side
    return np.flatnonzero(start)


def _grow(a: np.ndarray, need: int) -> np.ndarray:
    if need <= len(a):
        return a
    out = np.zeros(max(need, 2 * len(a)), dtype=a.dtype)
    out[: len(a)] = a
    return out


# random 64-bit values per (position in the token mod 64, byte): a long pre-token's hash is their sum
_HASH_TABLE = np.random.default_rng(0x6C6D).integers(1, 2**63, size=64 * 256, dtype=np.uint64)
_LEN_MIX = np.uint64(0x9E3779B97F4A7C15)
# pre-tokens of up to _EXACT bytes are their own keys: the bytes (little-endian) below bit 56 and
# the length (1..7) above; hashed keys have the top byte 0xFF, so the two kinds never meet, and
# no key is 0 (an empty slot)
_EXACT = 7
_LOW_BYTES = np.array([(1 << 8 * n) - 1 for n in range(_EXACT + 1)], dtype=np.uint64)
_HASHED = np.uint64(0xFF << 56)
_NO_MERGE = np.iinfo(np.int64).max  # BatchBPE's rank of a pair that has no merge
_SLOT_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: a key's slot is the top bits of key * this


def _ranges(offsets: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
    """``concatenate([arange(o, o + n) for o, n in zip(offsets, lengths)])`` for lengths >= 1,
    as one cumulative sum: steps of 1, and a jump where each range begins."""
    step = np.ones(total, dtype=np.intp)
    begin = np.cumsum(lengths) - lengths
    step[0] = offsets[0]
    step[begin[1:]] = offsets[1:] - offsets[:-1] - lengths[:-1] + 1
    return np.cumsum(step, out=step)


def _hash_tokens(b: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A hash of each of the pre-tokens that tile ``b`` (they start at ``starts``), top byte 0xFF.

    Each byte's random value (by its position mod 64) is multiplied by an odd number that
    grows with its block of 64, so that words that are the same blocks in another order
    ("a"*64 + "b"*64 and "b"*64 + "a"*64) do not sum alike."""
    pos = _ranges(np.zeros(len(starts), dtype=np.intp), lengths, len(b))  # position in the token
    idx = (pos & 63) << 8
    idx |= b
    values = _HASH_TABLE[idx]
    values *= ((pos >> 6) * 2 + 1).astype(np.uint64)
    h = np.add.reduceat(values, starts)
    h ^= lengths.astype(np.uint64) * _LEN_MIX
    h |= _HASHED
    return h


def _token_keys(b: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The key of each pre-token of ``b`` (see ``_EXACT``), and the indices of the hashed ones."""
    n = len(b)
    padded = np.zeros(n + 8, dtype=np.uint8)
    padded[:n] = b
    # the 8 bytes from each offset, one unaligned little-endian load each
    words = np.ndarray((n,), dtype="<u8", buffer=padded, strides=(1,))
    keys = words[starts]
    keys &= _LOW_BYTES[np.minimum(lengths, _EXACT)]
    keys |= lengths.astype(np.uint64) << np.uint64(56)
    long = np.flatnonzero(lengths > _EXACT)
    if long.size:
        ll = lengths[long]
        keys[long] = _hash_tokens(b[_ranges(starts[long], ll, int(ll.sum()))], np.cumsum(ll) - ll, ll)
    return keys, long


class _OpenTable:
    """A hash table in numpy arrays: uint64 keys (0 marks an empty slot, so no key is 0) to int64
    values, open addressing with linear probing; a key's first slot is the top bits of key times
    a Fibonacci constant. The owner keeps it at most half full."""

    def __init__(self, size: int, missing: int):
        self.keys = np.zeros(size, dtype=np.uint64)
        self.values = np.full(size, missing, dtype=np.int64)  # an empty slot's: what find gives a stranger
        self.missing = missing
        self._shift = np.uint64(64 - (size.bit_length() - 1))

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _SLOT_MIX) >> self._shift).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, or ``missing`` (the key 0 too: it meets an empty slot's value)."""
        mask = len(self.keys) - 1
        slot = self._slots(keys)
        k = self.keys[slot]
        out = self.values[slot]
        hit = k == keys
        if hit.all():  # the common case: every key in its own slot
            return out
        out[~hit] = self.missing
        todo = np.flatnonzero(~hit & (k != 0))  # the slot held another key: probe on
        slot, wanted = (slot[todo] + 1) & mask, keys[todo]
        while todo.size:
            k = self.keys[slot]
            hit = k == wanted
            out[todo[hit]] = self.values[slot[hit]]
            more = ~hit & (k != 0)
            todo, slot, wanted = todo[more], (slot[more] + 1) & mask, wanted[more]
        return out

    def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Add ``keys`` (distinct, not 0, not held yet) with their ``values``."""
        mask = len(self.keys) - 1
        slot = self._slots(keys)
        while keys.size:
            # each free slot takes the first key that wants it; the others probe on
            free = self.keys[slot] == 0
            first = np.zeros(len(keys), dtype=bool)
            _, idx = np.unique(slot[free], return_index=True)
            first[np.flatnonzero(free)[idx]] = True
            self.keys[slot[first]] = keys[first]
            self.values[slot[first]] = values[first]
            rest = ~first
            keys, values, slot = keys[rest], values[rest], (slot[rest] + 1) & mask


class HashedEncoder:
    """Maps pre-tokens to ids through a numpy hash table; grows by running ``bpe_many`` on new words.

    Args:
        bpe_many: pre-tokens' UTF-8 bytes -> their token ids, flat, and how many each has.
        limit: number of distinct pre-tokens after which the table starts again empty, so
            memory stays bounded on an endless stream.
    """

    def __init__(self, bpe_many: Callable[[list[bytes]], tuple[np.ndarray, np.ndarray]], limit: int):
        self.bpe_many = bpe_many
        self.limit = limit
        self.clear()

    def clear(self) -> None:
        self.table = _OpenTable(1 << 16, -1)  # key -> entry
        self.entries = 0  # distinct pre-tokens held
        self.ids_off = np.zeros(1 << 12, dtype=np.int64)  # entry -> its ids in ids_pool
        self.ids_len = np.zeros(1 << 12, dtype=np.int64)
        self.word_off = np.zeros(1 << 12, dtype=np.int64)  # entry -> its bytes in word_pool
        self.word_len = np.zeros(1 << 12, dtype=np.int64)
        self.ids_pool = np.zeros(1 << 14, dtype=np.uint32)
        self.word_pool = np.zeros(1 << 16, dtype=np.uint8)
        self.ids_used = self.words_used = 0

    def _add(self, words: list[bytes], h: np.ndarray) -> None:
        """Add new pre-tokens (distinct, not in the table) with their hashes."""
        flat_ids, n_ids = self.bpe_many(words)
        n_bytes = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        flat_words = np.frombuffer(b"".join(words), dtype=np.uint8)
        e0, e1 = self.entries, self.entries + len(words)
        for name in ("ids_off", "ids_len", "word_off", "word_len"):
            setattr(self, name, _grow(getattr(self, name), e1))
        self.ids_off[e0:e1] = self.ids_used + np.cumsum(n_ids) - n_ids
        self.ids_len[e0:e1] = n_ids
        self.word_off[e0:e1] = self.words_used + np.cumsum(n_bytes) - n_bytes
        self.word_len[e0:e1] = n_bytes
        self.ids_pool = _grow(self.ids_pool, self.ids_used + len(flat_ids))
        self.ids_pool[self.ids_used : self.ids_used + len(flat_ids)] = flat_ids
        self.word_pool = _grow(self.word_pool, self.words_used + len(flat_words))
        self.word_pool[self.words_used : self.words_used + len(flat_words)] = flat_words
        self.ids_used += len(flat_ids)
        self.words_used += len(flat_words)
        self.entries = e1
        if 2 * self.entries > len(self.table.keys):  # keep the load under 1/2: rebuild twice as large
            size = len(self.table.keys)
            while 2 * self.entries > size:
                size *= 2
            old, self.table = self.table, _OpenTable(size, -1)
            used = old.keys != 0
            self.table.insert(old.keys[used], old.values[used])
        self.table.insert(h, np.arange(e0, e1, dtype=np.int64))

    def encode(self, data: bytes, specials: list[tuple[int, int, int]] = ()) -> np.ndarray | None:
        """The ids of ``data`` (UTF-8 of text fit for this path) as ``uint32``, or None on a hash collision.

        ``specials`` lists (start, end, id) of special tokens in ``data``, in order.
        """
        pieces = self.encode_pieces(data, [], specials)
        return None if pieces is None else pieces[0]

    def encode_pieces(self, data: bytes, cuts: list[int],
                      specials: list[tuple[int, int, int]] = ()) -> list[np.ndarray] | None:
        """:meth:`encode`, the ids cut where the bytes are cut at ``cuts`` (increasing offsets, each
        the start of a pre-token): ``len(cuts) + 1`` arrays. None on a hash collision, or where a
        cut is not the start of a pre-token (the pieces would not be the ids of the byte ranges).

        Several texts joined at safe cuts encode in one call this way, which is faster than one
        call each: the words new to the table go through the merges in one batch.
        """
        b = np.frombuffer(data, dtype=np.uint8)
        if len(b) == 0:
            return [np.zeros(0, dtype=np.uint32) for _ in range(len(cuts) + 1)]
        mask = sp_starts = None
        if specials:
            mask = np.zeros(len(b), dtype=bool)
            for s, e, _ in specials:
                mask[s:e] = True
            sp_starts = np.array([s for s, _, _ in specials], dtype=np.intp)
        starts = pretoken_starts(b, mask, sp_starts)
        lengths = np.diff(starts, append=len(b))
        is_special = None
        if specials:
            is_special = np.zeros(len(starts), dtype=bool)
            is_special[np.searchsorted(starts, sp_starts)] = True
        h, long = _token_keys(b, starts, lengths)
        entry = self.table.find(h)
        miss = entry < 0
        if is_special is not None:
            miss &= ~is_special
        if miss.any():
            new_h, first = np.unique(h[miss], return_index=True)
            if self.entries + len(new_h) > self.limit:
                # start again empty, with every word of this text (the hits' entries are gone)
                self.clear()
                miss = np.ones(len(h), dtype=bool) if is_special is None else ~is_special
                new_h, first = np.unique(h[miss], return_index=True)
            at = np.flatnonzero(miss)[first]
            self._add([data[s : s + n] for s, n in zip(starts[at].tolist(), lengths[at].tolist())], new_h)
            entry[miss] = self.table.find(h[miss])
        if is_special is not None:
            entry[is_special] = 0  # placeholder: filled below
            long = long[~is_special[long]]
        # a hashed key may belong to another word: check the long pre-tokens against the stored
        # bytes (lengths first, so that the bytes compared lie within the stored word)
        if long.size:
            ll, stored = lengths[long], entry[long]
            if not np.array_equal(self.word_len[stored], ll):
                return None
            total = int(ll.sum())
            if not np.array_equal(self.word_pool[_ranges(self.word_off[stored], ll, total)],
                                  b[_ranges(starts[long], ll, total)]):
                return None
        n_ids = self.ids_len[entry]
        if is_special is not None:
            n_ids[is_special] = 1
        ids = self.ids_pool[_ranges(self.ids_off[entry], n_ids, int(n_ids.sum()))]
        if is_special is None and not cuts:
            return [ids]
        first_id = np.cumsum(n_ids) - n_ids
        if is_special is not None:
            ids[first_id[is_special]] = [i for _, _, i in specials]
        if not cuts:
            return [ids]
        at = np.searchsorted(starts, cuts)
        if (at >= len(starts)).any() or not np.array_equal(starts[at], cuts):
            return None
        return np.split(ids, first_id[at])


def _joined(words: list[bytes], at: np.ndarray) -> np.ndarray:
    """The bytes of ``words[i]`` for each ``i`` in ``at``, one after another."""
    return np.frombuffer(b"".join([words[i] for i in at.tolist()]), dtype=np.uint8)


class BatchBPE:
    """The merges applied to many pre-tokens at once, with numpy: the same ids as applying them
    to each alone (repeatedly merge the leftmost adjacent pair of lowest rank).

    Words of similar length go through together as the rows of a matrix of ids. Every row that
    can still merge does so once per round (at its leftmost pair of lowest rank: ``argmin``
    takes the first of equal values), so all the matrix's rows shrink by one column a round;
    a row that can merge no more leaves. Shorter words are padded with -1, which pairs with
    nothing. Groups too small to repay numpy's per-call cost, and the longest words, go to
    ``bpe_one``, the plain Python form.

    Args:
        byte_ids: the id of each byte (256 ints).
        ranks: ``left id << shift | right id`` -> ``rank << shift | merged id`` for every merge.
        bpe_one: one pre-token's bytes -> its ids.
        max_len: longer pre-tokens go to ``bpe_one``.
        shift: the bits of ``ranks``' low part (16 or 32: ``Tokenizer._pair_ranks``); the table
            holds them with 32.
    """

    _GROUPS = ((2, 4), (5, 8), (9, 16), (17, 32))  # lengths padded to the group's largest
    MIN_ROWS = 256  # smaller groups go to bpe_one: below about this, numpy's per-call cost outweighs

    def __init__(self, byte_ids: list[int], ranks: dict[int, int], bpe_one: Callable[[bytes], list[int]],
                 max_len: int = 32, shift: int = 32):
        self.byte_ids = np.array(byte_ids, dtype=np.int64)
        # pair key + 1 (a pair of ids 0 and 0 is key 0, the table's empty slot) -> rank << 32 | merged id,
        # the table at most 1/4 full, so that most lookups take one probe
        keys = np.fromiter(ranks.keys(), dtype=np.uint64, count=len(ranks))
        values = np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks))
        if shift != 32:
            keys = keys >> np.uint64(shift) << np.uint64(32) | keys & np.uint64((1 << shift) - 1)
            values = values >> shift << 32 | values & ((1 << shift) - 1)
        keys += np.uint64(1)
        self.table = _OpenTable(1 << max(4, (4 * len(keys)).bit_length()), _NO_MERGE)
        self.table.insert(keys, values)
        self.bpe_one = bpe_one
        self.max_len = max_len

    def _rank(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """``rank << 32 | merged id`` of each pair, or ``_NO_MERGE``; a -1 (padding) pairs with nothing."""
        q = (left << 32 | right) + 1
        q[(left < 0) | (right < 0)] = 0  # no key: the table's value for it is _NO_MERGE
        return self.table.find(q.reshape(-1).astype(np.uint64)).reshape(q.shape)

    def __call__(self, words: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of every word, flat (``uint32``), and how many each word has."""
        n_words = len(words)
        if n_words < self.MIN_ROWS:  # no group can be large enough
            ids = [self.bpe_one(w) for w in words]
            return (np.fromiter((i for x in ids for i in x), dtype=np.uint32),
                    np.fromiter(map(len, ids), dtype=np.int64, count=n_words))
        lengths = np.fromiter(map(len, words), dtype=np.int64, count=n_words)
        done: list[tuple[np.ndarray, np.ndarray]] = []  # (word indices, their ids as matrix rows)
        n_ids = lengths.copy()
        alone = np.ones(n_words, dtype=bool)
        one = lengths == 1
        if one.any():
            at = np.flatnonzero(one)
            done.append((at, self.byte_ids[_joined(words, at)][:, None]))
            alone[at] = False
        for lo, hi in self._GROUPS:
            if hi > self.max_len:
                break
            at = np.flatnonzero((lengths >= lo) & (lengths <= hi))
            if len(at) < self.MIN_ROWS:
                continue
            alone[at] = False
            self._group(words, at, lengths[at], hi, done, n_ids)
        rest = np.flatnonzero(alone).tolist()
        rest_ids = [self.bpe_one(words[i]) for i in rest]
        for i, ids in zip(rest, rest_ids):
            n_ids[i] = len(ids)
        offsets = np.cumsum(n_ids) - n_ids
        flat = np.empty(int(n_ids.sum()), dtype=np.uint32)
        for at, mat in done:
            real = mat >= 0  # a row's padding (-1) follows its ids
            flat[(offsets[at][:, None] + np.arange(mat.shape[1]))[real]] = mat[real]
        if rest:
            flat[_ranges(offsets[rest], n_ids[rest], int(n_ids[rest].sum()))] = [i for ids in rest_ids for i in ids]
        return flat, n_ids

    def _group(self, words: list[bytes], at: np.ndarray, lengths: np.ndarray, width: int,
               done: list[tuple[np.ndarray, np.ndarray]], n_ids: np.ndarray) -> None:
        """Merge the words ``at`` (of ``lengths``, at most ``width``) to the end; record their ids."""
        raw = np.zeros((len(at), width), dtype=np.uint8)
        raw[np.arange(width) < lengths[:, None]] = _joined(words, at)
        ids = self.byte_ids[raw]
        ids[np.arange(width) >= lengths[:, None]] = -1
        rank = self._rank(ids[:, :-1], ids[:, 1:])
        real = lengths.copy()  # symbols per row
        while True:
            rows = np.arange(len(at))
            if rank.shape[1]:
                pos = rank.argmin(axis=1)
                best = rank[rows, pos]
                finished = best == _NO_MERGE
            else:  # one symbol left in every row
                finished = np.ones(len(at), dtype=bool)
            if finished.any():
                f = np.flatnonzero(finished)
                n_ids[at[f]] = real[f]
                done.append((at[f], ids[f]))  # with their padding (-1)
                if f.size == len(at):
                    return
                keep = np.flatnonzero(~finished)
                at, ids, rank, pos, best, real = at[keep], ids[keep], rank[keep], pos[keep], best[keep], real[keep]
                rows = np.arange(len(at))
            # merge each row's pair at pos: drop column pos + 1 of ids and column pos of rank
            w = ids.shape[1]
            ids[rows, pos] = best & 0xFFFFFFFF
            cols = np.arange(w - 1)
            ids = np.take_along_axis(ids, cols + (cols > pos[:, None]), axis=1)
            rank = np.take_along_axis(rank, cols[:-1] + (cols[:-1] >= pos[:, None]), axis=1)
            real -= 1
            # the pairs on either side of the merged symbol are new
            r, p = rows[pos > 0], pos[pos > 0]
            rank[r, p - 1] = self._rank(ids[r, p - 1], ids[r, p])
            r, p = rows[pos < w - 2], pos[pos < w - 2]
            rank[r, p] = self._rank(ids[r, p], ids[r, p + 1])

r"""Encoding without a Python step per pre-token: the GPT-2 pre-tokens of plain text found with
numpy, and their ids looked up in a hash table held in numpy arrays.

This is the fast path of :class:`lm.tokenizer.Tokenizer` for text whose characters are ASCII or
common punctuation (``pretokenize._SAFE_NON_ASCII``), which is what English corpora mostly hold.
On that text the GPT-2 pattern reduces to rules about classes of bytes — letters, digits, space,
other whitespace, anything else — that numpy applies to a whole chunk at once
(:func:`pretoken_starts`, tested equal to the regex). Each pre-token is then hashed from its bytes,
looked up, and checked byte for byte against the word stored with the entry, so a hash collision
cannot give wrong ids (the caller falls back to the regex path). Pre-tokens not yet in the table
get their ids from the tokenizer's BPE, one Python call per distinct new word.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# byte classes
_LETTER, _DIGIT, _OTHER, _SPACE, _WS, _SPECIAL = 0, 1, 2, 3, 4, 5
_CLASS = np.full(256, _OTHER, dtype=np.uint8)  # bytes >= 0x80 are parts of punctuation on this path
_CLASS[ord("a") : ord("z") + 1] = _LETTER
_CLASS[ord("A") : ord("Z") + 1] = _LETTER
_CLASS[ord("0") : ord("9") + 1] = _DIGIT
_CLASS[ord(" ")] = _SPACE
for _c in "\t\n\x0b\x0c\r":
    _CLASS[ord(_c)] = _WS
_APOSTROPHE = ord("'")
# second (and third) letters of the contractions '(?:[sdmt]|ll|ve|re)
_ONE_LETTER_CONTRACTION = np.zeros(256, dtype=bool)
_ONE_LETTER_CONTRACTION[[ord(c) for c in "sdmt"]] = True
_TWO_LETTER_CONTRACTIONS = {(ord("l"), ord("l")), (ord("v"), ord("e")), (ord("r"), ord("e"))}


def pretoken_starts(
    b: np.ndarray, special: np.ndarray | None = None, special_starts: np.ndarray | None = None
) -> np.ndarray:
    r"""Offsets where the GPT-2 pre-tokens of the UTF-8 bytes ``b`` start.

    ``b`` must hold only ASCII and the punctuation of ``_SAFE_NON_ASCII`` (whose bytes all count
    as "other"). ``special``, if given, marks the bytes of special tokens and ``special_starts``
    holds where each of them starts: around them the text is pre-tokenized as if they cut it
    into separate texts.
    """
    n = len(b)
    if n == 0:
        return np.zeros(0, dtype=np.intp)
    c = _CLASS[b]
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
    if n > 2:
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


# random 64-bit values per (position in the token mod 64, byte): a pre-token's hash is their sum
_HASH_TABLE = np.random.default_rng(0x6C6D).integers(1, 2**63, size=64 * 256, dtype=np.uint64)
_LEN_MIX = np.uint64(0x9E3779B97F4A7C15)


def _ranges(offsets: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
    """``concatenate([arange(o, o + n) for o, n in zip(offsets, lengths)])`` for lengths >= 1,
    as one cumulative sum: steps of 1, and a jump where each range begins."""
    step = np.ones(total, dtype=np.intp)
    begin = np.cumsum(lengths) - lengths
    step[0] = offsets[0]
    step[begin[1:]] = offsets[1:] - offsets[:-1] - lengths[:-1] + 1
    return np.cumsum(step, out=step)


def _hash_tokens(b: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    idx = _ranges(np.zeros(len(starts), dtype=np.intp), lengths, len(b))  # position in the token
    idx &= 63
    idx <<= 8
    idx |= b
    h = np.add.reduceat(_HASH_TABLE[idx], starts)
    h ^= lengths.astype(np.uint64) * _LEN_MIX
    h |= np.uint64(1)  # 0 marks an empty slot
    return h


class HashedEncoder:
    """Maps pre-tokens to ids through a numpy hash table; grows by running ``bpe`` on new words.

    Args:
        bpe: a pre-token's UTF-8 bytes -> its token ids.
        limit: number of distinct pre-tokens after which the table starts again empty, so
            memory stays bounded on an endless stream.
    """

    def __init__(self, bpe: Callable[[bytes], list[int]], limit: int):
        self.bpe = bpe
        self.limit = limit
        self.clear()

    def clear(self) -> None:
        self.keys = np.zeros(1 << 16, dtype=np.uint64)  # open addressing, linear probing
        self.slot_entry = np.zeros(1 << 16, dtype=np.int64)
        self.entries = 0  # distinct pre-tokens held
        self.ids_off = np.zeros(1 << 12, dtype=np.int64)  # entry -> its ids in ids_pool
        self.ids_len = np.zeros(1 << 12, dtype=np.int64)
        self.word_off = np.zeros(1 << 12, dtype=np.int64)  # entry -> its bytes in word_pool
        self.word_len = np.zeros(1 << 12, dtype=np.int64)
        self.ids_pool = np.zeros(1 << 14, dtype=np.uint32)
        self.word_pool = np.zeros(1 << 16, dtype=np.uint8)
        self.ids_used = self.words_used = 0

    def _find(self, h: np.ndarray) -> np.ndarray:
        """Entry of each hash, or -1."""
        keys, mask = self.keys, len(self.keys) - 1
        out = np.full(len(h), -1, dtype=np.int64)
        todo = np.arange(len(h))
        slot = (h >> np.uint64(17)).astype(np.int64) & mask
        hh = h
        while todo.size:
            k = keys[slot]
            hit = k == hh
            out[todo[hit]] = self.slot_entry[slot[hit]]
            more = ~hit & (k != 0)
            todo, slot, hh = todo[more], (slot[more] + 1) & mask, hh[more]
        return out

    def _insert_slots(self, h: np.ndarray, entries: np.ndarray) -> None:
        keys, mask = self.keys, len(self.keys) - 1
        slot = (h >> np.uint64(17)).astype(np.int64) & mask
        while h.size:
            # each free slot takes the first key that wants it; the others probe on
            free = keys[slot] == 0
            first = np.zeros(len(h), dtype=bool)
            _, idx = np.unique(slot[free], return_index=True)
            first[np.flatnonzero(free)[idx]] = True
            keys[slot[first]] = h[first]
            self.slot_entry[slot[first]] = entries[first]
            rest = ~first
            h, entries, slot = h[rest], entries[rest], (slot[rest] + 1) & mask

    def _add(self, words: list[bytes], h: np.ndarray) -> None:
        """Add new pre-tokens (distinct, not in the table) with their hashes."""
        ids = list(map(self.bpe, words))
        n_ids = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        n_bytes = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        flat_ids = np.fromiter((i for x in ids for i in x), dtype=np.uint32, count=int(n_ids.sum()))
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
        if 2 * self.entries > len(self.keys):  # keep the load under 1/2: rebuild twice as large
            size = len(self.keys)
            while 2 * self.entries > size:
                size *= 2
            old_keys, old_entries = self.keys, self.slot_entry
            used = old_keys != 0
            self.keys = np.zeros(size, dtype=np.uint64)
            self.slot_entry = np.zeros(size, dtype=np.int64)
            self._insert_slots(old_keys[used], old_entries[used])
        self._insert_slots(h, np.arange(e0, e1, dtype=np.int64))

    def encode(self, data: bytes, specials: list[tuple[int, int, int]] = ()) -> np.ndarray | None:
        """The ids of ``data`` (UTF-8 of text fit for this path) as ``uint32``, or None on a hash collision.

        ``specials`` lists (start, end, id) of special tokens in ``data``, in order.
        """
        b = np.frombuffer(data, dtype=np.uint8)
        if len(b) == 0:
            return np.zeros(0, dtype=np.uint32)
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
        h = _hash_tokens(b, starts, lengths)
        entry = self._find(h)
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
            entry[miss] = self._find(h[miss])
        if is_special is not None:
            entry[is_special] = 0  # placeholder: checked and filled below
        # check every pre-token against the bytes stored with its entry
        same = self.word_pool[_ranges(self.word_off[entry], lengths, len(b))] == b
        if is_special is not None:
            same |= mask
            lengths = np.where(is_special, self.word_len[entry], lengths)
        if not same.all() or not np.array_equal(self.word_len[entry], lengths):
            return None
        n_ids = self.ids_len[entry]
        if is_special is not None:
            n_ids[is_special] = 1
        ids = self.ids_pool[_ranges(self.ids_off[entry], n_ids, int(n_ids.sum()))]
        if is_special is not None:
            first_id = np.cumsum(n_ids) - n_ids
            ids[first_id[is_special]] = [i for _, _, i in specials]
        return ids

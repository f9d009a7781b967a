r"""Pre-tokenization: split out special tokens, then cut text with the GPT-2 regex.

BPE merges never cross a pre-token boundary, so everything downstream works on
pre-tokens. This module also knows where a text can be cut so that no pre-token or
special token crosses the cut: at the start of a special token, or at the start of a
whitespace run that holds a newline and follows a character that is not whitespace
(see :func:`find_safe_cut` for why). (A cut *after* a newline is not safe: in "a  \nb" the
run "  \n" splits as "  ", "\n", but at the end of a chunk it would stay whole.)
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import regex

# The pattern of GPT-2 (and tiktoken's "gpt2" encoding).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_REGEX = regex.compile(GPT2_PATTERN)

# The same pattern restricted to Latin-1 text (ASCII and U+0080-U+00FF: English, German, French,
# Spanish...), whose letters, numbers and spaces it spells out: \p{L} is [A-Za-zªµºÀ-ÖØ-öø-ÿ], \p{N}
# is [0-9²³¹¼-¾] and the `regex` module's \s is [\t\n\v\f\r \x85\xa0] (a test checks each class
# against the Unicode pattern's, character by character). The standard library's engine runs it
# faster than `regex` runs the Unicode pattern (Multi30k's German sentences: 2.5 µs a call, against
# 3.8 when only ASCII took this path; docs/benchmarks.md); `pretokenize` uses it on plain stretches.
_WS = r"\t\n\x0b\x0c\r \x85\xa0"
_LETTERS = r"A-Za-z\xaa\xb5\xba\xc0-\xd6\xd8-\xf6\xf8-\xff"
_NUMBERS = r"0-9\xb2\xb3\xb9\xbc-\xbe"
GPT2_PLAIN_REGEX = re.compile(
    rf"""'(?:[sdmt]|ll|ve|re)| ?[{_LETTERS}]+| ?[{_NUMBERS}]+| ?[^{_WS}{_LETTERS}{_NUMBERS}]+"""
    rf"""|[{_WS}]+(?![^{_WS}])|[{_WS}]+"""
)
# Common punctuation and symbols above Latin-1: none is a letter, number or space, so the plain
# pattern (whose "other" class is a negated one) already treats them as the Unicode one does.
_SAFE_NON_ASCII = "‘’‚“”„–—―…‹›•†‡′″™€"
# A character that only the Unicode pattern classifies correctly.
_NOT_PLAIN = re.compile(f"[^\\x00-\\xff{_SAFE_NON_ASCII}]")


@functools.cache
def _fast_patterns() -> tuple[re.Pattern, re.Pattern, Callable[[str], object]]:
    """``(other, safe_newline, cut_after)``, built on first use from the classes of the BMP:

    - ``other`` finds a character the vectorised encoder (:mod:`lm.tokenizer.vectorized`) cannot
      take: a lone surrogate, which UTF-8 cannot encode. It takes every other character (accented
      Latin letters, Greek, Cyrillic, Hebrew, Arabic, Devanagari, Thai, CJK, emoji, the Unicode
      spaces...), each classed from a table.
    - ``safe_newline`` finds a safe cut: the start of a whitespace run that ends a line ("\\n",
      "\\r\\n", "  \\n") after a character that is not whitespace (see :func:`find_safe_cut`):
      printable ASCII or a character above it other than the whitespace (U+0085, U+00A0, U+1680,
      U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000); ``cut_after`` tells such a character.
    """
    from lm.tokenizer.vectorized import non_ascii_spaces

    excluded = {*non_ascii_spaces(), *range(0xD800, 0xE000)}
    body, lo = [], 0x80
    for cp in [*sorted(excluded), 0x110000]:
        if cp > lo:
            body.append(f"\\U{lo:08x}-\\U{cp - 1:08x}")
        lo = cp + 1
    non_space = "".join(body)
    return (re.compile("[\\ud800-\\udfff]"),
            re.compile(f"(?<=[!-~{non_space}])[\\t\\x0b\\x0c\\r ]*\\n"),
            re.compile(f"[!-~{non_space}]").fullmatch)


_LINE_SPACE = "\t\x0b\x0c\r "
# a stretch that is not plain is extended over plain gaps shorter than this, to keep calls few
_PLAIN_GAP = 512
# a text shorter than this that is not plain goes through the Unicode pattern whole: cutting it into
# stretches costs more than the plain pattern saves (measured when plain was ASCII, on German
# sentences: 3.0 against 5.2 µs at 64 characters, 22 against 29 at 512; English with a rare accent:
# 20 against 25 at 256, but 85 against 71 at 1,024; docs/benchmarks.md)
_SHORT_UNICODE = 512


def is_plain(text: str, fast: bool = False) -> bool:
    """Whether ``text`` holds only Latin-1 and common punctuation (see :func:`plain_stretches`);
    with ``fast``, any characters but lone surrogates."""
    return text.isascii() or (_fast_patterns()[0] if fast else _NOT_PLAIN).search(text) is None


def plain_stretches(text: str, max_plain: int | None = None, fast: bool = False) -> Iterator[tuple[bool, int, int]]:
    r"""Cut ``text`` into stretches ``(plain, start, end)`` at safe cuts.

    A plain stretch holds only Latin-1 and common punctuation (``_SAFE_NON_ASCII``), what the
    plain form of the pattern (``GPT2_PLAIN_REGEX``) classifies correctly; with ``fast``, what the vectorised encoder
    takes: every character but a lone surrogate (:func:`_fast_patterns`). The
    other stretches hold the characters that only the Unicode pattern classifies correctly
    (short plain gaps between them are kept with them, to keep the stretches few). With
    ``max_plain``, a plain stretch longer than that is cut further, at the first safe cut after
    each ``max_plain`` characters (where there is one).

    >>> list(plain_stretches("Hello.\nΚαφές\nbye"))
    [(True, 0, 6), (False, 6, 12), (True, 12, 16)]
    >>> list(plain_stretches("Hello.\ncafé 東京 🙂\n\u3000ok \ud83d\nbye", fast=True))  # half an emoji
    [(True, 0, 16), (False, 16, 26)]
    """
    if max_plain is not None:
        for plain, a, b in plain_stretches(text, fast=fast):
            while plain and b - a > max_plain:
                m = _fast_patterns()[1].search(text, a + max_plain, b)
                if m is None:
                    break
                yield True, a, m.start()
                a = m.start()
            yield plain, a, b
        return
    if is_plain(text, fast):
        if text:
            yield True, 0, len(text)
        return
    fast_other, safe_newline, cut_after = _fast_patterns()
    other = fast_other if fast else _NOT_PLAIN
    pos, n = 0, len(text)
    while pos < n:
        m = other.search(text, pos)
        if m is None:
            yield True, pos, n
            return
        s = m.start()
        # the last safe cut before the first character that is not plain
        cut = pos
        i = text.rfind("\n", pos + 1, s)
        while i > pos:
            j = i
            while j > pos and text[j - 1] in _LINE_SPACE:  # back to the start of the line end's run
                j -= 1
            if j > pos and cut_after(text[j - 1]):
                cut = j
                break
            i = text.rfind("\n", pos + 1, j)
        if cut > pos:
            yield True, pos, cut
        # the first safe cut after it, skipping over short plain gaps
        end = s
        while True:
            nl = safe_newline.search(text, end + 1)
            stop = nl.start() if nl is not None else n
            nxt = other.search(text, stop, stop + _PLAIN_GAP)
            if nxt is None:
                break
            end = nxt.start()
        yield False, cut, stop
        pos = stop


def pretokenize(text: str) -> list[str]:
    r"""The GPT-2 pre-tokens of ``text`` (exactly ``GPT2_REGEX.findall(text)``), faster.

    Plain stretches (Latin-1 and common punctuation, see :func:`plain_stretches`) go through the
    standard library's ``re`` with the Latin-1 form of the pattern; stretches that hold other
    characters go through the Unicode pattern.

    >>> pretokenize("Hello world's  café\n")
    ['Hello', ' world', "'s", ' ', ' café', '\n']
    """
    if is_plain(text):
        return GPT2_PLAIN_REGEX.findall(text)
    if len(text) < _SHORT_UNICODE:
        return GPT2_REGEX.findall(text)
    out: list[str] = []
    for plain, a, b in plain_stretches(text):
        out += (GPT2_PLAIN_REGEX if plain else GPT2_REGEX).findall(text, a, b)
    return out


def special_tokens_regex(special_tokens: Iterable[str], *, as_bytes: bool = False) -> regex.Pattern | None:
    """A regex matching any special token; where two overlap, the longest wins.

    ``as_bytes`` gives the same pattern over UTF-8 bytes, for searching encoded text.

    >>> special_tokens_regex(["<a>", "<a><b>"]).findall("x<a><b>y<a>")
    ['<a><b>', '<a>']
    """
    toks = sorted(set(special_tokens), key=lambda t: (-len(t), t))
    if not toks:
        return None
    # one capturing group, so that ``split`` keeps the special tokens
    if as_bytes:
        return regex.compile(b"(" + b"|".join(regex.escape(t.encode("utf-8")) for t in toks) + b")")
    return regex.compile("(" + "|".join(regex.escape(t) for t in toks) + ")")


def check_special_tokens(special_tokens: Sequence[str] | None) -> list[str]:
    """Validate a list of special tokens: strings, non-empty, no duplicates.

    A string itself is refused, not read as a list of one-character tokens."""
    if isinstance(special_tokens, (str, bytes, bytearray)):
        kind = "string" if isinstance(special_tokens, str) else "bytes"
        raise ValueError(f"special_tokens: expected a list of strings, got the {kind} {special_tokens!r}")
    toks = list(special_tokens or [])
    seen: set[str] = set()
    for t in toks:
        if not isinstance(t, str) or not t:
            raise ValueError(f"special_tokens: each special token must be a non-empty string, got {t!r}")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"special_tokens: {t!r} is not valid Unicode text (it holds a lone surrogate)") from None
        if t in seen:
            raise ValueError(f"special_tokens: duplicate special token {t!r}")
        seen.add(t)
    return toks


def split_on_special(text: str, special_re: regex.Pattern | None) -> list[str]:
    """Split ``text`` into segments; special tokens come out as their own segments (odd positions)."""
    if special_re is None:
        return [text]
    return special_re.split(text)


# ---------------------------------------------------------------- cutting files into chunks

# The characters that the GPT-2 pattern's \s matches: the `regex` module's White_Space (not
# str.isspace, which adds \x1c-\x1f: those are "other" characters to the pattern). A test checks
# this list against the pattern's \s over every code point.
_WHITESPACE_CHARS = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
# A run of those characters in UTF-8, whole characters at a time (ASCII ones in a tight loop); and
# the same run read backwards, over the reversed bytes. Every character starts with an ASCII or a
# lead byte, never a continuation byte, so wherever a match starts it is a run of whole characters,
# also in a text that holds invalid UTF-8 (the decoder starts a new character at every such byte).
_ASCII_WS = bytes(c for c in map(ord, _WHITESPACE_CHARS) if c < 0x80)
_WIDE_WS = [c.encode() for c in _WHITESPACE_CHARS if ord(c) >= 0x80]
_WS_RUN = re.compile(b"(?:[%s]+|%s)*" % (re.escape(_ASCII_WS), b"|".join(map(re.escape, _WIDE_WS))))
_WS_RUN_REVERSED = re.compile(
    b"(?:[%s]+|%s)*" % (re.escape(_ASCII_WS), b"|".join(re.escape(c[::-1]) for c in _WIDE_WS)))
_ASCII_TEXT = frozenset(range(0x80)) - frozenset(_ASCII_WS)  # an ASCII character that is not whitespace
_WS_LAST_BYTES = frozenset(c.encode()[-1] for c in _WHITESPACE_CHARS)  # the byte a whitespace character ends with
_WS_CHAR = regex.compile(r"\s")


def _char_before(buf: bytes, i: int) -> str | None:
    """The character whose UTF-8 bytes end just before ``buf[i]``, or None when they are not valid UTF-8."""
    for k in range(1, 5):  # back to the nearest byte that is not a continuation byte (10xxxxxx)
        if i - k < 0:
            return None
        lead = buf[i - k]
        if lead & 0xC0 != 0x80:
            # the length that the lead byte announces (0: never valid)
            n = 1 if lead < 0x80 else 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else \
                4 if 0xF0 <= lead <= 0xF4 else 0
            if n != k:
                return None
            try:  # an overlong form or a surrogate is still refused here
                return buf[i - k : i].decode("utf-8")
            except UnicodeDecodeError:
                return None
    return None


def find_safe_cut(buf: bytes, specials: Sequence[bytes], start: int = 0) -> int:
    r"""Index in ``buf``, at or after ``start``, where a text may be cut with no token crossing it, or -1.

    Prefers the start of a special token (a document boundary); otherwise the start of the first
    whitespace run that holds a ``\n`` and follows a character that is not whitespace (a line end:
    before "\n", "\r\n", " \n" after "。"...). The newline rule is off when a special token holds a
    newline. ``buf[:start]`` is context for the search: the bytes just before ``start`` (at least 4,
    and as many as the longest special token, less one), or all of them.

    >>> find_safe_cut(b"ab  \ncd\nef", [])
    2
    >>> find_safe_cut(b"xx<a><b>yy<b>", [b"<a>", b"<a><b>", b"<b>"], start=4)  # not inside "<a><b>"
    10
    """
    special_re = _special_bytes_regex(tuple(specials))
    floor = start
    if special_re is not None:
        # Special tokens may overlap ("<a>" and "<a><b>", "ab" and "bc"), so an occurrence at or
        # after ``start`` may lie inside the one that ``encode``, matching from the beginning of
        # the text, takes. Search instead from the first position no occurrence straddles: that
        # scan of the whole text is between two matches there, and goes on as a scan from there.
        longest = max(map(len, specials))
        resync = start
        for m in special_re.finditer(buf, max(0, start - longest + 1), overlapped=True):
            if m.start() >= resync:
                break
            resync = max(resync, m.end())
        m = special_re.search(buf, resync)
        if m is not None:
            return m.start()
        if any(b"\n" in s for s in specials):
            return -1
        # No occurrence starts at or after ``resync``, and every one before it ends by then: no
        # special token straddles a cut at or after ``resync``.
        floor = resync
    # Why the start of a whitespace run that follows a non-whitespace character c is safe: the
    # GPT-2 pattern has no look-behind, so the pre-tokens from the cut on are those of the text after
    # it alone. Before the cut, no pre-token reaches past c: only its whitespace alternatives take a
    # whitespace character other than a first optional " ", and those take nothing but whitespace,
    # so they cannot hold c too. And none of them is decided by what lies past c: the one look-ahead,
    # (?!\S), is only tried after whitespace, so before c; every other alternative fails on the
    # whitespace after c as it fails at the end of the text. (Special tokens are split off first;
    # none straddles the cut, see above.) The cut is also a boundary of the UTF-8 decoder (the run
    # starts with an ASCII or lead byte), and c is checked to be a whole, valid character, so the
    # two halves decode to the text of the whole.
    #
    # The work is per "\n" (found at C speed), never per byte: each run is read backwards to its
    # start once, and when it is no cut, forwards to its end, to skip its other newlines.
    i = buf.find(b"\n", max(floor, 1))
    reversed_buf = None
    while i != -1:
        if buf[i - 1] in _ASCII_TEXT:  # the common case, "\n" after ASCII text: the run starts at the "\n"
            return i
        cut = i
        if buf[i - 1] in _WS_LAST_BYTES:  # it may start earlier: back, whole whitespace characters at a time
            if reversed_buf is None:
                reversed_buf = buf[::-1]
            r = len(buf) - 1 - i  # the "\n" in reversed_buf
            cut = i + 1 - (_WS_RUN_REVERSED.match(reversed_buf, r).end() - r)
        if cut >= max(floor, 1):
            c = _char_before(buf, cut)
            if c is not None and not _WS_CHAR.match(c):
                return cut
        # no cut in this run (it starts too early, or after invalid UTF-8): on past its end
        i = buf.find(b"\n", _WS_RUN.match(buf, i).end())
    return -1


@functools.lru_cache(maxsize=16)
def _special_bytes_regex(specials: tuple[bytes, ...]) -> regex.Pattern | None:
    """:func:`special_tokens_regex` over bytes (longest first, as ``encode`` matches them)."""
    return special_tokens_regex([s.decode("utf-8") for s in specials], as_bytes=True)


def next_safe_cut(f, pos: int, end: int, specials: Sequence[bytes], search_block: int = 1 << 16) -> int:
    """The first safe cut at or after ``pos`` (and before ``end``) in the open binary file ``f``, or -1."""
    longest = max((len(s) for s in specials), default=1)
    scan = pos
    while scan < end:
        # read a little before the block (a special token that straddles its start, the character
        # before a line end) and a little past it (a special token on its end), so that every special
        # token near the block is seen whole
        back = min(max(longest - 1, 4), scan)
        f.seek(scan - back)
        buf = f.read(back + min(search_block, end - scan))
        if len(buf) <= back:
            break
        j = find_safe_cut(buf + f.read(longest), specials, back)
        if j != -1 and j < len(buf):
            return scan - back + j
        scan += len(buf) - back
    return -1


# A chunk this long (and 16 times the chunk target) draws a warning: the text had no safe cut (a line
# end or a special token) for that long, and a process holds it whole, several times over, while it
# pre-tokenizes or encodes it.
LONG_CHUNK_BYTES = 1 << 24


def warn_long_chunk(path: str | os.PathLike, bounds: Sequence[tuple[int, int]], chunk_bytes: int, doing: str,
                    limit: int = LONG_CHUNK_BYTES) -> None:
    """Warn once when the longest of ``bounds`` (from :func:`chunk_boundaries`) is over
    ``max(16 * chunk_bytes, limit)``: text with no safe cut for that long is ``doing`` in one piece."""
    import warnings

    if not bounds:
        return
    a, b = max(bounds, key=lambda r: r[1] - r[0])
    if b - a > max(16 * chunk_bytes, limit):
        warnings.warn(f"input: in {str(path)!r}, the {b - a:,} bytes from byte {a:,} hold no line end or document "
                      f"boundary past their first {chunk_bytes:,} to cut at: they are {doing} in one piece, in memory",
                      stacklevel=3)


def chunk_boundaries(
    path: str | os.PathLike,
    specials: Sequence[str],
    target_chunk_bytes: int,
    start: int = 0,
    end: int | None = None,
) -> list[tuple[int, int]]:
    r"""Cut the byte range ``[start, end)`` of a file into chunks of about ``target_chunk_bytes``.

    Every cut is a safe cut (see :func:`find_safe_cut`), so pre-tokenizing the chunks
    separately gives exactly the pre-tokens of the whole range. A range with no safe cut
    comes back as one chunk.
    """
    size = os.path.getsize(path)
    end = size if end is None else min(end, size)
    specials_b = [s.encode("utf-8") for s in specials]
    cuts = [start]
    with open(path, "rb") as f:
        pos = start + target_chunk_bytes
        while pos < end:
            found = next_safe_cut(f, pos, end, specials_b)
            if found == -1:
                break
            if found > cuts[-1]:
                cuts.append(found)
            pos = cuts[-1] + target_chunk_bytes
    cuts.append(end)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

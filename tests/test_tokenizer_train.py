"""The fast BPE trainer against a brute-force one, and its pre-tokenization pieces."""

import re
from collections import Counter
from unittest import mock

import pytest
import regex
from helpers.counting import count_heap_ops
from helpers.data import GPT2_ENCODER_PY_PATTERN, gpt2_published_pattern
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lm.tokenizer.pretokenize as pretokenize_mod
import lm.tokenizer.train as train_mod
from lm.io import decode_utf8
from lm.tokenizer import train_bpe
from lm.tokenizer.pretokenize import chunk_boundaries, find_safe_cut, next_safe_cut, pretokenize
from lm.tokenizer.train import count_pretokens, merge_counts

REFERENCE_REGEX = regex.compile(gpt2_published_pattern())  # not lm's GPT2_PATTERN


def brute_force_bpe(text: str, vocab_size: int, special_tokens: list[str]):
    """BPE as defined: recount every pair of every word before each merge."""
    if special_tokens:
        alternation = "|".join(regex.escape(t) for t in sorted(special_tokens, key=len, reverse=True))
        segments = regex.split(alternation, text)
    else:
        segments = [text]
    words = Counter()
    for seg in segments:
        for w in REFERENCE_REGEX.findall(seg):
            words[tuple(bytes([b]) for b in w.encode("utf-8"))] += 1
    vocab = [t.encode() for t in special_tokens] + [bytes([i]) for i in range(256)]
    merges = []
    while len(vocab) < vocab_size:
        pairs = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        vocab.append(best[0] + best[1])
        new_words = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return dict(enumerate(vocab)), merges


# Small alphabets make many ties and repeated pairs; the specials overlap on purpose.
corpus_text = st.lists(st.sampled_from(list("aab  bc\n.'sé😀") + ["<|x|>", "<|x|><|y|>", "<|y|>"]), max_size=300).map(
    "".join
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=corpus_text, extra=st.integers(0, 40), use_specials=st.booleans())
def test_fast_trainer_matches_brute_force(tmp_path, text, extra, use_specials):
    specials = ["<|x|>", "<|x|><|y|>"] if use_specials else []
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    vocab_size = 256 + len(specials) + extra
    if not text:
        with pytest.raises(ValueError, match="empty"):
            train_bpe(path, vocab_size, specials, num_workers=1)
        return
    vocab, merges = train_bpe(path, vocab_size, specials, num_workers=1)
    ref_vocab, ref_merges = brute_force_bpe(text, vocab_size, specials)
    assert merges == ref_merges
    assert vocab == ref_vocab


def test_ids_order_and_specials_never_merged(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("low lower<|endoftext|>lowest newest<|endoftext|>widest " * 50, encoding="utf-8")
    vocab, merges = train_bpe(path, 300, ["<|endoftext|>"])
    assert vocab[0] == b"<|endoftext|>"
    assert [vocab[i] for i in range(1, 257)] == [bytes([i]) for i in range(256)]
    assert [vocab[257 + k] for k in range(len(merges))] == [a + b for a, b in merges]
    assert not any(b"<|" in a + b and b"|>" in a + b for a, b in merges)


def test_count_pretokens_refuses_a_string_as_special_tokens(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("hello there<eos>", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^special_tokens: expected a list of strings, got the string '<eos>'$"):
        count_pretokens([(str(path), 0, path.stat().st_size)], "<eos>", num_workers=1)
    assert count_pretokens([(str(path), 0, path.stat().st_size)], ["<eos>"], num_workers=1) == {"hello": 1,
                                                                                                 " there": 1}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=6), st.binary(max_size=6))
def test_the_heap_key_orders_tokens_the_other_way_round(x, y):
    """merge_counts's heap breaks ties with this key: the greater token must come first, also where one
    token starts the other (b"a" < b"ab")."""
    kx, ky = train_mod._reversed_key(x), train_mod._reversed_key(y)
    assert (x < y) == (kx > ky) and (x == y) == (kx == ky)
    assert train_mod._reversed_key(x + y) == kx[:-1] + ky  # a merged token's key, as _PairIndex makes it


def test_many_tied_pairs_merge_like_brute_force(tmp_path):
    """Distinct words, each once: most merges are ties at a low count, broken to the greater pair of bytes."""
    import random

    rng = random.Random(0)
    text = " ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 7))) for _ in range(300))
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(path, 256 + 700, [], num_workers=1)
    ref_vocab, ref_merges = brute_force_bpe(text, 256 + 700, [])
    assert len(merges) > 500 and merges == ref_merges and vocab == ref_vocab


def test_ties_do_not_make_merging_quadratic(monkeypatch):
    """The heap popped every pair tied at the top count on each merge (and pushed all but one back):
    late merges on a small corpus, where thousands of pairs tie at a count of 1 or 2, took seconds each
    (15,000 merges of tinyshakespeare: 86 s, now under 1 s). The tie-break is now part of the heap's
    order: counted, not timed, these 4,000 merges push 20,552 entries (15.7 million before)."""
    import random

    calls = count_heap_ops(monkeypatch, train_mod)
    rng = random.Random(0)
    words = {bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 12))): 1
             for _ in range(2000)}
    merges = merge_counts(words, 4000)
    assert len(merges) == 4000
    # each merge pushes the pairs whose counts it changed, a handful here; every pop is a merge or a stale entry
    assert calls["heappush"] < 10 * 4000 and calls["heappop"] <= calls["heappush"] + len(words) * 12, calls
    # the first merges, by hand: the most frequent pair, ties to the greater pair of bytes
    pairs = Counter(p for w in words for p in zip(w, w[1:]))
    top = max(pairs.values())
    assert merges[0] == max((bytes([a]), bytes([b])) for (a, b), c in pairs.items() if c == top)


def test_sennrich_example():
    # The worked example of the CS336 handout (Sennrich et al.), with whitespace pre-tokenization.
    counts = {b"low": 5, b"lower": 2, b"widest": 3, b"newest": 6}
    merges = merge_counts(counts, 6)
    assert merges == [(b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"), (b"w", b"est"), (b"n", b"e")]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab ZZ\n\t\r.,'s1²éü€’“—\u00a0\u2028\u3000 😀")), max_size=200))
def test_pretokenize_equals_regex(text):
    """Both ways a text that is not plain goes: whole through the Unicode pattern (a short one), and
    cut into stretches for the ASCII pattern where it can (a long one; here the cut-off at 0)."""
    expected = REFERENCE_REGEX.findall(text)
    assert pretokenize(text) == expected
    with mock.patch.object(pretokenize_mod, "_SHORT_UNICODE", 0):
        assert pretokenize(text) == expected


LATIN1 = "".join(map(chr, range(256)))


def test_plain_pattern_spells_the_unicode_classes_of_latin1():
    """The Latin-1 form of the pattern lists its letters, numbers and spaces by hand: each class
    holds exactly the characters of U+0000-U+00FF that the Unicode pattern's \\p{L}, \\p{N} and
    \\s hold, and the common punctuation that is also plain is in none of them."""
    for name, mine, theirs in (("letters", pretokenize_mod._LETTERS, r"\p{L}"),
                               ("numbers", pretokenize_mod._NUMBERS, r"\p{N}"),
                               ("spaces", pretokenize_mod._WS, r"\s")):
        assert re.findall(f"[{mine}]", LATIN1) == regex.findall(theirs, LATIN1), name  # the engine that runs it
        assert regex.search(theirs, pretokenize_mod._SAFE_NON_ASCII) is None, name
    assert pretokenize_mod.is_plain(LATIN1 + pretokenize_mod._SAFE_NON_ASCII)
    assert not pretokenize_mod.is_plain(LATIN1 + "\u0100")


def test_pretokenize_of_every_latin1_character_equals_the_regex():
    """Each character of Latin-1 and each plain punctuation mark alone, twice, after a space, between
    letters, numbers and spaces, and before a line end: the plain pattern's pre-tokens are the
    Unicode pattern's."""
    for c in LATIN1 + pretokenize_mod._SAFE_NON_ASCII:
        for text in (c, c + c, " " + c, "a" + c + "b", "1" + c + "2", " " + c + c + " x", c + "  \n", "'" + c + "'s",
                     "\xa0" + c, c + "\x85 "):
            assert pretokenize_mod.is_plain(text)
            assert pretokenize(text) == REFERENCE_REGEX.findall(text), (hex(ord(c)), text)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab ZZ\n\t\r\x0b\x0c.,'s1²³¹¼éüßÀ×÷ÿªµº¿\x85\xa0\x1c€’“—"
                                                  + pretokenize_mod._SAFE_NON_ASCII)), max_size=200))
def test_plain_text_pretokenizes_as_the_regex(text):
    """Latin-1 text (German, French...) goes through the standard library's engine with the plain
    pattern, never the Unicode one."""
    assert pretokenize_mod.is_plain(text)
    with mock.patch.object(pretokenize_mod, "GPT2_REGEX", None):  # any call into it fails
        assert pretokenize(text) == REFERENCE_REGEX.findall(text)


def test_pretokenize_non_ascii_equals_the_published_patterns():
    text = "Café and Über Straße, naïve façade: ½ cup, 東京 2024年 — l'été's ÆØÅ\u00a0x  \n"
    for pattern in (gpt2_published_pattern(), GPT2_ENCODER_PY_PATTERN):
        assert pretokenize(text) == regex.findall(pattern, text)
    assert pretokenize("Café and Über Straße") == ["Café", " and", " Über", " Straße"]


def _pieces(data: bytes, specials: list[str]) -> list[str]:
    """The special tokens and the reference pre-tokens of ``data``, in order, as lm decodes it."""
    text, _ = decode_utf8(data)
    out = []
    alternation = "|".join(regex.escape(t) for t in sorted(specials, key=len, reverse=True))
    for k, seg in enumerate(regex.split(f"({alternation})", text) if specials else [text]):
        out += [seg] if k % 2 else REFERENCE_REGEX.findall(seg)
    return out


# Line ends of every kind that a chunk may be cut before: CRLF, trailing spaces, CJK lines ("。" ends
# in the byte that U+2002 ends in), Unicode spaces before "\n" (U+2002, U+3000, U+00A0, U+0085, U+2028),
# "\x1c" (whitespace to str.isspace, not to the pattern), invalid UTF-8 before "\n" ("\xff", a stray
# continuation byte, a truncated character), and the contraction "'s" and the digits of the pattern.
CUT_ALPHABET = [b"a", b"b", b" ", b"  ", b"\n", b"\n", b"\r\n", b"\t", b".", b"'", b"s", b"1", "\u00e9".encode(),
                "\u3002".encode(), "\u4ece".encode(), "\u2002".encode(), "\u3000".encode(), "\u00a0".encode(),
                "\u0085".encode(), "\u2028".encode(), b"\x1c", b"\xff", b"\x80", b"\xe2\x80", b"<|e|>"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.lists(st.sampled_from(CUT_ALPHABET), max_size=400).map(b"".join),
    target=st.integers(1, 50),
    block=st.integers(1, 40),
)
def test_chunks_cut_no_pretoken(tmp_path, data, target, block):
    """Pre-tokenizing the chunks one by one gives the pre-tokens (and special tokens) of the whole
    text, in order, also when the blocks that ``next_safe_cut`` reads end anywhere."""
    path = tmp_path / "t.txt"
    path.write_bytes(data)
    chunks = chunk_boundaries(path, ["<|e|>"], target)
    if not data:
        assert chunks == []
        return
    assert chunks[0][0] == 0 and chunks[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    whole = _pieces(data, ["<|e|>"])
    assert [p for a, b in chunks for p in _pieces(data[a:b], ["<|e|>"])] == whole
    with open(path, "rb") as f:
        for pos in range(0, len(data), max(1, target // 3)):
            cut = next_safe_cut(f, pos, len(data), [b"<|e|>"], search_block=block)
            assert cut == -1 or pos <= cut < len(data)
            if cut != -1:
                assert _pieces(data[:cut], ["<|e|>"]) + _pieces(data[cut:], ["<|e|>"]) == whole, (pos, cut)


def _first_line_end(text: str, start: int) -> int:
    """A reference for ``find_safe_cut`` without special tokens, on valid UTF-8, written on the text:
    the first character position at or after ``start`` that begins a whitespace run holding a "\n"
    and follows a character that is not whitespace; as a byte offset."""
    ws = regex.compile(r"\s")
    for k in range(1, len(text)):
        at = len(text[:k].encode())
        if at < start or ws.match(text[k - 1]) or not ws.match(text[k]):
            continue
        run = regex.match(r"\s*", text[k:]).group()
        if "\n" in run:
            return at
    return -1


LINE_ENDS = [
    ("ab\r\ncd", 2),
    ("cat. \nThe dog.  \r\n", 4),
    ("\u4e00\u3002\n\u4e8c", 6),  # after "。" (E3 80 82)
    ("x\u2002\ny", 1),  # before U+2002 (E2 80 82: the same last byte as "。")
    ("x\u3000\u3000\ny", 1),
    ("x\u00a0\n", 1),
    ("x\u0085\n", 1),
    ("\u3002\t\u2028 \r\n", 3),
    ("x\x1c\ny", 2),  # "\x1c" is no whitespace to the pattern: the cut is before the "\n"
    ("\n\n\nab\n", 5),  # the run at the start follows nothing
    ("ab  \ncd\nef", 2),
]


@pytest.mark.parametrize(("text", "cut"), LINE_ENDS)
def test_find_safe_cut_at_the_start_of_a_line_end(text, cut):
    data = text.encode()
    assert find_safe_cut(data, []) == cut == _first_line_end(text, 0)
    assert _pieces(data[:cut], []) + _pieces(data[cut:], []) == _pieces(data, [])


@pytest.mark.parametrize(
    ("data", "cut"),
    [(b"\xff\nab\n", 4), (b"a\x80\nb\n", 4), (b"a\xe2\x80\nb\n", 5), (b"\xe2\x80\x80\x80\nb\n", 6),
     (b"\xc0\xaf\nb\n", 4), (b"\xed\xa0\x80\nb\n", 5)],  # an overlong "/" and a surrogate are not valid either
)
def test_find_safe_cut_not_after_invalid_utf8(data, cut):
    """A line end after invalid UTF-8 is not taken (the character before the run must be whole and valid)."""
    assert find_safe_cut(data, []) == cut
    assert _pieces(data[:cut], []) + _pieces(data[cut:], []) == _pieces(data, [])


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(list("ab .'\n\r\t\x1c\u00e9\u3002\u2002\u3000\u00a0\u0085\u2028")), max_size=60)
       .map("".join), start=st.integers(0, 80))
def test_find_safe_cut_is_the_first_line_end(text, start):
    """On valid UTF-8, the cut is the reference's: the first place the rule allows (no place missed)."""
    data = text.encode()
    assert find_safe_cut(data, [], min(start, len(data))) == _first_line_end(text, min(start, len(data)))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(st.binary(min_size=1, max_size=2), st.characters().map(
    lambda c: c.encode("utf-8", "surrogatepass"))), max_size=12).map(b"".join), st.integers(0, 40))
def test_the_character_before_a_cut_is_the_one_a_decoder_finds(data, i):
    """``_char_before(buf, i)``: the one character whose UTF-8 bytes end at ``i``, by brute force: the
    first 1 to 4 bytes before ``i`` that decode (strictly) to one character; None where none do. Random
    bytes among encoded characters of every length, surrogates' encodings among them (mutation: the
    three-byte lead range one past 0xEF, and every other lead byte taken as announcing four bytes,
    survived: the cut tests put no four-byte character before a line end)."""
    i = min(i, len(data))

    def brute(buf: bytes, i: int):
        for k in range(1, 5):
            if i - k < 0:
                return None
            try:
                text = buf[i - k : i].decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(text) == 1:
                return text
        return None

    assert pretokenize_mod._char_before(data, i) == brute(data, i)
    for ch in ("\U0001f600", "\U00010000", "\U0010ffff", "\uffff", "\u00e9", "a"):  # each length, at its bounds
        assert pretokenize_mod._char_before(b"x" + ch.encode() + b"\n", 1 + len(ch.encode())) == ch


def test_every_cut_before_short_line_ends_is_safe():
    """Brute force: after every start, in every text "a" + three pieces + "\nb" over the line-end alphabet,
    the cut that ``find_safe_cut`` returns splits the text into the pre-tokens of the whole."""
    import itertools

    alphabet = [b" ", b"\r", b"\n", b"\t", b".", b"'", b"s", "\u3002".encode(), "\u2002".encode(), "\u3000".encode(),
                "\u00a0".encode(), "\u0085".encode(), b"\x1c", b"\xff", b"\x80", b"\xe2\x80"]
    for parts in itertools.product(alphabet, repeat=3):
        data = b"a" + b"".join(parts) + b"\nb"
        whole = _pieces(data, [])
        for start in range(len(data)):
            cut = find_safe_cut(data, [], start)
            assert cut == -1 or start <= cut < len(data)
            if cut != -1:
                assert _pieces(data[:cut], []) + _pieces(data[cut:], []) == whole, (data, start, cut)


def test_the_whitespace_of_the_chunker_is_the_patterns():
    """The characters that the chunker walks back over are exactly those the GPT-2 pattern's \\s matches,
    and its byte patterns match each one whole (and nothing else), forwards and backwards."""
    import lm.tokenizer.pretokenize as P

    every = "".join(map(chr, range(0x110000)))
    assert P._WHITESPACE_CHARS == "".join(regex.findall(r"\s", every))
    wide = set(c.encode() for c in P._WHITESPACE_CHARS)
    for c in map(chr, range(0x80, 0x110000)):
        b = c.encode("utf-8", "surrogatepass")
        assert (P._WS_RUN.fullmatch(b) is not None) == (P._WS_RUN_REVERSED.fullmatch(b[::-1]) is not None) \
            == (b in wide), hex(ord(c))


def test_chunks_of_crlf_cjk_and_trailing_space_text(tmp_path):
    """Text whose line ends follow no printable ASCII had no cut at all: the whole file was one chunk."""
    texts = {
        "crlf": "".join(f"Line {i} of a Windows text, with a comma,\r\n" for i in range(5000)),
        "cjk": "\u4ece\u524d\u6709\u4e00\u4e2a\u5c0f\u5973\u5b69\uff0c\u5979\u559c\u6b22\u5728\u82b1\u56ed"
               "\u91cc\u73a9\u3002\n" * 5000,
        "trailing": "Once upon a time there was a cat. \n" * 5000,
        "spaces": "Le chat\u00a0!\u2002\n\u3000\u3000\u4f60\u597d\u3000\r\n" * 5000,
    }
    for name, text in texts.items():
        path = tmp_path / f"{name}.txt"
        path.write_text(text, encoding="utf-8", newline="")
        chunks = chunk_boundaries(path, ["<|endoftext|>"], 10_000)
        assert len(chunks) >= path.stat().st_size // 12_000, name
        data = path.read_bytes()
        assert [p for a, b in chunks for p in _pieces(data[a:b], [])] == _pieces(data, []), name


OVERLAPPING_SPECIALS = [
    (["<|a|>", "<|a|><|b|>", "<|b|>"], "xx<|a|><|b|>yy<|a|>\n<|b|><|a|><|b|><|a|>z.\n"),
    (["ab", "bc"], "xxabcxx\nabc.\nbcab"),
    (["<|endoftext|>", "endoftext"], "aa<|endoftext|>bb\nendoftext.\n<|endoftext|>"),
    (["ab", "ba"], "xabababx.\nbababa.\n"),  # a chain of overlaps
    (["x\t", "<|a b|>", "y \r"], "ax\t\nb<|a b|>\r\n<|a\ny \r\n.y \r\n"),  # whitespace inside special tokens
]


@pytest.mark.parametrize(("specials", "text"), OVERLAPPING_SPECIALS)
def test_chunks_never_cut_inside_an_overlapping_special_token(tmp_path, specials, text):
    """A chunk target inside "<|a|><|b|>" cut the file at the inner "<|b|>", so the counts (and the ids of
    `lm tokenize`) differed from those of the whole text, by where the targets fell."""
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    whole = Counter()
    for seg in regex.split("|".join(regex.escape(t) for t in sorted(specials, key=len, reverse=True)), text):
        whole.update(REFERENCE_REGEX.findall(seg))
    for chunk_bytes in range(1, len(text) + 1):
        counts = count_pretokens([(str(path), 0, len(text))], specials, num_workers=1, chunk_bytes=chunk_bytes)
        assert counts == whole, (chunk_bytes, chunk_boundaries(path, specials, chunk_bytes))


def test_parallel_counting_equals_serial(tmp_path, monkeypatch):
    rows = [f"Line {i}: the quick brown fox {i % 97} jumps — über café.\n" for i in range(20000)]
    text = "<|endoftext|>".join("".join(rows[i : i + 500]) for i in range(0, len(rows), 500))
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    size = path.stat().st_size
    monkeypatch.setattr(train_mod, "MIN_PARALLEL_BYTES", 0)
    parallel = count_pretokens([(str(path), 0, size)], ["<|endoftext|>"], num_workers=2, chunk_bytes=50_000)
    serial = Counter()
    for seg in text.split("<|endoftext|>"):
        serial.update(REFERENCE_REGEX.findall(seg))
    assert parallel == serial


def test_invalid_utf8_is_replaced_with_a_warning(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world \xff\xfe hello again " * 20)
    with pytest.warns(UserWarning) as caught:  # 2 bad bytes x 20
        vocab, merges = train_bpe(path, 270, [])
    assert [str(w.message) for w in caught] == [f"input: 40 bytes of {str(path)!r} are not valid UTF-8 (the first at "
                                                "line 1, column 13); they were replaced by U+FFFD"]
    assert len(vocab) == 270


def test_the_invalid_utf8_warning_names_the_first_file_and_place_whatever_order_the_chunks_come_in(
        tmp_path, monkeypatch):
    """It said "input: 3 bytes are not valid UTF-8", naming neither which of several files held
    them nor where (cli21 F2). The chunks' results come in any order (workers, ``ordered=False``):
    the place named is the first bad byte in the files' order, whichever chunk was counted first."""
    import contextlib

    good, bad, worse = tmp_path / "good.txt", tmp_path / "bad.txt", tmp_path / "worse.txt"
    good.write_bytes(b"all fine here.\n" * 40)
    bad.write_bytes(b"fine.\n" * 30 + b"Lily saw \xffit.\n" + b"fine again.\n" * 30 + b"end \xfe\xfe.\n")
    worse.write_bytes(b"\x80" + b"fine.\n" * 30)

    @contextlib.contextmanager
    def reversed_map(func, tasks, workers, **kwargs):  # the last chunk's result first
        yield reversed([func(t) for t in tasks])

    monkeypatch.setattr(train_mod, "parallel_map", reversed_map)
    ranges = [(str(p), 0, p.stat().st_size) for p in (good, bad, worse)]
    stats = train_mod.TrainStats()
    with pytest.warns(UserWarning) as caught:
        count_pretokens(ranges, [], num_workers=2, chunk_bytes=64, stats=stats)
    assert [str(w.message) for w in caught] == [f"input: 4 bytes of 2 files are not valid UTF-8 (the first in "
                                                f"{str(bad)!r} at line 31, column 10); they were replaced by U+FFFD"]
    assert stats.invalid_utf8_bytes == 4
    with pytest.warns(UserWarning) as caught:
        count_pretokens(ranges[::2], [], num_workers=2, chunk_bytes=64)
    assert [str(w.message) for w in caught] == [f"input: 1 byte of {str(worse)!r} is not valid UTF-8 (the first at "
                                                "line 1, column 1); it was replaced by U+FFFD"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vocab_size": 100, "special_tokens": []}, "vocab_size: 100 is below"),
        ({"vocab_size": 256, "special_tokens": ["<s>"]}, "vocab_size: 256 is below"),
        ({"vocab_size": 300, "special_tokens": ["<s>", "<s>"]}, "duplicate special token '<s>'"),
        ({"vocab_size": 300, "special_tokens": [""]}, "non-empty string"),
        ({"vocab_size": "300", "special_tokens": []}, "vocab_size: expected an integer"),
        # a string was split into one-character special tokens: the text was cut at every "e"
        ({"vocab_size": 300, "special_tokens": "<eos>"},
         r"^special_tokens: expected a list of strings, got the string '<eos>'$"),
        ({"vocab_size": 300, "special_tokens": "<|endoftext|>"},
         r"^special_tokens: expected a list of strings, got the string '<\|endoftext\|>'$"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, match):
    path = tmp_path / "c.txt"
    path.write_text("some text", encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        train_bpe(path, **kwargs)


def test_missing_and_empty_input(tmp_path):
    with pytest.raises(ValueError, match="input_path: file not found"):
        train_bpe(tmp_path / "nope.txt", 300, [])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="input_path: input is empty"):
        train_bpe(tmp_path / "empty.txt", 300, [])


def test_train_bpe_takes_a_numpy_integer_vocab_size(tmp_path):
    """`train_bpe(path, np.int64(280), ...)` was "vocab_size: expected an integer, got np.int64(280)"
    (apifuzz19 #20); a float is still refused."""
    import numpy as np

    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 40)
    assert train_bpe(corpus, np.int64(270), [], num_workers=1) == train_bpe(corpus, 270, [], num_workers=1)
    with pytest.raises(ValueError, match=r"^vocab_size: expected an integer, got 270\.0$"):
        train_bpe(corpus, 270.0, [], num_workers=1)


def test_the_merge_bar_is_drawn_on_a_terminal_when_asked_and_moves_64_merges_at_a_time(monkeypatch):
    """``merge_counts`` draws nothing by default, even on a terminal (a library call stays quiet);
    with ``progress=True`` its bar there reads ``merge`` and counts the merges learned out of those
    asked for, moving 64 merges at a time (one ``update`` per merge costs more than the merge) and then
    to the count learned. Mutation: the default bar, a bar on every terminal or on none, its total,
    name or unit, and the 64-merge steps, all survived (the bpe target's tests drew no bar)."""
    import sys

    from helpers.pipes import Terminal

    steps = []

    class Recording(train_mod.tqdm):
        def update(self, n=1):
            steps.append(n)
            return super().update(n)

    monkeypatch.setattr(train_mod, "tqdm", Recording)
    word = {bytes(range(131)): 1}  # 130 merges make it one token; 200 are asked for
    for kwargs in ({}, {"progress": False}, {"progress": True}):
        monkeypatch.setattr(sys, "stderr", Terminal())
        steps.clear()
        assert len(merge_counts(word, 200, **kwargs)) == 130
        drawn = sys.stderr.getvalue()
        if kwargs.get("progress"):
            assert re.search(r"merge: +65%\|.*\| 130/200 \[.*merge/s\]", drawn), drawn
            assert steps == [64, 64, 2], steps
        else:
            assert drawn == "", (kwargs, drawn)

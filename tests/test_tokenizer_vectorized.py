"""The vectorised fast path of encoding against the regex path it replaces on plain text."""

import json
import re
from unittest import mock

import numpy as np
import pytest
import regex
from helpers.data import data_file, gpt2_published_pattern
from hypothesis import given, settings
from hypothesis import strategies as st

import lm.tokenizer.tokenizer as tokenizer_module
import lm.tokenizer.vectorized as vz
from lm.tokenizer import Tokenizer, train_bpe
from lm.tokenizer.byte_unicode import unicode_str_to_bytes
from lm.tokenizer.pretokenize import _SAFE_NON_ASCII, GPT2_REGEX, is_plain, plain_stretches
from lm.tokenizer.vectorized import HashedEncoder

EOT = "<|endoftext|>"
# special tokens that end in a space, which the fast path once took for a space before the next word
SPACE_ENDED = ["<sep> ", "x ", "' ", "  ", " "]
# plain text, weighted towards what the rules care about: contractions, runs of whitespace
PLAIN = st.text(
    alphabet=st.sampled_from(list("abcABZ019 '''sdmtlverSDLVE.,!?-\"\n\n  \t\r\x0b\x0c") + list(_SAFE_NON_ASCII[:8])),
    max_size=60,
)


# characters of two UTF-8 bytes, which the fast path classes by code point: letters (Latin, Greek,
# Cyrillic, Hebrew, Arabic), numbers (superscripts, fractions, Arabic-Indic digits), others (signs,
# a combining accent, C1 controls) and those next to the whitespace U+0085 and U+00A0
TWO_BYTE = "éÄßøłœΩжЯשع²½٣×÷§¬\u0301\u0080\u0084\u0086\u009f¡\u07ff"
# and of three: CJK, kana, hangul, Devanagari (with its vowel signs, marks: "other"), Thai, full-width
# digits and letters, CJK punctuation, those next to the whitespace U+1680, U+2000-U+200A, U+3000
THREE_BYTE = "東京日本語ひらカタ한국हिन्दी२กขー、。「」０９ＡＺ\u1681\u200b\u2027\u3001\ufffd\uffff\u0800"
# and of four: emoji (with a skin tone, a flag's regional indicators), mathematical letters and
# digits, CJK extension B, Gothic, Aegean numbers, a musical sign, the first and last code points
FOUR_BYTE = "🙂😀👍🏽🇩🇪𝐀𝑥𝟎𝟗𠀀𠮷𐌰𐄇𝄞\U00010000\U0010ffff"
# the whitespace above ASCII: of two bytes (NEL, NBSP) and three (ogham, en quad to hair space,
# line and paragraph separators, narrow NBSP, medium math space, ideographic space); weighted
UNICODE_SPACES = "\x85\xa0\u1680\u2000\u2009\u200a\u2028\u2029\u202f\u205f\u3000" + "\xa0\u3000" * 3
FAST = st.text(
    alphabet=st.sampled_from(list("abcABZ019 '''sdmtlverSDLVE.,!?-\"\n\n  \t\r") + list(_SAFE_NON_ASCII[:8])
                             + list(TWO_BYTE) + list(THREE_BYTE) + list(FOUR_BYTE) + list(UNICODE_SPACES)),
    max_size=60,
)


def regex_starts(text: str) -> list[int]:
    """Byte offsets where the GPT-2 regex's pre-tokens start."""
    out, pos = [], 0
    for tok in GPT2_REGEX.findall(text):
        out.append(pos)
        pos += len(tok.encode("utf-8"))
    return out


def starts_of(text: str) -> list[int]:
    return vz.pretoken_starts(np.frombuffer(text.encode("utf-8"), dtype=np.uint8)).tolist()


@settings(max_examples=2000, deadline=None)
@given(PLAIN)
def test_pretoken_starts_equal_the_regex(text):
    assert is_plain(text)
    assert starts_of(text) == regex_starts(text)


@settings(max_examples=2000, deadline=None)
@given(FAST)
def test_pretoken_starts_equal_the_regex_with_two_byte_characters(text):
    assert is_plain(text, fast=True)
    assert starts_of(text) == regex_starts(text)


def test_two_byte_characters_are_classed_as_the_pattern_classes_them():
    """Every code point of two UTF-8 bytes against the Unicode pattern: alone, after a space, and
    between letters, digits and punctuation (the whitespace among them too, U+0085 and U+00A0)."""
    for cp in range(0x80, 0x800):
        ch = chr(cp)
        assert is_plain(ch, fast=True)
        for text in (ch, " " + ch, "a" + ch + "b", "1" + ch + "2", "." + ch + ".", ch * 3 + " x" + ch, "'" + ch,
                     ch + ch + "a", "a " + ch + " b", "a" + ch + "\n b", ch + "\n" + ch, "a " + ch):
            assert starts_of(text) == regex_starts(text), (hex(cp), text)


def test_every_bmp_character_is_classed_as_the_pattern_classes_it():
    """Every code point of three UTF-8 bytes (U+0800-U+FFFF) against the Unicode pattern, in texts of
    a thousand at a time: each after a space, between letters, digits and punctuation, and doubled;
    the whitespace among them (which took the regex path) also in runs with ASCII whitespace."""
    chars = [chr(cp) for cp in range(0x800, 0x10000) if not 0xD800 <= cp < 0xE000]
    assert is_plain("".join(chars), fast=True) and not is_plain("a\ud83d", fast=True)  # not a lone surrogate
    for i in range(0, len(chars), 1000):
        text = "".join(f" {c}a{c}b 1{c}2.{c}.{c}{c} {c}'{c}" for c in chars[i : i + 1000])
        assert starts_of(text) == regex_starts(text), chars[i]
    spaces = [c for c in chars if regex.fullmatch(r"\s", c)]
    assert [ord(c) for c in spaces] == [0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
    for c in [*spaces, "\x85", "\xa0"]:
        for text in (f"a{c}{c}b", f"a {c}b", f"a{c} b", f"a{c}\nb", f"a\n{c}b", f"a {c} {c}  b{c}", f"{c}{c}",
                     f"x{c}{EOT}", f"{c}'s", f"1{c}{c}2", f"a\t{c}\n \u3000\xa0b"):
            assert starts_of(text) == regex_starts(text), (hex(ord(c)), text)


def test_every_letter_and_number_of_four_bytes_is_classed_as_the_pattern_classes_it():
    """Characters of four UTF-8 bytes (emoji, CJK extension B, mathematical letters) took the regex
    path. Every letter and number above U+FFFF (some 98,000) against the Unicode pattern, as the BMP's
    are above, and every 61st of the others (emoji, symbols, unassigned code points); none of them is
    whitespace (the fast path could not take it: the class rules suppose whitespace of one byte)."""
    astral = "".join(map(chr, range(0x10000, 0x110000)))
    assert regex.search(r"\s", astral) is None
    assert is_plain(astral, fast=True)
    letters_numbers = regex.findall(r"[\p{L}\p{N}]", astral)
    others = regex.findall(r"[^\p{L}\p{N}]", astral)[::61]
    assert len(letters_numbers) > 90_000 and len(others) > 10_000
    chars = letters_numbers + others
    for i in range(0, len(chars), 2000):
        text = "".join(f" {c}a{c}b 1{c}2.{c}.{c}{c} {c}'{c}" for c in chars[i : i + 2000])
        assert starts_of(text) == regex_starts(text), chars[i]


@pytest.mark.parametrize("text", [
    "don't I'll we've they're 's 'S 'lls 'ss ''s ' 's", "a  b", "a \nb", "a\n b", "a  \n\n  b  ", "x'", "'",
    "1990's", "end.\u201d He said\u2014no.", "\t\t x", "  ", "\n", "a'll'", "'ll've're", "it’s",
])
def test_pretoken_starts_on_corner_cases(text):
    assert starts_of(text) == regex_starts(text)


def test_a_stretch_inside_a_special_token_joins_the_stretch_before_it():
    """A cut inside "<sep-x>" moves to its start; the stretch left empty (8..12, all inside it) joins the
    one before, the third of four, not the second (plain only if both are)."""
    from lm.tokenizer.tokenizer import _keep_specials_whole

    text = "abcdefgh<sep-x>zzzzz"
    stretches = [(True, 0, 4), (True, 4, 8), (True, 8, 12), (False, 12, 20)]
    assert _keep_specials_whole(stretches, text, regex.compile("(<sep-x>)"), 7) == [
        (True, 0, 4), (True, 4, 8), (False, 8, 20)]


def test_a_cut_inside_a_special_token_that_overlaps_an_earlier_one_moves_to_its_start():
    """Special tokens "ab" and "bcdef" in "xxabcdefzz", a cut at 6: "ab" (2..4) is found first, and a
    search that resumed after it would miss "bcdef" (3..8), which holds the cut. The cut moves to 3,
    then, inside "ab", to 2."""
    from lm.tokenizer.pretokenize import special_tokens_regex
    from lm.tokenizer.tokenizer import _keep_specials_whole

    text = "xxabcdefzz"
    assert _keep_specials_whole([(True, 0, 6), (False, 6, 10)], text, special_tokens_regex(["ab", "bcdef"]), 5) == [
        (True, 0, 2), (False, 2, 10)]


@settings(max_examples=500, deadline=None)
@given(st.lists(PLAIN, min_size=1, max_size=5),
       st.lists(st.sampled_from(["<s>", "<|x|>", "l", *SPACE_ENDED, "'"]), min_size=5, max_size=5))
def test_special_tokens_cut_the_text_like_separate_texts(pieces, specials):
    """Around a special token the text splits as if it ended (or began) there: the last space of
    "<sep> " does not join the word after it, nor is a special token "'" the start of "'s"."""
    text, mask, sp_starts, expected = "", [], [], []
    for i, piece in enumerate(pieces):
        if i:
            sp = specials[i]
            sp_starts.append(len(text.encode()))
            expected.append(len(text.encode()))
            text += sp
            mask += [True] * len(sp.encode())
        base = len(text.encode())
        expected += [base + s for s in regex_starts(piece)]
        text += piece
        mask += [False] * len(piece.encode())
    b = np.frombuffer(text.encode(), dtype=np.uint8)
    got = vz.pretoken_starts(b, np.array(mask, dtype=bool), np.array(sp_starts, dtype=np.intp))
    assert got.tolist() == expected


@pytest.fixture(autouse=True, scope="module")
def _short_texts_take_the_vectorised_path_too():
    """These tests are about the vectorised path, mostly on short texts, which ``encode`` otherwise
    sends down the regex path (``_SHORT_TEXT``): compared with it, they would compare it with itself."""
    with mock.patch.object(tokenizer_module, "_SHORT_TEXT", 0):
        yield


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("vz") / "corpus.txt"
    path.write_text(("Tom's dog can't run. \"We'll see,\" she said.\n\n  It’s 1990’s—end.\t" + EOT) * 30)
    vocab, merges = train_bpe(path, 350, [EOT, "<pad>"])
    return Tokenizer(vocab, merges, [EOT, "<pad>"])


def regex_path(tok: Tokenizer, text: str) -> list[int]:
    return [ord(c) for c in tok._encode_chars(text)]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(PLAIN, FAST, st.sampled_from([EOT, "<pad>", EOT + EOT, "é", "東京", "\xa0", "\x85"])),
                max_size=8))
def test_fast_path_equals_regex_path(tok, parts):
    text = "".join(parts)
    assert tok.encode(text) == regex_path(tok, text)
    assert tok.encode_to_numpy(text, np.uint16).tolist() == regex_path(tok, text)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(PLAIN, st.sampled_from([*SPACE_ENDED, "'", EOT, "é"])), max_size=8),
       st.sampled_from([*SPACE_ENDED, "'"]))
def test_fast_path_equals_regex_path_with_special_tokens_ending_in_a_space(tok, parts, special):
    """ "a<sep> b" gave [a, <sep> , " ", b] on the fast path (the space of the special token was taken
    for one before "b"), and decoded to "a<sep>  b"; the regex path gives [a, <sep> , b]."""
    tok = Tokenizer(tok.vocab, tok.merges, [EOT, special])
    text = "".join(parts)
    assert tok.encode(text) == regex_path(tok, text)
    assert tok.decode(tok.encode(text)) == text


def tiktoken_gpt2_with(tok: Tokenizer):
    """tiktoken's encoding of the GPT-2 files (GPT-2's published pattern), with the special tokens of ``tok``."""
    tiktoken = pytest.importorskip("tiktoken")
    vocab = json.loads(data_file("gpt2_vocab.json").read_text(encoding="utf-8"))
    ranks = {unicode_str_to_bytes(s): i for s, i in vocab.items() if s != EOT}
    specials = {t: tok.token_to_id[t.encode()] for t in tok.special_tokens}
    return tiktoken.Encoding("gpt2-local", pat_str=gpt2_published_pattern(), mergeable_ranks=ranks,
                             special_tokens=specials)


@pytest.fixture(scope="module")
def gpt2_space_ended() -> dict[str, tuple]:
    """GPT-2 with each special token of SPACE_ENDED, and tiktoken given the same special tokens."""
    gpt2 = Tokenizer.from_files(data_file("gpt2_vocab.json"), data_file("gpt2_merges.txt"), [EOT])
    out = {}
    for special in SPACE_ENDED:
        tok = Tokenizer(gpt2.vocab, gpt2.merges, [EOT, special])
        out[special] = tok, tiktoken_gpt2_with(tok)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(PLAIN, st.sampled_from([*SPACE_ENDED, "»", "…", EOT])), max_size=8),
       st.sampled_from(SPACE_ENDED))
def test_special_tokens_ending_in_a_space_encode_like_tiktoken(gpt2_space_ended, parts, special):
    tok, enc = gpt2_space_ended[special]
    text = "".join(parts)
    assert tok.encode(text) == enc.encode(text, allowed_special="all")


def test_a_hash_collision_falls_back_to_the_regex_path(tok, monkeypatch):
    """With a hash that only sees the length, every long word (8 bytes or more) of one length
    collides: the check against the stored bytes must catch it, and the ids must still be right."""
    fresh = Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    monkeypatch.setattr(vz, "_HASH_TABLE", np.ones_like(vz._HASH_TABLE))
    text = "elephants giraffes. Tom ran far away, far far away.\n" * 3
    assert fresh._fast.encode(text.encode()) is None
    assert fresh.encode(text) == regex_path(tok, text)
    # a long word whose hash meets a shorter stored word's (the length is checked before the bytes)
    monkeypatch.setattr(vz, "_HASH_TABLE", np.zeros_like(vz._HASH_TABLE))
    monkeypatch.setattr(vz, "_LEN_MIX", np.uint64(0))  # every long word's hash is the same
    fresh = Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    text = "zz " + "y" * 5_000 + " " + "x" * 9
    assert fresh._fast.encode(b" " + b"x" * 9) is not None
    assert fresh._fast.encode(b" " + b"y" * 5_000) is None
    assert fresh.encode(text) == regex_path(tok, text)


def test_short_words_are_their_own_keys(tok):
    """Pre-tokens of up to 7 bytes are keyed by their bytes and length, not hashed: words that
    differ only in a NUL byte, its place or the length never share an entry."""
    fresh = Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    words = ["a", "a\x00", "\x00a", "\x00", "\x00\x00", "aaaaaaa", "aaaaaab", "baaaaaa", "aaaaaaaa",
             " Tom", " Tom\x00", "'s", "1990", "..."]
    for w in words:
        assert is_plain(w)
    text = "".join(words * 3)
    assert fresh._fast.encode(text.encode()).tolist() == regex_path(tok, text)
    assert fresh._fast.encode(text.encode()).tolist() == regex_path(tok, text)  # all found this time
    keys, hashed = vz._token_keys(np.frombuffer(b"ab\x00cdefghi", dtype=np.uint8), np.array([0, 2]), np.array([2, 8]))
    assert keys[0] == 2 << 56 | ord("b") << 8 | ord("a") and hashed.tolist() == [1] and keys[1] >> 56 == 0xFF


def letters(i: int) -> str:
    out = "q"
    while i:
        i, d = divmod(i, 26)
        out += chr(97 + d)
    return out


def test_table_grows_and_starts_again_at_its_limit(tok):
    """A HashedEncoder built with a small limit (the tokenizer's own is 2^20 words)."""
    def table(limit):
        return HashedEncoder(tok._bpe_many, limit)

    def fast(encoder, text):
        ids = encoder.encode(text.encode())
        assert ids is not None  # plain text: the fast path, not the fallback
        return ids.tolist()

    words = " ".join(letters(i) for i in range(6000))  # 6,000 distinct pre-tokens: the table grows
    encoder = table(6050)
    assert fast(encoder, words) == regex_path(tok, words) and encoder.entries == 6000
    assert fast(encoder, words) == regex_path(tok, words)  # all found this time
    more = " ".join(letters(i) for i in range(6000, 6060))  # would pass the limit: the table starts again
    assert fast(encoder, more) == regex_path(tok, more) and encoder.entries == 60
    # known and new words in one text that passes the limit: the table starts again with all of them
    encoder.limit = 100
    mixed = more + " " + " ".join(letters(i) for i in range(7000, 7050))
    assert fast(encoder, mixed) == regex_path(tok, mixed)
    assert encoder.entries == len(set(GPT2_REGEX.findall(mixed))) == 110
    assert fast(table(10**6), words) == regex_path(tok, words)
    # past half of the table's first 2**16 slots: rebuilt twice as large, the load kept under 1/2
    many = " ".join(letters(i) for i in range(40_000))
    encoder = table(10**6)
    assert fast(encoder, many) == regex_path(tok, many) and encoder.entries == 40_000
    assert len(encoder.table.keys) == 2**17 and fast(encoder, many) == regex_path(tok, many)


def test_mixed_text_splits_into_plain_and_other_stretches(tok):
    text = "Plain line.\nΚαφέ au lait.\nPlain again.\n" * 5
    stretches = list(plain_stretches(text))
    assert {p for p, _, _ in stretches} == {True, False}
    assert "".join(text[a:b] for _, a, b in stretches) == text
    assert tok.encode(text) == regex_path(tok, text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(PLAIN, st.sampled_from(["é", "東京", "naïve\n", EOT, "<pad>", "\n"])), max_size=12),
       st.integers(1, 40))
def test_plain_text_in_small_blocks_equals_regex_path(tok, parts, block):
    """Plain stretches go to the fast path joined into blocks (and long ones cut at safe cuts):
    with tiny blocks every join and cut is exercised, and the ids must not change."""
    fresh = Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    text = "".join(parts)
    with mock.patch.object(tokenizer_module, "_FAST_BLOCK", block):
        assert fresh.encode(text) == regex_path(tok, text)
    stretches = list(plain_stretches(text, max_plain=block))
    assert [s for s in stretches if not s[0]] == [s for s in plain_stretches(text) if not s[0]]
    assert "".join(text[a:b] for _, a, b in stretches) == text
    for plain, a, b in stretches:
        if plain and b - a > block:  # no safe cut after its first `block` characters
            assert re.search(r"(?<=[!-~])[\t\x0b\x0c\r ]*\n", text[a + block - 1 : b]) is None


def test_line_ends_with_a_carriage_return_or_spaces_are_safe_cuts(tok):
    """Only "\n" right after a printable character was a cut: a CRLF text was one block however
    large (and one non-ASCII character sent all of it down the regex path)."""
    text = "One line.\r\nTwo  \nthree.\t\r\n" * 4
    # each cut: the first start of a line end's whitespace run ("\t\r\n" after "three.") 20 characters on
    assert [(a, b) for _, a, b in plain_stretches(text, max_plain=20)] == [
        (0, 23), (23, 49), (49, 75), (75, 101), (101, 104)]
    mixed = "Plain line.\r\nΚαφέ au lait.\r\nPlain again.\r\n"
    assert list(plain_stretches(mixed)) == [(True, 0, 11), (False, 11, 26), (True, 26, 42)]
    for t in (text, mixed * 3):
        with mock.patch.object(tokenizer_module, "_FAST_BLOCK", 16):
            assert Tokenizer(tok.vocab, tok.merges, tok.special_tokens).encode(t) == regex_path(tok, t)


@pytest.mark.parametrize("special", ["<sep> ", " <sep> ", "a\t", "x\r", "é ", "z\x0c", "\n"])
def test_a_special_token_across_a_safe_cut_stays_whole(tok, special):
    """tokenizer20: a text past one block was cut at the start of a line end's whitespace run, which
    may lie inside a special token that holds a space, tab or "\r" (only "\n" was looked for): past
    1 MiB, "The cat sat on the mat <sep> \n" * 40000 kept 39,999 of its 40,000 separators, the other
    encoded as ordinary text."""
    fresh = Tokenizer(tok.vocab, tok.merges, [EOT, special])
    line = f"The cat sat on the {special}\nmat {special}\r\n"
    text = line * 300
    with mock.patch.object(tokenizer_module, "_FAST_BLOCK", 64):
        ids = fresh.encode(text)
    assert ids == regex_path(fresh, text)
    assert ids.count(fresh.special_ids[special]) == text.count(special) >= 600


# with some that overlap ("<s>\n<s>", "<s>\n", "\n<s>"): a cut moved to one's start may lie inside another
WHITESPACE_SPECIALS = [EOT, "<sep> ", " <sep> ", "\n\n", "<s>\n", " \n", "\r\n", "x\t", "\u00e9 \n", "<s>\n<s>",
                       "\n<s>"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["The cat sat.", " \n", "\n", "\r\n", "  ", "\t", "<sep> ", " <sep> ", "\n\n",
                                 "<s>\n", "<s>", "x\t", "\u00e9 \n", "Caf\u00e9", "\U0001f642", "a", " b", EOT]),
                min_size=1, max_size=120))
def test_cuts_inside_special_tokens_that_hold_whitespace_are_joined_up(tok, parts):
    """tokexp22: a special token holding whitespace had turned cutting off (tokenizer20's fix), so a long
    text was one block, ~20 bytes of memory a character. Cuts are kept, and one inside a special token
    joins its two stretches: the ids equal the regex path's, with small blocks and many cuts."""
    fresh = Tokenizer(tok.vocab, tok.merges, WHITESPACE_SPECIALS)
    text = "".join(parts)
    with mock.patch.object(tokenizer_module, "_FAST_BLOCK", 8), mock.patch.object(tokenizer_module, "_SHORT_TEXT", 0):
        assert fresh.encode(text) == regex_path(fresh, text)


def test_a_long_text_with_whitespace_special_tokens_is_still_encoded_in_blocks(tok):
    """The blocks stay about _FAST_BLOCK long (tokexp22: the whole text had been one block)."""
    fresh = Tokenizer(tok.vocab, tok.merges, [EOT, " <sep> "])
    text = "The cat sat on the mat <sep> \nA dog ran.\r\n" * 2000  # 90,000 characters
    sizes = []
    encode_pieces = fresh._fast.encode_pieces

    def spy(data, cuts, specials):
        sizes.append(len(data))
        return encode_pieces(data, cuts, specials)

    fresh._fast.encode_pieces = spy
    slow = []
    encode_regex = fresh._encode_regex
    fresh._encode_regex = lambda t: slow.append(len(t)) or encode_regex(t)
    with mock.patch.object(tokenizer_module, "_FAST_BLOCK", 4096):
        ids = fresh.encode(text)
    fresh._encode_regex = encode_regex
    assert ids == regex_path(fresh, text) and ids.count(fresh.special_ids[" <sep> "]) == 2000
    # every safe cut after 4,096 characters falls inside " <sep> " (its trailing space starts " \n"):
    # moved to its start, not joined with the next block, and nothing falls back to the regex path
    assert len(sizes) > 15 and max(sizes) < 4096 + 100 and slow == [], (sizes, slow)


def test_encode_pieces_splits_the_ids_at_pre_token_starts(tok):
    text = "One line.\nTwo words\nthree"
    data = text.encode()
    whole = tok._fast.encode(data).tolist()
    pieces = tok._fast.encode_pieces(data, [9, 19])
    assert [p.tolist() for p in pieces] == [regex_path(tok, text[:9]), regex_path(tok, text[9:19]),
                                            regex_path(tok, text[19:])]
    assert sum((p.tolist() for p in pieces), []) == whole
    assert tok._fast.encode_pieces(data, [5]) is None  # inside the pre-token " line"
    assert tok._fast.encode_pieces(data, [len(data)]) is None  # past the last pre-token's start


def test_long_words_of_the_same_blocks_in_another_order_hash_apart():
    """The hash summed one random value per (position mod 64, byte): "a"*64 + "b"*64 and its
    reverse always collided (the byte check caught it, at the cost of the slow path)."""
    words = [b"a" * 64 + b"b" * 64, b"b" * 64 + b"a" * 64, b"ab" * 64, b"ba" * 64]
    b = np.frombuffer(b"".join(words), dtype=np.uint8)
    keys, hashed = vz._token_keys(b, np.arange(4) * 128, np.full(4, 128))
    assert hashed.tolist() == [0, 1, 2, 3] and len(set(keys.tolist())) == 4


def test_encode_to_numpy_gives_a_writable_array_on_every_path(tok):
    """The regex path's ids were a read-only view of bytes ('café'), the fast path's writable ('hello')."""
    for text in ("hello", "café", "東京 x", ""):
        ids = tok.encode_to_numpy(text)
        assert ids.flags.writeable, text
        if ids.size:
            ids[0] = ids[0]


def test_a_short_text_of_new_words_skips_the_batch(tok, monkeypatch):
    """A handful of new words go one at a time: BatchBPE's numpy calls cost more than they save there
    (German lines between special tokens encoded 2.4x slower when every segment went through it)."""
    fresh = Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    monkeypatch.setattr(fresh, "_bpe_many", lambda words: pytest.fail(f"batched {len(words)} words"))
    text = "Zwei Männer stehen am Herd." + EOT + "Ein Mädchen läuft."
    assert fresh.encode(text) == regex_path(tok, text)


@settings(max_examples=500, deadline=None)
@given(FAST)
def test_the_fast_path_takes_two_byte_characters(tok, text):
    ids = tok._fast.encode(text.encode())
    assert ids is not None and ids.tolist() == regex_path(tok, text)


def test_german_takes_the_fast_path_and_encodes_like_tiktoken(monkeypatch):
    """Accented letters sent German (and French, Greek, Russian, Hindi, Chinese...) text down the regex
    path, 0.7x tiktoken's speed warm; characters of two and three UTF-8 bytes now take the vectorised path."""
    import gzip

    gpt2 = Tokenizer.from_files(data_file("gpt2_vocab.json"), data_file("gpt2_merges.txt"), [EOT])
    enc = tiktoken_gpt2_with(gpt2)
    with gzip.open(data_file("multi30k/train.de.gz"), "rt", encoding="utf-8") as f:
        text = "".join(f.readlines()[:3000])
    assert "ä" in text and "ß" in text
    monkeypatch.setattr(gpt2, "_encode_chars", lambda t: pytest.fail(f"regex path for {t[:40]!r}"))
    assert gpt2.encode(text) == enc.encode(text, allowed_special="all")
    greek_russian = "Καλημέρα κόσμε, 2½ ώρες. Привет, мир! Ёлка — это ель.\n" * 20
    assert gpt2.encode(greek_russian) == enc.encode(greek_russian)
    three_bytes = "東京は日本の首都です。「こんにちは」と言った。\nहिन्दी में २०२४ लिखा।\nภาษาไทย ๑๒๓\n한국어 ３人\n" * 20
    assert gpt2.encode(three_bytes) == enc.encode(three_bytes)
    four_bytes = "Love it 🙂🙂 👍🏽 😀! 𝐀𝐁𝐂 = 𝟎𝟗, 𠮷野家 🇩🇪's \U0010ffff\n" * 20  # took the regex path before
    assert gpt2.encode(four_bytes) == enc.encode(four_bytes)
    # so did these
    spaces = "Preis:\xa0100\xa0€ \xa0 \xa0\xa0x\n東京\u3000大阪\u3000\u3000駅\u2009\u2009km \u202f%\u3000\n" * 20
    assert gpt2.encode(spaces) == enc.encode(spaces)


def test_a_short_text_takes_the_regex_path_and_gets_the_vectorised_paths_ids():
    """Sentences encoded one call each (`lm tokenize --target` with a tokenizer that has no special
    token to join them with) cost 115 us each on the vectorised path, whose set-up dominates there,
    against 4 us on the regex path: Multi30k's 29,000 pairs took 16 s. A text under ``_SHORT_TEXT``
    characters now takes the regex path; a longer one the vectorised path, as before."""
    import gzip

    gpt2 = Tokenizer.from_files(data_file("gpt2_vocab.json"), data_file("gpt2_merges.txt"), [EOT])
    enc = tiktoken_gpt2_with(gpt2)
    with gzip.open(data_file("multi30k/train.de.gz"), "rt", encoding="utf-8") as f:
        lines = [f.readline().rstrip("\n") for _ in range(400)]
    vectorised = [gpt2.encode(line) for line in lines]  # (_SHORT_TEXT is 0 in this file)
    whole = "".join(line + "\n" for line in lines)
    with mock.patch.object(tokenizer_module, "_SHORT_TEXT", 2048), \
            mock.patch.object(gpt2._fast, "encode_pieces", wraps=gpt2._fast.encode_pieces) as pieces:
        short = [gpt2.encode(line) for line in lines]
        assert pieces.call_count == 0  # every line by the regex path
        assert len(whole) >= 2048 and gpt2.encode(whole) == enc.encode(whole) and pieces.call_count > 0
    assert short == vectorised == [enc.encode(line) for line in lines]
    assert gpt2.vocab_size == 50257 and gpt2._vocab_size == 50257  # counted once, then kept

"""The fast BPE trainer against a brute-force one, and its pre-tokenization pieces."""

from collections import Counter

import pytest
import regex
from helpers.data import GPT2_ENCODER_PY_PATTERN, gpt2_published_pattern
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lm.tokenizer.train as train_mod
from lm.tokenizer import train_bpe
from lm.tokenizer.pretokenize import chunk_boundaries, pretokenize
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


def test_sennrich_example():
    # The worked example of the CS336 handout (Sennrich et al.), with whitespace pre-tokenization.
    counts = {b"low": 5, b"lower": 2, b"widest": 3, b"newest": 6}
    merges = merge_counts(counts, 6)
    assert merges == [(b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"), (b"w", b"est"), (b"n", b"e")]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab ZZ\n\t\r.,'s1²éü€’“—\u00a0\u2028\u3000 😀")), max_size=200))
def test_pretokenize_equals_regex(text):
    assert pretokenize(text) == REFERENCE_REGEX.findall(text)


def test_pretokenize_non_ascii_equals_the_published_patterns():
    text = "Café and Über Straße, naïve façade: ½ cup, 東京 2024年 — l'été's ÆØÅ\u00a0x  \n"
    for pattern in (gpt2_published_pattern(), GPT2_ENCODER_PY_PATTERN):
        assert pretokenize(text) == regex.findall(pattern, text)
    assert pretokenize("Café and Über Straße") == ["Café", " and", " Über", " Straße"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(st.sampled_from(list("ab  \n\n.é\u00a0") + ["<|e|>"]), max_size=400).map("".join),
    target=st.integers(1, 50),
)
def test_chunks_cut_no_pretoken(tmp_path, text, target):
    path = tmp_path / "t.txt"
    data = text.encode("utf-8")
    path.write_bytes(data)
    chunks = chunk_boundaries(path, ["<|e|>"], target)
    if not data:
        assert chunks == []
        return
    assert chunks[0][0] == 0 and chunks[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    whole = Counter()
    for seg in regex.split(r"<\|e\|>", text):
        whole.update(REFERENCE_REGEX.findall(seg))
    pieces = Counter()
    for a, b in chunks:
        for seg in regex.split(r"<\|e\|>", data[a:b].decode("utf-8")):
            pieces.update(REFERENCE_REGEX.findall(seg))
    assert pieces == whole


OVERLAPPING_SPECIALS = [
    (["<|a|>", "<|a|><|b|>", "<|b|>"], "xx<|a|><|b|>yy<|a|>\n<|b|><|a|><|b|><|a|>z.\n"),
    (["ab", "bc"], "xxabcxx\nabc.\nbcab"),
    (["<|endoftext|>", "endoftext"], "aa<|endoftext|>bb\nendoftext.\n<|endoftext|>"),
    (["ab", "ba"], "xabababx.\nbababa.\n"),  # a chain of overlaps
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
    with pytest.warns(UserWarning, match="40 bytes are not valid UTF-8"):  # 2 bad bytes x 20
        vocab, merges = train_bpe(path, 270, [])
    assert len(vocab) == 270


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vocab_size": 100, "special_tokens": []}, "vocab_size: 100 is below"),
        ({"vocab_size": 256, "special_tokens": ["<s>"]}, "vocab_size: 256 is below"),
        ({"vocab_size": 300, "special_tokens": ["<s>", "<s>"]}, "duplicate special token '<s>'"),
        ({"vocab_size": 300, "special_tokens": [""]}, "non-empty string"),
        ({"vocab_size": "300", "special_tokens": []}, "vocab_size: expected an integer"),
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

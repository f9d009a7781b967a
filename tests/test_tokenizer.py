"""Encoding and decoding: round trips, special tokens, streaming, files, and parity with tiktoken / tokenizers."""

import io
import json
import tracemalloc

import numpy as np
import pytest
from helpers.data import data_file, gpt2_published_pattern
from hypothesis import given, settings
from hypothesis import strategies as st

from lm.tokenizer import Tokenizer, train_bpe
from lm.tokenizer.byte_unicode import unicode_str_to_bytes

EOT = "<|endoftext|>"

SAMPLE = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine.\n"
    "One day, she saw a big, red ball. \"Can I play with it?\" she asked her mom. Her mom said, \"Yes!\"\n"
    "Über café naïve — résumé 東京 😀 1234 5,678.9 don't I'll we've they're   spaces\t\ttabs\r\n"
)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "corpus.txt"
    path.write_text((SAMPLE + EOT) * 40, encoding="utf-8")
    vocab, merges = train_bpe(path, 400, [EOT])
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return Tokenizer.from_files(data_file("gpt2_vocab.json"), data_file("gpt2_merges.txt"), [EOT])


def tiktoken_gpt2():
    tiktoken = pytest.importorskip("tiktoken")
    vocab = json.loads(data_file("gpt2_vocab.json").read_text(encoding="utf-8"))
    ranks = {unicode_str_to_bytes(s): i for s, i in vocab.items() if s != EOT}
    # GPT-2's pattern as tiktoken publishes it, not lm's GPT2_PATTERN: a wrong pattern must not match itself
    pattern = gpt2_published_pattern()
    return tiktoken.Encoding("gpt2-local", pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOT: 50256})


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_arbitrary_unicode(small_tokenizer, text):
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_special_tokens_and_overlap():
    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [], ["<|a|>", "<|a|><|b|>", "<|b|>"])
    ids = tok.encode("x<|a|><|b|>y<|a|>z<|b|>")
    a, ab, b = (tok.token_to_id[t.encode()] for t in ["<|a|>", "<|a|><|b|>", "<|b|>"])
    assert ids == [ord("x"), ab, ord("y"), a, ord("z"), b]  # the longest special wins
    assert tok.decode(ids) == "x<|a|><|b|>y<|a|>z<|b|>"
    assert {a, ab, b} == {256, 257, 258}  # appended after the vocab


def test_special_token_never_merges_with_text(small_tokenizer):
    ids = small_tokenizer.encode(f"hello{EOT}world")
    eot = small_tokenizer.token_to_id[EOT.encode()]
    assert ids.count(eot) == 1
    i = ids.index(eot)
    assert small_tokenizer.decode(ids[:i]) == "hello" and small_tokenizer.decode(ids[i + 1 :]) == "world"


def test_merges_apply_in_rank_order():
    vocab = {i: bytes([i]) for i in range(256)}
    vocab.update({256: b"bc", 257: b"ab", 258: b"abc"})
    # "bc" ranks before "ab": "abc" -> a + bc, and (a, bc) is no merge, so "abc" is never reached
    tok = Tokenizer(vocab, [(b"b", b"c"), (b"a", b"b"), (b"ab", b"c")])
    assert tok.encode("abc") == [ord("a"), 256]
    assert tok.encode("abd") == [257, ord("d")]


def test_decode_malformed_utf8_and_bad_ids(small_tokenizer):
    e_acute = small_tokenizer.encode("é")
    first_byte = small_tokenizer.token_to_id[b"\xc3"]
    assert small_tokenizer.decode([first_byte]) == "\ufffd"
    assert small_tokenizer.decode(e_acute) == "é"
    with pytest.raises(ValueError, match="ids: 999999 is not a token id"):
        small_tokenizer.decode([1, 999999])
    with pytest.raises(ValueError, match="ids: -1 is not a token id"):
        small_tokenizer.decode([-1])


def test_decode_takes_any_iterable_of_ids_and_names_the_bad_one(small_tokenizer):
    """An iterator was read twice (a bad id then raised an empty StopIteration) and a tensor's
    elements, 0-d tensors, were never keys of the vocab (so 104 "is not a token id")."""
    import torch

    tok = small_tokenizer
    ids = tok.encode("hello world")
    text = tok.decode(ids)
    assert text == "hello world"
    for same in (iter(ids), tuple(ids), (i for i in ids), torch.tensor(ids), np.array(ids, dtype=np.uint16),
                 np.array(ids), [np.int64(i) for i in ids]):
        assert tok.decode(same) == text
    bad = ids[:1] + [999999]
    for form in (iter(bad), torch.tensor(bad), np.array(bad), (i for i in bad), [np.int64(bad[0]), bad[1]]):
        with pytest.raises(ValueError, match="ids: 999999 is not a token id"):
            tok.decode(form)
    with pytest.raises(ValueError, match="ids: 2.5 is not a token id"):
        tok.decode(iter([ids[0], 2.5]))
    with pytest.raises(ValueError, match="ids: expected a 1-D sequence of token ids, got the scalar 104"):
        tok.decode(torch.tensor(104))


def test_encode_to_numpy_equals_encode(small_tokenizer):
    text = (SAMPLE + EOT) * 3
    ids = small_tokenizer.encode(text)
    for dtype in (np.uint16, np.uint32, "uint16", np.dtype(">u4")):
        arr = small_tokenizer.encode_to_numpy(text, dtype)
        assert arr.dtype == np.dtype(dtype) and arr.tolist() == ids
    assert small_tokenizer.encode_to_numpy("").tolist() == []
    with pytest.raises(ValueError, match="dtype: must be uint16 or uint32, got float32"):
        small_tokenizer.encode_to_numpy(text, np.float32)


def test_ids_in_the_surrogate_range_and_beyond_uint16(small_tokenizer):
    """Ids travel through the cache as characters: ids that are UTF-16 surrogates, or above
    65,535, must come back exactly (the same tokenizer with its ids moved there)."""
    n = small_tokenizer.vocab_size
    moved = {i: (0xD7F0 + i if i % 2 else 0x10FF00 - i) for i in range(n)}
    tok = Tokenizer({moved[i]: b for i, b in small_tokenizer.vocab.items()}, small_tokenizer.merges, [EOT])
    text = (SAMPLE + EOT) * 2
    expected = [moved[i] for i in small_tokenizer.encode(text)]
    assert any(0xD800 <= i < 0xE000 for i in expected) and any(i > 0xFFFF for i in expected)
    assert tok.encode(text) == expected
    assert tok.encode_to_numpy(text, np.uint32).tolist() == expected
    assert tok.decode(expected) == text
    with pytest.raises(ValueError, match="dtype: uint16 cannot hold the ids of a vocab of size"):
        tok.encode_to_numpy(text, np.uint16)
    with pytest.raises(ValueError, match=r"vocab: ids must be integers in \[0, 1114111\], got 1114112"):
        Tokenizer({**small_tokenizer.vocab, 0x110000: b"zz"}, [], [])


def test_encode_iterable_equals_encode_on_multi_mb_input(small_tokenizer, tmp_path):
    text = (SAMPLE + EOT + "a  \n  b\n\n" + SAMPLE.upper()) * 8000  # ~3 MB, odd whitespace at line ends
    path = tmp_path / "big.txt"
    path.write_text(text, encoding="utf-8")
    expected = small_tokenizer.encode(text)
    with open(path, encoding="utf-8", newline="") as f:
        assert list(small_tokenizer.encode_iterable(f)) == expected
    # pieces that cut through special tokens, words and whitespace runs
    pieces = (text[i : i + 7] for i in range(0, len(text), 7))
    assert list(small_tokenizer.encode_iterable(pieces)) == expected


def test_encode_iterable_constant_memory(small_tokenizer, tmp_path):
    path = tmp_path / "big.txt"
    path.write_text((SAMPLE + EOT) * 20000, encoding="utf-8")  # ~5.6 MB
    size = path.stat().st_size
    small_tokenizer.encode(SAMPLE)  # warm the cache
    tracemalloc.start()
    n = 0
    with open(path, encoding="utf-8") as f:
        for _ in small_tokenizer.encode_iterable(f):
            n += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n > 1_000_000
    assert peak < 2_000_000 < size, f"peak {peak} bytes while streaming a {size}-byte file"


def test_save_and_from_files_round_trip(small_tokenizer, tmp_path):
    small_tokenizer.save(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert (tmp_path / "merges.txt").read_text(encoding="utf-8").startswith("#version")
    loaded = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT])
    assert loaded.vocab == small_tokenizer.vocab
    assert loaded.merges == small_tokenizer.merges
    assert loaded.encode(SAMPLE + EOT) == small_tokenizer.encode(SAMPLE + EOT)


def test_from_files_errors(small_tokenizer, tmp_path):
    small_tokenizer.save(tmp_path / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="vocab_path: file not found"):
        Tokenizer.from_files(tmp_path / "missing.json", tmp_path / "merges.txt")
    # merges that need tokens the vocab lacks: the files do not belong together
    (tmp_path / "other.txt").write_text("#version: 0.2\nq z\nqz y\n", encoding="utf-8")
    with pytest.raises(ValueError, match="vocab and merges do not belong together"):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "other.txt")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="vocab_path: .* is not valid JSON"):
        Tokenizer.from_files(tmp_path / "bad.json", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="duplicate special token"):
        Tokenizer(small_tokenizer.vocab, small_tokenizer.merges, [EOT, EOT])


def read_real_texts():
    texts = {name: data_file(name).read_text(encoding="utf-8") for name in
             ["tinystories_sample.txt", "tinyshakespeare.txt", "tinystories_valid_head.txt"]}
    with open(data_file("gutenberg.txt"), encoding="utf-8") as f:
        texts["gutenberg[:3MB]"] = f.read(3_000_000)
    return texts


def test_gpt2_matches_tiktoken_on_real_text(gpt2):
    enc = tiktoken_gpt2()
    texts = {**read_real_texts(), "non-ASCII": "Café and Über Straße. " + SAMPLE}
    for name, text in texts.items():
        ours = gpt2.encode(text)
        assert ours == enc.encode(text, allowed_special="all"), name
        assert gpt2.decode(ours) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_gpt2_matches_tiktoken_on_arbitrary_text(gpt2, text):
    enc = tiktoken_gpt2()
    assert gpt2.encode(text) == enc.encode(text, disallowed_special=())


def test_gpt2_original_file_format_is_read(tmp_path, gpt2):
    # GPT-2's own vocab.bpe starts with a "#version" line
    merges = data_file("gpt2_merges.txt").read_text(encoding="utf-8")
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n" + merges, encoding="utf-8")
    tok = Tokenizer.from_files(data_file("gpt2_vocab.json"), tmp_path / "vocab.bpe", [EOT])
    assert tok.merges == gpt2.merges and len(tok.merges) == 50000
    assert tok.encode("Hello world" + EOT) == [15496, 995, 50256]


def test_hf_tokenizer_json_encodes_identically(small_tokenizer, gpt2, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    texts = read_real_texts()
    for tok in (small_tokenizer, gpt2):
        tok.save_hf(tmp_path / "tokenizer.json")
        hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        for name, text in texts.items():
            text = text[:300_000]
            ids = tok.encode(text)
            assert hf.encode(text).ids == ids, name
            assert hf.decode(ids, skip_special_tokens=False) == text, name
        assert hf.encode(SAMPLE + EOT + "x").ids == tok.encode(SAMPLE + EOT + "x")


def test_stream_from_stringio(small_tokenizer):
    text = SAMPLE * 3 + EOT
    assert list(small_tokenizer.encode_iterable(io.StringIO(text))) == small_tokenizer.encode(text)

"""`lm tokenizer train` and `lm tokenize`: outputs, sidecar, parallel = serial, and one-line errors."""

import json
import os
import signal

import numpy as np
import pytest

from lm.cli import main
from lm.data import read_token_file, tokenize_file
from lm.tokenizer import Tokenizer, load_tokenizer_dir, save_tokenizer_dir, train_bpe

EOT = "<|endoftext|>"
STORY = (
    "Tom had a red ball. He liked to throw it high. One day the ball went over the fence!\n"
    "\"Oh no,\" said Tom. His friend Mia helped him find it — under a big tree. Café time.\n"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    path = d / "stories.txt"
    path.write_text("".join(f"{STORY}Story {i}.\n{EOT}\n" for i in range(3000)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tok"
    rc = main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "350", "--special-token", EOT,
               "--out", str(out), "--quiet", "--holdout-bytes", "20000"])
    assert rc == 0
    return out


def test_train_writes_files_and_summary(trained, corpus):
    for name in ["vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "summary.json"]:
        assert (trained / name).is_file(), name
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["vocab_size"] == 350
    assert set(summary["seconds"]) >= {"pretokenize", "merge", "total"}
    assert summary["peak_rss_mb"] > 0
    assert summary["heldout_bytes"] > 0 and summary["bytes_per_token_heldout"] > 1.5
    assert summary["train_bytes"] + summary["heldout_bytes"] == corpus.stat().st_size
    tok = load_tokenizer_dir(trained)
    assert tok.special_tokens == [EOT] and tok.vocab[0] == EOT.encode()
    assert tok.decode(tok.encode(STORY)) == STORY


@pytest.mark.parametrize(("workers", "warm_bytes"), [(1, 3000), (2, 3000), (2, 1 << 30)])
def test_tokenize_file_equals_encode(trained, corpus, tmp_path, workers, warm_bytes):
    tok = load_tokenizer_dir(trained)
    meta = tokenize_file(tok, corpus, tmp_path / "t.bin", num_workers=workers, chunk_bytes=10_000,
                         warm_bytes=warm_bytes)
    ids, meta2 = read_token_file(tmp_path / "t.bin")
    assert meta == meta2
    expected = tok.encode(corpus.read_text(encoding="utf-8"))
    assert ids.dtype == np.uint16 and ids.tolist() == expected
    assert meta["num_tokens"] == len(expected)
    assert meta["source_bytes"] == corpus.stat().st_size
    assert meta["tokenizer_sha256"] == tok.checksum() and meta["vocab_size"] == tok.vocab_size


@pytest.mark.parametrize("specials", [["<|a|>", "<|a|><|b|>", "<|b|>"], ["ab", "bc"], ["<|endoftext|>", "endoftext"]])
def test_tokenize_file_equals_encode_for_any_chunk_size_with_overlapping_special_tokens(tmp_path, specials):
    """The file was cut at the first occurrence of a special token after the chunk target, even one
    inside a longer special token that starts before it ("<|b|>" in "<|a|><|b|>"): the ids then
    depended on where the targets fell, and differed from encode's."""
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], specials)
    text = "xx<|a|><|b|>yy abc\n<|endoftext|>endoftext bcab.\n<|b|><|a|><|b|>ab\nbc"
    path = tmp_path / "in.txt"
    path.write_text(text, encoding="utf-8")
    expected = tok.encode(text)
    for chunk_bytes in range(1, len(text) + 1):
        tokenize_file(tok, path, tmp_path / "out.bin", num_workers=1, chunk_bytes=chunk_bytes)
        assert read_token_file(tmp_path / "out.bin")[0].tolist() == expected, chunk_bytes


def test_tokenize_cli_with_the_default_chunk_target_inside_a_special_token(tmp_path, capsys):
    specials = ["<|a|>", "<|a|><|b|>", "<|b|>"]
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], specials)
    save_tokenizer_dir(tok, tmp_path / "tok")
    text = "x" * ((1 << 21) - 2) + "<|a|><|b|> tail\n"  # the 2 MiB chunk target falls 2 bytes into "<|a|><|b|>"
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    assert main(["tokenize", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "in.txt"),
                 "--out", str(tmp_path / "in.bin"), "--num-workers", "1", "--quiet"]) == 0
    assert read_token_file(tmp_path / "in.bin")[0].tolist() == tok.encode(text)


def test_tokenize_cli_and_uint32(trained, corpus, tmp_path, capsys):
    assert main(["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--out",
                 str(tmp_path / "c.bin"), "--quiet"]) == 0
    assert "tokens (uint16)" in capsys.readouterr().out
    ids, _ = read_token_file(tmp_path / "c.bin")
    assert ids.tolist() == load_tokenizer_dir(trained).encode(corpus.read_text(encoding="utf-8"))
    big = Tokenizer({i: bytes([i]) for i in range(256)} | {70000: b"zz"}, [])
    tokenize_file(big, corpus, tmp_path / "u32.bin")
    ids, meta = read_token_file(tmp_path / "u32.bin")
    assert meta["dtype"] == "uint32" and ids.dtype == np.uint32
    # no merges: one id per byte, the same ids encode gives
    assert ids.tolist() == big.encode(corpus.read_text(encoding="utf-8")) == list(corpus.read_bytes())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tokenizer", "train", "--input", "MISSING", "--vocab-size", "300", "--out", "OUT"],
         "--input: file not found: 'MISSING'"),
        (["tokenizer", "train", "--input", "EMPTY", "--vocab-size", "300", "--out", "OUT"], "--input: file is empty"),
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "100", "--out", "OUT"],
         "--vocab-size: 100 is below 256 bytes + 0 special token(s) = 256"),  # the flag, not the parameter
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "<s>",
          "--special-token", "<s>", "--out", "OUT"], "duplicate special token '<s>'"),
        (["tokenize", "--tokenizer", "NODIR", "--input", "CORPUS", "--out", "OUT/x.bin"], "tokenizer: not a directory"),
        (["tokenize", "--tokenizer", "TOK", "--input", "MISSING", "--out", "OUT/x.bin"],
         "--input: file not found: 'MISSING'"),
        (["tokenize", "--tokenizer", "TOK", "--input", "EMPTY", "--out", "OUT/x.bin"],
         "--input: file is empty: 'EMPTY'"),  # the flag, not the library's parameter "input"
        # special tokens that the tokenizer's files could not hold: refused before training
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "@", "--out", "OUT"],
         "--special-token: '@' cannot be saved in vocab.json: '@' is already the key of token"),
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "é", "--out", "OUT"],
         "--special-token: 'é' cannot be saved in tokenizer.json"),
        # ... and the spelling of a token training may learn: found only after training, it had thrown it away
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "Ġthe", "--out", "OUT"],
         "--special-token: 'Ġthe' is how vocab.json and tokenizer.json spell the bytes b' the', which training may"),
    ],
)
def test_cli_errors_are_one_line(argv, message, corpus, trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY").write_text("")
    argv = [{"CORPUS": str(corpus), "TOK": str(trained)}.get(a, a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "OUT").exists() or not any((tmp_path / "OUT").iterdir())


def test_train_with_a_newline_special_token_reloads_exactly(tmp_path, capsys):
    """With --special-token "\n" the special token and the byte b"\n" were written under one key: the
    folder reloaded with one token fewer and the special token at another id."""
    corpus = tmp_path / "lines.txt"
    corpus.write_text("".join(f"{STORY}line {i}\n" for i in range(200)), encoding="utf-8")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--special-token", "\n",
                 "--special-token", EOT, "--out", str(out), "--quiet", "--holdout-bytes", "0",
                 "--num-workers", "1"]) == 0
    vocab, merges = train_bpe(corpus, 300, ["\n", EOT], num_workers=1)
    trained = Tokenizer(vocab, merges, ["\n", EOT])
    loaded = load_tokenizer_dir(out)
    assert loaded.checksum() == trained.checksum() and loaded.vocab_size == 300
    assert loaded.encode(STORY) == trained.encode(STORY) and loaded.token_to_id[b"\n"] == 0
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert hf.encode(STORY + EOT).ids == trained.encode(STORY + EOT)


def test_interrupted_tokenize_leaves_no_output(trained, corpus, tmp_path, monkeypatch):
    class Interrupted(Tokenizer):  # Ctrl-C while the first chunk is encoded
        def encode_to_numpy(self, text, dtype=None):
            raise KeyboardInterrupt

    tok = load_tokenizer_dir(trained)
    with pytest.raises(KeyboardInterrupt):
        tokenize_file(Interrupted(tok.vocab, tok.merges, tok.special_tokens), corpus, tmp_path / "x.bin",
                      num_workers=1)
    assert list(tmp_path.iterdir()) == []


_SIGINT_AT_FORK = []  # armed by the test below: os.register_at_fork hooks cannot be removed


def _sigint_at_fork():
    if _SIGINT_AT_FORK:
        os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_that_lands_while_the_workers_fork_is_raised_not_dropped(capfd):
    """A SIGINT during a fork would run its handler inside the interpreter's at-fork hooks, which
    print "Exception ignored" and drop it; the pool holds it back until the workers are forked."""
    from lm.tokenizer.workers import WorkerPool

    if not hasattr(os, "register_at_fork"):
        pytest.skip("no os.register_at_fork here")
    if not getattr(_sigint_at_fork, "registered", False):
        os.register_at_fork(after_in_parent=_sigint_at_fork)
        _sigint_at_fork.registered = True
    _SIGINT_AT_FORK.append(True)
    try:
        with pytest.raises(KeyboardInterrupt):
            with WorkerPool(2, abs) as pool:
                list(pool.map([-1, -2]))
    finally:
        _SIGINT_AT_FORK.clear()
    assert "Exception ignored" not in capfd.readouterr().err
    with WorkerPool(2, abs) as pool:  # and the pool works as before
        assert list(pool.map([-1, -2, 3])) == [1, 2, 3]


def test_invalid_utf8_in_tokenize_warns(trained, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"Tom had a ball \xff\xfe.\n" * 10)
    with pytest.warns(UserWarning, match="20 bytes .* not valid UTF-8"):  # 2 bad bytes x 10 lines
        meta = tokenize_file(load_tokenizer_dir(trained), path, tmp_path / "b.bin", num_workers=1)
    # each invalid byte becomes U+FFFD, as bytes.decode(errors="replace") does, and the rest is encoded as usual
    tok = load_tokenizer_dir(trained)
    expected = tok.encode("Tom had a ball \ufffd\ufffd.\n" * 10)
    assert expected == tok.encode(path.read_bytes().decode("utf-8", errors="replace"))
    ids, _ = read_token_file(tmp_path / "b.bin")
    assert ids.tolist() == expected and meta["num_tokens"] == len(expected)
    assert tok.decode(ids.tolist()) == "Tom had a ball \ufffd\ufffd.\n" * 10


def test_a_token_file_or_binary_data_as_input_text_is_refused(trained, corpus, tmp_path, capsys):
    """A token file (or other binary data) given as --input had drawn only a warning about invalid
    UTF-8 and been tokenized, or trained on, as if it were text."""
    tok = ["--tokenizer", str(trained)]
    assert main(["tokenize", *tok, "--input", str(corpus), "--out", str(tmp_path / "t.bin")]) == 0
    capsys.readouterr()
    (tmp_path / "random.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    for argv, message in (
        (["tokenize", *tok, "--input", str(tmp_path / "t.bin"), "--out", str(tmp_path / "u.bin")],
         "is a token file written by `lm tokenize`, not text"),
        (["tokenizer", "train", "--input", str(tmp_path / "t.bin"), "--vocab-size", "300", "--out",
          str(tmp_path / "tok2")], "is a token file written by `lm tokenize`, not text"),
        (["tokenize", *tok, "--input", str(tmp_path / "random.txt"), "--out", str(tmp_path / "u.bin")],
         "is not text (it holds NUL bytes, or is mostly not UTF-8)"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--input: " in err and message in err, err
    assert not (tmp_path / "u.bin").exists() and not (tmp_path / "tok2").exists()


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_tokenize_never_writes_into_the_tokenizer_folder(trained, corpus, tmp_path, capsys):
    """`--out TOK/vocab` would write its sidecar over TOK/vocab.json: the --tokenizer folder is an input."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(trained, tok)
    before = _files(tok)
    for out in (tok / "vocab", tok / "new.bin"):
        assert main(["tokenize", "--tokenizer", str(tok), "--input", str(corpus), "--out", str(out),
                     "--quiet", "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--out: {str(out)!r} is inside the --tokenizer folder" in err and len(err.splitlines()) == 1, err
    assert _files(tok) == before and load_tokenizer_dir(tok).vocab_size == 350


def test_overwrite_replaces_a_sidecar_or_offsets_only_when_they_are_ours(trained, corpus, tmp_path, capsys):
    """`--out X` also writes X.json (and for a pair file X.idx): a file of that name that lm did not
    write is never replaced, even with --overwrite."""
    (tmp_path / "keep.json").write_text('{"my": "notes"}')
    (tmp_path / "src.txt").write_text("a red ball\nthe dog\n")
    (tmp_path / "tgt.txt").write_text("ein roter ball\nder hund\n")
    pair = ["--target", str(tmp_path / "tgt.txt")]
    tok = ["tokenize", "--tokenizer", str(trained), "--quiet", "--overwrite"]
    # a token file whose sidecar name is taken by someone else's file; an earlier token file next
    # to someone's X.idx, which a pair file would write over
    assert main([*tok, "--input", str(corpus), "--out", str(tmp_path / "t.bin")]) == 0
    (tmp_path / "t.bin.idx").write_text("mine")
    (tmp_path / "p.bin.idx").write_text("mine too")
    capsys.readouterr()
    before = _files(tmp_path)
    for argv, path, what in [
        ([*tok, "--input", str(corpus), "--out", str(tmp_path / "keep")], "keep.json", "the sidecar of a token"),
        ([*tok, "--input", str(tmp_path / "src.txt"), *pair, "--out", str(tmp_path / "keep")], "keep.json",
         "the sidecar of a token"),
        ([*tok, "--input", str(tmp_path / "src.txt"), *pair, "--out", str(tmp_path / "p.bin")], "p.bin.idx",
         "the offsets of a pair file"),
        ([*tok, "--input", str(tmp_path / "src.txt"), *pair, "--out", str(tmp_path / "t.bin")], "t.bin.idx",
         "the offsets of a pair file"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert f"--out: {str(tmp_path / path)!r} exists and is not {what}" in err and len(err.splitlines()) == 1, err
    assert _files(tmp_path) == before
    # what lm wrote is still replaced with --overwrite: a pair file, then a token file over it (its offsets go)
    (tmp_path / "p.bin.idx").unlink()
    assert main([*tok, "--input", str(tmp_path / "src.txt"), *pair, "--out", str(tmp_path / "p.bin")]) == 0
    assert main([*tok, "--input", str(tmp_path / "src.txt"), *pair, "--out", str(tmp_path / "p.bin")]) == 0
    assert main([*tok, "--input", str(corpus), "--out", str(tmp_path / "p.bin")]) == 0
    assert not (tmp_path / "p.bin.idx").exists() and read_token_file(tmp_path / "p.bin")[1]["num_tokens"] > 0

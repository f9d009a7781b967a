"""`lm tokenizer train` and `lm tokenize`: outputs, sidecar, parallel = serial, and one-line errors."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers.collector import collector_off
from helpers.data import data_file
from helpers.faults import full_disk_fdopen

from lm.cli import main
from lm.data import read_token_file, tokenize_file
from lm.tokenizer import Tokenizer, load_tokenizer_dir, save_tokenizer_dir, train_bpe
from lm.tokenizer.pretokenize import chunk_boundaries

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


def test_num_workers_is_bounded_and_used_with_target_too(trained, corpus, tmp_path, capsys, monkeypatch):
    """Any --num-workers was taken (10**21), and 1,000 forked one process per 2 MB of the input on a
    2-CPU machine; with --target it was ignored without a word (clifuzz9), then with a warning."""
    from lm.cli.tokenizer import max_workers

    cpus = os.cpu_count()
    too_many = max_workers() + 1
    for argv in (["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--out", str(tmp_path / "a.bin")],
                 ["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "t")]):
        for n, message in ((too_many, f"must be at most {max_workers()} (4 per CPU, {cpus} CPUs here, and at least "
                                      f"64), got {too_many}"), (0, "must be a whole number >= 1, got 0")):
            assert main([*argv, "--num-workers", str(n), "--quiet"]) == 2
            assert capsys.readouterr().err == f"lm {' '.join(argv[:2 if argv[0] == 'tokenizer' else 1])}: error: " \
                                              f"--num-workers: {message}\n"
    assert max_workers() == max(64, 4 * cpus)
    # with --target the pairs go to the workers too (they had been encoded in one process, with a warning)
    (tmp_path / "s.txt").write_text("".join(f"Tom had {i} balls.\n" for i in range(3000)))
    import lm.data.pairs as pairs

    asked, tokenize_pairs = [], pairs.tokenize_pairs
    monkeypatch.setattr(pairs, "tokenize_pairs", lambda *a, **kw: (asked.append((kw["num_workers"], kw["progress"])),
                                                                   tokenize_pairs(*a, **kw))[1])
    for n, quiet in ((1, []), (2, ["--quiet"])):
        t0 = time.perf_counter()
        assert main(["tokenize", "--tokenizer", str(trained), "--input", str(tmp_path / "s.txt"), "--target",
                     str(tmp_path / "s.txt"), "--out", str(tmp_path / f"p{n}.bin"), "--num-workers", str(n),
                     *quiet]) == 0
        out, err = capsys.readouterr()
        assert "warning" not in err
        took = float(re.search(r" in (\d+\.\d)s -> ", out)[1])  # the run's own seconds (mut31: + t0 survived)
        assert took <= round(time.perf_counter() - t0, 1) + 0.05, out
    # the processes asked for, and progress unless --quiet (mut31: dropped, every pair file took the CPU
    # count; progress None, no bar on a terminal)
    assert asked == [(1, True), (2, False)]
    assert (tmp_path / "p1.bin").read_bytes() == (tmp_path / "p2.bin").read_bytes()
    assert (tmp_path / "p1.bin.idx").read_bytes() == (tmp_path / "p2.bin.idx").read_bytes()
    # and a token file's (seed 14: --num-workers dropped there survived; every run took the CPU count)
    import lm.data

    asked, tokenize_file = [], lm.data.tokenize_file
    monkeypatch.setattr(lm.data, "tokenize_file", lambda *a, **kw: (asked.append((kw["num_workers"], kw["progress"])),
                                                                    tokenize_file(*a, **kw))[1])
    for n, quiet in ((1, []), (2, ["--quiet"])):
        assert main(["tokenize", "--tokenizer", str(trained), "--input", str(tmp_path / "s.txt"), "--out",
                     str(tmp_path / f"t{n}.bin"), "--num-workers", str(n), *quiet]) == 0
    assert asked == [(1, True), (2, False)]
    assert (tmp_path / "t1.bin").read_bytes() == (tmp_path / "t2.bin").read_bytes()


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
    # what training learned, not the special token (13 bytes, longer than any token learned here)
    learned = [t for i, t in tok.vocab.items() if i not in tok.special_ids.values()]
    assert summary["longest_token"] == {"bytes": max(map(len, learned)), "text": max(learned, key=len).decode()}
    assert summary["longest_token"]["text"] != EOT and summary["longest_token"]["bytes"] < len(EOT)
    assert tok.special_tokens == [EOT] and tok.vocab[0] == EOT.encode()
    assert tok.decode(tok.encode(STORY)) == STORY


def test_the_summary_of_a_training_that_learned_no_merge_names_no_longest_token(tmp_path):
    """With no merge learned, "longest_token" was byte 0x00, which was neither learned nor in the
    input (audit tokenizer9): null now."""
    (tmp_path / "one.txt").write_text("a")
    for size, specials in (("256", []), ("257", ["--special-token", EOT])):
        out = tmp_path / f"tok{size}"
        assert main(["tokenizer", "train", "--input", str(tmp_path / "one.txt"), "--vocab-size", size, *specials,
                     "--out", str(out), "--quiet"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["num_merges"] == 0 and summary["longest_token"] is None, summary


def test_tokenize_files_bar_counts_the_inputs_bytes_on_a_terminal_when_asked(trained, corpus, tmp_path, monkeypatch):
    """``tokenize_file(progress=True)`` on a terminal: a bar named ``tokenize`` over the input's bytes, to
    the whole file, chunk by chunk; none by default (mutations: the bar's total and name dropped, and a chunk
    counted as its end plus its start, survived: the file had been one chunk)."""
    from helpers.pipes import Terminal
    from tqdm import tqdm

    tok = load_tokenizer_dir(trained)
    size = corpus.stat().st_size
    assert size > 3 * 4096
    for progress in (False, True):
        monkeypatch.setattr(sys, "stderr", Terminal())
        tokenize_file(tok, corpus, tmp_path / f"{progress}.bin", num_workers=1, progress=progress, chunk_bytes=4096)
        drawn = sys.stderr.getvalue()
        if progress:
            whole = re.escape(tqdm.format_sizeof(size))  # as tqdm writes a size with unit_scale
            assert re.search(rf"tokenize: 100%\|.*\| {whole}/{whole} \[.*B/s\]", drawn), (whole, drawn[-300:])
        else:
            assert drawn == ""


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


def test_tokenize_file_refuses_an_empty_input_and_takes_one_byte(trained, tmp_path):
    """An empty file is refused by name, in the library as on the command line; one of a single byte is
    one token (mutation: `size == 1` for `size == 0`, survived: only the command line's check was seen)."""
    tok = load_tokenizer_dir(trained)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError) as e:
        tokenize_file(tok, tmp_path / "empty.txt", tmp_path / "e.bin")
    assert str(e.value) == f"input: file is empty: {str(tmp_path / 'empty.txt')!r}"
    assert not (tmp_path / "e.bin").exists()
    (tmp_path / "one.txt").write_bytes(b"a")
    assert tokenize_file(tok, tmp_path / "one.txt", tmp_path / "o.bin")["num_tokens"] == 1
    assert read_token_file(tmp_path / "o.bin")[0].tolist() == tok.encode("a")


def test_tokenize_file_in_one_process_keeps_its_tokenizer_while_another_call_runs(trained, corpus, tmp_path):
    """The tokenizer was set in the module and read at every chunk, so a second call in the same
    process (another thread) replaced it, and the first call's later chunks came out in the second
    tokenizer's ids (review18b). Shown without threads: the second call runs inside the first's."""
    tok = load_tokenizer_dir(trained)
    other = Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT])  # bytes: other ids
    encode, text = tok.encode_to_numpy, corpus.read_text(encoding="utf-8")
    nested = []

    def encode_and_meanwhile(piece, dtype=np.uint32):
        if not nested:
            nested.append(tokenize_file(other, corpus, tmp_path / "other.bin", num_workers=1, chunk_bytes=10_000))
        return encode(piece, dtype)

    tok.encode_to_numpy = encode_and_meanwhile
    tokenize_file(tok, corpus, tmp_path / "t.bin", num_workers=1, chunk_bytes=10_000)
    assert nested and read_token_file(tmp_path / "t.bin")[0].tolist() == tok.encode(text)
    assert read_token_file(tmp_path / "other.bin")[0].tolist() == other.encode(text)


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


# Texts whose line ends follow no printable ASCII byte, once cut nowhere: each was one chunk, read,
# decoded and encoded whole in one process, with a peak memory of about 25 times the file.
LINE_END_TEXTS = {
    "crlf": "".join(f"{STORY}Story {i}.\n" for i in range(600)).replace("\n", "\r\n"),
    "cjk": "\u4ece\u524d\u6709\u4e00\u4e2a\u5c0f\u5973\u5b69\uff0c\u5979\u559c\u6b22\u5728\u82b1\u56ed\u91cc\u73a9"
           "\u3002\n" * 3000,
    "trailing-space": "Once upon a time there was a cat. \n" * 3000,
    "unicode-spaces": "Le chat\u00a0!\u2002\n\u3000\u4f60\u597d\u3000\r\nend\u0085\n" * 3000,
}


@pytest.mark.parametrize("kind", sorted(LINE_END_TEXTS))
def test_tokenize_file_cuts_text_whose_lines_end_after_no_ascii(trained, tmp_path, kind):
    tok = load_tokenizer_dir(trained)
    text = LINE_END_TEXTS[kind]
    path = tmp_path / "in.txt"
    path.write_bytes(text.encode())
    size = path.stat().st_size
    assert len(chunk_boundaries(path, [EOT], 10_000)) >= size // 12_000
    tokenize_file(tok, path, tmp_path / "t.bin", num_workers=2, chunk_bytes=10_000, warm_bytes=3000)
    assert read_token_file(tmp_path / "t.bin")[0].tolist() == tok.encode(text)


def test_a_long_stretch_without_a_line_end_is_encoded_whole_with_a_warning(trained, tmp_path, monkeypatch, recwarn):
    """Text with no safe cut for long (one huge line) is still one chunk, held whole: it had been silent."""
    import lm.data.tokenize as tokenize_mod

    monkeypatch.setattr(tokenize_mod, "LONG_CHUNK_BYTES", 2000)
    tok = load_tokenizer_dir(trained)
    path = tmp_path / "in.txt"
    path.write_text("Short line.\n" * 100 + "word " * 1000 + "\nShort line.\n" * 100, encoding="utf-8")
    tokenize_file(tok, path, tmp_path / "t.bin", num_workers=1, chunk_bytes=100)
    assert [str(w.message) for w in recwarn] == [
        f"input: in {str(path)!r}, the 5,012 bytes from byte 1,187 hold no line end or document boundary past their "
        "first 100 to cut at: they are encoded in one piece, in memory"]
    assert read_token_file(tmp_path / "t.bin")[0].tolist() == tok.encode(path.read_text(encoding="utf-8"))
    recwarn.clear()
    path.write_text("Short line.\n" * 1000, encoding="utf-8")
    tokenize_file(tok, path, tmp_path / "t.bin", num_workers=1, chunk_bytes=100)
    assert not recwarn


def test_training_on_a_long_stretch_without_a_line_end_warns_too(tmp_path, monkeypatch, capsys):
    """The README said tokenizer training warns when one huge line is pre-tokenized in one piece; only
    `lm tokenize` did (an 18 MB line trained silently, peaking at 1 GB)."""
    import lm.tokenizer.train as train_mod

    monkeypatch.setattr(train_mod, "LONG_CHUNK_BYTES", 2000)
    real = train_mod.count_pretokens
    monkeypatch.setattr(train_mod, "count_pretokens", lambda *a, **k: real(*a, **{**k, "chunk_bytes": 100}))
    path = tmp_path / "in.txt"
    path.write_text("Short line.\n" * 100 + "word " * 1000 + "\nShort line.\n" * 100, encoding="utf-8")
    with pytest.warns(UserWarning) as caught:
        train_bpe(path, 260, [], num_workers=1)
    assert [str(w.message) for w in caught] == [
        f"input: in {str(path)!r}, the 5,012 bytes from byte 1,187 hold no line end or document boundary past their "
        "first 100 to cut at: they are pre-tokenized in one piece, in memory"]
    assert main(["tokenizer", "train", "--input", str(path), "--vocab-size", "260", "--out", str(tmp_path / "tok"),
                 "--quiet", "--holdout-bytes", "0", "--num-workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "lm tokenizer train: warning: --input: in " in err and "pre-tokenized in one piece" in err, err


def test_tokenize_file_cuts_a_crlf_copy_of_gutenberg(trained, tmp_path):
    """The audit's case: Project Gutenberg text with CRLF line ends (as the raw files come)."""
    text = data_file("gutenberg.txt").read_bytes()[: 3 << 20].decode("utf-8", "ignore").replace(EOT, "")
    text = text.replace("\r\n", "\n").replace("\n", "\r\n")
    path = tmp_path / "crlf.txt"
    path.write_bytes(text.encode())
    tok = load_tokenizer_dir(trained)
    assert len(chunk_boundaries(path, [EOT], 1 << 18)) >= 10
    tokenize_file(tok, path, tmp_path / "t.bin", num_workers=2, chunk_bytes=1 << 18)
    assert read_token_file(tmp_path / "t.bin")[0].tolist() == tok.encode(text)


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
        (["tokenize", "--tokenizer", "NODIR", "--input", "CORPUS", "--out", "OUT/x.bin"],
         "lm tokenize: error: --tokenizer: not found: 'NODIR'"),  # once: not "--tokenizer: tokenizer: ..."
        (["tokenize", "--tokenizer", "TOK", "--input", "MISSING", "--out", "OUT/x.bin"],
         "--input: file not found: 'MISSING'"),
        (["tokenize", "--tokenizer", "TOK", "--input", "EMPTY", "--out", "OUT/x.bin"],
         "--input: file is empty: 'EMPTY'"),  # the flag, not the library's parameter "input"
        # the input is checked before the tokenizer is looked for, as a missing one is (seed 14: the empty
        # check's size changed survived, the library's own check giving the same words later)
        (["tokenize", "--tokenizer", "NODIR", "--input", "EMPTY", "--out", "OUT/x.bin"],
         "lm tokenize: error: --input: file is empty: 'EMPTY'"),
        # the input as its own output, in this process (seed 14: the argument misnamed survived the test of
        # the command in a subprocess, which mutation testing does not see)
        (["tokenize", "--tokenizer", "TOK", "--input", "CORPUS", "--out", "CORPUS", "--overwrite"],
         "is the input --input itself; choose another output"),
        # special tokens that the tokenizer's files could not hold: refused before training
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "@", "--out", "OUT"],
         "--special-token: '@' cannot be saved in vocab.json: '@' is already the key of token"),
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "é", "--out", "OUT"],
         "--special-token: 'é' cannot be saved in tokenizer.json"),
        # ... and the spelling of a token training may learn: found only after training, it had thrown it away
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "Ġthe", "--out", "OUT"],
         "--special-token: 'Ġthe' is how vocab.json and tokenizer.json spell the bytes b' the', which training may"),
        # bytes no UTF-8 text holds (0xE9 before "|") cannot be learned: the reason is Hugging Face's decoding
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "<|café|>", "--out",
          "OUT"], "--special-token: '<|café|>' cannot be saved in tokenizer.json: Hugging Face's byte-level decoder"),
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "ĠÃ", "--out", "OUT"],
         "--special-token: 'ĠÃ' is how vocab.json and tokenizer.json spell the bytes b' \\xc3', which training may"),
        # pieces of one character alone (two continuation bytes): learnable inside a pre-token, though they decode to
        # no text at all (mutation: no text taken for not learnable, survived)
        (["tokenizer", "train", "--input", "CORPUS", "--vocab-size", "300", "--special-token", "ĤĤ", "--out", "OUT"],
         "--special-token: 'ĤĤ' is how vocab.json and tokenizer.json spell the bytes b'\\x82\\x82', which training"),
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


def test_a_vocab_size_the_training_bytes_cannot_give_names_the_held_out_tail(tmp_path, capsys):
    """The error said "the input gives at most N tokens", and the input less its held-out tail was
    what training saw: the same input with --holdout-bytes 0 gave more."""
    path = tmp_path / "small.txt"
    path.write_text(STORY * 60, encoding="utf-8")
    size = path.stat().st_size

    def train(*flags: str) -> str:
        argv = ["tokenizer", "train", "--input", str(path), "--vocab-size", "5000", "--out", str(tmp_path / "tok"),
                "--quiet", *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    err = train()
    held = size // 10  # --holdout-bytes is 1,000,000: a tenth of the input, cut where no pre-token crosses
    found = re.search(r"--vocab-size: the ([\d,]+) training bytes \(([\d,]+) held out, see --holdout-bytes\) give "
                      r"at most ([\d,]+) tokens .*, not 5,000; pass --vocab-size (\d+) or less, or more text, or a "
                      r"smaller --holdout-bytes$", err)
    assert found, err
    trained, heldout, most = (int(found[i].replace(",", "")) for i in (1, 2, 3))
    assert trained + heldout == size and abs(heldout - held) < 200 and most == int(found[4])
    err = train("--holdout-bytes", "0")
    found = re.search(rf"--vocab-size: the input's {size:,} bytes give at most ([\d,]+) tokens .*; pass --vocab-size "
                      r"\d+ or less, or more text$", err)
    assert found and int(found[1].replace(",", "")) >= most, err
    # the limit it names is the one training meets
    assert main(["tokenizer", "train", "--input", str(path), "--vocab-size", str(most), "--out", str(tmp_path / "tok"),
                 "--quiet"]) == 0


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


def _change_once(path: Path, how: str, marker: Path) -> None:
    """Change ``path`` as ``how`` says, the first time only (in whichever process gets here first)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    if how == "truncated":
        os.truncate(path, 5000)
    elif how == "appended":
        with open(path, "a", encoding="utf-8") as f:
            f.write("One more story.\n")
    elif how == "replaced":  # another text of the same size, renamed over it (as a download or a script does)
        other = path.with_name("other.txt")
        other.write_bytes(path.read_bytes().replace(b"ball", b"kite"))
        os.replace(other, path)
    else:
        os.unlink(path)


@pytest.mark.parametrize("how, said", [("truncated", "was changed"), ("appended", "was changed"),
                                       ("replaced", "was replaced by another file"),
                                       ("deleted", "was deleted or moved")])
@pytest.mark.parametrize("workers, first", [(1, False), (2, False), (2, True)])
def test_an_input_changed_while_it_is_tokenized_is_one_line_and_nothing_is_written(
        trained, corpus, tmp_path, monkeypatch, capsys, how, said, workers, first):
    """rest26 R2: the chunks are read by offsets, each anew; a file truncated, written to or replaced
    part way had given a token file of the wrong text and exit 0 (a 206 MB input cut to 20 MB: 28.9M
    tokens where 140.8M, its sidecar keeping the old size, bytes/token 4.9x too large), and one
    deleted the bare "[Errno 2] No such file or directory". Now one line naming --input, exit 2, and
    no output. ``first``: changed as the parent reads the head, before the workers start (review26)."""
    import lm.data.tokenize as tokenize_module

    text = tmp_path / "in.txt"
    text.write_bytes(corpus.read_bytes())
    read = tokenize_module.read_text_range

    def changes_part_way(path, start, end):
        if (start == 0) == first:
            _change_once(Path(path), how, tmp_path / "changed")
        return read(path, start, end)

    monkeypatch.setattr(tokenize_module, "read_text_range", changes_part_way)
    monkeypatch.setattr(tokenize_module.tokenize_file, "__kwdefaults__",
                        {**tokenize_module.tokenize_file.__kwdefaults__, "chunk_bytes": 20_000, "warm_bytes": 3000})
    out = tmp_path / "out" / "t.bin"
    out.parent.mkdir()
    assert main(["tokenize", "--tokenizer", str(trained), "--input", str(text), "--out", str(out),
                 "--num-workers", str(workers), "--quiet"]) == 2
    err = capsys.readouterr().err
    sizes = {"truncated": r" \([\d,]+ bytes then, 5,000 now\)", "appended": r" \([\d,]+ bytes then, [\d,]+ now\)",
             "replaced": rf" \({text.stat().st_size:,} bytes, as before\)" if text.exists() else "", "deleted": ""}[how]
    assert re.fullmatch(rf"lm tokenize: error: --input: '{re.escape(str(text))}' {said} while it was tokenized"
                        rf"{sizes}; nothing was written\n", err), err
    assert list(out.parent.iterdir()) == [] and (tmp_path / "changed").exists()


def test_reading_a_range_past_the_end_of_a_file_is_an_error_not_a_short_text(tmp_path):
    """read_text_range had returned the bytes there were: a range cut before the file was truncated
    read as a shorter text, silently."""
    from lm.io import FileChangedError, read_text_range

    path = tmp_path / "t.txt"
    path.write_bytes(b"0123456789")
    assert read_text_range(path, 2, 10) == ("23456789", 0)
    for start, end in ((2, 12), (20, 30)):  # the file's own size, not where the read stopped (review26)
        with pytest.raises(FileChangedError, match=rf"^'.*t\.txt' is 10 bytes, shorter than the range \[{start}, "
                                                   rf"{end}\) read from it: was it changed while it was read\?$"):
            read_text_range(path, start, end)


@pytest.mark.parametrize("how", ["truncated", "appended", "replaced"])
def test_an_input_changed_while_the_tokenizer_counts_it_is_an_error(corpus, tmp_path, monkeypatch, how):
    """The same for training: counts of no one file's text had made a tokenizer."""
    import lm.tokenizer.train as train_module
    from lm.io import FileChangedError

    text = tmp_path / "in.txt"
    text.write_bytes(corpus.read_bytes())
    read = train_module.read_text_range

    def changes_part_way(path, start, end):
        if start > 0:
            _change_once(Path(path), how, tmp_path / "changed")
        return read(path, start, end)

    monkeypatch.setattr(train_module, "read_text_range", changes_part_way)
    sizes = r"[\d,]+ bytes, as before" if how == "replaced" else r"[\d,]+ bytes then, [\d,]+ now"
    with pytest.raises(FileChangedError, match=r"^input: '.*in\.txt' was (changed|replaced by another file) while "
                                               rf"it was read \({sizes}\); nothing was written$"):
        train_module.count_pretokens([(str(text), 0, text.stat().st_size)], [EOT], num_workers=1, chunk_bytes=20_000)


def test_a_held_out_tail_cut_short_after_training_names_the_input(trained, corpus, tmp_path):
    """The held-out tail is read last, after the merges: a file truncated by then had said "'x' ends
    at byte 190,003" (the read's start, not the file's end) without naming --input (review26)."""
    from lm.io import FileChangedError
    from lm.tokenizer.train import TrainStats, training_summary

    text = tmp_path / "in.txt"
    text.write_bytes(corpus.read_bytes()[:50_000])
    with pytest.raises(FileChangedError, match=r"^input: '.*in\.txt' is 50,000 bytes, shorter than the range "
                                               r"\[60,000, 70,000\) read from it: was it changed while it was read\? "
                                               r"\(the held-out tail, read after the training\)$"):
        training_summary(load_tokenizer_dir(trained), TrainStats(), [text], (str(text), 60_000, 70_000),
                         {"save": 0.0, "since_start": 0.0})


def test_byte_ranges_past_the_end_of_a_file_are_refused_before_counting(corpus):
    """A range cut past a file's end (the file shorter than when it was cut, or a caller's mistake) is
    refused at once, naming the size and the range; it had counted the bytes there were."""
    from lm.io import FileChangedError
    from lm.tokenizer.train import count_pretokens

    size = corpus.stat().st_size
    with pytest.raises(FileChangedError, match=rf"^input: '.*stories\.txt' is {size:,} bytes, shorter than the range "
                                               rf"to byte {size + 1000:,} to be read from it: was it changed since "
                                               r"the ranges were cut\?$"):
        count_pretokens([(str(corpus), 0, size + 1000)], [EOT], num_workers=1)


def test_a_task_that_fails_in_a_worker_leaves_nothing_of_the_call_alive(trained, corpus, tmp_path, monkeypatch):
    """rest26 R4: the pool's frame kept the error it raised, and the error's traceback that frame: the
    caller's tokenizer, the progress bar and the chunk list stayed in a cycle until a collection.
    Freed at once now, with the collector off; the error is the worker's, nothing written."""
    import gc
    import weakref

    import lm.data.tokenize as tokenize_module

    encode = tokenize_module._encode_chunk

    def fails_in_a_worker(task):
        if os.getpid() != _PARENT and task[1] > 0:
            raise ValueError("the chunk could not be encoded")
        return encode(task)

    monkeypatch.setattr(tokenize_module, "_encode_chunk", fails_in_a_worker)
    gc.collect()
    with collector_off():
        tok = load_tokenizer_dir(trained)
        alive = weakref.ref(tok)
        said = None
        try:  # not pytest.raises: its record of the error would hold the traceback
            tokenize_file(tok, corpus, tmp_path / "t.bin", num_workers=2, chunk_bytes=20_000, warm_bytes=3000)
        except ValueError as e:
            said = str(e)
        del tok
        assert said == "the chunk could not be encoded" and alive() is None
    assert list(tmp_path.iterdir()) == []


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
        os.kill(os.getpid(), signal.SIGINT)  # to the process: a fork may come from the pool's own thread


@pytest.mark.parametrize("nested", [False, True])
def test_a_ctrl_c_that_lands_while_the_workers_fork_is_raised_not_dropped(capfd, nested):
    """A SIGINT during a fork would run its handler inside the interpreter's at-fork hooks, which
    print "Exception ignored" and drop it; the pool holds it back until the workers are forked. Also
    under another handler than Python's (``nested``: an InterruptGuard's, as around a token file's
    writing), where the pool's InterruptGuard had stood aside."""
    from lm.io import InterruptGuard
    from lm.tokenizer.workers import WorkerPool

    if not hasattr(os, "register_at_fork"):
        pytest.skip("no os.register_at_fork here")
    if not getattr(_sigint_at_fork, "registered", False):
        os.register_at_fork(after_in_parent=_sigint_at_fork)
        _sigint_at_fork.registered = True
    _SIGINT_AT_FORK.append(True)
    try:
        with pytest.raises(KeyboardInterrupt), InterruptGuard() if nested else contextlib.nullcontext():
            with WorkerPool(2, abs) as pool:
                list(pool.map([-1, -2]))
    finally:
        _SIGINT_AT_FORK.clear()
    assert "Exception ignored" not in capfd.readouterr().err
    with WorkerPool(2, abs) as pool:  # and the pool works as before
        assert list(pool.map([-1, -2, 3])) == [1, 2, 3]


def test_a_ctrl_c_while_the_workers_are_closed_is_raised_after_every_one_is_closed(monkeypatch):
    """CI, 2026-12-05: a Ctrl-C at the end of `lm tokenize --num-workers 2` was printed as "Exception
    ignored in: <Finalize object, dead> ... KeyboardInterrupt" and lost: it had landed in a worker
    process's finalizer, run as a weakref callback when the pool dropped it. WorkerPool.close now
    closes each process itself (its finalizer runs there) and raises a Ctrl-C that came meanwhile
    once every worker is closed; nothing is left to a weakref callback."""
    import multiprocessing.process

    from lm.tokenizer.workers import WorkerPool

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    pool = WorkerPool(2, abs)
    assert list(pool.map([-1, -2, 3])) == [1, 2, 3]
    processes = [p for p, _ in pool._workers]
    join = multiprocessing.process.BaseProcess.join

    def join_then_ctrl_c(self, timeout=None):
        join(self, timeout)
        if self is processes[0]:
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C while the pool is being closed

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", join_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    for p in processes:
        with pytest.raises(ValueError, match="closed"):
            p.exitcode  # noqa: B018 - closed: its finalizer has run, nothing is left for a weakref callback
    assert unraisable == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_closing_the_workers_leaves_no_pipe_or_process_to_a_later_finalizer():
    """CI, 2026-12-05, again: the Ctrl-C landed in a pipe's ``__del__`` (multiprocessing's
    Connection), run when the last reference went, after close() and outside the deferred block:
    the map generator's frame (which a caller still holds) and close()'s own loop variables held
    pipes. Now every pipe and process of the pool is gone when close() returns."""
    import gc
    import weakref

    from lm.tokenizer.workers import WorkerPool

    gc.collect()
    pool = WorkerPool(2, abs)
    results = pool.map([-1, -2, 3])  # held by the caller, as `with parallel_map(...) as results` holds it
    assert next(results) == 1
    refs = [weakref.ref(o) for p, conn in pool._workers for o in (p, conn)]
    assert gc.get_freeze_count() > 0  # what existed before the fork: frozen while the workers share it
    with collector_off():  # only reference counts free them: nothing is left for a later collection either
        pool.close()
        assert [r() for r in refs] == [None] * len(refs)
    with pytest.raises(StopIteration):
        next(results)
    assert gc.get_freeze_count() == 0  # and collected again once they are gone (mutation: left frozen, survived)
    # closing again (an explicit close, then the with block's) does nothing, not even to another pool's
    # frozen objects (mutation: the maps' list dropped, and the pool left "frozen", survived)
    with WorkerPool(1, abs) as other:
        pool.close()
        assert gc.get_freeze_count() > 0 and list(other.map([-4])) == [4]
    assert gc.get_freeze_count() == 0


def test_a_pool_never_closed_does_not_keep_python_from_exiting():
    """The workers are daemon processes: a program that makes a pool and ends without closing it
    exits, its workers with it. (Mutation: non-daemon workers survived; Python then waited at exit
    for workers that waited for their next task: for ever.)"""
    from lm.tokenizer.workers import WorkerPool

    code = ("from lm.tokenizer.workers import WorkerPool\n"
            "pool = WorkerPool(2, abs)\n"
            "print(list(pool.map([-1, 2])))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[1, 2]\n", "")
    with WorkerPool(2, abs) as pool:  # in this process too, where mutation testing sees it (seed 14)
        assert [p.daemon for p, _ in pool._workers] == [True, True]


_PARENT = os.getpid()


def _die_on_2(x: int) -> int:
    """``x``, but the worker given 2 dies as the out-of-memory killer ends one; 5 ends it with status 3,
    8 with status 0 and 9 by SIGTERM."""
    if x == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if x == 5:
        os._exit(3)
    if x == 8:
        os._exit(0)
    if x == 9:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    return x


def test_a_worker_that_dies_is_one_line_saying_how(corpus, trained, tmp_path, capsys, monkeypatch):
    """A worker killed (the OOM killer's SIGKILL) was a traceback, "RuntimeError: a tokenizer worker
    process died", or, with a task still unread in its pipe, "[Errno 104] Connection reset by peer"
    (audit tokenizer9). Now a WorkerDied (an OSError: one line from the CLI) that says how it ended."""
    from lm.tokenizer.workers import WorkerDied, WorkerPool

    for tasks, how in (([0, 1, 2, 3, 4, 6, 7], r"killed by SIGKILL \(the kernel's out-of-memory killer sends it: "
                                               r"fewer workers take less memory\)"),
                       ([0, 1, 5, 3], "exited with status 3"),
                       ([0, 1, 8, 3], "exited with status 0"),  # (mutation: "killed by signal 0" survived)
                       ([0, 1, 9, 3], "killed by SIGTERM")):
        for _ in range(3):  # the death lands in a receive, or in a send of the next task
            with WorkerPool(2, _die_on_2) as pool, pytest.raises(
                    WorkerDied, match=rf"^a worker process \(pid \d+\) {how} before it finished its work$"):
                list(pool.map(tasks))
    # a worker dead before its first task: the send fails, and says how it ended (seed 14: that error
    # looked up the worker of no pipe, a RuntimeError, and survived; the deaths above land in either)
    with WorkerPool(1, abs) as pool, pytest.raises(WorkerDied, match=r"^a worker process \(pid \d+\) killed by "
                                                                      r"SIGKILL \(the kernel's"):
        pool._workers[0][0].kill()
        pool._workers[0][0].join()
        list(pool.map([-1, 2]))
    import lm.data.tokenize as tokenize_module

    encode = tokenize_module._encode_chunk

    def dies_in_a_worker(task):
        if os.getpid() != _PARENT and task[1] > 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return encode(task)

    monkeypatch.setattr(tokenize_module, "_encode_chunk", dies_in_a_worker)
    monkeypatch.setattr(tokenize_module.tokenize_file, "__kwdefaults__",
                        {**tokenize_module.tokenize_file.__kwdefaults__, "chunk_bytes": 50_000})
    out = tmp_path / "x.bin"
    assert main(["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--out", str(out),
                 "--num-workers", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"lm tokenize: error: a worker process \(pid \d+\) killed by SIGKILL \(.*\) before it "
                        r"finished its work\n", err), err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written left


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    """``pid`` exists and has not died (a zombie, dead but not yet reaped by its new parent, has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@contextlib.contextmanager
def _running_with_workers(args: list[str], tmp: Path) -> Iterator[tuple[subprocess.Popen, list[int], Path, Path]]:
    """``lm ARGS`` with 2 workers, in a session of its own, in ``tmp/run``, once its workers run; its
    stderr goes to ``tmp/err`` (a pipe would be held open by a worker that outlived it). Yields the
    process, its workers, the folder and stderr's file; any of them still running at the end is killed."""
    cwd, err = tmp / "run", tmp / "err"
    cwd.mkdir()
    with open(err, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "lm", *args, "--num-workers", "2", "--quiet"], cwd=cwd,
                             stdout=subprocess.DEVNULL, stderr=f, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers := _children(p.pid)) < 2:
            assert p.poll() is None and time.monotonic() < deadline, (p.returncode, err.read_text())
            time.sleep(0.02)
        time.sleep(0.3)  # at work
        yield p, workers, cwd, err
    finally:
        for q in [p.pid, *workers]:
            if _running(q):
                os.kill(q, signal.SIGKILL)
        p.wait()


def _gone(pids: list[int], seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_running, pids))


@pytest.fixture(scope="module")
def big_text(tmp_path_factory):
    """Enough text (12 MB) to keep two workers busy for a few seconds, of words the cache has not seen
    (each line its own words: a text of repeated lines is encoded from the cache, in a blink)."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    words = letters[rng.integers(0, 26, size=(1_500_000, 7))]
    text = np.concatenate([words, np.full((1_500_000, 1), ord(" "), dtype=np.uint8)], axis=1).reshape(-1, 80)
    text[:, -1] = ord("\n")  # lines of ten words
    path = tmp_path_factory.mktemp("big") / "big.txt"
    path.write_bytes(text.tobytes())
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("command", ["tokenize", "tokenizer train"])
def test_sigterm_stops_like_ctrl_c(trained, big_text, tmp_path, command):
    """`kill PID` had killed only the parent: its workers (blocked for ever in a send) and a hidden
    partial temporary file stayed. Now it exits 143 with one line, and leaves neither."""
    out = "out.bin" if command == "tokenize" else "tok-out"
    args = (["tokenize", "--tokenizer", str(trained), "--input", str(big_text), "--out", out] if command == "tokenize"
            else ["tokenizer", "train", "--input", str(big_text), "--vocab-size", "300", "--out", out])
    with _running_with_workers(args, tmp_path) as (p, workers, cwd, err):
        os.kill(p.pid, signal.SIGTERM)  # the parent only, as `kill PID` or a process manager
        rc = p.wait(timeout=30)
        assert rc == 128 + signal.SIGTERM and err.read_text().strip() == f"lm {command}: terminated", \
            (rc, err.read_text())
        assert _gone(workers), workers
    # No temporary file, and no output; or, when the signal came during the renames that make the
    # output complete (held back there, as a Ctrl-C is), the complete output.
    left = sorted(q.name for q in cwd.iterdir())
    assert left in ([], ["out.bin", "out.bin.json"] if command == "tokenize" else ["tok-out"]), left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_killed_parent(trained, big_text, tmp_path):
    """SIGKILL leaves nothing to clean up for the parent: the workers must end by themselves."""
    args = ["tokenize", "--tokenizer", str(trained), "--input", str(big_text), "--out", "out.bin"]
    with _running_with_workers(args, tmp_path) as (p, workers, _, _):
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert _gone(workers), workers


@pytest.mark.parametrize("command", ["tokenize", "tokenize --target", "tokenizer train"])
def test_sigterm_in_this_process_is_the_commands_terminated_line_and_143(trained, corpus, tmp_path, monkeypatch,
                                                                           capsys, command):
    """The line's name was seen only by the subprocess tests above, from folders of their own (a
    mutant naming another command survived). SIGTERM as the work starts: one line naming the command,
    exit 143, and no output."""
    from helpers.signals import main_terminated_inside

    import lm.data
    import lm.data.pairs
    import lm.tokenizer.train

    (tmp_path / "de.txt").write_text("Hallo\n")
    (tmp_path / "en.txt").write_text("Hello\n")
    out = tmp_path / "out"
    owner, name, argv = {
        "tokenize": (lm.data, "tokenize_file",
                     ["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--out", str(out)]),
        "tokenize --target": (lm.data.pairs, "tokenize_pairs",
                              ["tokenize", "--tokenizer", str(trained), "--input", str(tmp_path / "de.txt"),
                               "--target", str(tmp_path / "en.txt"), "--out", str(out)]),
        "tokenizer train": (lm.tokenizer.train, "train_bpe",
                            ["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out",
                             str(out)]),
    }[command]
    assert main_terminated_inside(monkeypatch, owner, name, [*argv, "--quiet"]) == 143
    prog = command.replace(" --target", "")
    assert capsys.readouterr() == ("", f"lm {prog}: terminated\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["de.txt", "en.txt"]


def _pid(_):
    return os.getpid()


_INITIALIZED: list[int] = []


def _note_pid() -> None:
    _INITIALIZED.append(os.getpid())


def _slow_zero(x: int) -> int:
    if x == 0:
        time.sleep(1.0)
    return x


def test_parallel_map_forks_workers_only_for_two_tasks_or_more_and_two_workers_or_more(monkeypatch):
    """One worker, one task, or serial=True: the tasks (and the initializer) run in this process; else
    in min(workers, tasks) forked workers, each initialized, and the results keep the tasks' order
    unless ordered=False, where they come as they are done. (Mutation: a pool for one worker and many
    tasks, and none for two tasks, survived: the results are the same either way.)"""
    import lm.tokenizer.workers as workers_module
    from lm.tokenizer.workers import parallel_map

    pools = []
    real_pool = workers_module.WorkerPool
    monkeypatch.setattr(workers_module, "WorkerPool", lambda n, *a: pools.append(n) or real_pool(n, *a))
    here = os.getpid()
    for tasks, workers, serial in (([1, 2, 3], 1, False), ([1], 4, False), ([1, 2, 3], 4, True)):
        _INITIALIZED.clear()
        with parallel_map(_pid, tasks, workers, initializer=_note_pid, serial=serial) as results:
            assert list(results) == [here] * len(tasks) and _INITIALIZED == [here]
    for tasks, workers in (([1, 2], 2), ([1, 2, 3], 2), ([1, 2], 5)):
        with parallel_map(_pid, tasks, workers) as results:
            pids = list(results)
        assert here not in pids and len(set(pids)) <= min(workers, len(tasks)), pids
    assert pools == [2, 2, 2]  # no more workers than tasks
    # the first worker takes tasks 0 and 1, the second 2 and 3; task 0 takes a second
    for ordered, expected in ((True, [0, 1, 2, 3]), (False, [2, 3, 0, 1])):
        with parallel_map(_slow_zero, [0, 1, 2, 3], 2, ordered=ordered) as results:
            assert list(results) == expected
    with parallel_map(abs, list(range(-40, 0)), 3) as results:
        assert list(results) == list(range(40, 0, -1))


def test_a_worker_whose_pipe_ends_while_it_still_runs_is_said_to_have_ended():
    """A worker's pipe that ends while its process has not (yet) exited: "ended", not an exit status
    (mutation: that word in capitals survived)."""
    from lm.tokenizer.workers import WorkerPool

    with WorkerPool(1, abs) as pool:
        process, conn = pool._workers[0]
        process.join = lambda timeout=None: None  # not reaped within the wait: still running
        try:
            assert str(pool._died(conn)) == (f"a worker process (pid {process.pid}) ended before it finished "
                                             "its work")
        finally:
            del process.join  # close() reaps it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_workers_hold_no_parent_end_of_a_pipe():
    """Each worker had kept the parent's ends of its own pipe and of the earlier workers' pipes: with
    the parent dead, a worker blocked in a send waited for ever. Without them, the send fails."""
    from lm.tokenizer.workers import WorkerPool

    with WorkerPool(3, _pid) as pool:
        assert len(list(pool.map(range(6)))) == 6  # the workers are up
        parent_ends = {os.readlink(f"/proc/self/fd/{c.fileno()}") for _, c in pool._workers}  # socket:[inode]
        for p, _ in pool._workers:
            held = {os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.pid}/fd")}
            assert not held & parent_ends, (held, parent_ends)


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


def test_the_invalid_utf8_warning_of_tokenize_file_is_told_at_its_callers_line(trained, tmp_path):
    """(scripts/mutation.py leaves it out of the dataset target: there mutmut's trampoline is the caller.)"""
    path = tmp_path / "bad.txt"
    path.write_bytes(b"Tom had a ball \xff.\n")
    with pytest.warns(UserWarning, match="1 byte .* not valid UTF-8") as caught:
        tokenize_file(load_tokenizer_dir(trained), path, tmp_path / "b.bin", num_workers=1)
    assert [w.filename for w in caught] == [__file__]


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


def test_a_stray_nul_in_text_is_text_but_token_files_are_not(trained, corpus, tmp_path, capsys):
    """One NUL byte in the first 64 KiB made valid UTF-8 text "not text" (the same byte further on
    was accepted); GPT-2 token files (uint16 and uint32) and float arrays must still be refused."""
    from lm.io import looks_like_text

    gpt2 = Tokenizer.from_files(data_file("gpt2_vocab.json"), data_file("gpt2_merges.txt"), [EOT])
    text = data_file("tinystories_sample.txt").read_bytes()[:200_000]
    nul = tmp_path / "nul.txt"
    nul.write_bytes(text[:1000] + b"a\x00b\n" + text[-100_000:])
    assert looks_like_text(nul)
    assert main(["tokenize", "--tokenizer", str(trained), "--input", str(nul), "--out", str(tmp_path / "nul.bin"),
                 "--quiet"]) == 0
    ids, _ = read_token_file(tmp_path / "nul.bin")
    assert load_tokenizer_dir(trained).decode(ids.tolist()) == nul.read_text(encoding="utf-8")
    capsys.readouterr()
    # token files as `lm tokenize` writes them, without their sidecar (which is_token_file recognises)
    gpt2_dir = tmp_path / "gpt2"
    save_tokenizer_dir(gpt2, gpt2_dir)
    (tmp_path / "story.txt").write_bytes(text)
    out = tmp_path / "ids.bin"
    assert main(["tokenize", "--tokenizer", str(gpt2_dir), "--input", str(tmp_path / "story.txt"), "--out", str(out),
                 "--quiet"]) == 0
    ids16 = read_token_file(out)[0]
    assert ids16.dtype == np.uint16
    binary = [tmp_path / "ids_uint16.dat", tmp_path / "ids_uint32.dat"]
    binary[0].write_bytes(out.read_bytes())
    binary[1].write_bytes(ids16.astype(np.uint32).tobytes())  # as a vocab of more than 65,536 writes them
    binary.append(tmp_path / "words_only.dat")  # ids of 256 and up only: few NUL bytes, most of the rest not UTF-8
    binary[-1].write_bytes(ids16[ids16 >= 256].tobytes())
    binary.append(tmp_path / "floats.dat")
    binary[-1].write_bytes(np.random.default_rng(0).standard_normal(50_000).astype(np.float32).tobytes())
    capsys.readouterr()
    for path in binary:
        assert not looks_like_text(path), path.name
        assert main(["tokenize", "--tokenizer", str(trained), "--input", str(path), "--out",
                     str(tmp_path / "x.bin"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--input: {str(path)!r} is not text" in err, err
    # a short file: no NUL at all
    (tmp_path / "short.txt").write_bytes(b"hello\x00")
    assert not looks_like_text(tmp_path / "short.txt")


def test_a_bad_tokenizer_file_is_named_by_lm_tokenize(trained, corpus, tmp_path, capsys):
    """lm tokenize said "--tokenizer: 'utf-8' codec can't decode byte 0xff in position 14: ...", naming
    neither the folder nor the file."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(trained, bad)
    lines = (bad / "merges.txt").read_bytes().splitlines(keepends=True)
    (bad / "merges.txt").write_bytes(b"".join(lines[:3]) + b"a \xff\n" + b"".join(lines[3:]))
    assert main(["tokenize", "--tokenizer", str(bad), "--input", str(corpus), "--out", str(tmp_path / "x.bin")]) == 2
    err = capsys.readouterr().err.strip()
    expected = f"--tokenizer: line 4 of {str(bad / 'merges.txt')!r} is not UTF-8 (byte 0xff)"
    assert len(err.splitlines()) == 1 and err.endswith(expected), err


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


def test_tokenizer_commands_start_without_importing_torch(trained, corpus, tmp_path):
    """`lm --help`, `lm tokenizer ...` and `lm tokenize` (a token file or a pair file) need no torch,
    whose import is most of their start-up (seconds on a small machine): lm.data names its modules
    lazily and the pair file builds tensors only where batches are made."""
    src = tmp_path / "src.txt"
    src.write_text("a cat\nthe dog\n", encoding="utf-8")
    script = f"""
import sys
from lm.cli import build_parser, main
build_parser()
assert main(["tokenize", "--tokenizer", {str(trained)!r}, "--input", {str(corpus)!r}, "--out",
             {str(tmp_path / "a.bin")!r}, "--num-workers", "1", "--quiet"]) == 0
assert main(["tokenize", "--tokenizer", {str(trained)!r}, "--input", {str(src)!r}, "--target", {str(src)!r},
             "--out", {str(tmp_path / "p.bin")!r}, "--num-workers", "1", "--quiet"]) == 0
print("torch" in sys.modules)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "False", p.stdout
    # and the names lm.data exports are still there, each from its module
    import lm.data
    from lm.data.pairs import PairDataset
    from lm.data.token_file import read_token_meta

    assert lm.data.PairDataset is PairDataset and lm.data.read_token_meta is read_token_meta
    assert set(dir(lm.data)) >= set(lm.data.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lm.data.nope  # noqa: B018


# -- audit data4 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"chunk_bytes": 0}, "chunk_bytes must be a positive integer, got chunk_bytes=0"),
    ({"chunk_bytes": -5}, "chunk_bytes must be a positive integer, got chunk_bytes=-5"),
    ({"chunk_bytes": 1.5}, "chunk_bytes must be a positive integer, got chunk_bytes=1.5"),
    ({"warm_bytes": -1}, "warm_bytes must be a non-negative integer (0: no warm-up), got warm_bytes=-1"),
])
def test_tokenize_file_refuses_a_chunk_size_below_one(trained, corpus, tmp_path, kwargs, message):
    """chunk_bytes=0 (or -5) never advanced past the first cut: tokenize_file hung (audit data4 #5)."""
    with pytest.raises(ValueError) as e:
        tokenize_file(load_tokenizer_dir(trained), corpus, tmp_path / "cb.bin", num_workers=1, **kwargs)
    assert str(e.value) == message
    assert list(tmp_path.iterdir()) == []


def test_tokenize_file_refuses_its_input_as_output_in_plain_words(trained, corpus):
    """The message said "is the input input itself" (audit data4 #4)."""
    with pytest.raises(ValueError) as e:
        tokenize_file(load_tokenizer_dir(trained), corpus, corpus, num_workers=1)
    assert str(e.value) == f"out_path: {str(corpus)!r} is the input input_path itself; choose another output"


def test_a_failed_tokenize_removes_the_folders_it_made(trained, corpus, tmp_path, monkeypatch, capsys):
    """A Ctrl-C (or an error) in `lm tokenize` left the empty folders made for --out (audit data4 #7);
    a folder that was there before, or one that something else wrote into, stays."""
    class Interrupted(Tokenizer):  # Ctrl-C while the first chunk is encoded
        def encode_to_numpy(self, text, dtype=None):
            raise KeyboardInterrupt

    tok = load_tokenizer_dir(trained)
    broken = Interrupted(tok.vocab, tok.merges, tok.special_tokens)
    monkeypatch.setattr("lm.tokenizer.load_tokenizer_dir", lambda *a, **k: broken)
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "nd/a/b/g.bin", tmp_path / "kept/a/g.bin"):
        assert main(["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--out", str(out),
                     "--num-workers", "1", "--quiet"]) == 130
        assert capsys.readouterr().err.strip() == "lm tokenize: interrupted"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]
    with pytest.raises(KeyboardInterrupt):  # the library too
        tokenize_file(broken, corpus, tmp_path / "x/y/z.bin", num_workers=1)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]


@pytest.mark.skipif(sys.platform != "linux", reason="/proc, where no file can be made, is Linux's")
def test_an_output_that_cannot_be_written_names_out_not_a_temporary_file(trained, corpus, tmp_path, capsys):
    """``--out /proc/x.bin`` gave ``[Errno 2] No such file or directory: '/proc/.x.bin.lr28spfr.tmp'``,
    a hidden name the user never gave (audit data4 #9)."""
    for out, message in (
        ("/proc/x.bin", "--out: cannot write '/proc/x.bin': No such file or directory"),
        ("/proc/new/x.bin",
         "--out: cannot make the folder '/proc/new' for '/proc/new/x.bin': No such file or directory"),
    ):
        for target in ([], ["--target", str(corpus)]):
            assert main(["tokenize", "--tokenizer", str(trained), "--input", str(corpus), *target, "--out", out,
                         "--num-workers", "1", "--quiet"]) == 2
            assert capsys.readouterr().err.strip() == f"lm tokenize: error: {message}"


def test_the_invalid_utf8_warning_of_lm_tokenize_names_input(trained, tmp_path, capsys):
    """`lm tokenize` named the library's parameter: "warning: input: 2 bytes of ..." (audit data4 #9)."""
    path = tmp_path / "inv.txt"
    path.write_bytes(b"Tom had a ball \xff\xfe.\n" * 10)
    assert main(["tokenize", "--tokenizer", str(trained), "--input", str(path), "--out", str(tmp_path / "b.bin"),
                 "--num-workers", "1", "--quiet"]) == 0
    assert capsys.readouterr().err.strip() == (f"lm tokenize: warning: --input: 20 bytes of {str(path)!r} are not "
                                               "valid UTF-8 (the first at line 1, column 16); they were replaced by "
                                               "U+FFFD")


def test_the_invalid_utf8_warning_of_lm_tokenizer_train_names_the_file_and_the_place(tmp_path, capsys):
    """`lm tokenizer train` said "--input: 3 bytes are not valid UTF-8", naming neither which of its
    inputs held them nor where (cli21 F2): it now says it as `lm tokenize` does."""
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("the cat sat on the mat.\n" * 20, encoding="utf-8")
    bad.write_bytes(b"hello \xff\xfe world\nline2 ok \xc3\n")
    assert main(["tokenizer", "train", "--input", str(good), str(bad), "--vocab-size", "256", "--out",
                 str(tmp_path / "tok"), "--quiet", "--holdout-bytes", "0", "--num-workers", "1"]) == 0
    assert capsys.readouterr().err.strip() == (f"lm tokenizer train: warning: --input: 3 bytes of {str(bad)!r} are "
                                               "not valid UTF-8 (the first at line 1, column 7); they were replaced "
                                               "by U+FFFD")


def test_invalid_utf8_in_the_held_out_tail_is_warned_of_and_counted(tmp_path, capsys):
    """walk26: the held-out tail (read after training, to measure bytes per token) was never counted:
    a bad byte there had no warning and summary.json said "invalid_utf8_bytes": 0."""
    path = tmp_path / "in.txt"
    path.write_bytes(b"the cat sat on the mat.\n" * 400 + b"a tail \xff\xfe here\n" + b"the end.\n" * 10)
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(path), "--vocab-size", "262", "--out", str(out), "--quiet",
                 "--holdout-bytes", "500", "--num-workers", "1"]) == 0
    assert capsys.readouterr().err.strip() == (
        f"lm tokenizer train: warning: --input: 2 bytes of {str(path)!r} are not valid UTF-8 (the first at line 401, "
        "column 8); they were replaced by U+FFFD (in the held-out tail that measures bytes per token)")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["invalid_utf8_bytes"] == 2 and summary["heldout_bytes"] > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_the_invalid_utf8_warning_says_where_the_first_bad_byte_is(trained, tmp_path, workers):
    """The warning said "1 bytes of 'in.txt' are not valid UTF-8" and nowhere in a large corpus to look
    (data21), where `lm tokenize --target` and `lm translate` name the line and column: it now names
    the first bad byte's (found by the chunk it is in, whichever worker encoded it), and counts in the
    singular for one byte. The line and column are those a byte search of the file gives."""
    # the second bad line in a later chunk: the first is named (mutation: a later chunk's taken, survived)
    body = b"Tom had a ball.\n" * 3000 + b"Lily saw \xffit.\n" + b"Tom had a ball.\n" * 600 + b"The end \xfe\xfe.\n"
    path = tmp_path / "in.txt"
    path.write_bytes(body)
    at = body.index(b"\xff")
    line, column = body.count(b"\n", 0, at) + 1, at - body.rfind(b"\n", 0, at)
    assert (line, column) == (3001, 10)
    tok = load_tokenizer_dir(trained)
    with pytest.warns(UserWarning) as caught:
        tokenize_file(tok, path, tmp_path / "a.bin", num_workers=workers, chunk_bytes=4096, warm_bytes=1024)
    assert [str(w.message) for w in caught] == [f"input: 3 bytes of {str(path)!r} are not valid UTF-8 (the first at "
                                                "line 3,001, column 10); they were replaced by U+FFFD"]
    path.write_bytes(b"Tom had a ball.\n" * 3 + b"\x80")
    with pytest.warns(UserWarning) as caught:
        tokenize_file(tok, path, tmp_path / "b.bin", num_workers=workers)
    assert [str(w.message) for w in caught] == [f"input: 1 byte of {str(path)!r} is not valid UTF-8 (the first at "
                                                "line 4, column 1); it was replaced by U+FFFD"]


def test_an_input_gone_before_the_summary_is_the_inputs_error(tmp_path, capsys, monkeypatch):
    """The summary reads the held-out tail of the input; a read failure there was reported as
    "--out: 'tok' cannot be written: No such file or directory"."""
    import lm.tokenizer.train as train_module

    path = tmp_path / "corpus.txt"
    path.write_text("hello world, the cat sat.\n" * 200, encoding="utf-8")

    def gone(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(train_module, "training_summary", gone)
    assert main(["tokenizer", "train", "--input", str(path), "--vocab-size", "260", "--out", str(tmp_path / "tok"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"lm tokenizer train: error: --input: {str(path)!r} cannot be read: No such file or directory\n"
    assert not (tmp_path / "tok").exists()


def test_a_repeated_input_trains_on_every_file(tmp_path, capsys):
    """`--input a --input b` kept b only, without a word (nargs="+" with the default store action),
    while --special-token beside it is repeatable (clifuzz7 #3). Both spellings train on both files."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(STORY * 40, encoding="utf-8")
    b.write_text("Zebras zigzag by the zoo. " * 200, encoding="utf-8")
    common = ["--vocab-size", "300", "--holdout-bytes", "0", "--num-workers", "1", "--quiet"]
    assert main(["tokenizer", "train", "--input", str(a), "--input", str(b), "--out", str(tmp_path / "t1"),
                 *common]) == 0
    line = capsys.readouterr().out  # what it trained on, in MB (seed 14: the bytes multiplied survived)
    total = a.stat().st_size + b.stat().st_size
    assert line.startswith(f"trained 300 tokens on {total / 1e6:.1f} MB in ") and line.count("\n") == 1, line
    assert line.endswith(f" -> {tmp_path / 't1'}{os.sep}\n"), line
    assert main(["tokenizer", "train", "--input", str(a), str(b), "--out", str(tmp_path / "t2"), *common]) == 0
    summary = json.loads((tmp_path / "t1" / "summary.json").read_text(encoding="utf-8"))
    assert summary["inputs"] == [str(a), str(b)]
    assert summary["train_bytes"] == total
    for name in ("vocab.json", "merges.txt"):
        assert (tmp_path / "t1" / name).read_bytes() == (tmp_path / "t2" / name).read_bytes()


def test_an_input_name_that_is_not_utf8_is_in_the_summary_as_escapes(tmp_path, capsys):
    """`--input $'\\xff.txt'` trained, then failed writing summary.json ("'utf-8' codec can't encode
    character '\\udcff'"), naming no option (clifuzz7 #1). The name is stored with \\xff."""
    src = Path(os.fsdecode(bytes(tmp_path) + b"/\xff.txt"))
    src.write_text(STORY * 40, encoding="utf-8")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(src), "--vocab-size", "300", "--holdout-bytes", "0",
                 "--num-workers", "1", "--out", str(out), "--quiet"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["inputs"] == [f"{tmp_path}/\\xff.txt"]


def test_a_symlink_loop_as_an_output_or_input_is_one_line(corpus, trained, tmp_path, capsys, monkeypatch):
    """A loop (ln -s b a; ln -s a b) at --out was a 48-line RuntimeError traceback from Path.resolve
    (Python 3.10-3.12); at --input it was "file not found" (clifuzz7 #2)."""
    monkeypatch.chdir(tmp_path)
    os.symlink("loop2", "loop1")
    os.symlink("loop1", "loop2")
    cases = [
        (["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", "loop1"],
         "lm tokenizer train: error: --out: 'loop1' is a symlink loop"),
        (["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--out", "loop1"],
         "lm tokenize: error: --out: 'loop1' is a symlink loop"),
        (["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--out", "loop1/x.bin"],
         "lm tokenize: error: --out: 'loop1/x.bin' lies below 'loop1', a symlink loop"),
        (["tokenize", "--tokenizer", str(trained), "--input", "loop1", "--out", "x.bin"],
         "lm tokenize: error: --input: 'loop1' is a symlink loop"),
    ]
    for argv, message in cases:
        assert main([*argv, "--quiet"]) == 2
        assert capsys.readouterr().err.strip() == message
    assert sorted(os.listdir(tmp_path)) == ["loop1", "loop2"]


def test_a_full_disk_while_tokenizing_names_out_and_keeps_the_earlier_output(trained, corpus, tmp_path, capsys,
                                                                             monkeypatch):
    """faults20: a full disk had been "lm tokenize: error: [Errno 28] No space left on device", naming no
    argument and no file (a write gives none); the earlier output stays whole, and nothing is left beside it."""
    import errno

    import lm.io

    out = tmp_path / "c.bin"
    pairs = tmp_path / "p.bin"
    (tmp_path / "s.txt").write_text("".join(f"Tom had {i} balls.\n" for i in range(300)))
    plain = ["tokenize", "--tokenizer", str(trained), "--input", str(corpus), "--num-workers", "1", "--quiet"]
    paired = ["tokenize", "--tokenizer", str(trained), "--input", str(tmp_path / "s.txt"), "--target",
              str(tmp_path / "s.txt"), "--num-workers", "1", "--quiet"]
    assert main([*plain, "--out", str(out)]) == 0 and main([*paired, "--out", str(pairs)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    monkeypatch.setattr(lm.io.os, "fdopen", full_disk_fdopen())  # every file written fails
    for argv, path in ((plain, out), (paired, pairs)):
        assert main([*argv, "--out", str(path), "--overwrite"]) == 2
        assert capsys.readouterr().err == f"lm tokenize: error: --out: cannot write {str(path)!r}: " \
                                          f"{os.strerror(errno.ENOSPC)}\n"
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert read_token_file(out)[0].size > 0


@pytest.mark.parametrize("target", [False, True], ids=["tokens", "pairs"])
def test_a_first_write_cut_between_its_renames_is_replaced_with_overwrite(trained, tmp_path, capsys, monkeypatch,
                                                                           target):
    """faults20: the ids were renamed into place first, so a first `lm tokenize` killed between its
    renames left ids without a sidecar, which every rerun refused ("not a token file written by `lm
    tokenize`"), --overwrite too. The sidecar, by which an output is known, now goes first: what a cut
    leaves is known, named without --overwrite, and replaced with it."""
    import lm.io

    (tmp_path / "s.txt").write_text("".join(f"Tom had {i} balls.\n" for i in range(300)))
    out = tmp_path / "c.bin"
    argv = ["tokenize", "--tokenizer", str(trained), "--input", str(tmp_path / "s.txt"), "--out", str(out),
            "--num-workers", "1", "--quiet"] + (["--target", str(tmp_path / "s.txt")] if target else [])
    real, calls = os.replace, []

    def cut_after_the_first(src, dst):  # the process dies after its first rename: the others never happen
        if calls:
            raise OSError(5, "Input/output error")
        calls.append(dst)
        return real(src, dst)

    monkeypatch.setattr(lm.io.os, "replace", cut_after_the_first)
    assert main(argv) == 2
    monkeypatch.undo()
    capsys.readouterr()
    assert [Path(p).name for p in calls] == ["c.bin.json"] and not out.exists()
    assert main(argv) == 2
    assert "exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    if target:
        from lm.data.pairs import read_pair_meta

        assert read_pair_meta(out)["num_pairs"] == 300
    else:
        assert read_token_file(out)[0].size > 0


def test_tokenizer_train_holds_out_at_most_a_tenth_and_reports_its_bytes_per_token(tmp_path, capsys):
    """summary.json: the held-out tail is at most a tenth of the input (--holdout-bytes asks for more
    here), and bytes_per_token_heldout is its UTF-8 bytes over the ids of Hugging Face tokenizers'
    encoding of it with the saved tokenizer.json (non-ASCII text: bytes, not characters)."""
    tokenizers = pytest.importorskip("tokenizers")
    lines = [f"Die Straße Nummer {i} führt über den Fluß nach Köln; 東京 {i % 7}.\n" for i in range(800)]
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(lines), encoding="utf-8")
    size = corpus.stat().st_size
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(out),
                 "--special-token", EOT, "--holdout-bytes", str(size // 3), "--quiet"]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["heldout_bytes"] <= size // 10
    assert summary["train_bytes"] + summary["heldout_bytes"] == size
    tail = corpus.read_bytes()[summary["train_bytes"]:].decode("utf-8")
    hf = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    n = len(hf.encode(tail, add_special_tokens=False).ids)
    assert summary["bytes_per_token_heldout"] == round(len(tail.encode("utf-8")) / n, 4)


def test_tokenizer_train_refuses_a_negative_holdout_before_any_work(tmp_path, capsys):
    """A mutation (`--holdout-bytes < 0` read as `< -1`): no test gives a negative --holdout-bytes."""
    (tmp_path / "c.txt").write_text("Lily had a red ball.\n" * 20)
    assert main(["tokenizer", "train", "--input", str(tmp_path / "c.txt"), "--vocab-size", "260", "--out",
                 str(tmp_path / "tok"), "--holdout-bytes", "-1", "--quiet"]) == 2
    assert capsys.readouterr() == ("", "lm tokenizer train: error: --holdout-bytes: must be >= 0, got -1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


def test_tokenize_never_writes_below_the_tokenizer_folder(tmp_path, capsys):
    """A mutation (only --out directly in the --tokenizer folder refused, not in a folder below it):
    "nothing is written into the --tokenizer folder, an input" (_check_outputs)."""
    (tmp_path / "tok" / "sub").mkdir(parents=True)
    (tmp_path / "c.txt").write_text("Lily had a red ball.\n")
    out = tmp_path / "tok" / "sub" / "x.bin"
    assert main(["tokenize", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "c.txt"), "--out",
                 str(out), "--quiet"]) == 2
    assert capsys.readouterr() == ("", f"lm tokenize: error: --out: {str(out)!r} is inside the --tokenizer folder "
                                       f"{str(tmp_path / 'tok')!r}, an input; choose another output\n")
    assert list((tmp_path / "tok" / "sub").iterdir()) == []


def test_tokenize_names_what_it_refuses_to_replace_and_a_missing_tokenizer(trained, tmp_path, capsys):
    """`lm tokenize`'s refusals, in this process (mut31: the kind of file that --out is not, and
    --tokenizer in a pair corpus's error, misspelled survived): another tool's file at --out is named
    as not lm's token file (or pair file, with --target), and left as it is; a missing --tokenizer is
    named as --tokenizer with or without --target."""
    (tmp_path / "s.txt").write_text("a\nb\n")
    notes = tmp_path / "notes.bin"
    notes.write_text("mine")
    pair = ["--target", str(tmp_path / "s.txt")]
    for extra, kind in (([], "a token file"), (pair, "a pair or token file")):
        argv = ["tokenize", "--input", str(tmp_path / "s.txt"), *extra, "--quiet"]
        assert main([*argv, "--tokenizer", str(trained), "--out", str(notes)]) == 2
        assert capsys.readouterr().err == (f"lm tokenize: error: --out: {str(notes)!r} exists and is not {kind} "
                                           "written by `lm tokenize` (it has no valid sidecar); refusing to replace "
                                           "it\n")
        assert main([*argv, "--tokenizer", str(tmp_path / "nope"), "--out", str(tmp_path / "x.bin")]) == 2
        assert capsys.readouterr().err == f"lm tokenize: error: --tokenizer: not found: {str(tmp_path / 'nope')!r}\n"
    assert notes.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.bin", "s.txt"]


def test_tokenizer_train_names_an_empty_input(tmp_path, capsys):
    """An empty --input, and an empty --out, are refused naming them, before anything is made (mut31: the
    path and the option's name lost survived)."""
    (tmp_path / "empty.txt").write_text("")
    assert main(["tokenizer", "train", "--input", str(tmp_path / "empty.txt"), "--vocab-size", "300", "--out",
                 str(tmp_path / "tok"), "--quiet"]) == 2
    assert capsys.readouterr().err == (f"lm tokenizer train: error: --input: file is empty: "
                                       f"{str(tmp_path / 'empty.txt')!r}\n")
    (tmp_path / "text.txt").write_text("some text")
    assert main(["tokenizer", "train", "--input", str(tmp_path / "text.txt"), "--vocab-size", "300", "--out", "",
                 "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("lm tokenizer train: error: --out: must not be empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "text.txt"]


def test_the_training_summary_is_indented_json(trained):
    """summary.json is read by people as well as by code: one key a line, indented, non-ASCII kept."""
    text = (trained / "summary.json").read_text(encoding="utf-8")
    assert text == json.dumps(json.loads(text), indent=1, ensure_ascii=False)


def test_sigterm_waits_where_ctrl_c_waits_and_is_said_after(capsys):
    """terminate_as_interrupt hands SIGTERM to whatever handles Ctrl-C at that moment: inside an
    InterruptGuard that holds (the renames that complete a token file and its sidecar), the signal
    waits for the block's end, and only then is the command's terminated line and 143. A mutant that
    raised KeyboardInterrupt at once, inside the held block, survived."""
    from lm.cli.tokenizer import terminate_as_interrupt
    from lm.io import InterruptGuard

    done = []

    def run() -> int:
        with InterruptGuard() as guard:
            guard.hold()
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("renamed")  # still run: the signal waits for the block to end
        done.append("after the block")  # never run: the deferred interrupt is raised at the block's end
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert terminate_as_interrupt("lm tokenize", run, note=lambda: "kept x") == 143
    assert done == ["renamed"]
    assert capsys.readouterr().err == "lm tokenize: terminated; kept x\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handler is gone
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the guard's handler is gone


def test_a_tokenizer_folder_is_marked_as_lm_tokenizer_trains_and_another_commands_is_not_replaced(
        trained, corpus, tmp_path, capsys):
    """The folder's marker names the command that wrote it, so that --overwrite replaces only an
    earlier `lm tokenizer train` output: an `lm export hf` folder of the same files' names is refused
    naming that command, and nothing in it changes."""
    from lm.io import read_marker, write_marker

    marker = read_marker(trained)
    assert marker["format"] == "lm-output" and marker["command"] == "lm tokenizer train" and marker["complete"]
    assert set(marker["files"]) == {"merges.txt", "summary.json", "tokenizer.json", "tokenizer_config.json",
                                    "vocab.json"}
    other = tmp_path / "hf"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    write_marker(other, "lm export hf")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(other),
                 "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lm tokenizer train: error: --out: {str(other)!r} holds files that `lm tokenizer train` "
                          "did not write") and "it is an output of `lm export hf`" in err, err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


def test_a_special_token_the_files_refuse_at_saving_names_the_flag(corpus, tmp_path, capsys, monkeypatch):
    """Special tokens the files cannot hold are refused before training; should that check miss one,
    the save refuses it, and the error still names --special-token, not the library's parameter."""
    import lm.tokenizer.files

    monkeypatch.setattr(lm.tokenizer.files, "check_special_tokens_savable", lambda tokens: None)
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--special-token", "@",
                 "--out", str(tmp_path / "tok"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lm tokenizer train: error: --special-token: '@' cannot be saved in tokenizer.json: "), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "tok").exists()

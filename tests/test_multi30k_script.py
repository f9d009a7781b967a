"""scripts/multi30k.py: its arguments are checked before the budget is spent, and a failure after
training keeps the trained run. A made-up Multi30k of a hundred short pairs and a tiny model."""

from __future__ import annotations

import gzip
import json
import random
import time
from pathlib import Path

import pytest
from helpers.scripts import error_line, forbid_training, run_script

WORDS = {"a": "ein", "dog": "Hund", "man": "Mann", "runs": "rennt", "sits": "sitzt", "red": "roter", "big": "großer",
         "the": "der", "in": "im", "park": "Park", "snow": "Schnee", "two": "zwei", "cats": "Katzen"}
TINY = ["--vocab-size", "300", "--d-model", "32", "--d-ff", "64", "--layers", "1", "--heads", "2",
        "--batch-tokens", "256", "--warmup-fraction", "0.02", "--dtype", "float32", "--threads", "1"]


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        en = [rng.choice(list(WORDS)) for _ in range(rng.randint(2, 6))]
        out.append((" ".join(en) + ".", " ".join(WORDS[w] for w in en) + "."))
    return out


def _write(path: Path, lines) -> Path:
    data = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A --data folder holding multi30k/{train,val,test_2016_flickr}.{en,de}.gz."""
    root = tmp_path_factory.mktemp("data")
    (root / "multi30k").mkdir()
    for split, n in (("train", 100), ("val", 20), ("test_2016_flickr", 6)):
        pairs = _pairs(n, seed=len(split))
        _write(root / "multi30k" / f"{split}.en.gz", [s for s, _ in pairs])
        _write(root / "multi30k" / f"{split}.de.gz", [t for _, t in pairs])
    return root


def _main(monkeypatch, *argv) -> int | str | None:
    return run_script(monkeypatch, "multi30k.py", *argv)


def _error(capsys) -> str:
    return error_line(capsys, "multi30k.py")


@pytest.mark.parametrize("fault", ["missing", "mismatched", "empty line"])
def test_a_bad_test_pair_is_refused_before_training(data, tmp_path, monkeypatch, capsys, fault):
    """--test was read only after the whole budget was spent on training, and the error (not naming
    --test) then deleted the trained run with the rest of --out: a typo cost five minutes and the model."""
    src = _write(tmp_path / "t.en", ["a dog runs.", "two cats sit."])
    ref = _write(tmp_path / "t.de", ["ein Hund rennt.", "zwei Katzen sitzen."])
    if fault == "missing":
        src, why = tmp_path / "nope.en.gz", f"--test: {str(tmp_path / 'nope.en.gz')!r}: file not found"
    elif fault == "mismatched":
        _write(ref, ["ein Hund rennt."])
        why = f"--test: mismatched line counts: {str(ref)!r} ends after line 1"
    else:
        _write(ref, ["ein Hund rennt.", ""])
        why = f"--test: {str(ref)!r} line 2: empty line"
    out = tmp_path / "out"
    forbid_training(monkeypatch)
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--test", src, ref, *TINY) == 2
    assert _error(capsys).startswith(f"multi30k.py: error: {why}")
    assert not out.exists()  # nothing trained, nothing made


def test_a_test_source_longer_than_the_context_is_refused_before_the_model_trains(data, tmp_path, monkeypatch,
                                                                                   capsys):
    """It was found by `translate` after training ("source 0 has 201 tokens: ...", 0-based, no
    argument named), and the run deleted. It is checked once the tokenizer can count its tokens."""
    src = _write(tmp_path / "t.en", ["a dog runs.", " ".join(["two big red cats"] * 40)])
    ref = _write(tmp_path / "t.de", ["ein Hund rennt.", "zwei Katzen."])
    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--test", src, ref, *TINY) == 2
    err = _error(capsys)
    assert err.startswith(f"multi30k.py: error: --test: line 2 of {str(src)!r} has "), err
    assert err.endswith("tokens, more than the 127 a source may hold (the model's context is 128, one kept for "
                        "<eos>)"), err
    assert not (out / "run").exists()


def test_a_budget_too_small_names_budget(data, tmp_path, monkeypatch, capsys):
    """`--budget 1` said `config: train.max_time must be > 0, got -11.86`: a setting the user never
    made. Now the error names --budget: up front when it cannot hold the final validation, else
    once the tokenizer has taken its time, with the time left."""
    test = [data / "multi30k" / "test_2016_flickr.en.gz", data / "multi30k" / "test_2016_flickr.de.gz"]
    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 2, "--test", *test, *TINY) == 2
    assert _error(capsys) == ("multi30k.py: error: --budget: must be more than the 3 s kept for the final "
                              "validation, got 2")
    import lm.tokenizer

    real = lm.tokenizer.train_bpe

    def slow(*args, **kwargs):  # a tokenizer that takes 2 of the 4.5 seconds
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(lm.tokenizer, "train_bpe", slow)
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 4.5, "--test", *test, *TINY) == 2
    err = _error(capsys)
    assert err.startswith("multi30k.py: error: --budget: 4.5 s leaves "), err
    assert "s once the tokenizer and the pair files are made (" in err and err.endswith("raise --budget"), err
    assert not out.exists()


@pytest.mark.parametrize("argv, why", [
    (["--warmup", "5000"], "--warmup: counts steps of --schedule inverse_sqrt; the cosine schedule runs on elapsed "
                           "time: give --warmup-fraction instead, got --warmup 5000"),
    (["--schedule", "inverse_sqrt", "--warmup-fraction", "0.1"], "--warmup-fraction: applies to --schedule cosine"),
    (["--warmup-fraction", "1.5"], "--warmup-fraction: must be in [0, 1), got 1.5"),
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--threads", "-1"], "--threads: must be >= 1, got -1"),
    (["--vocab-size", "100"], "--vocab-size: must be at least 259 (256 bytes and the 3 special tokens), got 100"),
    (["--d-model", "31"], "--d-model 31, --heads 2: config: [model] d_model must be divisible by num_heads"),
    (["--layers", "0"], "--layers 0: config: [model] encoder_layers must be a positive integer, got 0"),
    (["--batch-tokens", "0"], "--batch-tokens 0: config: train.batch_tokens must be > 0, got 0"),
    (["--schedule", "inverse_sqrt", "--warmup", "0"], "--warmup 0: config: optim.schedule = inverse_sqrt needs"),
    (["--budget", "nan"], "--budget: must be more than the 3 s kept for the final validation, got nan"),
    # clifuzz7: `config: train.max_time must be a finite number`, a key the user never set
    (["--budget", "inf"], "--budget: must be a finite number of seconds, got inf"),
    # clifuzz7: torch.set_num_threads' "Overflow when unpacking long long" traceback; `lm` caps --threads
    (["--threads", str(2**70)], "--threads: must be at most "),
])
def test_a_bad_setting_is_refused_before_anything_runs_naming_its_option(data, tmp_path, monkeypatch, capsys,
                                                                          argv, why):
    """--warmup was ignored under the default cosine schedule (300 of its 10,000 time units, whatever
    was given) while result.json recorded the value given; --threads -1 was a traceback and 0 was
    ignored; a model setting the config refuses was caught only after the tokenizer was trained, in
    the config's words (`train.batch_tokens`), not the option's."""
    out = tmp_path / "out"
    forbid_training(monkeypatch)
    tiny = TINY[:]
    if "inverse_sqrt" in argv:  # TINY's warm-up is the cosine schedule's
        i = tiny.index("--warmup-fraction")
        del tiny[i : i + 2]
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, *tiny, *argv) == 2
    assert _error(capsys).startswith(f"multi30k.py: error: {why}")
    assert not out.exists()


@pytest.mark.parametrize("beam", [10**6, 10**12, 2**70])
def test_a_beam_that_cannot_fit_is_refused_before_training(data, tmp_path, monkeypatch, capsys, beam):
    """--beam 10**12 trained for the whole budget, then failed decoding the test set. The decoder's
    cache, memory and logits for the test set's largest batch are counted once the tokenizer can
    count its tokens and the model is built, before the first step."""
    import lm.train

    def run(self):
        raise AssertionError("the model trained before --beam was refused")

    monkeypatch.setattr(lm.train.Trainer, "run", run)
    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--beam", beam, *TINY) == 2
    err = _error(capsys)
    assert err.startswith(f"multi30k.py: error: --beam: decoding the test set at beam {beam} does not fit in memory "
                          "(decoding needs about "), err
    assert err.endswith("; lower --beam"), err
    assert not out.exists()


def test_a_failure_after_training_keeps_the_trained_run(data, tmp_path, monkeypatch, capsys):
    """A failure while decoding the test set (here the allocator's, past the count made before
    training) came after the budget was spent, and deleted the trained run with the rest of --out.
    The run stays, and the error says where; --overwrite then replaces the output, and a run that
    succeeds lists its test.hyp (one hypothesis a test line) and result.json."""
    import lm.generate

    def translate(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 81920000000 bytes. Error code 12 (Cannot allocate memory)")

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(lm.generate, "translate", translate)
        assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--beam", 3, *TINY) == 2
    assert _error(capsys) == ("multi30k.py: error: --beam: decoding the test set at beam 3 does not fit in "
                              f"memory; the trained run is kept in {str(out / 'run')!r}")
    assert list((out / "run" / "checkpoints").glob("step_*.pt")) and (out / "tokenizer" / "vocab.json").is_file()

    def overflows(model, sources, **kwargs):  # the third test sentence's logits overflow, in whichever batch
        third = tok.encode(lines[2].strip())
        if third in sources:
            raise lm.generate.NonFiniteLogitsError(1, sources.index(third))
        return [[] for _ in sources]

    import gzip

    from lm.tokenizer import load_tokenizer_dir

    lines = gzip.decompress((data / "multi30k" / "test_2016_flickr.en.gz").read_bytes()).decode().splitlines()
    tok = load_tokenizer_dir(out / "tokenizer")
    assert lines.count(lines[2]) == 1
    with monkeypatch.context() as m:  # seq2seq8: named by its line, not by its place in the batch
        m.setattr(lm.generate, "translate", overflows)
        assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--beam", 3, "--overwrite",
                     *TINY) == 2
    assert _error(capsys) == ("multi30k.py: error: the model's logits are not finite (NaN or inf) at new token 1 of "
                              f"--test source line 3; the trained run is kept in {str(out / 'run')!r}")
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--beam", 2, "--overwrite", *TINY) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].startswith("BLEU ")
    assert len((out / "test.hyp").read_text().split("\n")) == 6 + 1
    result = json.loads((out / "result.json").read_text())
    assert result["beam"] == 2
    # the warm-up recorded is the one used: 2% of the 10,000 time units of the cosine schedule
    assert result["settings"]["warmup_fraction"] == 0.02 and result["settings"]["warmup"] is None
    assert "warmup_iters = 200\n" in (out / "run" / "config.toml").read_text()
    marker = json.loads((out / ".lm-output.json").read_text())
    assert marker["complete"] and {"test.hyp", "result.json"} <= set(marker["files"])


def test_a_signal_during_training_puts_back_and_after_it_keeps_the_run(data, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while training kept the half-made output marked complete and deleted an --overwrite'n
    earlier one; after training (decoding the test set) it was a KeyboardInterrupt traceback (demo21).
    Now the first puts the earlier output back and the second keeps the trained run, as an error there
    does, each with one line and exit 130."""
    import lm.generate
    import lm.train

    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--beam", 1, *TINY) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(lm.train.Trainer, "run", lambda self: 130)  # the trainer saved and stopped for a Ctrl-C
        assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--overwrite", *TINY) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "multi30k.py: interrupted"
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    fresh = tmp_path / "fresh"
    with monkeypatch.context() as m:
        m.setattr(lm.generate, "translate", interrupted)
        assert _main(monkeypatch, "--data", data, "--out", fresh, "--budget", 5, "--beam", 1, *TINY) == 130
    assert capsys.readouterr().err.splitlines()[-1] == ("multi30k.py: interrupted; the trained run is kept in "
                                                        f"{str(fresh / 'run')!r}")
    assert list((fresh / "run" / "checkpoints").glob("step_*.pt")) and not (fresh / "result.json").exists()

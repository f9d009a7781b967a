"""`lm demo` end to end on tiny settings: every stage runs and the report holds what it promises."""

import json
import math

import pytest

from lm.demo.pipeline import DemoSettings, run_demo, unigram_bits_per_byte


def test_unigram_baseline_formula():
    import numpy as np

    train = np.array([0, 0, 0, 1])  # counts +1: [4, 2, 1] of 7
    val = np.array([0, 1, 2])
    expected = -(math.log(4 / 7) + math.log(2 / 7) + math.log(1 / 7)) / math.log(2) / 6
    assert unigram_bits_per_byte(train, val, 3, val_bytes=6) == pytest.approx(expected)


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no TinyStories in ./data: the synthetic corpus is used
    # bound by steps, not by the clock (300 steps take about 8 s here), so a busy machine only makes it slower
    settings = DemoSettings(out_dir=str(tmp_path / "demo"), corpus_bytes=400_000, vocab_size=600,
                            train_seconds=300, max_steps=300, d_model=64, num_layers=2, num_heads=2, context_length=64,
                            num_samples=2, sample_tokens=40, progress=False)
    report = run_demo(settings)
    assert report.synthetic
    assert report.val["bits_per_byte"] < 0.75 * report.unigram_bpb
    assert len(report.samples) == 2 and all(s.strip() for s in report.samples)
    assert (tmp_path / "demo" / "loss.png").stat().st_size > 1000
    text = report.to_text()
    assert "SYNTHETIC" in text and "unigram baseline" in text and "sample 2" in text
    saved = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert saved["val"]["loss"] == pytest.approx(report.val["loss"])


def _tiny(tmp_path, **kw) -> DemoSettings:
    return DemoSettings(**{**dict(out_dir=str(tmp_path / "demo"), corpus_bytes=50_000, vocab_size=300,
                                  train_seconds=60, max_steps=2, d_model=32, num_layers=1, num_heads=2,
                                  context_length=32, num_samples=1, sample_tokens=4, device="cpu"), **kw})


def test_quiet_demo_prints_nothing_but_the_report(tmp_path, monkeypatch, capsys):
    """--quiet (progress=False) used to print the trainer's model/step/eval/done lines."""
    monkeypatch.chdir(tmp_path)
    report = run_demo(_tiny(tmp_path, progress=False))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "", captured
    assert report.sizes["steps"] == 2 and (tmp_path / "demo" / "report.json").exists()
    # bits per byte over the bytes of the tokens scored: all but the first (fewer than 200,000 here)
    val = report.val
    assert val["tokens"] == report.sizes["val_tokens"] - 1 and 0 < report.sizes["val_bytes"] - val["bytes"] <= 64
    assert val["bits_per_byte"] == pytest.approx(val["loss"] * val["tokens"] / math.log(2) / val["bytes"])


def test_overwrite_keeps_a_demo_folder_a_file_was_added_to_at_any_depth(tmp_path, monkeypatch):
    """--overwrite had checked only the folder's top level: a note put in the demo's run/ went with
    the old demo. A complete output's marker lists its files; anything else, at any depth, is kept."""
    monkeypatch.chdir(tmp_path)
    run_demo(_tiny(tmp_path, progress=False))
    note = tmp_path / "demo" / "run" / "NOTES.txt"
    note.write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that `lm demo` did not write \('run/NOTES.txt'\)"):
        run_demo(_tiny(tmp_path, progress=False, overwrite=True))
    assert note.read_text() == "mine"
    note.unlink()
    assert run_demo(_tiny(tmp_path, progress=False, overwrite=True)).sizes["steps"] == 2  # its own files: replaced


def test_ctrl_c_during_demo_training_is_one_line_and_removes_the_folder(tmp_path, monkeypatch, capsys):
    """SIGINT while the model trains: the trainer stops with status 130, which used to end in
    `RuntimeError: training stopped with status 130` (a traceback, exit 1)."""
    import os
    import signal

    from lm.cli import main
    from lm.train import Trainer

    monkeypatch.chdir(tmp_path)
    step = Trainer.train_step

    def interrupted_step(self, lr):
        os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler: stop after this step
        return step(self, lr)

    monkeypatch.setattr(Trainer, "train_step", interrupted_step)
    rc = main(["demo", "--out", "d", "--corpus-bytes", "50000", "--vocab-size", "300", "--train-seconds", "60",
               "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 130 and err.splitlines()[-1] == "lm demo: interrupted", (rc, err)
    assert "Traceback" not in err and "status 130" not in err
    assert not (tmp_path / "d").exists()
    rc = main(["demo", "--out", "d", "--corpus-bytes", "50000", "--vocab-size", "300", "--train-seconds", "60",
               "--device", "cpu", "--quiet"])
    assert rc == 130 and capsys.readouterr().err.strip() == "lm demo: interrupted"
    assert not (tmp_path / "d").exists()


def test_a_demo_whose_training_diverges_is_one_line_exit_3(tmp_path, monkeypatch, capsys):
    """As `lm train`: the divergence in one line, exit 3, the folder removed (it had been a traceback)."""
    from lm.cli import main
    from lm.train import Trainer, TrainingDiverged

    monkeypatch.chdir(tmp_path)

    def diverged(self):
        raise TrainingDiverged("the loss became nan by step 3")

    monkeypatch.setattr(Trainer, "run", diverged)
    rc = main(["demo", "--out", "d", "--corpus-bytes", "50000", "--vocab-size", "300", "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and err == "lm demo: error: the loss became nan by step 3", err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("extra, message", [
    (["--corpus-bytes", "0"], "--corpus-bytes: must be at least 50,000"),
    (["--corpus-bytes", "49999"], "--corpus-bytes: must be at least 50,000"),
    (["--seed", "99999999999999999999"], "--seed: must be a whole number in [0, 2**64-1], got 99999999999999999999"),
    (["--seed", "-1"], "--seed: must be a whole number in [0, 2**64-1], got -1"),
    (["--vocab-size", "200"], "--vocab-size: must be at least 257 (256 bytes + the <|endoftext|> token), got 200"),
])
def test_bad_demo_numbers_are_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys, extra, message):
    """--corpus-bytes 0 used to blame --data (which the user never passed); a seed beyond 64 bits
    ended in torch's `Overflow when unpacking long long`."""
    from lm.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--out", "d", "--train-seconds", "1", "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lm demo: error: ") and message in err and len(err.splitlines()) == 1, err
    assert "--data" not in err and not (tmp_path / "d").exists()


def test_a_corpus_limit_too_small_to_split_names_corpus_bytes(tmp_path):
    from pathlib import Path

    from lm.demo.pipeline import split_corpus

    src = Path(tmp_path / "c.txt")
    src.write_text("one long document without a boundary " * 100 + "\n<|endoftext|>\n" + "more text\n" * 100)
    with pytest.raises(ValueError, match=r"^--corpus-bytes: the first 1,000 bytes of .* hold no document"):
        split_corpus(src, tmp_path, 1000)

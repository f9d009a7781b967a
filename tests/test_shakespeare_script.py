"""scripts/shakespeare.py: every option is checked before the budget is spent, each error naming the
option and its value; a tiny run on a made-up text ends in the bits per byte it reports."""

from __future__ import annotations

import json
import random
import time

import pytest
from helpers.scripts import error_line, forbid_training, run_script

TINY = ["--vocab-size", "300", "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--context-length", "32",
        "--batch-size", "4", "--dtype", "float32", "--eval-margin", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A --data folder holding a small made-up tinyshakespeare.txt."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = ["thou", "art", "my", "lord", "and", "the", "king", "shall", "be", "so", "good", "night"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(800)]
    (root / "tinyshakespeare.txt").write_text("\n".join(lines) + "\n")
    return root


def _main(monkeypatch, *argv) -> int | str | None:
    return run_script(monkeypatch, "shakespeare.py", *argv)


def _error(capsys) -> str:
    return error_line(capsys, "shakespeare.py")


@pytest.mark.parametrize("argv, why", [
    (["--eval-stride", "200"], "--eval-stride: must be between 1 and --context-length 32, got 200"),
    (["--eval-stride", "0"], "--eval-stride: must be between 1 and --context-length 32, got 0"),
    (["--eval-stride", "-1"], "--eval-stride: must be between 1 and --context-length 32, got -1"),
    (["--budget", "0.5"], "--budget: must be more than the 1 s kept for the final evaluation (--eval-margin), "
                          "got 0.5"),
    (["--eval-margin", "-1"], "--eval-margin: must be >= 0, got -1"),
    (["--vocab-size", "100"], "--vocab-size: must be at least 256 (one token a byte), got 100"),
    (["--batch-size", "0"], "--batch-size 0: config: train.batch_size must be > 0, got 0"),
    (["--d-model", "33"], "--d-model 33, --num-heads 2: config: [model] d_model must be divisible by num_heads"),
    (["--num-layers", "0"], "--num-layers 0: config: [model] num_layers must be a positive integer, got 0"),
    (["--warmup-fraction", "1"], "--warmup-fraction: must be in [0, 1), got 1"),
    (["--seed", "-1"], "--seed -1: config: train.seed must be a whole number"),
    # clifuzz7: `config: train.max_time must be a finite number`, a key the user never set
    (["--budget", "inf"], "--budget: must be a finite number of seconds, got inf"),
])
def test_a_bad_setting_is_refused_before_anything_runs_naming_its_option(data, tmp_path, monkeypatch, capsys,
                                                                          argv, why):
    """`--eval-stride 200` was refused only after the whole budget was trained, in words naming
    `stride`, and the error then deleted the trained run; `--eval-stride 0` was taken silently as the
    default; `--budget 3` and the model settings were refused after the tokenizer, in the config's
    words (`train.max_time must be > 0, got -2.3`), not the option's."""
    out = tmp_path / "out"
    forbid_training(monkeypatch)
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 10, *TINY, *argv) == 2
    assert _error(capsys).startswith(f"shakespeare.py: error: {why}")
    assert not out.exists()


def test_missing_data_names_the_folder(tmp_path, monkeypatch, capsys):
    assert _main(monkeypatch, "--data", tmp_path, "--out", tmp_path / "out") == 2
    assert _error(capsys) == f"shakespeare.py: error: --data: {str(tmp_path)!r} holds no tinyshakespeare.txt"


def test_a_budget_the_tokenizer_eats_names_budget(data, tmp_path, monkeypatch, capsys):
    """A budget that the tokenizer leaves no training time of names --budget and the time left."""
    import lm.tokenizer

    real = lm.tokenizer.train_bpe

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(lm.tokenizer, "train_bpe", slow)
    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 2, *TINY) == 2
    err = _error(capsys)
    assert err.startswith("shakespeare.py: error: --budget: 2 s leaves ") and err.endswith("raise --budget"), err
    assert not out.exists()


def test_a_tiny_run_reports_its_stride_and_bits_per_byte(data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--eval-stride", 8, *TINY) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["eval_stride"] == 8 and result["steps"] > 0
    # bits per byte = loss in nats per token · tokens / bytes / ln 2: a byte costs less than a token
    assert 0 < result["bits_per_byte"] < result["val_loss"] / 0.6931 + 1e-3
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result


@pytest.mark.parametrize("status, word", [(130, "interrupted"), (143, "terminated")])
def test_a_run_stopped_by_a_signal_puts_the_earlier_output_back(data, tmp_path, monkeypatch, capsys, status, word):
    """A Ctrl-C or SIGTERM while training returned 1 inside claim_dir: the half-made output was kept
    marked complete (without result.json), an --overwrite'n earlier one deleted for it, and the line
    said "continue with --resume", which the script has not (demo21). Now claim_dir puts the earlier
    output back, and the script exits 128 + the signal with one line, as an `lm` command does."""
    import lm.train

    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, *TINY) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    monkeypatch.setattr(lm.train.Trainer, "run", lambda self: status)  # the trainer saved and stopped
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, "--overwrite", *TINY) == status
    assert capsys.readouterr().err.splitlines()[-1] == f"shakespeare.py: {word}"
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no set-aside copy left


def test_ctrl_c_during_the_final_evaluation_is_one_line_and_leaves_nothing(data, tmp_path, monkeypatch, capsys):
    """After training, a Ctrl-C (here in the final evaluation) was a KeyboardInterrupt traceback, exit 1
    (demo21): now one line, exit 130, and the unfinished output removed."""
    import lm.evaluate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lm.evaluate, "evaluate_tokens", interrupted)
    out = tmp_path / "out"
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, *TINY) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "shakespeare.py: interrupted"
    assert not out.exists()


def test_a_vocab_size_the_text_cannot_give_is_a_warning(data, tmp_path, monkeypatch, capsys):
    """The made-up text's few words give fewer tokens than --vocab-size 5000: the run went on with fewer,
    saying nothing (demo21), where lm demo warns and lm tokenizer train refuses. It warns, and
    result.json records the size obtained."""
    out = tmp_path / "out"
    argv = [a if a != "300" else "5000" for a in TINY]
    assert _main(monkeypatch, "--data", data, "--out", out, "--budget", 5, *argv) == 0
    result = json.loads((out / "result.json").read_text())
    train_bytes = (out / "data" / "train.txt").stat().st_size
    assert result["vocab_size"] < 5000
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        f"shakespeare.py: warning: --vocab-size: the {train_bytes:,} training bytes give at most "
        f"{result['vocab_size']:,} tokens (BPE ran out of pairs to merge), not 5,000; the run goes on with "
        f"{result['vocab_size']:,}"]

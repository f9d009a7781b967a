"""The benchmark scripts refuse a bad option in one line naming it (exit status 2) before any work,
compare like with like, and do not print a ratio of different outputs as if it were one. Each
script's main() runs in this process with the arguments it would get; nothing here times anything."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"


def _script(name: str):
    """scripts/NAME loaded as a module (not run)."""
    return load_script(name)


def _main(monkeypatch, script: str, *argv):
    module = _script(script)
    monkeypatch.setattr(sys, "argv", [script, *map(str, argv)])
    return module.main()


def _refused(monkeypatch, capsys, script: str, argv: list, why: str) -> None:
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, script, *argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{script}: error: {why}"), lines[0]


# -- bench_tokenizer -------------------------------------------------------------------------------


@pytest.fixture
def small_text(tmp_path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text("".join(f"Line {i} of a small text, with words {i * 7}.\n" for i in range(200)), encoding="utf-8")
    return path


@pytest.mark.parametrize("argv, why", [
    (["--holdout-bytes", "0"], "--holdout-bytes: must be > 0 and below the text's {size:,} bytes, got 0"),
    (["--holdout-bytes", "-5"], "--holdout-bytes: must be > 0 and below the text's {size:,} bytes, got -5"),
    (["--holdout-bytes", "{size}"], "--holdout-bytes: must be > 0 and below the text's {size:,} bytes, got {size}"),
    (["--holdout-bytes", "2000", "--reps", "0"], "--reps: must be >= 1, got 0"),
    (["--holdout-bytes", "2000", "--vocab-size", "10"], f"--vocab-size: must be >= 257 (256 bytes and {EOT}), got 10"),
])
def test_tokenizer_refuses_bad_counts_before_any_task(monkeypatch, capsys, small_text, argv, why):
    """--holdout-bytes 0 or -5 trained on the whole text and held out its last byte ("+0.00%,
    within 1%"); the file's size and the others were a task's traceback and then the parent's."""
    size = small_text.stat().st_size
    argv = [a.format(size=size) for a in argv]
    _refused(monkeypatch, capsys, "bench_tokenizer.py", ["--data", small_text.parent, "--text", small_text,
             "--skip", "encode", "tokenize", "lines", "longword", "--vocab-size", "300", "--reps", "1", *argv],
             why.format(size=size))


def test_tokenizer_refuses_a_holdout_with_no_line_end(monkeypatch, capsys, tmp_path, small_text):
    """No safe cut in the held-out tail: next_safe_cut's -1 was taken as a cut before the last byte."""
    text = tmp_path / "tail.txt"
    text.write_bytes(small_text.read_bytes() + b"x" * 3000)
    _refused(monkeypatch, capsys, "bench_tokenizer.py",
             ["--data", tmp_path, "--text", text, "--skip", "encode", "tokenize", "lines", "longword",
              "--vocab-size", "300", "--reps", "1", "--holdout-bytes", "2000"],
             f"--holdout-bytes: no line end or {EOT} in the last 2,000 bytes of {str(text)!r}")


def test_tokenizer_refuses_to_skip_every_task(monkeypatch, capsys, small_text):
    """clifuzz7: an empty table and exit 0, which reads as a run that found nothing wrong."""
    _refused(monkeypatch, capsys, "bench_tokenizer.py", ["--data", small_text.parent, "--text", small_text,
             "--skip", "train", "encode", "tokenize", "lines", "longword"],
             "--skip: train encode tokenize lines longword leaves no task to run (the tasks: train encode tokenize "
             "lines longword)")


def test_tokenizer_refuses_missing_or_unreadable_inputs(monkeypatch, capsys, tmp_path, small_text):
    skip_train = ["--skip", "train"]
    _refused(monkeypatch, capsys, "bench_tokenizer.py", ["--data", tmp_path / "nonexist", "--skip", "train"],
             f"--data: {str(tmp_path / 'nonexist')!r} is not a folder")
    _refused(monkeypatch, capsys, "bench_tokenizer.py", ["--data", tmp_path, "--text", "nonexist.txt", *skip_train],
             "--text: 'nonexist.txt' is not a file")
    _refused(monkeypatch, capsys, "bench_tokenizer.py", ["--data", tmp_path, "--text", small_text, *skip_train],
             f"--data: {str(tmp_path)!r} holds no gpt2_vocab.json")
    for name in ("gpt2_vocab.json", "gpt2_merges.txt"):
        (tmp_path / name).write_text("")  # only their presence is checked up front
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    _refused(monkeypatch, capsys, "bench_tokenizer.py", ["--data", tmp_path, "--text", latin1, *skip_train],
             f"--text: {str(latin1)!r} is not UTF-8 (byte 3)")
    _refused(monkeypatch, capsys, "bench_tokenizer.py", ["--data", tmp_path, "--text", small_text, *skip_train],
             f"--data: {str(tmp_path)!r} holds no multi30k/train.de.gz (the sentences of the lines row)")
    monkeypatch.delenv("LM_TEST_DATA", raising=False)
    _refused(monkeypatch, capsys, "bench_tokenizer.py", skip_train,
             "--data: not given and LM_TEST_DATA is not set")


def test_tokenizer_reports_a_failed_task_in_one_line(capsys):
    """The parent ran its tasks with check=True: a task's traceback, then the parent's own."""
    module = _script("bench_tokenizer.py")
    crash = "import sys; print('text: progress', file=sys.stderr); raise AssertionError('ids differ from tiktoken')"
    with pytest.raises(SystemExit) as e:
        module.run_task("encode", [sys.executable, "-c", crash])
    assert e.value.code == 1
    assert capsys.readouterr().err == ("bench_tokenizer.py: error: the encode task failed (exit status 1): "
                                       "AssertionError: ids differ from tiktoken\n")
    refusal = "import sys; sys.exit('bench_tokenizer.py: error: --x: bad')"  # a task's own one-line error
    with pytest.raises(SystemExit) as e:
        module.run_task("train", [sys.executable, "-c", refusal])
    assert e.value.code == 1 and capsys.readouterr().err == "bench_tokenizer.py: error: --x: bad\n"


def test_tokenizer_tiktoken_batch_gives_the_whole_texts_ids(monkeypatch, tmp_path):
    """The same-threads reference: the file in `lm tokenize`'s chunks (several here), one batch on
    threads, ids those of encoding the whole text, special tokens included."""
    tiktoken = pytest.importorskip("tiktoken")
    from lm.tokenizer.pretokenize import GPT2_PATTERN

    module = _script("bench_tokenizer.py")
    enc = tiktoken.Encoding("bytes", pat_str=GPT2_PATTERN, mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={EOT: 256})
    text = "".join(f"Story {i}: the cat sat.\n\n{EOT}" if i % 3 == 0 else f"Line {i}  of text\n" for i in range(60))
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(module, "CHUNK_BYTES", 100)
    parts = module.tiktoken_file(enc, path, 2)
    assert len(parts) > 5
    assert list(itertools.chain.from_iterable(parts)) == enc.encode(text, allowed_special="all")


def test_tokenizer_tokenize_task_has_a_same_threads_row_with_the_target(monkeypatch, capsys, test_data, small_text):
    """`lm tokenize` on every core was held to >= 1.0x of tiktoken on one thread; the target is now
    the row against tiktoken on as many threads, the one-thread row is reported beside it."""
    pytest.importorskip("tiktoken")
    assert _main(monkeypatch, "bench_tokenizer.py", "--task", "tokenize", "--data", test_data, "--text", small_text,
                 "--reps", "1") == 0
    rows = json.loads(capsys.readouterr().out)
    cpus = __import__("os").cpu_count()
    ours = f"lm tokenize, {cpus} process{'es' * (cpus > 1)}, GPT-2 vocab (MB/s)"
    assert [(r[0], r[4]) for r in rows] == [
        (f"{ours} vs tiktoken encode_batch, {cpus} thread{'s' * (cpus > 1)}", ">= 1.0x"),
        (f"{ours} vs tiktoken 1 thread", "none (threads differ)"),
    ]
    assert rows[0][1] == rows[1][1]  # the same lm measurement against each reference


# -- bench_model ---------------------------------------------------------------------------------

TRAIN = ["--skip-generate", "--attn-impls", "sdpa", "--batch", "1", "--warmup", "0", "--rounds", "1"]
GENERATE = ["--skip-train", "--attn-impls", "sdpa", "--gen-rounds", "1", "--streams", "1"]


@pytest.mark.parametrize("argv, why", [
    ([*TRAIN, "--rounds", "0"], "--rounds: must be >= 1, got 0"),
    ([*TRAIN, "--steps", "0"], "--steps: must be >= 1, got 0"),
    ([*TRAIN, "--batch", "0"], "--batch: must be >= 1, got 0"),
    ([*TRAIN, "--warmup", "-1"], "--warmup: must be >= 0, got -1"),
    ([*GENERATE, "--streams", "0"], "--streams: must be >= 1, got 0"),
    ([*GENERATE, "--new-tokens", "0"], "--new-tokens: must be >= 1, got 0"),
    ([*GENERATE, "--prompt-len", "510", "--new-tokens", "3"],
     "--prompt-len + --new-tokens: must be <= the generation model's 512 positions, got 510 + 3 = 513"),
])
def test_model_refuses_bad_counts(monkeypatch, capsys, argv, why):
    """Each was a traceback (StatisticsError, ZeroDivisionError, a reshape error, IndexError), some
    after half a table; past 512 positions lm slid its window and transformers did not."""
    _refused(monkeypatch, capsys, "bench_model.py", argv, why)


@pytest.mark.parametrize("argv, why", [
    (["--skip-train", "--skip-generate"],
     "--skip-train and --skip-generate: together they leave nothing to run; give one at most"),
    ([*TRAIN, "--batch", str(2**70)], "--batch: a training step of 1,180,591,620,717,411,303,424 x 256 tokens needs "
                                      "at least "),
    ([*GENERATE, "--streams", str(2**70)], "--streams: the key and value cache of 1,180,591,620,717,411,303,424 "
                                           "streams of 288 positions needs at least "),
])
def test_model_refuses_nothing_to_run_and_sizes_past_memory(monkeypatch, capsys, argv, why):
    """clifuzz7: both --skip options printed a header and exit 0 having measured nothing; 2**70 was
    torch's "Overflow when unpacking long long" traceback once the models were built."""
    _refused(monkeypatch, capsys, "bench_model.py", argv, why)


def _fake_generation(identical: bool, batch_identical: bool):
    hf = "transformers generate (sdpa)"
    rows = [("lm generate (attn_impl=sdpa)", 110.0), ("lm generate, compiled step (compile=True)", 200.0), (hf, 100.0)]
    batch = [("lm generate, 16 streams (attn_impl=sdpa)", 800.0), ("lm generate, 16 streams, compiled step", 900.0),
             (f"{hf}, 16 streams", 400.0)]
    return lambda args: (rows, identical, batch, batch_identical)


@pytest.mark.parametrize("identical, batch_identical", [(False, True), (True, False)])
def test_model_tokens_that_differ_mark_the_ratios_and_fail(monkeypatch, capsys, identical, batch_identical):
    """identical tokens: False was printed, the ratios shown as if valid, and the exit status was 0."""
    module = _script("bench_model.py")
    monkeypatch.setattr(module, "bench_generation", _fake_generation(identical, batch_identical))
    monkeypatch.setattr(sys, "argv", ["bench_model.py", "--skip-train"])
    assert module.main() == 1
    out, err = capsys.readouterr()
    headers = [line for line in out.splitlines() if line.startswith("| implementation |")]
    assert [("NOT VALID: the tokens differ" in h) for h in headers] == [not identical, not batch_identical]
    assert "| 1.10× |" in out  # the ratios are still printed
    assert err.startswith("bench_model.py: the generated tokens differ from transformers'")
    monkeypatch.setattr(module, "bench_generation", _fake_generation(True, True))
    assert module.main() == 0
    assert "NOT VALID" not in capsys.readouterr().out


TINY = dict(vocab_size=300, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)


@pytest.mark.parametrize("same", [True, False])
def test_model_training_rows_check_they_train_the_same_model(monkeypatch, capsys, same):
    """The training rows printed ratios with no check that the sides compute the same loss (bench21):
    a transformers model other than lm's (here: a zeroed gate projection) was timed as like for like.
    Every row's loss on the batch, before any step, is compared with transformers'; a difference
    marks the tables NOT VALID and the exit status 1."""
    module = _script("bench_model.py")
    monkeypatch.setattr(module, "SHAPE", TINY)
    if not same:
        real = module.llama_like

        def another_model(model):
            hf = real(model)
            with torch.no_grad():
                hf.model.layers[0].mlp.gate_proj.weight.zero_()
            return hf

        monkeypatch.setattr(module, "llama_like", another_model)
    monkeypatch.setattr(sys, "argv", ["bench_model.py", "--skip-generate", "--batch", "2", "--rounds", "1",
                                      "--warmup", "0"])
    assert module.main() == (0 if same else 1)
    out, err = capsys.readouterr()
    header = next(line for line in out.splitlines() if line.startswith("| implementation |"))
    assert ("NOT VALID: the losses differ" in header) is not same
    assert f"same loss before the first step (every row against transformers'): {same}" in out
    assert err.startswith("bench_model.py: the rows' losses differ") is not same


def test_step_optimizer_rows_check_lm_and_torch_make_the_same_updates(monkeypatch):
    """The AdamW rows were timed with no check that lm's and torch's optimizers of a kind make the same
    update (bench21); they agree to the bit on a CPU, and a torch AdamW of another learning rate stops
    the script before timing anything."""
    from lm.model import TransformerLM

    module = _script("bench_step.py")
    torch.manual_seed(0)
    model = TransformerLM(**{**TINY, "rope_theta": 10000.0})
    assert module.update_difference(model) == 0.0
    real = module.optimizers

    def other_lr(model):
        opts = real(model)
        for group in opts["torch AdamW(foreach=True)"].param_groups:
            group["lr"] *= 1.01
        return opts

    monkeypatch.setattr(module, "optimizers", other_lr)
    assert module.update_difference(model) > module.MAX_UPDATE_DIFFERENCE
    with pytest.raises(SystemExit) as e:
        module.bench_optimizers(model, torch.device("cpu"), rounds=1)
    assert str(e.value).startswith("bench_step.py: lm's and torch's AdamW of the same kind differ by ")


# -- bench_seq2seq --------------------------------------------------------------------------------


def _multi30k(root: Path, test: bool = False) -> Path:
    """A few Multi30k-like pairs: enough for the script to run end to end, fast."""
    d = root / "multi30k"
    d.mkdir(parents=True)
    en = [f"a man in a blue shirt is riding a bike number {i} ." for i in range(24)]
    de = [f"ein mann in einem blauen hemd fährt fahrrad nummer {i} ." for i in range(24)]
    names = {"train.en.gz": en, "train.de.gz": de} | ({"test_2016_flickr.en.gz": en[:4]} if test else {})
    for name, lines in names.items():
        with gzip.open(d / name, "wt", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("argv, why", [
    (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["--rounds", "1", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--rounds", "1", "--steps", "1", "--sentences", "0"], "--sentences: must be >= 1, got 0"),
    (["--rounds", "1", "--steps", "1", "--clients", "0"], "--clients: must be >= 1, got 0"),
])
def test_seq2seq_refuses_bad_counts_before_training(monkeypatch, capsys, tmp_path, argv, why):
    """--rounds 0 was a StatisticsError after the BPE training and tokenizing; the others a
    ZeroDivisionError or an engine error after the whole run."""
    _refused(monkeypatch, capsys, "bench_seq2seq.py", ["--data", _multi30k(tmp_path), *argv], why)


def test_seq2seq_refuses_a_data_folder_without_multi30k(monkeypatch, capsys, tmp_path):
    _refused(monkeypatch, capsys, "bench_seq2seq.py", ["--data", tmp_path],
             f"--data: {str(tmp_path)!r} holds no multi30k/train.en.gz")


@pytest.mark.slow  # the whole script on a few sentences: about 7 s
def test_seq2seq_outputs_that_differ_mark_the_ratios_and_fail(monkeypatch, capsys, tmp_path):
    """identical greedy outputs: False still exited 0 with the decoding and serving ratios shown as valid."""
    module = _script("bench_seq2seq.py")
    greedy = module.greedy_decode
    monkeypatch.setattr(module, "greedy_decode", lambda model, part: [[7] + out for out in greedy(model, part)])
    monkeypatch.setattr(sys, "argv", ["bench_seq2seq.py", "--data", str(_multi30k(tmp_path, test=True)), "--rounds",
                                      "1", "--steps", "1", "--sentences", "2", "--clients", "2"])
    assert module.main() == 1
    out, err = capsys.readouterr()
    rows = {line.split(" |")[0]: line for line in out.splitlines() if line.startswith("| ")}
    assert "NOT VALID" in rows["| greedy decoding, sentences/s"]
    assert "NOT VALID" in rows["| … against greedy_decode one by one (the engine before batching)"]
    assert "NOT VALID" not in rows["| training step, target tokens/s"]
    assert err.strip().splitlines()[-1].startswith("bench_seq2seq.py: outputs differ")


@pytest.mark.slow  # the whole script on a few sentences: about 7 s
def test_seq2seq_with_every_translation_empty_says_so_instead_of_dividing_by_zero(monkeypatch, capsys, tmp_path):
    """A model that ends every translation at once serves no target tokens: the serving ratios were
    a ZeroDivisionError after the whole run (torch 2.11's init, one training step). They are now
    shown as not measured, the other rows as before."""
    module = _script("bench_seq2seq.py")
    monkeypatch.setattr(module, "serve", lambda engine, chunk, at_once: (0.0, [[] for _ in chunk]))
    greedy = module.greedy_decode
    monkeypatch.setattr(module, "greedy_decode",
                        lambda model, part: [[] for _ in part] if len(part) == 1 else greedy(model, part))
    monkeypatch.setattr(sys, "argv", ["bench_seq2seq.py", "--data", str(_multi30k(tmp_path, test=True)), "--rounds",
                                      "1", "--steps", "1", "--sentences", "2", "--clients", "2"])
    assert module.main() == 0
    out, _ = capsys.readouterr()
    rows = {line.split(" |")[0]: line for line in out.splitlines() if line.startswith("| ")}
    for row in ("| serving 2 sentences, target tokens/s",
                "| … against greedy_decode one by one (the engine before batching)"):
        assert "n/a (no target tokens: every translation empty)" in rows[row], rows[row]
    assert rows["| greedy decoding, sentences/s"].endswith("x |")


# -- bench_step, bench_step_bound, bench_decode_steps ----------------------------------------------------


@pytest.mark.parametrize("argv, why", [
    (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["--rounds", "1", "--checkpoint-rounds", "0"], "--checkpoint-rounds: must be >= 1, got 0"),
    (["--config", "nonexist.toml"], "--config: file not found: 'nonexist.toml'"),
    (["--device", "foo"], "--device: unknown device 'foo'"),
])
def test_step_refuses_bad_options(monkeypatch, capsys, argv, why):
    """--config and --device were tracebacks; --rounds 0 a StatisticsError; --checkpoint-rounds 0
    an UnboundLocalError after the optimizer table."""
    _refused(monkeypatch, capsys, "bench_step.py", ["--config", REPO / "configs" / "cpu-small.toml", *argv], why)


@pytest.mark.parametrize("script", ["bench_step.py", "bench_train.py"])
def test_step_and_train_refuse_a_config_that_is_no_file(monkeypatch, capsys, tmp_path, script):
    """clifuzz7: a folder was an IsADirectoryError traceback, a symlink loop an OSError one
    (load_config caught only a missing file)."""
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    _refused(monkeypatch, capsys, script, ["--config", tmp_path], f"--config: not a regular file: {str(tmp_path)!r}")
    _refused(monkeypatch, capsys, script, ["--config", tmp_path / "loop1"], "--config: ")


@pytest.mark.parametrize("argv, why", [
    (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
])
def test_step_bound_refuses_bad_counts(monkeypatch, capsys, argv, why):
    _refused(monkeypatch, capsys, "bench_step_bound.py", ["--skip-steps", *argv], why)


def test_step_bound_times_one_and_sixteen_rows_in_turn():
    """All rounds of the 1-row form ran before any of the 16-row one: the "16 vs 1" ratios came
    from measurements the project's rule says must alternate."""
    module = _script("bench_step_bound.py")
    calls = []
    ms = module.median_ms({1: lambda: calls.append(1), 16: lambda: calls.append(16)}, rounds=3, steps=2)
    assert calls == [1, 1, 1, 16, 16, 16] + [1, 1, 16, 16] * 3  # three warm-up calls each, then turns
    assert sorted(ms) == [1, 16] and all(v >= 0 for v in ms.values())


@pytest.mark.parametrize("argv, why", [
    (["--max-batch", "0"], "--max-batch: must be >= 1, got 0"),
    (["--max-batch", "1", "--rounds", "0"], "--rounds: must be >= 1, got 0"),
    # clifuzz7: an OverflowError traceback from the engine's rows
    (["--max-batch", str(2**70)], "--max-batch: 1,180,591,620,717,411,303,424 rows need "),
])
def test_decode_steps_refuses_bad_counts(monkeypatch, capsys, argv, why):
    _refused(monkeypatch, capsys, "bench_decode_steps.py", argv, why)


# -- bench_train ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, why", [
    (["--config", "nonexist.toml"], "--config: file not found: 'nonexist.toml'"),
    (["--set", "train.batch_size=0"], "config: train.batch_size must be > 0, got 0"),
    (["--set", "nosuch.key=1"], "config: unknown section [nosuch]"),
    (["--set", "train.device=cuda:99"], "train.device: 'cuda:99' is not available on this machine"),
])
def test_train_refuses_bad_config(monkeypatch, capsys, argv, why):
    """Each was a traceback."""
    _refused(monkeypatch, capsys, "bench_train.py", ["--config", REPO / "configs" / "cpu-small.toml", *argv], why)


def test_train_runs_end_to_end_on_a_config_with_a_tokenizer(monkeypatch, capsys):
    """The script's documented command crashed before timing anything (bench21): it dropped the
    config's data.tokenizer by `--set data.tokenizer=''`, which the config check now refuses. A tiny
    run of every row (bare step, lm train, lm train without eval) prints its table; the runs trained
    on the random token files without the config's tokenizer."""
    from lm.train import load_config

    config = REPO / "configs" / "cpu-small.toml"
    assert load_config(config).data.tokenizer  # the case: the config names a tokenizer folder
    shape = ["model.vocab_size=64", "model.context_length=8", "model.d_model=16", "model.num_heads=2",
             "model.d_ff=32", "model.num_layers=1", "train.batch_size=2", "train.compile=false",
             "eval.interval=1", "eval.batches=1", "checkpoint.interval=1", "log.interval=1"]
    _main(monkeypatch, "bench_train.py", "--config", config, "--steps", "2", "--repeats", "1",
          *[a for item in shape for a in ("--set", item)])
    out = capsys.readouterr().out
    assert "repeat 1: bare" in out and "lm train without eval" in out
    assert re.search(r"best of 1: bare [\d,]+ tok/s \| lm train [\d,]+ tok/s = [\d.]+%", out), out


@pytest.mark.parametrize("grad_clip, clips", [(0.0, 0), (1.0, 2)])
def test_train_bare_step_does_what_the_trainer_does(monkeypatch, grad_clip, clips):
    """The bare step kept validate_ids (four min/max reductions and host reads a micro-step that
    `lm train` skips) and clipped at inf when grad_clip was 0 (the Trainer does not clip then)."""
    module = _script("bench_train.py")
    from lm.train import load_config

    cfg = load_config(REPO / "configs" / "cpu-small.toml", [
        "data.train=unused", "model.vocab_size=64", "model.context_length=8", "model.d_model=16",
        "model.num_heads=2", "model.d_ff=32", "model.num_layers=1", "train.batch_size=2",
        f"optim.grad_clip={grad_clip}"])
    built, clipped = [], []
    real = module.TransformerLM

    class Spy(real):
        @classmethod
        def from_config(cls, config):
            built.append(real.from_config(config))
            return built[-1]

    monkeypatch.setattr(module, "TransformerLM", Spy)
    monkeypatch.setattr(module, "clip_grad_norm_", lambda params, max_norm: clipped.append(max_norm))
    assert module.bare_tokens_per_second(cfg, steps=1, warmup=1) > 0
    assert len(built) == 1 and built[0].validate_ids is False
    assert clipped == [grad_clip] * clips


# -- bench_serve ----------------------------------------------------------------------------------

FULL = "abcdefghijklmnopqrstuvwxyz"  # the fake server's greedy answer, one character a token


def _fake_server(request):
    """What lm serve answers to the fault mix's requests, without a model."""
    import httpx

    try:
        body = json.loads(request.content)
    except ValueError:
        return httpx.Response(400, json={"error": {"message": "not JSON"}})
    if len(request.content) > 1_000_000:
        return httpx.Response(413, json={"error": {"message": "too large"}})
    if ("prompt" not in body or body.get("temperature", 0) < 0 or body.get("max_tokens", 1) > 1000
            or body.get("n", 1) < 1):
        return httpx.Response(400, json={"error": {"message": "bad field"}})
    text = FULL[: body["max_tokens"]] if not EMPTY_ANSWERS else ""
    if body.get("stream"):
        events = [{"choices": [{"text": c, "finish_reason": None}]} for c in text]
        return httpx.Response(200, text="".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")
    return httpx.Response(200, json={"choices": [{"text": text}], "usage": {"completion_tokens": len(text)}})


EMPTY_ANSWERS = False  # the fake server answers every valid completion with no text (and no tokens)


@pytest.fixture
def fake_serve(monkeypatch):
    httpx = pytest.importorskip("httpx")
    module = _script("bench_serve.py")
    client = httpx.AsyncClient
    monkeypatch.setattr(module.httpx, "AsyncClient",
                        lambda **kw: client(transport=httpx.MockTransport(_fake_server), **kw))
    return module


def test_serve_faults_with_few_tokens_ask_for_prefixes_of_the_answer(fake_serve):
    """With --tokens 4 the valid requests asked for 8 or 16 tokens, answers longer than the 4-token
    reference they were checked against: a false FAIL while the server did nothing wrong."""
    counts = asyncio.run(fake_serve.faults("http://fake", 60, {"Once upon a time": (FULL[:4], 4)}, 4))
    assert counts["valid"] > 10 and counts["valid correct"] == counts["valid"]
    assert counts["malformed"] > 5 and counts["malformed refused"] == counts["malformed"]
    assert counts["unexpected"] == 0


def test_serve_faults_do_not_take_an_empty_answer_for_a_correct_one(fake_serve, monkeypatch):
    """A valid answer was correct when the reference started with its text, which an empty text always
    is: a server answering every request with nothing scored "every valid answer correct" (bench21).
    Its number of tokens must be the one it asked for (or the reference's, if that is shorter)."""
    monkeypatch.setattr(sys.modules[__name__], "EMPTY_ANSWERS", True)
    counts = asyncio.run(fake_serve.faults("http://fake", 60, {"Once upon a time": (FULL[:20], 20)}, 20))
    assert counts["valid"] > 10 and counts["valid correct"] == 0
    assert counts["malformed refused"] == counts["malformed"] and counts["unexpected"] == 0


def test_serve_sigterm_part_reports_streams_that_never_overlapped(fake_serve, monkeypatch):
    """It exited with one line and printed no table: the concurrency and fault rows it had measured
    were lost. Now no signal is sent and its rows say why."""
    monkeypatch.setattr(fake_serve, "metrics", lambda url: {"lm_batch_size": 0})

    class Proc:
        signals: list[int] = []

        def send_signal(self, signal):
            self.signals.append(signal)

        def wait(self, timeout=None):
            return 0

    term = asyncio.run(fake_serve.sigterm(Proc(), "http://fake", False, 20, 2))
    assert term == {k: "not run: the 2 streams were never decoding at once"
                    for k in ("new request during drain", "streams finished", "exit status")}
    assert Proc.signals == []


def test_serve_refuses_a_missing_checkpoint(monkeypatch, capsys, tmp_path):
    """A traceback ending in ValueError: --checkpoint: file not found."""
    pytest.importorskip("httpx")
    _refused(monkeypatch, capsys, "bench_serve.py", ["--checkpoint", tmp_path / "nonexist"],
             f"--checkpoint: file not found: {str(tmp_path / 'nonexist')!r}")

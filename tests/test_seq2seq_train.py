"""The encoder–decoder through the same trainer, checkpoints, resume and command line as the LM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lm.checkpoint import load_model
from lm.data.pairs import write_pair_file
from lm.tokenizer import Tokenizer, save_tokenizer_dir
from lm.train import Trainer, config_from_dict, read_metrics

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<pad>", "<bos>", "<eos>"]


def _data(tmp: Path):
    """A reversal task over the 26 letters: the target is the source backwards."""
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], SPECIALS)
    save_tokenizer_dir(tok, tmp / "tok")
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(600):
        src = rng.integers(ord("a"), ord("z") + 1, rng.integers(3, 9)) + 3  # + the specials before the bytes
        pairs.append((src, src[::-1].copy()))
    for name, part in (("train", pairs[:500]), ("val", pairs[500:])):
        write_pair_file(tmp / f"{name}.bin", part, vocab_size=tok.vocab_size, tokenizer_sha256=tok.checksum(),
                        source_bytes=sum(len(s) for s, _ in part), target_bytes=sum(len(t) for _, t in part))
    return tok


def _config(tmp: Path, out: str, **train) -> dict:
    return {
        "model": dict(architecture="encoder_decoder", vocab_size=259, context_length=16, d_model=32,
                      encoder_layers=1, decoder_layers=1, num_heads=2, d_ff=64, dropout=0.1),
        "data": dict(train=str(tmp / "train.bin"), val=str(tmp / "val.bin"), tokenizer=str(tmp / "tok")),
        "train": dict(out_dir=str(tmp / out), batch_tokens=128, device="cpu", dtype="float32", **train),
        "optim": dict(schedule="inverse_sqrt", max_lr=3e-3, warmup_iters=10, beta2=0.98),
        "eval": dict(interval=5, batches=2),
        "checkpoint": dict(interval=5, keep_last=3),
        "log": dict(interval=1),
    }


def test_trains_resumes_exactly_and_translates(tmp_path):
    _data(tmp_path)
    straight = Trainer(config_from_dict(_config(tmp_path, "a", max_steps=10)), print_fn=lambda *a: None)
    assert straight.run() == 0
    first = Trainer(config_from_dict(_config(tmp_path, "b", max_steps=5)), print_fn=lambda *a: None)
    assert first.run() == 0
    resumed = Trainer(config_from_dict(_config(tmp_path, "b", max_steps=10)), resume=True,
                      print_fn=lambda *a: None)
    assert resumed.step == 5 and resumed.run() == 0
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "a") if r["split"] == "train"}
    assert losses == {r["step"]: r["loss"] for r in read_metrics(tmp_path / "b") if r["split"] == "train"}
    val = [r for r in read_metrics(tmp_path / "a") if r["split"] == "val"]
    assert [r["step"] for r in val] == [5, 10] and val[-1]["bpb"] is not None
    model, info = load_model(tmp_path / "a" / "model.safetensors")
    assert model.config.architecture == "encoder_decoder"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def lm(*args):
        return subprocess.run([sys.executable, "-m", "lm", *map(str, args)], capture_output=True, text=True, env=env)

    r = lm("translate", "--checkpoint", tmp_path / "a", "abc", "hello", "--beam", "2")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stderr
    r = lm("translate", "--checkpoint", tmp_path / "a", "abc", "--beam", "2", "--alpha", "-1")
    assert r.returncode == 2 and r.stderr.strip() == "lm translate: error: --alpha: must be a finite number >= 0, " \
                                                     "got -1.0"  # the flag (it had said alpha)
    r = lm("sample", "--checkpoint", tmp_path / "a", "--prompt", "abc")
    assert r.returncode == 2 and "is a translation model (encoder_decoder); use `lm translate`" in r.stderr
    (tmp_path / "s.txt").write_text("abc\nhello\n")
    (tmp_path / "t.txt").write_text("cba\nolleh\n")
    r = lm("eval", "--checkpoint", tmp_path / "a", "--data", tmp_path / "s.txt", "--target", tmp_path / "t.txt",
           "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    assert '"bleu"' in r.stdout and '"chrf"' in r.stdout and "nrefs:1" in r.stdout

    # a fault in the pair of files names its argument (the messages had named only the file)
    (tmp_path / "short.txt").write_text("cba\n")
    (tmp_path / "bad.txt").write_bytes(b"cba\n\xff\xfe\n")
    (tmp_path / "empty.txt").write_text("")
    for data, target, message in (("s.txt", "nope.txt", "--target: file not found"),
                                  ("s.txt", "short.txt", "--data/--target: mismatched line counts"),
                                  ("s.txt", "bad.txt", f"--target: {str(tmp_path / 'bad.txt')!r} line 2"),
                                  ("empty.txt", "empty.txt", "--data/--target: "),
                                  ("s.txt", "t.txt --stride 4", "--stride: slides a language model's window")):
        target, *more = target.split()  # --stride had been ignored for a translation model
        r = lm("eval", "--checkpoint", tmp_path / "a", "--data", tmp_path / data, "--target", tmp_path / target,
               *more)
        err = r.stderr.strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_batch_budget_below_the_longest_pair_names_the_setting(tmp_path):
    """It said `data.val: max_tokens 8 is less than ...`: max_tokens is the dataset's parameter, no
    config has it. The error names what the user set, before the run folder is touched."""
    _data(tmp_path)  # pairs of up to 8 letters: 9 tokens with <eos>
    for budgets, message in (
        ({"train": {"batch_tokens": 8}}, "train.batch_tokens: 8 is less than the longest pair kept in data.train "
                                         "(9 tokens with <bos>/<eos>); raise it to at least 9"),
        ({"eval": {"batch_tokens": 6}}, "eval.batch_tokens: 6 is less than the longest pair kept in data.val"),
    ):
        raw = _config(tmp_path, "never", max_steps=2)
        for section, values in budgets.items():
            raw[section].update(values)
        with pytest.raises(ValueError) as error:
            Trainer(config_from_dict(raw), print_fn=lambda *a: None)
        assert str(error.value).startswith(message), str(error.value)
        assert not (tmp_path / "never").exists()

"""The encoder–decoder through the same trainer, checkpoints, resume and command line as the LM."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.cli import main_in_one_interpreter
from helpers.tokenizers import pair_tokenizer
from test_train import _raw_config, _write_toml

from lm.checkpoint import load_model, read_checkpoint
from lm.data.pairs import PairDataset, read_pair_file, write_pair_file
from lm.tokenizer import Tokenizer, save_tokenizer_dir
from lm.tomlio import dump_tables
from lm.train import Trainer, config_from_dict, read_metrics

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<pad>", "<bos>", "<eos>"]


def _data(tmp: Path):
    """A reversal task over the 26 letters: the target is the source backwards."""
    tok = pair_tokenizer()
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


@pytest.mark.slow
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
    # without eval.batch_tokens the validation pairs are batched by train.batch_tokens: that is the name
    tok = pair_tokenizer()
    long = np.arange(ord("a"), ord("a") + 12) + 3  # 12 letters: 13 tokens with <eos>
    write_pair_file(tmp_path / "long_val.bin", [(long, long[::-1].copy())], vocab_size=tok.vocab_size,
                    tokenizer_sha256=tok.checksum())
    raw = _config(tmp_path, "never", max_steps=2)
    raw["data"]["val"], raw["train"]["batch_tokens"] = str(tmp_path / "long_val.bin"), 10
    with pytest.raises(ValueError) as error:
        Trainer(config_from_dict(raw), print_fn=lambda *a: None)
    assert str(error.value) == ("train.batch_tokens: 10 is less than the longest pair kept in data.val (13 tokens "
                                "with <bos>/<eos>); raise it to at least 13, or lower model.context_length")
    assert not (tmp_path / "never").exists()


def test_the_models_special_ids_must_be_the_tokenizers(tmp_path, capsys):
    """A tokenizer trained with `--special-tokens '<eos>' '<pad>' '<bos>'` (or with none) and the
    config's default ids 0, 1, 2 trained a model whose <eos> was another token (a byte, with no
    special tokens), and `lm translate` and `lm eval` used it as such: nothing compared the ids.
    The pair file (its sidecar records the tokenizer's special tokens), data.tokenizer and the
    loaded tokenizer are each checked; `lm tokenize --target` records {} for a tokenizer without any."""
    from lm.checkpoint import export_safetensors
    from lm.cli import main
    from lm.data.pairs import tokenize_pairs
    from lm.model import Seq2SeqConfig, build_model

    (tmp_path / "s.txt").write_text("a dog\na cat\n")
    (tmp_path / "t.txt").write_text("ein Hund\neine Katze\n")
    cases = {
        "reordered": (Tokenizer({0: b"<eos>", 1: b"<pad>", 2: b"<bos>", **{i + 3: bytes([i]) for i in range(256)}},
                                [], ["<eos>", "<pad>", "<bos>"]),
                      "model.pad_id is 0, but <pad> is id 1 in {tok}"),
        "none": (Tokenizer({i: bytes([i]) for i in range(256)}, []),
                 "model.pad_id 0 is not a special token of {tok} (its special tokens: none)"),
        "bytes first": (Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<s>", "</s>", "<blank>"]),
                        "model.pad_id 0 is not a special token of {tok} (its special tokens: <s> 256, </s> 257, "
                        "<blank> 258)"),
    }
    for name, (tok, message) in cases.items():
        d = tmp_path / name
        save_tokenizer_dir(tok, d / "tok")
        tokenize_pairs(tok, tmp_path / "s.txt", tmp_path / "t.txt", d / "train.bin")
        assert read_pair_file(d / "train.bin").meta["special_tokens"] == tok.special_ids
        raw = _config(tmp_path, "never", max_steps=2)
        raw["data"] = {"train": str(d / "train.bin")}
        with pytest.raises(ValueError) as error:
            Trainer(config_from_dict(raw), print_fn=lambda *a: None)
        assert str(error.value) == "data.train: " + message.format(tok=f"the tokenizer of {str(d / 'train.bin')!r}")
        raw["data"]["tokenizer"] = str(d / "tok")
        with pytest.raises(ValueError) as error:
            Trainer(config_from_dict(raw), print_fn=lambda *a: None)
        assert str(error.value) == "data.tokenizer: " + message.format(tok=repr(str(d / "tok")))
        assert not (tmp_path / "never").exists()
        # a model saved without the tokenizer's checksum, loaded with that tokenizer
        export_safetensors(build_model(Seq2SeqConfig(vocab_size=259, context_length=16, d_model=16, encoder_layers=1,
                                                     decoder_layers=1, num_heads=2, d_ff=32)),
                           d / "run" / "model.safetensors")
        for argv in (["translate", "--checkpoint", str(d / "run"), "--tokenizer", str(d / "tok"), "a dog"],
                     ["eval", "--checkpoint", str(d / "run"), "--tokenizer", str(d / "tok"), "--data",
                      str(tmp_path / "s.txt"), "--target", str(tmp_path / "t.txt")]):
            assert main([*argv, "--quiet"]) == 2
            want = message.replace("model.", "the model's ").format(tok=repr(str(d / "tok")))
            assert capsys.readouterr() == ("", f"lm {argv[0]}: error: --tokenizer: {want}\n")
    # the tokenizer the config's ids name: training starts
    d = tmp_path / "matching"
    tok = pair_tokenizer()
    save_tokenizer_dir(tok, d / "tok")
    tokenize_pairs(tok, tmp_path / "s.txt", tmp_path / "t.txt", d / "train.bin")
    raw = _config(tmp_path, "ok", max_steps=1)
    raw["data"] = {"train": str(d / "train.bin"), "tokenizer": str(d / "tok")}
    raw["eval"]["interval"] = 0
    assert Trainer(config_from_dict(raw), print_fn=lambda *a: None).run() == 0


def test_a_pair_sidecars_special_tokens_are_checked_when_read(tmp_path):
    """A sidecar's special_tokens are compared with the model's ids: one that is not a map of
    token texts to ids in the vocabulary is refused when the file is read, naming the sidecar."""
    for bad in ([0, 1, 2], {"<pad>": "0"}, {"<pad>": 259}, {"<pad>": True}):
        write_pair_file(tmp_path / "p.bin", [(np.array([5, 6]), np.array([7]))], vocab_size=259,
                        special_tokens={"<pad>": 0})
        side = tmp_path / "p.bin.json"
        meta = json.loads(side.read_text())
        meta["special_tokens"] = bad
        side.write_text(json.dumps(meta))
        with pytest.raises(ValueError) as error:
            read_pair_file(tmp_path / "p.bin")
        assert str(error.value) == (f"sidecar {str(side)!r}: 'special_tokens' must map each special token to an id "
                                    f"in [0, 259), got {bad!r}")


# -- the trainer's arithmetic on sentence pairs (audit: training math) --------------------------


def _quiet(*_args) -> None:
    pass


def _without_dropout(raw: dict) -> dict:
    raw["model"]["dropout"] = 0.0  # ranks, processes and batches compared: the same function
    return raw


def test_accumulated_pair_micro_batches_weigh_every_target_token_the_same(tmp_path):
    """Each micro-batch's loss is a mean over its own real target tokens. Averaging those means
    over the micro-batches (what the step did) gave a gradient ~10% off that of one batch of the
    same pairs when they hold different numbers of tokens; each now counts its share of the step's
    tokens, as fairseq normalises. The step's tokens are the real ones, known before the batches
    are drawn (no read of the device)."""
    _data(tmp_path)
    raw = _without_dropout(_config(tmp_path, "acc", max_steps=1, grad_accum_steps=3))
    raw["optim"]["grad_clip"] = 0.0  # the optimizer sees the raw gradients
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    reference = copy.deepcopy(trainer.model)
    drawn, next_batch = [], trainer._next_batch
    trainer._next_batch = lambda: drawn.append(next_batch()) or drawn[-1]
    grads, optimizer_step = [], trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    loss, _ = trainer.train_step(1e-3)
    tokens = [b.num_tokens for b in drawn]
    assert len(drawn) == 3 and len(set(tokens)) > 1 and trainer.step_tokens == sum(tokens)
    whole = trainer.train_data.batch(np.concatenate([b.index for b in drawn]))  # one batch of the same pairs
    whole_loss = reference.loss(whole)
    whole_loss.backward()
    torch.testing.assert_close(loss, whole_loss.detach(), rtol=1e-6, atol=0)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[0][name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_pair_training_step_never_waits_for_the_device(tmp_path):
    """The step's token count was read from each batch's mask (``int(tgt_mask.sum())``: on a GPU, a
    sync per micro-batch); it now comes from the sampler's plan, on the host."""
    from helpers.host_reads import HostReads

    _data(tmp_path)
    trainer = Trainer(config_from_dict(_config(tmp_path, "r", max_steps=3, grad_accum_steps=2)), print_fn=_quiet)
    trainer.train_step(1e-3)
    with HostReads() as reads:
        loss, norm = trainer.train_step(1e-3)
        trainer.train_step(1e-3)
    assert reads.reads == []
    assert isinstance(loss, torch.Tensor) and isinstance(norm, torch.Tensor)


def test_evaluation_of_pairs_spreads_over_every_length(tmp_path):
    """``eval.batches`` took the first batches of the length-sorted plan: the shortest sentences
    only (0.2 nats too low on Multi30k), and under DDP each rank took its own first ones. The
    batches are now spread over the plan, the loss is the token mean over their pairs, and two
    ranks splitting the same batches add up to it."""
    _data(tmp_path)
    raw = _config(tmp_path, "ev", max_steps=1)
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    val = trainer.val_data
    plan = val.fixed_batches(128)
    assert len(plan) >= 4 and raw["eval"]["batches"] == 2
    scored = np.concatenate(trainer._val_starts)
    longest = max(val.target_tokens([i]) for i in val.kept)
    assert max(val.target_tokens([i]) for i in scored) == longest  # the first two batches stop short of it
    result = trainer.evaluate()
    trainer.model.eval()  # as evaluate: no dropout
    with torch.no_grad():
        expected = float(trainer.model.loss(val.batch(scored), label_smoothing=0.0))
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
    kw = dict(max_len=16, pad_id=0, bos_id=1, eos_id=2, print_fn=None)
    ranks = [PairDataset(tmp_path / "val.bin", rank=r, world_size=2, **kw).fixed_batches(128, 2) for r in range(2)]
    with torch.no_grad():
        sums = [(float(trainer.model.loss(val.batch(ix), label_smoothing=0.0)) * val.target_tokens(ix),
                 val.target_tokens(ix)) for r in ranks for ix in r]
    assert sum(s for s, _ in sums) / sum(n for _, n in sums) == pytest.approx(result["loss"], rel=1e-6)


def test_two_gloo_processes_equal_one_process_with_two_accumulation_steps(tmp_path):
    """Two ranks with a validation file of one batch: rank 1 has none. Its empty mean was 0/0, the
    all-reduce spread the NaN and the run stopped as 'diverged' (exit 3, no checkpoint). The
    validation loss is now the ranks' summed losses over their summed tokens; the logged tokens
    are the real ones of every rank (they were rank 0's times two); and the gradients weigh
    every target token the same across ranks as across micro-batches."""
    _data(tmp_path)
    write_pair_file(tmp_path / "small.bin", [(np.array([100, 101, 102]), np.array([102, 101, 100]))] * 5,
                    vocab_size=259, target_bytes=20)
    raws = {"one": _config(tmp_path, "one", max_steps=4, grad_accum_steps=2),
            "two": _config(tmp_path, "two", max_steps=4)}
    for raw in raws.values():
        _without_dropout(raw)
        raw["data"]["val"] = str(tmp_path / "small.bin")
        raw["eval"]["interval"] = raw["checkpoint"]["interval"] = 2
    assert Trainer(config_from_dict(raws["one"]), print_fn=_quiet).run() == 0
    (tmp_path / "two.toml").write_text(dump_tables(raws["two"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "lm", "train", "--config", str(tmp_path / "two.toml")],
                          env=env, capture_output=True, text=True, timeout=300)
    records = {name: read_metrics(tmp_path / name) for name in raws}
    train = {name: {r["step"]: r for r in rs if r["split"] == "train"} for name, rs in records.items()}
    logged = sorted(train["two"])  # every step once the run ends; first, what it logged before any end
    assert [train["two"][s]["tokens"] for s in logged] == [train["one"][s]["tokens"] for s in logged]
    assert [train["two"][s]["loss"] for s in logged] == pytest.approx([train["one"][s]["loss"] for s in logged],
                                                                      rel=1e-6)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert logged == [1, 2, 3, 4]
    for step in (2, 4):
        a = read_checkpoint(tmp_path / "one" / "checkpoints" / f"step_{step:08d}.pt")["model"]
        b = read_checkpoint(tmp_path / "two" / "checkpoints" / f"step_{step:08d}.pt")["model"]
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    val = {name: [r["loss"] for r in rs if r["split"] == "val"] for name, rs in records.items()}
    assert len(val["one"]) == 2 and val["two"] == pytest.approx(val["one"], rel=1e-6)


@pytest.mark.slow
def test_compiled_pair_training_compiles_once_and_equals_eager(tmp_path):
    """Pair batches change shape at every step. The fused loss's loop over the token count made
    the compiled step guard on rows x target length, so almost every step compiled again (~10 s
    each, counted as training time; 5 graphs for these 6 steps). With symbolic sizes and one chunk
    taken without a loop it compiles once, and the losses are eager's. (The data's seed gives no
    lone-row batch: torch specialises a size of 1, and that batch compiled a second graph, 30 s.)"""
    from torch._dynamo.utils import counters

    tok = _data(tmp_path)
    rng = np.random.default_rng(6)
    pairs = []
    for _ in range(300):  # targets 0-3 letters longer than their sources: the two lengths differ
        src = rng.integers(ord("a"), ord("z") + 1, rng.integers(3, 9)) + 3
        pairs.append((src, np.concatenate([src[::-1], src[: rng.integers(0, 4)]])))
    write_pair_file(tmp_path / "ragged.bin", pairs, vocab_size=259, tokenizer_sha256=tok.checksum())
    runs = {}
    for compiled in (False, True):
        raw = _without_dropout(_config(tmp_path, f"c{compiled}", max_steps=6, compile=compiled))
        raw["data"]["train"] = str(tmp_path / "ragged.bin")
        del raw["data"]["val"]
        raw["eval"]["interval"] = 0
        torch._dynamo.reset()
        counters.clear()
        trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
        shapes, next_batch = [], trainer._next_batch

        def recording_batch(next_batch=next_batch, shapes=shapes):
            batch = next_batch()
            shapes.append((*batch.src.shape, batch.tgt_in.shape[1]))
            return batch

        trainer._next_batch = recording_batch
        assert trainer.run() == 0
        runs[compiled] = [r["loss"] for r in read_metrics(tmp_path / f"c{compiled}") if r["split"] == "train"]
        graphs = counters["stats"]["unique_graphs"]
    assert len(set(shapes)) >= 5 and min(rows for rows, *_ in shapes) >= 2, shapes
    assert any(src != tgt for _, src, tgt in shapes), shapes  # a target length apart from its source's
    assert graphs == 1, graphs
    assert runs[True] == pytest.approx(runs[False], rel=1e-5)


def test_pair_data_errors_name_the_config_key_and_the_working_directory(tmp_path):
    """A translation config's data errors said "pair file not found: 'data/...'" where a language
    model's say "data.train: ..."; run from another folder, neither said that a config's paths are
    read from the working directory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for config, kind in (("multi30k-en-de.toml", "pair file"), ("tinystories-17m.toml", "token file")):
        done = subprocess.run([sys.executable, "-m", "lm", "train", "--config", str(REPO / "configs" / config)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert "\n" not in line and line.startswith(f"lm train: error: data.train: {kind} not found: 'data/")
        assert line.endswith(f"(a config's paths are read from the working directory, {str(tmp_path)!r})")


def test_a_pair_file_of_a_larger_vocabulary_is_refused_naming_data_train_once(tmp_path):
    """A mutation (the check that an error names its config key already made always false) survived,
    and showed that the check never held: a pair file's errors start "data.train ('PATH'): ", and
    the trainer put "data.train: " before them again ("data.train: data.train ('...'): was tokenized
    ..."). The key is said once."""
    _data(tmp_path)  # tokenized with the pair tokenizer's 259 ids
    raw = _config(tmp_path, "never", max_steps=2)
    raw["model"]["vocab_size"] = 200
    del raw["data"]["tokenizer"]  # else the tokenizer's 259 tokens are refused first
    with pytest.raises(ValueError) as error:
        Trainer(config_from_dict(raw), print_fn=lambda *a: None)
    assert str(error.value) == (f"data.train ({str(tmp_path / 'train.bin')!r}): was tokenized with vocab_size 259, "
                                "larger than the model's 200")
    assert not (tmp_path / "never").exists()


def test_the_pair_trainer_is_torch_adamw_clip_label_smoothing_and_the_inverse_sqrt_schedule(tmp_path):
    """The translation trainer's steps against a loop written with torch: F.cross_entropy with label
    smoothing over the real target tokens (padding ignored, where a batch has any), torch.optim.AdamW
    (decay on the matrices only), clip_grad_norm_ and the paper's inverse-sqrt formula peaking at
    max_lr, fed the pair batches the Trainer drew (the twin of test_train's; testq22)."""
    import math

    import torch.nn.functional as F
    from helpers.torch_training import replay_with_torch

    _data(tmp_path)
    raw = _config(tmp_path, "run", max_steps=6)
    raw["model"]["dropout"] = 0.0  # the reference draws no dropout masks
    raw["optim"] = dict(schedule="inverse_sqrt", max_lr=3e-3, warmup_iters=3, beta1=0.85, beta2=0.97, eps=1e-7,
                        weight_decay=0.2, grad_clip=0.3)
    raw["eval"] = dict(interval=0)
    raw["checkpoint"] = dict(interval=0)
    trainer = Trainer(config_from_dict(raw), print_fn=lambda *a: None)
    d = trainer.model.config.d_model

    def inverse_sqrt(step):  # the paper's formula, scaled to peak at max_lr at step 3
        return 3e-3 * math.sqrt(d * 3) * d**-0.5 * min(step**-0.5, step * 3**-1.5) if step else 0.0

    def smoothed_loss(model, b):
        logits = model(b.src, b.tgt_in, b.src_mask, b.tgt_mask)
        targets = b.tgt_out.masked_fill(~b.tgt_mask, -100)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1, ignore_index=-100)

    steps = replay_with_torch(trainer, smoothed_loss, inverse_sqrt, weight_decay=0.2, betas=(0.85, 0.97), eps=1e-7,
                              grad_clip=0.3)
    assert steps == 6


def test_a_pair_file_rewritten_with_its_pairs_split_otherwise_is_refused_naming_num_pairs(tmp_path):
    """A pair file rewritten in place with the same tokens cut into other pairs (two sentences joined
    into one) is other data: ``--resume`` names the number of pairs, the first thing its sidecar
    says differently (mut30: the field misspelled, so that the message fell through to the file's
    size, survived; no test resumed a translation run on changed pairs)."""
    tok = _data(tmp_path)
    raw = _config(tmp_path, "run", max_steps=1)
    raw["eval"]["interval"] = 0
    assert Trainer(config_from_dict(raw), print_fn=lambda *a: None).run() == 0
    pairs = read_pair_file(tmp_path / "train.bin")
    n = len(pairs)
    joined = [(np.concatenate([pairs.src(0), pairs.src(1)]), np.concatenate([pairs.tgt(0), pairs.tgt(1)])),
              *((pairs.src(i).copy(), pairs.tgt(i).copy()) for i in range(2, n))]
    meta = pairs.meta
    for name in ("train.bin", "train.bin.json"):
        (tmp_path / name).unlink()
    write_pair_file(tmp_path / "train.bin", joined, vocab_size=tok.vocab_size, tokenizer_sha256=tok.checksum(),
                    source_bytes=meta["source_bytes"], target_bytes=meta["target_bytes"])
    assert read_pair_file(tmp_path / "train.bin").meta["num_tokens"] == meta["num_tokens"]  # only the cut differs
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001.pt"
    with pytest.raises(ValueError) as refused:
        Trainer(config_from_dict({**raw, "train": {**raw["train"], "max_steps": 2}}), resume=True,
                print_fn=lambda *a: None)
    assert str(refused.value) == (f"--resume: data.train {str(tmp_path / 'train.bin')!r} is not the file "
                                  f"{str(ckpt)!r} trained on (num_pairs {n} then, {n - 1} now); a resumed run "
                                  "keeps its data: give the file it trained on")


def test_a_pair_run_resumed_by_another_number_of_processes_names_its_batch_tokens(tmp_path, monkeypatch):
    """The refusal to resume with another number of processes counts a pair run's tokens per step as
    ``train.batch_tokens`` x accumulation steps x processes (a decoder's are batch_size x context); the
    count had been checked for decoder-only runs alone."""
    from test_train_resume import _processes

    _data(tmp_path)
    raw = _without_dropout(_config(tmp_path, "run", max_steps=2, grad_accum_steps=2))
    raw["checkpoint"]["interval"] = 2
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    raw["train"]["max_steps"] = 4
    _processes(monkeypatch, 3)
    with pytest.raises(ValueError) as e:
        Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
    assert str(e.value) == (f"--resume: {str(ckpt)!r} was trained by 1 process (256 tokens per step) but this run "
                            "has 3 processes (768 tokens per step); a resumed run keeps its global batch: resume it in "
                            "one process (without torchrun)")


def test_an_uncompiled_lm_train_never_imports_dynamo(tmp_path):
    """Importing torch._dynamo takes 2.4 s (2 cores), and every `lm train` had done it at its start,
    compiled or not: torch wraps the optimizer's add_param_group, zero_grad, state_dict and
    load_state_dict in a guard whose first call imports it, and the memory check's model of shapes
    (on the meta device) ran arange, cos and normal_ through torch's Python references, which do the
    same. An LM run, a translation run and a resume of each now train without it (what they train is
    the other tests'; a compiled run imports it, as torch.compile must)."""
    (tmp_path / "lm").mkdir()
    (tmp_path / "pairs").mkdir()
    _data(tmp_path / "pairs")
    raws = {"lm": _raw_config(tmp_path / "lm", train={"max_steps": 2}, eval={"interval": 2}),
            "pairs": _config(tmp_path / "pairs", "run", max_steps=2)}
    argvs = []
    for name, raw in raws.items():
        raw["checkpoint"] = {"interval": 1, "keep_last": 2}
        config = str(_write_toml(tmp_path / name / "c.toml", raw))
        argvs += [["train", "--config", config, "--quiet"],
                  ["train", "--config", config, "--resume", f"{raw['train']['out_dir']}/checkpoints/step_00000001.pt",
                   "--set", f"train.out_dir={raw['train']['out_dir']}2", "--quiet"]]
    statuses, errors = main_in_one_interpreter(argvs, timeout=300, module="torch._dynamo")
    assert statuses == ["0 False"] * 4, (statuses, errors)
    for raw in raws.values():  # each resumed run trained its second step
        resumed = Path(raw["train"]["out_dir"] + "2") / "checkpoints" / "step_00000002.pt"
        assert read_checkpoint(resumed)["iteration"] == 2

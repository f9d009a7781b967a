"""The training loop's bookkeeping: a log window's record (tokens/s, per-device MFU, ETA), what a
resume carries on, the schedule under max_time, keep_best, the non-finite checks, the validation loss."""

import gc
import os
import weakref

import numpy as np
import pytest
import torch
from helpers.collector import collector_off
from test_train import VOCAB
from test_train import _raw_config as _config

import lm.train.trainer as trainer_module
from lm.train import Trainer, config_from_dict, read_metrics
from lm.train.metrics import format_duration
from lm.train.trainer import _LogWindow


def _let_go(trainer: Trainer) -> None:
    """What ``fit``'s way out does for a trainer whose steps the test ran itself: its metrics file
    closed and its run folder's lock released."""
    trainer.metrics.close()
    trainer._lock.release()


class _TwoProcesses:
    """What _log_window asks of the process group, for rank 0 of two processes whose ranks agree
    (all_mean of equal values is the value)."""

    world_size, rank, is_main, enabled = 2, 0, True, False

    @staticmethod
    def all_mean(value):
        return value


# the MFU of a DDP run is per device: the FLOPs of every process's tokens over one device's peak
# was world_size times too large (2 processes logged 2x the MFU of one doing the same per device).
# the ETA is the steps left times the seconds of a timed step.
def test_a_log_record_is_the_windows_mean_tokens_per_second_and_per_device_mfu(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "peak_flops", lambda device, override, dtype: 1e9)
    raw = _config(tmp_path, train={"max_steps": 10}, eval={"interval": 0}, checkpoint={"interval": 0})
    lines = []
    trainer = Trainer(config_from_dict(raw), print_fn=lines.append)
    try:
        trainer.dist = _TwoProcesses()
        trainer.step, trainer.tokens_seen, trainer.elapsed = 4, 12_345, 6.5
        window = _LogWindow(torch.zeros(()))
        # a compiling step (not timed), then two timed ones: 300 tokens in 2.0 s
        window.add(torch.tensor(9.0), torch.tensor(3.0), 1000, 50.0, timed=False)
        window.add(torch.tensor(2.0), torch.tensor(0.5), 100, 0.5)
        window.add(torch.tensor(4.0), torch.tensor(1.5), 200, 1.5)
        trainer._log_window(window, 1e-3, torch.tensor(1.5))
        record = [r for r in read_metrics(tmp_path / "run") if r["split"] == "train"][-1]
    finally:
        _let_go(trainer)
    tok_s = 300 / 2.0
    fwd = trainer.model.flops_per_token()
    assert record["loss"] == pytest.approx((9.0 + 2.0 + 4.0) / 3)
    assert record["tok_per_s"] == pytest.approx(tok_s)
    assert record["mfu"] == pytest.approx(3 * fwd * tok_s / 2 / 1e9, rel=1e-9)  # one device's share
    assert record["grad_norm"] == pytest.approx(1.5) and record["lr"] == pytest.approx(1e-3)
    assert record["tokens"] == 12_345 and record["time"] == 6.5 and record["step"] == 4
    eta = format_duration((10 - 4) * (2.0 / 2))  # 6 steps left at 1.0 s per timed step
    assert lines[-1].endswith(f"| ETA {eta}"), lines[-1]
    assert window.steps == 0 and float(window.loss_sum) == 0.0 and float(window.norm_sum) == 0.0


# a resume carries on the run's token count and its best validation loss: with the best
# forgotten, the first evaluation after a resume (however bad) replaced checkpoints/best.pt; with the
# count forgotten, the records' "tokens" started again from 0.
def test_a_resume_keeps_the_best_checkpoint_and_counts_tokens_on(tmp_path, monkeypatch):
    raw = _config(tmp_path, train={"max_steps": 10}, eval={"interval": 5},
                  checkpoint={"interval": 5, "keep_last": 10})
    first = Trainer(config_from_dict(raw), print_fn=lambda *_: None)
    scripted = iter([2.0, 1.0])
    monkeypatch.setattr(first, "evaluate", lambda: {"loss": next(scripted), "ppl": 1.0, "bpb": None})
    assert first.run() == 0

    raw["train"]["max_steps"] = 20
    resumed = Trainer(config_from_dict(raw), print_fn=lambda *_: None, resume=True)
    assert resumed.step == 10 and resumed.best_val_loss == 1.0
    scripted_after = iter([3.0, 2.5])  # both worse than the best before the resume
    monkeypatch.setattr(resumed, "evaluate", lambda: {"loss": next(scripted_after), "ppl": 1.0, "bpb": None})
    assert resumed.run() == 0

    from lm.checkpoint import read_checkpoint

    best = read_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")
    assert best["iteration"] == 10 and best["best_val_loss"] == 1.0
    per_step = 4 * 16  # batch_size x context_length, one process
    train = [r for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21))
    assert [r["tokens"] for r in train] == [s * per_step for s in range(1, 21)]
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000020.pt")["tokens_seen"] == 20 * per_step


# with max_time and max_steps both set, the schedule follows whichever limit is nearer: the
# step when the steps run ahead of the clock (the time fraction alone kept a fast run at warm-up lrs).
# the time fraction is of the run's length, max_steps, also where the cosine cycle is shorter
# (at half of max_time a run of 200 steps is where step 100 is, not step 50).
@pytest.mark.parametrize("cycle", [None, 100])
def test_the_schedule_follows_the_step_when_it_is_ahead_of_the_clock(tmp_path, cycle):
    from lm.optim import cosine_lr_schedule

    optim = {"warmup_iters": 10} if cycle is None else {"warmup_iters": 10, "cosine_cycle_iters": cycle}
    raw = _config(tmp_path, train={"max_time": 100.0, "max_steps": 200}, optim=optim)
    trainer = Trainer(config_from_dict(raw), print_fn=lambda *_: None)
    try:
        for step, elapsed, position in [(50, 10.0, 50.0), (50, 50.0, 100.0), (0, 0.0, 0.0), (150, 99.0, 198.0)]:
            trainer.step, trainer.elapsed = step, elapsed
            assert trainer.schedule_position() == pytest.approx(position)
            assert trainer.learning_rate() == pytest.approx(
                cosine_lr_schedule(position, 1e-2, 1e-3, 10, cycle or 200))
    finally:
        _let_go(trainer)


# checkpoint.keep_best = false writes no checkpoints/best.pt (it was written at every new best all the same)
def test_keep_best_false_writes_no_best_checkpoint(tmp_path):
    raw = _config(tmp_path, train={"max_steps": 6}, eval={"interval": 2},
                  checkpoint={"interval": 3, "keep_last": 10, "keep_best": False})
    trainer = Trainer(config_from_dict(raw), print_fn=lambda *_: None)
    assert trainer.run() == 0
    val = [r for r in read_metrics(tmp_path / "run") if r["split"] == "val"]
    assert [r["step"] for r in val] == [2, 4, 6]
    assert trainer.best_val_loss == min(r["loss"] for r in val)  # still tracked, only not written
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_00000003.pt", "step_00000006.pt"]


# a loss that stops being finite stops the run at the next log line even without clipping (no
# gradient norm to catch it): without the check the run logged NaN losses on to its next checkpoint.
# a gradient norm that stops being finite (an overflow under clipping, the loss still finite) stops
# the run at that step, named as the gradient norm.
@pytest.mark.parametrize("bad", ["loss", "norm"])
def test_a_non_finite_loss_or_gradient_norm_stops_the_run_at_its_log_line(tmp_path, bad):
    from lm.train import TrainingDiverged

    raw = _config(tmp_path, train={"max_steps": 8}, eval={"interval": 0}, checkpoint={"interval": 2},
                  optim={"grad_clip": 0.0 if bad == "loss" else 1.0})
    trainer = Trainer(config_from_dict(raw), print_fn=lambda *_: None)
    train_step = trainer.train_step

    def step_going_bad(lr):
        loss, norm = train_step(lr)
        if trainer.step == 2:  # the step about to be counted as step 3
            if bad == "loss":
                loss = torch.full_like(loss, float("nan"))
            else:
                norm = torch.full_like(norm, float("inf"))
        return loss, norm

    trainer.train_step = step_going_bad
    what = "the loss became nan" if bad == "loss" else "the gradient norm became inf"
    with pytest.raises(TrainingDiverged, match=f"^{what} by step 3; the last good checkpoint is .*step_00000002.pt"):
        trainer.run()
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert steps == [1, 2]


# the validation loss is the mean token cross-entropy over eval.batches fixed batches of
# eval.batch_size windows drawn with eval.seed (torch's cross_entropy on the model's logits as the
# reference): a mean over batches - 1, the train batch size or another seed passed every test.
def test_the_validation_loss_is_torchs_cross_entropy_over_the_fixed_eval_batches(tmp_path):
    import torch.nn.functional as F

    from lm.data import TokenDataset

    raw = _config(tmp_path, eval={"interval": 10, "batches": 3, "batch_size": 5, "seed": 7})
    trainer = Trainer(config_from_dict(raw), print_fn=lambda *_: None)
    try:
        got = trainer.evaluate()["loss"]
    finally:
        _let_go(trainer)
    val = TokenDataset(raw["data"]["val"], 16, vocab_size=VOCAB)
    losses = []
    with torch.no_grad():
        for starts in val.fixed_batches(3, 5, seed=7):
            assert len(starts) == 5
            windows = torch.from_numpy(val.windows(starts).astype(np.int64))
            logits = trainer.model(windows[:, :-1])
            losses.append(F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))
    assert got == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
    assert trainer.model.training  # evaluation puts the model back in training mode


# the start line's tokens per step counts every micro-batch of an accumulated step
def test_the_start_line_counts_the_tokens_of_every_micro_batch(tmp_path):
    raw = _config(tmp_path, train={"grad_accum_steps": 3})
    lines = []
    trainer = Trainer(config_from_dict(raw), print_fn=lines.append)
    try:
        trainer._log_start()
    finally:
        _let_go(trainer)
    assert any(f"| {4 * 16 * 3:,} tokens/step |" in line for line in lines), lines


# an encoder-decoder's records count the real target tokens of its steps (README: "an
# encoder-decoder's real target tokens"), not train.batch_tokens, the budget a step is drawn under
def test_pair_records_count_the_real_target_tokens_of_the_steps(tmp_path):
    from helpers.tokenizers import pair_tokenizer

    from lm.data.pairs import write_pair_file

    tok = pair_tokenizer()
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(200):
        src = rng.integers(ord("a"), ord("z") + 1, rng.integers(3, 9)) + 3
        pairs.append((src, src[::-1].copy()))
    for name, part in (("train", pairs[:150]), ("val", pairs[150:])):
        write_pair_file(tmp_path / f"{name}.bin", part, vocab_size=tok.vocab_size, tokenizer_sha256=tok.checksum(),
                        source_bytes=sum(len(s) for s, _ in part), target_bytes=sum(len(t) for _, t in part))
    raw = {
        "model": dict(architecture="encoder_decoder", vocab_size=259, context_length=16, d_model=32,
                      encoder_layers=1, decoder_layers=1, num_heads=2, d_ff=64),
        "data": dict(train=str(tmp_path / "train.bin"), val=str(tmp_path / "val.bin")),
        "train": dict(out_dir=str(tmp_path / "run"), batch_tokens=128, device="cpu", dtype="float32",
                      max_steps=4, grad_accum_steps=2),
        "optim": dict(schedule="inverse_sqrt", max_lr=3e-3, warmup_iters=10),
        "eval": dict(interval=0), "checkpoint": dict(interval=0), "log": dict(interval=1),
    }
    trainer = Trainer(config_from_dict(raw), print_fn=lambda *_: None)
    drawn, next_batch = [], trainer._next_batch
    trainer._next_batch = lambda: drawn.append(next_batch()) or drawn[-1]
    assert trainer.run() == 0
    # the real target tokens (with <eos>) of each step's two micro-batches, counted from the batches
    per_step = [sum(int(b.tgt_mask.sum()) for b in drawn[i : i + 2]) for i in range(0, 8, 2)]
    assert len(drawn) == 8 and len(set(per_step)) > 1
    records = [r for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert [r["tokens"] for r in records] == [int(n) for n in np.cumsum(per_step)]


def test_a_dropped_trainer_frees_its_model_and_token_files_without_the_cyclic_collector(tmp_path):
    """The trainer's autocast was a lambda over the trainer itself: a cycle, so a trainer that was
    dropped kept its weights, gradients, AdamW moments and mapped token files until a full
    collection, and a sweep in one process held several runs at once (cyc25: five, 823 MiB). With
    the collector off, they are freed when the trainer is dropped."""
    def run(name: str) -> Trainer:
        trainer = Trainer(config_from_dict(_config(tmp_path, train={"out_dir": str(tmp_path / name), "max_steps": 2},
                                                   eval={"interval": 0}, checkpoint={"interval": 0})),
                          print_fn=lambda *a: None, quiet=True)
        assert trainer.run() == 0
        return trainer

    def mapped() -> int:
        with open("/proc/self/maps") as f:
            return sum(str(tmp_path / "train.bin") in line for line in f)

    run("first")  # the first trainer of a process may also be held by torch's import of its compiler (torch's)
    gc.collect()
    with collector_off():
        trainer = run("second")
        refs = [weakref.ref(trainer), weakref.ref(next(trainer.model.parameters()))]
        del trainer
        assert [r() is None for r in refs] == [True, True]
        if os.path.exists("/proc/self/maps"):
            assert mapped() == 0


def test_a_trainer_made_and_dropped_unrun_lets_go_of_its_run_folder(tmp_path):
    """Only run() released the run folder's lock: a trainer made and dropped unrun (a notebook cell
    run again) left its folder refused to every later trainer of the process, as "in use by another
    `lm train`" with the process's own pid (cyc25)."""
    raw = _config(tmp_path, train={"max_steps": 2}, eval={"interval": 0}, checkpoint={"interval": 0})
    with collector_off():
        unrun = Trainer(config_from_dict(raw), print_fn=lambda *a: None, quiet=True)
        with pytest.raises(ValueError, match="in use by another `lm train` in this process"):
            Trainer(config_from_dict(raw), print_fn=lambda *a: None, quiet=True)
        del unrun  # its folder now holds a run with no checkpoint yet: resumed, as any other
        assert Trainer(config_from_dict(raw), print_fn=lambda *a: None, quiet=True, resume=True).run() == 0


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (59.4, "59s"), (60, "1m00s"), (61, "1m01s"), (3599, "59m59s"), (3599.6, "1h00m"), (3600, "1h00m"),
    (3659, "1h00m"), (3660, "1h01m"), (7 * 3600 + 5 * 60 + 59, "7h05m"), (100 * 3600, "100h00m"),
    (float("inf"), "?"), (float("nan"), "?"),
])
def test_format_duration_of_the_eta_and_waits(seconds, text):
    """The ETA of the train lines and the waits that errors name: seconds under a minute, minutes and
    seconds under an hour, then hours and minutes; ? for no finite time."""
    assert format_duration(seconds) == text

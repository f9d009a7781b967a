"""Claims of the README about `lm train` that had no test: device/dtype `auto`, `train.compile`,
resuming a `max_time` run, and `best.pt` holding the lowest validation loss."""

import os
import signal

import pytest
import torch
from test_train import _quiet, _raw_config

from lm.checkpoint import read_checkpoint
from lm.train import Trainer, config_from_dict, read_metrics


def _records(run_dir, split, key):
    return {r["step"]: r[key] for r in read_metrics(run_dir) if r["split"] == split}


def _expected_auto_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def test_auto_device_and_dtype_run_through_the_trainer(tmp_path):
    """`auto` picks CUDA, then MPS, then the CPU; on the CPU `dtype = auto` is float32 (no
    autocast), so the run equals an explicit cpu/float32 run bitwise."""
    runs = {}
    for name, device, dtype in (("auto", "auto", "auto"), ("explicit", "cpu", "float32")):
        (tmp_path / name).mkdir()
        raw = _raw_config(tmp_path / name, train={"device": device, "dtype": dtype, "max_steps": 6})
        trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
        assert trainer.run() == 0
        runs[name] = trainer
    auto = runs["auto"]
    assert auto.device.type == _expected_auto_device()
    if auto.device.type != "cpu":
        pytest.skip("an accelerator: the auto run is not comparable with the CPU one bitwise")
    assert _records(tmp_path / "auto" / "run", "train", "loss") == _records(tmp_path / "explicit" / "run", "train",
                                                                            "loss")  # fmt: skip
    for k, v in runs["explicit"].model.state_dict().items():
        assert torch.equal(auto.model.state_dict()[k], v), k


@pytest.mark.slow
def test_compile_runs_through_the_trainer(tmp_path):
    """`train.compile = true` wraps the model in torch.compile (inductor; slow to compile on a CPU)
    and trains like eager. Measured: losses at most 2e-6 apart over 4 steps."""
    losses = {}
    for compile_ in (False, True):
        (tmp_path / str(compile_)).mkdir()
        raw = _raw_config(tmp_path / str(compile_), train={"compile": compile_, "max_steps": 4},
                          eval={"interval": 2})  # fmt: skip
        trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
        assert trainer.run() == 0
        if compile_:
            assert trainer.train_model is not trainer.model and hasattr(trainer.train_model, "_orig_mod")
        losses[compile_] = [*_records(tmp_path / str(compile_) / "run", "train", "loss").values(),
                            *_records(tmp_path / str(compile_) / "run", "val", "loss").values()]  # fmt: skip
    assert len(losses[True]) == 4 + 2
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)


def _fake_clock(trainer):
    ticks = iter(range(1_000_000))
    # every training step takes 1/128 s: a power of two, so elapsed sums exactly however the run is cut
    trainer.clock = lambda: next(ticks) / 128


def test_resuming_a_max_time_run_continues_its_clock_and_schedule(tmp_path):
    """A 1-second run stopped at step 64 (0.5 s, its `elapsed` in the checkpoint) and resumed
    finishes at 1.0 s and step 128 with the learning rates and losses of an uninterrupted run."""

    def config(name):
        raw = _raw_config(tmp_path, train={"max_time": 1.0, "out_dir": str(tmp_path / name)},
                          optim={"cosine_cycle_iters": 128}, checkpoint={"interval": 16, "keep_last": 10})  # fmt: skip
        del raw["train"]["max_steps"]
        return config_from_dict(raw)

    straight = Trainer(config("straight"), print_fn=_quiet)
    _fake_clock(straight)
    assert straight.run() == 0 and straight.step == 128

    def stop_at_64(step, path):
        if step == 64:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's own handler: stop after this step

    stopped = Trainer(config("stopped"), print_fn=_quiet, on_checkpoint=stop_at_64)
    _fake_clock(stopped)
    assert stopped.run() == 128 + signal.SIGTERM and stopped.step == 64
    saved = read_checkpoint(tmp_path / "stopped" / "checkpoints" / "step_00000064.pt")
    assert saved["schedule"]["elapsed"] == 0.5 and saved["schedule"]["position"] == 64.0

    resumed = Trainer(config("stopped"), print_fn=_quiet, resume=True)
    assert resumed.step == 64 and resumed.elapsed == 0.5
    _fake_clock(resumed)
    assert resumed.run() == 0
    assert resumed.step == 128 and resumed.elapsed == 1.0
    for key in ("lr", "loss"):
        a = _records(tmp_path / "straight", "train", key)
        b = _records(tmp_path / "stopped", "train", key)
        assert list(b) == list(range(1, 129)) and b == a, key


def test_best_checkpoint_holds_the_lowest_validation_loss(tmp_path, monkeypatch):
    # A real run: best.pt is the step of the lowest logged validation loss, and its weights give it.
    raw = _raw_config(tmp_path, train={"max_steps": 30}, eval={"interval": 5},
                      checkpoint={"interval": 5, "keep_last": 10})  # fmt: skip
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    assert trainer.run() == 0
    val = _records(tmp_path / "run", "val", "loss")
    best = read_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")
    assert best["best_val_loss"] == min(val.values()) and best["iteration"] == min(val, key=val.get)
    trainer.model.load_state_dict(best["model"])
    assert trainer.evaluate()["loss"] == best["best_val_loss"]

    # Scripted validation losses whose minimum is not the last: best.pt is that step's checkpoint.
    (tmp_path / "scripted").mkdir()
    raw = _raw_config(tmp_path / "scripted", train={"max_steps": 30}, eval={"interval": 5},
                      checkpoint={"interval": 5, "keep_last": 10})  # fmt: skip
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    scripted = iter([3.0, 2.0, 2.5, 1.5, 1.8, 1.7])
    monkeypatch.setattr(trainer, "evaluate", lambda: {"loss": next(scripted), "ppl": 1.0, "bpb": None})
    assert trainer.run() == 0
    folder = tmp_path / "scripted" / "run" / "checkpoints"
    best = read_checkpoint(folder / "best.pt")
    assert best["iteration"] == 20 and best["best_val_loss"] == 1.5
    at_20 = read_checkpoint(folder / "step_00000020.pt")
    assert at_20["iteration"] == 20
    for k, v in at_20["model"].items():
        assert torch.equal(best["model"][k], v), k

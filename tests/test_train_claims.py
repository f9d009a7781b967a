"""Claims of the README about `lm train` that had no test: device/dtype `auto`, `train.compile`,
resuming a `max_time` run, `best.pt` holding the lowest validation loss, config.toml reading back
as the run's config (so `--resume` works), and device errors naming what the user typed."""

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


# -- config.toml reads back as the config it was written from (so --resume works) ----------------

def test_config_toml_round_trips_any_string_and_numpy_numbers():
    """JSON's escapes were written as TOML's: a character above U+FFFF became a surrogate pair
    ("\\ud83d\\ude42") and a numpy float its repr (np.float64(0.001)), neither of them TOML."""
    import numpy as np
    import tomllib

    from lm.tomlio import dump_tables

    texts = ["runs/🙂", "story 😀 é ü 中", "\x00\x01\x1f\x7f\t\n\r\b\f", 'a "quoted" \\ back\\slash', "\u2028\ufeff",
             "\U0010ffff"]
    numbers = {"f64": np.float64(0.001), "f32": np.float32(0.1), "i64": np.int64(7), "b": np.bool_(True),
               "big": 2**70, "tiny": 5e-324, "inf": float("inf")}
    text = dump_tables({"s": {f"k{i}": t for i, t in enumerate(texts)}, "n": numbers})
    assert text.isascii()  # as JSON's escapes kept it: the file reads the same in any encoding
    back = tomllib.loads(text)
    assert back["s"] == {f"k{i}": t for i, t in enumerate(texts)}
    assert back["n"] == {"f64": 0.001, "f32": float(np.float32(0.1)), "i64": 7, "b": True, "big": 2**70,
                         "tiny": 5e-324, "inf": float("inf")}
    assert 'k0 = "runs/\\U0001f642"' in text and "f64 = 0.001\n" in text


def test_a_name_that_is_not_utf8_is_refused_naming_its_key():
    """A folder named in Latin-1 (argv's surrogateescape: 'runs/caf\\udce9') was written as a lone
    surrogate, which no TOML file holds: the run trained, then could never be resumed."""
    from lm.tomlio import dump_tables

    with pytest.raises(ValueError) as e:
        dump_tables({"train": {"device": "cpu", "out_dir": "runs/caf\udce9"}})
    assert str(e.value) == ("train.out_dir: 'runs/caf\\udce9' holds the byte 0xE9 of a name that is not UTF-8, "
                            "which a TOML file cannot hold; use a name in UTF-8")


def test_a_run_named_with_an_emoji_resumes_in_its_folder(tmp_path):
    """`--set train.out_dir=runs/🙂` trained, and `--resume` then called the run's own folder "not an
    lm run config (not valid TOML: Escaped character is not a Unicode scalar value ...)"."""

    def config(steps):
        raw = _raw_config(tmp_path, train={"out_dir": str(tmp_path / "runs 🙂"), "max_steps": steps},
                          wandb={"name": "story 😀"}, eval={"interval": 0})  # fmt: skip
        return config_from_dict(raw)

    assert Trainer(config(2), print_fn=_quiet).run() == 0
    resumed = Trainer(config(4), print_fn=_quiet, resume=True)
    assert resumed.step == 2 and resumed.run() == 0 and resumed.step == 4


# -- devices: one line naming what the user typed ----------------------------------------------------

@pytest.mark.parametrize("device", ["cuda:01", "cuda:99999999999999999999", "cpu\n"])
def test_device_names_torch_cannot_parse_are_one_line(device):
    """The pattern let these through (a leading zero, an index past int64, "$" before a final newline)
    and torch.device raised RuntimeError: a traceback, exit 1."""
    from lm.device import available_devices, resolve_device

    with pytest.raises(ValueError) as e:
        resolve_device(device, "train.device")
    assert str(e.value) == (f"train.device: unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps "
                            f"(here: {', '.join(available_devices())})")


def test_a_cuda_index_past_the_devices_is_refused_as_written(monkeypatch):
    """torch keeps a device index in 8 bits: "cuda:256" was cuda:0, and on a one-GPU machine trained
    there without a word. The index is compared with the device count as the user wrote it."""
    import torch

    from lm.device import resolve_device

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("cuda:256", "cuda:1", "cuda:128"):
        with pytest.raises(ValueError, match=rf"^--device: '{name}' is not available on this machine \(available: "):
            resolve_device(name)
    assert resolve_device("cuda:0") == torch.device("cuda", 0) and resolve_device("cuda") == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 0)] * 2


@pytest.mark.parametrize("device, message", [
    ("cuda:01", "unknown device 'cuda:01'"),
    ("", "unknown device ''"),  # was dropped: the run trained on the config's device
])
def test_lm_train_names_the_device_flag_it_was_given(tmp_path, capsys, device, message):
    """`lm train --device X` was reported as `train.device: ...`, an option the user never typed."""
    from test_train import _write_toml

    from lm.cli import main

    config = _write_toml(tmp_path / "c.toml", _raw_config(tmp_path))
    assert main(["train", "--config", str(config), "--device", device, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lm train: error: --device: {message}; use auto, cpu") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
    # given as train.device, it is named so
    assert main(["train", "--config", str(config), "--set", "train.device=cuda:01", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("lm train: error: train.device: unknown device 'cuda:01'")


def test_a_run_that_fails_after_taking_its_folder_leaves_none_behind(tmp_path, monkeypatch):
    """ddp8: a failure after the run folder was made and locked, before anything was written in it
    (under DDP, a peer that died at the first broadcast), left the folder holding a stale .lock,
    and the next run printed that it "took over" the lock. Now the folder goes (a fresh one), or
    only the lock (a run's own folder, resumed)."""
    def broken(self):
        raise RuntimeError("the DDP wrap failed")

    raw = _raw_config(tmp_path, train={"max_steps": 2})
    with monkeypatch.context() as m:
        m.setattr(Trainer, "_wrap_for_devices", broken)
        with pytest.raises(RuntimeError, match="the DDP wrap failed"):
            Trainer(config_from_dict(raw), print_fn=_quiet)
    assert not (tmp_path / "run").exists()
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    raw["train"]["max_steps"] = 4
    with monkeypatch.context() as m:
        m.setattr(Trainer, "_wrap_for_devices", broken)
        with pytest.raises(RuntimeError, match="the DDP wrap failed"):
            Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == files  # no .lock left
    lines = []
    assert Trainer(config_from_dict(raw), resume=True, print_fn=lines.append).run() == 0
    assert not any("took over" in line for line in lines), lines


def test_more_ctrl_cs_during_a_slow_checkpoint_write_wait_for_it(tmp_path, monkeypatch, capsys):
    """ckpt8: a third Ctrl-C while a large checkpoint was being written left run()'s wait for it:
    the lock was never released, and `lm`'s exit (os._exit) cut the file short, leaving only its
    temporary file. Now every further signal is held until the file is whole; the run says so."""
    import threading
    import time

    from lm.checkpoint.manager import CheckpointManager

    save = CheckpointManager.save

    def slow_save(self, *args, **kwargs):
        time.sleep(1.5)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", slow_save)
    raw = _raw_config(tmp_path, train={"max_steps": 1000}, checkpoint={"interval": 3})
    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)

    def press_ctrl_c_thrice():
        while not trainer._writer.writing:
            time.sleep(0.01)
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGINT)  # from another thread: to the process, as a real Ctrl-C
            time.sleep(0.2)

    presser = threading.Thread(target=press_ctrl_c_thrice)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    presser.join()
    assert not trainer._writer.writing  # the file was finished before run() gave up
    ckpts = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckpts.iterdir()] == ["step_00000003.pt"]
    assert read_checkpoint(ckpts / "step_00000003.pt")["iteration"] == 3
    assert not (tmp_path / "run" / ".lock").exists()
    assert f"the checkpoint being written was finished: {ckpts / 'step_00000003.pt'}" in capsys.readouterr().err

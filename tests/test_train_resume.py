"""What `--resume` accepts and refuses (audit "train", items 1, 3, 7 and 10): another number of
processes, a budget below the checkpoint's step, the same data file by another path, and the way
out of an unreadable latest checkpoint."""

import shlex
import shutil
import subprocess
import warnings

import numpy as np
import pytest
import torch
from test_train import VOCAB, _cli, _fake_wandb, _quiet, _raw_config, _recording_init, _snapshot, _write_toml
from test_train_bookkeeping import _let_go

from lm.checkpoint import read_checkpoint
from lm.checkpoint.io import write_checkpoint
from lm.cli import main
from lm.data import write_token_file
from lm.tomlio import dump_tables
from lm.tomlio import loads as toml_loads
from lm.train import Trainer, config_from_dict, load_config, read_metrics
from lm.train.distributed import Dist


def _processes(monkeypatch, world_size: int) -> None:
    """The next Trainers see ``world_size`` processes (this one is rank 0); nothing here trains
    under more than one, so no process group is needed: the refusals come first."""
    import lm.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "init_distributed",
                        lambda device, timeout: (Dist(0, 0, world_size), torch.device("cpu")))  # fmt: skip


def _rewrite(path, **changes) -> None:
    """The checkpoint at ``path`` with some of its entries changed (None: removed), as an older or
    other lm would have written it."""
    state = read_checkpoint(path)
    for key, value in changes.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    state.pop("format"), state.pop("version")
    write_checkpoint(state, path)


def test_resume_with_another_number_of_processes_is_refused(tmp_path, monkeypatch):
    """Each process draws its own rows, so 2 processes resuming a 1-process run doubled the global
    batch (and changed the validation batches) with no word said."""
    raw = _raw_config(tmp_path, train={"max_steps": 4})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    assert read_checkpoint(ckpt)["world_size"] == 1
    before = _snapshot(tmp_path / "run")
    raw["train"]["max_steps"] = 8
    _processes(monkeypatch, 2)
    with pytest.raises(ValueError) as e:
        Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
    assert str(e.value) == (f"--resume: {str(ckpt)!r} was trained by 1 process (64 tokens per step) but this run has "
                            "2 processes (128 tokens per step); a resumed run keeps its global batch: resume it in one "
                            "process (without torchrun)")
    assert _snapshot(tmp_path / "run") == before
    _processes(monkeypatch, 1)
    _rewrite(ckpt, world_size=2)  # the other way round
    with pytest.raises(ValueError, match=r"was trained by 2 processes \(128 tokens per step\) but this run has 1 "
                                         r"process \(64 tokens per step\); .* resume it with torchrun "
                                         r"--nproc_per_node 2$"):
        Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
    _rewrite(ckpt, world_size=None)  # a checkpoint from before the field: accepted as it always was
    trainer = Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
    assert trainer.step == 4 and trainer.run() == 0


def test_a_checkpoint_from_before_its_bookkeeping_resumes_with_none_of_it(tmp_path):
    """A checkpoint written before tokens_seen, best_val_loss and last_eval_step were kept resumes
    (seed 14: best_val_loss read with no default, a TypeError on such a checkpoint, survived): no
    tokens counted, no best loss known, so the first evaluation after it is the best so far and
    writes best.pt, and no step evaluated."""
    import math

    raw = _raw_config(tmp_path, train={"max_steps": 2}, checkpoint={"interval": 2}, eval={"interval": 2})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    run = tmp_path / "run"
    _rewrite(run / "checkpoints" / "step_00000002.pt", tokens_seen=None, best_val_loss=None, last_eval_step=None)
    (run / "checkpoints" / "best.pt").unlink()
    raw["train"]["max_steps"] = 4
    trainer = Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
    assert trainer.step == 2 and trainer.tokens_seen == 0 and trainer.best_val_loss == math.inf
    assert trainer.run() == 0
    val = [r["loss"] for r in read_metrics(run) if r["split"] == "val" and r["step"] == 4]
    assert len(val) == 1 and read_checkpoint(run / "checkpoints" / "best.pt")["best_val_loss"] == val[0]


def test_a_checkpoint_without_its_step_is_refused_as_no_training_checkpoint(tmp_path):
    """A checkpoint that records no ``iteration`` (written by write_checkpoint from a dict of one's own)
    had been a KeyError traceback when it was the run's latest, and, as an older one named by
    --resume, "(step 0) is older than the run's latest": a step read from nowhere. The run's folder
    is left as it was."""
    raw = _raw_config(tmp_path, train={"max_steps": 4})
    raw["checkpoint"] = {"interval": 2, "keep_last": 0}
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    ckpts = tmp_path / "run" / "checkpoints"
    older, latest = ckpts / "step_00000002.pt", ckpts / "step_00000004.pt"
    raw["train"]["max_steps"] = 8
    aside = shlex.quote(str(latest)) + " " + shlex.quote(str(latest) + ".unreadable")
    for path, bad, hint in [(older, None, "")] + [
            (latest, bad, f"; move it aside (mv {aside}) and run again with --resume alone: it continues from step 2")
            for bad in (None, "4", -1, 4.0, True)]:
        _rewrite(path, iteration=bad)
        before = _snapshot(tmp_path / "run")
        with pytest.raises(ValueError) as e:
            Trainer(config_from_dict(raw), resume=str(path) if path == older else True, print_fn=_quiet)
        assert str(e.value) == (f"--resume: {str(path)!r} records no iteration (the step it was saved at); it is not "
                                f"a training checkpoint{hint}"), (path, bad)
        assert _snapshot(tmp_path / "run") == before


def test_resume_with_max_steps_below_the_checkpoint_is_refused(tmp_path, capsys):
    """It used to exit 0 saying nothing, and config.toml then said max_steps = 3 for a run at step 10."""
    good = _write_toml(tmp_path / "good.toml", _raw_config(tmp_path, train={"max_steps": 10}))
    assert _cli(["train", "--config", str(good), "--quiet"], capsys)[0] == 0
    before = _snapshot(tmp_path)
    rc, err = _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=3"], capsys)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000010.pt"
    assert rc == 2 and err == (f"lm train: error: --resume: train.max_steps 3 is below the step of {str(ckpt)!r}, 10; "
                               "set train.max_steps to 10 or more (at 10 there is nothing left to train)\n"), err
    assert _snapshot(tmp_path) == before
    assert load_config(tmp_path / "run" / "config.toml").train.max_steps == 10
    # the checkpoint's own step: nothing to do, and it says so
    assert main(["train", "--config", str(good), "--resume", "--quiet"]) == 0
    assert "nothing left to train: step 10 has reached train.max_steps 10" in capsys.readouterr().out


def test_resume_messages_spell_values_as_the_config_does(tmp_path, capsys):
    """"train.deterministic is True in ... but False", "cosine_cycle_iters is None" and "keep_best
    True -> False": Python's spellings of what config.toml writes true, false or leaves out (audit
    train8). A key left out is "unset"."""
    good = _write_toml(tmp_path / "good.toml", _raw_config(tmp_path, train={"max_steps": 4}))
    assert _cli(["train", "--config", str(good), "--quiet"], capsys)[0] == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    for item, was, now in (("train.deterministic=false", "true", "false"), ("optim.cosine_cycle_iters=9", "unset", "9"),
                           ("train.dtype=bfloat16", "'float32'", "'bfloat16'")):
        rc, err = _cli(["train", "--config", str(good), "--resume", "--set", item], capsys)
        key = item.split("=")[0]
        assert rc == 2 and err.startswith(f"lm train: error: --resume: {key} is {was} in {str(ckpt)!r} but {now} in "
                                          "the config; a resumed run keeps"), err
    assert main(["train", "--config", str(good), "--resume", "--set", "checkpoint.keep_best=false",
                 "--set", "log.peak_tflops=5"]) == 0
    assert "resumed with checkpoint.keep_best true -> false, log.peak_tflops unset -> 5.0" in capsys.readouterr().out


def test_the_same_data_by_another_path_or_moved_resumes_and_other_data_is_refused(tmp_path, capsys, monkeypatch):
    """data.train was compared as a string: `./train.bin` for `train.bin`, an absolute path for a
    relative one, or the file moved to another folder, could never resume. The same file (or a file
    with the fingerprint the checkpoint recorded) resumes, and the new path is recorded."""
    monkeypatch.chdir(tmp_path)
    raw = _raw_config(tmp_path, train={"max_steps": 4, "out_dir": "run"})
    raw["data"] = {"train": "train.bin", "val": "val.bin"}
    good = _write_toml(tmp_path / "good.toml", raw)
    assert _cli(["train", "--config", str(good), "--quiet"], capsys)[0] == 0

    def resume(train: str, val: str = "val.bin", steps: int = 4) -> tuple[int, str]:
        return _cli(["train", "--config", str(good), "--resume", "--quiet", "--set", f"data.train={train}",
                     "--set", f"data.val={val}", "--set", f"train.max_steps={steps}"], capsys)

    assert resume("./train.bin") == (0, "")
    assert resume(str(tmp_path / "train.bin"), str(tmp_path / "val.bin"), 5) == (0, "")
    (tmp_path / "moved").mkdir()
    for name in ("train.bin", "train.bin.json"):
        shutil.move(tmp_path / name, tmp_path / "moved" / name)
    assert resume("moved/train.bin", steps=6) == (0, "")
    changed = [r["changed"] for r in read_metrics(tmp_path / "run") if r["split"] == "config"]
    assert changed[0] == {"data.train": {"was": "train.bin", "now": "./train.bin"}}
    # the first resume trained nothing but wrote its checkpoint again, with the path it recorded
    assert changed[1]["data.train"] == {"was": "./train.bin", "now": str(tmp_path / "train.bin")}
    assert changed[1]["data.val"] == {"was": "val.bin", "now": str(tmp_path / "val.bin")}
    assert changed[2]["data.train"] == {"was": str(tmp_path / "train.bin"), "now": "moved/train.bin"}
    assert load_config(tmp_path / "run" / "config.toml").data.train == "moved/train.bin"

    # other data: another file, or one of the same size, sidecar and tokenizer with other ids
    n = len(np.fromfile(tmp_path / "moved" / "train.bin", dtype=np.uint16))
    other = tmp_path / "other.bin"
    write_token_file(other, np.random.default_rng(1).integers(0, VOCAB, n), vocab_size=VOCAB, source_bytes=3 * n,
                     tokenizer_sha256="abc")  # fmt: skip
    before = _snapshot(tmp_path / "run")
    for data in ("val.bin", str(other)):
        rc, err = resume(data, steps=7)
        assert rc == 2 and err.count("\n") == 1, err
        assert "--resume: data.train is 'moved/train.bin' in " in err and f"but {data!r} in the config" in err, err
    assert _snapshot(tmp_path / "run") == before


def test_the_hint_for_an_unreadable_latest_checkpoint_works(tmp_path, capsys):
    """The hint used to be `--resume RUN/checkpoints/step_10.pt`, which is then refused (older than
    the latest checkpoint of the run). Now it says to move the file aside: doing exactly that and
    running --resume again continues from the checkpoint before it."""
    raw = _raw_config(tmp_path, train={"max_steps": 15}, checkpoint={"interval": 5, "keep_last": 3})
    good = _write_toml(tmp_path / "good.toml", raw)
    assert _cli(["train", "--config", str(good), "--quiet"], capsys)[0] == 0
    ckpts = tmp_path / "run" / "checkpoints"
    latest = ckpts / "step_00000015.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    rc, err = _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=20"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    aside = ckpts / "step_00000015.pt.unreadable"
    move = f"mv {latest} {aside}"
    assert err.startswith(f"lm train: error: --resume: {str(latest)!r} is not a readable checkpoint (truncated or "
                          "corrupt?)"), err
    assert err.endswith(f"; move it aside ({move}) and run again with --resume alone: it continues from step 10\n"), err
    subprocess.run(shlex.split(err.split("move it aside (")[1].split(")")[0]), check=True)
    assert aside.is_file() and not latest.exists()
    assert main(["train", "--config", str(good), "--resume", "--set", "train.max_steps=20", "--quiet"]) == 0
    assert f"resumed from {ckpts / 'step_00000010.pt'} at step 10" in capsys.readouterr().out
    assert read_checkpoint(ckpts / "step_00000020.pt")["iteration"] == 20
    assert aside.is_file()  # kept, for whoever wants to look at it; never taken for a checkpoint
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert steps == list(range(1, 21))  # the steps after 10 were logged once, by the resumed run
    # with no older checkpoint, the way out starts the run again from step 0
    latest = ckpts / "step_00000020.pt"
    for step in (10, 15):
        (ckpts / f"step_{step:08d}.pt").unlink()
    latest.write_bytes(b"garbage")
    rc, err = _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=20"], capsys)
    assert rc == 2 and err.endswith("--resume alone: with no older checkpoint, the run starts again from step 0\n")
    subprocess.run(shlex.split(err.split("move it aside (")[1].split(")")[0]), check=True)
    assert main(["train", "--config", str(good), "--resume", "--set", "train.max_steps=20", "--quiet"]) == 0
    assert "starting again from step 0" in capsys.readouterr().out
    assert read_checkpoint(ckpts / "step_00000020.pt")["iteration"] == 20


def test_an_unreadable_checkpoint_given_by_path_gets_no_move_aside_hint(tmp_path):
    """The move-aside hint is for the run's own latest checkpoint: an unreadable file given to --resume
    from elsewhere, into a new folder, is named alone (mut31: the hint's test read as
    `latest is None and ...` failed there on None.resolve())."""
    elsewhere = tmp_path / "elsewhere" / "step_00000005.pt"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"garbage")
    with pytest.raises(ValueError) as refused:
        Trainer(config_from_dict(_raw_config(tmp_path, train={"max_steps": 2})), resume=elsewhere, print_fn=_quiet)
    assert str(refused.value) == (f"--resume: {str(elsewhere)!r} is not an lm checkpoint: not a file torch.save "
                                  "writes (a zip archive)")
    assert not (tmp_path / "run").exists()


def test_a_restart_from_step_0_sets_the_earlier_weights_aside(tmp_path):
    """A run kept as model.safetensors with its checkpoints/ deleted, then `--resume`d to train longer,
    starts again from step 0. Its old model.safetensors stayed: `--checkpoint RUN` served the other
    history's weights until this one passed its step, and this run's end wrote over them (audit
    "ckpt" #2). It is set aside as metrics.jsonl is, under the next free name."""
    import shutil
    import signal

    from lm.checkpoint.export import exported_step
    from lm.generate.load import resolve_checkpoint

    raw = _raw_config(tmp_path, train={"max_steps": 10}, checkpoint={"interval": 2}, eval={"interval": 0})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    run = tmp_path / "run"
    shutil.rmtree(run / "checkpoints")
    (run / "model.safetensors.1").write_bytes(b"an earlier one")  # taken: the next free name is .2
    old = (run / "model.safetensors").read_bytes()
    lines, trainer = [], None

    def stop(step, path):
        trainer._signal = signal.SIGTERM

    raw["train"]["max_steps"] = 6
    trainer = Trainer(config_from_dict(raw), resume=True, print_fn=lines.append, on_checkpoint=stop)
    assert trainer.run() == 128 + signal.SIGTERM
    assert lines[0] == (f"no checkpoint in {str(run)!r}: starting again from step 0 (the earlier metrics are in "
                        "metrics.jsonl.1, the earlier weights are in model.safetensors.2)")
    assert (run / "model.safetensors.2").read_bytes() == old and not (run / "model.safetensors").exists()
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_00000002.pt"  # this history's newest
    assert Trainer(config_from_dict(raw), resume=True, print_fn=_quiet).run() == 0
    assert exported_step(run / "model.safetensors") == 6 and (run / "model.safetensors.2").read_bytes() == old


def _files(folder) -> dict[str, tuple]:
    """Each file's content hash, and for checkpoints and exported weights also inode and mtime: one
    written again (atomically: a new inode), even with the same bytes, shows. (config.toml and
    metrics.jsonl are rewritten with the same bytes by every resume.)"""
    import hashlib

    def key(p):
        stat = (p.stat().st_ino, p.stat().st_mtime_ns) if p.suffix in (".pt", ".safetensors") else ()
        return (hashlib.sha256(p.read_bytes()).hexdigest(), *stat)

    return {str(p.relative_to(folder)): key(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resume_of_a_stopped_run_at_its_step_records_the_last_evaluation_once(tmp_path):
    """A run stopped by SIGTERM at step 7 and resumed with train.max_steps=7 trains nothing, but
    records the config change and the final evaluation. No checkpoint of step 7 said so (it was not
    written again), so every later --resume evaluated again, appended the same "config" and "val"
    records to metrics.jsonl and rewrote best.pt (audit readme1 #1, case A). Now the resume writes
    the checkpoint of step 7 again, ends with "done:", and the next one changes no file; training on
    from it later ends bitwise where the uninterrupted run does."""
    import signal

    from safetensors.torch import load_file

    raw = _raw_config(tmp_path, train={"max_steps": 12}, model={"dropout": 0.1}, eval={"interval": 5},
                      checkpoint={"interval": 5, "keep_last": 2}, log={"interval": 2})
    ref = {**raw, "train": {**raw["train"], "out_dir": str(tmp_path / "ref")}}
    assert Trainer(config_from_dict(ref), print_fn=_quiet).run() == 0
    trainer = None

    def stop_at_step_7():
        if trainer.step == 7:
            trainer._signal = signal.SIGTERM
        return 0.0

    trainer = Trainer(config_from_dict(raw), print_fn=_quiet)
    trainer.clock = stop_at_step_7
    assert trainer.run() == 128 + signal.SIGTERM
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000007.pt"
    assert read_checkpoint(ckpt)["last_eval_step"] == 5

    at_7 = {**raw, "train": {**raw["train"], "max_steps": 7}}
    lines = []
    assert Trainer(config_from_dict(at_7), resume=True, print_fn=lines.append).run() == 0
    records = [(r["step"], r["split"]) for r in read_metrics(run)]
    assert records[-2:] == [(7, "config"), (7, "val")], records
    state = read_checkpoint(ckpt)
    assert state["last_eval_step"] == 7 and state["config"]["train"]["max_steps"] == 7
    assert state["best_val_loss"] == min(r["loss"] for r in read_metrics(run) if r["split"] == "val")
    # the last line names the checkpoint, the exported weights and the best one (audit train8)
    done = (f"done: step 7, checkpoint {ckpt}; weights {run / 'model.safetensors'}; best val loss "
            f"{state['best_val_loss']:.4f} in {run / 'checkpoints' / 'best.pt'}")
    assert "resumed with train.max_steps 12 -> 7" in lines and lines[-1] == done, lines
    assert (run / "model.safetensors").is_file()

    before = _files(run)
    for _ in range(2):
        lines = []
        assert Trainer(config_from_dict(at_7), resume=True, print_fn=lines.append).run() == 0
        assert _files(run) == before  # metrics.jsonl, best.pt, the checkpoint, the export: all as they were
        assert not [line for line in lines if line.startswith(("resumed with", "eval step"))], lines
        assert lines[-2:] == ["nothing left to train: step 7 has reached train.max_steps 7", done], lines

    # the checkpoint written again holds the state it was resumed from: training on is still exact
    assert Trainer(config_from_dict(raw), resume=True, print_fn=_quiet).run() == 0
    weights, expected = load_file(run / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "step_00000010.pt",
                                                                       "step_00000012.pt"]


def test_a_resume_of_a_finished_run_with_another_setting_records_it_once(tmp_path, capsys):
    """A finished run copied to another folder (train.out_dir changes), or resumed with other log or
    checkpoint settings, appended the same "config" record at every --resume: the checkpoint kept
    the old values (audit readme1 #1, case B). Now the first resume writes the checkpoint again with
    the settings it records, and a second one changes nothing; keep_last applies as at a run's end."""
    raw = _raw_config(tmp_path, train={"max_steps": 6}, eval={"interval": 3}, checkpoint={"interval": 2})
    good = _write_toml(tmp_path / "good.toml", raw)
    assert _cli(["train", "--config", str(good), "--quiet"], capsys)[0] == 0
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    original = _files(tmp_path / "run")
    copy, ckpts = tmp_path / "copy", tmp_path / "copy" / "checkpoints"
    args = ["train", "--config", str(good), "--resume", "--set", f"train.out_dir={copy}", "--set", "log.interval=2",
            "--set", "checkpoint.keep_last=1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"done: step 6, checkpoint {ckpts / 'step_00000006.pt'}" in out, out
    configs = [r for r in read_metrics(copy) if r["split"] == "config"]
    assert len(configs) == 1 and set(configs[0]["changed"]) == {"train.out_dir", "log.interval", "checkpoint.keep_last"}
    state = read_checkpoint(ckpts / "step_00000006.pt")
    assert state["config"]["train"]["out_dir"] == str(copy) and state["config"]["log"]["interval"] == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "step_00000006.pt"]  # keep_last=1 now
    before = _files(copy)
    for _ in range(2):
        assert main([*args, "--quiet"]) == 0
        assert _files(copy) == before
        assert "resumed with" not in capsys.readouterr().out
    assert _files(tmp_path / "run") == original

    # a resume with a change, stopped by a signal before its first step: the same
    import signal

    cfg = load_config(copy / "config.toml")
    cfg.log.interval, cfg.train.max_steps = 3, 8
    trainer = Trainer(cfg, resume=True, print_fn=_quiet)
    trainer._signal = signal.SIGTERM
    assert trainer.run() == 128 + signal.SIGTERM
    assert read_checkpoint(ckpts / "step_00000006.pt")["config"]["log"]["interval"] == 3
    assert Trainer(load_config(copy / "config.toml"), resume=True, print_fn=_quiet).run() == 0  # no change now
    configs = [(r["step"], sorted(r["changed"])) for r in read_metrics(copy) if r["split"] == "config"]
    assert configs[1:] == [(6, ["log.interval", "train.max_steps"])], configs
    assert read_checkpoint(ckpts / "step_00000008.pt")["iteration"] == 8


def test_a_folder_with_a_run_s_names_but_not_its_content_is_refused(tmp_path, capsys):
    """A folder was taken for a run because one name in it was a run's: another tool's config.toml,
    another trainer's metrics.jsonl or checkpoints/. The refusal said "pass --resume", and --resume
    then wrote config.toml, tokenizer/ and the run over the user's files (audit train3 #1). Each of
    these names is now checked for what lm train writes there, and the folder refused, naming it."""
    from lm.train.config import SECTIONS

    raw = _raw_config(tmp_path, train={"max_steps": 2})
    good = _write_toml(tmp_path / "good.toml", raw)
    hand_written = dict(raw)
    hand_written.pop("log")  # a config for lm, written by hand: not the resolved config of a run
    gone = [name for name in SECTIONS if name in raw and name != "model"][:2]  # with [wandb]: three missing
    three_missing = {name: values for name, values in raw.items() if name not in gone}
    with pytest.raises(ValueError) as parsed:  # the TOML parser's own words (tomllib's, or tomli's on 3.10)
        toml_loads("name = [\n")
    toml_error = str(parsed.value).splitlines()[0]
    cases = {
        "tool": ({"config.toml": "[tool.black]\nline-length = 100\n"},
                 "config.toml is not an lm run config (it has a table 'tool')"),
        "hand": ({"config.toml": dump_tables(hand_written)},
                 "config.toml is not an lm run config (no [log] or [wandb] table)"),
        "toml": ({"config.toml": "name = [\n"}, f"config.toml is not an lm run config (not valid TOML: {toml_error})"),
        "key": ({"config.toml": "seed = 1\n"}, "config.toml is not an lm run config (it has a key 'seed')"),
        "three": ({"config.toml": dump_tables(three_missing)},
                  f"config.toml is not an lm run config (no [{gone[0]}] or [{gone[1]}] ... table)"),
        "keras": ({"metrics.jsonl": '{"epoch": 1, "acc": 0.5}\n'},
                  'metrics.jsonl is not the metrics of lm train (its first record has no "step" and "split")'),
        "split": ({"metrics.jsonl": '{"step": 1, "split": 3}\n'},
                  'metrics.jsonl is not the metrics of lm train (its first record has no "step" and "split")'),
        "bool": ({"metrics.jsonl": '{"step": true, "split": "train"}\n'},
                 'metrics.jsonl is not the metrics of lm train (its first record has no "step" and "split")'),
        "csv": ({"metrics.jsonl": "epoch,acc\n1,0.5\n"},
                "metrics.jsonl is not the metrics of lm train (its first line is not a JSON object)"),
        # one line without its newline: a cut-short first record only when it starts as lm train's do
        "cut": ({"metrics.jsonl": "epoch,acc"},
                "metrics.jsonl is not the metrics of lm train (its first line is not a JSON object)"),
        "ckpt": ({"checkpoints/epoch3.ckpt": "x", "metrics.jsonl": ""},
                 "checkpoints/ holds 'epoch3.ckpt', which is not a checkpoint of lm train"),
        "mixed": ({"checkpoints/best.pt": "x", "checkpoints/last.pt": "x"},
                  "checkpoints/ holds 'last.pt', which is not a checkpoint of lm train"),
        "file": ({"checkpoints": "x"}, "checkpoints is not a folder"),
    }
    for name, (files, why) in cases.items():
        folder = tmp_path / name
        for rel, text in {**files, "notes.txt": "mine", "tokenizer/vocab.json": '{"mine": 1}'}.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)
        before = _snapshot(folder)
        for resume in ([], ["--resume"]):
            rc, err = _cli(["train", "--config", str(good), "--set", f"train.out_dir={folder}", *resume], capsys)
            assert rc == 2 and err.count("\n") == 1, (name, err)
            assert err == (f"lm train: error: train.out_dir: {str(folder)!r} is not empty and holds no run of "
                           f"`lm train`: {why}; choose a new or empty folder\n"), (name, err)
        assert _snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == sorted(
            {rel.split("/")[0] for rel in files} | {"notes.txt", "tokenizer"})


def test_runs_killed_or_restarted_at_any_point_are_still_recognised(tmp_path):
    """What a run leaves when it is killed at any point, restarted or resumed (a config.toml alone, an
    empty metrics.jsonl, a first record cut short, wandb/, NAME.N set aside, the temporary files of
    checkpoint writes, a checkpoint moved aside as unreadable) is still taken for a run."""
    from lm.train.run_dir import check_run_folder, holds_run

    raw = _raw_config(tmp_path, train={"max_steps": 4}, eval={"interval": 2},
                      checkpoint={"interval": 2, "keep_last": 0})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    run = tmp_path / "run"
    metrics = (run / "metrics.jsonl").read_text()
    states = {
        "config_only": {".lock": "999999\n"},
        "empty_metrics": {"metrics.jsonl": "", "wandb_id.txt": "ab12cd34\n", "wandb/debug.log": "x"},
        "cut_short": {"metrics.jsonl": metrics.splitlines()[0][:20]},
        "restarted": {"metrics.jsonl": metrics, "metrics.jsonl.1": metrics, "model.safetensors.1": "x",
                      "loss.png": "x", "checkpoints/best.pt.1": "x", "checkpoints/step_00000002.pt.unreadable": "x",
                      "checkpoints/.step_00000004.pt.ab12_x9.tmp": "x", "checkpoints/.best.pt.zz3.tmp": "x"},
        "empty_checkpoints": {"metrics.jsonl": metrics, "checkpoints/.keep": None},
    }
    for name, files in states.items():
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(run / "config.toml", folder / "config.toml")
        for rel, text in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            if text is not None:
                (folder / rel).write_text(text)
        check_run_folder(folder)
        assert holds_run(folder), name
        cfg = config_from_dict({**raw, "train": {**raw["train"], "out_dir": str(folder), "max_steps": 2}})
        lines = []
        assert Trainer(cfg, resume=True, print_fn=lines.append).run() == 0, name
        assert any(line.startswith(f"no checkpoint in {str(folder)!r}: starting again from step 0") for line in lines)
    resumed = tmp_path / "resumed"  # a run with checkpoints, resumed (from its step 2): metrics.jsonl.N beside
    shutil.copytree(run, resumed)
    (resumed / "checkpoints" / "step_00000004.pt").unlink()
    (resumed / "metrics.jsonl.1").write_text(metrics)
    cfg = config_from_dict({**raw, "train": {**raw["train"], "out_dir": str(resumed)}})
    lines = []
    assert Trainer(cfg, resume=True, print_fn=lines.append).run() == 0
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000002.pt'} at step 2" in lines


def _only_best_refusal(run, best, of_step: str) -> str:
    """The refusal of a fresh start in ``run``, whose run stopped with only ``best`` (``of_step``: how
    its step is said, or "")."""
    return (f"train.out_dir: {str(run)!r} holds a run that stopped before its first checkpoint (it has only "
            f"checkpoints/best.pt{of_step}); pass --resume to start it again from step 0 (its metrics.jsonl, "
            "model.safetensors and checkpoints/best.pt are kept aside as NAME.1, or the next free number), or "
            f"--resume {best} to continue it from there, or choose another train.out_dir")


def test_a_restart_from_step_0_sets_the_earlier_best_checkpoint_aside(tmp_path):
    """A run killed before its first step checkpoint but after an evaluation has a best.pt: the
    restart from step 0 wrote over it at its first evaluation, though the message promised the
    earlier history was kept, and said nothing of best.pt, from which that history can go on (audit
    train3 #2a). It is set aside as best.pt.N, said so, and the refusal names `--resume .../best.pt`."""
    from lm.checkpoint import CheckpointManager
    from lm.generate.load import resolve_checkpoint

    raw = _raw_config(tmp_path, train={"max_steps": 6}, eval={"interval": 2}, checkpoint={"interval": 4})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    for p in [*ckpts.glob("step_*.pt"), run / "model.safetensors"]:  # as if killed before step 4's checkpoint
        p.unlink()
    best = ckpts / "best.pt"
    old, step = best.read_bytes(), read_checkpoint(best)["iteration"]
    assert 0 < step <= 6
    shutil.copytree(run, tmp_path / "copy")

    again = {**raw, "train": {**raw["train"], "max_steps": 2}}
    with pytest.raises(ValueError) as e:
        Trainer(config_from_dict(again), print_fn=_quiet)
    assert str(e.value) == _only_best_refusal(run, best, f", of step {step}")

    # what the refusal offers: --resume RUN/checkpoints/best.pt continues that history in its folder
    copy = tmp_path / "copy"
    cfg = config_from_dict({**raw, "train": {**raw["train"], "out_dir": str(copy)}})
    lines = []
    assert Trainer(cfg, resume=copy / "checkpoints" / "best.pt", print_fn=lines.append).run() == 0
    assert f"resumed from {copy / 'checkpoints' / 'best.pt'} at step {step}" in lines

    lines = []
    assert Trainer(config_from_dict(again), resume=True, print_fn=lines.append).run() == 0
    aside = ckpts / "best.pt.1"
    assert lines[0] == (f"no checkpoint in {str(run)!r}: starting again from step 0 (the earlier metrics are in "
                        f"metrics.jsonl.1, the earlier best checkpoint (step {step}) is in checkpoints/best.pt.1: "
                        f"--resume {aside} with another train.out_dir continues that history)"), lines
    assert aside.read_bytes() == old and read_checkpoint(best)["iteration"] == 2  # this history's own
    # best.pt.1 is no checkpoint of this history: not the run's latest, nor what --checkpoint RUN serves
    assert CheckpointManager(run).latest() == ckpts / "step_00000002.pt"
    assert resolve_checkpoint(run) == run / "model.safetensors"
    assert resolve_checkpoint(ckpts) == ckpts / "step_00000002.pt"
    with pytest.raises(ValueError, match=r"^--resume: .*best.pt.1' is a best checkpoint that the run in .* set aside "
                                         r"\(of a history .* set train.out_dir to a new folder$"):
        Trainer(config_from_dict({**raw, "train": {**raw["train"], "max_steps": 8}}), resume=aside, print_fn=_quiet)
    elsewhere = config_from_dict({**raw, "train": {**raw["train"], "out_dir": str(tmp_path / "old")}})
    lines = []
    assert Trainer(elsewhere, resume=aside, print_fn=lines.append).run() == 0
    assert f"resumed from {aside} at step {step}" in lines


def test_a_resume_from_a_step_before_best_pt_sets_it_aside(tmp_path):
    """A run killed after best.pt of step 8 was written but before the checkpoint of step 8 resumes
    from step 4: best.pt stayed, a model of steps this history never reached (and `--resume best.pt`
    then took it, mixing two histories), whenever the resumed run did not beat it (audit train3
    #2b). It is set aside as best.pt.N, and said so."""
    raw = _raw_config(tmp_path, train={"max_steps": 8}, eval={"interval": 2},
                      checkpoint={"interval": 4, "keep_last": 0})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    for p in (ckpts / "step_00000008.pt", run / "model.safetensors"):  # killed before step 8's checkpoint
        p.unlink()
    best = ckpts / "best.pt"
    old, step = best.read_bytes(), read_checkpoint(best)["iteration"]
    assert step > 4, step  # the loss went down after step 4: the premise of this test

    resume = {**raw, "train": {**raw["train"], "max_steps": 6}, "eval": {**raw["eval"], "interval": 0}}
    lines = []
    assert Trainer(config_from_dict(resume), resume=True, print_fn=lines.append).run() == 0
    assert (f"checkpoints/best.pt (step {step}) is past step 4, where the run goes on: it belongs to the steps it "
            "trains again, and is kept aside as checkpoints/best.pt.1") in lines, lines
    assert (ckpts / "best.pt.1").read_bytes() == old and not best.exists()  # no evaluation since: no best yet
    assert max(r["step"] for r in read_metrics(run)) == 6
    with pytest.raises(ValueError, match=r"is a best checkpoint that the run in .* set aside"):
        Trainer(config_from_dict({**raw, "train": {**raw["train"], "max_steps": 10}}), resume=ckpts / "best.pt.1",
                print_fn=_quiet)

    # a best.pt of the history resumed (at or before its step) stays where it is
    lines = []
    assert Trainer(config_from_dict({**raw, "train": {**raw["train"], "max_steps": 10}}), resume=True,
                   print_fn=lines.append).run() == 0
    kept = read_checkpoint(best)["iteration"]
    assert 6 < kept <= 10 and not any("kept aside" in line for line in lines)
    assert Trainer(config_from_dict({**raw, "train": {**raw["train"], "max_steps": 12}}), resume=True,
                   print_fn=lines.append).run() == 0
    assert read_checkpoint(best)["iteration"] >= kept and not (ckpts / "best.pt.2").exists()


def test_resume_keeps_the_lines_that_are_not_records_with_a_step(tmp_path):
    """--resume drops the records past the checkpoint's step; a line that is JSON but not a record
    with a number as its step (a hand edit, disk damage) was an AttributeError or TypeError
    traceback. Such lines are kept (lm plot and read_metrics pass over them); the records past the
    step, and a line cut short by a kill, are dropped."""
    from lm.train.metrics import MetricsLog

    run = tmp_path / "hand"
    run.mkdir()
    kept = ['{"step": 5, "split": "train", "loss": 1.0}', "[1, 2]", '{"step": "7", "split": "note"}',
            '{"split": "note"}', '"text"', "null", '{"step": true}', '{"step": 10.0, "split": "val", "loss": 0.9}',
            '{"step": 10, "split": "train", "loss": 0.8}']  # fmt: skip
    past = ['{"step": 11, "split": "train", "loss": 0.7}', '{"step": 10.5}']
    (run / "metrics.jsonl").write_text("\n".join(kept[:3] + past + kept[3:]) + '\n{"step": 12, "spl')
    MetricsLog.truncate(run, 10)
    assert (run / "metrics.jsonl").read_text() == "".join(line + "\n" for line in kept)

    raw = _raw_config(tmp_path, train={"max_steps": 10})  # and through lm train --resume
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('[1, 2]\n{"step": "7", "split": "note"}\n')
    raw["train"]["max_steps"] = 12
    assert Trainer(config_from_dict(raw), resume=True, print_fn=_quiet).run() == 0
    lines = metrics.read_text().splitlines()
    assert lines.index("[1, 2]") + 1 == lines.index('{"step": "7", "split": "note"}')
    assert [r["step"] for r in read_metrics(tmp_path / "run") if isinstance(r, dict) and r.get("split") == "train"] \
        == list(range(1, 13))


@pytest.mark.parametrize("resume, why", [
    ("", "resume: must not be empty; pass resume=True to continue the run in train.out_dir, or a checkpoint's path"),
    (None, "resume: must be True, False or a checkpoint's path, got None"),
    (1, "resume: must be True, False or a checkpoint's path, got 1"),
])
def test_the_library_refuses_a_resume_that_means_neither(tmp_path, resume, why):
    """`Trainer(cfg, resume=os.environ.get("CKPT", ""))` took the empty path for False: a run to
    continue was refused with "already holds a run; pass --resume to continue it" (which the caller
    had meant to do), and a folder with no run started fresh. The CLI refused `--resume ''`
    already. The run folder is left as it was."""
    raw = _raw_config(tmp_path, train={"max_steps": 2})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    before = _snapshot(tmp_path / "run")
    raw["train"]["max_steps"] = 4
    with pytest.raises(ValueError) as e:
        Trainer(config_from_dict(raw), resume=resume, print_fn=_quiet)
    assert str(e.value) == why
    assert _snapshot(tmp_path / "run") == before


def test_a_run_with_a_stray_file_is_named_as_a_run_with_the_file_to_move(tmp_path, capsys):
    """ckpt8: a .DS_Store (Finder writes one into any folder it opens) or a backup copy in
    checkpoints/, or a typo in config.toml, made a run "hold no run of `lm train`", with the
    advice to choose a new or empty folder: abandoning the run. Now the run is named as one, and
    the entry to move out; once moved, --resume continues."""
    raw = _raw_config(tmp_path, train={"max_steps": 2})
    good = _write_toml(tmp_path / "good.toml", raw)
    assert _cli(["train", "--config", str(good)], capsys)[0] == 0
    run = tmp_path / "run"
    for stray in (run / "checkpoints" / ".DS_Store", run / "checkpoints" / "step_00000002.pt.bak"):
        stray.write_bytes(b"x")
        before = _snapshot(run)
        rc, err = _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=4"], capsys)
        assert rc == 2 and err == (f"lm train: error: train.out_dir: {str(run)!r} holds a run of `lm train` (its "
                                   "config.toml and metrics.jsonl are lm train's), but checkpoints/ "
                                   f"holds {stray.name!r}, which is not a checkpoint of lm train; move that out of the "
                                   "folder (or mend it) and run again\n"), err
        assert _snapshot(run) == before
        stray.unlink()
    config = (run / "config.toml").read_text()
    (run / "config.toml").write_text(config.replace("[model]", "[model", 1))
    rc, err = _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=4"], capsys)
    assert rc == 2 and err.startswith(f"lm train: error: train.out_dir: {str(run)!r} holds a run of `lm train` (its "
                                      "metrics.jsonl and checkpoints are lm train's), but config.toml is not an lm "
                                      "run config (not valid TOML: "), err
    (run / "config.toml").write_text(config)
    assert _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=4"], capsys)[0] == 0


def test_a_run_folder_with_one_marker_of_a_run_and_one_of_another_tool_is_named_with_the_way_out(tmp_path):
    """One marker that is lm train's (a config.toml) beside one that is not (another tool's
    metrics.jsonl): still a run, named by the one ("its config.toml is lm train's"), the other to move
    out. And an out_dir that is a file is refused as such, in this process as from the command line."""
    from lm.train.run_dir import check_run_folder, holds_run, run_problem

    raw = _raw_config(tmp_path, train={"max_steps": 2})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_tables(config_from_dict(raw).to_dict()))
    assert run_problem(run) is None and holds_run(run)
    (run / "metrics.jsonl").write_text('["not", "a", "record"]\n')
    assert run_problem(run) == "metrics.jsonl is not the metrics of lm train (its first line is not a JSON object)"
    assert not holds_run(run)
    with pytest.raises(ValueError) as refused:
        check_run_folder(run)
    assert str(refused.value) == (f"train.out_dir: {str(run)!r} holds a run of `lm train` (its config.toml is lm "
                                  "train's), but metrics.jsonl is not the metrics of lm train (its first line is not a "
                                  "JSON object); move that out of the folder (or mend it) and run again")
    shutil.rmtree(run)
    run.write_text("a file")
    with pytest.raises(ValueError) as refused:
        Trainer(config_from_dict(raw), print_fn=_quiet)
    assert str(refused.value) == f"train.out_dir: {str(run)!r} exists and is not a folder"
    assert run.read_text() == "a file"


@pytest.mark.parametrize("records", [b"", b"\n", b"\n\n  \n"])
def test_a_metrics_file_without_records_shows_no_run_beside_a_broken_config(tmp_path, records):
    """An empty metrics.jsonl (a run killed before its first record), or one of blank lines, which
    run_problem takes for empty too, is no sign of a run: beside a config.toml that is not lm's, the
    folder holds no run ("choose a new or empty folder"), not "a run of lm train (its metrics.jsonl
    is lm train's)" (a blank line had counted as a record: the size was compared with 0)."""
    from lm.train.run_dir import check_run_folder

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[model\n")
    (run / "metrics.jsonl").write_bytes(records)
    with pytest.raises(ValueError) as refused:
        check_run_folder(run)
    assert str(refused.value).startswith(f"train.out_dir: {str(run)!r} is not empty and holds no run of `lm train`: "
                                         "config.toml is not an lm run config (not valid TOML: "), str(refused.value)
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "split": "train", "loss": 5.0}\n' + records)
    with pytest.raises(ValueError) as refused:
        check_run_folder(run)
    assert str(refused.value).startswith(f"train.out_dir: {str(run)!r} holds a run of `lm train` (its metrics.jsonl "
                                         "is lm train's), but config.toml is not an lm run config"), str(refused.value)


def test_a_folder_of_other_files_names_the_first_and_says_whether_there_are_more(tmp_path):
    """"('a' and more)" for two entries or more, "('a')" for one: the count had been checked at three."""
    from lm.train.run_dir import check_run_folder

    folder = tmp_path / "f"
    folder.mkdir()
    for names, shown in ((["b.txt"], "'b.txt'"), (["b.txt", "a.txt"], "'a.txt' and more")):
        for name in names:
            (folder / name).write_text("x")
        with pytest.raises(ValueError) as refused:
            check_run_folder(folder)
        assert str(refused.value) == (f"train.out_dir: {str(folder)!r} is not empty ({shown}) and holds no run of "
                                      "`lm train` (no config.toml, metrics.jsonl or checkpoints/); choose a new or "
                                      "empty folder")


@pytest.mark.parametrize("kind", ["folder", "broken link"])
def test_a_latest_checkpoint_that_is_a_folder_or_a_broken_link_is_named_with_the_way_out(tmp_path, capsys, kind):
    """ckpt8: a step_N.pt that is a folder or a link to nothing was "checkpoint not found" (it is
    there), without the `mv ... .unreadable` way out an unreadable checkpoint gets; following it,
    the run continues from the checkpoint before."""
    raw = _raw_config(tmp_path, train={"max_steps": 4}, checkpoint={"interval": 2, "keep_last": 0})
    good = _write_toml(tmp_path / "good.toml", raw)
    assert _cli(["train", "--config", str(good)], capsys)[0] == 0
    latest = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    latest.unlink()
    if kind == "folder":
        latest.mkdir()
        what = "is a folder, not a checkpoint file"
    else:
        latest.symlink_to(tmp_path / "gone.pt")
        what = f"is a symbolic link to {str(tmp_path / 'gone.pt')!r}, which does not exist"
    rc, err = _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=6"], capsys)
    aside = latest.with_name("step_00000004.pt.unreadable")
    assert rc == 2 and err == (f"lm train: error: --resume: {str(latest)!r} {what}; move it aside (mv "
                               f"{shlex.quote(str(latest))} {shlex.quote(str(aside))}) and run again with --resume "
                               "alone: it continues from step 2\n"), err
    latest.rename(aside)
    assert _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=6"], capsys)[0] == 0
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000006.pt")["iteration"] == 6


def test_an_old_checkpoint_that_cannot_be_deleted_is_a_warning_not_the_end_of_the_run(tmp_path, capsys):
    """ckpt8: pruning (checkpoint.keep_last) that failed to delete an old checkpoint (an immutable
    file; here a folder of that name) stopped the run with a bare "[Errno 21] Is a directory" line,
    before max_steps and with no final export. It is a warning now; the run goes on to its end."""
    raw = _raw_config(tmp_path, train={"max_steps": 2}, checkpoint={"interval": 2, "keep_last": 1})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    (tmp_path / "run" / "checkpoints" / "step_00000001.pt").mkdir()  # an old "checkpoint" that cannot go
    (tmp_path / "run" / "checkpoints" / "step_00000001.pt" / "x").write_text("kept")
    raw["train"]["max_steps"] = 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
        assert trainer.run() == 0
    assert [str(w.message) for w in caught if w.category is UserWarning] == [  # at each prune: steps 4 and 6
        f"could not delete the old checkpoint {str(tmp_path / 'run' / 'checkpoints' / 'step_00000001.pt')!r} "
        "(checkpoint.keep_last = 1): Is a directory; the new one, "
        f"{str(tmp_path / 'run' / 'checkpoints' / f'step_0000000{step}.pt')!r}, is written, and the run goes on"
        for step in (4, 6)
    ], [str(w.message) for w in caught]
    assert trainer.step == 6 and (tmp_path / "run" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["best.pt", "step_00000001.pt",
                                                                                   "step_00000006.pt"]


def test_the_temporary_files_of_a_killed_runs_writes_are_cleared_when_it_reopens(tmp_path, capsys):
    """ckpt8: a kill while a new run wrote its config.toml left `.lock` and `.config.toml.X.tmp`, a
    folder that `lm train` and `lm train --resume` both refused ("not empty ... holds no run"): the
    user had to delete a file lm made. A kill while a resume rewrote metrics.jsonl left
    `.metrics.jsonl.X.tmp` for good. Now a folder holding only those is a new run's, and every
    such file of the run's (and of its tokenizer/) is removed when the run reopens its folder."""
    raw = _raw_config(tmp_path, train={"max_steps": 2})
    good = _write_toml(tmp_path / "good.toml", raw)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("999999\n")  # its process is gone
    (run / ".config.toml.k2x9_abc.tmp").write_text("[model]\nvocab")
    rc, err = _cli(["train", "--config", str(good), "--resume"], capsys)
    assert rc == 2 and "holds no run to resume" in err, err
    assert _cli(["train", "--config", str(good)], capsys)[0] == 0
    assert not (run / ".config.toml.k2x9_abc.tmp").exists()
    left = [run / ".metrics.jsonl.edyeoavg.tmp", run / "tokenizer" / ".vocab.json.q1w2e3r4.tmp"]
    for path in left:
        path.parent.mkdir(exist_ok=True)
        path.write_text("half")
    assert _cli(["train", "--config", str(good), "--resume", "--set", "train.max_steps=4"], capsys)[0] == 0
    assert not any(path.exists() for path in left)


def test_a_data_file_rewritten_in_place_is_refused(tmp_path, capsys, monkeypatch):
    """The path was compared, and the fingerprint the checkpoint records only for a path that differed:
    a train.bin rewritten in place (another text tokenized to it), or `train.bin` naming another file
    from another working folder, resumed on other data with no word (ddp21). Both are refused in one
    line naming the key and what differs; the run is untouched; the file it trained on resumes."""
    monkeypatch.chdir(tmp_path)
    raw = _raw_config(tmp_path, train={"max_steps": 4, "out_dir": str(tmp_path / "run")})
    raw["data"] = {"train": "train.bin", "val": "val.bin"}
    good = _write_toml(tmp_path / "good.toml", raw)
    assert _cli(["train", "--config", str(good), "--quiet"], capsys)[0] == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    keep = tmp_path / "kept"
    keep.mkdir()
    for name in ("train.bin", "train.bin.json", "val.bin", "val.bin.json"):
        shutil.copy(tmp_path / name, keep / name)
    n = len(np.fromfile(tmp_path / "train.bin", dtype=np.uint16))
    before = _snapshot(tmp_path / "run")
    resume = ["train", "--config", str(good), "--resume", "--quiet", "--set", "train.max_steps=6"]
    for ids, what in ((np.random.default_rng(1).integers(0, VOCAB, n), "the same size, other bytes"),
                      (np.arange(n // 2) % VOCAB, f"num_tokens {n} then, {n // 2} now")):
        for name in ("train.bin", "train.bin.json"):
            (tmp_path / name).unlink()
        write_token_file(tmp_path / "train.bin", ids, vocab_size=VOCAB, source_bytes=3 * n, tokenizer_sha256="abc")
        rc, err = _cli(resume, capsys)
        assert (rc, err) == (2, f"lm train: error: --resume: data.train 'train.bin' is not the file {str(ckpt)!r} "
                                f"trained on ({what}); a resumed run keeps its data: give the file it trained on\n")
    assert _snapshot(tmp_path / "run") == before
    # from another folder whose train.bin is other data: refused too; the kept files resume
    other = tmp_path / "elsewhere"
    other.mkdir()
    for name in ("train.bin", "train.bin.json", "val.bin", "val.bin.json"):
        shutil.copy(tmp_path / name, other / name)
    monkeypatch.chdir(other)
    assert _cli(resume, capsys)[0] == 2
    monkeypatch.chdir(keep)
    assert _cli(resume, capsys) == (0, "")


# A1: the fingerprint of a data file sees a change in its middle or at its end (same size)
@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_data_file_rewritten_with_the_same_size_and_start_has_another_fingerprint(tmp_path, where):
    from lm.train.data_identity import SAMPLE_BYTES, data_fingerprint

    data = bytearray(np.arange(4 * SAMPLE_BYTES, dtype=np.uint8).tobytes())
    p = tmp_path / "train.bin"
    p.write_bytes(bytes(data))
    before = data_fingerprint(p, {})
    i = len(data) // 2 if where == "middle" else len(data) - 10
    data[i] ^= 0xFF
    p.write_bytes(bytes(data))
    assert data_fingerprint(p, {}) != before


def test_train_resume_given_empty_is_refused_naming_resume(tmp_path, capsys):
    """A mutation (the `--resume ''` check dropped): '' was taken for "not given" and the run started
    over. Only test_cli_faults (a subprocess in tmp_path) checked it."""
    config = tmp_path / "c.toml"
    config.write_text("")  # never read: the refusal comes first
    assert main(["train", "--config", str(config), "--resume", "", "--quiet"]) == 2
    assert capsys.readouterr().err == ("lm train: error: --resume: must not be empty; pass --resume alone to continue "
                                       "the run in train.out_dir, or --resume PATH\n")


def test_a_restart_with_nothing_to_keep_aside_says_so_in_one_bare_line(tmp_path):
    """A run killed after its config.toml and before its metrics.jsonl (both are written as it starts)
    restarts from step 0 with nothing of an earlier history to keep aside: the line says no more
    (mut30: a stray text in place of the empty list of what was kept survived)."""
    raw = _raw_config(tmp_path, train={"max_steps": 2})
    first = Trainer(config_from_dict(raw), print_fn=_quiet)
    _let_go(first)  # its lock as a killed process leaves it
    (tmp_path / "run" / "metrics.jsonl").unlink()
    lines = []  # quiet: the line is said all the same (mut30: it was not, and that survived)
    assert Trainer(config_from_dict(raw), resume=True, print_fn=lines.append, quiet=True).run() == 0
    assert lines[0] == f"no checkpoint in {str(tmp_path / 'run')!r}: starting again from step 0"
    assert not list((tmp_path / "run").glob("*.1"))


@pytest.mark.parametrize("wandb", [False, True], ids=["no-wandb", "wandb"])
def test_a_new_folder_whose_first_record_fails_is_left_as_it_was_found(tmp_path, monkeypatch, wandb):
    """A run resumed from another run's checkpoint into a new folder writes a "config" record first
    (its out_dir changed); a full disk there undoes the start: config.toml, the tokenizer,
    metrics.jsonl and (with wandb on) wandb_id.txt go with the folder, and the same command can
    simply be run again (mut30: metrics.jsonl, then wandb_id.txt, left behind, and with them the
    folder, survived; wandb's refusals, the case tested before, come before either exists)."""
    from lm.train.metrics import MetricsLog, MetricsWriteError, _write_error

    raw = _raw_config(tmp_path, train={"max_steps": 4}, checkpoint={"interval": 2})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    source = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    raw["train"]["out_dir"] = str(tmp_path / "run2")
    written = ["metrics.jsonl"]  # what the undo must remove
    if wandb:
        _fake_wandb(monkeypatch, _recording_init([]))
        raw["wandb"] = {"mode": "offline", "project": "lm-test"}
        written.append("wandb_id.txt")
    write = MetricsLog.write

    def full_disk(self, record):
        assert all((self.path.parent / name).is_file() for name in written)
        raise _write_error(self.path, OSError(28, "No space left on device"))

    monkeypatch.setattr(MetricsLog, "write", full_disk)
    with pytest.raises(MetricsWriteError, match="metrics.jsonl.: no space left on device$"):
        Trainer(config_from_dict(raw), resume=source, print_fn=_quiet)
    assert not (tmp_path / "run2").exists()
    monkeypatch.setattr(MetricsLog, "write", write)
    assert Trainer(config_from_dict(raw), resume=source, print_fn=_quiet).run() == 0  # no --resume needed there


def test_a_checkpoint_of_another_tokenizer_is_refused_naming_resume(tmp_path):
    """A checkpoint that records another tokenizer than the one that wrote data.train (its data
    fingerprint the same: an older lm recorded none, or the files were regenerated since) is refused
    naming ``--resume`` and both sides (mut30: the argument's name misspelled survived)."""
    raw = _raw_config(tmp_path, train={"max_steps": 2})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    ours = read_checkpoint(ckpt)["tokenizer_sha256"]
    assert ours  # the token files record the tokenizer that wrote them
    _rewrite(ckpt, tokenizer_sha256="0" * 64)
    raw["train"]["max_steps"] = 3
    with pytest.raises(ValueError) as refused:
        Trainer(config_from_dict(raw), resume=True, print_fn=_quiet)
    assert str(refused.value) == (f"--resume: the tokenizer of data.train {raw['data']['train']!r} is not the "
                                  f"tokenizer of the checkpoint {str(ckpt)!r} (tokenizer checksum {ours[:12]}… "
                                  f"instead of {'0' * 12}…)")


def test_a_fresh_start_in_a_run_stopped_before_its_first_checkpoint_says_how_to_go_on(tmp_path):
    """Without --resume, a folder whose run stopped before its first checkpoint is refused with the
    two ways on (mut30: the message's tail in capitals survived; test_cli_faults, a process, read it)."""
    raw = _raw_config(tmp_path, train={"max_steps": 2})
    first = Trainer(config_from_dict(raw), print_fn=_quiet)
    _let_go(first)  # its lock as a killed process leaves it
    with pytest.raises(ValueError) as refused:
        Trainer(config_from_dict(raw), print_fn=_quiet)
    assert str(refused.value) == (
        f"train.out_dir: {str(tmp_path / 'run')!r} holds a run that stopped before its first checkpoint; pass "
        "--resume to start it again from step 0 (its metrics.jsonl and model.safetensors are kept aside as NAME.1, "
        "or the next free number), or choose another train.out_dir")


def test_a_run_with_only_its_best_checkpoint_is_refused_naming_its_step(tmp_path):
    """A run stopped after an evaluation wrote checkpoints/best.pt but before its first step
    checkpoint: a fresh start there is refused, naming best.pt's step when it can be read, and the
    three ways on (mut30, seed 3: the step's clause always or never said, or stray text, survived)."""
    raw = _raw_config(tmp_path, train={"max_steps": 2}, eval={"interval": 1}, checkpoint={"interval": 0})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    ckpts = tmp_path / "run" / "checkpoints"
    for path in ckpts.glob("step_*.pt"):
        path.unlink()
    best = ckpts / "best.pt"
    step = read_checkpoint(best)["iteration"]
    for of_step in (f", of step {step}", ""):
        with pytest.raises(ValueError) as refused:
            Trainer(config_from_dict(raw), print_fn=_quiet)
        assert str(refused.value) == _only_best_refusal(tmp_path / "run", best, of_step)
        best.write_bytes(b"not a checkpoint")  # unreadable: its step is not said
    # the restart it offers sets the unreadable best.pt aside without a step too (seed 14: stray text survived)
    lines = []
    assert Trainer(config_from_dict(raw), resume=True, print_fn=lines.append).run() == 0
    assert lines[0] == (f"no checkpoint in {str(tmp_path / 'run')!r}: starting again from step 0 (the earlier metrics "
                        "are in metrics.jsonl.1, the earlier weights are in model.safetensors.1, the earlier best "
                        f"checkpoint is in checkpoints/best.pt.1: --resume {ckpts / 'best.pt.1'} with another "
                        "train.out_dir continues that history)"), lines
    assert (ckpts / "best.pt.1").read_bytes() == b"not a checkpoint"


def test_the_lines_of_a_resume_are_said_under_quiet(tmp_path):
    """``--quiet`` leaves out progress, not what a resume did to the run: the settings it changed, a
    best.pt past the step it goes on from, set aside, and where it ended (mut30, seeds 3 and 4: each
    line made quiet survived)."""
    raw = _raw_config(tmp_path, train={"max_steps": 2}, checkpoint={"interval": 2}, eval={"interval": 0})
    assert Trainer(config_from_dict(raw), print_fn=_quiet).run() == 0
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copy(ckpts / "step_00000002.pt", ckpts / "best.pt")
    _rewrite(ckpts / "best.pt", iteration=4)  # as a run killed after its best.pt of step 4, before step_4.pt
    raw["train"]["max_steps"] = 3
    lines = []
    assert Trainer(config_from_dict(raw), resume=True, print_fn=lines.append, quiet=True).run() == 0
    assert "resumed with train.max_steps 2 -> 3" in lines
    assert ("checkpoints/best.pt (step 4) is past step 2, where the run goes on: it belongs to the steps it trains "
            "again, and is kept aside as checkpoints/best.pt.1") in lines
    # and where the run ended (mut30, seed 4: the last line made quiet survived)
    weights = ckpts.parent / "model.safetensors"
    assert lines[-1] == f"done: step 3, checkpoint {ckpts / 'step_00000003.pt'}; weights {weights}"


def test_saved_step_is_an_integer_iteration_or_none(tmp_path):
    """The step said of a best.pt is its ``iteration`` when that is an int, and nothing for any other
    value a foreign or damaged file may hold (mut30, seed 3: a string or float taken survived)."""
    from lm.train.trainer import _saved_step

    for value, want in ((3, 3), ("3", None), (3.0, None), (True, None), (None, None)):
        torch.save({"iteration": value}, tmp_path / "best.pt")
        assert _saved_step(tmp_path / "best.pt") == want, value
    torch.save([3], tmp_path / "best.pt")
    assert _saved_step(tmp_path / "best.pt") is None
    assert _saved_step(tmp_path / "missing.pt") is None

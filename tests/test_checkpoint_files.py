"""Finding a run's files: checkpoints named by hand, the temp file of a killed export, symlink loops
and the model's name in `lm serve` (from the checkpoint audit)."""

from __future__ import annotations

import pytest

from lm.checkpoint import CheckpointManager
from lm.cli.serve import served_model_name
from lm.generate.load import resolve_checkpoint


def test_a_step_checkpoint_named_by_hand_is_found_under_its_own_name(tmp_path):
    """`step_12.pt` matched the step pattern but was then looked for as `step_00000012.pt`: 'checkpoint
    not found' for a file the user never had, and rotation never deleted it."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_12.pt").write_bytes(b"x")
    (run / "checkpoints" / "step_00000003.pt").write_bytes(b"x")
    manager = CheckpointManager(run, keep_last=1)
    assert manager.steps() == [3, 12] and manager.latest() == run / "checkpoints" / "step_12.pt"
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_12.pt"
    assert resolve_checkpoint(run / "checkpoints") == run / "checkpoints" / "step_12.pt"
    (run / "checkpoints" / "step_5.pt").write_bytes(b"x")
    (run / "checkpoints" / "step_00000020.pt").write_bytes(b"x")  # what save() would write; rotation as save does
    for _, old in manager.step_files()[: -manager.keep_last]:
        old.unlink()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000020.pt"]


def test_the_temp_file_of_a_killed_export_is_removed_with_those_of_checkpoints(tmp_path):
    """A killed export left `.model.safetensors.RANDOM.tmp`, as large as the model, in the run folder for good."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    export = run / ".model.safetensors.k2j3h4_x.tmp"
    ckpt = run / "checkpoints" / ".step_00000015.pt.abc_12.tmp"
    mine = [run / "notes.tmp", run / ".model.safetensors", run / "model.safetensors"]
    for p in (export, ckpt, *mine):
        p.write_bytes(b"x")
    assert CheckpointManager(run).remove_partial_writes() == sorted([export, ckpt])
    assert not export.exists() and not ckpt.exists() and all(p.exists() for p in mine)


def test_a_symlink_loop_is_named_as_one(tmp_path, monkeypatch):
    """`lm serve --checkpoint LOOP` was a RuntimeError traceback (it named the model first), the other
    commands said 'file not found' for a file that is there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.pt").symlink_to("b.pt")
    (tmp_path / "b.pt").symlink_to("a.pt")
    (tmp_path / "gone.pt").symlink_to("nothing.pt")
    with pytest.raises(ValueError, match=r"^--checkpoint: 'a.pt' is a symlink loop$"):
        resolve_checkpoint("a.pt")
    with pytest.raises(ValueError, match=r"^--checkpoint: 'gone.pt' is a symlink to a file that is not there$"):
        resolve_checkpoint("gone.pt")
    with pytest.raises(ValueError, match=r"^--checkpoint: 'a.pt' is a symlink loop$"):
        served_model_name("a.pt")


def test_served_model_name_of_a_runs_checkpoints_folder_is_the_run(tmp_path):
    """README: the model's id is the run folder's name; `--checkpoint RUN/checkpoints` served it as 'checkpoints'."""
    run = tmp_path / "tiny-run"
    (run / "checkpoints").mkdir(parents=True)
    assert served_model_name(str(run / "checkpoints")) == "tiny-run"
    assert served_model_name(str(run / "checkpoints") + "/") == "tiny-run"
    assert served_model_name(str(run / "checkpoints" / "best.pt")) == "tiny-run"
    assert served_model_name(str(run)) == "tiny-run"


def _size_of(state) -> int:
    """The bytes of the checkpoint file of ``state``."""
    import io

    from lm.checkpoint.io import write_checkpoint

    buffer = io.BytesIO()
    write_checkpoint(state, buffer)
    return len(buffer.getvalue())


def test_a_checkpoint_over_the_file_size_limit_says_so(tmp_path):
    """Under `ulimit -f` the reason was torch's: "RuntimeError: [enforce fail at inline_container.cc:672]
    . unexpected pos 832 vs 726 (disk full?)". It names the limit now (and the write leaves nothing)."""
    import torch

    from lm.checkpoint.io import CheckpointWriteError

    resource = pytest.importorskip("resource")
    manager = CheckpointManager(tmp_path)
    state = {"model": {"w": torch.zeros(100_000)}, "iteration": 5}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < 300 * 1024:
        pytest.skip("the hard file size limit is below the one this test sets")
    resource.setrlimit(resource.RLIMIT_FSIZE, (300 * 1024, hard))  # Python ignores SIGXFSZ: writes fail (EFBIG)
    try:
        with pytest.raises(CheckpointWriteError) as e:
            manager.save(state, 5)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value) == (f"could not write checkpoint {str(manager.step_path(5))!r}: the checkpoint is "
                            f"{_size_of(state):,} bytes, over the file size limit of 307,200 bytes (ulimit -f); "
                            "raise it")
    assert not manager.dir.exists() or not any(manager.dir.iterdir())


def test_a_checkpoint_larger_than_the_free_space_says_the_disk_is_full(tmp_path, monkeypatch):
    """A full disk reached torch's writer as a short write: its words, not "no space"."""
    import collections
    import shutil

    import torch

    import lm.checkpoint.io as io_module
    from lm.checkpoint.io import CheckpointWriteError

    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # a real file fails as torch reports it; counting still works
        if hasattr(f, "fileno") and not hasattr(f, "getvalue"):  # a file (atomic_write's), not a buffer
            f.write(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        return real_save(obj, f, *args, **kwargs)

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(io_module.torch, "save", full_disk)
    manager = CheckpointManager(tmp_path)
    manager.dir.mkdir()
    state = {"model": {"w": torch.zeros(1000)}, "iteration": 5}
    with pytest.raises(CheckpointWriteError) as e:
        manager.save_best(state)
    assert str(e.value).startswith(f"could not write checkpoint {str(manager.best_path)!r}: RuntimeError: ")  # room
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(CheckpointWriteError) as e:
        manager.save_best(state)
    assert str(e.value) == (f"could not write checkpoint {str(manager.best_path)!r}: the disk is full: the checkpoint "
                            f"is {_size_of(state):,} bytes and {str(manager.dir)!r} has 1,000 bytes free")
    assert list(manager.dir.iterdir()) == []


def test_a_checkpoint_path_that_is_a_folder_is_not_called_a_full_disk(tmp_path):
    """Every failed write ended in "(disk full?)", an OSError with its reason too ("Is a directory"):
    the hint is for torch's own write errors, which give no reason (api7 audit)."""
    import torch

    from lm.checkpoint.io import CheckpointWriteError, write_checkpoint

    (tmp_path / "step.pt").mkdir()
    with pytest.raises(CheckpointWriteError) as e:
        write_checkpoint({"model": {"w": torch.zeros(3)}}, tmp_path / "step.pt")
    assert str(e.value) == f"could not write checkpoint {str(tmp_path / 'step.pt')!r}: IsADirectoryError: " \
                           f"[Errno 21] Is a directory: {str(tmp_path / 'step.pt')!r}"


def test_a_write_error_without_words_is_named_by_its_type_and_keeps_the_earlier_file(tmp_path, monkeypatch):
    """A failed torch.save whose exception has no message (``RuntimeError()``) is named by its type,
    with the disk-full hint; the checkpoint written before it at that path is the one left."""
    import torch

    import lm.checkpoint.io as io_module
    from lm.checkpoint.io import CheckpointWriteError, read_checkpoint, write_checkpoint

    path = tmp_path / "step.pt"
    write_checkpoint({"model": {"w": torch.ones(3)}, "iteration": 1}, path)

    def fails(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise RuntimeError()

    monkeypatch.setattr(io_module.torch, "save", fails)
    with pytest.raises(CheckpointWriteError) as e:
        write_checkpoint({"model": {"w": torch.zeros(3)}, "iteration": 2}, path)
    assert str(e.value) == f"could not write checkpoint {str(path)!r}: RuntimeError (disk full?)"
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step.pt"]
    assert read_checkpoint(path)["iteration"] == 1


def test_a_checkpoint_exactly_at_the_file_size_limit_is_not_blamed_on_it(tmp_path, monkeypatch):
    """A file of exactly the limit's size may be written: a write that fails at that size failed for
    another reason, and keeps its own words; one byte over the limit is the limit's fault."""
    import torch

    import lm.checkpoint.io as io_module
    import lm.checkpoint.manager as manager_module
    from lm.checkpoint.io import CheckpointWriteError

    real_save = torch.save

    def fails(obj, f, *args, **kwargs):
        if hasattr(f, "fileno") and not hasattr(f, "getvalue"):  # a file, not a buffer or the counting of its size
            raise RuntimeError("unexpected pos 64 vs 0")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(io_module.torch, "save", fails)
    manager = CheckpointManager(tmp_path)
    state = {"model": {"w": torch.zeros(1000)}, "iteration": 5}
    size = _size_of(state)
    for limit, reason in ((size, "RuntimeError: unexpected pos 64 vs 0 (disk full?)"),
                          (size - 1, f"the checkpoint is {size:,} bytes, over the file size limit of {size - 1:,} "
                                     "bytes (ulimit -f); raise it")):
        monkeypatch.setattr(manager_module, "_file_size_limit", lambda limit=limit: limit)
        with pytest.raises(CheckpointWriteError) as e:
            manager.save(state, 5)
        assert str(e.value) == f"could not write checkpoint {str(manager.step_path(5))!r}: {reason}"

"""`lm.io.claim_dir` (the in-place folder output of `lm demo`, scripts/shakespeare.py and scripts/multi30k.py):
on failure or interrupt it removes only what it made. A folder the user made beforehand stays, emptied of
what the command wrote; a folder it made goes; with --overwrite the earlier output is put back."""

import os

import pytest

from lm.io import MARKER, claim_dir, read_marker, write_marker


def _write_partial(out):
    (out / "run").mkdir()
    (out / "run" / "step_1.pt").write_bytes(b"partial")
    (out / "report.json").write_text("{}")


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_failed_command_keeps_the_empty_folder_the_user_made(tmp_path, failure):
    """An interrupted `lm demo --out DIR` removed DIR, an empty folder the user had made for it."""
    out = tmp_path / "mine"
    out.mkdir()
    os.chmod(out, 0o750)  # the user's own folder: its mode and identity stay too
    before = out.stat()
    with pytest.raises(failure), claim_dir(out, command="lm test", files=("run", "report.json")) as claimed:
        assert claimed == out
        _write_partial(out)
        raise failure("stopped")
    assert out.is_dir() and not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    after = out.stat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


def test_a_failed_command_removes_the_folder_it_made(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(KeyboardInterrupt), claim_dir(out, command="lm test") as claimed:
        _write_partial(claimed)
        raise KeyboardInterrupt
    assert not out.exists() and not any(tmp_path.iterdir())


def test_emptying_the_users_folder_removes_links_not_what_they_point_to(tmp_path):
    out, elsewhere = tmp_path / "mine", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt), claim_dir(out, command="lm test") as claimed:
        (claimed / "data").symlink_to(elsewhere, target_is_directory=True)
        (claimed / "f").symlink_to(elsewhere / "keep.txt")
        raise KeyboardInterrupt
    assert out.is_dir() and not any(out.iterdir())
    assert (elsewhere / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("premade", [False, True])
def test_a_successful_command_keeps_its_output(tmp_path, premade):
    out = tmp_path / "out"
    if premade:
        out.mkdir()
    with claim_dir(out, command="lm test", files=("run", "report.json")) as claimed:
        _write_partial(claimed)
    assert (out / "run" / "step_1.pt").read_bytes() == b"partial"
    assert read_marker(out)["complete"] is True


def test_an_interrupted_overwrite_puts_the_earlier_output_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"earlier": true}')
    write_marker(out, "lm test")
    with pytest.raises(KeyboardInterrupt), \
            claim_dir(out, command="lm test", overwrite=True, files=("run", "report.json")) as claimed:
        assert not (claimed / "report.json").exists()  # the earlier output was moved aside
        _write_partial(claimed)
        raise KeyboardInterrupt
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "report.json"]
    assert (out / "report.json").read_text() == '{"earlier": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no hidden .old folder left beside it

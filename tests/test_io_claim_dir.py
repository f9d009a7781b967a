"""`lm.io.claim_dir` (the in-place folder output of `lm demo`, scripts/shakespeare.py and scripts/multi30k.py):
on failure or interrupt it removes only what it made. A folder the user made beforehand stays, emptied of
what the command wrote; a folder it made goes; with --overwrite the earlier output is put back."""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

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


def _files_under(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_never_replaces_a_folder_without_the_commands_marker(tmp_path):
    """A folder without the marker was taken for an earlier output when its top-level names were the
    command's: `lm demo --out proj --overwrite` deleted the user's proj/data/corpus.txt and
    proj/run/notes.md (data/ and run/ are names the demo writes), and `lm export hf --overwrite` a
    folder transformers' save_pretrained wrote (tokenizer.json, tokenizer_config.json). Without
    --overwrite the error had said to pass it (audit exportdemo3 #1)."""
    from lm.export.hf import HF_FILES
    from lm.io import check_output_dir, replace_dir

    proj = tmp_path / "proj"
    for name, text in (("data/corpus.txt", "my corpus"), ("run/notes.md", "my notes"), ("report.json", "{}")):
        (proj / name).parent.mkdir(parents=True, exist_ok=True)
        (proj / name).write_text(text)
    hf = tmp_path / "hftok"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    (hf / "tokenizer_config.json").write_text("{}")
    before = _files_under(tmp_path)
    for out, command, files in ((proj, "lm demo", ("data", "tokenizer", "run", "loss.png", "report.json")),
                                (hf, "lm export hf", HF_FILES)):
        want = (f"--out: {str(out)!r} holds files and no {MARKER} naming `{command}` (it was not written by "
                f"`{command}`, or by a version of lm before the marker); refusing to replace it: choose a new or "
                "empty folder, or remove it yourself")
        for overwrite in (True, False):
            with pytest.raises(ValueError) as error:
                check_output_dir(out, command=command, overwrite=overwrite, files=files)
            assert str(error.value) == want
        with pytest.raises(ValueError, match="no .lm-output.json"), claim_dir(out, command=command, overwrite=True,
                                                                              files=files):
            pass
        with pytest.raises(ValueError, match="no .lm-output.json"), replace_dir(out, command=command, overwrite=True,
                                                                                files=files):
            pass
    assert _files_under(tmp_path) == before
    # the same folder marked as the command's output is replaced with --overwrite
    write_marker(hf, "lm export hf")
    assert check_output_dir(hf, command="lm export hf", overwrite=True, files=HF_FILES) is True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, where no folder can be made")
def test_a_folder_that_cannot_be_made_is_one_line_naming_the_argument(tmp_path):
    """`lm demo --out /proc/x` said "[Errno 2] No such file or directory: '/proc/x'", naming neither
    --out nor what failed (clifuzz7 #8), where replace_dir's outputs name both."""
    with pytest.raises(ValueError) as e, claim_dir("/proc/x", command="lm test"):
        pass
    assert str(e.value) == "--out: '/proc/x' cannot be written: No such file or directory"


def test_a_name_too_long_to_look_at_is_one_line_naming_the_argument(tmp_path):
    """A 300-character --out of `lm demo` or `lm plot` was "[Errno 36] File name too long: 'xxx...'":
    the checks' own stat of the path failed (clifuzz7 #8)."""
    from lm.io import check_output_dir, check_output_file

    long = tmp_path / ("x" * 300)
    for check in (lambda: check_output_dir(long, command="lm test"), lambda: check_output_file(long)):
        with pytest.raises(ValueError) as e:
            check()
        assert str(e.value) == f"--out: {str(long)!r} cannot be written: File name too long"


def test_a_symlink_loop_is_refused_naming_it(tmp_path, monkeypatch):
    """Path.resolve raises RuntimeError for a loop on Python 3.10-3.12: every output check was a
    traceback for a loop at --out (lm tokenizer train, tokenize, plot, export hf, demo), and
    check_readable_file called one "file not found" (clifuzz7 #2)."""
    from lm.io import check_not_input, check_output_dir, check_output_file, check_readable_file

    monkeypatch.chdir(tmp_path)
    os.symlink("loop2", "loop1")
    os.symlink("loop1", "loop2")
    (tmp_path / "in.txt").write_text("x")
    checks = [
        (lambda: claim_dir("loop1", command="lm test").__enter__(), "--out: 'loop1' is a symlink loop"),
        (lambda: check_output_dir("loop1", command="lm test", inputs=[("--input", "in.txt")]),
         "--out: 'loop1' is a symlink loop"),
        (lambda: check_output_file("loop1/x.png"), "--out: 'loop1/x.png' lies below 'loop1', a symlink loop"),
        (lambda: check_not_input("loop1/a/b", [("--input", "in.txt")], "out"),
         "out: 'loop1/a/b' lies below 'loop1', a symlink loop"),
        (lambda: check_readable_file("loop1", "--input"), "--input: 'loop1' is a symlink loop"),
        # an empty path, named by the argument it was given as (not the working folder it would read)
        (lambda: check_not_input("", [("--input", "in.txt")], "--report"), "--report: must not be empty"),
    ]
    for check, message in checks:
        with pytest.raises(ValueError) as e:
            check()
        assert str(e.value) == message
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "loop1", "loop2"]


def test_an_incomplete_output_is_refused_saying_it_is_incomplete(tmp_path):
    """A folder whose marker says ``complete: false`` (its run was killed, SIGKILL or a power cut, where
    nothing could clean up, or it still runs) had been refused as any earlier output, "exists; pass
    --overwrite": now the message says it is incomplete, and why it may be. A complete one is refused
    as before; --overwrite takes both."""
    from lm.io import check_output_dir

    for complete in (False, True):
        out = tmp_path / f"out-{complete}"
        out.mkdir()
        (out / "run").mkdir()
        write_marker(out, "lm test", complete=complete)
        with pytest.raises(ValueError) as e:
            check_output_dir(out, command="lm test", files=["run"])
        assert str(e.value) == (f"--out: {str(out)!r} exists and is incomplete (a `lm test` killed part way, or one "
                                "still writing it); pass --overwrite to replace it once none is" if not complete else
                                f"--out: {str(out)!r} exists; pass --overwrite to replace it")
        assert check_output_dir(out, command="lm test", files=["run"], overwrite=True) is True


def test_an_out_that_is_a_symlink_is_refused_saying_so(tmp_path, monkeypatch):
    """A link to a folder was refused as "exists and is not a folder", though `test -d` is true (cli21
    F3): the refusal stands (the new folder, renamed into place, would replace the link, not the
    folder it points to), and the message now says why and what to give instead."""
    from lm.io import check_output_dir

    monkeypatch.chdir(tmp_path)
    Path("realdir").mkdir()
    Path("earlier").mkdir()
    write_marker(Path("earlier"), "lm test", complete=False)  # an earlier output: --overwrite would replace it
    Path("file.txt").write_text("x")
    for link, target in (("linkdir", "realdir"), ("linktok", "earlier")):
        os.symlink(target, link)
        for overwrite in (False, True):
            with pytest.raises(ValueError) as e:
                check_output_dir(link, command="lm test", overwrite=overwrite)
            assert str(e.value) == (f"--out: {link!r} is a symlink (to {target!r}); give the folder itself: the output "
                                    "would replace the link, not the folder it points to")
        with pytest.raises(ValueError) as e:
            claim_dir(link, command="lm test").__enter__()
        assert str(e.value).startswith(f"--out: {link!r} is a symlink (to {target!r}); give the folder itself")
    assert check_output_dir("realdir", command="lm test") is False  # the folder itself is taken
    for link, target in (("dangling", "nowhere"), ("filelink", "file.txt")):
        os.symlink(target, link)
        with pytest.raises(ValueError) as e:
            check_output_dir(link, command="lm test")
        assert str(e.value) == f"--out: {link!r} is a symlink (to {target!r}), not a folder; refusing to replace it"
    assert sorted(os.listdir()) == ["dangling", "earlier", "file.txt", "filelink", "linkdir", "linktok", "realdir"]
    assert os.listdir("realdir") == [] and os.listdir("earlier") == [MARKER]


def test_atomic_files_renames_nothing_until_every_file_is_written(tmp_path):
    """The files of one output (ids, offsets, sidecar) appear together: a failure while writing the
    last leaves every earlier file as it was, and no temporary file (clifuzz7 #1)."""
    from lm.io import atomic_files

    for name in ("a.bin", "a.bin.json"):
        (tmp_path / name).write_text(f"old {name}")
    with pytest.raises(UnicodeEncodeError), atomic_files() as open_file:
        open_file(tmp_path / "a.bin", "wb").write(b"new ids")
        assert (tmp_path / "a.bin").read_text() == "old a.bin"  # not renamed yet
        open_file(tmp_path / "a.bin.json").write("\udcff")  # a lone surrogate: no UTF-8 file holds it
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"a.bin": "old a.bin", "a.bin.json": "old a.bin.json"}
    with atomic_files() as open_file:
        open_file(tmp_path / "sub" / "a.bin", "wb").write(b"new ids")
        open_file(tmp_path / "sub" / "a.bin.json").write("{}")
    assert {p.name: p.read_bytes() for p in (tmp_path / "sub").iterdir()} == {"a.bin": b"new ids", "a.bin.json": b"{}"}
    opened = []
    with pytest.raises(RuntimeError), atomic_files() as open_file:
        for name in ("a.bin", "a.bin.json"):
            opened.append(open_file(tmp_path / "made" / "deeper" / name, "wb"))
            opened[-1].write(b"x")
        raise RuntimeError("stopped")
    assert not (tmp_path / "made").exists()  # the folders it made, removed again
    assert all(f._file.closed for f in opened)  # each closed, not left to the collector (a ResourceWarning)


FILES = ("run", "report.json")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _killed_overwrite(tmp_path, builder="claim_dir"):
    """A complete output at tmp_path/out, then a second run with --overwrite SIGKILLed while it runs:
    that run's folder at out (claim_dir: built in place; replace_dir: out missing, killed after
    setting it aside), the complete one set aside in a hidden .out.XXXXXXXX.old. Returns that folder."""
    out = tmp_path / "out"
    with claim_dir(out, command="lm test", files=FILES) as claimed:
        _write_partial(claimed)
        (claimed / "report.json").write_text('{"earlier": true}')
    if builder == "claim_dir":
        body = ("with claim_dir(out, command='lm test', overwrite=True, files=('run', 'report.json')) as d:\n"
                "    (d / 'report.json').write_text('{\"partial\": true}')\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\n")
    else:  # killed in replace_dir's window between setting the old output aside and renaming the new one in
        body = ("real = os.replace\n"
                "def killed(a, b):\n"
                "    real(a, b)\n"
                "    if str(b).endswith('.old'):\n"
                "        os.kill(os.getpid(), signal.SIGKILL)\n"
                "lm.io.os.replace = killed\n"
                "with replace_dir(out, command='lm test', overwrite=True, files=('run', 'report.json')) as d:\n"
                "    (d / 'report.json').write_text('{}')\n")
    script = ("import os, signal\nfrom pathlib import Path\nimport lm.io\nfrom lm.io import claim_dir, replace_dir\n"
              f"out = Path({str(out)!r})\n{body}")
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    olds = sorted(tmp_path.glob(".out.*.old"))
    assert len(olds) == 1 and read_marker(olds[0])["complete"] is True, sorted(os.listdir(tmp_path))
    assert (olds[0] / "report.json").read_text() == '{"earlier": true}'
    for tmp in tmp_path.glob(".out.*.tmp"):  # replace_dir's new folder, left by the kill: not at issue here
        shutil.rmtree(tmp)
    if builder == "claim_dir":
        assert read_marker(out)["complete"] is False
    else:
        assert not out.exists()
    return olds[0]


def _hint(message):
    """The shell command the refusal gives to get the output back."""
    return message.split("; to put it back: ")[1].split("; or pass --overwrite")[0]


@pytest.mark.parametrize("state", ["incomplete", "missing", "empty"])
def test_without_overwrite_a_killed_runs_set_aside_output_is_refused_naming_it(tmp_path, state):
    """`lm demo --out out --overwrite` SIGKILLed while it ran left the previous complete output hidden
    in .out.XXXXXXXX.old for ever: the next run said only "exists; pass --overwrite" (or, with out
    gone, wrote a new output), and --overwrite then replaced out and left the .old (ckpt8 claim)."""
    from lm.io import check_output_dir

    out = tmp_path / "out"
    old = _killed_overwrite(tmp_path, "replace_dir" if state == "missing" else "claim_dir")
    if state == "empty":  # the user cleared out the incomplete output, keeping the folder
        shutil.rmtree(out)
        out.mkdir()
    q_out, q_old = shlex.quote(str(out)), shlex.quote(str(old))
    clear = {"incomplete": f"rm -r {q_out} && ", "missing": "", "empty": f"rmdir {q_out} && "}[state]
    want = (f"--out: a run of `lm test` was killed while replacing {str(out)!r}, and the previous complete output "
            f"is still set aside in {str(old)!r}; to put it back: {clear}mv {q_old} {q_out}; "
            "or pass --overwrite to discard it")
    before = _files_under(tmp_path)
    for check in (lambda: check_output_dir(out, command="lm test", files=FILES),
                  lambda: claim_dir(out, command="lm test", files=FILES).__enter__()):
        with pytest.raises(ValueError) as e:
            check()
        assert str(e.value) == want
    assert _files_under(tmp_path) == before and old.is_dir()
    subprocess.run(_hint(str(e.value)), shell=True, check=True)  # the way back it gives works
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert (out / "report.json").read_text() == '{"earlier": true}' and read_marker(out)["complete"] is True


def test_of_several_set_aside_outputs_the_newest_complete_one_is_named_first(tmp_path):
    """Runs killed more than once leave several set-aside folders: the refusal names the newest
    complete output (the one to put back), counts the others, and gives an incomplete one only when
    no complete one is left (mutations: the complete ones sorted last, survived)."""
    from lm.io import check_output_dir

    out = tmp_path / "out"
    folders = {}
    for name, complete, mtime in (("aaaaaaaa", True, 1000), ("bbbbbbbb", False, 3000), ("cccccccc", True, 2000)):
        folder = folders[name] = tmp_path / f".out.{name}.old"
        folder.mkdir()
        (folder / "report.json").write_text("{}")
        write_marker(folder, "lm test", complete=complete)
        os.utime(folder, (mtime, mtime))
    for gone, named, more, what in ((None, "cccccccc", " (and 2 more like it)", "the previous complete output"),
                                    ("cccccccc", "aaaaaaaa", " (and 1 more like it)", "the previous complete output"),
                                    ("aaaaaaaa", "bbbbbbbb", "", "an earlier incomplete output")):
        if gone:
            shutil.rmtree(folders[gone])
        with pytest.raises(ValueError) as e:
            check_output_dir(out, command="lm test", files=FILES)
        assert str(e.value).startswith(f"--out: a run of `lm test` was killed while replacing {str(out)!r}, and "
                                       f"{what} is still set aside in {str(folders[named])!r}{more}; "), str(e.value)


@pytest.mark.parametrize("builder", ["claim_dir", "replace_dir"])
def test_overwrite_discards_a_killed_runs_set_aside_output_once_it_succeeds(tmp_path, builder):
    """With --overwrite the set-aside output goes with the one it replaces, but only when the run succeeds:
    one that fails leaves out and the set-aside output as they were, to be found again."""
    from lm.io import replace_dir

    build = {"claim_dir": claim_dir, "replace_dir": replace_dir}[builder]
    out = tmp_path / "out"
    old = _killed_overwrite(tmp_path)
    before = _files_under(tmp_path)
    with pytest.raises(KeyboardInterrupt), build(out, command="lm test", overwrite=True, files=FILES) as d:
        _write_partial(d)
        raise KeyboardInterrupt
    assert _files_under(tmp_path) == before and old.is_dir()
    with build(out, command="lm test", overwrite=True, files=FILES) as d:
        (d / "report.json").write_text('{"new": true}')
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no hidden .old folder left beside it
    assert (out / "report.json").read_text() == '{"new": true}' and read_marker(out)["complete"] is True


def test_a_set_aside_folder_that_is_not_the_commands_is_never_touched(tmp_path):
    """Only a .out.XXXXXXXX.old holding an output of the same command, and nothing else, counts: one
    without a marker (a user's), another command's, one the user added a file to, or one of another
    output (.out.b.XXXXXXXX.old) is neither reported nor removed. An empty one without a marker (a run
    killed after making it, before it moved the output there) holds nothing: it goes (faults20: it had
    stayed for ever, one more with each such kill)."""
    from lm.io import check_output_dir

    out = tmp_path / "out"
    old = _killed_overwrite(tmp_path)
    others = {name: tmp_path / name for name in (".out.aaaaaaaa.old", ".out.bbbbbbbb.old", ".out.cccccccc.old",
                                                  ".out.b.dddddddd.old", ".out.eeeeeeee.old", ".out.ffffffff.old")}
    others[".out.aaaaaaaa.old"].mkdir()  # empty, no marker
    for name, command in ((".out.bbbbbbbb.old", "lm export hf"), (".out.cccccccc.old", "lm test"),
                          (".out.b.dddddddd.old", "lm test")):
        others[name].mkdir()
        (others[name] / "report.json").write_text("{}")
        write_marker(others[name], command)
    (others[".out.cccccccc.old"] / "notes.txt").write_text("mine")  # added by the user after the marker
    (others[".out.ffffffff.old"] / "run").mkdir(parents=True)  # complete, then a note added below its top
    (others[".out.ffffffff.old"] / "run" / "log.txt").write_text("the command's")
    write_marker(others[".out.ffffffff.old"], "lm test")
    (others[".out.ffffffff.old"] / "run" / "notes.txt").write_text("mine")
    others[".out.eeeeeeee.old"].mkdir()
    (others[".out.eeeeeeee.old"] / "report.json").write_text("mine")  # no marker
    with pytest.raises(ValueError, match=re.escape(f"set aside in {str(old)!r};")):  # only ours is named
        check_output_dir(out, command="lm test", files=FILES)
    with claim_dir(out, command="lm test", overwrite=True, files=FILES) as d:
        _write_partial(d)
    empty = others.pop(".out.aaaaaaaa.old")
    assert not old.exists() and not empty.exists() and all(p.is_dir() for p in others.values())
    assert sorted(os.listdir(tmp_path)) == sorted(["out", *others])
    assert (others[".out.cccccccc.old"] / "notes.txt").read_text() == "mine"
    assert (others[".out.ffffffff.old"] / "run" / "notes.txt").read_text() == "mine"
    # none of them is reported either
    shutil.rmtree(out)
    assert check_output_dir(out, command="lm test", files=FILES) is False


@pytest.mark.parametrize("there", ["missing", "empty folder"])
def test_a_folder_another_process_takes_after_the_checks_is_refused_and_left_alone(tmp_path, monkeypatch, there):
    """faults20: claim_dir made the folder with exist_ok and wrote its marker over whatever was there, so
    two `lm demo --out X` started together both wrote into X, and the one that failed emptied it under
    the other. Now the folder (or, for an empty one, its marker) is created exclusively: the second
    is refused in one line, and touches nothing of the first's."""
    import lm.io

    out = tmp_path / "out"
    if there == "empty folder":
        out.mkdir()
    real_make_dir, real_set_aside, calls = lm.io.make_dir, lm.io._set_aside, []

    def the_other_process_claims_it():
        out.mkdir(exist_ok=True)
        write_marker(out, "lm test", complete=False)
        (out / "report.json").write_text("the other run's")

    if there == "missing":  # it makes the folder right before this process's mkdir (after the checks)
        def make_dir(path):
            made = real_make_dir(path)
            if Path(path) == out.parent:
                the_other_process_claims_it()
            return made

        monkeypatch.setattr(lm.io, "make_dir", make_dir)
    else:  # it claims the empty folder between the checks and this process's claim
        def set_aside(*args):
            calls.append(args)
            if len(calls) == 2:  # claim_dir's own call, after check_output_dir's
                the_other_process_claims_it()
            return real_set_aside(*args)

        monkeypatch.setattr(lm.io, "_set_aside", set_aside)
    with pytest.raises(ValueError, match=rf"^--out: {re.escape(repr(str(out)))} was taken by another process after "
                                         r"it was checked \(another run writing the same output\?\)"):
        with claim_dir(out, command="lm test", files=FILES):
            raise AssertionError("the block must not run")
    assert (out / "report.json").read_text() == "the other run's" and read_marker(out)["complete"] is False


def test_a_decompressed_copy_a_killed_run_left_is_named_with_its_size(tmp_path, monkeypatch):
    """faults20: a `lm tokenizer train` killed (SIGKILL, the OOM killer) while reading a .gz input left its
    decompressed copy in the temporary folder, as large as the corpus, and nothing named it. Each copy's
    folder now carries its process id: one whose process is gone is named in a warning, with its size
    and how to remove it (not removed: another PID namespace's process may be reading it)."""
    import contextlib
    import gzip
    import tempfile
    import warnings

    from lm.io import decompressed_copies

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    dead = tmp_path / "tmp" / "lm-text-999999999-k1ll3d"  # above any pid_max: no such process
    dead.mkdir()
    (dead / "0-corpus.txt").write_bytes(b"x" * 5000)
    alive = tmp_path / "tmp" / f"lm-text-{os.getppid()}-run"  # a process that runs
    alive.mkdir()
    source = tmp_path / "c.txt.gz"
    source.write_bytes(gzip.compress(b"hello world\n"))
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copy, = decompressed_copies([source], stack)
        assert copy.read_bytes() == b"hello world\n" and copy.parent.name.startswith(f"lm-text-{os.getpid()}-")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and messages[0].startswith(f"--input: {str(dead)!r} (")
    assert "holds the decompressed copy of a gzip input that a run killed while reading left behind; rm -r " \
           f"{dead}" in messages[0] and str(alive) not in messages[0]
    assert dead.is_dir() and alive.is_dir() and not copy.exists()
    dead2 = tmp_path / "tmp" / "lm-text-999999998-k1ll3d"  # two: named together, in the plural
    dead2.mkdir()
    (dead2 / "0-corpus.txt").write_bytes(b"y" * 3000)
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decompressed_copies([source], stack)
    message, = (str(w.message) for w in caught)
    assert message.startswith(f"--input: {str(dead2)!r} and {str(dead)!r} (")
    assert message.endswith(f"bytes) hold the decompressed copies of a gzip input that runs killed while reading left "
                            f"behind; rm -r {dead2} {dead}")


def test_a_name_within_14_bytes_of_the_longest_is_written_and_its_leftovers_found(tmp_path):
    """tokexp22: the temporary name beside an output (.NAME.XXXXXXXX.tmp) is 14 bytes longer than
    NAME, so a legal name of 242-255 bytes failed "File name too long" (`lm export hf --out` into an
    empty folder of that name the user made, `lm tokenize --out`). The temporary name is cut (with a
    hash of the whole name), and a killed writer's leftovers of such a name are still found."""
    from lm.io import _leftover_temps, atomic_write, check_output_dir, replace_dir, temp_prefix

    for n in (241, 242, 250, 255):
        name = "m" * n
        with atomic_write(tmp_path / name) as f:
            f.write("x")
        assert (tmp_path / name).read_text() == "x"
        (tmp_path / name).unlink()
        made = tmp_path / ("d" * n)
        made.mkdir()  # the user's empty folder of that name
        with replace_dir(made, command="lm test", files=FILES) as d:
            (d / "report.json").write_text("{}")
        assert read_marker(made)["complete"] is True
        with replace_dir(made, command="lm test", files=FILES, overwrite=True) as d:  # the .old swap
            (d / "report.json").write_text('{"again": 1}')
        assert sorted(os.listdir(tmp_path)) == [made.name]
        shutil.rmtree(made)
    long, other = "a" * 250, "a" * 249 + "b"
    # the cut uses the room to the byte: the temporary's name (+ 8 random characters and ".tmp") is 255 bytes
    assert temp_prefix(long) != temp_prefix(other) and len(temp_prefix(long).encode()) + 12 == 255
    assert temp_prefix("short.bin") == ".short.bin."
    left = tmp_path / (temp_prefix(long) + "abcd1234.tmp")  # what a killed writer of `long` leaves
    left.write_text("partial")
    assert _leftover_temps(tmp_path / long) == [left] and _leftover_temps(tmp_path / other) == []
    for argument in ("--out", "--out-dir"):  # named by the argument the folder was given as
        with pytest.warns(UserWarning, match=rf"^{argument}: '.*' \(7 bytes\), beside '.*', is the temporary copy of "
                                             "a run killed while writing it"):
            check_output_dir(tmp_path / long, command="lm test", argument=argument, files=FILES)


# I1 / I2: atomic_files fsyncs every file before any rename, and renames the last opened first
def test_atomic_files_fsyncs_each_file_before_renaming_and_renames_the_sidecar_first(tmp_path, monkeypatch):
    import lm.io as lio

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(lio.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                       real_fsync(fd))[1])
    monkeypatch.setattr(lio.os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))),
                                                           real_replace(a, b))[1])
    with lio.atomic_files() as open_file:
        open_file(tmp_path / "ids.bin", "wb").write(b"12")
        open_file(tmp_path / "ids.bin.json").write("{}")
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "fsync", "replace", "replace"], events
    synced = {os.path.basename(e[1]) for e in events[:2]}
    renamed_from = {os.path.basename(e[1]) for e in events[2:]}
    assert synced == renamed_from  # the temporary files that were fsynced are those renamed
    assert [os.path.basename(e[2]) for e in events[2:]] == ["ids.bin.json", "ids.bin"]  # sidecar first


# I8: replace_dir that fails to rename the new folder into place puts the old output back
def test_replace_dir_puts_the_old_output_back_when_the_swap_fails(tmp_path, monkeypatch):
    import lm.io as lio

    out = tmp_path / "out"
    with lio.replace_dir(out, command="lm x", files=("a.txt",)) as d:
        (d / "a.txt").write_text("old")
    real_replace = os.replace

    def replace(a, b):
        if ".tmp" in os.path.basename(str(a)) and str(b) == str(out):
            raise OSError(5, "Input/output error")
        return real_replace(a, b)

    monkeypatch.setattr(lio.os, "replace", replace)
    with pytest.raises(OSError):
        with lio.replace_dir(out, command="lm x", files=("a.txt",), overwrite=True) as d:
            (d / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "old"


# I10: the lock is exclusive: a second holder (another lm train, another download) is refused
def test_lock_file_is_exclusive_and_a_second_run_lock_is_refused(tmp_path):
    from lm.io import lock_file
    from lm.train.run_dir import RunLock

    fd = lock_file(tmp_path / "x.part")
    try:
        with pytest.raises(BlockingIOError):
            lock_file(tmp_path / "x.part")
    finally:
        os.close(fd)
    first = RunLock(tmp_path)
    first.acquire(say=lambda *_: None)
    try:
        with pytest.raises(ValueError, match="in use by another `lm train`"):
            RunLock(tmp_path).acquire(say=lambda *_: None)
    finally:
        first.release()


def test_a_run_lock_dropped_unreleased_lets_go_of_the_folder(tmp_path):
    """A lock that is dropped without release (a Trainer made and never run) kept its descriptor open
    for the life of the process, and the folder refused every later lock of that process, naming the
    process's own pid as "another `lm train`" (cyc25). It is released when collected; while it is
    held, the message says the holder is in this process."""
    from lm.train.run_dir import LOCK_NAME, RunLock

    first = RunLock(tmp_path)
    first.acquire(say=lambda *_: None)
    with pytest.raises(ValueError, match=rf"in use by another `lm train` in this process \(pid {os.getpid()}: a "
                                         r"Trainer for it that has not run or been dropped\); run or drop that one"):
        RunLock(tmp_path).acquire(say=lambda *_: None)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    del first  # no release
    assert not (tmp_path / LOCK_NAME).exists()
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds - 1
    second = RunLock(tmp_path)
    second.acquire(say=pytest.fail)  # no "took over the lock" either: it was let go of
    second.release()
    second.release()  # twice is once
    assert not second.held and not (tmp_path / LOCK_NAME).exists()


def test_a_ctrl_c_in_a_deferred_block_goes_to_the_earlier_handler_once_the_block_ends():
    """interrupts_deferred: Python's handler raises KeyboardInterrupt after the block, not inside it;
    another handler is called with SIGINT; an ignored SIGINT stays ignored."""
    from lm.io import interrupts_deferred

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)  # handled before raise_signal returns: nothing raised here
            reached.append("end of block")
    assert reached == ["end of block"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_deferred_under_the_default_action_is_raised_again_and_an_ignored_one_is_not(monkeypatch):
    """Under SIGINT's default action (a process that set ``SIG_DFL``: Ctrl-C kills it) the deferred
    Ctrl-C is raised again once the block ends, so the process still dies of it; under ``SIG_IGN`` it
    is dropped, as it would have been. Mutation: ``!=`` for ``==``, which lost the first and raised the
    second, survived (no test could let a real SIGINT kill its own process). The signal raised again
    is recorded here instead of delivered; the Ctrl-C is the deferring handler called as the kernel
    would call it."""
    from lm.io import interrupts_deferred

    raised = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        for action, expected in ((signal.SIG_DFL, [signal.SIGINT]), (signal.SIG_IGN, [])):
            signal.signal(signal.SIGINT, action)
            raised.clear()
            with interrupts_deferred():
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # a Ctrl-C arrives
                assert raised == []
            assert raised == expected and signal.getsignal(signal.SIGINT) == action, action
            with interrupts_deferred():  # and a block without one raises nothing
                pass
            assert raised == expected
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_mode_open_gives_under_the_umask(tmp_path, umask):
    """mkstemp makes 0600 files; an output written through a temporary name gets 0666 less the
    umask, as ``open`` would give it (a sidecar the group could not read, or one anyone could write,
    would differ from every other file the user makes). A lock file too (mutation: made 0667, survived)."""
    from lm.io import atomic_files, atomic_write, lock_file

    old = os.umask(umask)
    try:
        with atomic_write(tmp_path / "a.json") as f:
            f.write("{}")
        with atomic_files() as open_file:
            open_file(tmp_path / "sub" / "ids.bin", "wb").write(b"\0")
        (tmp_path / "plain").write_text("")
        os.close(lock_file(tmp_path / "run.lock"))
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777
             for p in (tmp_path / "a.json", tmp_path / "sub" / "ids.bin", tmp_path / "run.lock")}
    assert modes == {"a.json": 0o666 & ~umask, "ids.bin": 0o666 & ~umask, "run.lock": 0o666 & ~umask}
    assert (tmp_path / "plain").stat().st_mode & 0o777 == 0o666 & ~umask


def test_an_output_below_a_file_is_refused_naming_the_file(tmp_path):
    """check_parents names the argument, the file in the way and the output (mutation: the file's
    name as None, survived here; lm plot's and a script's tests read it through their commands)."""
    from lm.io import check_parents

    (tmp_path / "notes.txt").write_text("")
    out = tmp_path / "notes.txt" / "plots" / "loss.png"
    with pytest.raises(ValueError) as refused:
        check_parents(out, "--plot")
    assert str(refused.value) == (f"--plot: {str(tmp_path / 'notes.txt')!r} is a file, not a folder, so "
                                  f"{str(out)!r} cannot be made")
    check_parents(tmp_path / "plots" / "loss.png")  # folders yet to be made are no file in the way


def test_a_temporary_file_is_named_after_its_output_and_hidden(tmp_path):
    """While a file is written, its temporary name is ``.NAME.XXXXXXXX.tmp`` beside it: hidden, and
    what a later run recognises as a killed writer's leftover of that output."""
    from lm.io import atomic_files

    with atomic_files() as open_file:
        open_file(tmp_path / "ids.bin", "wb").write(b"\0")
        names = os.listdir(tmp_path)
    assert len(names) == 1 and re.fullmatch(r"\.ids\.bin\.[a-z0-9_]{8}\.tmp", names[0]), names
    assert os.listdir(tmp_path) == ["ids.bin"]


def test_text_name_writes_bytes_that_are_not_utf8_as_escapes():
    from lm.io import text_name

    assert text_name("caf\udce9.en") == "caf\\xe9.en"  # a Latin-1 file name, as Python holds it
    assert text_name(b"caf\xe9.en") == "caf\\xe9.en"  # the same name as bytes
    assert text_name(Path("café.en")) == "café.en"
    assert text_name("a\ud800b") == "a\\ud800b"  # a lone surrogate no file name gives


def test_a_folder_of_another_commands_output_is_refused_naming_that_command(tmp_path):
    """An output of `lm export hf` given to `lm demo --out`: refused saying whose it is (the files
    alone could be the command's); with files the command does not write, named, with how many more."""
    from lm.io import check_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "run").mkdir()
    write_marker(out, "lm export hf")

    def refusal() -> str:
        with pytest.raises(ValueError) as e:
            check_output_dir(out, command="lm demo", overwrite=True, files=("run",))
        return str(e.value)

    head, tail = f"--out: {str(out)!r} holds files that `lm demo` did not write", "refusing to replace it: choose a " \
        "new or empty folder"
    assert refusal() == f"{head} (it is an output of `lm export hf`); {tail}"
    for name in ("notes.md", "zz.txt"):
        (out / name).write_text("mine")
    assert refusal() == f"{head} ('notes.md' and 1 more; it is an output of `lm export hf`); {tail}"
    (out / "zz.txt").unlink()
    write_marker(out, "lm demo")
    assert refusal() == f"{head} ('notes.md'); {tail}"


def test_a_file_added_below_a_complete_output_is_named_from_its_markers_list(tmp_path):
    from lm.io import check_output_dir

    out = tmp_path / "out"
    (out / "run").mkdir(parents=True)
    (out / "run" / "loss.png").write_text("png")
    write_marker(out, "lm demo")
    assert check_output_dir(out, command="lm demo", overwrite=True, files=("run",)) is True
    # a killed writer's temporary of a listed file is the command's; one of another name, or in another
    # folder, is not (mutation: any temporary taken for foreign without looking, survived)
    (out / "run" / ".loss.png.abcd1234.tmp").write_text("half")
    assert check_output_dir(out, command="lm demo", overwrite=True, files=("run",)) is True
    for name in ("run/.notes.md.abcd1234.tmp", "run/sub/.loss.png.abcd1234.tmp"):
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("half")
        with pytest.raises(ValueError) as e:
            check_output_dir(out, command="lm demo", overwrite=True, files=("run",))
        assert str(e.value) == (f"--out: {str(out)!r} holds files that `lm demo` did not write ({name!r}); refusing "
                                "to replace it: choose a new or empty folder")
        (out / name).unlink()
    (out / "run" / "notes.md").write_text("mine")
    with pytest.raises(ValueError) as e:
        check_output_dir(out, command="lm demo", overwrite=True, files=("run",))
    assert str(e.value) == (f"--out: {str(out)!r} holds files that `lm demo` did not write ('run/notes.md'); refusing "
                            "to replace it: choose a new or empty folder")


def test_an_existing_output_file_needs_overwrite_by_default(tmp_path):
    from lm.io import check_output_file

    (tmp_path / "o.bin").write_text("x")
    with pytest.raises(ValueError) as e:
        check_output_file(tmp_path / "o.bin", recognise=lambda p: True)
    assert str(e.value) == f"--out: {str(tmp_path / 'o.bin')!r} exists; pass --overwrite to replace it"
    assert check_output_file(tmp_path / "o.bin", recognise=lambda p: True, overwrite=True) == tmp_path / "o.bin"


def test_an_output_folder_holding_an_input_or_the_working_folder_is_refused(tmp_path, monkeypatch):
    """Replacing a folder removes what it holds: one that holds an input, or the folder the command
    runs in, is refused before anything is touched (an output file may sit beside its input)."""
    from lm.io import check_output_dir, check_output_file

    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    corpus = out / "data" / "corpus.txt"
    corpus.write_text("text")
    with pytest.raises(ValueError) as e:
        check_output_dir(out, command="lm demo", overwrite=True, inputs=[("--input", corpus)])
    assert str(e.value) == (f"--out: {str(out)!r} contains the input --input {str(corpus)!r}; choose another "
                            "output")
    monkeypatch.chdir(out / "data")
    with pytest.raises(ValueError) as e:
        check_output_dir(out, command="lm demo", overwrite=True)
    assert str(e.value) == f"--out: {str(out)!r} contains the current directory; choose a folder below it"
    assert check_output_file(out / "data" / "ids.bin", inputs=[("--input", corpus)]) == out / "data" / "ids.bin"
    assert corpus.read_text() == "text"


def test_a_link_named_like_a_set_aside_output_is_not_taken_for_one(tmp_path):
    """Only a folder itself is a killed run's set-aside output: a symlink of that name, to a folder that
    looks like one, is not named as a way back, nor discarded with --overwrite."""
    from lm.io import check_output_dir

    elsewhere = tmp_path / "elsewhere"
    with claim_dir(elsewhere, command="lm test", files=FILES) as claimed:
        _write_partial(claimed)
    link = tmp_path / ".out.abcd1234.old"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert check_output_dir(tmp_path / "out", command="lm test", files=FILES) is False
    with claim_dir(tmp_path / "out", command="lm test", overwrite=True, files=FILES) as claimed:
        _write_partial(claimed)
    assert link.is_symlink() and read_marker(elsewhere)["complete"] is True
    link.unlink()
    elsewhere.rename(link)  # the same, as a folder: a set-aside output
    with pytest.raises(ValueError, match="is still set aside in"):
        check_output_dir(tmp_path / "out", command="lm test", files=FILES)


def test_a_temporary_name_is_cut_only_past_the_longest_name_a_file_may_have():
    """``.NAME.`` + 8 random characters + ``.tmp`` fit 255 bytes up to a 241-byte name, which keeps its
    name whole; one byte more and the name is cut, with its hash."""
    from lm.io import temp_prefix

    assert temp_prefix("a" * 241) == "." + "a" * 241 + "."
    longer = temp_prefix("a" * 242)
    assert longer.startswith(".aaa") and longer[-10] == "~" and len(longer) + 12 <= 255


def test_a_sample_that_ends_inside_a_character_still_looks_like_text(tmp_path):
    """The sample of a file is cut at ``sample`` bytes, maybe inside a character: the cut one is not
    counted against it. A whole file shorter than the sample is judged to its last byte."""
    from lm.io import looks_like_text

    (tmp_path / "t.txt").write_bytes("é".encode() * 4)  # 8 bytes: a sample of 7 cuts the last é
    assert looks_like_text(tmp_path / "t.txt", sample=7)
    (tmp_path / "b.bin").write_bytes(b"ab\xff\xfe")  # 2 bad bytes of 4: more than a quarter
    assert not looks_like_text(tmp_path / "b.bin", sample=8)


def test_a_killed_writers_leftover_is_named_beside_its_output(tmp_path):
    import warnings

    from lm.io import warn_leftover_temps

    out = tmp_path / "ids.bin"
    left = tmp_path / ".ids.bin.abcd1234.tmp"
    left.write_bytes(b"x" * 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_leftover_temps(out)
    message, = (str(w.message) for w in caught)
    assert message.startswith(f"--out: {str(left)!r} (")
    assert message.endswith(f"bytes), beside {str(out)!r}, is the temporary copy of a run killed while writing it (or "
                            f"writing it now); once none is running: rm -r {left}")


@pytest.mark.parametrize("holder", ["4242", "", "unreadable", "\udcff42"])
def test_a_run_lock_held_elsewhere_names_its_holders_pid(tmp_path, monkeypatch, holder):
    """The refusal names the pid in the lock file (another process's: wait for it), or ? when the file
    holds none or cannot be read (its holder removed it meanwhile); bytes that are not UTF-8 (no lock
    of lm's) are shown as U+FFFD, not a UnicodeDecodeError."""
    from helpers.faults import raising

    from lm.train.run_dir import LOCK_NAME, RunLock

    first = RunLock(tmp_path)
    first.acquire(say=pytest.fail)
    try:
        if holder == "unreadable":
            monkeypatch.setattr(Path, "read_bytes", raising(FileNotFoundError(str(tmp_path / LOCK_NAME))))
        else:
            (tmp_path / LOCK_NAME).write_bytes(os.fsencode(holder + "\n" if holder else ""))
        with pytest.raises(ValueError) as refused:
            RunLock(tmp_path).acquire(say=pytest.fail)
        pid = {"": "?", "unreadable": "?", "\udcff42": "\ufffd42"}.get(holder, holder)
        assert str(refused.value) == (f"train.out_dir: {str(tmp_path)!r} is in use by another `lm train` (pid {pid}); "
                                      "wait for it to finish or choose another train.out_dir")
    finally:
        first.release()


def test_a_run_lock_left_by_a_dead_process_is_taken_over_saying_so_and_one_of_this_process_silently(tmp_path):
    """A lock file that no one holds: a killed run's is taken over with a line naming its pid; one
    holding this process's own pid (a release that could not remove the file, in a read-only folder)
    is taken again without that line: this process is running."""
    from lm.train.run_dir import LOCK_NAME, RunLock

    said = []
    (tmp_path / LOCK_NAME).write_bytes(b"\xff999999999\n")  # bytes that are not UTF-8 (no pid of lm's): U+FFFD
    lock = RunLock(tmp_path)
    lock.acquire(say=said.append)
    assert said == [f"took over the lock of {str(tmp_path)!r} from pid \ufffd999999999, which is no longer running"]
    assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n" and lock.held
    lock.release()
    (tmp_path / LOCK_NAME).write_text(f"{os.getpid()}\n")  # as a release that could not remove it leaves it
    again = RunLock(tmp_path)
    again.acquire(say=pytest.fail)
    again.release()


def test_a_run_lock_whose_file_is_gone_is_released_without_a_warning(tmp_path):
    """A mutation (the lock file's removal no longer missing_ok) survived: a lock file removed under
    the run (someone cleaning the folder) made the release warn "could not remove the lock": there
    is nothing to remove. The descriptor is closed all the same, and the folder can be locked again."""
    import warnings

    from lm.train.run_dir import LOCK_NAME, RunLock

    lock = RunLock(tmp_path)
    lock.acquire(say=pytest.fail)
    (tmp_path / LOCK_NAME).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lock.release()
    assert not lock.held and not (tmp_path / LOCK_NAME).exists()
    again = RunLock(tmp_path)
    again.acquire(say=pytest.fail)
    again.release()


def test_an_output_that_is_an_input_and_a_path_that_is_no_file_are_named_in_full(tmp_path):
    """check_not_input names an input reached by another spelling or a hard link as "the same file",
    the input itself as "itself"; check_readable_file names a folder given for a file."""
    from lm.io import check_not_input, check_readable_file

    src = tmp_path / "in.txt"
    src.write_text("text")
    os.link(src, tmp_path / "hard.txt")
    (tmp_path / "sub").mkdir()
    for out, which in ((src, " itself"), (tmp_path / "hard.txt", f" {str(src)!r} (the same file)"),
                       (tmp_path / "sub" / ".." / "in.txt", f" {str(src)!r} (the same file)")):
        with pytest.raises(ValueError) as e:
            check_not_input(out, [("--input", src)])
        assert str(e.value) == f"--out: {str(out)!r} is the input --input{which}; choose another output"
    with pytest.raises(ValueError) as e:
        check_readable_file(tmp_path, "--data")
    assert str(e.value) == f"--data: not a regular file: {str(tmp_path)!r}"


@pytest.mark.parametrize("builder", ["claim_dir", "replace_dir"])
def test_an_old_output_that_cannot_be_removed_does_not_fail_the_new_one(tmp_path, monkeypatch, builder):
    """--overwrite sets the old output aside, writes the new one, then removes the old copy. A copy
    that cannot be removed (a busy file on NFS, say) leaves the new output in place and the command
    succeeding: the copy stays set aside, where the next run names it."""
    from lm.io import replace_dir

    build = {"claim_dir": claim_dir, "replace_dir": replace_dir}[builder]
    out = tmp_path / "out"
    with build(out, command="lm test", files=FILES) as d:
        _write_partial(d)
    real_rmdir = os.rmdir

    def busy(path, *args, **kwargs):
        if os.fsdecode(path).endswith(".old"):  # the set-aside folder itself: its contents go
            raise OSError(16, "Device or resource busy", str(path))
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", busy)
    with build(out, command="lm test", overwrite=True, files=FILES) as d:
        _write_partial(d)
        (d / "report.json").write_text('{"new": 1}')
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    assert (out / "report.json").read_text() == '{"new": 1}' and read_marker(out)["complete"] is True
    assert len(list(tmp_path.glob(".out.*.old"))) == 1

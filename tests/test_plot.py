"""`lm plot`: legend names that tell runs apart, and --overwrite that replaces only a plot it wrote."""

import json
import os
from pathlib import Path

import matplotlib.figure
import matplotlib.image
import pytest

from lm.cli import main


def _run(folder: Path, loss: float = 4.0) -> Path:
    folder.mkdir(parents=True)
    records = [{"step": s, "split": "train", "loss": loss - s / 10, "time": float(s)} for s in range(1, 6)]
    records += [{"step": 5, "split": "val", "loss": loss - 0.3, "time": 5.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _cli(argv, capsys) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.fixture
def legend(monkeypatch) -> list[str]:
    """The labels of the lines of the step panel, as drawn when the PNG is written."""
    labels, savefig = [], matplotlib.figure.Figure.savefig

    def capture(fig, *args, **kwargs):
        labels.extend(line.get_label() for line in fig.axes[0].lines)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    return labels


def test_each_run_has_one_colour_and_the_axes_say_their_units(tmp_path, monkeypatch):
    """As drawn when the PNG is written: a run's train and val lines share its colour, in both panels,
    and no other run has it; both panels say what the loss is in; the time axis is in seconds up to
    120 s and in minutes past it (its x values divided by 60)."""
    import matplotlib.colors
    import matplotlib.pyplot as plt

    from lm.train.plot import plot_runs

    drawn, savefig = [], matplotlib.figure.Figure.savefig

    def capture(fig, *args, **kwargs):
        drawn.append([(ax.get_xlabel(), ax.get_ylabel(), [(line.get_label(), matplotlib.colors.to_hex(line.get_color()),
                                                           list(line.get_xdata())) for line in ax.lines])
                      for ax in fig.axes])
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", capture)
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", loss=5.0)

    def add_train_record(step, time):  # b's last train record, at the longest time
        with open(b / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "split": "train", "loss": 3.0, "time": time}) + "\n")

    before = plt.get_fignums()
    add_train_record(6, 120.0)
    plot_runs([a, b], tmp_path / "s.png")
    add_train_record(7, 120.5)
    plot_runs([a, b], tmp_path / "m.png")
    assert plt.get_fignums() == before  # each figure closed once written
    c0, c1 = (matplotlib.colors.to_hex(f"C{i}") for i in (0, 1))
    for (steps, times), unit, scale in zip(drawn, ("seconds", "minutes"), (1, 60)):
        assert steps[:2] == ("step", "loss (nats/token)")
        assert times[:2] == (f"training time ({unit})", "loss (nats/token)")
        assert [(label, color) for label, color, _ in steps[2]] == [("a train", c0), ("a val", c0), ("b train", c1),
                                                                    ("b val", c1)]
        assert [(label, color) for label, color, _ in times[2]] == [(label, color) for label, color, _ in steps[2]]
        assert times[2][0][2] == [t / scale for t in (1.0, 2.0, 3.0, 4.0, 5.0)]
    b_train_times = [times[2][2][2] for _, times in drawn]  # the time panel's third line: b train's x values
    assert b_train_times[0][-1] == 120.0 and b_train_times[1][-1] == 120.5 / 60


def test_runs_whose_folders_share_a_name_are_told_apart(tmp_path, capsys, legend):
    """Two demos (lm demo writes RUN/run) were both "run train" and "run val": four lines, two names."""
    a, b = _run(tmp_path / "demoA" / "run"), _run(tmp_path / "demoB" / "run", loss=5.0)
    c = _run(tmp_path / "other")
    rc, err = _cli(["plot", str(a), str(b), str(c), "--out", str(tmp_path / "p.png")], capsys)
    assert rc == 0, err
    assert legend == ["demoA/run train", "demoA/run val", "demoB/run train", "demoB/run val", "other train",
                      "other val"]


def test_plot_of_the_current_folder_is_named_after_it(tmp_path, capsys, legend, monkeypatch):
    """`lm plot .` labelled its lines " train" and " val" (the name of "." is "")."""
    run = _run(tmp_path / "my-run")
    monkeypatch.chdir(run)
    rc, err = _cli(["plot", "."], capsys)
    assert rc == 0, err
    assert legend == ["my-run train", "my-run val"]


def test_run_labels_grow_only_as_far_as_needed():
    from lm.train.plot import run_labels

    assert run_labels(["/x/a/run", "/y/a/run", "/x/b"]) == ["x/a/run", "y/a/run", "b"]
    assert run_labels(["/a/run", "/run"]) == ["a/run", "/run"]
    assert run_labels(["/a/run", "/a/run"]) == ["run", "run"]  # the same run twice: nothing to tell apart


def _matplotlib_figure(path: Path) -> None:
    fig = matplotlib.figure.Figure()
    fig.add_subplot().plot([1, 2, 3])
    fig.savefig(path)  # with matplotlib's own Software tag, as the plots of lm before the mark


@pytest.mark.parametrize("kind", ["matplotlib figure", "other PNG", "not a PNG"])
def test_overwrite_replaces_only_a_plot_that_lm_plot_wrote(tmp_path, capsys, kind):
    """--overwrite replaced any file that began with the PNG signature: a user's figure or screenshot
    given as --out was lost. Only a PNG marked Software='lm plot' is an earlier output now."""
    run = _run(tmp_path / "run")
    mine = tmp_path / "mine.png"
    if kind == "matplotlib figure":
        _matplotlib_figure(mine)
    elif kind == "other PNG":
        from PIL import Image

        Image.new("RGB", (8, 8), "red").save(mine)  # a screenshot, say: no Software tag at all
    else:
        mine.write_text("my notes")
    before = mine.read_bytes()
    rc, err = _cli(["plot", str(run), "--out", str(mine), "--overwrite"], capsys)
    assert rc == 2 and err == (f"lm plot: error: --out: {str(mine)!r} exists and is not a plot that lm plot wrote "
                               "(marked Software='lm plot' in its PNG metadata); refusing to replace it\n"), (rc, err)
    assert mine.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.png", "run"]  # no temporary file left


def test_a_plot_that_lm_plot_wrote_is_replaced_with_overwrite_only(tmp_path, capsys):
    run = _run(tmp_path / "run")
    assert _cli(["plot", str(run)], capsys)[0] == 0
    plot = run / "loss.png"
    rc, err = _cli(["plot", str(run)], capsys)
    assert rc == 2 and "exists; pass --overwrite to replace it" in err, err
    before = plot.read_bytes()
    _run(tmp_path / "other")
    assert _cli(["plot", str(run), str(tmp_path / "other"), "--out", str(plot), "--overwrite"], capsys)[0] == 0
    assert plot.read_bytes() != before

    from lm.train.plot import is_marked_plot

    assert is_marked_plot(plot)


def test_plot_runs_marks_its_png_for_every_caller(tmp_path):
    """lm demo and the notebooks call plot_runs: their loss.png is a plot that `lm plot --overwrite` redraws."""
    from lm.train.plot import is_marked_plot, plot_runs

    out = plot_runs([_run(tmp_path / "run")], tmp_path / "loss.png")
    assert is_marked_plot(out)
    assert matplotlib.image.imread(out).shape[:2] == (540, 1440)  # 12 x 4.5 inches at 120 dpi: the image is whole


def test_a_missing_run_dir_is_named_as_not_found(tmp_path, capsys):
    """It was "'runs/x' has no metrics.jsonl; is it a run directory of `lm train`?", naming no argument."""
    _run(tmp_path / "a")
    rc, err = _cli(["plot", str(tmp_path / "a"), str(tmp_path / "missing"), "--out", str(tmp_path / "p.png")], capsys)
    assert rc == 2 and err.strip() == f"lm plot: error: RUN_DIR: folder not found: {str(tmp_path / 'missing')!r}"
    assert not (tmp_path / "p.png").exists()


def test_a_path_that_is_not_a_run_folder_is_named_as_run_dir(tmp_path, capsys):
    """`lm plot RUN/config.toml` said "'RUN/config.toml' has no metrics.jsonl; is it a run directory
    of `lm train`?": no RUN_DIR, as its other errors have, and a file spoken of as a folder."""
    run = _run(tmp_path / "run")
    (run / "config.toml").write_text("")
    (tmp_path / "empty").mkdir()
    for path, message in ((run / "config.toml", "is not a folder; pass a run directory of `lm train`"),
                          (tmp_path / "empty", "has no metrics.jsonl; is it a run directory of `lm train`?")):
        rc, err = _cli(["plot", str(path), "--out", str(tmp_path / "p.png")], capsys)
        assert rc == 2 and err == f"lm plot: error: RUN_DIR: {str(path)!r} {message}\n", err
    assert not (tmp_path / "p.png").exists()


def test_a_label_smoothed_train_loss_says_so(tmp_path, capsys, legend):
    """An encoder–decoder logs its train loss with label smoothing and its val loss without: the
    legend read "run train" / "run val", as if the gap between them were the model's."""
    s2s = _run(tmp_path / "s2s")
    (s2s / "config.toml").write_text('[model]\narchitecture = "encoder_decoder"\nlabel_smoothing = 0.2\n')
    default = _run(tmp_path / "default")  # the default smoothing, 0.1, comes from Seq2SeqConfig
    (default / "config.toml").write_text('[model]\narchitecture = "encoder_decoder"\n')
    plain = _run(tmp_path / "plain")
    (plain / "config.toml").write_text('[model]\narchitecture = "encoder_decoder"\nlabel_smoothing = 0.0\n')
    lm = _run(tmp_path / "lm")
    (lm / "config.toml").write_text('[model]\nd_model = 64\n')
    assert _cli(["plot", str(s2s), str(default), str(plain), str(lm), "--out", str(tmp_path / "p.png")],
                capsys)[0] == 0
    assert legend == ["s2s train (label-smoothed, ε=0.2)", "s2s val", "default train (label-smoothed, ε=0.1)",
                      "default val", "plain train", "plain val", "lm train", "lm val"]


def test_a_line_that_is_not_utf8_is_skipped_like_any_damaged_line(tmp_path, capsys, legend):
    """One byte that is not UTF-8 stopped `lm plot` (and `lm train --resume`) with "'utf-8' codec can't
    decode byte 0xff ...", naming no file; the reader skips damaged lines."""
    run = _run(tmp_path / "run")
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe garbage\n{"step": 6, "split": "train", "loss": 3.3, "time": 6.0}\n')
    assert _cli(["plot", str(run), "--out", str(tmp_path / "p.png")], capsys)[0] == 0

    from lm.train.plot import loss_records

    assert [r["step"] for r in loss_records(run)["train"]] == [1, 2, 3, 4, 5, 6]


def test_a_run_folder_whose_name_is_not_utf8_is_plotted_with_the_byte_escaped(tmp_path, capsys, legend):
    """`lm plot $'r\\xff'` was a 90-line traceback from matplotlib, which cannot draw the lone
    surrogate Python holds for the byte (clifuzz9 #5); every other command takes such a name."""
    import os
    import subprocess
    import sys

    from lm.train.plot import plot_runs

    run = _run(Path(str(tmp_path) + "/r\udcff"))
    plot_runs([run], tmp_path / "p.png")
    assert legend == ["r\\xff train", "r\\xff val"]
    # under a strict UTF-8 locale's stdout too (this machine's C.UTF-8 writes such names as they are)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PYTHONIOENCODING": "utf-8:strict"}
    r = subprocess.run([sys.executable, "-m", "lm", "plot", os.fsencode(run), "--quiet"], capture_output=True,
                       env=env, timeout=120)
    assert (r.returncode, r.stderr) == (0, b"")  # its path printed as given, the byte itself
    assert r.stdout == os.fsencode(run / "loss.png") + b"\n" and (run / "loss.png").is_file()


def test_a_step_past_a_float_is_skipped_like_any_damaged_line(tmp_path, capsys, legend):
    """A hand-edited step of 10**400 (an integer JSON number past a float's range) was an
    OverflowError traceback (clifuzz9)."""
    run = _run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 1' + "0" * 400 + ', "split": "train", "loss": 3.3, "time": 6.0}\n')
    assert _cli(["plot", str(run), "--out", str(tmp_path / "p.png")], capsys)[0] == 0

    from lm.train.plot import loss_records

    assert [r["step"] for r in loss_records(run)["train"]] == [1, 2, 3, 4, 5]


def test_out_below_a_file_is_refused_naming_out(tmp_path, capsys):
    """It was "[Errno 17] File exists: 'afile'", naming no argument."""
    run = _run(tmp_path / "run")
    (tmp_path / "afile").write_text("mine")
    rc, err = _cli(["plot", str(run), "--out", str(tmp_path / "afile" / "sub" / "x.png")], capsys)
    assert rc == 2 and err == (f"lm plot: error: --out: {str(tmp_path / 'afile')!r} is a file, not a folder, so "
                               f"{str(tmp_path / 'afile' / 'sub' / 'x.png')!r} cannot be made\n"), err
    assert (tmp_path / "afile").read_text() == "mine"


def test_plot_runs_refuses_to_write_over_a_run_s_metrics(tmp_path):
    """lm plot refused it, but lm.train.plot_runs (notebook 03's) wrote the PNG over the run's
    metrics.jsonl, itself or through a link, and the run's log was gone."""
    from lm.train.plot import plot_runs

    run = _run(tmp_path / "run")
    metrics = run / "metrics.jsonl"
    before = metrics.read_bytes()
    link = tmp_path / "m.png"
    link.symlink_to(metrics)
    for out in (metrics, link):
        with pytest.raises(ValueError) as e:
            plot_runs([run], out)
        which = "itself" if out == metrics else f"{str(metrics)!r} (the same file)"
        assert str(e.value) == f"out: {str(out)!r} is the input run_dirs {which}; choose another output"
    assert metrics.read_bytes() == before


def test_plot_help_says_training_time(capsys):
    """The time axis is metrics.jsonl's `time`: training time, without evaluation, checkpoints,
    logging and compilation. The help said wall-clock time."""
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "against steps and training time (evaluation, checkpoints and compilation left out" in out
    assert "wall-clock" not in out


def test_label_smoothing_is_read_without_tomllib_as_on_python_3_10(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib (lm depends on tomli there): `lm plot` imported tomllib on its own
    and failed with ModuleNotFoundError on every run; it reads config.toml as the rest of lm does."""
    import sys

    import tomllib

    from lm.train.plot import train_label_smoothing

    run = _run(tmp_path / "s2s")
    (run / "config.toml").write_text('[model]\narchitecture = "encoder_decoder"\nlabel_smoothing = 0.2\n')
    monkeypatch.setitem(sys.modules, "tomli", tomllib)  # 3.10: the tomli package
    monkeypatch.setitem(sys.modules, "tomllib", None)  # 3.10: no tomllib in the standard library
    assert train_label_smoothing(run) == 0.2
    (run / "config.toml").write_bytes(b'[model]\narchitecture = "encoder_decoder\xff"\n')  # not UTF-8: unknown
    assert train_label_smoothing(run) == 0.0


def test_an_empty_out_is_refused_not_taken_for_the_default(tmp_path, capsys):
    """`lm plot RUN --out ''` wrote RUN/loss.png, rc 0: '' was taken for "not given" (clifuzz7 #7)."""
    run = _run(tmp_path / "run")
    rc, err = _cli(["plot", str(run), "--out", "", "--quiet"], capsys)
    assert (rc, err.strip()) == (2, "lm plot: error: --out: must not be empty; omit --out for the default, "
                                    "RUN_DIR/loss.png")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_an_out_that_cannot_be_written_is_one_line_naming_out(tmp_path, capsys, monkeypatch):
    """`--out /proc/x.png` said "[Errno 2] No such file or directory: '/proc/x.png'", a 300-character
    name "[Errno 36] File name too long", naming no option (clifuzz7 #8); a symlink loop in its
    folder was a RuntimeError traceback (clifuzz7 #2)."""
    import os

    run = _run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    os.symlink("loop2", "loop1")
    os.symlink("loop1", "loop2")
    long = "x" * 300 + ".png"
    cases = [(long, f"--out: {long!r} cannot be written: File name too long"),
             ("loop1/x.png", "--out: 'loop1/x.png' lies below 'loop1', a symlink loop")]
    if os.path.isdir("/proc/self"):
        cases.append(("/proc/x.png", "--out: '/proc/x.png' cannot be written: No such file or directory"))
    for out, message in cases:
        rc, err = _cli(["plot", str(run), "--out", out, "--quiet"], capsys)
        assert (rc, err.strip()) == (2, f"lm plot: error: {message}")
    assert sorted(os.listdir(tmp_path)) == ["loop1", "loop2", "run"]


def test_plot_refuses_an_out_that_is_not_a_png_and_writes_nothing(tmp_path, capsys):
    """A mutation (the .png check dropped): a PNG was written under any name (plot.txt)."""
    run = _run(tmp_path / "run")
    assert main(["plot", str(run), "--out", str(tmp_path / "plot.txt"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"lm plot: error: --out: {str(tmp_path / 'plot.txt')!r} must end in .png\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_plot_refuses_an_out_that_is_a_runs_metrics_under_another_name(tmp_path, capsys):
    """A mutation (the inputs checked under another name) survived: a .png that is a link to a run's
    metrics.jsonl was still refused, as a file lm plot did not write; the line now said nothing of
    the run it would have destroyed. Refused as the input, with --overwrite too, and left whole."""
    run = _run(tmp_path / "run")
    before = (run / "metrics.jsonl").read_bytes()
    os.link(run / "metrics.jsonl", tmp_path / "hard.png")
    os.symlink(run / "metrics.jsonl", tmp_path / "soft.png")
    for name in ("hard.png", "soft.png"):
        out = str(tmp_path / name)
        assert main(["plot", str(run), "--out", out, "--overwrite", "--quiet"]) == 2
        assert capsys.readouterr().err == (f"lm plot: error: --out: {out!r} is the input RUN_DIR "
                                           f"{str(run / 'metrics.jsonl')!r} (the same file); choose another output\n")
    assert (run / "metrics.jsonl").read_bytes() == before


def test_plot_without_out_writes_into_the_run_or_for_several_runs_here(tmp_path, capsys, monkeypatch):
    """The default --out: RUN_DIR/loss.png for one run, ./loss.png for several (a mutation of the
    latter survived: only a subprocess test plotted several runs without --out). The path is printed."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", loss=3.0)
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "a", "--quiet"]) == 0
    assert capsys.readouterr() == (str(Path("a") / "loss.png") + "\n", "")
    assert main(["plot", "a", "b", "--quiet"]) == 0
    assert capsys.readouterr() == ("loss.png\n", "")
    assert (a / "loss.png").is_file() and (tmp_path / "loss.png").is_file() and not (b / "loss.png").exists()


def test_plot_of_an_empty_run_dir_is_refused_inside_a_run_folder(tmp_path, capsys, monkeypatch):
    """A mutation (check_not_empty of RUN_DIR dropped): `lm plot "$RUN"` with RUN unset, from inside
    a run folder, plotted the working folder into ./loss.png."""
    run = _run(tmp_path / "run")
    monkeypatch.chdir(run)
    assert main(["plot", "", "--quiet"]) == 2
    assert capsys.readouterr().err == "lm plot: error: RUN_DIR: must not be empty\n"
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]

"""The notebooks run top to bottom on tiny settings (LM_NOTEBOOK_TINY=1), and write only into a work
folder they made (notebooks/nbsetup.py)."""

import base64
import importlib.util
import io
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


@pytest.fixture
def nbsetup(monkeypatch):
    """notebooks/nbsetup.py, freshly imported (it is no package: the notebooks import it from their folder)."""
    monkeypatch.delenv("LM_NOTEBOOK_DIR", raising=False)
    spec = importlib.util.spec_from_file_location("nbsetup", NOTEBOOK_DIR / "nbsetup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_work_dir_makes_and_marks_its_folder(nbsetup, tmp_path, monkeypatch):
    monkeypatch.setenv("LM_NOTEBOOK_DIR", str(tmp_path / "new" / "work"))
    d = nbsetup.work_dir("translate")
    assert d == tmp_path / "new" / "work" / "translate" and d.is_dir()
    assert (tmp_path / "new" / "work" / nbsetup.MARKER).is_file()
    (d / "train.en").write_text("a notebook's file\n")
    assert nbsetup.work_dir() == tmp_path / "new" / "work"  # its own folder, with files in it: fine
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("LM_NOTEBOOK_DIR", str(empty))
    assert nbsetup.work_dir() == empty and (empty / nbsetup.MARKER).is_file()  # an empty folder: taken and marked


@pytest.mark.parametrize("what", ["folder", "file"])
def test_work_dir_refuses_a_folder_it_did_not_make(nbsetup, tmp_path, monkeypatch, what):
    """LM_NOTEBOOK_DIR may point anywhere: at a folder of the user's files, the notebooks would overwrite
    corpus.txt and delete run3/ (audit nbplot, defect 9). One line naming the variable and the path."""
    user = tmp_path / "userdir"
    if what == "folder":
        user.mkdir()
        (user / "corpus.txt").write_text("my precious corpus\n")
    else:
        user.write_text("a file\n")
    monkeypatch.setenv("LM_NOTEBOOK_DIR", str(user))
    with pytest.raises(nbsetup.WorkDirError) as e:
        nbsetup.work_dir()
    message = str(e.value)
    assert "\n" not in message and "LM_NOTEBOOK_DIR" in message and str(user) in message
    if what == "folder":
        assert sorted(p.name for p in user.iterdir()) == ["corpus.txt"]  # nothing written, not even the marker
        assert (user / "corpus.txt").read_text() == "my precious corpus\n"
        with pytest.raises(nbsetup.WorkDirError, match="LM_NOTEBOOK_DIR"):
            nbsetup.work_dir("translate")
        assert not (user / "translate").exists()


def test_work_dir_default_folder_is_refused_without_the_marker(nbsetup, tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where the notebooks run: the default is ../runs/notebooks
    (tmp_path / "runs" / "notebooks").mkdir(parents=True)
    (tmp_path / "runs" / "notebooks" / "notes.txt").write_text("mine\n")
    with pytest.raises(nbsetup.WorkDirError, match=r"LM_NOTEBOOK_DIR is not set.*runs/notebooks"):
        nbsetup.work_dir()


def test_fresh_run_dir_deletes_only_a_run_inside_the_marked_folder(nbsetup, tmp_path, monkeypatch):
    monkeypatch.setenv("LM_NOTEBOOK_DIR", str(tmp_path / "work"))
    work = nbsetup.work_dir()
    run = work / "run3"
    assert nbsetup.fresh_run_dir(run) == run and not run.exists()  # nothing there yet: nothing to do
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("[model]\n")
    (run / "metrics.jsonl").write_text("")
    nbsetup.fresh_run_dir(run)
    assert not run.exists()
    run.mkdir()
    (run / ".lock").write_text("123\n")  # a run killed before it wrote anything: left to the trainer
    nbsetup.fresh_run_dir(run)
    assert (run / ".lock").exists()
    (run / "notes.txt").write_text("not a run\n")
    with pytest.raises(nbsetup.WorkDirError, match="not a run of `lm train`"):
        nbsetup.fresh_run_dir(run)
    assert (run / "notes.txt").exists()
    outside = tmp_path / "elsewhere" / "run3"  # a run, but not in a folder the notebooks made
    outside.mkdir(parents=True)
    (outside / "config.toml").write_text("[model]\n")
    with pytest.raises(nbsetup.WorkDirError, match="not inside a work folder"):
        nbsetup.fresh_run_dir(outside)
    assert (outside / "config.toml").exists()


def test_four_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_tokenizer.ipynb", "02_model.ipynb", "03_train_and_sample.ipynb",
                                          "04_translation.ipynb"]


def _check_figures(nb, name):
    """Every cell that draws (``plt.``, ``display(Image``) shows a PNG that is not one flat colour: with
    the inline backend a figure is drawn when shown, so a drawing error or an empty figure fails here."""
    plt_image = pytest.importorskip("matplotlib.image")
    drawing = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
               and ("plt." in c.source or "display(Image" in c.source)]
    assert drawing, f"{name}: no cell draws a figure"
    for i in drawing:
        pngs = [o.data["image/png"] for o in nb.cells[i].get("outputs", [])
                if o.output_type == "display_data" and "image/png" in o.get("data", {})]
        assert pngs, f"{name}, cell {i}: no figure shown"
        for png in pngs:
            pixels = plt_image.imread(io.BytesIO(base64.b64decode(png)), format="png")
            assert pixels.reshape(-1, pixels.shape[-1]).std(axis=0).max() > 0, f"{name}, cell {i}: a blank figure"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    """Top to bottom, and then again in the same work folder, as "Restart & Run All" does (notebook 03
    once refused its second run: its first run's folder already held a run). A notebook whose first
    run leaves nothing in its folder but work_dir()'s mark (02) would find only that mark in a second
    run, as the other notebooks' second runs do among their files, so its second run is left out (14 s).
    With the inline backend that Jupyter uses: under Agg, plt.show drew nothing, and a figure that
    fails to draw passed."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("matplotlib_inline")
    monkeypatch.setenv("LM_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("LM_NOTEBOOK_DIR", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for _ in range(2):
        nb = nbformat.read(path, as_version=4)
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.output_type == "error"]
        # an error while drawing a shown figure is an output, not a failed cell: nbclient goes on
        assert not errors, f"{errors[0].ename}: {errors[0].evalue.strip()}" if errors else None
        _check_figures(nb, path.stem)
        if [p.name for p in tmp_path.rglob("*")] == [".lm-notebooks"]:
            break  # nothing written but the mark: a second run would meet nothing of this one's
    assert (tmp_path / ".lm-notebooks").is_file()  # work_dir() marked the folder it was given (empty)
    assert not [p for p in tmp_path.rglob("*.tmp")]  # every file renamed into place (cross_attention.png)

"""The notebooks run top to bottom on tiny settings (LM_NOTEBOOK_TINY=1)."""

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_four_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_tokenizer.ipynb", "02_model.ipynb", "03_train_and_sample.ipynb",
                                          "04_translation.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    """Top to bottom, and then again in the same work folder, as "Restart & Run All" does (notebook 03
    once refused its second run: its first run's folder already held a run)."""
    monkeypatch.setenv("LM_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("LM_NOTEBOOK_DIR", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    for _ in range(2):
        nb = nbformat.read(path, as_version=4)
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.output_type == "error"]
        assert not errors, errors[0]["evalue"] if errors else None

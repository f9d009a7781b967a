"""What every notebook's first cell needs: the size of the run and its work folder.

CI runs every notebook top to bottom with ``LM_NOTEBOOK_TINY=1`` (the same steps, smaller sizes)
and ``LM_NOTEBOOK_DIR`` set to a temporary folder (``tests/test_notebooks.py``).

The notebooks overwrite their files in the work folder and delete their earlier runs there, so
:func:`work_dir` writes only into a folder the notebooks made: it marks a folder it makes (or finds
empty) with the file :data:`MARKER`, and refuses a non-empty folder without it (``LM_NOTEBOOK_DIR``
may point anywhere, at a folder of the user's own files too).
"""

import os
import shutil
from pathlib import Path

TINY = os.environ.get("LM_NOTEBOOK_TINY") == "1"
MARKER = ".lm-notebooks"  # in the work folder: the notebooks made it, so they may overwrite what is in it
DEFAULT_DIR = "../runs/notebooks"


class WorkDirError(RuntimeError):
    """The work folder is not one the notebooks may write into (one line: the variable, the path, what to do)."""


def _base() -> Path:
    """The work folder: ``LM_NOTEBOOK_DIR``, else ``../runs/notebooks``, made and marked if missing or empty."""
    base = Path(os.environ.get("LM_NOTEBOOK_DIR") or DEFAULT_DIR)
    where = (f"LM_NOTEBOOK_DIR={os.environ['LM_NOTEBOOK_DIR']!r}" if os.environ.get("LM_NOTEBOOK_DIR")
             else "the default work folder (LM_NOTEBOOK_DIR is not set)")
    if base.exists() and not base.is_dir():
        raise WorkDirError(f"{where}: {str(base)!r} is not a folder; set LM_NOTEBOOK_DIR to a new or empty folder")
    if (base / MARKER).is_file():
        return base
    if base.is_dir() and any(base.iterdir()):
        raise WorkDirError(
            f"{where}: {str(base)!r} is not empty and has no {MARKER} marker, so the notebooks did not make it and "
            "will not overwrite files in it; set LM_NOTEBOOK_DIR to a new or empty folder (or, if it is the "
            f"notebooks' own folder from an older version, create an empty file {MARKER} in it)")
    base.mkdir(parents=True, exist_ok=True)
    (base / MARKER).write_text("made by lm's notebooks (notebooks/nbsetup.py): they overwrite the files in this "
                               "folder and delete the runs they trained here\n", encoding="utf-8")
    return base


def work_dir(sub: str = "") -> Path:
    """The folder a notebook writes to (made if missing): ``LM_NOTEBOOK_DIR``, else ``../runs/notebooks``,
    or its subfolder ``sub``. A non-empty folder without the notebooks' marker is refused (WorkDirError)."""
    d = _base() / sub
    d.mkdir(parents=True, exist_ok=True)
    print("tiny settings" if TINY else "full settings", "| work dir:", d)
    return d


RUN_FILES = ("config.toml", "metrics.jsonl", "checkpoints")  # what `lm train` writes first into its run folder


def fresh_run_dir(run_dir: Path) -> Path:
    """Delete the run that an earlier execution of the notebook left in ``run_dir``, so that it trains anew.

    Only a folder inside the marked work folder (see :func:`work_dir`: the notebooks made it, so
    nothing in it is the user's) that holds a run of ``lm train`` (its config.toml, metrics.jsonl or
    checkpoints/) is deleted; a missing or empty folder is left for the trainer, and anything else is
    refused (WorkDirError) rather than deleted.
    """
    run_dir = Path(run_dir)
    if not any((p / MARKER).is_file() for p in run_dir.resolve().parents):
        raise WorkDirError(f"{str(run_dir)!r} is not inside a work folder of the notebooks (no {MARKER} above it); "
                           "refusing to delete it")
    if not run_dir.exists():
        return run_dir
    if run_dir.is_dir() and not run_dir.is_symlink():
        entries = {p.name for p in run_dir.iterdir()}
        if entries & set(RUN_FILES):
            shutil.rmtree(run_dir)
            return run_dir
        if entries <= {".lock"}:  # empty, or a lock alone (a run killed before it wrote anything): the trainer takes it
            return run_dir
    raise WorkDirError(f"{str(run_dir)!r} exists and is not a run of `lm train` (no config.toml, metrics.jsonl or "
                       "checkpoints/); refusing to delete it: move it away")

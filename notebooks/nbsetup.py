"""What every notebook's first cell needs: the size of the run and its work folder.

CI runs every notebook top to bottom with ``LM_NOTEBOOK_TINY=1`` (the same steps, smaller sizes)
and ``LM_NOTEBOOK_DIR`` set to a temporary folder (``tests/test_notebooks.py``).
"""

import os
from pathlib import Path

TINY = os.environ.get("LM_NOTEBOOK_TINY") == "1"


def work_dir(sub: str = "") -> Path:
    """The folder a notebook writes to (made if missing): ``LM_NOTEBOOK_DIR``, else ``../runs/notebooks``."""
    d = Path(os.environ.get("LM_NOTEBOOK_DIR", "../runs/notebooks")) / sub
    d.mkdir(parents=True, exist_ok=True)
    print("tiny settings" if TINY else "full settings", "| work dir:", d)
    return d

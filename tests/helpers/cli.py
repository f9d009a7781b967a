"""Running ``lm`` commands one after another in one fresh interpreter, to see which of them import torch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def main_in_one_interpreter(argvs: Sequence[Sequence[str]], cwd: Path | None = None,
                            timeout: float = 120) -> tuple[list[str], list[str]]:
    """``lm.cli.main(argv)`` for each of ``argvs`` in turn, in one new Python process (one torch import
    at most, not one per case): stdout's lines, ``"{status} {torch imported by then}"`` for each call
    (``"2 False"``: refused before torch), and stderr's lines, the commands' messages."""
    code = ("import json, sys\nfrom lm.cli import main\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    print(main(args), 'torch' in sys.modules, flush=True)")
    p = subprocess.run([sys.executable, "-c", code, json.dumps([list(a) for a in argvs])], cwd=cwd,
                       capture_output=True, text=True, timeout=timeout)
    return p.stdout.splitlines(), p.stderr.splitlines()

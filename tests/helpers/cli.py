"""Running ``lm`` commands one after another in one fresh interpreter, to see which modules they import."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_MARK = "main returned: "


def main_in_one_interpreter(argvs: Sequence[Sequence[str]], cwd: Path | None = None, timeout: float = 120,
                            module: str = "torch") -> tuple[list[str], list[str]]:
    """``lm.cli.main(argv)`` for each of ``argvs`` in turn, in one new Python process (one torch import
    at most, not one per case): ``"{status} {module imported by then}"`` for each call (``"2 False"``:
    refused before torch), and stderr's lines, the commands' messages."""
    code = ("import json, sys\nfrom lm.cli import main\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    status = main(args)\n"
            f"    print({_MARK!r} + str(status), sys.argv[2] in sys.modules, flush=True)")
    p = subprocess.run([sys.executable, "-c", code, json.dumps([list(a) for a in argvs]), module], cwd=cwd,
                       capture_output=True, text=True, timeout=timeout)
    return [line[len(_MARK):] for line in p.stdout.splitlines() if line.startswith(_MARK)], p.stderr.splitlines()

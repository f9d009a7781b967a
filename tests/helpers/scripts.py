"""Running a script of scripts/ in the test's process, for the tests of its argument checks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """``scripts/NAME`` loaded as a module, not run (its ``if __name__ == "__main__"`` part is not)."""
    spec = importlib.util.spec_from_file_location(Path(name).stem + "_script", REPO / "scripts" / name)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def run_script(monkeypatch, name: str, *argv) -> int | str | None:
    """``scripts/NAME``'s main() on ``argv``; its exit status (a message, for sys.exit(str))."""
    script = load_script(name)
    monkeypatch.setattr(sys, "argv", [name, *map(str, argv)])
    try:
        return script.main()
    except SystemExit as e:
        return e.code


def forbid_training(monkeypatch) -> None:
    """Make the tokenizer (the first thing the scripts train) fail the test if it is reached."""
    import lm.tokenizer

    def trained(*args, **kwargs):
        raise AssertionError("the script started training before refusing the setting")

    monkeypatch.setattr(lm.tokenizer, "train_bpe", trained)


def error_line(capsys, name: str) -> str:
    """The one ``NAME: error:`` line on stderr."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"{name}: error:")]
    assert len(lines) == 1, lines
    return lines[0]

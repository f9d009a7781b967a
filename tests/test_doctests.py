"""The examples in the package's docstrings (``>>> ...``) run and print what they show.

They are documentation people copy from (a size in GiB, a line split, a schedule's values); a
docstring example that drifted from the code would teach the wrong thing, so each module that
holds one is run through :mod:`doctest` here."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import lm

PACKAGE = Path(lm.__file__).parent


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>> " in path.read_text(encoding="utf-8"):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_package_has_examples_to_run():
    # the discovery itself: a broken glob would make every case below vanish, not fail
    assert len(MODULES) >= 15 and "lm.cli.common" in MODULES and "lm.tokenizer.pretokenize" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True, verbose=False)
    assert result.attempted > 0, f"{name}: no example found, though its source holds '>>> '"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed (above)"

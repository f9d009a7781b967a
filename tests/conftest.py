import os
from pathlib import Path

import pytest


def _test_data_dir() -> Path | None:
    d = os.environ.get("LM_TEST_DATA")
    return Path(d) if d and Path(d).is_dir() else None


@pytest.fixture
def test_data() -> Path:
    """The shared real-text folder (GPT-2 vocab/merges, Gutenberg, TinyStories...); skips when unset."""
    d = _test_data_dir()
    if d is None:
        pytest.skip("LM_TEST_DATA is not set to a folder of reference data")
    return d


def data_file(name: str) -> Path:
    """A file from LM_TEST_DATA, or skip the calling test."""
    d = _test_data_dir()
    if d is None or not (d / name).exists():
        pytest.skip(f"LM_TEST_DATA/{name} not available")
    return d / name

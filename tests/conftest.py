"""The shared fixtures; the helpers live in the tests/helpers package."""

from pathlib import Path

import pytest
from helpers.data import _test_data_dir


@pytest.fixture
def test_data() -> Path:
    """The shared real-text folder (GPT-2 vocab/merges, Gutenberg, TinyStories...); skips when unset."""
    d = _test_data_dir()
    if d is None:
        pytest.skip("LM_TEST_DATA is not set to a folder of reference data")
    return d

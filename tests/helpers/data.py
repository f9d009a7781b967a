"""Reference data from LM_TEST_DATA for the parity tests, and GPT-2's published pattern."""

import os
from pathlib import Path

import pytest


def _test_data_dir() -> Path | None:
    """LM_TEST_DATA's folder; None when it is unset. Set to something that is not a folder, it is an
    error rather than a skip: a typo must not quietly turn the parity tests off."""
    d = os.environ.get("LM_TEST_DATA")
    if not d:
        return None
    if not Path(d).is_dir():
        pytest.fail(f"LM_TEST_DATA={d!r} is not a folder", pytrace=False)
    return Path(d)


def data_file(name: str) -> Path:
    """A file from LM_TEST_DATA: skips the calling test when LM_TEST_DATA is unset, fails when it is
    set and the file is missing (an incomplete data folder would otherwise hide the parity tests)."""
    d = _test_data_dir()
    if d is None:
        pytest.skip(f"LM_TEST_DATA is not set (the test needs {name})")
    if not (d / name).exists():
        pytest.fail(f"LM_TEST_DATA/{name} is missing (LM_TEST_DATA={str(d)!r})", pytrace=False)
    return d / name


# GPT-2's pre-tokenization pattern as published in openai/gpt-2, src/encoder.py (copied verbatim).
GPT2_ENCODER_PY_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_published_pattern() -> str:
    """The reference for lm's ``GPT2_PATTERN``, never lm's own constant: tiktoken's published GPT-2
    pattern (``r50k_pat_str``, the one its "gpt2" encoding uses; it ships with tiktoken, no download),
    or, without tiktoken, the pattern of GPT-2's encoder.py above."""
    try:
        from tiktoken_ext.openai_public import r50k_pat_str
    except ImportError:
        return GPT2_ENCODER_PY_PATTERN
    return r50k_pat_str

"""lm.tomlio: TOML written by hand (configs hold scalars only), checked against the standard library's
``tomllib``, the parser that reads it back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lm.tomlio import dump_table, dump_tables, toml_string, toml_value

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _read_back(text: str) -> str:
    return tomllib.loads(f"k = {toml_string(text)}")["k"]


@pytest.mark.parametrize("text", [
    "", "plain ascii", 'a "quoted" \\ path', "\b\t\n\f\r", "\x00\x01\x1f\x7f", "é 中文 \u2028 \ufeff \uffff",
    "😀 \U0010ffff", "\U00010000", "C:\\runs\\tiny",  # the first character past the BMP (mutation: `<= 65536`)
])
def test_a_string_reads_back_as_itself_and_is_written_in_ascii(text):
    """Every character TOML can hold: the short escapes, control characters and DEL as ``\\uXXXX``,
    the BMP as ``\\uXXXX`` and the astral planes as ``\\UXXXXXXXX`` (mutation: the ``\\u`` escapes
    written as None, survived: no test wrote a control or non-ASCII character through it)."""
    written = toml_string(text)
    assert written.isascii() and _read_back(text) == text, written


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",))))
def test_any_string_without_surrogates_reads_back_as_itself(text):
    assert _read_back(text) == text


@pytest.mark.parametrize("code, what", [
    (0xDC80, "the byte 0x80 of a name that is not UTF-8"),
    (0xDCFF, "the byte 0xFF of a name that is not UTF-8"),  # the last byte os.fsdecode escapes
    (0xDD00, "U+DD00, half of a surrogate pair"),  # one past them (mutation: `< 0xDCFF`, `<= 0xDD00` survived)
    (0xDC7F, "U+DC7F, half of a surrogate pair"),
    (0xD800, "U+D800, half of a surrogate pair"),
    (0xDFFF, "U+DFFF, half of a surrogate pair"),
])
def test_a_lone_surrogate_is_refused_saying_what_it_is(code, what):
    text = f"runs/{chr(code)}"
    with pytest.raises(ValueError) as refused:
        toml_string(text)
    assert str(refused.value) == f"{text!r} holds {what}, which a TOML file cannot hold; use a name in UTF-8"


def test_scalars_are_written_as_toml_reads_them_and_anything_else_is_refused():
    """numpy and 0-d torch scalars as their Python value; a list, None or a dict is no scalar, and the
    error says so (mutation: ``getattr(value, "item")`` without its default, survived: a list then
    raised AttributeError, a traceback)."""
    values = {"a": True, "b": 3, "c": 0.1, "d": np.float64(1e-3), "e": np.int64(7), "f": np.bool_(False),
              "g": torch.tensor(2.5), "h": "x", "i": 1e300, "j": -0.0}
    read = tomllib.loads(dump_table(values))
    assert read == {"a": True, "b": 3, "c": 0.1, "d": 1e-3, "e": 7, "f": False, "g": 2.5, "h": "x", "i": 1e300,
                    "j": -0.0}
    assert [type(read[k]) for k in "abcdefg"] == [bool, int, float, float, int, bool, float]
    for bad in ([1, 2], {"x": 1}, object):
        with pytest.raises(ValueError) as refused:
            toml_value(bad)
        assert str(refused.value) == f"{bad!r} is not a TOML scalar (a string, number or boolean)"


def test_tables_name_the_key_of_a_value_they_cannot_hold_and_comment_out_unset_ones():
    text = dump_tables({"model": {"d_model": 64, "norm": None}, "data": {"train": "t.bin"}})
    assert text == '[model]\nd_model = 64\n# norm = (unset)\n\n[data]\ntrain = "t.bin"\n\n'
    assert tomllib.loads(text) == {"model": {"d_model": 64}, "data": {"train": "t.bin"}}
    with pytest.raises(ValueError, match=r"^data\.train: \[1\] is not a TOML scalar"):
        dump_tables({"data": {"train": [1]}})
    with pytest.raises(ValueError, match=r"^out: 'runs/\\udcff' holds the byte 0xFF"):
        dump_table({"out": "runs/\udcff"})

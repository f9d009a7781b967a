"""TOML for configs: written here (every value is a scalar, so no TOML library is needed to write),
read with the standard library's ``tomllib``."""

from __future__ import annotations

import numbers
from typing import Any

_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string, in ASCII (as JSON's escapes wrote it, so the file reads the
    same in any encoding): ``\\uXXXX`` up to U+FFFF, ``\\UXXXXXXXX`` above, where JSON's surrogate
    pairs are not TOML. A lone surrogate (what ``os.fsdecode`` makes of a file-name byte that is not
    UTF-8) is no character at all, so TOML cannot hold it: a ValueError says so."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            what = (f"the byte 0x{code - 0xDC00:02X} of a name that is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                    else f"U+{code:04X}, half of a surrogate pair")
            raise ValueError(f"{text!r} holds {what}, which a TOML file cannot hold; use a name in UTF-8")
        else:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """A scalar as TOML: booleans lower-case, strings quoted (:func:`toml_string`), numbers as
    Python writes them (a numpy scalar or other number type as its Python int or float)."""
    if not isinstance(value, (bool, int, float, str)) and callable(getattr(value, "item", None)):
        value = value.item()  # a numpy scalar (np.float64 is a float, but its repr is np.float64(...))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, numbers.Integral):
        return repr(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    raise ValueError(f"{value!r} is not a TOML scalar (a string, number or boolean)")


def dump_table(values: dict[str, Any], section: str = "") -> str:
    """``key = value`` lines; a None value (an unset option) becomes a comment. A value TOML cannot
    hold is a ValueError naming its key (``section.key``)."""
    lines = []
    for k, v in values.items():
        if v is None:
            lines.append(f"# {k} = (unset)\n")
            continue
        try:
            lines.append(f"{k} = {toml_value(v)}\n")
        except ValueError as e:
            raise ValueError(f"{section}.{k}: {e}" if section else f"{k}: {e}") from None
    return "".join(lines)


def dump_tables(sections: dict[str, dict[str, Any]]) -> str:
    """``[section]`` tables of ``key = value`` lines, a blank line after each."""
    return "".join(f"[{name}]\n{dump_table(values, name)}\n" for name, values in sections.items())


def loads(text: str) -> dict[str, Any]:
    """A TOML document as a dict (``tomllib``, or ``tomli`` on Python 3.10, imported here only); a
    syntax error is ``TOMLDecodeError``, a ValueError."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)

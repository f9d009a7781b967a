"""TOML for configs: written here (every value is a scalar, so no TOML library is needed to write),
read with the standard library's ``tomllib``."""

from __future__ import annotations

import json
from typing import Any


def toml_value(value: Any) -> str:
    """A scalar as TOML: booleans lower-case, strings quoted (JSON's escapes are TOML's), numbers as repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def dump_table(values: dict[str, Any]) -> str:
    """``key = value`` lines; a None value (an unset option) becomes a comment."""
    return "".join(f"# {k} = (unset)\n" if v is None else f"{k} = {toml_value(v)}\n" for k, v in values.items())


def dump_tables(sections: dict[str, dict[str, Any]]) -> str:
    """``[section]`` tables of ``key = value`` lines, a blank line after each."""
    return "".join(f"[{name}]\n{dump_table(values)}\n" for name, values in sections.items())


def loads(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)

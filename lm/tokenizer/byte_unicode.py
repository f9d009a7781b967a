"""GPT-2's reversible mapping between bytes and printable unicode characters.

GPT-2 stores byte-level tokens as strings in ``encoder.json``/``vocab.bpe``; every byte is
mapped to a printable character so that whitespace and control bytes survive JSON and
line-based files. Printable Latin-1 bytes map to themselves; the other 68 bytes map to
U+0100 onwards, in byte order.

>>> BYTE_TO_UNICODE[ord(" ")]
'Ġ'
>>> bytes_to_unicode_str(b" the")
'Ġthe'
"""

from __future__ import annotations


def _byte_to_unicode() -> dict[int, str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


BYTE_TO_UNICODE: dict[int, str] = _byte_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}


def bytes_to_unicode_str(token: bytes) -> str:
    """The GPT-2 string form of a byte-level token."""
    return "".join(BYTE_TO_UNICODE[b] for b in token)


def unicode_str_to_bytes(token: str) -> bytes:
    """Inverse of :func:`bytes_to_unicode_str`; raises ValueError on a character outside the mapping."""
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in token)
    except KeyError as e:
        raise ValueError(f"token {token!r}: character {e.args[0]!r} is not in the GPT-2 byte mapping") from None

"""The token file written by ``lm tokenize``: a flat array of ids and a JSON sidecar.

``X.bin`` holds the ids as little-endian ``uint16`` (vocabularies up to 65,536) or ``uint32``;
``X.bin.json`` beside it says what the ids are::

    {"format": "lm-tokens", "version": 1, "dtype": "uint16", "vocab_size": 10000,
     "num_tokens": 123456, "source_bytes": 567890, "tokenizer_sha256": "...", "source": "..."}

``source_bytes / num_tokens`` is the bytes-per-token ratio that turns a loss into bits per byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lm.checks import check_size, is_count
from lm.io import InterruptGuard, atomic_files, read_json_object, text_name

FORMAT = "lm-tokens"
VERSION = 1
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
VOCAB_SIZE_MAX = 1 << 32  # the largest vocabulary whose ids all fit the widest dtype, uint32
_SCAN_CHUNK = 1 << 22  # ids per read when scanning a file: 8-16 MB, whatever the file size


def sidecar_path(path: str | os.PathLike) -> Path:
    """``X.bin`` -> ``X.bin.json``; a path with no file name (``.``, ``/``) is a ValueError naming it,
    which no ``lm tokenize`` output can be (``Path.with_name`` said "PosixPath('.') has an empty name")."""
    path = Path(path)
    if not path.name:
        raise ValueError(f"{str(path)!r} is a folder, not a token or pair file")
    return path.with_name(path.name + ".json")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest id dtype of the format that holds ``vocab_size`` ids."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return TOKEN_DTYPES["uint16"] if vocab_size <= 1 << 16 else TOKEN_DTYPES["uint32"]


def check_vocab_size(vocab_size: Any) -> None:
    """A writer's ``vocab_size``: a positive integer whose ids fit ``uint32`` (a larger one had
    wrapped its ids: 2**32 + 7 stored as 7), not a float that the sidecar would record truncated."""
    check_size("vocab_size", vocab_size)
    if vocab_size > VOCAB_SIZE_MAX:
        raise ValueError(f"vocab_size must be at most 2**32 (ids are stored as uint32), got vocab_size={vocab_size!r}")


def check_count_arg(name: str, value: Any) -> int:
    """A writer's byte count (``source_bytes``...) as an int: a non-negative integer, as its reader
    requires (:func:`check_optional_fields`), or None for 0, "not known"."""
    if value is None:
        return 0
    if not is_count(value):
        raise ValueError(f"{name} must be a non-negative integer or None, got {name}={value!r}")
    return int(value)


def check_text_arg(name: str, value: Any) -> str:
    """A writer's ``tokenizer_sha256``: a str, or None for "" (not the text 'None')."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str or None, got {name}={value!r}")
    return value


def check_not_sidecar(path: str | os.PathLike, argument: str = "path") -> None:
    """Refuse an output ``path`` that is the sidecar of an existing token or pair file
    (``X.bin.json`` beside ``X.bin``): writing ids there had destroyed that file's sidecar."""
    path = Path(path)
    if not path.name.endswith(".json") or not path.is_file():
        return
    ids = path.with_name(path.name[: -len(".json")])
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if ids.is_file() and isinstance(meta, dict) and meta.get("format") in (FORMAT, "lm-pairs"):
        what = "token file" if meta["format"] == FORMAT else "pair file"
        raise ValueError(f"{argument}: {str(path)!r} is the sidecar of the {what} {str(ids)!r}; choose another output")


def check_ids(chunk: np.ndarray, vocab_size: int) -> np.ndarray:
    """``chunk`` as a 1-D integer array, every id in ``[0, vocab_size)``; else a ValueError naming the id."""
    chunk = np.asarray(chunk)
    if chunk.ndim != 1:
        chunk = chunk.reshape(-1)
    if chunk.size == 0:
        return chunk
    if not np.issubdtype(chunk.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {chunk.dtype}")
    lo, hi = int(chunk.min()), int(chunk.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return chunk


def _one_array(ids: Any) -> bool:
    """Whether ``ids`` is one array of ids rather than an iterable of arrays (see :func:`write_token_file`)."""
    if isinstance(ids, np.ndarray) or hasattr(ids, "__array__"):  # a torch tensor, a memmap, an array-like
        return True
    if isinstance(ids, range):
        return True
    return isinstance(ids, (list, tuple)) and len(ids) > 0 and isinstance(ids[0], (int, np.integer))


def _chunks(ids: Any) -> Iterator[Any]:
    """The arrays to write one after another: ``ids`` itself when it is one array; else its items,
    single ids among them gathered into blocks (one write per id had been 60x slower)."""
    if _one_array(ids):
        try:
            yield np.asarray(ids)
        except ValueError:  # np.asarray([1, np.array([2, 3])]): "inhomogeneous shape"
            raise ValueError("ids_array: a list holds either ids or arrays of ids, not both") from None
        return
    block: list = []
    for chunk in ids:
        if isinstance(chunk, (int, np.integer)):
            block.append(chunk)
            if len(block) >= _SCAN_CHUNK:
                yield np.array(block)
                block = []
            continue
        if block:
            yield np.array(block)
            block = []
        yield chunk
    if block:
        yield np.array(block)


def write_token_file(
    path: str | os.PathLike,
    ids_array: np.ndarray | Sequence[int] | Iterable[np.ndarray],
    *,
    vocab_size: int,
    source_bytes: int | None = 0,
    tokenizer_sha256: str | None = "",
    source: str = "",
) -> dict[str, Any]:
    """Write ids to ``path`` and the sidecar to ``path + '.json'``, both renamed into place only once
    both are complete (:func:`lm.io.atomic_files`); return the sidecar.

    ``ids_array`` is one integer array (a NumPy array, a torch tensor or anything else with
    ``__array__``, or a list, tuple or range of ints), or any other iterable of arrays (or lists),
    written one after another, so that a corpus larger than memory can be streamed; single ids
    in such a stream (``Tokenizer.encode_iterable``) are written in blocks. A list is one array
    when its first item is an int, and a list of chunks otherwise. The file is the same whichever
    form the ids come in. Every id must lie in ``[0, vocab_size)``; ``vocab_size`` is at most
    2**32 (ids are stored as ``uint32`` at most). ``source_bytes=None`` records 0 and
    ``tokenizer_sha256=None`` records "" (neither known). ``path`` may not be the sidecar of
    another token or pair file.

    >>> meta = write_token_file("/tmp/x.bin", np.array([1, 2, 3]), vocab_size=10)
    >>> meta["num_tokens"], meta["dtype"]
    (3, 'uint16')
    """
    path = Path(path)
    check_vocab_size(vocab_size)
    source_bytes = check_count_arg("source_bytes", source_bytes)
    tokenizer_sha256 = check_text_arg("tokenizer_sha256", tokenizer_sha256)
    check_not_sidecar(path)
    dtype = token_dtype(vocab_size)
    chunks = _chunks(ids_array)
    num_tokens = 0
    # Both files are written before either is renamed (a failure at the sidecar leaves the earlier
    # output whole), and a Ctrl-C once the ids are written waits for the renames. (The sidecar, opened
    # last, is renamed first: a crash between the two renames leaves the new sidecar beside the old ids,
    # or beside none, whose num_tokens readers find does not match, and which --overwrite replaces.)
    with InterruptGuard() as guard, atomic_files() as open_file:
        f = open_file(path, "wb")
        for chunk in chunks:
            chunk = check_ids(chunk, vocab_size)
            if chunk.size:
                f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                num_tokens += chunk.size
        guard.hold()
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "vocab_size": int(vocab_size),
            "num_tokens": int(num_tokens),
            "source_bytes": source_bytes,
            "tokenizer_sha256": tokenizer_sha256,
            "source": text_name(source),
        }
        f = open_file(sidecar_path(path), "w")
        json.dump(meta, f, indent=1)
        f.write("\n")
    return meta


def is_token_file(path: str | os.PathLike) -> bool:
    """``path`` has a sidecar of this format: it was written by :func:`write_token_file` (``lm tokenize``)."""
    try:
        meta = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def check_ids_file(path: Path, what: str) -> None:
    """A one-line ValueError when ``path`` (a ``what``) is a folder or missing: before its sidecar's
    name is made from it (``.`` and ``/`` have no name to add ``.json`` to)."""
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a folder, not a {what}")
    if not path.is_file():
        raise ValueError(f"{what} not found: {str(path)!r}")


def load_sidecar(path: Path, side: Path, what: str, writer: str) -> dict[str, Any]:
    """The JSON object in ``side``, the sidecar of ``path`` (a ``what`` that ``writer`` makes);
    a one-line ValueError when either file is missing or the sidecar is not a JSON object."""
    check_ids_file(path, what)
    if not side.is_file():
        raise ValueError(f"{str(path)!r} has no sidecar {side.name!r}; write {what}s with {writer}")
    return read_json_object(side, "sidecar")


def check_ids_sidecar(meta: dict[str, Any], side: Path, path: Path, counts: tuple[str, ...] = ("num_tokens",)) -> None:
    """What every ids file's sidecar must say of it (token files and pair files): a dtype, a vocab
    size the dtype can hold, non-negative ``counts``, and ``num_tokens`` ids of that dtype in ``path``."""
    for key, kind in (("dtype", str), ("vocab_size", int), *((c, int) for c in counts)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise ValueError(f"sidecar {str(side)!r}: {key!r} is missing or not "
                             f"{'a string' if kind is str else 'an integer'}")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise ValueError(f"sidecar {str(side)!r}: dtype {meta['dtype']!r} is not one of {sorted(TOKEN_DTYPES)}")
    if meta["vocab_size"] <= 0 or any(meta[c] < 0 for c in counts):
        raise ValueError(f"sidecar {str(side)!r}: vocab_size must be positive and {' and '.join(counts)} "
                         "must not be negative")
    expected = token_dtype(meta["vocab_size"]).name
    if meta["dtype"] != expected:
        raise ValueError(
            f"sidecar {str(side)!r}: dtype {meta['dtype']!r} does not match vocab_size "
            f"{meta['vocab_size']} (expected {expected!r})"
        )
    itemsize = TOKEN_DTYPES[meta["dtype"]].itemsize
    size = path.stat().st_size
    if size != meta["num_tokens"] * itemsize:
        raise ValueError(
            f"{str(path)!r} has {size} bytes but its sidecar says {meta['num_tokens']} {meta['dtype']} "
            f"ids ({meta['num_tokens'] * itemsize} bytes): the file is truncated or not the one "
            "the sidecar describes"
        )


def check_optional_fields(meta: dict[str, Any], side: Path, counts: tuple[str, ...], texts: tuple[str, ...]) -> None:
    """Fill in the optional fields of a sidecar (``counts`` 0, ``texts`` ""), and refuse one of the
    wrong type in one line: a string for ``source_bytes`` had passed the checks and then stopped
    ``lm train`` with a traceback in its bits-per-byte arithmetic."""
    for key in counts:
        value = meta.setdefault(key, 0)
        if not is_count(value):
            raise ValueError(f"sidecar {str(side)!r}: {key!r} must be a non-negative integer, got {value!r}")
    for key in texts:
        value = meta.setdefault(key, "")
        if not isinstance(value, str):
            raise ValueError(f"sidecar {str(side)!r}: {key!r} must be a string, got {value!r}")


def read_token_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check the sidecar of ``path`` against the file itself (dtype, size); return it."""
    path = Path(path)
    check_ids_file(path, "token file")
    side = sidecar_path(path)
    meta = load_sidecar(path, side, "token file", "`lm tokenize`")
    if meta.get("format") != FORMAT:
        what = (" (it is a translation pair file, for an encoder-decoder model; make a language model's token "
                "file with `lm tokenize`)" if meta.get("format") == "lm-pairs" else "")
        raise ValueError(f"sidecar {str(side)!r} is not an {FORMAT!r} sidecar{what}")
    if meta.get("version") != VERSION:
        raise ValueError(f"sidecar {str(side)!r} has version {meta.get('version')!r}; this lm reads {VERSION}")
    check_ids_sidecar(meta, side, path)
    check_optional_fields(meta, side, counts=("source_bytes",), texts=("tokenizer_sha256", "source"))
    return meta


def read_token_file(path: str | os.PathLike) -> tuple[np.memmap, dict[str, Any]]:
    """Open a token file read-only as a ``np.memmap`` after checking its sidecar; return both.

    Nothing is read into memory: pages of the file are loaded as batches touch them.
    """
    meta = read_token_meta(path)
    if meta["num_tokens"] == 0:
        raise ValueError(f"token file {str(path)!r} is empty")
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[meta["dtype"]], mode="r", shape=(meta["num_tokens"],))
    return tokens, meta


def max_token_id(path: str | os.PathLike, dtype: np.dtype | str, chunk: int = _SCAN_CHUNK) -> int:
    """The largest id in a token file, read in fixed-size chunks with ordinary reads.

    Plain reads rather than the memmap keep the scan from mapping the whole file into this
    process, so its resident memory stays at one chunk however large the file is.
    """
    dtype = np.dtype(dtype)
    buf = np.empty(chunk, dtype=dtype)
    best = -1
    with open(path, "rb") as f:
        while True:
            n = f.readinto(memoryview(buf).cast("B")) // dtype.itemsize
            if n == 0:
                return best
            best = max(best, int(buf[:n].max()))


def bytes_per_token(meta: dict) -> float | None:
    """Source bytes per token of a token file, from its sidecar (None when it does not say): the
    ratio that turns a loss per token into bits per byte."""
    source = meta.get("source_bytes") or 0
    return source / meta["num_tokens"] if source > 0 and meta.get("num_tokens") else None

"""Encode a text file of any size into a flat token file, in parallel and in order.

The file is cut at safe points (see :mod:`lm.tokenizer.pretokenize`), so the chunks
encode to exactly the ids of the whole text. Worker processes each hold the tokenizer
(and its cache) and return their chunk as a packed array; the parent writes the chunks in
order through :func:`lm.data.write_token_file`, which writes atomically. Memory stays
bounded by a few chunks whatever the file size. (It lives in ``lm.data``, which reads and
writes token files; the tokenizer knows nothing of them.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from lm.checks import check_size, is_count
from lm.data.token_file import sidecar_path, token_dtype, write_token_file
from lm.io import (
    check_not_input,
    check_readable_file,
    file_state,
    invalid_utf8_place,
    read_text_range,
    replaced_utf8_message,
    unchanged_while,
)
from lm.tokenizer import Tokenizer
from lm.tokenizer.pretokenize import LONG_CHUNK_BYTES, chunk_boundaries, warn_long_chunk
from lm.tokenizer.workers import parallel_map

_worker_tokenizer: Tokenizer | None = None  # set in a worker process only (see tokenize_file)


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_chunk_with(tokenizer: Tokenizer, args: tuple[str, int, int, str]) -> tuple[bytes, int, int]:
    path, start, end, dtype = args
    text, invalid = read_text_range(path, start, end)
    return tokenizer.encode_to_numpy(text, dtype).tobytes(), end - start, invalid


def _encode_chunk(args: tuple[str, int, int, str]) -> tuple[bytes, int, int]:
    """:func:`_encode_chunk_with` in a worker, with its tokenizer (:func:`_init_worker`)."""
    assert _worker_tokenizer is not None
    return _encode_chunk_with(_worker_tokenizer, args)


def tokenize_file(
    tokenizer: Tokenizer,
    input_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    num_workers: int | None = None,
    chunk_bytes: int = 1 << 21,
    warm_bytes: int = 1 << 18,
    progress: bool = False,
) -> dict[str, Any]:
    """Encode ``input_path`` (UTF-8 text) to the token file ``out_path``; return its sidecar.

    Invalid UTF-8 is replaced by U+FFFD with a warning. ``num_workers`` defaults to the CPU
    count; the output is identical for any number of workers. The file goes to the workers in
    chunks of about ``chunk_bytes``; with several workers the parent first encodes about
    ``warm_bytes`` itself (0: none), so that every worker starts with the commonest words cached.
    """
    path = check_readable_file(input_path, "input")
    check_not_input(out_path, [("input_path", path)], "out_path")
    check_not_input(sidecar_path(out_path), [("input_path", path)], "out_path")
    check_size("chunk_bytes", chunk_bytes)  # 0 had never advanced past the first cut: a hang
    if num_workers is not None:  # (0 or -5 had been taken for 1)
        check_size("num_workers", num_workers)
    if not is_count(warm_bytes):
        raise ValueError(f"warm_bytes must be a non-negative integer (0: no warm-up), got warm_bytes={warm_bytes!r}")
    # the workers read it by offsets: it must stay this file (rest26 R2)
    watched = {str(path): file_state(path)}
    size = watched[str(path)].size
    if size == 0:
        raise ValueError(f"input: file is empty: {str(path)!r}")
    workers = num_workers if num_workers is not None else (os.cpu_count() or 1)  # (checked above)
    dtype = token_dtype(tokenizer.vocab_size)
    # With several workers the parent first encodes a short head of the file (``warm_bytes``)
    # before it forks: the workers then start with the cache warm for the commonest words
    # instead of each filling it, and the other core idles only briefly.
    bounds = []
    if workers > 1 and 0 < warm_bytes and 2 * warm_bytes < size:
        head = chunk_boundaries(path, tokenizer.special_tokens, warm_bytes, end=2 * warm_bytes)
        bounds = head[:1] if len(head) > 1 else []  # one chunk: no safe cut before 2 * warm_bytes
    bounds += chunk_boundaries(path, tokenizer.special_tokens, chunk_bytes, start=bounds[0][1] if bounds else 0)
    warn_long_chunk(path, bounds, chunk_bytes, "encoded", limit=LONG_CHUNK_BYTES)
    tasks = [(str(path), a, b, dtype.str) for a, b in bounds]
    invalid, first_bad = 0, (0, 0)  # the bytes replaced by U+FFFD, and the chunk of the first
    # In this process the tokenizer is passed, not set in the module (where a second call, from
    # another thread, would have replaced it: each call's chunks encoded by the other's tokenizer).
    here = functools.partial(_encode_chunk_with, tokenizer)
    parallel = workers > 1 and len(tasks) > 1
    with unchanged_while(watched, "input", "tokenized"):
        first = [here(tasks[0])] if parallel else []  # the head, before the fork (see above)
    with tqdm(total=size, unit="B", unit_scale=True, desc="tokenize", disable=None if progress else True,
              file=sys.stderr) as bar, \
            (parallel_map(_encode_chunk, tasks[1:], workers, initializer=_init_worker, initargs=(tokenizer,))
             if parallel else contextlib.nullcontext(map(here, tasks))) as rest:
        results = itertools.chain(first, rest)
        # computed while the workers run (it takes a moment for a large vocab)
        checksum = tokenizer.checksum()

        def chunks() -> Iterator[np.ndarray]:
            nonlocal invalid, first_bad
            # checked again at the end, before the token file is renamed into place: truncated, written to
            # or replaced while the chunks were read, it had been a success of the wrong text (rest26 R2)
            with unchanged_while(watched, "input", "tokenized"):
                for (start, end), (data, nbytes, bad) in zip(bounds, results):
                    if bad and not invalid:
                        first_bad = (start, end)
                    invalid += bad
                    bar.update(nbytes)
                    yield np.frombuffer(data, dtype=dtype)

        meta = write_token_file(
            out_path,
            chunks(),
            vocab_size=tokenizer.vocab_size,
            source_bytes=size,
            tokenizer_sha256=checksum,
            source=str(path),
        )
    if invalid:  # where the first is, as `lm tokenize --target` and `lm translate` say it
        line, column = invalid_utf8_place(path, *first_bad) or (0, 0)
        warnings.warn(replaced_utf8_message("input", {str(path): invalid}, str(path), line, column), stacklevel=2)
    return meta

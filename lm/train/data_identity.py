"""Whether a data file named on ``--resume`` is the one the checkpoint trained on.

A resumed run keeps its data, but not its spelling of the path: ``data/train.bin``,
``./data/train.bin`` and an absolute path name one file, and a file moved to another disk is
still the same data. Two paths that both exist are compared as files (``os.path.samefile``);
otherwise the file is compared with the fingerprint the checkpoint recorded of it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 1 << 16  # read at the start, the middle and the end of the file
# what the sidecar says of the data itself (not where it came from: "source" names a text file)
SIDECAR_KEYS = ("dtype", "vocab_size", "num_tokens", "num_pairs", "source_bytes", "tokenizer_sha256")


def data_fingerprint(path: str | os.PathLike, meta: dict[str, Any]) -> dict[str, Any]:
    """What identifies a token or pair file without reading all of it: its size, its sidecar's
    description of the ids (``meta``: dtype, vocabulary, token count, source bytes, tokenizer
    checksum) and the SHA-256 of three 64 KiB samples of its bytes (start, middle, end)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return {"size": size, **{k: meta[k] for k in SIDECAR_KEYS if k in meta}, "sample_sha256": digest.hexdigest()}


def same_data_file(saved_path: str, path: str, saved_fingerprint: dict[str, Any] | None,
                   fingerprint: dict[str, Any]) -> bool:
    """``path`` (whose fingerprint is ``fingerprint``) holds the data a checkpoint recorded as
    ``saved_path``: the same file, or (when ``saved_path`` is not that file) a file with the
    fingerprint the checkpoint saved. A checkpoint without one (older) has only the path."""
    saved, new = Path(saved_path), Path(path)
    try:
        if saved.exists() and new.exists() and os.path.samefile(saved, new):
            return True
    except OSError:  # unreadable, or gone in between: compare fingerprints
        pass
    return saved_fingerprint is not None and saved_fingerprint == fingerprint

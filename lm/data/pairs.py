"""Parallel text for translation: aligned files, the pair token file, and length-bucketed batches.

**Text.** A parallel corpus is two files, one sentence a line, aligned line by line (plain or
gzip, UTF-8). :func:`read_parallel` yields the pairs and stops at the first fault with one line
naming the file and the line: bad UTF-8, an empty line, or files of different lengths.

**The pair file** (``lm tokenize --input SRC --target TGT --out X.bin``) is three files:

- ``X.bin``: the ids of pair 0's source, pair 0's target, pair 1's source, ... one after another,
  little-endian ``uint16`` while the vocabulary has at most 65,536 ids, else ``uint32``;
- ``X.bin.idx``: little-endian ``int64`` offsets, ``2 * num_pairs + 1`` of them: segment ``k``
  (source of pair ``k // 2`` when ``k`` is even, its target when odd) is
  ``ids[idx[k]:idx[k + 1]]``; ``idx[0] == 0`` and ``idx[-1] == num_tokens``;
- ``X.bin.json``, the sidecar, written last::

    {"format": "lm-pairs", "version": 1, "dtype": "uint16", "vocab_size": 8000, "num_pairs": 29000,
     "num_tokens": 812345, "source_bytes": 1801234, "target_bytes": 2012345,
     "tokenizer_sha256": "...", "source": "train.en.gz", "target": "train.de.gz",
     "special_tokens": {"<pad>": 0, "<bos>": 1, "<eos>": 2}}

``source_bytes`` and ``target_bytes`` count the UTF-8 bytes of each side's sentences plus one
newline each (the size of the decompressed file when every line ends in ``\\n``).

**Batches.** :class:`PairDataset` drops pairs that do not fit the model's context (with one
message), groups pairs of similar length, and cuts batches under a token budget; its sampler
state (epoch, position) goes into checkpoints so a resumed run sees exactly the batches of an
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import itertools
import json
import os
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lm.checks import check_rank, check_seed, check_size, is_count
from lm.data.token_file import (
    TOKEN_DTYPES,
    check_count_arg,
    check_ids,
    check_ids_file,
    check_ids_sidecar,
    check_not_sidecar,
    check_optional_fields,
    check_text_arg,
    check_vocab_size,
    load_sidecar,
    max_token_id,
    sidecar_path,
    token_dtype,
)
from lm.io import GZIP_MAGIC, InterruptGuard, atomic_files, check_not_input, text_name

if TYPE_CHECKING:  # torch is imported where batches are built: `lm tokenize` writes pair files without it
    import torch

FORMAT = "lm-pairs"
VERSION = 1
_OFFSET_DTYPE = np.dtype("<i8")


def index_path(path: str | os.PathLike) -> Path:
    """``X.bin`` -> ``X.bin.idx``, the offsets of a pair file (a path with no name, ``.``, is a ValueError)."""
    path = Path(path)
    if not path.name:
        raise ValueError(f"{str(path)!r} is a folder, not a pair file")
    return path.with_name(path.name + ".idx")


# -- parallel text ------------------------------------------------------------------------------


class _Prefixed(io.RawIOBase):
    """The bytes ``head`` already read from ``rest``, then the rest of it: a stream read once (a
    pipe, ``<(cmd)``) cannot seek back over the bytes its format was told by."""

    def __init__(self, head: bytes, rest):
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto(buffer)


@contextlib.contextmanager
def _open_binary(path: Path) -> Iterator[io.BufferedIOBase]:
    """``path`` opened for reading, decompressed when it is gzip: by its content (its first two
    bytes), whatever its name, as ``lm translate --input`` and ``lm eval --data`` tell it."""
    if not path.exists():
        raise ValueError(f"{str(path)!r}: file not found")
    if path.is_dir():  # a pipe or `<(cmd)` is fine: the file is read once, from its start
        raise ValueError(f"{str(path)!r}: is a directory")
    with open(path, "rb", buffering=0) as raw:
        head = b""
        while len(head) < len(GZIP_MAGIC):  # a pipe may hand over fewer bytes than asked for
            more = raw.read(len(GZIP_MAGIC) - len(head))
            if not more:
                break
            head += more
        with io.BufferedReader(_Prefixed(head, raw), buffer_size=1 << 16) as f:
            if head != GZIP_MAGIC:
                yield f
                return
            with gzip.GzipFile(fileobj=f, mode="rb") as z:
                yield z


def _lines(path: Path) -> Iterator[str]:
    """The lines of ``path`` without their ending (``\\n`` or ``\\r\\n``), checked for UTF-8 and emptiness."""
    n = 0
    with _open_binary(path) as f:
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                raise ValueError(f"{str(path)!r} line {n + 1}: cannot read it as gzip: {e}") from None
            if not raw:
                return
            n += 1
            raw = raw[:-1] if raw.endswith(b"\n") else raw
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{str(path)!r} line {n}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
            if not line.strip():
                raise ValueError(f"{str(path)!r} line {n}: empty line (every line must hold a sentence)")
            yield line


def read_parallel(src_path: str | os.PathLike, tgt_path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Yield ``(source, target)`` sentences from two aligned files (plain, or gzip: told by the content).

    Lines lose their ending (``\\n`` or ``\\r\\n``) and nothing else. A fault raises a one-line
    ValueError naming the file and its 1-based line: bad UTF-8, an empty (or blank) line on either
    side, or line counts that differ (both files named, and the line where the shorter one ends).

    >>> list(read_parallel("a.en", "a.de"))  # doctest: +SKIP
    [('A dog runs.', 'Ein Hund rennt.'), ...]
    """
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    src, tgt = _lines(src_path), _lines(tgt_path)
    n = 0
    while True:
        s = next(src, None)
        t = next(tgt, None)
        if s is None and t is None:
            return
        if s is None or t is None:
            short, long = (src_path, tgt_path) if s is None else (tgt_path, src_path)
            raise ValueError(
                f"mismatched line counts: {str(short)!r} ends after line {n} but {str(long)!r} goes on "
                f"at line {n + 1}; the two files must be aligned line by line"
            )
        n += 1
        yield s, t


# -- the pair file ------------------------------------------------------------------------------

def write_pair_file(
    path: str | os.PathLike,
    pairs: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    vocab_size: int,
    tokenizer_sha256: str | None = "",
    source_bytes: int | None = 0,
    target_bytes: int | None = 0,
    source: str = "",
    target: str = "",
    special_tokens: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Write ``(source ids, target ids)`` pairs to ``path``, its offsets and its sidecar; return the sidecar.

    The three files are written under temporary names and renamed only once all three are
    complete (:func:`lm.io.atomic_files`), and a Ctrl-C once the ids are written waits for the
    renames, so a failed or interrupted run leaves the old files (or none) or the new ones, never
    a mixture. ``source`` and ``target`` are stored as :func:`lm.io.text_name` gives them (a file
    name that is not UTF-8 had failed the sidecar after the ids were in place).
    Every id must lie in ``[0, vocab_size)``, and every id of ``special_tokens`` (each special
    token's text to its id) too; the other fields follow :func:`lm.data.write_token_file`'s rules.

    >>> meta = write_pair_file("/tmp/p.bin", [(np.array([5, 6]), np.array([7]))], vocab_size=10)
    >>> meta["num_pairs"], meta["num_tokens"], meta["dtype"]
    (1, 3, 'uint16')
    """
    check_vocab_size(vocab_size)
    check_not_sidecar(path)  # (tokenize_pairs checks its out_path before it encodes)
    extra = dict(source_bytes=check_count_arg("source_bytes", source_bytes),
                 target_bytes=check_count_arg("target_bytes", target_bytes),
                 tokenizer_sha256=check_text_arg("tokenizer_sha256", tokenizer_sha256),
                 source=str(source), target=str(target))
    if special_tokens is not None:  # {} too: a tokenizer without special tokens
        # the rule read_pair_meta applies: {'<pad>': 0.7} had been recorded as 0
        if not isinstance(special_tokens, Mapping) or not all(
                isinstance(t, str) and is_count(i) and i < vocab_size for t, i in special_tokens.items()):
            raise ValueError(f"special_tokens must map each special token (a str) to an id in [0, {vocab_size}), "
                             f"got special_tokens={special_tokens!r}")
        extra["special_tokens"] = {t: int(i) for t, i in special_tokens.items()}
    return _write_pair_file(path, pairs, vocab_size, lambda: extra)


def _write_pair_file(path, pairs, vocab_size: int, extra: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """:func:`write_pair_file`, with the sidecar's other fields from ``extra()`` once the pairs are written."""
    path = Path(path)
    dtype = token_dtype(vocab_size)
    offsets = [0]
    # all three written before any is renamed; a Ctrl-C once the ids are written waits for the renames
    with InterruptGuard() as guard, atomic_files() as open_file:
        f = open_file(path, "wb")
        for src, tgt in pairs:
            for side in (src, tgt):
                ids = check_ids(side, vocab_size)
                if ids.size:
                    f.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
                offsets.append(offsets[-1] + int(ids.size))
        guard.hold()
        open_file(index_path(path), "wb").write(np.asarray(offsets, dtype=_OFFSET_DTYPE).tobytes())
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "vocab_size": int(vocab_size),
            "num_pairs": (len(offsets) - 1) // 2,
            "num_tokens": int(offsets[-1]),
            "source_bytes": 0,
            "target_bytes": 0,
            "tokenizer_sha256": "",
            "source": "",
            "target": "",
        }
        meta.update(extra())
        meta["source"], meta["target"] = text_name(meta["source"]), text_name(meta["target"])
        f = open_file(sidecar_path(path), "w")
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return meta


def _read_sidecar(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_pair_file(path: str | os.PathLike) -> bool:
    """``path`` has a sidecar of this format: it was written by :func:`write_pair_file` (``lm tokenize --target``)."""
    meta = _read_sidecar(Path(path))
    return meta is not None and meta.get("format") == FORMAT


def read_pair_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check the sidecar of the pair file ``path`` against its ids and offsets files; return it."""
    path = Path(path)
    check_ids_file(path, "pair file")
    side, idx = sidecar_path(path), index_path(path)
    meta = load_sidecar(path, side, "pair file", "`lm tokenize --target`")
    if meta.get("format") != FORMAT:
        what = " (it is a token file of one text; make pair files with `lm tokenize --target`)" if (
            meta.get("format") == "lm-tokens") else ""
        raise ValueError(f"sidecar {str(side)!r} is not an {FORMAT!r} sidecar{what}")
    if meta.get("version") != VERSION:
        raise ValueError(f"sidecar {str(side)!r} has version {meta.get('version')!r}; this lm reads {VERSION}")
    check_ids_sidecar(meta, side, path, counts=("num_pairs", "num_tokens"))
    if not idx.is_file():
        raise ValueError(
            f"{str(path)!r} has no offsets file {idx.name!r}; write pair files with `lm tokenize --target`"
        )
    want = (2 * meta["num_pairs"] + 1) * _OFFSET_DTYPE.itemsize
    if idx.stat().st_size != want:
        raise ValueError(
            f"{str(idx)!r} has {idx.stat().st_size} bytes but the sidecar's {meta['num_pairs']} pairs need {want}: "
            "the file is truncated or not the one the sidecar describes"
        )
    specials = meta.get("special_tokens", {})
    if not isinstance(specials, dict) or not all(
            isinstance(t, str) and isinstance(i, int) and not isinstance(i, bool) and 0 <= i < meta["vocab_size"]
            for t, i in specials.items()):
        raise ValueError(f"sidecar {str(side)!r}: 'special_tokens' must map each special token to an id in "
                         f"[0, {meta['vocab_size']}), got {specials!r}")
    check_optional_fields(meta, side, counts=("source_bytes", "target_bytes"),
                          texts=("tokenizer_sha256", "source", "target"))
    return meta


class PairFile:
    """A pair file opened read-only: ids and offsets memory-mapped, checked against the sidecar.

    ``len(f)`` pairs; ``f.src(i)`` and ``f.tgt(i)`` are views of pair ``i``'s ids;
    ``f.src_lengths`` and ``f.tgt_lengths`` every pair's lengths; ``f.meta`` the sidecar.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.meta = read_pair_meta(self.path)
        n, dtype = self.meta["num_tokens"], TOKEN_DTYPES[self.meta["dtype"]]
        # np.memmap refuses an empty file
        self.ids = np.memmap(self.path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
        self.offsets = np.memmap(index_path(self.path), dtype=_OFFSET_DTYPE, mode="r",
                                 shape=(2 * self.meta["num_pairs"] + 1,))
        if self.offsets[0] != 0 or self.offsets[-1] != n or (np.diff(self.offsets) < 0).any():
            raise ValueError(
                f"{str(index_path(self.path))!r}: the offsets do not run from 0 to the sidecar's {n} tokens in "
                "order: the file is damaged or not the one the sidecar describes"
            )

    def __len__(self) -> int:
        return self.meta["num_pairs"]

    def src(self, i: int) -> np.ndarray:
        """The source ids of pair ``i`` (a read-only view)."""
        return self.ids[self.offsets[2 * i] : self.offsets[2 * i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        """The target ids of pair ``i`` (a read-only view)."""
        return self.ids[self.offsets[2 * i + 1] : self.offsets[2 * i + 2]]

    @cached_property
    def _lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets))

    @property
    def src_lengths(self) -> np.ndarray:
        return self._lengths[0::2]

    @property
    def tgt_lengths(self) -> np.ndarray:
        return self._lengths[1::2]

    def __repr__(self) -> str:
        return f"PairFile({str(self.path)!r}, {len(self)} pairs, {self.meta['num_tokens']} tokens)"


def read_pair_file(path: str | os.PathLike) -> PairFile:
    """Open a pair file (see :class:`PairFile`); one-line ValueError when it and its sidecar disagree."""
    return PairFile(path)


def _has_border(token: str) -> bool:
    """Some proper prefix of ``token`` is also its suffix (``<s><s>``, ``--``): joined after a line that
    ends with that prefix, the token is found early, and the line's tail moves into the next line."""
    return any(token[:k] == token[-k:] for k in range(1, len(token)))


def _encode_lines(tokenizer, lines: list[str], dtype: np.dtype, specials: list[str]) -> list[np.ndarray]:
    """Each line's ids, as ``tokenizer.encode_to_numpy(line)`` gives them, for many lines at a time.

    Encoding short sentences one call each is dominated by the per-call cost, so the lines are
    joined with a special token between them and encoded once: a special token always becomes
    one id, and no pre-token crosses it, so the ids between two separators are exactly the
    line's. The separator is a special token without a border (no proper prefix that is also its
    suffix: ``<pad>``, not ``<s><s>``), so it is found only where it was put; with none such, the
    lines are encoded one by one. Lines that hold the text of a special token are encoded one by
    one; if the separators do not come back one per line (another special token spanning a line's
    end and the separator), the lines are encoded one by one too.
    """
    one = lambda line: tokenizer.encode_to_numpy(line, dtype)  # noqa: E731
    sep = next((sp for sp in specials if not _has_border(sp)), None)
    if sep is None:
        return [one(line) for line in lines]
    out: list[np.ndarray | None] = [None] * len(lines)
    plain = []
    for i, line in enumerate(lines):
        if any(sp in line for sp in specials):
            out[i] = one(line)
        else:
            plain.append(i)
    sep_id = tokenizer.token_to_id[sep.encode("utf-8")]
    ids = tokenizer.encode_to_numpy(sep.join(lines[i] for i in plain) + sep, dtype) if plain else None
    ends = np.flatnonzero(ids == sep_id) if plain else np.zeros(0, np.int64)
    if len(ends) == len(plain):
        starts = np.concatenate(([0], ends[:-1] + 1))
        for i, a, b in zip(plain, starts.tolist(), ends.tolist()):
            out[i] = ids[a:b]
    else:
        for i in plain:
            out[i] = one(lines[i])
    return out  # type: ignore[return-value]


_pair_worker: tuple | None = None  # (tokenizer, dtype, special tokens), in a worker process only


def _init_pair_worker(tokenizer, dtype: str, specials: list[str]) -> None:
    global _pair_worker
    _pair_worker = (tokenizer, dtype, specials)


def _encode_pair_chunk(chunk: tuple[list[str], list[str]]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """:func:`_encode_pair_chunk_with` in a worker, with its setup (:func:`_init_pair_worker`)."""
    assert _pair_worker is not None
    return _encode_pair_chunk_with(*_pair_worker, chunk)


def _encode_pair_chunk_with(tokenizer, dtype: str, specials: list[str], chunk: tuple[list[str], list[str]]
                            ) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """A chunk's sources and targets encoded (:func:`_encode_lines`), each side as its ids end to
    end and each sentence's count of them (one array each: cheap to send back from a worker)."""
    dtype = np.dtype(dtype)
    out = []
    for side in chunk:
        ids = _encode_lines(tokenizer, side, dtype, specials)
        out.append((np.concatenate(ids) if ids else np.zeros(0, dtype), np.array([len(a) for a in ids], np.int64)))
    return tuple(out)


def tokenize_pairs(
    tokenizer,
    src_path: str | os.PathLike,
    tgt_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    progress: bool = False,
    chunk_pairs: int = 1024,
    num_workers: int | None = None,
) -> dict[str, Any]:
    """Encode a parallel corpus (see :func:`read_parallel`) into the pair file ``out_path``; return its sidecar.

    Each sentence is encoded on its own (the ids ``tokenizer.encode`` gives it alone). A sentence
    whose text holds a special token of the tokenizer (``<eos>`` written out, say) encodes it as
    that token; such pairs are counted and reported in one warning. The sentences go to the
    tokenizer ``chunk_pairs`` pairs at a time, over ``num_workers`` processes (default: the CPU
    count; one when the corpus is a single chunk); the file is the same for any number.
    ``out_path`` (its offsets and sidecar too) may not be one of the inputs.
    """
    from tqdm import tqdm

    from lm.tokenizer.workers import WorkerPool

    check_size("chunk_pairs", chunk_pairs)
    if num_workers is not None:
        check_size("num_workers", num_workers)
    workers = num_workers if num_workers is not None else (os.cpu_count() or 1)
    inputs = [("src_path", src_path), ("tgt_path", tgt_path)]
    for out in (out_path, index_path(out_path), sidecar_path(out_path)):  # never over the text it reads
        check_not_input(out, inputs, "out_path")
    check_not_sidecar(out_path, "out_path")  # (before a long encoding)
    vocab_size = tokenizer.vocab_size
    dtype = token_dtype(vocab_size)
    special_ids = tokenizer.special_ids
    specials = list(special_ids)
    counts = {"src": 0, "tgt": 0, "special": 0}
    checksum = tokenizer.checksum()
    lines = read_parallel(src_path, tgt_path)
    first = next(lines, None)  # read before anything is written: empty inputs leave no output
    if first is None:
        raise ValueError(f"{str(src_path)!r} and {str(tgt_path)!r} hold no lines")
    lines = itertools.chain([first], lines)

    def chunks() -> Iterator[tuple[list[str], list[str]]]:
        """The pairs, ``chunk_pairs`` at a time, as sources and targets; counted as they are read."""
        while chunk := list(itertools.islice(lines, chunk_pairs)):
            src = [s for s, _ in chunk]
            tgt = [t for _, t in chunk]
            counts["src"] += sum(map(len, (s.encode("utf-8") for s in src))) + len(src)
            counts["tgt"] += sum(map(len, (t.encode("utf-8") for t in tgt))) + len(tgt)
            if specials:
                counts["special"] += sum(any(sp in s or sp in t for sp in specials) for s, t in chunk)
            yield src, tgt

    def encoded() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        tasks = chunks()
        head = list(itertools.islice(tasks, workers))  # fewer chunks than workers: as many processes as chunks
        parallel = workers > 1 and len(head) > 1
        # In this process the setup is passed, not set in the module (where a second call, from
        # another thread, would have replaced it: each call's pairs encoded by the other's tokenizer).
        setup = (tokenizer, dtype.str, specials)
        with tqdm(unit=" pairs", desc="tokenize", disable=None if progress else True, file=sys.stderr) as bar, \
                (WorkerPool(len(head), _encode_pair_chunk, _init_pair_worker, setup) if parallel
                 else contextlib.nullcontext()) as pool:
            todo = itertools.chain(head, tasks)
            here = functools.partial(_encode_pair_chunk_with, *setup)
            for (src, src_n), (tgt, tgt_n) in pool.map(todo) if parallel else map(here, todo):
                yield from zip(np.split(src, np.cumsum(src_n)[:-1]), np.split(tgt, np.cumsum(tgt_n)[:-1]))
                bar.update(len(src_n))

    def extra() -> dict[str, Any]:
        # always recorded, {} too: the trainer checks the model's <pad>, <bos> and <eos> against them
        return dict(source_bytes=counts["src"], target_bytes=counts["tgt"], tokenizer_sha256=checksum,
                    source=str(src_path), target=str(tgt_path), special_tokens=special_ids)

    meta = _write_pair_file(out_path, encoded(), vocab_size, extra)
    if counts["special"]:
        warnings.warn(f"{counts['special']:,} pairs hold the text of a special token "
                      f"({', '.join(special_ids)}); it was encoded as that token", stacklevel=2)
    return meta


# -- batches ------------------------------------------------------------------------------------

@dataclass
class PairBatch:
    """One batch of pairs, padded with ``pad_id`` to the longest source and the longest target in it.

    ``src`` is each source followed by ``<eos>``; ``tgt_in`` is ``<bos>`` + target (the decoder's
    input) and ``tgt_out`` target + ``<eos>`` (what it predicts); the masks are True at real tokens.
    ``index`` holds the pairs' indices in the pair file (to put decoded outputs back in order).
    """

    src: torch.Tensor  # int64 [B, S]
    src_mask: torch.Tensor  # bool [B, S]
    tgt_in: torch.Tensor  # int64 [B, T]
    tgt_out: torch.Tensor  # int64 [B, T]
    tgt_mask: torch.Tensor  # bool [B, T]
    index: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        """Real target tokens (``tgt_mask.sum()``): the tokens the loss is taken over."""
        return int(self.tgt_mask.sum())

    def to(self, device: str | torch.device, non_blocking: bool = False) -> PairBatch:
        import torch

        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=non_blocking)
        return PairBatch(**moved)

    def __len__(self) -> int:
        return self.src.shape[0]


class PairDataset:
    """A pair file opened for training: pairs that fit the context, cut into length-bucketed batches.

    **Dropping.** A pair whose source + ``<eos>`` or ``<bos>`` + target is longer than ``max_len``
    is dropped, never truncated; how many is said in one line through ``print_fn``.

    **Training order** (:meth:`sample`). Each epoch shuffles the kept pairs with a generator seeded
    by ``(seed, epoch)``, sorts them stably by padded length (``max(len(source) + 1, len(target) + 1)``,
    then the target's), so that ties stay shuffled, cuts the sorted order into batches of as many
    pairs as keep ``rows * padded_len <= max_tokens``, and shuffles the batches. The epochs make one
    stream of batches. Every rank computes the same stream; one global step is ``world_size``
    consecutive batches of it, and rank ``r`` takes the ``r``-th. So ``N`` ranks with budget ``B``
    see exactly the batches of one process with budget ``B`` and ``N`` gradient-accumulation steps,
    and the sampler's state is two integers, the same on every rank (rank 0's checkpoint resumes
    them all).

    **Evaluation order** (:meth:`fixed_batches`, :meth:`batches`): every kept pair once, sorted
    by length (ties in file order), cut the same way, the same at every call; with a number of
    batches, that many spread evenly over this plan (short and long sentences both); rank ``r``
    takes batches ``r, r + world_size, ...`` of them, so together the ranks score the pairs one
    process scores.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_len: int,
        vocab_size: int | None = None,
        pad_id: int,
        bos_id: int,
        eos_id: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        print_fn: Callable[[str], Any] | None = print,
        name: str | None = None,
    ):
        self.path = Path(path)
        self.name = name or str(self.path)
        where = f"{name} ({str(self.path)!r})" if name else repr(str(self.path))  # for errors
        # checked, not cast with int(): max_len=5.9 had become 5, and pad_id == bos_id had been taken
        if not is_count(max_len, 2):
            raise ValueError(f"{where}: max_len must be an integer >= 2 (a token and <eos>), got max_len={max_len!r}")
        check_size("world_size", world_size)
        check_rank(rank, world_size)
        for what, i in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise ValueError(f"{what} must be an integer, got {what}={i!r}")
        if len({int(pad_id), int(bos_id), int(eos_id)}) < 3:  # as Seq2SeqConfig requires
            raise ValueError(f"pad_id, bos_id and eos_id must be distinct, got pad_id={pad_id}, "
                             f"bos_id={bos_id}, eos_id={eos_id}")
        self.seed = check_seed(seed, "seed")
        self.file = read_pair_file(self.path)
        self.meta = self.file.meta
        self.max_len = int(max_len)
        self.pad_id, self.bos_id, self.eos_id = int(pad_id), int(bos_id), int(eos_id)
        self.rank, self.world_size = int(rank), int(world_size)
        if vocab_size is not None:
            if self.meta["vocab_size"] > vocab_size:
                raise ValueError(
                    f"{where}: was tokenized with vocab_size {self.meta['vocab_size']}, "
                    f"larger than the model's {vocab_size}"
                )
            top = max_token_id(self.path, self.file.ids.dtype) if self.meta["num_tokens"] else -1
            if top >= vocab_size:
                raise ValueError(
                    f"{where}: contains token id {top}, outside the model's "
                    f"vocabulary [0, {vocab_size})"
                )
        limit = vocab_size if vocab_size is not None else self.meta["vocab_size"]
        for what, i in (("pad_id", self.pad_id), ("bos_id", self.bos_id), ("eos_id", self.eos_id)):
            if not 0 <= i < limit:
                raise ValueError(f"{where}: {what} {i} is outside the vocabulary [0, {limit})")

        src_len = self.file.src_lengths.astype(np.int64) + 1  # + <eos>
        tgt_len = self.file.tgt_lengths.astype(np.int64) + 1  # <bos> + / + <eos>
        keep = (src_len <= self.max_len) & (tgt_len <= self.max_len)
        self.kept = np.flatnonzero(keep)
        total = len(self.file)
        dropped = total - len(self.kept)
        if len(self.kept) == 0:
            raise ValueError(
                f"{where}: none of its {total:,} pairs fits the context ({self.max_len} tokens)"
                if total else f"{where}: holds no pairs"
            )
        if dropped and print_fn is not None:
            print_fn(f"{self.name}: dropped {dropped:,} of {total:,} pairs longer than the context "
                     f"({self.max_len} tokens)")
        self.num_dropped = dropped
        self._src_len, self._tgt_len = src_len, tgt_len  # padded lengths, indexed by pair
        self._padded = np.maximum(src_len, tgt_len)
        self.longest = int(self._padded[self.kept].max())
        self.epoch, self.position = 0, 0
        self.max_tokens: int | None = None
        self._plans: dict[tuple[int, int], list[np.ndarray]] = {}

    def __len__(self) -> int:
        """The number of pairs kept (that fit the context)."""
        return len(self.kept)

    @property
    def bytes_per_token(self) -> float | None:
        """Target bytes per predicted target token, over the whole file; None when the sidecar does not say.

        The predicted tokens of a pair are its target ids and ``<eos>`` (``tgt_out``); the bytes
        are its UTF-8 bytes and a newline, which ``<eos>`` stands for. So a mean loss in nats
        per ``tgt_mask`` token divided by ``log(2) * bytes_per_token`` is bits per byte.
        """
        nbytes = self.meta.get("target_bytes") or 0
        if nbytes <= 0:
            return None
        return nbytes / float(self.file.tgt_lengths.sum() + len(self.file))

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta.get("tokenizer_sha256", "")

    # -- plans

    def _check_budget(self, max_tokens: int) -> int:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
            raise ValueError(f"{self.name}: max_tokens must be an integer, got {max_tokens!r}")
        if max_tokens < self.longest:
            raise ValueError(
                f"{self.name}: max_tokens {max_tokens} is less than the longest pair kept ({self.longest} tokens "
                f"with <bos>/<eos>); raise it to at least {self.longest}, or lower the context"
            )
        return int(max_tokens)

    def _cut(self, order: np.ndarray, max_tokens: int) -> list[np.ndarray]:
        """Cut ``order`` (sorted by padded length, ascending) into batches of ``rows * longest <= max_tokens``."""
        lengths = self._padded[order].tolist()
        cuts, start, longest = [], 0, 0
        for i, n in enumerate(lengths):
            longest_with = max(longest, n)
            if (i - start + 1) * longest_with > max_tokens:
                cuts.append(i)
                start, longest_with = i, n
            longest = longest_with
        return np.split(order, cuts) if len(order) else []

    def _sorted(self, pairs: np.ndarray) -> np.ndarray:
        """``pairs`` stably sorted by padded length, then target length (ties keep their order)."""
        return pairs[np.lexsort((self._tgt_len[pairs], self._padded[pairs]))]

    def epoch_batches(self, epoch: int, max_tokens: int) -> list[np.ndarray]:
        """The global batches (pair indices) of training epoch ``epoch``, in the order they are drawn."""
        max_tokens = self._check_budget(max_tokens)
        key = (int(epoch), max_tokens)
        plan = self._plans.get(key)
        if plan is None:
            rng = np.random.Generator(np.random.PCG64([self.seed, int(epoch)]))
            plan = self._cut(self._sorted(rng.permutation(self.kept)), max_tokens)
            plan = [plan[i] for i in rng.permutation(len(plan))]
            if len(self._plans) >= 4:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan

    def batches_per_epoch(self, max_tokens: int) -> int:
        """Batches in one epoch (global: each step takes ``world_size`` of them)."""
        return len(self.epoch_batches(self.epoch, max_tokens))

    def _advance(self, epoch: int, position: int, steps: int, max_tokens: int) -> tuple[int, int]:
        position += steps
        while position >= (n := len(self.epoch_batches(epoch, max_tokens))):
            position -= n
            epoch += 1
        return epoch, position

    def target_tokens(self, indices: np.ndarray) -> int:
        """The real target tokens of the pairs ``indices`` (what :attr:`PairBatch.num_tokens`
        counts), from the lengths on the host: no read of a batch's tensors, which on a GPU waits
        for the device."""
        return int(self._tgt_len[np.asarray(indices, dtype=np.int64)].sum())

    # -- training

    def upcoming_tokens(self, count: int, max_tokens: int) -> list[int]:
        """The real target tokens of each of the next ``count`` batches of the training stream
        (the global stream: every rank's), without drawing them.

        A step of ``world_size`` ranks and ``A`` accumulation steps draws ``A * world_size``
        consecutive batches, micro-step ``m`` of rank ``r`` the ``(m * world_size + r)``-th. Every
        rank computes the same list from the same state, so a trainer knows the step's token count
        and each micro-batch's share of it on the host, with no collective and no device read.
        """
        max_tokens = self._check_budget(max_tokens)
        epoch, position, tokens = self.epoch, self.position, []
        for _ in range(count):
            epoch, position = self._advance(epoch, position, 0, max_tokens)  # past an epoch's end
            tokens.append(self.target_tokens(self.epoch_batches(epoch, max_tokens)[position]))
            position += 1
        return tokens

    def sample(self, max_tokens: int, device: str | torch.device = "cpu") -> PairBatch:
        """This rank's next batch of the training stream (see the class), on ``device``."""
        max_tokens = self._check_budget(max_tokens)
        if self.max_tokens is None:
            self.max_tokens = max_tokens
        elif self.max_tokens != max_tokens:
            raise ValueError(
                f"{self.name}: the sampler is part-way through epoch {self.epoch} with max_tokens "
                f"{self.max_tokens}, not {max_tokens}; keep the batch budget of the run (or start a new run)"
            )
        epoch, position = self._advance(self.epoch, self.position, self.rank, max_tokens)
        indices = self.epoch_batches(epoch, max_tokens)[position]
        self.epoch, self.position = self._advance(self.epoch, self.position, self.world_size, max_tokens)
        return self.batch(indices, device)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position in plain ints (safe to checkpoint): epoch, batches drawn in it, and the budget."""
        return {"epoch": self.epoch, "position": self.position, "max_tokens": self.max_tokens,
                "seed": self.seed, "num_pairs": len(self.kept)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_pairs", len(self.kept)) != len(self.kept):
            raise ValueError(
                f"{self.name}: the checkpoint's sampler ran over {state['num_pairs']:,} pairs but {str(self.path)!r} "
                f"keeps {len(self.kept):,} (another file, or another context length?)"
            )
        self.seed = int(state.get("seed", self.seed))
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.max_tokens = None if state.get("max_tokens") is None else int(state["max_tokens"])

    # -- evaluation

    def fixed_batches(self, max_tokens: int, num_batches: int | None = None) -> list[np.ndarray]:
        """This rank's evaluation batches (pair indices), the same at every call.

        The plan is every kept pair once, sorted by length and cut under ``max_tokens``. With
        ``num_batches`` (fewer than the plan holds) it keeps that many of its batches spread evenly
        over it, the middle one of each of ``num_batches`` equal stretches: the first batches alone
        would be the shortest sentences. The choice is made on the global plan and only then split
        between the ranks (rank ``r`` takes batches ``r, r + world_size, ...``; a rank may get none),
        so together the ranks score the pairs one process scores, whatever their number.
        """
        if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int)
                                        or num_batches < 1):
            raise ValueError(f"{self.name}: num_batches must be a positive int, got {num_batches!r}")
        plan = self._cut(self._sorted(self.kept), self._check_budget(max_tokens))
        if num_batches is not None and num_batches < len(plan):
            plan = [plan[(2 * i + 1) * len(plan) // (2 * num_batches)] for i in range(num_batches)]
        return plan[self.rank :: self.world_size]

    def batches(self, max_tokens: int, device: str | torch.device = "cpu",
                num_batches: int | None = None) -> Iterator[PairBatch]:
        """:meth:`fixed_batches` as :class:`PairBatch` es on ``device``."""
        for indices in self.fixed_batches(max_tokens, num_batches):
            yield self.batch(indices, device)

    def batch(self, indices: np.ndarray, device: str | torch.device = "cpu") -> PairBatch:
        """The pairs ``indices`` (indices into the pair file), padded, as a :class:`PairBatch` on ``device``."""
        import torch

        indices = np.asarray(indices, dtype=np.int64)
        rows = len(indices)
        s_len, t_len = self._src_len[indices], self._tgt_len[indices]
        s_max = int(s_len.max()) if rows else 1
        t_max = int(t_len.max()) if rows else 1
        src = np.full((rows, s_max), self.pad_id, dtype=np.int64)
        tgt_in = np.full((rows, t_max), self.pad_id, dtype=np.int64)
        tgt_out = np.full((rows, t_max), self.pad_id, dtype=np.int64)
        for r, i in enumerate(indices.tolist()):
            s, t = self.file.src(i), self.file.tgt(i)
            src[r, : len(s)] = s
            src[r, len(s)] = self.eos_id
            tgt_in[r, 0] = self.bos_id
            tgt_in[r, 1 : len(t) + 1] = t
            tgt_out[r, : len(t)] = t
            tgt_out[r, len(t)] = self.eos_id
        src_mask = np.arange(s_max)[None, :] < s_len[:, None]
        tgt_mask = np.arange(t_max)[None, :] < t_len[:, None]
        out = PairBatch(torch.from_numpy(src), torch.from_numpy(src_mask), torch.from_numpy(tgt_in),
                        torch.from_numpy(tgt_out), torch.from_numpy(tgt_mask), indices)
        return out if torch.device(device).type == "cpu" else out.to(device)

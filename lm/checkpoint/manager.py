"""The checkpoints of one run: the last K by step, and the best by validation loss."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from lm.checkpoint.io import CheckpointWriteError, write_checkpoint
from lm.checks import is_count

STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
# The temporary file of an atomic write of a checkpoint (lm.io.atomic_write: ".NAME.RANDOM.tmp"),
# left behind when a run was killed while writing it.
PARTIAL_FILE = re.compile(r"^\.(step_\d+|best)\.pt\.[A-Za-z0-9_]+\.tmp$")
# ... and of the run folder's other files written whole (the exported weights, as large as the
# model; the config, metrics.jsonl rewritten by a resume, the wandb id, the plot)
PARTIAL_RUN_FILE = re.compile(r"^\.(model\.safetensors|config\.toml|metrics\.jsonl|wandb_id\.txt|loss\.png)"
                              r"\.[A-Za-z0-9_]+\.tmp$")
# ... and of the tokenizer files copied into RUN_DIR/tokenizer/
_PARTIAL_TOKENIZER_FILE = re.compile(r"^\.(vocab\.json|merges\.txt|tokenizer_config\.json)\.[A-Za-z0-9_]+\.tmp$")


class CheckpointManager:
    """``RUN_DIR/checkpoints/step_00001000.pt`` (the newest ``keep_last`` kept) and ``best.pt``.

    ``keep_last`` is a non-negative integer, as ``checkpoint.keep_last``: 0 keeps all.
    """

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 3):
        # as checkpoint.keep_last: -1 had kept all (undocumented), and 1.5 or '3' failed at the first save
        if not is_count(keep_last):
            raise ValueError(f"keep_last must be a non-negative integer (0 keeps all), got keep_last={keep_last!r}")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def step_path(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}.pt"

    @property
    def best_path(self) -> Path:
        return self.dir / "best.pt"

    def step_files(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step_N.pt``, by step: the file as it is named (``step_12.pt``
        put there by hand too, not only this class's ``step_00000012.pt``)."""
        if not self.dir.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.dir.iterdir() if (m := STEP_FILE.match(p.name)))

    def steps(self) -> list[int]:
        return [step for step, _ in self.step_files()]

    def latest(self) -> Path | None:
        files = self.step_files()
        return files[-1][1] if files else None

    def remove_partial_writes(self) -> list[Path]:
        """Delete the temporary files of the writes that a killed run left in its folder (the
        checkpoints', the exported weights', the config's, metrics.jsonl's, the tokenizer files'...;
        call with the run folder locked: no write is in progress); return their paths."""
        partial = []
        for folder, pattern in ((self.dir.parent, PARTIAL_RUN_FILE), (self.dir, PARTIAL_FILE),
                                (self.dir.parent / "tokenizer", _PARTIAL_TOKENIZER_FILE)):
            if folder.is_dir():
                partial += [p for p in folder.iterdir() if pattern.match(p.name) and p.is_file()]
        partial.sort()
        for p in partial:
            p.unlink(missing_ok=True)
        return partial

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write the checkpoint of ``step`` atomically, then delete all but the newest ``keep_last``."""
        path = self.step_path(step)
        _write(state, path)
        if self.keep_last > 0:
            for _, old in self.step_files()[: -self.keep_last]:
                try:
                    old.unlink(missing_ok=True)
                except OSError as e:  # (an immutable file, a folder of that name): the new checkpoint is good
                    warnings.warn(f"could not delete the old checkpoint {str(old)!r} (checkpoint.keep_last = "
                                  f"{self.keep_last}): {e.strerror or e}; the new one, {str(path)!r}, is written, "
                                  "and the run goes on", stacklevel=2)
        return path

    def save_best(self, state: dict[str, Any]) -> Path:
        _write(state, self.best_path)
        return self.best_path


def _write(state: dict[str, Any], path: Path) -> None:
    """:func:`write_checkpoint`; a failure that is the file size limit or a full disk says so. torch
    reports a short write in its own words ("unexpected pos 304640 vs 304532"), not the OS's."""
    try:
        write_checkpoint(state, path)
    except CheckpointWriteError:
        reason = _why_not_written(state, path)
        if reason is None:
            raise
        raise CheckpointWriteError(f"could not write checkpoint {str(path)!r}: {reason}") from None


class _Counter:
    """A file that keeps nothing but the number of bytes written to it."""

    def __init__(self):
        self.size = 0

    def write(self, data) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _why_not_written(state: dict[str, Any], path: Path) -> str | None:
    """The size limit (``ulimit -f``) or the free space, when the checkpoint's size is over it
    (its size found by writing it again, to nowhere); None when neither explains the failure."""
    try:
        counter = _Counter()
        write_checkpoint(state, counter)
        size = counter.size
        folder = next(p for p in (path.parent, *path.parents) if p.is_dir())  # a folder the write made is gone
        free = shutil.disk_usage(folder).free
    except Exception:  # noqa: BLE001 - the first error stands as it was
        return None
    limit = _file_size_limit()
    if limit is not None and size > limit:
        return f"the checkpoint is {size:,} bytes, over the file size limit of {limit:,} bytes (ulimit -f); raise it"
    if size > free:
        return f"the disk is full: the checkpoint is {size:,} bytes and {str(folder)!r} has {free:,} bytes free"
    return None


def _file_size_limit() -> int | None:
    """The largest file this process may write, in bytes; None when there is no limit (or no way to tell)."""
    try:
        import resource  # not on Windows
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft

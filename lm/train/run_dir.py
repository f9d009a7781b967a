"""The run folder of `lm train`: what may be started in it, and one process at a time.

A run folder holds what a run writes (:data:`RUN_ENTRIES`). A new run starts in a missing or
empty folder; a folder that holds a run (its ``config.toml``, ``metrics.jsonl`` or ``checkpoints/``)
is continued with ``--resume`` (a run that stopped before its first checkpoint starts again from
step 0, its earlier ``metrics.jsonl`` kept beside); any other folder is refused. :class:`RunLock`
keeps a second ``lm train`` out of a folder while one is running in it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

from lm.io import file_mode

RUN_ENTRIES = frozenset({
    "config.toml", "metrics.jsonl", "checkpoints", "model.safetensors", "tokenizer", "loss.png",
    "wandb", "wandb_id.txt", ".lock",
})
LOCK_NAME = ".lock"


def run_entries(run_dir: Path) -> set[str]:
    """The names in ``run_dir`` (empty when it does not exist)."""
    return {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()


def holds_run(run_dir: Path) -> bool:
    """The folder holds the config or metrics of a run (with or without checkpoints)."""
    entries = run_entries(run_dir)
    return bool(entries & {"config.toml", "metrics.jsonl", "checkpoints"})


def check_run_folder(run_dir: Path) -> None:
    """Refuse a folder that is not a folder, or that is neither empty nor a run's: a run is recognised
    by what it writes first (``config.toml``; ``metrics.jsonl`` and ``checkpoints/`` follow), so files
    that only share a run's names (``model.safetensors``, ``tokenizer/``...) are not taken for one."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"train.out_dir: {str(run_dir)!r} exists and is not a folder")
    entries = run_entries(run_dir)
    others = sorted(entries - {LOCK_NAME})  # a lock alone: a run killed before it wrote anything
    if others and not holds_run(run_dir):
        raise ValueError(
            f"train.out_dir: {str(run_dir)!r} is not empty ({others[0]!r}{' and more' if len(others) > 1 else ''}) "
            "and holds no run of `lm train` (no config.toml, metrics.jsonl or checkpoints/); choose a new or "
            "empty folder"
        )


def set_aside_metrics(run_dir: Path) -> Path | None:
    """Rename ``metrics.jsonl`` to the first free ``metrics.jsonl.N``; return the new name."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    n = 1
    while (run_dir / f"metrics.jsonl.{n}").exists():
        n += 1
    target = run_dir / f"metrics.jsonl.{n}"
    os.replace(path, target)
    return target


class RunLock:
    """An advisory lock on a run folder: ``RUN_DIR/.lock`` held with ``flock`` and holding the pid.

    The kernel drops a ``flock`` when its process dies, so a lock left by a killed run is taken
    over (with a message naming the dead pid); a live holder makes :meth:`acquire` raise.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, say: Callable[[str], None] = print) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, file_mode())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ValueError(
                    f"train.out_dir: {str(self.path.parent)!r} is in use by another `lm train` (pid {holder}); "
                    "wait for it to finish or choose another train.out_dir"
                ) from None
            # The holder we waited for may have deleted the file after we opened it: lock the file
            # that is there now.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = os.read(fd, 64).decode(errors="replace").strip()
        if old and old != str(os.getpid()):
            say(f"took over the lock of {str(self.path.parent)!r} from pid {old}, which is no longer running")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:  # a read-only folder, say: the run's own outcome is what matters
            warnings.warn(f"could not remove the lock {str(self.path)!r}: {e}", stacklevel=2)
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

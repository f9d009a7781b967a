"""The run folder of `lm train`: what may be started in it, and one process at a time.

A run folder holds what a run writes (:data:`RUN_ENTRIES`). A new run starts in a missing or
empty folder; a folder that holds a run (its ``config.toml``, ``metrics.jsonl`` or ``checkpoints/``,
each as ``lm train`` writes it: see :func:`run_problem`) is continued with ``--resume`` (a run that
stopped before its first checkpoint starts again from step 0, its earlier ``metrics.jsonl`` kept
beside); any other folder is refused. :class:`RunLock` keeps a second ``lm train`` out of a folder
while one is running in it.
"""

from __future__ import annotations

import json
import os
import re
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

from lm.checkpoint.manager import PARTIAL_FILE, STEP_FILE
from lm.io import lock_file
from lm.tomlio import loads as toml_loads
from lm.train.config import SECTIONS

RUN_ENTRIES = frozenset({
    "config.toml", "metrics.jsonl", "checkpoints", "model.safetensors", "tokenizer", "loss.png",
    "wandb", "wandb_id.txt", ".lock",
})
LOCK_NAME = ".lock"
# the names by which a run is recognised (each checked for what lm train writes there: run_problem)
RUN_MARKERS = ("config.toml", "metrics.jsonl", "checkpoints")
# in checkpoints/, besides step_N.pt and the temporary files of their writes (lm.checkpoint.manager):
# best.pt, best.pt set aside by a restart (best.pt.N), and a checkpoint moved aside as unreadable
SET_ASIDE_BEST = re.compile(r"^best\.pt\.\d+$")  # best.pt of another history (Trainer._prepare_run_dir)
_OTHER_CHECKPOINT_NAME = re.compile(r"^(best\.pt|(step_\d+|best)\.pt\.unreadable\d*)$")
_CONFIG_LIMIT = 1 << 20  # a resolved config is a few KB: a larger config.toml is not one


def run_entries(run_dir: Path) -> set[str]:
    """The names in ``run_dir`` (empty when it does not exist)."""
    return {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()


def holds_run(run_dir: Path) -> bool:
    """The folder holds the config or metrics of a run (with or without checkpoints): one of
    :data:`RUN_MARKERS` at least, and each of them as ``lm train`` writes it (:func:`run_problem`)."""
    entries = run_entries(run_dir)
    return bool(entries & set(RUN_MARKERS)) and run_problem(run_dir) is None


def run_problem(run_dir: Path) -> str | None:
    """Why a name of :data:`RUN_MARKERS` in ``run_dir`` is not what ``lm train`` writes there
    ("config.toml is not an lm run config (...)"); None when each one that is there is (or none is).

    ``config.toml`` is the resolved config (TOML with every table of a run's config, and nothing
    else); ``metrics.jsonl`` is empty or starts with a record (a JSON object with ``step`` and
    ``split``; a first line cut short by a kill counts); ``checkpoints/`` is a folder that holds
    only checkpoint names (``step_N.pt``, ``best.pt``, ``best.pt.N``, the temporary files of their
    writes, ``NAME.pt.unreadable``). Another tool's files with these names are not taken for a run."""
    return next((problem for problem in marker_problems(run_dir).values() if problem is not None), None)


def marker_problems(run_dir: Path) -> dict[str, str | None]:
    """Each name of :data:`RUN_MARKERS` that is in ``run_dir``, with why it is not what ``lm train``
    writes there (None where it is), in the order lm train writes them."""
    problems = {}
    for name, check in (("config.toml", _config_problem), ("metrics.jsonl", _metrics_problem),
                        ("checkpoints", _checkpoints_problem)):
        path = run_dir / name
        if os.path.lexists(path):
            problems[name] = check(path)
    return problems


def _config_problem(path: Path) -> str | None:
    what = "config.toml is not an lm run config"
    if not path.is_file():
        return f"{what} (not a file)"
    if path.stat().st_size > _CONFIG_LIMIT:
        return f"{what} (larger than 1 MiB)"
    try:
        raw = toml_loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return f"{what} (not UTF-8 text)"
    except ValueError as e:  # tomllib.TOMLDecodeError
        return f"{what} (not valid TOML: {str(e).splitlines()[0] if str(e) else type(e).__name__})"
    other = next((k for k, v in raw.items() if k not in SECTIONS or not isinstance(v, dict)), None)
    if other is not None:
        return f"{what} (it has {'a table' if isinstance(raw[other], dict) else 'a key'} {other!r})"
    missing = [f"[{name}]" for name in SECTIONS if name not in raw]  # every lm wrote them all (a hand-written
    # config lacks some: lm train would write over it)
    if missing:
        return f"{what} (no {' or '.join(missing[:2])}{' ...' if len(missing) > 2 else ''} table)"
    return None


def _first_line(path: Path) -> bytes:
    """The first line of ``path`` (its first 64 KiB at most), as bytes."""
    with open(path, "rb") as f:
        return f.readline(1 << 16)


def _metrics_problem(path: Path) -> str | None:
    what = "metrics.jsonl is not the metrics of lm train"
    if not path.is_file():
        return f"{what} (not a file)"
    first = _first_line(path)
    if not first.strip():  # empty: a run killed before its first record
        return None
    whole = first.endswith(b"\n")
    try:
        record = json.loads(first.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        if not whole and first.startswith(b'{"step": '):  # the first record, cut short by a kill
            return None
        return f"{what} (its first line is not a JSON object)"
    if not isinstance(record, dict):
        return f"{what} (its first line is not a JSON object)"
    step, split = record.get("step"), record.get("split")
    if not (isinstance(step, int) and not isinstance(step, bool) and isinstance(split, str)):
        return f"{what} (its first record has no \"step\" and \"split\")"
    return None


def _checkpoints_problem(path: Path) -> str | None:
    if not path.is_dir():
        return "checkpoints is not a folder"
    names = sorted(p.name for p in path.iterdir())
    other = next((n for n in names if not (STEP_FILE.match(n) or PARTIAL_FILE.match(n)
                                           or _OTHER_CHECKPOINT_NAME.match(n) or SET_ASIDE_BEST.match(n))), None)
    if other is not None:
        return f"checkpoints/ holds {other!r}, which is not a checkpoint of lm train"
    return None


def check_run_folder(run_dir: Path) -> None:
    """Refuse a folder that is not a folder, or that is neither empty nor a run's: a run is recognised
    by what it writes first (``config.toml``; ``metrics.jsonl`` and ``checkpoints/`` follow), each
    checked for what lm train writes there (:func:`run_problem`), so files that only share a run's
    names (``model.safetensors``, ``tokenizer/``, another tool's ``config.toml``...) are not taken for one."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"train.out_dir: {str(run_dir)!r} exists and is not a folder")
    from lm.checkpoint.manager import PARTIAL_RUN_FILE

    entries = run_entries(run_dir)
    # a lock alone, or with the temporary file of its first write: a run killed before it wrote anything
    others = sorted(e for e in entries - {LOCK_NAME} if not PARTIAL_RUN_FILE.match(e))
    if not others:
        return
    if not entries & set(RUN_MARKERS):
        raise ValueError(
            f"train.out_dir: {str(run_dir)!r} is not empty ({others[0]!r}{' and more' if len(others) > 1 else ''}) "
            "and holds no run of `lm train` (no config.toml, metrics.jsonl or checkpoints/); choose a new or "
            "empty folder"
        )
    problems = marker_problems(run_dir)
    problem = next((p for p in problems.values() if p is not None), None)
    if problem is None:
        return
    # what shows a run of its own: its config, records, step checkpoints (not an empty metrics.jsonl, nor one
    # of blank lines, which _metrics_problem takes for empty too)
    shown = {"config.toml": lambda: True, "metrics.jsonl": lambda: bool(_first_line(run_dir / "metrics.jsonl").strip()),
             "checkpoints": lambda: any(STEP_FILE.match(p.name) for p in (run_dir / "checkpoints").iterdir())}
    good = [name for name, p in problems.items() if p is None and shown[name]()]
    if good:  # a run (a .DS_Store in checkpoints/, a hand-edited config.toml): not a folder to abandon
        raise ValueError(f"train.out_dir: {str(run_dir)!r} holds a run of `lm train` (its {' and '.join(good)} "
                         f"{'are' if len(good) > 1 else 'is'} lm train's), but {problem}; move that out of the "
                         "folder (or mend it) and run again")
    raise ValueError(f"train.out_dir: {str(run_dir)!r} is not empty and holds no run of `lm train`: {problem}; "
                     "choose a new or empty folder")


def set_aside(path: Path) -> Path | None:
    """Rename ``path`` (``metrics.jsonl``, ``model.safetensors``, ``checkpoints/best.pt`` of an earlier
    history) to the first free ``NAME.N``; the new name, or None when there is no such file."""
    if not path.exists():
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    target = path.with_name(f"{path.name}.{n}")
    os.replace(path, target)
    return target


def _unlock(path: Path, fd: int) -> None:
    """Remove the lock file, then close its descriptor (which drops the ``flock``)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:  # a read-only folder, say: the run's own outcome is what matters
        warnings.warn(f"could not remove the lock {str(path)!r}: {e}", stacklevel=4)  # release()'s caller
    finally:
        os.close(fd)


class RunLock:
    """An advisory lock on a run folder: ``RUN_DIR/.lock`` held with ``flock`` and holding the pid.

    The kernel drops a ``flock`` when its process dies, so a lock left by a killed run is taken
    over (with a message naming the dead pid); a live holder makes :meth:`acquire` raise. A lock
    that is dropped unreleased (a Trainer made and never run) is released when it is collected:
    its descriptor had stayed open for the life of the process, and the folder refused every later
    Trainer of that process (cyc25).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self._release: weakref.finalize | None = None  # alive while the lock is held

    def acquire(self, say: Callable[[str], None] = print) -> None:
        try:
            fd = lock_file(self.path)
        except BlockingIOError:
            try:
                holder = self.path.read_bytes()[:64].decode(errors="replace").strip() or "?"
            except OSError:  # its holder removed it meanwhile
                holder = "?"
            # this process: a notebook that made a second Trainer before dropping the first
            held_by = (f"in this process (pid {holder}: a Trainer for it that has not run or been dropped); run or "
                       "drop that one," if holder == str(os.getpid()) else f"(pid {holder}); wait for it to finish")
            raise ValueError(f"train.out_dir: {str(self.path.parent)!r} is in use by another `lm train` {held_by} "
                             "or choose another train.out_dir") from None
        if fd is None:  # not POSIX: no locking
            return
        old = os.read(fd, 64).decode(errors="replace").strip()
        if old and old != str(os.getpid()):
            say(f"took over the lock of {str(self.path.parent)!r} from pid {old}, which is no longer running")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._release = weakref.finalize(self, _unlock, self.path, fd)

    def release(self) -> None:
        if self._release is not None:
            self._release()  # once: a finalizer that has run does nothing

    @property
    def held(self) -> bool:
        return self._release is not None and self._release.alive

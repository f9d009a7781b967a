"""The checkpoints of one run: the last K by step, and the best by validation loss."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lm.checkpoint.io import write_checkpoint

STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
# The temporary file of an atomic write of a checkpoint (lm.io.atomic_write: ".NAME.RANDOM.tmp"),
# left behind when a run was killed while writing it.
PARTIAL_FILE = re.compile(r"^\.(step_\d+|best)\.pt\.[A-Za-z0-9_]+\.tmp$")
# ... and of the run's exported weights (RUN_DIR/model.safetensors), as large as the model
_PARTIAL_EXPORT = re.compile(r"^\.model\.safetensors\.[A-Za-z0-9_]+\.tmp$")


class CheckpointManager:
    """``RUN_DIR/checkpoints/step_00001000.pt`` (the newest ``keep_last`` kept) and ``best.pt``."""

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 3):
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
        """Delete the temporary files of checkpoint writes that a killed run left (call with the
        run folder locked: no write is in progress); return their paths."""
        partial = []
        if self.dir.parent.is_dir():
            partial += [p for p in self.dir.parent.iterdir() if _PARTIAL_EXPORT.match(p.name) and p.is_file()]
        if self.dir.is_dir():
            partial += [p for p in self.dir.iterdir() if PARTIAL_FILE.match(p.name) and p.is_file()]
        partial.sort()
        for p in partial:
            p.unlink(missing_ok=True)
        return partial

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write the checkpoint of ``step`` atomically, then delete all but the newest ``keep_last``."""
        path = self.step_path(step)
        write_checkpoint(state, path)
        if self.keep_last > 0:
            for _, old in self.step_files()[: -self.keep_last]:
                old.unlink(missing_ok=True)
        return path

    def save_best(self, state: dict[str, Any]) -> Path:
        write_checkpoint(state, self.best_path)
        return self.best_path

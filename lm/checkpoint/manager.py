"""The checkpoints of one run: the last K by step, and the best by validation loss."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lm.checkpoint.io import write_checkpoint

_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
# The temporary file of an atomic write of a checkpoint (lm.io.atomic_write: ".NAME.RANDOM.tmp"),
# left behind when a run was killed while writing it.
_PARTIAL_FILE = re.compile(r"^\.(step_\d+|best)\.pt\.[A-Za-z0-9_]+\.tmp$")


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

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _STEP_FILE.match(p.name)))

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.step_path(steps[-1]) if steps else None

    def remove_partial_writes(self) -> list[Path]:
        """Delete the temporary files of checkpoint writes that a killed run left (call with the
        run folder locked: no write is in progress); return their paths."""
        if not self.dir.is_dir():
            return []
        partial = sorted(p for p in self.dir.iterdir() if _PARTIAL_FILE.match(p.name) and p.is_file())
        for p in partial:
            p.unlink(missing_ok=True)
        return partial

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write the checkpoint of ``step`` atomically, then delete all but the newest ``keep_last``."""
        path = self.step_path(step)
        write_checkpoint(state, path)
        if self.keep_last > 0:
            for old in self.steps()[: -self.keep_last]:
                self.step_path(old).unlink(missing_ok=True)
        return path

    def save_best(self, state: dict[str, Any]) -> Path:
        write_checkpoint(state, self.best_path)
        return self.best_path

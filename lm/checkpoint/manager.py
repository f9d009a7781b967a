"""The checkpoints of one run: the last K by step, and the best by validation loss."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from lm.checkpoint.io import write_checkpoint

_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


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

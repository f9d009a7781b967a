"""Where training reports go: the console, ``RUN_DIR/metrics.jsonl`` and (optionally) Weights & Biases."""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
import weakref
from pathlib import Path
from typing import Any

from lm.io import atomic_write


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class MetricsWriteError(OSError):
    """``metrics.jsonl`` could not be written (the disk full...): one line naming it and the reason."""


def _write_error(path: Path, e: OSError) -> MetricsWriteError:
    reason = e.strerror or str(e)
    return MetricsWriteError(f"could not write {str(path)!r}: {reason[:1].lower() + reason[1:]}")


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; mirrors records to wandb when enabled
    (``quiet``: wandb prints nothing, as ``lm train --quiet`` prints no progress)."""

    def __init__(self, run_dir: Path, wandb_cfg: Any = None, config: dict | None = None, resume: bool = False,
                 quiet: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":  # first: if it cannot start, nothing is written
            import wandb

            id_file = Path(run_dir) / "wandb_id.txt"
            run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:8]
            # its banner, run history and summary (about 30 lines on stderr) are progress output too
            quiet_settings = {"settings": wandb.Settings(silent=True)} if quiet else {}
            try:
                self._wandb = wandb.init(
                    project=wandb_cfg.project,
                    name=wandb_cfg.name or Path(run_dir).name,
                    mode=wandb_cfg.mode,
                    dir=str(run_dir),
                    config=config,
                    id=run_id,
                    resume="allow",
                    **quiet_settings,
                )
            except Exception as e:  # wandb's own errors (a bad project name, online without a login): one line
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(f"wandb: could not start a {wandb_cfg.mode} run (project {wandb_cfg.project!r}): "
                                 f"{first}") from None
            # The x-axis is the record's step logged as a value, not wandb's own step: a resumed run
            # logs again the steps from its checkpoint to where it stopped, and wandb drops a log to a
            # step below its current one ("Steps must be monotonically increasing").
            self._wandb.define_metric("step")
            for split in ("train", "val", "config", "compile"):
                self._wandb.define_metric(f"{split}/*", step_metric="step")
            with atomic_write(id_file) as f:
                f.write(run_id + "\n")
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed in close())
        # a log dropped unclosed (a Trainer made and never run) closes with it, not as a ResourceWarning
        weakref.finalize(self, _close_quietly, self._file)

    @staticmethod
    def truncate(run_dir: Path, after_step: int) -> None:
        """Drop records past ``after_step``: a resumed run repeats those steps and logs them again.
        A line that is JSON but not a record with a number as its step (a hand edit) is kept."""
        path = Path(run_dir) / "metrics.jsonl"
        if not path.exists():
            return
        keep = [line for line, record in _records(path) if not _past(record, after_step)]
        with atomic_write(path) as f:
            f.write("".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            raise _write_error(self.path, e) from None
        if self._wandb is not None:
            split = record.get("split", "train")
            values = {f"{split}/{k}": v for k, v in record.items() if k not in ("step", "split") and v is not None}
            self._wandb.log({"step": record["step"], **values})

    def close(self) -> None:
        """Close the file (a failed write's line is tried again, and its error raised again: the file
        is closed all the same) and finish the wandb run."""
        try:
            self._file.close()
        except OSError as e:
            raise _write_error(self.path, e) from None
        finally:
            if self._wandb is not None:
                self._wandb.finish()
                self._wandb = None


def _close_quietly(f) -> None:
    """Close ``f`` where no one is left to hear of a failure (a collected log)."""
    with contextlib.suppress(OSError):
        f.close()


def _past(record: Any, step: int) -> bool:
    """``record`` is a record of a step after ``step``."""
    at = record.get("step") if isinstance(record, dict) else None
    return isinstance(at, int | float) and not isinstance(at, bool) and at > step


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Each line of a ``metrics.jsonl`` with its record; a line cut short by a kill, or damaged
    (not JSON, not UTF-8), is skipped."""
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            line = raw.decode("utf-8")
            out.append((line, json.loads(line)))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
    return out


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (lines cut short by a kill are skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).exists():
        raise ValueError(f"run directory not found: {str(run_dir)!r}")
    if not Path(run_dir).is_dir():
        raise ValueError(f"{str(run_dir)!r} is not a folder, so not a run directory of `lm train`")
    if not path.exists():
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl; is it a run directory of `lm train`?")
    return [record for _, record in _records(path)]

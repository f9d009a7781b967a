"""Checkpoints written while training goes on: a copy on the host, written by one background thread.

Writing a checkpoint of the 17M model (272 MB with AdamW's moments) takes about half a second,
long beside a step on a GPU. :class:`BackgroundWriter` copies the state to the host on the
calling thread (the copy is what the file will hold, whatever the next steps do to the live
tensors), then writes it on a thread, atomically as :class:`CheckpointManager` always does. One
write at a time: the next save waits for the previous one before it copies, so files appear in
order and at most one copy is held. An error of the thread is raised by the next
:meth:`~BackgroundWriter.wait`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lm.checkpoint.manager import CheckpointManager
from lm.io import clear_error_frames


def host_copy(state: Any) -> Any:
    """``state`` with every tensor (and numpy array) copied to new CPU memory, containers rebuilt."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(host_copy(v) for v in state)
    return state


class BackgroundWriter:
    """``save``/``save_best`` of a :class:`CheckpointManager`, each on a thread after the previous one ends."""

    def __init__(self, manager: CheckpointManager):
        self.manager = manager
        self._done: threading.Event | None = None  # set by the thread of the write in progress as it ends
        self._errors: list[BaseException] = []  # the failed write's error, for wait() to raise

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Start writing the checkpoint of ``step``; return its path (complete once :meth:`wait` returns)."""
        self.wait()  # before the copy: the previous write's copy is freed first
        self._start(self.manager.save, host_copy(state), step)
        return self.manager.step_path(step)

    def save_best(self, state: dict[str, Any]) -> Path:
        self.wait()
        self._start(self.manager.save_best, host_copy(state))
        return self.manager.best_path

    @property
    def writing(self) -> bool:
        """A write is in progress."""
        return self._done is not None and not self._done.is_set()

    def wait(self) -> None:
        """Block until the write in progress (if any) is on disk; raise its error, if it had one.

        An Event, not ``Thread.join``: a join that an exception interrupts (a signal handler's, as
        the trainer's second SIGINT/SIGTERM raises) marks the thread stopped while it still runs on
        Python 3.11 and 3.12 (bpo-45274's cleanup), and the next join returned at once, abandoning the
        file being written. An interrupted ``Event.wait`` leaves the event as it was: waiting again
        still waits for the write."""
        if self._done is not None:
            self._done.wait()
            self._done = None
        if self._errors:
            error = self._errors.pop()
            try:
                raise error
            finally:
                del error  # this frame, on the error's traceback, would hold it: a cycle (rest26 R1)

    def _start(self, write, *args) -> None:
        self.wait()
        done, job = threading.Event(), [args]

        # run() holds neither the writer nor, once failed, its list of errors: the error's traceback
        # holds run's frame, and a path back to the error from it had kept the writer and the whole host
        # copy of the state (model and AdamW moments) alive until a cyclic collection (rest26 R1).
        def run(errors: list[BaseException]) -> None:
            try:
                write(*job.pop())  # the copy is freed once written, before the event says so
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
                clear_error_frames(e)  # the write's locals: the host copy goes now, not with the error
                errors.append(e)
            finally:
                del errors
                done.set()

        # not a daemon: an interpreter that exits still finishes the file it is writing
        threading.Thread(target=run, args=(self._errors,), name="lm-checkpoint-writer").start()
        self._done = done  # once started: a thread that could not start is waited for by nobody

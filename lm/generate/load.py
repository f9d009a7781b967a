"""A trained model and its tokenizer, loaded once, for inference (``lm sample``, ``lm translate``,
``lm eval``, ``lm export``, ``lm serve``).

``path`` is a checkpoint file, a run folder (its newest weights) or its ``checkpoints/`` (see
:func:`resolve_checkpoint`); the tokenizer is the one ``lm train`` copied into the run (see
:func:`find_run_tokenizer`) unless another is named, and it must be the model's: its checksum is
compared with the one the checkpoint recorded.
Errors are ``ValueError`` naming the argument (``--checkpoint``/``--tokenizer`` by default, so
the command line can print them as they are).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm.io import spoken_list, text_name
from lm.tokenizer import Tokenizer


@dataclass
class Loaded:
    """What :func:`load_model_and_tokenizer` returns: the model (in eval mode), its tokenizer (None only when not
    asked for), the checkpoint's info (``model_config``, ``tokenizer_sha256``, ...; the architecture is
    :attr:`architecture`) and the file."""

    model: torch.nn.Module
    tokenizer: Tokenizer | None
    info: dict[str, Any]
    path: Path

    @property
    def architecture(self) -> str:
        return self.model.config.architecture

    @property
    def source(self) -> str:
        """The file loaded and, for a training checkpoint, its step: ``PATH, step N`` (for messages)."""
        from lm.io import text_name

        step = self.info.get("iteration")
        name = text_name(self.path)  # a byte that is not UTF-8 as \xff, not Python's \udcff
        return name if step is None else f"{name}, step {step}"

    def __iter__(self):  # model, tokenizer, info = load_model_and_tokenizer(...)
        return iter((self.model, self.tokenizer, self.info))


def resolve_checkpoint(path: str | Path, argument: str = "--checkpoint") -> Path:
    """A checkpoint file, or a run folder: its newest weights, ``model.safetensors`` (exported at the
    end of the run) unless a checkpoint of a later step is there (the run was resumed and stopped
    early, so the export is older) or the export cannot be read (a cut copy: a warning says so),
    else its newest checkpoint; or a run's ``checkpoints/`` folder:
    its newest ``step_N.pt``, as ``lm train --resume`` takes it."""
    from lm.checkpoint import CheckpointManager
    from lm.io import check_not_empty

    check_not_empty(path, argument)  # not the working folder
    p = Path(path)
    if p.is_dir():
        if p.name == "checkpoints" and not (p / "checkpoints").is_dir():  # RUN/checkpoints itself
            latest = CheckpointManager(p.parent).latest()
            if latest is None:
                raise ValueError(f"{argument}: {str(p)!r} holds no step_*.pt ({_holding(p)}); pass a checkpoint "
                                 "file or the run folder")
            return latest
        exported = p / "model.safetensors"
        newest, unreadable = _newest_weights(CheckpointManager(p).step_files(), exported)
        if newest is None:
            raise ValueError(f"{argument}: run directory {str(p)!r} holds no model.safetensors and no "
                             f"checkpoints/step_*.pt ({_holding(p)}); pass a checkpoint file or a run folder")
        if unreadable and newest != exported:  # a cut copy: the checkpoint is loaded, and the user told why
            warnings.warn(f"{argument}: {unreadable}; loading {text_name(newest)!r} instead", stacklevel=2)
        return newest
    if not p.is_file():
        if p.is_symlink():
            try:
                p.resolve(strict=True)
            except RuntimeError:  # Python 3.11 raises this for a loop; 3.13 an OSError
                raise ValueError(f"{argument}: {str(p)!r} is a symlink loop") from None
            except OSError:
                raise ValueError(f"{argument}: {str(p)!r} is a symlink to a file that is not there") from None
        if p.exists():  # /dev/null, a pipe: there, but no checkpoint file (it had said "file not found")
            raise ValueError(f"{argument}: not a regular file: {str(p)!r}")
        raise ValueError(f"{argument}: file not found: {str(p)!r}")
    return p


def _holding(folder: Path) -> str:
    """What a folder holds, in a few names: "it holds 'best.pt' and 'notes.txt'", "it is empty"."""
    names = sorted(q.name + ("/" if q.is_dir() else "") for q in folder.iterdir())
    if not names:
        return "it is empty"
    shown = [repr(n) for n in names[:3]] + ([f"{len(names) - 3} more"] if len(names) > 3 else [])
    return "it holds " + spoken_list(shown)


def _newest_weights(files: list[tuple[int, Path]], exported: Path | None) -> tuple[Path | None, str]:
    """A run's newest weights, of its ``step_N.pt`` files (``(step, path)``, by step) and its export
    (``model.safetensors``, where it is a file; None: not a candidate): the export unless a checkpoint
    of a later step is there or it cannot be read, else the newest checkpoint; None if neither. And
    why the export cannot be read, '' if it can (an export alone is returned all the same: loading
    it says what is wrong)."""
    latest = files[-1][1] if files else None
    if exported is None or not exported.is_file():
        return latest, ""
    step, unreadable = _exported_step(exported)
    return (exported if latest is None or files[-1][0] <= step else latest), unreadable


def _exported_step(path: Path) -> tuple[float, str]:
    """The step ``lm train`` recorded in an exported file, infinity when there is none (a file put
    there by hand is taken as meant); and -1 with the reason when it cannot be read (a checkpoint
    wins)."""
    from lm.checkpoint.export import exported_step

    try:
        step = exported_step(path)
    except ValueError as e:
        return -1, str(e)
    return float("inf") if step is None else step, ""


def _earlier_weights(file: Path) -> Path | None:
    """The weights a run folder resolves to without ``file`` (its newest, which could not be loaded):
    the same rule over its other checkpoints and its export; None when it has none that can be read."""
    from lm.checkpoint import CheckpointManager

    run = file.parent if file.name == "model.safetensors" else file.parent.parent  # RUN/checkpoints/step_N.pt
    exported = run / "model.safetensors"
    others = [(step, f) for step, f in CheckpointManager(run).step_files() if f != file]
    newest, unreadable = _newest_weights(others, None if exported == file else exported)
    return None if unreadable and newest == exported else newest


def find_run_tokenizer(checkpoint: Path) -> Path | None:
    """The ``tokenizer/`` folder that ``lm train`` copies into a run, looked up from a checkpoint path:
    beside the file (``RUN/model.safetensors``), or in the run of a file in its ``checkpoints/``
    (``RUN/checkpoints/step_N.pt``); never in the folder that holds a run (another model's, maybe)."""
    folders = [checkpoint.parent]
    if checkpoint.parent.name == "checkpoints":
        folders.append(checkpoint.parent.parent)
    for d in folders:
        if (d / "tokenizer" / "vocab.json").is_file():
            return d / "tokenizer"
    return None


RESOLVE_ATTEMPTS = 5  # picks of a run folder's newest checkpoint, where each was deleted before it was read


def load_model_and_tokenizer(
    path: str | Path,
    tokenizer: str | Path | None = None,
    device: str | torch.device = "cpu",
    *,
    need_tokenizer: bool = True,
    argument: str = "--checkpoint",
    tokenizer_argument: str = "--tokenizer",
) -> Loaded:
    """Load the model at ``path`` and its tokenizer once; see the module's docstring.

    ``device`` is a name (``auto`` included) checked against what this machine has, or a device.
    """
    from lm.checkpoint import load_model
    from lm.device import resolve_device
    from lm.tokenizer import check_tokenizer_checksum, load_tokenizer_dir

    if isinstance(tokenizer, str) and not tokenizer:  # '' (an unset variable) had meant "the run's", silently
        raise ValueError(f"{tokenizer_argument}: must not be empty; omit it to use the run's tokenizer/")
    dev = device if isinstance(device, torch.device) else resolve_device(device, "--device")
    for attempt in range(RESOLVE_ATTEMPTS):
        file = resolve_checkpoint(path, argument)
        try:
            model, info = load_model(file, device=dev)
            break
        except ValueError as e:  # the file's own fault: name the argument it came from
            # A run that is training deletes its older checkpoints (checkpoint.keep_last): the newest
            # one, picked from the folder, can be gone by the time it is opened. Pick again.
            if attempt + 1 < RESOLVE_ATTEMPTS and Path(path).is_dir() and not file.exists():
                continue
            earlier = _earlier_weights(file) if Path(path).is_dir() else None  # picked from a run folder
            hint = f"; the run's next newest weights are {text_name(earlier)!r}" if earlier else ""
            raise ValueError(f"{argument}: {e}{hint}") from None
    model.eval()
    tok_dir = Path(tokenizer) if tokenizer else find_run_tokenizer(file)
    if tok_dir is None:
        if need_tokenizer:
            raise ValueError(f"{tokenizer_argument}: no tokenizer/ beside {str(file)!r}; "
                             f"pass {tokenizer_argument} DIR")
        return Loaded(model, None, info, file)
    tok = load_tokenizer_dir(tok_dir, argument=tokenizer_argument)
    check_tokenizer_checksum(tok.checksum(), info["tokenizer_sha256"], argument=tokenizer_argument,
                             what=f"{str(tok_dir)!r}", against=f"the model {str(file)!r}")
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"{tokenizer_argument}: {str(tok_dir)!r} has {tok.vocab_size} tokens, more than the model's "
            f"vocab_size {model.config.vocab_size}"
        )
    if model.config.architecture == "encoder_decoder":
        problem = model.config.special_ids_problem(tok.special_ids, "the model's ", repr(str(tok_dir)))
        if problem:
            raise ValueError(f"{tokenizer_argument}: {problem}")
    return Loaded(model, tok, info, file)

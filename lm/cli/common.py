"""What `lm sample`, `lm eval` and `lm export` share: a trained model and its tokenizer from a path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint file, or a run directory (its ``model.safetensors``, else its newest checkpoint)."""
    from lm.checkpoint import CheckpointManager

    p = Path(path)
    if p.is_dir():
        if (p / "model.safetensors").is_file():
            return p / "model.safetensors"
        latest = CheckpointManager(p).latest()
        if latest is None:
            raise ValueError(f"--checkpoint: run directory {str(p)!r} holds no model.safetensors and no checkpoints/")
        return latest
    if not p.is_file():
        raise ValueError(f"--checkpoint: file not found: {str(p)!r}")
    return p


def find_run_tokenizer(checkpoint: Path) -> Path | None:
    """The ``tokenizer/`` folder that `lm train` copies into a run, looked up from a checkpoint path."""
    for d in (checkpoint.parent, checkpoint.parent.parent):
        if (d / "tokenizer" / "vocab.json").is_file():
            return d / "tokenizer"
    return None


def load_model_and_tokenizer(
    checkpoint: str, tokenizer: str | None = None, device: str = "cpu", need_tokenizer: bool = True
) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """``(model, tokenizer or None, info)`` for a checkpoint path; the tokenizer checksum is checked."""
    from lm.checkpoint import load_model
    from lm.tokenizer import load_tokenizer_dir

    path = resolve_checkpoint(checkpoint)
    model, info = load_model(path, device=device)
    tok_dir = Path(tokenizer) if tokenizer else find_run_tokenizer(path)
    if tok_dir is None:
        if need_tokenizer:
            raise ValueError(f"--tokenizer: no tokenizer/ beside {str(path)!r}; pass --tokenizer DIR")
        return model, None, info
    tok = load_tokenizer_dir(tok_dir)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"--tokenizer: {str(tok_dir)!r} has {tok.vocab_size} tokens, more than the model's "
            f"vocab_size {model.config.vocab_size}"
        )
    return model, tok, info

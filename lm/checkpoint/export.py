"""Weights as safetensors: the shareable form of a model (tensors only, no code)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from lm.checkpoint.io import safetensors_checksums, unwrap
from lm.io import atomic_write


def export_safetensors(
    model: nn.Module | dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a model's weights (or a state dict) to a ``.safetensors`` file atomically.

    Safetensors holds tensors only, so it is safe to share. When ``model`` carries a ``config``
    with ``to_json`` (``TransformerLM`` does), it goes into the metadata as ``"model_config"`` so
    :func:`load_model` can rebuild the model from the file alone. Tied weights are stored once
    per name. The metadata also records ``tensor_crc32`` and ``metadata_crc32`` (CRC-32s of the
    tensors' bytes and of the other metadata), which :func:`load_model` checks.
    """
    from safetensors.torch import save

    if metadata is not None:
        if not isinstance(metadata, Mapping):  # 'x' had failed in dict(): "dictionary update sequence element"
            raise ValueError(f"metadata must be None or a dict of str to str, got metadata={metadata!r}")
        bad = next(((k, v) for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))), None)
        if bad is not None:  # before the tensors are copied, not in safetensors' save
            raise ValueError(f"metadata must be a dict of str to str, got metadata[{bad[0]!r}]={bad[1]!r}")
    meta = dict(metadata or {})
    if isinstance(model, nn.Module):
        inner = unwrap(model)
        if hasattr(getattr(inner, "config", None), "to_json"):
            meta.setdefault("model_config", inner.config.to_json())
        tensors = inner.state_dict()
    else:
        tensors = model
    # safetensors refuses tensors that share memory; a copy per name is what a reader expects.
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}
    meta.update(safetensors_checksums(tensors, meta))  # checked by load_model: a damaged file is refused
    with atomic_write(path, "wb") as f:
        f.write(save(tensors, metadata=meta))
    return Path(path)


def exported_step(path: str | os.PathLike) -> int | None:
    """The training step ``lm train`` recorded in an exported file's metadata (``"step"``), None
    when it records none; a ValueError when the file cannot be read (missing, or not safetensors)."""
    from safetensors import safe_open

    from lm.checkpoint.io import safetensors_name

    try:
        with safetensors_name(path) as name, safe_open(name, "pt") as f:
            step = (f.metadata() or {}).get("step")
    except Exception as e:  # noqa: BLE001 - a corrupt header is safetensors' own error type
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {e}") from None
    return int(step) if step is not None and step.isdigit() else None

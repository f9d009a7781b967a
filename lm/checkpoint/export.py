"""Weights as safetensors, and models rebuilt from checkpoints or safetensors files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lm.checkpoint.io import check_state_dict_fits, read_checkpoint, unwrap
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
    per name.
    """
    from safetensors.torch import save

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
    with atomic_write(path, "wb") as f:
        f.write(save(tensors, metadata=meta))
    return Path(path)


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a ``TransformerLM`` from a checkpoint (``.pt``) or an exported ``.safetensors`` file.

    Returns ``(model, info)`` where ``info`` holds the model config dict, the iteration, the run
    config and the tokenizer checksum when the file records them. The model is in eval mode.
    """
    from lm.model import ModelConfig, TransformerLM

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            state_dict = load_file(str(path))
        except (OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{str(path)!r} is not a readable safetensors file: {e}") from None
        if "model_config" not in meta:
            raise ValueError(f"{str(path)!r} has no 'model_config' metadata; it was not written by lm")
        model_cfg = json.loads(meta["model_config"])
        info = {"model_config": model_cfg, "metadata": meta}
    else:
        state = read_checkpoint(path)
        model_cfg = (state.get("config") or {}).get("model")
        if model_cfg is None:
            raise ValueError(
                f"{str(path)!r} records no model config; load it with load_checkpoint into a model"
            )
        state_dict = state["model"]
        info = {
            "model_config": model_cfg,
            "iteration": state.get("iteration"),
            "config": state.get("config"),
            "tokenizer_sha256": state.get("tokenizer_sha256", ""),
        }
    model = TransformerLM.from_config(ModelConfig.from_dict(model_cfg), device=device)
    check_state_dict_fits(model, state_dict, repr(str(path)))
    model.load_state_dict(state_dict)
    return model.eval(), info

"""Every random-number-generator state a training run depends on, as checkpointable plain values."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """Python's, numpy's global, torch's CPU and (when present) every CUDA device's RNG state."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's MT19937 key is an array; a list of ints keeps the checkpoint weights_only-loadable.
        "numpy": {**np_state, "state": {**np_state["state"], "key": np_state["state"]["key"].tolist()}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        {
            **np_state,
            "state": {**np_state["state"], "key": np.asarray(np_state["state"]["key"], dtype=np.uint32)},
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

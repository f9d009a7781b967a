"""Checkpoints: atomic, weights_only-loadable files; the last K and best of a run; safetensors export.

save_checkpoint / load_checkpoint   model + optimizer + iteration (API.md)
write_checkpoint / read_checkpoint  any checkpoint dictionary (the trainer's full state)
CheckpointManager                   RUN_DIR/checkpoints/step_*.pt (last K) and best.pt
get_rng_state / set_rng_state       python, numpy, torch and CUDA generator states
load_model                          a TransformerLM rebuilt from a checkpoint or safetensors file
export_safetensors                  shareable weights
"""

from lm.checkpoint.export import export_safetensors
from lm.checkpoint.io import (
    check_state_dict_fits,
    load_checkpoint,
    load_model,
    read_checkpoint,
    save_checkpoint,
    unwrap,
    write_checkpoint,
)
from lm.checkpoint.manager import CheckpointManager
from lm.checkpoint.rng import get_rng_state, set_rng_state

__all__ = [
    "CheckpointManager",
    "check_state_dict_fits",
    "export_safetensors",
    "get_rng_state",
    "load_checkpoint",
    "load_model",
    "read_checkpoint",
    "save_checkpoint",
    "set_rng_state",
    "unwrap",
    "write_checkpoint",
]

"""Checkpoints: atomic, weights_only-loadable files; the last K and best of a run; safetensors export.

save_checkpoint / load_checkpoint   model + optimizer + iteration (the CS336 interface)
write_checkpoint / read_checkpoint  any checkpoint dictionary (the trainer's full state)
CheckpointManager                   RUN_DIR/checkpoints/step_*.pt (last K) and best.pt
load_model                          a TransformerLM rebuilt from a checkpoint or safetensors file
export_safetensors                  shareable weights
"""

from lm.checkpoint.export import export_safetensors
from lm.checkpoint.io import load_checkpoint, load_model, read_checkpoint, save_checkpoint, write_checkpoint
from lm.checkpoint.manager import CheckpointManager

__all__ = [
    "CheckpointManager",
    "export_safetensors",
    "load_checkpoint",
    "load_model",
    "read_checkpoint",
    "save_checkpoint",
    "write_checkpoint",
]

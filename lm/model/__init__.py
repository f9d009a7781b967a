"""The Transformer language model, its configuration, and parameter / FLOP accounting."""

from lm.model.config import POSITION_TYPES, ModelConfig
from lm.model.transformer import TransformerLM, count_parameters, forward_flops_per_token, sinusoidal_table

__all__ = [
    "POSITION_TYPES",
    "ModelConfig",
    "TransformerLM",
    "count_parameters",
    "forward_flops_per_token",
    "sinusoidal_table",
]

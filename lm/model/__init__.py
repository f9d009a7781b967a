"""The models (the decoder-only LM and the encoder–decoder), their configurations, and accounting.

A model is built from its config by :func:`build_model`, keyed on the config's architecture:
``decoder_lm`` (:class:`ModelConfig` → :class:`TransformerLM`) or ``encoder_decoder``
(:class:`Seq2SeqConfig` → :class:`EncoderDecoder`). The trainer, checkpoint loader, evaluation
and generation go through it and through what a model offers (``loss(batch)``,
``output_weight``, ``device``), never through one class's name.
"""

from __future__ import annotations

from typing import Any

from lm.device import check_dtype
from lm.model.config import ModelConfig
from lm.model.seq2seq import EncoderDecoder, Seq2SeqConfig
from lm.model.transformer import TransformerLM, sinusoidal_table
from lm.nn.choices import check_choice

ARCHITECTURES = {"decoder_lm": (ModelConfig, TransformerLM), "encoder_decoder": (Seq2SeqConfig, EncoderDecoder)}


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig | Seq2SeqConfig:
    """The config a dict describes: ``architecture`` picks the class (default ``decoder_lm``)."""
    d = dict(d)
    arch = d.get("architecture", "decoder_lm")
    check_choice("architecture", arch, ARCHITECTURES)
    if arch == "decoder_lm":
        d.pop("architecture", None)
    return ARCHITECTURES[arch][0].from_dict(d)


def build_model(config: ModelConfig | Seq2SeqConfig, device=None, dtype=None):
    """The model of ``config``, by its architecture."""
    check_dtype("dtype", dtype)
    return ARCHITECTURES[config.architecture][1].from_config(config, device=device, dtype=dtype)


__all__ = [
    "EncoderDecoder",
    "ModelConfig",
    "Seq2SeqConfig",
    "TransformerLM",
    "build_model",
    "model_config_from_dict",
    "sinusoidal_table",
]

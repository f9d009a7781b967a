"""Serving a trained language model: the continuous-batching :class:`Engine` and the
OpenAI-compatible HTTP app around it (``lm serve``)."""

from lm.serve.engine import Engine, EngineStopped, QueueFull, Request, SamplingParams
from lm.serve.translation import TranslationEngine

__all__ = ["Engine", "EngineStopped", "QueueFull", "Request", "SamplingParams", "TranslationEngine", "create_app"]


def create_app(*args, **kwargs):
    """:func:`lm.serve.app.create_app` (imported on use: starlette is only needed to serve)."""
    from lm.serve.app import create_app as create

    return create(*args, **kwargs)

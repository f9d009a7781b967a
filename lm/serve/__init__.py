"""Serving a trained language model: the continuous-batching :class:`Engine` and the
OpenAI-compatible HTTP app around it (``lm serve``)."""

from collections.abc import Sequence

from lm.serve.engine import Engine, EngineStopped, QueueFull, Request, SamplingParams
from lm.serve.protocol import MAX_BODY_BYTES
from lm.serve.translation import TranslationEngine

__all__ = ["Engine", "EngineStopped", "QueueFull", "Request", "SamplingParams", "TranslationEngine", "create_app"]


def create_app(engine: Engine, tokenizer, model_name: str, *, max_body: int = MAX_BODY_BYTES,
               start_engine: bool = True, api_key: str | None = None, allowed_origins: Sequence[str] = ()):
    """The ASGI app serving ``engine``: :func:`lm.serve.app.create_app` (imported on use: starlette is
    only needed to serve)."""
    from lm.serve.app import create_app as create

    return create(engine, tokenizer, model_name, max_body=max_body, start_engine=start_engine, api_key=api_key,
                  allowed_origins=allowed_origins)

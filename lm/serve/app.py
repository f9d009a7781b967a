"""The HTTP side of ``lm serve``: an ASGI app (Starlette) in front of one :class:`Engine`.

Endpoints: ``GET /`` (the playground), ``GET /v1/models`` (and ``/v1/models/{model}``), ``POST
/v1/completions`` (OpenAI's schema, streaming as server-sent events), ``GET /health``, ``GET
/metrics`` (Prometheus text), and
vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, through which a client
(lm-evaluation-harness's remote tokenizer) counts and cuts text in this model's own tokens.
No endpoint reads a path from a request or writes a file. Errors have OpenAI's shape.

Starlette rather than FastAPI: the app is nine routes whose validation must produce OpenAI's
error bodies naming the field, which hand-written checks do directly; FastAPI would add
pydantic and its own 422 error shape to undo.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import math
import re
import sys
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from lm.checks import check_origins
from lm.serve import protocol as api
from lm.serve.engine import Engine, EngineStopped, QueueFull
from lm.serve.engine import Request as EngineRequest

MAX_BODY_BYTES = api.MAX_BODY_BYTES


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any
    model_name: str
    max_body: int = MAX_BODY_BYTES
    draining: bool = False
    inflight: int = 0  # completion requests not yet answered in full
    http: dict[tuple[str, int], int] = field(default_factory=dict)  # (route, status) -> count
    # Prompts are encoded on this one thread, not on the event loop: a 950 kB prompt took 0.43 s there,
    # and every stream stalled meanwhile (one thread: the tokenizer's caches are not shared safely).
    encoder: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "lm-tokenize"))

    async def off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the encoding thread; the event loop serves others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.encoder, functools.partial(fn, *args, **kwargs))


def error_response(e: api.APIError) -> Response:
    """``e`` in OpenAI's error shape. Non-ASCII text is escaped (``ensure_ascii``): a message that
    quotes the request (a field named ``"\\ud800"``) may hold a lone surrogate, which UTF-8 cannot
    encode, and the error had become a plain-text 500 with a traceback in the log."""
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past ``limit`` bytes (checked as it arrives, not only by header)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise api.APIError(413, f"the request body is {int(declared):,} bytes; the limit is {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise api.APIError(413, f"the request body is over the limit of {limit:,} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw, parse_int=_parse_int)
    except _LongInteger as e:
        raise _long_integer_error(raw, e.digits) from None
    except (ValueError, RecursionError) as e:  # nesting too deep: a RecursionError
        raise api.APIError(400, f"the request body is not valid JSON: {e}") from None


class _LongInteger(Exception):
    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str) -> int:
    """JSON's integers, as ``json`` reads them, but one past Python's limit on digits
    (``sys.get_int_max_str_digits()``, 4,300) is :class:`_LongInteger`: the body is valid JSON, and
    its error had read "not valid JSON ... use sys.set_int_max_str_digits()" (serve22)."""
    try:
        return int(text)
    except ValueError:
        raise _LongInteger(len(text.lstrip("-"))) from None


def _long_integer_error(raw: bytes, digits: int) -> api.APIError:
    """A 400 for an integer of ``digits`` digits, naming its field when it is a top-level field's value."""
    limit = sys.get_int_max_str_digits()
    found = re.search(rb'"([A-Za-z_][A-Za-z0-9_]*)"\s*:\s*-?\d{%d}' % (limit + 1), raw)
    name = found.group(1).decode() if found else None
    where = f"{name}: an integer" if name else "the request body holds an integer"
    return api.APIError(400, f"{where} of {digits:,} digits; this server reads integers of at most {limit:,} "
                             "digits", name)


class _Choice:
    def __init__(self, state: ServerState, stops: list[str], prefix: str):
        eot = state.tokenizer.eot_id
        self.text = api.StopText(state.tokenizer, stops, skip=() if eot is None else (eot,),
                                 strip=state.engine.architecture == "encoder_decoder")  # as lm translate writes it
        self.prefix = prefix  # echo: the prompt's text, before the completion's
        self.tokens = 0
        self.done = False
        self.reason: str | None = None
        self.parts: list[str] = []
        self.started = False  # echo: the prompt's text (and records) are out
        self.records: list[api.LogprobRecord] = []  # with logprobs: every token's, the prompt's too (echo)
        self.taken = 0  # records already sent in chunks (streaming)

    def take(self) -> list[api.LogprobRecord]:
        """The records not sent yet: those of the text of the chunk about to be sent."""
        new, self.taken = self.records[self.taken:], len(self.records)
        return new


class Completion:
    """One ``/v1/completions`` call in flight: its engine requests (one per prompt) and the text
    of each choice, fed by the engine's events through an asyncio queue."""

    def __init__(self, state: ServerState, req: api.CompletionRequest):
        self.state, self.req = state, req
        self.id, self.created = api.completion_id(), api.now()
        self.events: asyncio.Queue = asyncio.Queue()
        self.logprobs = req.params.logprobs is not None
        loop = asyncio.get_running_loop()
        n = req.n
        self.choices = [_Choice(state, req.stop, req.texts[i // n] if req.echo else "")
                        for i in range(len(req.prompts) * n)]
        self.requests: list[EngineRequest] = []
        events = self.events
        # The callbacks close over the queue and their request held weakly, not over self: a call's
        # Completion had been a cycle (it holds its requests, their callbacks held it), left to the
        # cyclic collector with its prompts, texts and logprob records (cyc25)
        for p, ids in enumerate(req.prompts):
            own: list[weakref.ref[EngineRequest]] = []

            def on_token(index, token, p=p, own=own):  # the engine's thread: its logprobs for the token are in
                r = own[0]()  # alive: the engine holds it while it calls
                entry = r.logprobs[index][-1] if r is not None and r.logprobs is not None else None
                loop.call_soon_threadsafe(events.put_nowait, (p * n + index, token, None, entry))

            def on_finish(index, reason, p=p):
                loop.call_soon_threadsafe(events.put_nowait, (p * n + index, None, reason, None))

            request = EngineRequest(ids, req.params, n, on_token, on_finish)
            own.append(weakref.ref(request))
            self.requests.append(request)
        self.remaining = len(self.choices)

    def submit(self) -> None:
        """Queue every prompt, or none: a request refused part-way leaves nothing queued."""
        try:
            self.state.engine.submit_all(self.requests)
        except QueueFull as e:
            raise api.APIError(503, f"the server is busy: {e}", type="server_error",
                               headers={"Retry-After": "1"}) from None
        except EngineStopped:
            raise api.APIError(503, "the server is shutting down", type="server_error",
                               headers={"Retry-After": "5"}) from None
        except ValueError as e:  # the engine's own checks (parse_completion makes them all first)
            raise api.APIError(400, str(e), str(e).split(":")[0]) from None

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()

    async def next_pieces(self) -> list[tuple[int, str, str | None, list[api.LogprobRecord]]]:
        """Wait for the next engine event; the (choice, text, finish_reason, logprob records) it
        makes sendable: with echo, the prompt first."""
        index, token, reason, entry = await self.events.get()
        c = self.choices[index]
        if c.done:
            return []  # a token or the end of a choice already cut by a stop string
        pieces = []
        if not c.started:
            c.started = True
            if self.req.echo:
                request = self.requests[index // self.req.n]
                if self.logprobs:  # the prompt's log-probabilities came with the prefill, before any token
                    c.records += api.prompt_records(self.state.tokenizer, request.prompt_ids, request.prompt_logprobs)
                pieces.append((index, c.prefix, None, c.take()))
        if token is not None:
            c.tokens += 1
            text = c.text.push(token)
            if self.logprobs:
                c.records.append((token, len(c.prefix) + c.text.start, entry))
            if c.text.stopped:
                c.done, c.reason = True, "stop"
                self.remaining -= 1
                self.requests[index // self.req.n].stop(index % self.req.n)  # finished, its row freed
                return [*pieces, (index, text, "stop", c.take())]
            return [*pieces, (index, text, None, c.take())] if text else pieces
        if reason == "error":
            raise api.APIError(500, "the model failed while generating; see the server's log", type="server_error")
        c.done, c.reason = True, "stop" if reason == "cancelled" else reason
        self.remaining -= 1
        text = c.text.flush()
        if c.text.stopped:  # the flush completed a stop string (a U+FFFD for a character left open)
            c.reason = "stop"
        return [*pieces, (index, text, c.reason, c.take())]

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.req.prompts)
        return api.usage(prompt, sum(c.tokens for c in self.choices))


async def _watch_disconnect(request: Request, on_disconnect) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.draining:
        raise api.APIError(503, "the server is shutting down", type="server_error", headers={"Retry-After": "5"})
    body = await read_json(request, state.max_body)
    engine = state.engine
    req = await state.off_loop(api.parse_completion, body, state.tokenizer, model_name=state.model_name,
                               max_batch=engine.max_batch, context_length=engine.context_length,
                               eot_id=state.tokenizer.eot_id, architecture=engine.architecture,
                               max_queue=engine.max_queue)
    completion = Completion(state, req)
    completion.submit()
    state.inflight += 1
    if req.stream:
        return _EventStream(_sse(completion), on_close=lambda: _closed(state, completion))
    left = asyncio.Event()  # the client disconnected: its rows are cancelled, and nobody reads the answer

    def client_left() -> None:
        left.set()
        completion.cancel()

    watcher = asyncio.ensure_future(_watch_disconnect(request, client_left))
    try:
        while completion.remaining:
            for index, text, _, _ in await completion.next_pieces():
                completion.choices[index].parts.append(text)
    finally:
        watcher.cancel()
        _closed(state, completion)
    if left.is_set():  # not a 200 in /metrics or the access log: the client got nothing (nginx's 499)
        return Response(status_code=CLIENT_CLOSED)
    choices = [api.choice(i, "".join(c.parts), c.reason,
                          api.logprobs_body(state.tokenizer, c.records) if completion.logprobs else None)
               for i, c in enumerate(completion.choices)]
    return JSONResponse(api.completion_body(completion.id, completion.created, state.model_name, choices,
                                            completion.usage()))


def _closed(state: ServerState, completion: Completion) -> None:
    completion.cancel()  # a no-op for finished rows; frees the rows of a client that left
    state.inflight -= 1


async def _sse(completion: Completion):
    state, req = completion.state, completion.req

    def event(payload: dict) -> bytes:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    try:
        while completion.remaining:
            pieces = await completion.next_pieces()
            for index, text, reason, records in pieces:
                if not text and reason is None and not records:
                    continue
                logprobs = api.logprobs_body(state.tokenizer, records) if completion.logprobs else None
                chunk = api.completion_body(completion.id, completion.created, state.model_name,
                                            [api.choice(index, text, reason, logprobs)], None)
                if req.include_usage:
                    chunk["usage"] = None
                yield event(chunk)
    except api.APIError as e:
        yield event(e.body())
        yield b"data: [DONE]\n\n"
        return
    if req.include_usage:
        yield event(api.completion_body(completion.id, completion.created, state.model_name, [],
                                        completion.usage()))
    yield b"data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose ``on_close`` runs however the response ends: finished, or the
    client gone before or during the stream (when the generator may never have started)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _model_card(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return {"id": state.model_name, "object": "model", "created": request.app.state.started, "owned_by": "lm",
            "max_model_len": state.engine.context_length, "architecture": state.engine.architecture}


async def models(request: Request) -> Response:
    """OpenAI's model list, one model; with vLLM's ``max_model_len`` and the engine's ``architecture``
    (``decoder_lm``, or ``encoder_decoder``: a translation model), which the playground reads."""
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def model(request: Request) -> Response:
    """OpenAI's "retrieve model" (``GET /v1/models/{model}``, the ``openai`` client's
    ``models.retrieve``): the list's one entry, or OpenAI's 404 ``model_not_found`` for another id."""
    api.check_model_name(request.path_params["model"], request.app.state.server.model_name)
    return JSONResponse(_model_card(request))


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    text = api.parse_tokenize(await read_json(request, state.max_body), model_name=state.model_name,
                              translation=state.engine.architecture == "encoder_decoder")
    ids = await state.off_loop(state.tokenizer.encode, text)
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.context_length, "tokens": ids,
                         "token_strs": None})


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    ids = api.parse_detokenize(await read_json(request, state.max_body), state.tokenizer,
                               model_name=state.model_name)
    return JSONResponse({"prompt": state.tokenizer.decode(ids)})


async def tokenizer_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    tok = state.tokenizer
    engine = state.engine
    config = engine.model.config  # a translation model's <bos>, <pad>; the engine's end token either way

    def token(i):
        return None if i is None else tok.decode([i])

    return JSONResponse({"tokenizer_class": f"{type(tok).__module__}.{type(tok).__qualname__}",
                         "eos_token": token(engine.eos_id), "bos_token": token(getattr(config, "bos_id", None)),
                         "pad_token": token(getattr(config, "pad_id", None)), "vocab_size": tok.vocab_size,
                         "special_tokens": list(tok.special_tokens),
                         "model_max_length": state.engine.context_length})


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``: refused, saying why and what to use (a 404 "no such endpoint"
    left an OpenAI chat client guessing). lm trains base models: no chat template to turn messages
    into a prompt, as vLLM refuses chat for a model without one (400)."""
    raise api.APIError(400, "this server's model is a base language model with no chat template, so it serves no "
                            "chat completions; send the text to continue as `prompt` to /v1/completions")


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.engine.error is not None:
        return JSONResponse({"status": "failed", "error": repr(state.engine.error)}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return PlainTextResponse(prometheus_text(request.app.state.server),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


def prometheus_text(state: ServerState) -> str:
    s = state.engine.stats
    out: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{labels} {_sample(value)}" for labels, value in samples)

    metric("lm_http_requests_total", "counter", "HTTP requests by route and status.",
           [(f'{{route="{r}",status="{c}"}}', n) for (r, c), n in sorted(state.http.items())])
    metric("lm_requests_total", "counter", "Completions by outcome (one per prompt and choice: n per prompt).",
           [(f'{{outcome="{k}"}}', v) for k, v in s.requests.items()])
    metric("lm_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", s.prompt_tokens)])
    metric("lm_generation_tokens_total", "counter", "Tokens generated.", [("", s.generated_tokens)])
    metric("lm_queue_depth", "gauge", "Requests waiting for a slot.", [("", s.queue_depth)])
    metric("lm_batch_size", "gauge", "Rows decoding (slots in use) after the last step.", [("", s.batch_size)])
    metric("lm_decode_steps_total", "counter", "Decode steps run, by step size (rows in the step).",
           [(f'{{size="{size}"}}', n) for size, n in sorted(s.steps.items())])
    metric("lm_decode_rows_total", "counter", "Rows decoded, summed over steps (/ steps = mean batch size).",
           [("", s.step_rows)])
    cumulative, buckets = 0, []
    for bound, count in zip((*s.TTFT_BUCKETS, "+Inf"), s.ttft_counts):
        cumulative += count
        buckets.append((f'_bucket{{le="{bound}"}}', cumulative))
    metric("lm_time_to_first_token_seconds", "histogram", "From a request's arrival to its first token.",
           [*buckets, ("_sum", float(s.ttft_sum)), ("_count", cumulative)])
    return "\n".join(out) + "\n"


def _sample(value: float) -> str:
    """A sample's value as Prometheus' clients write it: a float in full (``repr``; ``%g`` kept six
    digits, so a time-to-first-token sum past 1e6 s stood still while requests were added), and
    ``+Inf``, ``-Inf``, ``NaN``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"
    return repr(value)


async def playground(request: Request) -> Response:
    html = resources.files("lm.serve").joinpath("static/playground.html").read_text(encoding="utf-8")
    return Response(html, media_type="text/html; charset=utf-8")


class _Guard:
    """Pure ASGI middleware: OpenAI-shaped errors for anything a route raises, counts by route
    and status for /metrics, and with ``api_key`` a 401 for a request to the API (``/v1/...``, the
    tokenizer endpoints) without ``Authorization: Bearer <api_key>``, as vLLM's ``--api-key``
    (the page, ``/health`` and ``/metrics`` stay open)."""

    def __init__(self, app, state: ServerState, api_key: str | None = None):
        self.app, self.state = app, state
        self.api_key = None if api_key is None else api_key.encode()

    def _refusal(self, scope) -> str | None:
        """Why a request is refused for its API key (a missing one, or a wrong one), or None."""
        if self.api_key is None or scope.get("path", "") in OPEN_ROUTES:
            return None
        given = dict(scope.get("headers") or ()).get(b"authorization")
        if given is None:
            return "this server needs an API key: Authorization: Bearer <key>"
        # the scheme is case-insensitive (RFC 9110, 11.1): "bearer KEY" from a hand-written client is the key too
        if given[:7].lower() == b"bearer " and hmac.compare_digest(given[7:], self.api_key):
            return None
        return "the API key given is not this server's (Authorization: Bearer <key>)"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope.get("path", "")
        if route.startswith("/v1/models/"):  # a model's name may hold a slash (org/name)
            route = "/v1/models/{model}"
        route = route if route in ROUTES else "other"
        status = {"code": 500}
        started = False

        async def send_counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                status["code"], started = message["status"], True
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                raise api.APIError(401, refusal, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await self.app(scope, receive, send_counted)
        except api.APIError as e:
            if not started:
                await error_response(e)(scope, receive, send_counted)
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down, nor leak a traceback
            if not started:
                await error_response(api.APIError(500, f"internal error: {type(e).__name__}",
                                                  type="server_error"))(scope, receive, send_counted)
            raise
        finally:
            key = (route, status["code"])
            self.state.http[key] = self.state.http.get(key, 0) + 1


ROUTES = ("/", "/v1/models", "/v1/models/{model}", "/v1/completions", "/v1/chat/completions", "/health", "/metrics",
          "/tokenize", "/detokenize", "/tokenizer_info")
OPEN_ROUTES = ("/", "/health", "/metrics")  # without the API key (the page asks for it)
CLIENT_CLOSED = 499  # the status of an answer whose client left first (nginx's; nothing is sent)


def create_app(engine: Engine, tokenizer, model_name: str, *, max_body: int = MAX_BODY_BYTES,
               start_engine: bool = True, api_key: str | None = None, allowed_origins: Sequence[str] = ()):
    """The ASGI app serving ``engine`` (started and stopped with the app unless ``start_engine`` is
    False); with ``api_key``, the API answers only requests that carry it (``Authorization: Bearer``).

    ``allowed_origins``: the web origins (``http://localhost:3000``, or ``*`` for any) whose pages may
    call the API from a browser (CORS, as vLLM's ``--allowed-origins``); by default none but the
    server's own, so that a page from elsewhere cannot drive a server on this machine."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key: must be a non-empty string")
    allowed_origins = check_origins(allowed_origins)
    import contextlib
    import time

    state = ServerState(engine, tokenizer, model_name, max_body=max_body)

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        message = "no such endpoint" if status == 404 else f"method {request.method} not allowed here"
        return error_response(api.APIError(status, f"{message}: {request.method} {request.url.path}",
                                           headers=getattr(exc, "headers", None)))  # 405: Allow

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            state.encoder.shutdown(wait=False, cancel_futures=True)
            if start_engine:
                engine.stop()

    app = Starlette(
        routes=[
            Route("/", playground, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: not_found},
        lifespan=lifespan,
    )
    app.state.server = state
    app.state.started = int(time.time())
    app.add_middleware(_Guard, state=state, api_key=api_key)
    if allowed_origins:  # outside the guard: a browser's preflight (OPTIONS) carries no key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    return app

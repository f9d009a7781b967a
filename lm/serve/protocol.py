"""The OpenAI completions API as this server speaks it: parsing a request, shaping responses
and errors, and the text-side work of a choice (decoding ids as they come, stop strings).

Only what the server implements is accepted: a field that would change the result and is
not supported here (``suffix``, ``best_of``, penalties, ``logit_bias``, and vLLM's extensions but
``top_k`` and ``ignore_eos``: ``min_p``, ``stop_token_ids``, guided decoding ...) is a 400 that
names it, never silently ignored. ``logprobs`` and ``echo`` are OpenAI's: each token's log-probability
under the model (over the tokenizer's tokens, before temperature and top-p, as vLLM's) with the
``logprobs`` most likely alternatives and the token itself in ``top_logprobs``, its text in
``tokens`` and where it starts in the choice's text in ``text_offset``; ``echo`` puts the prompt
before the completion, its tokens too when ``logprobs`` is given (the first one's log-probability
``null``), which scores a text (what lm-evaluation-harness's ``local-completions`` asks for);
with ``max_tokens`` 0 it returns the prompt alone, nothing generated (finish_reason ``length``), as
OpenAI's and vLLM's.
"""

from __future__ import annotations

import difflib
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lm.generate.text import TextStreamer
from lm.serve.engine import MAX_LOGPROBS, SamplingParams, TokenLogprobs

MAX_BODY_BYTES = 1 << 20  # the largest request body, by default (413 above it)


class APIError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


UNSUPPORTED = {  # field: the value that means "not used" (OpenAI's, then vLLM's extensions); best_of: = n
    "suffix": "", "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0,
    "min_p": 0, "repetition_penalty": 1, "min_tokens": 0, "stop_token_ids": [], "include_stop_str_in_output": False,
    "skip_special_tokens": True, "use_beam_search": False, "length_penalty": 1, "bad_words": [],
    "allowed_token_ids": None, "prompt_logprobs": None, "truncate_prompt_tokens": None,
    "response_format": {"type": "text"}, "structured_outputs": None,  # guided decoding (vLLM's guided_* before)
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "return_tokens_as_token_ids": False, "logprob_token_ids": [], "repetition_detection": None,
    "prompt_embeds": None, "vllm_xargs": {}, "logits_processors": [],
}  # (null is "not used" for each)
# The fields a completions request may hold: OpenAI's (``user`` only tags the request), vLLM's that this
# server implements (top_k, ignore_eos; priority and cache_salt change nothing here, as add_special_tokens
# does not: this tokenizer adds none) and the UNSUPPORTED ones, refused with their own message. Any
# other field is a 400, as OpenAI's "Unrecognized request argument supplied": taken in silence, a
# misspelt "temprature" or "max_token" gave a plausible answer to a request nobody sent.
COMPLETION_FIELDS = frozenset({
    "model", "prompt", "best_of", "echo", "logprobs", "max_tokens", "n", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "user", "top_k", "ignore_eos", "priority", "cache_salt", "add_special_tokens",
}) | UNSUPPORTED.keys()
_OTHER_NAMES = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs", "max_new_tokens": "max_tokens",
                "stop_sequences": "stop", "num_return_sequences": "n", "do_sample": "temperature",
                "return_token_ids": None}  # (vLLM's: the ids of prompt and completion, not return_tokens_as_...)
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # OpenAI's; vLLM's (refused unless false)
MAX_STOP = 4  # as OpenAI


@dataclass
class CompletionRequest:
    prompts: list[list[int]]  # token ids, one list per prompt
    params: SamplingParams
    n: int
    stop: list[str]
    stream: bool
    include_usage: bool
    echo: bool = False
    texts: list[str] | None = None  # each prompt's text (echo): as sent, or its ids decoded


def _unicode(text: str, name: str) -> str:
    """``text``, refused if it holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one), which is
    no character and has no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{name}: not valid Unicode (a lone surrogate {text[e.start]!r} at character "
                            f"{e.start + 1})", name) from None
    return text


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value > hi or value < lo or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise APIError(400, f"{name}: must be a number in {bound}, got {value!r}", name)
    return float(value)


def _boolean(body: dict, name: str, default: bool, null: bool = True) -> bool:
    """``body[name]`` as true or false; absent (or, with ``null``, null as OpenAI allows) ``default``."""
    value = body.get(name, default)
    if value is None and null:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name}: must be true or false, got {value!r}", name)
    return value


def _integer(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
            or (hi is not None and value > hi):
        where = f" in [{lo}, {hi}]" if lo is not None and hi is not None else f" >= {lo}" if lo is not None else ""
        raise APIError(400, f"{name}: must be an integer{where}, got {value!r}", name)
    return value


def parse_completion(body: Any, tokenizer, *, model_name: str, max_batch: int, context_length: int,
                     eot_id: int | None, architecture: str = "decoder_lm", max_queue: int | None = None
                     ) -> CompletionRequest:
    """Check a ``POST /v1/completions`` body; every problem is a 400 naming its field.
    ``max_queue``: the most prompts the engine queues at once (more in one request can never run).

    For an ``encoder_decoder`` model the prompt is the source and the completion its
    translation: the source and the target each have the context to themselves, and
    ``max_tokens`` defaults to the most the model writes."""
    translation = architecture == "encoder_decoder"
    body = _check_model(body, model_name)
    _known_fields(body, COMPLETION_FIELDS)
    _integer(body, "priority", 0)  # vLLM's scheduling priority: one queue here, so no effect, but an integer
    _boolean(body, "add_special_tokens", True, null=False)
    for name in ("cache_salt", "user"):  # taken and unused (vLLM's prefix-cache salt; OpenAI's end-user id)
        if not isinstance(body.get(name, ""), (str, type(None))):
            raise APIError(400, f"{name}: must be a string, got {body[name]!r}", name)
    for name, unused in UNSUPPORTED.items():
        value = body.get(name, unused)
        if value is not None and not (value == unused and isinstance(value, bool) == isinstance(unused, bool)):
            raise APIError(400, f"{name}: not supported by this server", name)
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "prompt: required", "prompt")
    if isinstance(prompt, str):
        texts_or_ids: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        texts_or_ids = [prompt]  # one prompt as token ids
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        texts_or_ids = prompt
    else:
        raise APIError(400, "prompt: must be a string, a list of strings, or token ids", "prompt")
    if max_queue is not None and len(texts_or_ids) > max_queue:
        raise APIError(400, f"prompt: {len(texts_or_ids)} prompts, more than this server queues at once "
                            f"({max_queue}); send them in smaller requests", "prompt")
    prompts = []
    for p in texts_or_ids:
        if isinstance(p, str) and translation:
            ids = tokenizer.encode(_sentence(p))
        elif isinstance(p, str):
            ids = tokenizer.encode(_unicode(p, "prompt")) if p else ([eot_id] if eot_id is not None else [])
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = list(p)
        else:
            raise APIError(400, "prompt: a list of token ids must hold integers only", "prompt")
        if not ids:
            raise APIError(400, "prompt: empty, and the tokenizer has no end-of-text token to start from"
                           if isinstance(p, str) else "prompt: a list of token ids must not be empty", "prompt")
        vocab = tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside [0, {vocab})", "prompt")
        prompts.append(ids)
    echo = _boolean(body, "echo", False)
    if echo and translation:
        raise APIError(400, "echo: a translation's prompt is in another language; not supported for a "
                            "translation model", "echo")
    if type(body.get("max_tokens")) is int and body["max_tokens"] == 0 and not echo:
        # with echo, 0 scores the prompt (OpenAI's, vLLM's); else there is nothing to do
        raise APIError(400, "max_tokens: must be an integer >= 1 (0 only with echo: the prompt alone), got 0",
                       "max_tokens")
    # the bound that applies: -1 had been "must be >= 0", and 0 then refused as well (serve22)
    max_tokens = _integer(body, "max_tokens", context_length - 1 if translation else 16, 0 if echo else 1)
    longest = max(len(p) for p in prompts)
    if translation:
        if longest + 1 > context_length:  # the source ends in <eos>
            raise APIError(400, f"prompt: {longest} tokens, and this model reads at most {context_length - 1}",
                           "prompt")
        if max_tokens > context_length - 1:  # the target starts with <bos>
            raise APIError(400, f"max_tokens: this model writes at most {context_length - 1} tokens, got "
                                f"{max_tokens}", "max_tokens")
    elif longest + (0 if echo else 1) > context_length:  # no max_tokens can help: the prompt is the field
        most = context_length if echo else context_length - 1
        raise APIError(400, f"prompt: {longest} tokens, and this model's context is {context_length} (at most "
                            f"{most} in the prompt{'' if echo else ', to generate one'})", "prompt")
    elif longest + max_tokens > context_length:
        raise APIError(400, f"max_tokens: this model's context is {context_length} tokens, and the request asks "
                            f"for {longest + max_tokens} ({longest} in the prompt + {max_tokens} to generate)",
                       "max_tokens")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k", None, -1)  # vLLM's extension: -1 or 0 for all tokens
    top_k = top_k if top_k is not None and top_k > 0 else None
    n = _integer(body, "n", 1, 1, max_batch)
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != n):
        raise APIError(400, f"best_of: not supported by this server (only best_of = n, here {n}), got {best_of!r}",
                       "best_of")
    seed = _integer(body, "seed", None)
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = list(stop)
    else:
        raise APIError(400, f"stop: must be a string or a list of at most {MAX_STOP} strings, got {stop!r}", "stop")
    if any(s == "" for s in stops):
        raise APIError(400, "stop: the empty string cannot be a stop sequence", "stop")
    for s in stops:
        _unicode(s, "stop")
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not stream:  # as OpenAI and vLLM
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise APIError(400, "stream_options: must be an object", "stream_options")
    unknown = [k for k in options if k not in STREAM_OPTIONS]
    if unknown:  # as OpenAI's
        raise APIError(400, f"stream_options: unknown field(s) {', '.join(map(repr, unknown))}; this server takes "
                            "include_usage", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "stream_options.include_usage: must be true or false", "stream_options")
    continuous = options.get("continuous_usage_stats")  # vLLM's: usage in every chunk
    if continuous is not None and continuous is not False:
        raise APIError(400, "stream_options.continuous_usage_stats: not supported by this server (usage comes "
                            "once, in the last chunk, with include_usage)", "stream_options")
    ignore_eos = _boolean(body, "ignore_eos", False, null=False)  # vLLM's: a bool, not null
    if ignore_eos and translation:
        raise APIError(400, "ignore_eos: a translation ends at its <eos>; not supported for a translation model",
                       "ignore_eos")
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            ignore_eos=ignore_eos, logprobs=logprobs,
                            prompt_logprobs=logprobs if echo else None)
    texts = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(texts_or_ids, prompts)] \
        if echo else None
    return CompletionRequest(prompts, params, n, stops, stream, include_usage, echo, texts)


def _known_fields(body: dict, fields: frozenset[str] | set[str]) -> None:
    """A 400 naming the first field of ``body`` not in ``fields``, with the likely one meant."""
    for name in body:
        if name not in fields:
            meant = _OTHER_NAMES[name] if name in _OTHER_NAMES else next(
                iter(difflib.get_close_matches(name, sorted(fields), 1, 0.75)), None)
            hint = f" (did you mean {meant!r}?)" if meant else ""
            raise APIError(400, f"Unrecognized request argument supplied: {name}{hint}", name)


def _check_model(body: Any, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None:
        check_model_name(model, model_name)
    return body


def check_model_name(model: Any, model_name: str) -> None:
    """OpenAI's 404 ``model_not_found`` unless ``model`` (a request's, or ``GET /v1/models/{model}``'s)
    is the one served."""
    if model != model_name:
        raise APIError(404, f"model: {model!r} is not served here; this server has {model_name!r}", "model",
                       code="model_not_found")


def _sentence(prompt: str) -> str:
    """A translation model's prompt read as ``lm translate`` reads a line: stripped, not empty, one line."""
    text = _unicode(prompt, "prompt").strip()
    if not text:
        raise APIError(400, "prompt: empty (surrounding whitespace is dropped, as `lm translate` drops "
                            "it): nothing to translate", "prompt")
    if "\n" in text:  # lm translate --input: a sentence a line, one translation a line
        raise APIError(400, "prompt: holds a line break, and a translation model translates one line "
                            "(a sentence, as `lm translate` reads it); send each line as a prompt of its "
                            "own (prompt may be a list)", "prompt")
    return text


def parse_tokenize(body: Any, *, model_name: str, translation: bool = False) -> str:
    """A ``POST /tokenize`` body (vLLM's): the ``prompt`` text, for a ``translation`` model read as
    ``/v1/completions`` reads it (stripped, one line: its whitespace had been counted, 10 tokens for
    a prompt of 5: seq2seq20). ``add_special_tokens`` may be given; this tokenizer adds none either way."""
    body = _check_model(body, model_name)
    _known_fields(body, {"model", "prompt", "add_special_tokens"})
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, f"prompt: must be a string, got {type(prompt).__name__}", "prompt")
    _unicode(prompt, "prompt")
    _boolean(body, "add_special_tokens", True, null=False)  # this tokenizer adds none either way
    return _sentence(prompt) if translation else prompt


def parse_detokenize(body: Any, tokenizer, *, model_name: str) -> list[int]:
    """A ``POST /detokenize`` body (vLLM's): ``tokens``, ids of this tokenizer."""
    body = _check_model(body, model_name)
    _known_fields(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError(400, "tokens: must be a list of token ids", "tokens")
    bad = next((t for t in tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is outside [0, {tokenizer.vocab_size})", "tokens")
    return tokens


class StopText:
    """Text of one choice as its tokens arrive: decoded without splitting a character, cut before
    the first stop string, and never sending text that might yet turn out to start one. With
    ``strip`` (a translation), the text is ``text.strip()``, as ``lm translate`` writes it: its
    leading whitespace never sent, whitespace at its end held until more text follows (and dropped
    at the end); stop strings are looked for in that text."""

    def __init__(self, tokenizer, stops: list[str], skip: tuple[int, ...] = (), strip: bool = False):
        self.streamer = TextStreamer(tokenizer, skip=skip)
        self.stops = stops
        self.held = ""
        self.stopped = False
        self.strip = strip
        self.begun = not strip  # some text other than whitespace has come
        self.dropped = 0  # leading whitespace dropped (characters)
        self.blank = ""  # with strip: the whitespace at the end of the text so far, not sent yet

    def push(self, token_id: int) -> str:
        """The text that can be sent now (possibly ''); ``stopped`` turns True at a stop string."""
        return self._take(self._stripped(self.streamer.push(token_id)))

    @property
    def start(self) -> int:
        """Where the last token's text starts in the text decoded so far (stop strings or not), less
        the leading whitespace dropped."""
        return max(0, self.streamer.start - self.dropped)

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._take(self._stripped(self.streamer.flush()))
        if not self.stopped:
            text, self.held = text + self.held, ""
        self.blank = ""  # the end of the text: its trailing whitespace is dropped
        return text

    def _stripped(self, piece: str) -> str:
        if not self.strip:
            return piece
        if not self.begun:
            kept = piece.lstrip()
            self.dropped += len(piece) - len(kept)
            self.begun, piece = bool(kept), kept
        text = self.blank + piece
        body = text.rstrip()
        self.blank = text[len(body):]
        return body

    def _take(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.held = True, ""
            return text[: min(cuts)]
        keep = 0  # the longest end of the text that is the start of a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# One token of a choice with ``logprobs``: its id, where its text starts in the choice's text, and
# its log-probabilities (None: the prompt's first token, which nothing predicts).
LogprobRecord = tuple[int, int, "TokenLogprobs | None"]


def prompt_records(tokenizer, ids: list[int], logprobs: list[TokenLogprobs | None] | None) -> list[LogprobRecord]:
    """The echoed prompt's records: each token's start in ``tokenizer.decode(ids)``."""
    streamer, records = TextStreamer(tokenizer), []
    for i, token in enumerate(ids):
        streamer.push(token)
        records.append((token, streamer.start, None if logprobs is None else logprobs[i]))
    return records


def token_text(tokenizer, token: int) -> str:
    """A token as ``logprobs`` names it: its text, or, when its bytes are not UTF-8 on their own (a
    piece of a character), ``bytes:`` and the bytes escaped, as OpenAI's (``bytes:\\xe2\\x80``), so
    that two such tokens never share a name."""
    raw = tokenizer.vocab[token]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def logprobs_body(tokenizer, records: list[LogprobRecord]) -> dict[str, list]:
    """OpenAI's ``logprobs`` object of a completion (or of one streamed chunk): ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (the most likely tokens and the token itself, by
    :func:`token_text`; up to ``logprobs`` + 1 of them) and ``text_offset``."""
    def text(token: int) -> str:
        return token_text(tokenizer, token)

    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, offset, entry in records:
        body["tokens"].append(text(token))
        body["text_offset"].append(offset)
        if entry is None:
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        own, top = entry
        alternatives: dict[str, float] = {}
        for i, value in top:
            alternatives[text(i)] = value
        alternatives.setdefault(text(token), own)
        body["token_logprobs"].append(own)
        body["top_logprobs"].append(alternatives)
    return body


def completion_body(cid: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict[str, Any]:
    body = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())

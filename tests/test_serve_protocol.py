"""The request parser of `lm serve` on its own, without a server: each field's bounds at both edges,
its whole message, and the context checks of both architectures at their limits. Mutation testing
found these unchecked: mutants that took a temperature of 2.5, a null `ignore_eos`, a negative
`logprobs` or `true` among /detokenize's ids, or refused a prompt that fits exactly, passed the
server's tests, which named the field of an error but not its bounds."""

import pytest

from lm.serve.engine import MAX_LOGPROBS
from lm.serve.protocol import APIError, StopText, parse_completion, parse_detokenize, parse_tokenize
from lm.tokenizer import EOT, Tokenizer

CONTEXT = 32


@pytest.fixture(scope="module")
def tok():
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT])


def _parse(tok, body, architecture="decoder_lm"):
    return parse_completion(body, tok, model_name="m", max_batch=4, context_length=CONTEXT, eot_id=256,
                            architecture=architecture)


def _refused(tok, body, architecture="decoder_lm") -> APIError:
    with pytest.raises(APIError) as e:
        _parse(tok, body, architecture)
    assert e.value.status == 400 and str(e.value) == e.value.message  # (what a log line shows)
    return e.value


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 2.5, "temperature: must be a number in [0.0, 2.0], got 2.5"),  # OpenAI's range
    ("temperature", -0.1, "temperature: must be a number in [0.0, 2.0], got -0.1"),
    ("top_p", 0, "top_p: must be a number in (0.0, 1.0], got 0"),
    ("top_p", 1.01, "top_p: must be a number in (0.0, 1.0], got 1.01"),
    ("ignore_eos", None, "ignore_eos: must be true or false, got None"),  # vLLM's: a bool, never null
    ("ignore_eos", 1, "ignore_eos: must be true or false, got 1"),
    ("logprobs", -1, f"logprobs: must be an integer in [0, {MAX_LOGPROBS}], got -1"),
    ("logprobs", MAX_LOGPROBS + 1, f"logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {MAX_LOGPROBS + 1}"),
    ("top_k", -2, "top_k: must be an integer >= -1, got -2"),
    ("seed", "7", "seed: must be an integer, got '7'"),  # no bound to name
    ("seed", True, "seed: must be an integer, got True"),
    ("n", 5, "n: must be an integer in [1, 4], got 5"),
    ("max_tokens", -1, "max_tokens: must be an integer >= 1, got -1"),
    ("priority", 0.5, "priority: must be an integer, got 0.5"),
    ("add_special_tokens", None, "add_special_tokens: must be true or false, got None"),
])
def test_a_field_out_of_its_bounds_is_a_400_naming_it_and_its_bounds(tok, field, value, message):
    e = _refused(tok, {"prompt": "ab", field: value})
    assert (e.message, e.param) == (message, field)


@pytest.mark.parametrize("options, message", [
    ({"include_usage": "yes"}, "stream_options.include_usage: must be true or false"),
    ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats: not supported by this server (usage "
                                       "comes once, in the last chunk, with include_usage)"),
    ({"include_usage": True, "x": 1}, "stream_options: unknown field(s) 'x'; this server takes include_usage"),
    ([], "stream_options: must be an object"),
])
def test_stream_options_are_checked_field_by_field(tok, options, message):
    assert _parse(tok, {"prompt": "ab", "stream": True, "stream_options": {"include_usage": True,
                                                                           "continuous_usage_stats": False}}
                  ).include_usage is True
    e = _refused(tok, {"prompt": "ab", "stream": True, "stream_options": options})
    assert (e.param, e.message) == ("stream_options", message)


def test_tokenize_takes_the_model_and_add_special_tokens_fields_and_no_other(tok):
    assert parse_tokenize({"model": "m", "prompt": " ab ", "add_special_tokens": False}, model_name="m") == " ab "
    assert parse_tokenize({"prompt": " ab "}, model_name="m", translation=True) == "ab"  # as lm translate reads it
    with pytest.raises(APIError) as e:
        parse_tokenize({"prompt": "ab", "text": "ab"}, model_name="m")
    assert (e.value.status, e.value.param, e.value.message) == (400, "text", "Unrecognized request argument "
                                                                             "supplied: text")


@pytest.mark.parametrize("prompt, kind", [(None, "NoneType"), (5, "int"), (["ab"], "list"), ({"a": 1}, "dict")])
def test_tokenize_names_the_type_of_a_prompt_that_is_no_string(prompt, kind):
    with pytest.raises(APIError) as e:
        parse_tokenize({"prompt": prompt}, model_name="m")
    assert (e.value.status, e.value.param, e.value.message) == (400, "prompt", f"prompt: must be a string, got {kind}")


def test_an_empty_prompt_starts_from_end_of_text_or_is_refused_without_one(tok):
    """An empty text prompt is the end-of-text token (a story from nothing); with a tokenizer that has
    none it is a 400 saying so (a mutant that took [None] for the prompt had made it a 500)."""
    plain = Tokenizer({i: bytes([i]) for i in range(256)}, [], [])
    assert _parse(tok, {"prompt": ""}).prompts == [[256]]
    assert _parse(tok, {"prompt": ["", "a"]}).prompts == [[256], [97]]
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": ""}, plain, model_name="m", max_batch=4, context_length=CONTEXT, eot_id=None,
                         architecture="decoder_lm")
    assert (e.value.status, e.value.param, e.value.message) == (
        400, "prompt", "prompt: empty, and the tokenizer has no end-of-text token to start from")


def test_stop_text_keeps_whitespace_unless_told_to_strip(tok):
    """Only a translation's text is stripped (the server says so for its choices); by default the
    text is the tokens' text, its spaces and line breaks included."""
    for strip, want in ((False, " a b \n"), (True, "a b")):
        text = StopText(tok, [], strip=strip) if strip else StopText(tok, [])
        assert "".join(text.push(b) for b in b" a b \n") + text.flush() == want


@pytest.mark.parametrize("field, value, read", [
    ("temperature", 2.0, ("temperature", 2.0)), ("temperature", 0, ("temperature", 0.0)),
    ("top_p", 1, ("top_p", 1.0)), ("top_p", 1e-9, ("top_p", 1e-9)),
    ("logprobs", 0, ("logprobs", 0)), ("logprobs", MAX_LOGPROBS, ("logprobs", MAX_LOGPROBS)),
    ("top_k", -1, ("top_k", None)), ("top_k", 0, ("top_k", None)), ("top_k", 3, ("top_k", 3)),
    ("ignore_eos", True, ("ignore_eos", True)), ("seed", -5, ("seed", -5)),
    ("temperature", None, ("temperature", 1.0)), ("max_tokens", None, ("max_tokens", 16)),
    ("max_tokens", CONTEXT - 2, ("max_tokens", CONTEXT - 2)),  # with the prompt's 2 tokens, the whole context
])
def test_a_field_at_its_bounds_or_null_is_taken(tok, field, value, read):
    request = _parse(tok, {"prompt": "ab", field: value})
    assert getattr(request.params, read[0]) == read[1]


def test_the_defaults_are_openais(tok):
    request = _parse(tok, {"prompt": "ab"})
    p = request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.ignore_eos, p.logprobs) == \
        (16, 1.0, 1.0, None, None, False, None)
    assert (request.n, request.stop, request.stream, request.echo) == (1, [], False, False)


def test_max_tokens_past_the_context_is_blamed_on_max_tokens(tok):
    e = _refused(tok, {"prompt": "ab", "max_tokens": CONTEXT - 1})
    assert (e.param, e.message) == ("max_tokens", f"max_tokens: this model's context is {CONTEXT} tokens, and the "
                                                  f"request asks for {CONTEXT + 1} (2 in the prompt + {CONTEXT - 1} "
                                                  "to generate)")


@pytest.mark.parametrize("echo", [False, True])
def test_a_prompt_that_fills_the_context_exactly_is_taken_one_more_token_is_not(tok, echo):
    """Without echo the prompt may take the context less one token (one to generate); with echo and
    max_tokens 0, the whole context (it is scored)."""
    most = CONTEXT if echo else CONTEXT - 1
    extra = {"echo": True, "max_tokens": 0} if echo else {"max_tokens": 1}
    request = _parse(tok, {"prompt": [[5] * most], **extra})
    assert len(request.prompts[0]) == most and request.params.max_tokens == extra["max_tokens"]
    e = _refused(tok, {"prompt": [[5] * (most + 1)], **extra})
    assert e.param == "prompt" and e.message == (
        f"prompt: {most + 1} tokens, and this model's context is {CONTEXT} (at most {most} in the prompt"
        f"{'' if echo else ', to generate one'})")


def test_a_translation_source_that_fills_the_context_is_taken_one_more_token_is_not(tok):
    """A translation's source has the context to itself, less its <eos>; its target likewise."""
    request = _parse(tok, {"prompt": "x" * (CONTEXT - 1)}, "encoder_decoder")
    assert len(request.prompts[0]) == CONTEXT - 1 and request.params.max_tokens == CONTEXT - 1
    e = _refused(tok, {"prompt": "x" * CONTEXT}, "encoder_decoder")
    assert (e.param, e.message) == ("prompt", f"prompt: {CONTEXT} tokens, and this model reads at most {CONTEXT - 1}")
    e = _refused(tok, {"prompt": "x", "max_tokens": CONTEXT}, "encoder_decoder")
    assert (e.param, e.message) == ("max_tokens", f"max_tokens: this model writes at most {CONTEXT - 1} tokens, "
                                                  f"got {CONTEXT}")


@pytest.mark.parametrize("tokens", [[True], [1, False], [1.0], "12", None, [[1]]])
def test_detokenize_takes_a_list_of_integers_only(tok, tokens):
    with pytest.raises(APIError) as e:
        parse_detokenize({"tokens": tokens}, tok, model_name="m")
    assert (e.value.status, e.value.param, e.value.message) == (400, "tokens", "tokens: must be a list of token ids")


def test_detokenize_names_an_id_outside_the_vocabulary(tok):
    assert parse_detokenize({"tokens": [0, 256], "model": "m"}, tok, model_name="m") == [0, 256]
    with pytest.raises(APIError) as e:
        parse_detokenize({"tokens": [0, 257]}, tok, model_name="m")
    assert (e.value.param, e.value.message) == ("tokens", "tokens: token id 257 is outside [0, 257)")


@pytest.mark.parametrize("body, param, message", [
    ([{"prompt": "ab"}], None, "the request body must be a JSON object"),
    ("ab", None, "the request body must be a JSON object"),
    ({"prompt": [[1, "a"]]}, "prompt", "prompt: a list of token ids must hold integers only"),
    ({"prompt": [[1, 2], []]}, "prompt", "prompt: a list of token ids must not be empty"),
    ({"prompt": [1, 300]}, "prompt", "prompt: token id 300 is outside [0, 257)"),
    ({"prompt": 5}, "prompt", "prompt: must be a string, a list of strings, or token ids"),
    ({"prompt": "a\ud800"}, "prompt", "prompt: not valid Unicode (a lone surrogate '\\ud800' at character 2)"),
])
def test_a_body_or_prompt_of_the_wrong_shape_is_a_400_saying_what_it_must_be(tok, body, param, message):
    e = _refused(tok, body)
    assert (e.param, e.message) == (param, message)


@pytest.mark.parametrize("prompt, message", [
    (" \t ", "prompt: empty (surrounding whitespace is dropped, as `lm translate` drops it): nothing to translate"),
    ("a\nb", "prompt: holds a line break, and a translation model translates one line (a sentence, as `lm translate` "
              "reads it); send each line as a prompt of its own (prompt may be a list)"),
])
def test_a_translation_prompt_is_one_line_of_text(tok, prompt, message):
    assert _parse(tok, {"prompt": " a b\n"}, "encoder_decoder").prompts == [list(b"a b")]  # stripped, as read
    e = _refused(tok, {"prompt": ["ok", prompt]}, "encoder_decoder")
    assert (e.param, e.message) == ("prompt", message)


@pytest.mark.parametrize("field, value, message", [
    ("ignore_eos", True, "ignore_eos: a translation ends at its <eos>; not supported for a translation model"),
    ("echo", True, "echo: a translation's prompt is in another language; not supported for a translation model"),
])
def test_what_a_translation_cannot_do_is_refused_naming_the_field(tok, field, value, message):
    e = _refused(tok, {"prompt": "ab", field: value}, "encoder_decoder")
    assert (e.param, e.message) == (field, message)


def test_a_stripped_texts_token_starts_count_from_its_first_character_that_is_not_whitespace(tok):
    """With strip (a translation), the leading whitespace dropped is not counted in where a token's
    text starts (logprobs' text_offset)."""
    text = StopText(tok, [], strip=True)
    starts = []
    for b in b"  ab":
        text.push(b)
        starts.append(text.start)
    assert starts[2:] == [0, 1]

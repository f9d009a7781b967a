"""``lm serve`` over real HTTP: the official ``openai`` client, streaming and not, OpenAI-shaped
errors, a full queue, a client that leaves mid-stream, metrics, and SIGTERM on the real CLI."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from helpers.cli import main_in_one_interpreter
from helpers.collector import collector_off
from helpers.faults import Exited, exit_now, raising
from helpers.serving import ServerThread, model_and_tokenizer, saved_run
from prometheus_client.parser import text_string_to_metric_families

from lm.serve import Engine, Request, SamplingParams, create_app
from lm.serve.process import free_port, start_server
from lm.serve.protocol import token_text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=4, max_queue=16, eos_id=tok.eot_id)
    app = create_app(engine, tok, "tiny", max_body=4096)
    server = ServerThread(app)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    yield SimpleNamespace(url=server.url, engine=engine, tok=tok, model=model, client=client, run=run)
    server.close()


def reference_text(served, prompt: str, max_tokens: int, temperature: float, top_p: float = 1.0, seed=None,
                   n: int = 1) -> list[tuple[str, list[int]]]:
    """What the engine alone makes of a prompt (the same batch shape as the server's)."""
    engine = Engine(served.model, max_batch=served.engine.max_batch, eos_id=served.tok.eot_id)
    tokens = [[] for _ in range(n)]
    engine.submit(Request(served.tok.encode(prompt), SamplingParams(max_tokens, temperature, top_p, seed), n,
                          on_token=lambda i, t: tokens[i].append(t)))
    while engine.step():
        pass
    eot = served.tok.eot_id
    return [(served.tok.decode([t for t in ts if t != eot]), ts) for ts in tokens]


def wait_idle(engine, seconds=10.0):
    deadline = time.time() + seconds
    while engine.busy:
        assert time.time() < deadline, "rows were left in the engine"
        time.sleep(0.01)


def test_openai_client_completion_equals_the_engine(served):
    r = served.client.completions.create(model="tiny", prompt="Lily had", max_tokens=12, temperature=0.8, seed=5)
    (text, tokens), = reference_text(served, "Lily had", 12, 0.8, seed=5)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert r.choices[0].text == text and r.choices[0].index == 0
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] == served.tok.eot_id else "length")
    assert r.usage.prompt_tokens == len(served.tok.encode("Lily had"))
    assert r.usage.completion_tokens == len(tokens) and r.usage.total_tokens == r.usage.prompt_tokens + len(tokens)
    assert [m.id for m in served.client.models.list().data] == ["tiny"]


def test_openai_client_streams_the_same_text(served):
    kwargs = dict(model="tiny", prompt="Tom saw", max_tokens=30, temperature=0.0)
    whole = served.client.completions.create(**kwargs)
    chunks = list(served.client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 2 and "".join(texts) == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")  # the usage chunk's too


def test_several_prompts_and_choices(served):
    r = served.client.completions.create(model="tiny", prompt=["Lily", "The dog"], n=2, max_tokens=8,
                                         temperature=1.0, seed=9)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(["Lily", "The dog"]):
        expected = reference_text(served, prompt, 8, 1.0, seed=9, n=2)
        assert [c.text for c in r.choices[2 * p: 2 * p + 2]] == [t for t, _ in expected]


def test_stop_strings_cut_the_text_streaming_or_not(served):
    kwargs = dict(model="tiny", prompt="Lily had a", max_tokens=40, temperature=0.0)
    full = served.client.completions.create(**kwargs).choices[0].text
    assert len(full) > 12
    stop = full[5:8]
    cut = full[: full.find(stop)]
    r = served.client.completions.create(stop=[stop, "never-seen"], **kwargs)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = served.client.completions.create(stop=stop, stream=True, **kwargs)
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in streamed]
    assert "".join(t for t, _ in pieces) == cut and pieces[-1][1] == "stop"
    wait_idle(served.engine)


def _reference_logprobs(served, ids):
    import torch

    with torch.no_grad():
        return torch.log_softmax(served.model(torch.tensor([ids]))[0].float(), dim=-1)


def test_logprobs_through_the_openai_client_streaming_and_not(served):
    """OpenAI's logprobs object: every generated token's text, log-probability under the model
    without a cache, up to logprobs + 1 alternatives by text (the token itself among them) and
    where it starts in the text; the same pieces streamed."""
    kwargs = dict(model="tiny", prompt="Lily had a", max_tokens=10, temperature=0.9, seed=4, logprobs=2)
    r = served.client.completions.create(**kwargs)
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    ids = served.tok.encode("Lily had a")
    (_, generated), = reference_text(served, "Lily had a", 10, 0.9, seed=4)
    want = _reference_logprobs(served, ids + generated)
    for j, token in enumerate(generated):
        assert lp.tokens[j] == token_text(served.tok, token)  # its text, or bytes:\\x.. for part of a character
        assert abs(lp.token_logprobs[j] - want[len(ids) - 1 + j, token].item()) < 1e-5
        top = lp.top_logprobs[j]
        assert 2 <= len(top) <= 3 and top[lp.tokens[j]] == lp.token_logprobs[j]
        assert max(top.values()) == pytest.approx(want[len(ids) - 1 + j].max().item(), abs=1e-5)
    eot = served.tok.eot_id
    assert c.text == served.tok.decode([t for t in generated if t != eot])
    whole = [(o, p) for t, o, p in zip(generated, lp.text_offset, lp.tokens) if t != eot and not p.startswith("bytes:")]
    assert whole and all(c.text[o: o + len(p)] == p for o, p in whole)  # where each token's text starts
    chunks = [ch.choices[0] for ch in served.client.completions.create(stream=True, **kwargs)]
    joined = {k: sum((getattr(ch.logprobs, k) for ch in chunks if ch.logprobs), []) for k in
              ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == {k: getattr(lp, k) for k in joined} and "".join(ch.text for ch in chunks) == c.text


def test_echo_scores_a_text_as_lm_evaluation_harness_asks(served):
    """lm-evaluation-harness's local-completions loglikelihood request: token ids, echo, logprobs 1,
    max_tokens 1; the continuation's log-likelihood is the sum of token_logprobs[ctxlen:-1]."""
    context, continuation = served.tok.encode("Lily had a"), served.tok.encode(" red ball")
    ids = context + continuation
    body = {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = httpx.post(served.url + "/v1/completions", json=body).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _reference_logprobs(served, ids)
    loglikelihood = sum(want[t - 1, ids[t]].item() for t in range(len(context), len(ids)))
    assert sum(lp["token_logprobs"][len(context):-1]) == pytest.approx(loglikelihood, abs=1e-4)
    greedy = all(tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][len(context):-1],
                                                              lp["top_logprobs"][len(context):-1]))
    assert greedy == all(want[t - 1].argmax().item() == ids[t] for t in range(len(context), len(ids)))
    prompt_text = served.tok.decode(ids)
    assert r["choices"][0]["text"].startswith(prompt_text) and lp["text_offset"][len(ids)] == len(prompt_text)
    pieces = list(zip(lp["text_offset"], lp["tokens"]))[:len(ids)]
    assert [prompt_text[o: o + len(t)] for o, t in pieces] == lp["tokens"][:len(ids)]
    # echo without logprobs, streamed: the prompt's text first, then the completion's
    kwargs = dict(model="tiny", prompt="Tom saw", max_tokens=5, temperature=0.0, echo=True)
    whole = served.client.completions.create(**kwargs).choices[0]
    chunks = [ch.choices[0] for ch in served.client.completions.create(stream=True, **kwargs)]
    assert whole.text.startswith("Tom saw") and whole.logprobs is None
    assert chunks[0].text == "Tom saw" and "".join(ch.text for ch in chunks) == whole.text


def test_echo_with_max_tokens_0_returns_the_prompt_scored_without_generating(served):
    """OpenAI's and vLLM's way to score a text (older lm-evaluation-harness versions send it):
    echo with max_tokens 0 returns the prompt and, with logprobs, its tokens' log-probabilities
    (the first null), finish_reason "length" and no completion token, streaming and not; nothing is
    generated. It had been a 400; max_tokens 0 without echo still is one."""
    tok, client = served.tok, served.client
    ids = tok.encode("Lily had a red ball")
    text, want = tok.decode(ids), _reference_logprobs(served, ids)
    generated = served.engine.stats.generated_tokens
    kwargs = dict(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1, n=2)
    r = client.completions.create(**kwargs)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    for c in r.choices:
        lp = c.logprobs
        assert c.text == text and c.finish_reason == "length"
        assert lp.tokens == [token_text(tok, i) for i in ids] and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] \
            == lp.tokens
        scores = [want[t - 1, ids[t]].item() for t in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(scores, abs=1e-5)
    stream = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 0
    for index, c in enumerate(r.choices):
        chunks = [ch.choices[0] for ch in stream if ch.choices and ch.choices[0].index == index]
        assert "".join(ch.text for ch in chunks) == text and chunks[-1].finish_reason == "length"
        assert sum((ch.logprobs.token_logprobs for ch in chunks if ch.logprobs), []) == c.logprobs.token_logprobs
    plain = client.completions.create(model="tiny", prompt=[ids], max_tokens=0, echo=True).choices[0]
    assert plain.text == text and plain.logprobs is None and plain.finish_reason == "length"
    assert served.engine.stats.generated_tokens == generated
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=text, max_tokens=0)


def test_a_stop_string_ends_a_choice_counted_finished_in_the_metrics(served):
    """A choice cut by a stop string is finished (finish_reason "stop"), in /metrics too: the server
    had ended its row as a cancel, so that stop-string completions counted as abandoned requests."""
    def outcomes():
        wait_idle(served.engine)  # the row freed after the answer: at the engine's next step
        text = httpx.get(served.url + "/metrics").text
        return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "lm_requests_total"}

    base = dict(model="tiny", prompt="Lily had", max_tokens=60, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**base).choices[0].text
    stop = whole[len(whole) // 4: len(whole) // 4 + 2]
    before = outcomes()
    cut = served.client.completions.create(**base, stop=[stop]).choices[0]
    streamed = [ch.choices[0] for ch in served.client.completions.create(**base, stop=[stop], stream=True)]
    assert cut.text == whole[:whole.find(stop)] == "".join(ch.text for ch in streamed)
    assert cut.finish_reason == streamed[-1].finish_reason == "stop"
    after = outcomes()
    assert after["finished"] - before["finished"] == 2 and after["cancelled"] == before["cancelled"]


def test_vllms_tokenizer_endpoints_speak_the_models_tokens(served):
    """POST /tokenize and /detokenize and GET /tokenizer_info, as vLLM's (lm-evaluation-harness's
    remote tokenizer checks for /tokenizer_info with an eos_token and /tokenize returning tokens)."""
    text = "Lily had a red ball. 🙂"
    r = httpx.post(served.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == served.tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 64
    back = httpx.post(served.url + "/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    info = httpx.get(served.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["vocab_size"] == served.tok.vocab_size
    assert info["tokenizer_class"] == f"{type(served.tok).__module__}.{type(served.tok).__qualname__}"
    assert info["model_max_length"] == 64 and info["bos_token"] is None and info["pad_token"] is None
    eos = httpx.post(served.url + "/tokenize", json={"prompt": info["eos_token"]}).json()["tokens"]
    assert eos == [served.tok.eot_id]  # how the harness finds the end-of-text id
    for path, body, param in (("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"), ("/tokenize", {"prompt": "a",
                                                                                         "model": "x"}, "model")):
        r = httpx.post(served.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body)
    assert httpx.get(served.url + "/tokenize").status_code == 405


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "a", "temperature": 5}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "max_tokens": 1000}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "a", "n": 9}, 400, "n"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "a", "stop": ""}, 400, "stop"),  # would stop before every token
    ({"prompt": "a", "stop": ["x", ""]}, 400, "stop"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "a", "echo": "yes"}, 400, "echo"),
    ({"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ({"prompt": "a", "min_p": 0.1}, 400, "min_p"),
    ({"prompt": "a", "stop_token_ids": [3]}, 400, "stop_token_ids"),
    ({"prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "a", "best_of": 2}, 400, "best_of"),
    ({"prompt": "a", "n": 2, "best_of": 1}, 400, "best_of"),
    ({"prompt": "a", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "a", "stream_options": []}, 400, "stream_options"),
    # vLLM's extensions that change the answer: ids as token names, usage in every chunk; and unknown options
    ({"prompt": "a", "logprobs": 1, "return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    ({"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": True, "frobnicate": 1}}, 400,
     "stream_options"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ({"prompt": "a", "top_k": 0.5}, 400, "top_k"),
    ({"prompt": "a", "top_k": -2}, 400, "top_k"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": [1, 2, 999999]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
])
def test_bad_fields_get_openai_errors_that_name_them(served, body, status, param):
    r = httpx.post(served.url + "/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and param.split("_")[0] in err["message"] and err["type"]


def test_a_prompt_longer_than_the_context_is_blamed_on_the_prompt(served):
    """A prompt that fills the context (64 tokens) was refused naming max_tokens, which no value of
    max_tokens could fix (serve7 audit); with echo and max_tokens 0 it is scored, one more is not."""
    full = [5] * 64
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [full], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "prompt: 64 tokens, and this model's context is 64 (at most 63 in the prompt, to generate one)",
        "type": "invalid_request_error", "param": "prompt", "code": None}
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [full], "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [full + [5]], "max_tokens": 0, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "prompt: 65 tokens, and this model's context is 64 (at most 64 in the prompt)")
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [full[:60]], "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # here max_tokens can fix it


def test_prompts_are_encoded_off_the_event_loop(served, monkeypatch):
    """Prompts were encoded on the event loop: one 950 kB prompt stalled every stream for 0.3 s (serve7
    audit). They are encoded on the server's one encoding thread, /tokenize's too."""
    import threading

    where = []
    encode = served.tok.encode
    monkeypatch.setattr(served.tok, "encode", lambda text: where.append(threading.current_thread().name) or
                        encode(text))
    r = httpx.post(served.url + "/v1/completions", json={"prompt": ["Lily", "Tom"], "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.post(served.url + "/tokenize", json={"prompt": "Lily"}).json()["tokens"] == encode("Lily")
    assert len(where) == 3 and all(name.startswith("lm-tokenize") for name in where), where


def test_empty_prompts(served):
    """An empty string starts from the end-of-text token (a new document); an empty list of token
    ids is refused as what it is."""
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 2,
                                                          "total_tokens": 3}
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [[]]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt: a list of token ids must not be empty"
    r = httpx.post(served.url + "/v1/completions", json={"prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_top_k_and_fields_at_their_no_effect_values(served):
    """vLLM's top_k: 1 is greedy, k > 1 samples among the k most likely (the model's, at each
    position), -1 and 0 are all tokens; a field this server does not implement is accepted at the
    value that means 'not used' (presence_penalty 0.0, skip_special_tokens true)."""
    import torch

    base = dict(model="tiny", prompt="Lily had", max_tokens=12, temperature=1.0, seed=8)
    greedy = served.client.completions.create(**{**base, "temperature": 0.0}).choices[0].text
    assert served.client.completions.create(**base, extra_body={"top_k": 1}).choices[0].text == greedy
    plain = served.client.completions.create(**base).choices[0].text
    for off in (-1, 0):
        assert served.client.completions.create(**base, extra_body={"top_k": off}).choices[0].text == plain
    text = served.client.completions.create(**base, extra_body={"top_k": 3}).choices[0].text
    engine = Engine(served.model, max_batch=served.engine.max_batch, eos_id=served.tok.eot_id)
    tokens, ids = [], served.tok.encode("Lily had")
    engine.submit(Request(ids, SamplingParams(12, 1.0, top_k=3, seed=8), on_token=lambda _, t: tokens.append(t)))
    while engine.step():
        pass
    assert text == served.tok.decode([t for t in tokens if t != served.tok.eot_id]) and text != plain
    with torch.no_grad():
        logits = served.model(torch.tensor([ids + tokens]))[0, len(ids) - 1: -1]
    assert all(t in row.topk(3).indices.tolist() for t, row in zip(tokens, logits))  # each among the top 3
    same = served.client.completions.create(**base, presence_penalty=0.0, extra_body={"skip_special_tokens": True})
    assert same.choices[0].text == plain
    # OpenAI's defaults, sent as such (they had been refused: best_of 1, logit_bias {}, stream null)
    same = served.client.completions.create(**base, best_of=1, logit_bias={}, suffix="", extra_body={"stream": None})
    assert same.choices[0].text == plain
    same = served.client.completions.create(**base, extra_body={"return_tokens_as_token_ids": False})
    assert same.choices[0].text == plain
    chunks = list(served.client.completions.create(**base, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": False}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain and chunks[-1].usage is not None
    r = httpx.post(served.url + "/v1/completions", json={**base, "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    # a temperature or top_p that vanishes in float32 had turned the probabilities into NaN, and the
    # engine died with every later request answered 503; below 1e-5 it is greedy, as in vLLM
    for tiny in ({"temperature": 1e-300}, {"temperature": 1e-37}, {"top_p": 1e-300}):
        assert served.client.completions.create(**{**base, **tiny}).choices[0].text == greedy
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


def test_malformed_oversized_and_unknown(served):
    r = httpx.post(served.url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x" * 5000})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunked():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(served.url + "/v1/completions", content=chunked())  # no Content-Length: counted as it comes
    assert r.status_code == 413
    r = httpx.get(served.url + "/v2/nothing")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = httpx.get(served.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json() and r.headers["allow"] == "POST"  # RFC 9110: Allow
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client.completions.create(model="tiny", prompt="a", temperature=-1)


def test_text_that_is_no_unicode_is_a_400(served):
    """JSON may spell a lone surrogate ("\\ud800"), which no UTF-8 holds: the tokenizer had raised
    (a 500 and a traceback in the log)."""
    def post(path, raw: bytes):
        return httpx.post(served.url + path, content=raw, headers={"Content-Type": "application/json"})

    for path, raw, param in (("/v1/completions", rb'{"prompt": "a\ud800b"}', "prompt"),
                             ("/v1/completions", rb'{"prompt": ["ok", "\udc80"], "echo": true}', "prompt"),
                             ("/v1/completions", rb'{"prompt": "a", "stop": ["\ud800"]}', "stop"),
                             ("/tokenize", rb'{"prompt": "\ud83d"}', "prompt")):
        r = post(path, raw)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and "lone surrogate" in err["message"], raw
    r = post("/v1/completions", rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}')  # a pair: 😀
    assert r.status_code == 200
    # A lone surrogate in a field's *name*: the error that quotes it had failed to encode (a plain-text
    # 500 and a traceback); it is OpenAI's 400, the name escaped in the JSON.
    for path, raw, name in (("/v1/completions", rb'{"prompt": "x", "\ud800": 1}', "\ud800"),
                            ("/v1/completions", rb'{"prompt": "x", "max_tok\udfffens": 5}', "max_tok\udfffens"),
                            ("/tokenize", rb'{"prompt": "x", "\ud800": 1}', "\ud800"),
                            ("/detokenize", rb'{"tokens": [1], "\ud800": 1}', "\ud800")):
        r = post(path, raw)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (path, raw)
        err = r.json()["error"]
        assert err["param"] == name and err["message"].startswith(f"Unrecognized request argument supplied: {name}")


def test_integers_past_pythons_digit_limit_json_too_deep_and_more_prompts_than_the_queue(tmp_path_factory):
    """An integer of over 4,300 digits makes json.loads raise ValueError (not JSONDecodeError), and a
    body nested past the recursion limit RecursionError: both had been 500s. A list of more prompts
    than --max-queue had been a 503 "busy" with Retry-After even on an idle server, though no retry
    could succeed: a 400 naming prompt."""
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(Engine(model, max_batch=2, max_queue=3, eos_id=tok.eot_id), tok, "tiny",
                                     max_body=1 << 20))
    try:
        # valid JSON: its error had said "not valid JSON ... use sys.set_int_max_str_digits()" (serve22)
        r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "max_tokens: an integer of 5,000 digits; this server reads integers of at most 4,300 digits",
            "type": "invalid_request_error", "param": "max_tokens", "code": None}
        r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": [1, -' + b"9" * 4301 + b"]}",
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] is None
        assert r.json()["error"]["message"] == ("the request body holds an integer of 4,301 digits; this server "
                                                "reads integers of at most 4,300 digits")
        for bad, message in ((-1, "max_tokens: must be an integer >= 1, got -1"),  # had said ">= 0", then 0 refused
                             (0, "max_tokens: must be an integer >= 1 (0 only with echo: the prompt alone), got 0"),
                             (2.5, "max_tokens: must be an integer >= 1, got 2.5")):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": bad})
            assert r.status_code == 400 and r.json()["error"]["message"] == message
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": -1, "echo": True})
        assert r.json()["error"]["message"] == "max_tokens: must be an integer >= 0, got -1"
        # nested past Python's recursion limit (json.loads raises RecursionError; a test run that raised the
        # limit, as hypothesis may, parses it and the body is no object): a 400 either way, not a 500
        r = httpx.post(server.url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            ("the request body is not valid JSON", "the request body must be a JSON object"))
        r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert r.json()["error"]["message"] == "prompt: 4 prompts, more than this server queues at once (3); " \
                                               "send them in smaller requests"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a"] * 3, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
    finally:
        server.close()


def test_a_client_that_leaves_mid_stream_frees_its_row(served):
    before = served.engine.stats.requests["cancelled"]
    with httpx.stream("POST", served.url + "/v1/completions",
                      json={"prompt": "Lily", "max_tokens": 60, "temperature": 1.0, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    wait_idle(served.engine)
    assert served.engine.stats.requests["cancelled"] >= before  # left early, or finished first on a fast machine
    r = served.client.completions.create(model="tiny", prompt="Tom", max_tokens=4, temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_finished_call_is_freed_without_the_cyclic_collector(served, monkeypatch):
    """A call's Completion held its engine requests, whose callbacks closed over it: a cycle, left
    with its prompts, texts and logprob records to the cyclic collector (cyc25). With the collector
    off, each call is freed once answered, streamed or not, several prompts and logprobs too."""
    import weakref

    import lm.serve.app as app_module

    made = []
    init = app_module.Completion.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(app_module.Completion, "__init__", recorded)
    with collector_off():
        r = served.client.completions.create(model="tiny", prompt=["Lily", "Tom"], n=2, max_tokens=4, logprobs=1)
        assert len(r.choices) == 4
        chunks = list(served.client.completions.create(model="tiny", prompt="The dog", max_tokens=4, stream=True,
                                                       echo=True, logprobs=2))
        assert chunks
        wait_idle(served.engine)
        deadline = time.time() + 10  # the server's thread lets go of a call as its handler returns
        while any(ref() is not None for ref in made) and time.time() < deadline:
            time.sleep(0.01)
        assert len(made) == 2 and [ref() is None for ref in made] == [True, True]


def test_health_and_metrics(served):
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    served.client.completions.create(model="tiny", prompt="Lily", max_tokens=3, temperature=0.0)
    text = httpx.get(served.url + "/metrics").text
    samples, kinds, helps = {}, {}, {}
    for family in text_string_to_metric_families(text):  # Prometheus' own parser of the text format
        kinds[family.name], helps[family.name] = family.type, family.documentation
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    assert kinds == {"lm_http_requests": "counter", "lm_requests": "counter", "lm_prompt_tokens": "counter",
                     "lm_generation_tokens": "counter", "lm_queue_depth": "gauge", "lm_batch_size": "gauge",
                     "lm_decode_steps": "counter", "lm_decode_rows": "counter",
                     "lm_time_to_first_token_seconds": "histogram"}
    # every family says what it counts (a HELP of None had been written as "None": mut30)
    assert all(h[:1].isupper() and h.endswith(".") and h != "None" for h in helps.values()), helps
    assert samples["lm_generation_tokens_total"] >= 3
    assert samples['lm_requests_total{outcome="finished"}'] >= 1
    assert samples["lm_time_to_first_token_seconds_count"] >= 1
    count = samples["lm_time_to_first_token_seconds_count"]
    assert samples['lm_time_to_first_token_seconds_bucket{le="+Inf"}'] == count
    assert samples['lm_http_requests_total{route="/v1/completions",status="200"}'] >= 1
    smallest = served.engine.step_sizes[0]  # a lone request runs in the smallest step
    assert samples[f'lm_decode_steps_total{{size="{smallest}"}}'] >= 2
    for gauge in ("lm_queue_depth", "lm_batch_size"):  # nothing in flight: both gauges are back at zero
        assert samples[gauge] == 0


def _rendered(stats) -> list:
    """The samples of /metrics for these engine stats, as Prometheus' parser reads them."""
    from lm.serve.app import ServerState, prometheus_text

    text = prometheus_text(ServerState(SimpleNamespace(stats=stats), None, "m"))
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_metrics_print_a_float_in_full():
    """The time-to-first-token sum had been printed with %g, six digits: past 1e6 s it stood still
    while requests were added. Prometheus' parser reads back the exact sum."""
    from lm.serve.engine import Stats

    stats = Stats()
    stats.ttft_sum = 1234567.891
    stats.time_to_first_token(4.0)
    got = {s.name: s.value for s in _rendered(stats)}
    assert got["lm_time_to_first_token_seconds_sum"] == 1234567.891 + 4.0
    assert got["lm_time_to_first_token_seconds_count"] == 1
    from lm.serve.app import _sample

    assert [_sample(v) for v in (float("inf"), float("-inf"), float("nan"), 0.1, 3)] == \
        ["+Inf", "-Inf", "NaN", "0.1", "3"]


def test_a_first_token_slower_than_the_last_bucket_is_counted_in_inf_only():
    """Prometheus histogram: bucket le=B counts observations <= B; one of 12 s (past the last
    bound, 10 s) is in +Inf only (mut23a: the overflow index one short put it in le="10")."""
    from lm.serve.engine import Stats

    seconds = (0.005, 0.3, 10.0, 12.0, 99.0)
    stats = Stats()
    for t in seconds:
        stats.time_to_first_token(t)
    got = {(s.name, s.labels.get("le")): s.value for s in _rendered(stats)
           if s.name.startswith("lm_time_to_first_token_seconds")}
    name = "lm_time_to_first_token_seconds_bucket"
    for b in Stats.TTFT_BUCKETS:
        key = next(k for k in got if k[0] == name and k[1] not in (None, "+Inf") and float(k[1]) == b)
        assert got[key] == sum(x <= b for x in seconds), (b, got[key])
    assert got[(name, "+Inf")] == 5 and got[("lm_time_to_first_token_seconds_count", None)] == 5


def test_the_openai_client_retrieves_the_model_and_not_another(served):
    """OpenAI's GET /v1/models/{model} (``models.retrieve``) had been a 404 "no such endpoint"."""
    m = served.client.models.retrieve("tiny")
    listed = served.client.models.list().data[0]
    assert m.id == "tiny" and m.object == "model" and m.model_dump() == listed.model_dump()
    assert m.owned_by == "lm" and isinstance(m.created, int) and abs(m.created - time.time()) < 3600, m
    with pytest.raises(openai.NotFoundError) as e:
        served.client.models.retrieve("other/model")
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    text = httpx.get(served.url + "/metrics").text
    assert 'lm_http_requests_total{route="/v1/models/{model}",status="200"}' in text
    assert 'lm_http_requests_total{route="/v1/models/{model}",status="404"}' in text


def test_a_chat_completion_is_refused_saying_why_and_what_to_use(served):
    """The official client's chat.completions.create had got a 404 "no such endpoint" (serve22): the
    server's model is a base model with no chat template, and the 400 says so and names /v1/completions
    (vLLM refuses chat for a model without a template with a 400 too)."""
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["message"] == ("this server's model is a base language model with no chat template, so it "
                                       "serves no chat completions; send the text to continue as `prompt` to "
                                       "/v1/completions")
    assert e.value.body["type"] == "invalid_request_error"
    counted = httpx.get(served.url + "/metrics").text
    assert 'lm_http_requests_total{route="/v1/chat/completions",status="400"}' in counted


def test_a_model_named_with_a_slash_is_retrieved(tmp_path_factory):
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(Engine(model, max_batch=1, eos_id=tok.eot_id), tok, "org/tiny-1"))
    try:
        r = httpx.get(server.url + "/v1/models/org/tiny-1")
        assert r.status_code == 200 and r.json()["id"] == "org/tiny-1"
        assert httpx.get(server.url + "/v1/models/org").status_code == 404
    finally:
        server.close()


def test_a_request_whose_client_left_before_its_answer_is_counted_499_not_200(tmp_path_factory, monkeypatch):
    """A non-streaming request whose client disconnected had its rows cancelled but was counted
    status 200 in /metrics (and uvicorn's access log), though nothing reached the client."""
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    forward = model.forward

    def slow(*args, **kwargs):  # so that the client surely leaves before the answer is made
        time.sleep(0.02)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow)
    engine = Engine(model, max_batch=1, eos_id=tok.eot_id)
    server = ServerThread(create_app(engine, tok, "tiny"))
    try:
        body = json.dumps({"prompt": "Lily", "max_tokens": 50, "ignore_eos": True}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.time() + 10
            while engine.stats.generated_tokens == 0:  # the request is decoding
                assert time.time() < deadline
                time.sleep(0.01)
        wait_idle(engine)
        deadline = time.time() + 10
        while ("/v1/completions", 499) not in app_http(server):
            assert time.time() < deadline, app_http(server)
            time.sleep(0.01)
        assert ("/v1/completions", 200) not in app_http(server)
        assert engine.stats.requests["cancelled"] == 1 and engine.stats.generated_tokens < 50
    finally:
        server.close()


def app_http(server) -> dict:
    return server.server.config.app.state.server.http


def test_an_api_key_through_the_openai_client(tmp_path_factory):
    """With api_key the official client gets AuthenticationError (401) without it or with another
    key, and its answers with it; the page and /health stay open (the playground test drives it)."""
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(Engine(model, max_batch=2, eos_id=tok.eot_id), tok, "tiny", api_key="k3y"))
    try:
        for key in ("unused", "k3y2"):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                client.completions.create(model="tiny", prompt="Lily", max_tokens=2)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k3y", max_retries=0)
        r = client.completions.create(model="tiny", prompt="Lily", max_tokens=3, temperature=0.0)
        assert r.usage.completion_tokens <= 3 and [m.id for m in client.models.list().data] == ["tiny"]
        assert httpx.get(server.url + "/").status_code == 200 and httpx.get(server.url + "/health").status_code == 200
        # the scheme's case is free (RFC 9110, 11.1): "bearer" was a 401 with the right key (audit serve9)
        for header, status in (("bearer k3y", 200), ("BEARER k3y", 200), ("bearer k3y2", 401), ("Basic k3y", 401),
                               ("Bearerk3y", 401)):
            r = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
            assert r.status_code == status, (header, r.text)
            if status == 401:
                assert r.json()["error"]["message"].startswith("the API key given is not this server's"), r.text
        r = httpx.get(server.url + "/v1/models")  # no Authorization at all: told that a key is needed
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert r.json()["error"] == {"message": "this server needs an API key: Authorization: Bearer <key>",
                                     "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        with pytest.raises(ValueError, match="api_key: must be a non-empty string"):
            create_app(Engine(model, max_batch=1), tok, "tiny", api_key="")
    finally:
        server.close()


def test_a_full_queue_answers_503_with_retry_after(tmp_path_factory):
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=1, max_queue=2, eos_id=None)
    gate = threading.Event()
    step = engine.step
    engine.step = lambda: gate.wait(30) and step()  # hold the engine still while the queue fills
    server = ServerThread(create_app(engine, tok, "tiny"))
    try:
        body = {"prompt": "Lily", "max_tokens": 5, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as first, \
                httpx.stream("POST", server.url + "/v1/completions", json=body) as second:
            assert first.status_code == second.status_code == 200
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "Tom", "max_tokens": 5})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert "busy" in r.json()["error"]["message"]
            gate.set()
            for stream in (first, second):
                assert "data: [DONE]" in list(stream.iter_lines())
        wait_idle(engine)
        assert engine.stats.requests["rejected"] == 1
    finally:
        gate.set()
        server.close()


def test_a_request_refused_part_way_or_left_while_waiting_keeps_no_place_in_the_queue(tmp_path_factory):
    """The queue holds live requests only. A request of several prompts refused part-way (503) had
    left its first prompts queued, counted rejected and then cancelled too; a stream closed while
    it waited had kept its place until it reached the head: with clients that retry, live requests
    got 503s from a queue of dead ones. Now neither keeps a place, at once, and /metrics counts the
    refused choices as rejected only."""
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=4, max_queue=3, eos_id=tok.eot_id)
    server = ServerThread(create_app(engine, tok, "tiny", start_engine=False))  # it steps when the test says
    url = server.url + "/v1/completions"
    answers = []

    def post(body):
        thread = threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=60)), daemon=True)
        thread.start()
        return thread

    def depth(want):
        deadline = time.time() + 10
        while engine.stats.queue_depth != want:
            assert time.time() < deadline, f"queue depth {engine.stats.queue_depth}, not {want}"
            time.sleep(0.01)
        assert f"lm_queue_depth {want}\n" in httpx.get(server.url + "/metrics").text

    try:
        first = post({"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        depth(2)
        r = httpx.post(url, json={"prompt": ["c", "d"], "n": 2, "max_tokens": 2})
        assert r.status_code == 503
        depth(2)  # its first prompt had stayed queued
        assert "this request has 2 prompts" in r.json()["error"]["message"]
        with httpx.stream("POST", url, json={"prompt": "e", "max_tokens": 2, "stream": True}) as gone:
            assert gone.status_code == 200
            depth(3)
        depth(2)  # closed while it waited: its place is free before the engine runs a step
        last = post({"prompt": "f", "max_tokens": 2})
        depth(3)
        while first.is_alive() or last.is_alive():
            engine.step()
        assert [a.status_code for a in answers] == [200, 200]
        assert sorted(len(a.json()["choices"]) for a in answers) == [1, 4]
        assert engine.stats.requests == {"finished": 5, "cancelled": 1, "rejected": 4, "failed": 0}
    finally:
        server.close()


def test_sigterm_gives_a_client_that_stops_reading_the_graceful_timeout_not_for_ever(tmp_path_factory):
    """SIGTERM waits for the engine to finish the requests in it, then for the answers still being
    sent at most the graceful timeout (30 s in `lm serve`, 1 s here): a client that stops reading
    had kept the process up for as long as it did not read."""
    from lm.cli.serve import draining_server

    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=4, eos_id=tok.eot_id)
    app = create_app(engine, tok, "tiny")
    state = app.state.server
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by the accepted socket
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = draining_server(app, host="127.0.0.1", port=0, quiet=True, graceful_shutdown=1.0)
    thread = ServerThread(app, server=server, sock=listener)
    body = json.dumps({"prompt": "Lily", "n": 4, "max_tokens": 60, "logprobs": 20, "echo": True,
                       "ignore_eos": True, "stream": True}).encode()  # about 220 kB of events
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    try:
        client.connect(listener.getsockname())
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # and reads nothing
        deadline = time.time() + 30
        while state.inflight == 0 or engine.busy or engine.stats.requests["finished"] < 4:
            assert time.time() < deadline, "the request did not run"
            time.sleep(0.01)
        time.sleep(0.3)
        assert state.inflight == 1  # its tokens all made, its answer stuck in the buffers
        signalled = time.time()
        server.handle_exit(signal.SIGTERM, None)
        thread.thread.join(15)
        assert not thread.thread.is_alive() and time.time() - signalled < 5
        assert state.inflight == 0 and engine.stats.requests == {"finished": 4, "cancelled": 0, "rejected": 0,
                                                                 "failed": 0}
    finally:
        client.close()
        thread.close()


def test_start_server_fails_naming_the_port_where_another_process_answers(tmp_path_factory):
    """``start_server`` had returned as soon as anything answered /health on the port: another
    server's URL, with its own process about to fail to bind. The listening socket must be its
    process's own (Linux: /proc), else it fails naming the port."""
    from helpers.serving import one_page_server

    run, model, _ = saved_run(tmp_path_factory)
    with one_page_server(b"{}", "application/json") as port:  # another server, answering /health
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        with pytest.raises(RuntimeError, match=f"did not start on port {port} .*another process answers") as e:
            proc, _ = start_server(["--checkpoint", str(run), "--device", "cpu", "--quiet"], port,
                                   stderr=subprocess.PIPE, text=True)
            proc.kill()  # (not reached: it must not return another server's URL)
        assert f"cannot listen on 127.0.0.1:{port}" in str(e.value)
        from lm.serve.process import listens_on

        if sys.platform == "linux":  # the check: the port's listening socket among the process's files
            assert listens_on(os.getpid(), port) is True and listens_on(os.getpid(), free_port()) is False


def test_lm_serve_dtype_bfloat16_answers_as_the_engine_under_autocast(tmp_path_factory):
    """``--dtype bfloat16`` (autocast; ``auto`` picks it on CUDA): the decode steps write autocast's
    keys and values into the float32 cache (this had failed at start-up) and the server answers
    what the engine under the same autocast makes of the prompt."""
    import torch

    run, model, tok = saved_run(tmp_path_factory)
    proc, url = start_server(["--checkpoint", str(run), "--max-batch", "4", "--device", "cpu", "--dtype",
                              "bfloat16"], free_port(), stderr=subprocess.PIPE, text=True)
    try:
        body = {"prompt": "Lily had", "max_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    err = proc.stderr.read()
    assert "Traceback" not in err
    # the banner names the file it serves (a run folder resolves to one of several files)
    assert f"lm serve: {run.name} ({run / 'model.safetensors'}; " in err, err
    engine = Engine(model, max_batch=4, eos_id=tok.eot_id, dtype=torch.bfloat16)
    tokens = []
    engine.submit(Request(tok.encode("Lily had"), SamplingParams(12, 0.8, seed=7, ignore_eos=True),
                          on_token=lambda i, t: tokens.append(t)))
    while engine.step():
        pass
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    assert r.json()["choices"][0]["text"] == tok.decode([t for t in tokens if t != tok.eot_id])


def test_sigterm_finishes_requests_in_flight_refuses_new_ones_and_exits_0(tmp_path_factory):
    run, model, _ = saved_run(tmp_path_factory, context_length=1024, d_model=64)
    proc, url = start_server(["--checkpoint", str(run), "--max-batch", "2", "--device", "cpu"], free_port(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # ignore_eos: the request must still be decoding when the signal comes, not end early at a sampled
        # end-of-text token (a random model draws one every few hundred tokens)
        body = {"prompt": "Lily", "max_tokens": 1000, "temperature": 1.0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # decoding has begun
            proc.send_signal(signal.SIGTERM)
            while (health := httpx.get(url + "/health")).status_code == 200:  # until the signal is handled
                time.sleep(0.01)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "Tom", "max_tokens": 2})
            rest = list(lines)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert health.status_code == 503 and health.json()["status"] == "draining"
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert "data: [DONE]" in rest
        assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")  # finished, not cut
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "SIGTERM: finishing 1 request(s) in flight" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_failing_model_fails_its_requests_and_the_server_exits_1_with_the_traceback(tmp_path_factory):
    """The engine's thread had stored the error, answered 500 and then 503 "shutting down" for ever
    without exiting or logging anything. Now the requests in flight get a 500, the log has the
    traceback, and `lm serve` exits 1 (for a supervisor to restart it), as vLLM's server does."""
    run, model, _ = saved_run(tmp_path_factory)
    port = free_port()
    inject = ("import sys, lm.serve.engine as e\n"
              "def broken(*args, **kwargs):\n    raise RuntimeError('injected failure')\n"
              "e.next_token_and_finite = broken\n"
              "from lm.cli import main\n"
              f"sys.exit(main(['serve', '--checkpoint', {str(run)!r}, '--port', '{port}', '--device', 'cpu']))")
    proc = subprocess.Popen([sys.executable, "-c", inject], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None and time.time() < deadline, "the server did not start"
                time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Lily", "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert proc.wait(60) == 1
        err = proc.stderr.read()
        assert "lm serve: the model failed while generating" in err
        assert "Traceback" in err and "RuntimeError: injected failure" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_serve_refuses_bad_arguments_in_one_line(tmp_path_factory):
    run, model, _ = saved_run(tmp_path_factory)
    import socket

    taken = socket.socket()  # a port in use: uvicorn said so only after loading the model, with exit 1
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for args, message in ((["--port", "70000"], "--port: must be in [0, 65535]"),
                          # uvicorn's `ERROR: [Errno -2] Name or service not known`, exit 3, after loading
                          (["--host", "999.999.1.1"], "--host: cannot resolve '999.999.1.1'"),
                          (["--port", str(port)], f"--port: cannot listen on 127.0.0.1:{port} (Address already "
                                                  "in use)"),
                          (["--max-batch", "0"], "--max-batch: must be >= 1"),
                          (["--step-sizes", "1,x"], "--step-sizes: need whole numbers separated by commas, got '1,x'"),
                          (["--max-batch", "4", "--step-sizes", "2,8"], "--step-sizes: each must be in [1, "
                                                                         "--max-batch=4], got 8"),
                          (["--api-key", " "], "--api-key: must not be empty"),
                          (["--checkpoint", str(run / "missing")], "--checkpoint: file not found")):
        checkpoint = [] if "--checkpoint" in args else ["--checkpoint", str(run)]  # given once: twice is refused
        argv = ["serve", *checkpoint, "--port", "0", *args]  # 8000 may be in use here
        p = subprocess.run([sys.executable, "-m", "lm", *argv], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("lm serve: error:"), p.stderr
        assert message in p.stderr and "Traceback" not in p.stderr
    taken.close()


def test_a_flag_that_needs_no_model_is_refused_before_torch_is_imported(tmp_path):
    """A bad port, batch, key or host was said only after torch and the serving modules were imported
    (2.3-2.8 s on a 2-core machine, 0.7 s now); each is checked first, and torch is never imported."""
    cases = (["--port", "70000"], ["--max-batch", "0"], ["--max-queue", "0"], ["--api-key", " "],
             ["--host", "999.999.1.1"], ["--max-batch", "2", "--step-sizes", "1,4"], ["--port", "0"])
    statuses, errors = main_in_one_interpreter([["serve", "--checkpoint", str(tmp_path / "run"), *args]
                                                for args in cases], timeout=60)
    # the last, a flag that is fine and a checkpoint that is missing, needs the model: torch is imported then
    assert statuses == ["2 False"] * 6 + ["2 True"], (statuses, errors)
    assert len(errors) == len(cases), errors
    for args, line in zip(cases, errors):
        assert line.startswith(f"lm serve: error: {'--checkpoint' if args == ['--port', '0'] else args[-2]}: "), line


def test_the_model_is_named_after_the_run_folder_from_inside_it(tmp_path_factory, monkeypatch, capsys):
    """``--checkpoint .`` (or ``model.safetensors``) from inside the run folder had served the model
    as ``''``, so the README's clients, which ask for the run's name, got 404."""
    from lm.cli import main

    run, model, _ = saved_run(tmp_path_factory)
    names = []

    class Started(Exception):
        pass

    def create_app(engine, tok, name, **kw):
        names.append(name)
        raise Started

    monkeypatch.setattr("lm.serve.app.create_app", create_app)
    monkeypatch.chdir(run)
    for checkpoint in (".", "model.safetensors"):
        with pytest.raises(Started):
            main(["serve", "--checkpoint", checkpoint, "--port", "0", "--device", "cpu", "--max-batch", "1",
                  "--quiet"])
    assert names == [run.name, run.name]
    # bytes that are not UTF-8 (lone surrogates in Python) started the server, then every request was a
    # 500, /health too with the key (serve7 audit)
    odd = run.parent / "run\udcff"
    (odd / "checkpoints").mkdir(parents=True)
    for argv, message in ((["--model-name", ""], "--model-name: must not be empty"),
                          # a folder of no name holding no model: the checkpoint's error first, as for /nonexist
                          (["--checkpoint", "/"], "--checkpoint: run directory '/' holds no model.safetensors"),
                          (["--checkpoint", "/nonexist"], "--checkpoint: file not found: '/nonexist'"),
                          (["--allowed-origins", "*", "localhost:3000"], "--allowed-origins: 'localhost:3000' is "
                           "not an origin: give scheme://host[:port] (http://localhost:3000; no path, no trailing "
                           "slash) or *"),
                          # the value quoted as given (the option's name had been made by replacing every "_")
                          (["--allowed-origins", "http://my_host/"], "--allowed-origins: 'http://my_host/' is "
                           "not an origin: give scheme://host[:port] (http://localhost:3000; no path, no trailing "
                           "slash) or *"),
                          (["--model-name", "m\udcff"], "--model-name: the value is not valid UTF-8 (at character 2); "
                                                        "pass --model-name in UTF-8"),
                          (["--api-key", "k\udcff"], "--api-key: the key (or $LM_API_KEY) is not valid UTF-8 (at "
                                                     "character 2); pass --api-key in UTF-8")):
        checkpoint = [] if "--checkpoint" in argv else ["--checkpoint", "."]  # given once: twice is refused
        assert main(["serve", *checkpoint, "--port", "0", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert names == [run.name, run.name]  # refused before the model loaded
    from lm.cli.serve import served_model_name

    with pytest.raises(ValueError) as e:  # (a .pt checkpoint loads from such a folder; safetensors refuses it)
        served_model_name(str(odd / "checkpoints" / "step_00000001.pt"))
    assert str(e.value) == ("--model-name: the run folder's name 'run\\udcff' is not valid UTF-8 (at character 4); "
                            "pass --model-name in UTF-8")


def test_a_max_batch_that_cannot_fit_is_one_line_naming_it(tmp_path_factory, capsys, monkeypatch):
    """`--max-batch 2**70` was an OverflowError traceback (`[None] * max_batch`), ten million rows
    torch's allocator error, both exit 1, where `lm train` and `lm translate` size their batches
    (clifuzz7 #5). The slots' key/value cache is now counted before it is made, and an allocation
    that fails all the same is one line too."""
    from lm.cli import main

    run, model, _tok = saved_run(tmp_path_factory)
    cfg = model.config
    per_row = 2 * cfg.num_layers * cfg.num_heads * (cfg.context_length + 1) * (cfg.d_model // cfg.num_heads)  # k and v
    for rows in (10**9, 2**70):
        assert main(["serve", "--checkpoint", str(run), "--port", "0", "--max-batch", str(rows), "--quiet"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1, err
        assert err.startswith(f"lm serve: error: --max-batch: a batch of {rows} rows does not fit in memory (their "
                              f"key/value cache needs at least {rows * per_row * 4 / 2**30:,.2f} GiB, cpu has "), err
        assert err.endswith(" GiB free); lower --max-batch\n"), err

    def allocator_fails(self, *args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 42240000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(Engine, "__init__", allocator_fails)
    assert main(["serve", "--checkpoint", str(run), "--port", "0", "--max-batch", "4", "--quiet"]) == 2
    assert capsys.readouterr() == ("", "lm serve: error: --max-batch: a batch of 4 rows does not fit in memory (torch "
                                       "tried to allocate 42240000000 bytes); lower --max-batch\n")


def test_the_counted_cache_is_the_one_the_engine_makes():
    import torch

    from lm.generate.static import StaticKVCache, StaticSeq2SeqCache
    from lm.model import ModelConfig, Seq2SeqConfig, build_model

    lm_model = build_model(ModelConfig(vocab_size=50, context_length=24, d_model=32, num_layers=3, num_heads=4,
                                       d_ff=64))
    mt_model = build_model(Seq2SeqConfig(vocab_size=50, context_length=24, d_model=32, encoder_layers=1,
                                         decoder_layers=2, num_heads=4, d_ff=64))
    for cls, model in ((StaticKVCache, lm_model), (StaticSeq2SeqCache, mt_model), (StaticKVCache, lm_model.to(
            torch.bfloat16))):
        for max_len in (None, 9):
            cache = cls.for_model(model, 5, max_len)
            tensors = [*cache.k, *cache.v, *getattr(cache, "cross_k", []), *getattr(cache, "cross_v", [])]
            assert cache.max_len == (24 if max_len is None else max_len)
            assert cls.bytes_for(model, 5, max_len) == sum(t.numel() * t.element_size() for t in tensors)


def test_api_keys_no_client_can_send_and_model_names_with_line_breaks_are_refused(tmp_path_factory, capsys,
                                                                                  monkeypatch):
    """`--api-key ключ` started a server no OpenAI client could call (httpx and urllib encode a header
    as ASCII or Latin-1), `--api-key $'a\\nb'` one nobody could authenticate to, and `--model-name
    $'a\\nb'` broke the start-up line in two (clifuzz7 #9). Refused before the model loads; the key is
    never shown."""
    from lm.cli import main
    from lm.cli.serve import check_api_key

    run, model, _tok = saved_run(tmp_path_factory)
    loaded = []
    monkeypatch.setattr("lm.cli.common.load_model_and_tokenizer", lambda *a, **k: loaded.append(a))
    advice = ("use printable ASCII characters without spaces (letters, digits, punctuation): HTTP clients send no "
              "others in a Bearer token")
    for argv, message in (
            (["--api-key", "ключ"], f"--api-key: the key (or $LM_API_KEY) has a non-ASCII character at character 1; "
                                   f"{advice}"),
            (["--api-key", "a\nb"], f"--api-key: the key (or $LM_API_KEY) has a control character at character 2; "
                                    f"{advice}"),
            (["--api-key", "sk 1"], f"--api-key: the key (or $LM_API_KEY) has a space at character 3; {advice}"),
            (["--api-key", "key\x7f"], f"--api-key: the key (or $LM_API_KEY) has a control character at character 4; "
                                       f"{advice}"),
            (["--model-name", "a\nb"], "--model-name: the value holds U+000A, a control character or line break, at "
                                       "character 2; pass --model-name without one"),
            (["--model-name", "a\u2028b"], "--model-name: the value holds U+2028, a control character or line break, "
                                           "at character 2; pass --model-name without one")):
        assert main(["serve", "--checkpoint", str(run), "--port", "0", *argv]) == 2
        assert capsys.readouterr() == ("", f"lm serve: error: {message}\n")
    monkeypatch.setenv("LM_API_KEY", "tab\tkey")
    assert main(["serve", "--checkpoint", str(run), "--port", "0"]) == 2
    assert capsys.readouterr().err == ("lm serve: error: --api-key: the key (or $LM_API_KEY) has a control character "
                                       f"at character 4; {advice}\n")
    assert loaded == []
    check_api_key("".join(map(chr, range(33, 127))))  # every visible ASCII character is a key's


def test_a_signal_while_the_event_loop_holds_the_engine_lock_starts_the_drain(tmp_path_factory):
    """uvicorn runs the SIGTERM (Ctrl-C) handler on the main thread between two bytecodes, which may
    be the event loop's inside ``with engine._lock:`` (``submit_all``, ``_withdraw``). The handler
    took that lock (``stop_accepting``) and waited for ever: the server answered nothing, and later
    signals changed nothing. Now it takes no lock: it marks the server draining and returns, and the
    event loop's next tick stops the engine taking requests and exits once it is idle."""
    import asyncio

    from lm.cli.serve import draining_server
    from lm.serve.engine import EngineStopped

    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=1, eos_id=tok.eot_id)
    app = create_app(engine, tok, "tiny", start_engine=False)
    server = draining_server(app, host="127.0.0.1", port=0, quiet=True)
    engine.submit(Request(tok.encode("Lily"), SamplingParams(max_tokens=3)))  # a request in flight
    returned, stuck = threading.Event(), []

    def watchdog():  # the old handler waits for the lock for ever: let it through, so that the test fails
        if not returned.wait(10):
            stuck.append(True)
            engine._lock.release()

    threading.Thread(target=watchdog, daemon=True).start()
    previous = signal.signal(signal.SIGTERM, server.handle_exit)  # as uvicorn installs it
    try:
        engine._lock.acquire()  # as submit_all holds it, on this (the event loop's) thread
        signal.raise_signal(signal.SIGTERM)  # the handler runs here, on this thread
        returned.set()
        if not stuck:
            engine._lock.release()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not stuck, "the signal handler waited for the engine's lock"
    assert app.state.server.draining  # /health and /v1/completions answer 503 from here on

    def tick() -> bool:  # uvicorn's check, every 0.1 s on the event loop: whether to exit
        return asyncio.run(server.on_tick(1))

    assert tick() is False and not engine.accepting  # the drain has begun; the request in flight goes on
    with pytest.raises(EngineStopped):
        engine.submit(Request(tok.encode("Tom"), SamplingParams(max_tokens=3)))
    while engine.busy:
        assert tick() is False
        engine.step()
    assert tick() is True and server.should_exit and engine.stats.requests["finished"] == 1


def _generating(url: str) -> bool:
    text = httpx.get(url + "/metrics").text
    return int(text.split("\nlm_generation_tokens_total ")[1].split()[0]) > 0


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_exits_at_once_though_a_client_stops_reading(tmp_path_factory, second):
    """README: "a second signal exits at once". It had waited the whole graceful timeout (30 s) for a
    client that reads nothing, and a second Ctrl-C had logged a traceback. Now it exits at once with
    one line and status 128 + the signal (143, 130), as ``lm`` does after a signal."""
    run, model, _ = saved_run(tmp_path_factory)
    port = free_port()
    proc, url = start_server(["--checkpoint", str(run), "--max-batch", "4", "--device", "cpu", "--quiet"], port,
                             stderr=subprocess.PIPE, text=True)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    try:
        body = json.dumps({"prompt": ["Lily"] * 16, "n": 4, "max_tokens": 60, "logprobs": 20, "echo": True,
                           "ignore_eos": True, "stream": True}).encode()  # megabytes of events
        client.connect(("127.0.0.1", port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # and reads nothing
        deadline = time.time() + 60
        while not _generating(url):
            assert time.time() < deadline and proc.poll() is None, "the request did not run"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        while httpx.get(url + "/health").status_code == 200:  # until the first signal is handled
            time.sleep(0.01)
        proc.send_signal(second)
        status = proc.wait(10)  # at once: the engine is still busy, and the client reads nothing
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 128 + second
    err = proc.stderr.read()
    assert f"lm serve: {second.name} again: exiting, the requests in flight cut off\n" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_server_announces_the_address_it_listens_on(tmp_path_factory, host):
    """The start line had said ``http://127.0.0.1:0`` for ``--port 0`` (and, with ``--quiet``, said
    nothing, so the port could not be known), and ``http://::1:8470`` for an IPv6 host. It now comes
    once the server listens, with the port it got, and an IPv6 host in brackets."""
    from lm.cli.serve import draining_server, listen_url

    assert listen_url(("::1", 8470, 0, 0)) == "http://[::1]:8470" and listen_url(("0.0.0.0", 80)) == \
        "http://0.0.0.0:80"
    if host == "::1":
        try:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    app = create_app(Engine(model, max_batch=1, eos_id=tok.eot_id), tok, "tiny")
    urls = []
    thread = ServerThread(app, server=draining_server(app, host=host, port=0, quiet=True, announce=urls.append))
    try:
        port = thread.server.servers[0].sockets[0].getsockname()[1]
        assert urls == [f"http://{'[::1]' if host == '::1' else host}:{port}"] and port != 0
        assert httpx.get(urls[0] + "/health").json() == {"status": "ok"}
    finally:
        thread.close()


def test_lm_serve_quiet_on_port_0_says_where_it_listens(tmp_path_factory):
    """``--quiet`` leaves out progress and uvicorn's logs, not the one line saying where the server is:
    with ``--port 0`` nothing else tells the port."""
    import selectors

    run, model, _ = saved_run(tmp_path_factory)
    proc = subprocess.Popen([sys.executable, "-m", "lm", "serve", "--checkpoint", str(run), "--port", "0",
                             "--device", "cpu", "--max-batch", "1", "--quiet"], stderr=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stderr, selectors.EVENT_READ)
            assert sel.select(60), "lm serve --port 0 --quiet said nothing"
        line = proc.stderr.readline()
        assert line.startswith(f"lm serve: {run.name} (") and "/v1 — playground at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split("/v1")[0]
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        proc.terminate()
        assert proc.wait(60) == 0
        assert proc.stderr.read() == ""  # and nothing else
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name, value, no_effect", [
    ("structured_outputs", {"choice": ["yes", "no"]}, None),  # guided decoding in vLLM's CompletionRequest now
    ("logprob_token_ids", [5, 6], []),
    ("repetition_detection", {"max_pattern_size": 2}, None),
    ("prompt_embeds", "AAAA", None),
    ("vllm_xargs", {"x": 1}, {}),
    ("logits_processors", ["x"], []),
    ("response_format", {"type": "json_object"}, {"type": "text"}),
])
def test_vllms_result_changing_extensions_are_refused_at_any_other_value_than_their_no_effect_one(
        served, name, value, no_effect):
    """README: a field that changes the result and is not implemented "is refused unless it holds its
    no-effect value, never ignored". vLLM's current guided decoding (``structured_outputs``), its
    ``logprob_token_ids``, ``repetition_detection``, ``prompt_embeds``, ``vllm_xargs`` and
    ``logits_processors`` had been ignored (200, another answer), and ``response_format``
    ``{"type": "text"}``, OpenAI's no-effect value, refused."""
    base = {"prompt": "Lily had", "max_tokens": 4, "temperature": 0.0, "logprobs": 1}
    r = httpx.post(served.url + "/v1/completions", json={**base, name: value})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": f"{name}: not supported by this server", "type": "invalid_request_error", "param": name,
        "code": None}
    plain = httpx.post(served.url + "/v1/completions", json=base).json()["choices"]
    for unused in [None] if no_effect is None else [None, no_effect]:
        r = httpx.post(served.url + "/v1/completions", json={**base, name: unused})
        assert r.status_code == 200 and r.json()["choices"] == plain, (name, unused)


def test_an_unknown_or_misspelt_field_is_a_400_naming_it_never_ignored(served):
    """{"temprature": 0} sampled at temperature 1 and {"max_token": 3} gave 16 tokens, each a 200 with
    nothing in the log (audit serve9): every field not in the API is now OpenAI's 400 "Unrecognized
    request argument supplied", naming it and the field likely meant. The fields that change nothing
    here (OpenAI's user; vLLM's priority, cache_salt, add_special_tokens) are taken, and checked."""
    base = {"prompt": "Lily had", "max_tokens": 4, "temperature": 0.0}
    for name, value, meant in (("temprature", 0, "temperature"), ("max_token", 3, "max_tokens"),
                               ("max_completion_tokens", 3, "max_tokens"), ("top_logprobs", 5, "logprobs"),
                               ("return_token_ids", True, None), ("foo", 1, None)):
        r = httpx.post(served.url + "/v1/completions", json={**base, name: value})
        hint = f" (did you mean {meant!r}?)" if meant else ""
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"Unrecognized request argument supplied: {name}{hint}", "type": "invalid_request_error",
            "param": name, "code": None}, (name, r.text)
    for path, body in (("/tokenize", {"prompt": "x", "add_special_token": True}), ("/detokenize", {"tokens": [1],
                                                                                                  "skip": 1})):
        r = httpx.post(served.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "Unrecognized request argument supplied: "), (path, r.text)
    plain = httpx.post(served.url + "/v1/completions", json=base).json()["choices"]
    taken = {"user": "u-1", "priority": 3, "cache_salt": "s", "add_special_tokens": False}
    r = httpx.post(served.url + "/v1/completions", json={**base, **taken})
    assert r.status_code == 200 and r.json()["choices"] == plain, r.text
    for name, value in (("user", 5), ("priority", "high"), ("cache_salt", 1), ("add_special_tokens", None)):
        r = httpx.post(served.url + "/v1/completions", json={**base, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)


def test_echo_of_a_prompt_whose_logits_are_not_finite_is_a_500_counted_failed(tmp_path_factory):
    """With echo and ``max_tokens`` 0 nothing is sampled, so the finiteness check of a sampled row
    never ran: NaN log-probabilities gave a traceback and a 500 "internal error: ValueError" (JSON
    has no NaN), or bare ``NaN`` in a stream, counted finished. Now the documented 500, and no NaN."""
    import torch

    _, model, tok = model_and_tokenizer(tmp_path_factory)
    with torch.no_grad():
        model.token_embeddings.weight[7] = float("nan")
    engine = Engine(model, max_batch=2, eos_id=tok.eot_id)
    server = ServerThread(create_app(engine, tok, "tiny"))
    try:
        body = {"prompt": [5, 7, 9], "max_tokens": 0, "echo": True, "logprobs": 1}
        r = httpx.post(server.url + "/v1/completions", json=body)
        error = {"message": "the model failed while generating; see the server's log", "type": "server_error",
                 "param": None, "code": None}
        assert r.status_code == 500 and r.json() == {"error": error}
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line]
        assert lines == ["data: " + json.dumps({"error": error}), "data: [DONE]"]
        good = httpx.post(server.url + "/v1/completions", json={**body, "prompt": [5, 6, 9]})
        assert good.status_code == 200 and len(good.json()["choices"][0]["logprobs"]["token_logprobs"]) == 3
        assert engine.stats.requests == {"finished": 1, "cancelled": 0, "rejected": 0, "failed": 2}
    finally:
        server.close()


def test_a_stop_string_completed_by_the_final_flush_is_a_stop(served, monkeypatch):
    """A stop string ending in U+FFFD, completed only by the replacement character the end of the
    text gives a character left open, cut the text but reported finish_reason "length"."""
    import torch

    import lm.serve.engine as engine_module

    vocab = served.tok.vocab
    dollar, lead = (next(i for i, b in vocab.items() if b == want) for want in (b"$", b"\xed"))

    def scripted(logits, **kw):  # every row's next token: "$", then a UTF-8 lead byte, over and over
        row = next(r for r in served.engine.rows if r is not None and r.generator is kw["generator"])
        return torch.tensor([(dollar, lead)[row.generated % 2]]), torch.tensor([True])

    monkeypatch.setattr(engine_module, "next_token_and_finite", scripted)
    body = {"prompt": "Lily", "max_tokens": 2, "stop": "$\ufffd"}
    r = httpx.post(served.url + "/v1/completions", json=body).json()
    assert r["choices"][0]["text"] == "" and r["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(served.url + "/v1/completions", json={**body, "stop": "\ufffd"}).json()
    assert r["choices"][0]["text"] == "$" and r["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stop": "\ufffd", "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == "$"
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"
    r = httpx.post(served.url + "/v1/completions", json={**body, "stop": "x"}).json()  # no stop: the length
    assert r["choices"][0]["text"] == "$\ufffd" and r["choices"][0]["finish_reason"] == "length"


def test_cors_only_for_the_origins_allowed(tmp_path_factory):
    """--allowed-origins (vLLM's): a page from an allowed origin may call the API from a browser, its
    preflight answered without the key; other origins get no CORS headers. By default none: a page
    from elsewhere cannot drive a server on this machine (serve22 noted that none was possible)."""
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"prompt": "a", "max_tokens": 2}
    plain = ServerThread(create_app(Engine(model, max_batch=1, eos_id=None), tok, "tiny"))
    try:
        r = httpx.options(plain.url + "/v1/completions", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = httpx.post(plain.url + "/v1/completions", json=body, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        plain.close()
    server = ServerThread(create_app(Engine(model, max_batch=1, eos_id=None), tok, "tiny", api_key="k",
                                     allowed_origins=["http://LocalHost:3000"]))
    try:
        r = httpx.options(server.url + "/v1/completions", headers=preflight)  # no key: a preflight carries none
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert r.headers["access-control-max-age"] == "600"  # a browser asks again after ten minutes, not each call
        for method, status in (("GET", 200), ("DELETE", 400)):  # GET /v1/models from a page; nothing else
            r = httpx.options(server.url + "/v1/models", headers={**preflight, "Access-Control-Request-Method": method})
            assert r.status_code == status, (method, r.status_code, r.text)
        r = httpx.post(server.url + "/v1/completions", json=body,
                       headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = {**preflight, "Origin": "http://evil.example"}
        r = httpx.options(server.url + "/v1/completions", headers=other)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.post(server.url + "/v1/completions", json=body,
                       headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
    finally:
        server.close()
    engine = Engine(model, max_batch=1, eos_id=None)
    for bad in ("http://localhost:3000/", "localhost:3000", "http://a/b", ""):
        with pytest.raises(ValueError, match=r"^allowed_origins: .* is not an origin: give scheme://host\[:port\]"):
            create_app(engine, tok, "tiny", allowed_origins=[bad], start_engine=False)
    with pytest.raises(ValueError, match="^allowed_origins: a list of origins, got the string '\\*'$"):
        create_app(engine, tok, "tiny", allowed_origins="*", start_engine=False)
    wild = ServerThread(create_app(Engine(model, max_batch=1, eos_id=None), tok, "tiny", allowed_origins=["*"]))
    try:
        r = httpx.get(wild.url + "/v1/models", headers={"Origin": "http://anywhere.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    finally:
        wild.close()


def test_a_request_without_max_tokens_temperature_and_top_p_gets_openais_defaults(served):
    """OpenAI's completions defaults: max_tokens 16, temperature 1, top_p 1 (mut22b: 15, or greedy by
    default, passed every serving test)."""
    base = {"model": "tiny", "prompt": "Lily had", "seed": 3, "ignore_eos": True}
    r = httpx.post(served.url + "/v1/completions", json=base).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    explicit = httpx.post(served.url + "/v1/completions",
                          json={**base, "max_tokens": 16, "temperature": 1.0, "top_p": 1.0}).json()
    assert r["choices"][0]["text"] == explicit["choices"][0]["text"]
    greedy = httpx.post(served.url + "/v1/completions", json={**base, "temperature": 0.0}).json()
    assert greedy["choices"][0]["text"] != r["choices"][0]["text"]  # the default samples


def test_usage_counts_every_prompt_once_and_every_choices_tokens(served):
    """A mutation (prompt_tokens of the first prompt only) and another (completion_tokens of the first
    choice only): test_several_prompts_and_choices checks the texts, not the usage. OpenAI counts
    each prompt once (not once per choice) and the tokens of every choice."""
    prompts = ["Lily", "The dog ran"]
    r = served.client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=8, temperature=1.0, seed=9)
    completion = sum(len(tokens) for p in prompts for _, tokens in reference_text(served, p, 8, 1.0, seed=9, n=2))
    prompt = sum(len(served.tok.encode(p)) for p in prompts)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt, completion, prompt + completion)


def test_echo_of_several_prompts_with_n_choices_starts_each_choice_with_its_own_prompt(served):
    """A mutation (the echoed prefix of choice i taken as prompt i % len(prompts), not i // n):
    choices are grouped by prompt (n per prompt, test_several_prompts_and_choices), so with two
    prompts and n=2 the second choice echoed the second prompt. No test echoes several prompts."""
    prompts = ["Lily", "The dog ran"]
    r = served.client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=3, temperature=1.0, seed=4,
                                         echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        prompt = prompts[c.index // 2]
        generated = [t for t, _ in reference_text(served, prompt, 3, 1.0, seed=4, n=2)][c.index % 2]
        assert c.text == prompt + generated


def test_a_stream_is_server_sent_events_that_no_cache_or_proxy_holds_back(served):
    """A mutation (the stream's Cache-Control and X-Accel-Buffering headers dropped): nginx buffers
    a proxied response unless told `X-Accel-Buffering: no`, and the client would see the tokens
    only at the end; server-sent events are sent `Cache-Control: no-cache` (WHATWG HTML, 9.2)."""
    import httpx

    body = {"model": "tiny", "prompt": "Lily", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].split(";")[0] == "text/event-stream"
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        assert "data: [DONE]" in list(r.iter_lines())


def test_health_of_a_failed_engine_is_a_503_saying_failed():
    """A mutation (/health of a failed engine answers 200): a load balancer or Kubernetes probe takes
    a 200 for a live server, and kept sending requests to one whose model had failed (every request
    a 500). No test asks /health after a failure (the failing-model test only waits for the 200)."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from lm.serve import create_app

    engine = SimpleNamespace(error=RuntimeError("boom"), max_batch=1, max_queue=1, context_length=8,
                             architecture="decoder_lm")
    app = create_app(engine, SimpleNamespace(eot_id=None), "m", start_engine=False)
    r = TestClient(app).get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "failed", "error": "RuntimeError('boom')"})


def _stub_app(**kw):
    """An app over a stub engine that never runs: enough for what the middleware and routes decide
    before any generation."""
    engine = SimpleNamespace(error=None, max_batch=1, max_queue=1, context_length=8, architecture="decoder_lm")
    return create_app(engine, SimpleNamespace(eot_id=None), "m", start_engine=False, **kw)


def test_with_an_api_key_every_route_but_the_page_health_and_metrics_needs_it():
    """A mutation (/tokenizer_info added to the routes open without the key) survived: the API-key
    test asks only /v1/models, /v1/completions, / and /health. The README: with --api-key "the API
    answer[s] only requests with Authorization: Bearer <key> ... /health and /metrics stay open"; the
    tokenizer endpoints are the API (they count and cut text in the model's tokens)."""
    from starlette.testclient import TestClient

    client = TestClient(_stub_app(api_key="k3y"), raise_server_exceptions=False)
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/m"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/tokenizer_info")):
        r = client.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
        assert r.headers["WWW-Authenticate"] == "Bearer", path
    assert client.get("/health").status_code == 200  # open (the stub has no stats for /metrics to render)


def test_the_page_is_the_packaged_playground():
    """``GET /`` serves the page shipped in the package, as HTML (mut30: an empty body survived the
    suite outside the browser test)."""
    from importlib import resources

    from starlette.testclient import TestClient

    r = TestClient(_stub_app()).get("/")
    want = resources.files("lm.serve").joinpath("static/playground.html").read_text(encoding="utf-8")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.text == want and "<textarea" in want


def test_every_route_answers_another_method_with_405_naming_its_own():
    """A mutation (the chat route's ``methods`` dropped, so that it took every method) survived: the
    405 test asks one route. RFC 9110 (15.5.6): a 405 carries ``Allow``, the route's methods (in no
    fixed order); Starlette adds HEAD to a GET route."""
    from starlette.testclient import TestClient

    client = TestClient(_stub_app(), raise_server_exceptions=False)
    routes = {"GET": ("/", "/v1/models", "/v1/models/m", "/health", "/metrics", "/tokenizer_info"),
              "POST": ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")}
    for method, paths in routes.items():
        other = "POST" if method == "GET" else "GET"
        for path in paths:
            r = client.request(other, path)
            assert r.status_code == 405, (other, path, r.status_code)
            allowed = set(r.headers["allow"].split(", "))  # in the order of Starlette's set of methods
            assert allowed == ({"GET", "HEAD"} if method == "GET" else {"POST"}), (path, allowed)
            assert r.json()["error"]["message"] == f"method {other} not allowed here: {other} {path}"
        r = client.request("DELETE", paths[0])
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", paths[0]


def _unstarted(served, **kw):
    """A client of an app over an engine of the served model that was never started (nothing decodes)."""
    from starlette.testclient import TestClient

    engine = Engine(served.model, max_batch=1, max_queue=4, eos_id=served.tok.eot_id)
    return engine, TestClient(create_app(engine, served.tok, "tiny", start_engine=False, **kw),
                              raise_server_exceptions=False)


def test_a_draining_server_refuses_completions_before_reading_them(served):
    """Once a signal marks the server draining, a completion gets OpenAI's 503 ``server_error`` with
    ``Retry-After: 5`` before its body is read (even a body that is not JSON), and ``/health`` says
    ``draining``; the tests that check this over a real signal start `lm serve` as a process, which
    mutation testing cannot see (the error's type mutated survived)."""
    engine, client = _unstarted(served)
    client.app.state.server.draining = True
    for body in ({"prompt": "Lily", "max_tokens": 2}, {"prompt": "Lily", "stream": True}, None):
        r = (client.post("/v1/completions", json=body) if body is not None else
             client.post("/v1/completions", content=b"not json", headers={"Content-Type": "application/json"}))
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", (body, r.status_code, r.headers)
        assert r.json()["error"] == {"message": "the server is shutting down", "type": "server_error",
                                     "param": None, "code": None}, body
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert health.headers["Retry-After"] == "5"
    assert engine.stats.requests["rejected"] == 0


def test_a_stopped_engine_answers_503_shutting_down_with_retry_after(served):
    """A request that reaches an engine already stopped (the lifespan's end, or a failed thread
    torn down) is OpenAI's 503 ``server_error`` with ``Retry-After: 5`` (mut30: the header's name
    mutated survived), as a draining server answers, not a 500 from the engine's exception."""
    engine, client = _unstarted(served)
    engine.stop()
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": "Lily", "max_tokens": 2, "stream": stream})
        assert r.status_code == 503 and r.headers["Retry-After"] == "5", (stream, r.status_code, r.headers)
        assert r.json()["error"] == {"message": "the server is shutting down", "type": "server_error",
                                     "param": None, "code": None}
    assert engine.stats.requests["rejected"] == 0  # refused for the state it is in, not counted as a full queue


def test_an_engine_refusal_the_parser_let_through_is_a_400_naming_its_field(served, monkeypatch):
    """``parse_completion`` makes the engine's checks first; should the engine refuse a request
    anyway (its ``ValueError``, ``"field: why"``), the answer is a 400 naming that field, not a 500
    (mut30: the field taken from the wrong side of the colon survived)."""
    engine, client = _unstarted(served)

    def refuse(requests):
        raise ValueError("max_tokens: 9 new tokens do not fit: the cache holds 8")

    monkeypatch.setattr(engine, "submit_all", refuse)
    r = client.post("/v1/completions", json={"prompt": "Lily", "max_tokens": 9})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "max_tokens: 9 new tokens do not fit: the cache holds 8", "type": "invalid_request_error",
        "param": "max_tokens", "code": None}


def test_a_stream_with_include_usage_sends_usage_null_in_every_chunk_but_the_last(served):
    """A mutation (the ``"usage": null`` of each chunk dropped) survived: the streaming test reads
    the last chunk's usage only. OpenAI's API reference (stream_options.include_usage): "All other
    chunks will also include a usage field, but with a null value"; a client that reads
    ``chunk["usage"]`` (not ``.get``) failed on the first chunk."""
    body = {"model": "tiny", "prompt": "Lily", "max_tokens": 4, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", served.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(chunks) >= 2 and chunks[-1]["choices"] == []
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == len(served.tok.encode("Lily")) and usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # without include_usage, no chunk carries the field (OpenAI's chunks have none)
    body["stream_options"] = {"include_usage": False}
    with httpx.stream("POST", served.url + "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all("usage" not in c or c["usage"] is None for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_cancels_ends_with_an_openai_finish_reason_and_leaves_none_in_flight(served, stream):
    """Two mutations survived the in-process selection: a choice the engine ended as "cancelled"
    (the engine stopped with the request still in it) answered ``finish_reason: "cancelled"``, which
    is not one of OpenAI's values (stop, length, content_filter; the openai client's Literal); and
    ``state.inflight`` no longer counted down when an answer was done, so the drain's "finishing N
    request(s) in flight" counted every request ever served."""
    engine = Engine(served.model, max_batch=1, max_queue=4, eos_id=served.tok.eot_id)  # never started: it waits
    app = create_app(engine, served.tok, "tiny", start_engine=False)
    server = ServerThread(app)
    state = app.state.server
    out = {}

    def ask():
        body = {"model": "tiny", "prompt": "Lily", "max_tokens": 5, "stream": stream}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        out["status"] = r.status_code
        out["text"] = r.text

    try:
        t = threading.Thread(target=ask)
        t.start()
        deadline = time.time() + 10
        while engine.stats.queue_depth < 1:
            assert time.time() < deadline, "the request never reached the queue"
            time.sleep(0.01)
        assert state.inflight == 1
        engine.stop()  # the request still waits: it is finished "cancelled"
        t.join(20)
        assert out["status"] == 200
        if stream:
            events = [json.loads(line[6:]) for line in out["text"].splitlines() if line.startswith("data: {")]
            reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
            reason = [x for x in reasons if x is not None]
            assert len(reason) == 1
            reason = reason[0]
        else:
            reason = json.loads(out["text"])["choices"][0]["finish_reason"]
        assert reason in ("stop", "length", "content_filter"), reason
        deadline = time.time() + 5
        while state.inflight:
            assert time.time() < deadline, f"inflight stays {state.inflight} with nothing in flight"
            time.sleep(0.01)
    finally:
        server.close()


def test_a_413_names_the_declared_size_of_a_body_over_the_limit_before_reading_it():
    """A mutation (the Content-Length check dropped, the body counted as it arrives only) survived:
    the same 413, but after reading the body up to the limit, and the message no longer says how
    large the body is. The declared size is the client's own Content-Length."""
    from starlette.testclient import TestClient

    client = TestClient(_stub_app(max_body=4096))
    body = json.dumps({"prompt": "x" * 5000}).encode()
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == f"the request body is {len(body):,} bytes; the limit is 4,096"


def test_a_route_that_fails_unexpectedly_answers_openais_error_shape_not_a_plain_text_500():
    """A mutation (_Guard's OpenAI-shaped 500 for an unexpected exception dropped) survived: the
    exception then reached Starlette's ServerErrorMiddleware, whose answer is a plain-text
    "Internal Server Error" that no OpenAI client can read as an error. The module docstring:
    "Errors have OpenAI's shape". Here a stub engine without ``model`` makes /tokenizer_info raise
    AttributeError, standing in for a bug."""
    from starlette.testclient import TestClient

    app = _stub_app()
    r = TestClient(app, raise_server_exceptions=False).get("/tokenizer_info")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "internal error: AttributeError", "type": "server_error", "param": None,
                                  "code": None}}
    assert app.state.server.http[("/tokenizer_info", 500)] == 1  # counted for /metrics as the 500 it is


def test_a_request_cancelled_before_its_answer_is_counted_and_stays_cancelled():
    """A mutation (_Guard's status before any answer stored under another key) survived: every
    tested route answers, so the "nothing was sent" count was never read. A request cancelled
    before its answer starts (the server shutting down its tasks) then raised KeyError from the
    middleware's ``finally`` in place of the CancelledError, and was not counted. It is counted as
    a 500 for /metrics and the cancellation goes on up unchanged."""
    import asyncio

    from lm.serve.app import ServerState, _Guard

    async def cancelled_route(scope, receive, send):
        raise asyncio.CancelledError

    state = ServerState(SimpleNamespace(), None, "m")
    guard = _Guard(cancelled_route, state)

    async def call():
        await guard({"type": "http", "path": "/v1/completions", "headers": []}, None, None)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(call())
    assert state.http == {("/v1/completions", 500): 1}


def test_serve_refuses_port_65536_naming_port_before_loading_anything(tmp_path, capsys):
    """A mutation (`--port` checked against [0, 65536]) survived: the test gives 70000 only.
    getaddrinfo takes 65536 as port 0 (it wraps), so the listen check passed, the model loaded, and
    uvicorn's bind then failed with an OverflowError traceback. A TCP port is 16 bits (RFC 793)."""
    from lm.cli import main

    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "65536"]) == 2
    assert capsys.readouterr() == ("", "lm serve: error: --port: must be in [0, 65535], got 65536\n")


def test_a_runs_checkpoints_folder_serves_the_model_under_the_runs_name(tmp_path):
    """A mutation (`--checkpoint RUN/checkpoints` no longer named after RUN) survived: the model was
    served as "checkpoints", so a client asking for the run's name got 404. served_model_name's
    comment: "RUN/checkpoints: the run's name"; a folder named checkpoints that holds its own
    checkpoints/ is a run folder itself."""
    from lm.cli.serve import served_model_name

    run = tmp_path / "tiny-run"
    (run / "checkpoints").mkdir(parents=True)
    assert served_model_name(str(run / "checkpoints")) == "tiny-run"
    assert served_model_name(str(run / "checkpoints" / "step_00000010.pt")) == "tiny-run"
    nested = tmp_path / "checkpoints"  # a run that is itself named checkpoints
    (nested / "checkpoints").mkdir(parents=True)
    assert served_model_name(str(nested)) == "checkpoints"


@pytest.mark.parametrize("fails", [False, True])
def test_lm_serve_in_this_process_hands_its_options_to_the_app_and_the_server(tmp_path_factory, monkeypatch, capsys,
                                                                             fails):
    """cmd_serve's end (the app's options, the server it starts, its start-up line, the engine's error
    callbacks, its exit status) ran only in the tests that start `lm serve` as a process, which
    mutation testing cannot see: --max-body passed on as None, the app not given to the server, the
    start-up line dropped, all survived. Here the server is a stand-in (lm_serve_in_process) that
    records what it is given, says where it listens, and returns (after the engine fails, for ``fails``)."""
    import torch
    from helpers.serving import lm_serve_in_process

    run, model, _ = saved_run(tmp_path_factory)

    def serving(made):
        engine = made["engine"]
        if fails:  # as the engine's thread does when the model raises
            engine.error = RuntimeError("the model broke")
            engine.on_error(engine.error)
        engine.on_row_error(None, ValueError("one row broke"))

    for key in (["--api-key", "k3y"], []):
        argv = ["--checkpoint", str(run), "--port", "0", "--max-batch", "2", "--max-queue", "7", "--max-body",
                "12345", "--allowed-origins", "http://localhost:3000", "--model-name", "tiny", "--device", "cpu",
                "--dtype", "bfloat16" if key else "float32", "--quiet", *key]
        status, made = lm_serve_in_process(monkeypatch, argv, serving)
        assert status == (1 if fails else 0)
        assert made["name"] == "tiny" and made["server_app"] is made["app"]
        assert made["app_kwargs"] == {"max_body": 12345, "api_key": key[1] if key else None,
                                      "allowed_origins": ("http://localhost:3000",)}
        assert {k: v for k, v in made["server_kwargs"].items() if k != "announce"} == {
            "host": "127.0.0.1", "port": 0, "quiet": True}
        engine = made["engine"]
        assert type(engine) is Engine and (engine.max_batch, engine.max_queue) == (2, 7)
        assert engine.dtype == (torch.bfloat16 if key else None)  # autocast's; float32: the weights' own (None)
        err = capsys.readouterr().err.splitlines()
        where = "http://127.0.0.1:1234"
        assert err[0] == (f"lm serve: tiny ({run / 'model.safetensors'}; {model.num_parameters():,} parameters, "
                          f"context {model.config.context_length}, max batch 2) at {where}/v1 — playground at "
                          f"{where}/" + (" (the API needs the key)" if key else "")), err[0]
        if fails:  # every request in flight got a 500; the server drains and exits 1, with the traceback
            assert err[1] == ("lm serve: the model failed while generating (every request in flight got a 500); "
                              "exiting:")
            assert err[2:] == ["RuntimeError: the model broke",  # (raised nowhere here: no frames to show)
                               "lm serve: a request failed: one row broke"], err
            assert made["server"].should_exit and made["app"].state.server.draining
        else:
            assert not made["server"].should_exit and not made["app"].state.server.draining
            assert err[1:] == ["lm serve: a request failed: one row broke"], err


def test_lm_serve_warns_even_when_quiet_if_its_step_gives_a_row_other_bits_in_other_slots(tmp_path_factory,
                                                                                         monkeypatch, capsys):
    """The server cannot keep its promise (a seeded request's text the same beside others as alone)
    when no decode step is slot-invariant on the device: said even with --quiet. Made so here by an
    engine that finds its steps not invariant; the line was tested by nothing (mutation)."""
    from helpers.serving import lm_serve_in_process

    run, model, _ = saved_run(tmp_path_factory)
    init = Engine.__init__

    def not_invariant(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.slot_invariant = False

    monkeypatch.setattr(Engine, "__init__", not_invariant)
    status, made = lm_serve_in_process(monkeypatch, ["--checkpoint", str(run), "--port", "0", "--max-batch", "4",
                                                     "--device", "cpu", "--quiet"])
    assert status == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("lm serve: warning: the 4-row decode step gives a row other bits in other slots on this "
                      "device, and no wider step does either: a seeded request may get other text beside others "
                      "than alone"), err
    assert err[1].startswith(f"lm serve: {run.name} (") and len(err) == 2, err


@pytest.mark.parametrize("quiet", [False, True])
def test_a_signal_starts_the_drain_and_says_what_it_finishes_unless_quiet(tmp_path_factory, capsys, quiet):
    """The drain's line ("finishing N request(s) in flight ...") and uvicorn's log level were seen only
    by the tests that start `lm serve` as a process. The first SIGTERM marks the server draining
    (503s); its next tick stops the engine accepting, says so, and, the engine idle, exits."""
    import asyncio

    from lm.cli.serve import draining_server

    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=2, eos_id=tok.eot_id)
    app = create_app(engine, tok, "tiny")
    server = draining_server(app, host="127.0.0.1", port=0, quiet=quiet, graceful_shutdown=7.5)
    config = server.config
    assert (config.log_level, config.access_log, config.timeout_graceful_shutdown) == (
        ("warning", False, 7.5) if quiet else ("info", True, 7.5))
    server.handle_exit(signal.SIGTERM, None)
    assert app.state.server.draining and not server.should_exit
    asyncio.run(server.on_tick(1))
    assert server.should_exit and not engine.accepting
    assert capsys.readouterr().err == ("" if quiet else "lm serve: SIGTERM: finishing 0 request(s) in flight (then "
                                                        "at most 7.5 s to send them); new ones get 503\n")


def test_served_model_name_names_the_run_folder_holding_a_control_character(tmp_path):
    """A run folder's name is the model's id unless --model-name is given: a line break in it is
    refused naming the folder (it would break the start-up line and every response's id)."""
    from lm.cli.serve import served_model_name

    run = tmp_path / "a\nb"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError) as e:
        served_model_name(str(run / "checkpoints" / "step_00000001.pt"))
    assert str(e.value) == ("--model-name: the run folder's name 'a\\nb' holds U+000A, a control character or line "
                            "break, at character 2; pass --model-name without one")
    assert served_model_name(str(run), "fine") == "fine"


def test_bad_serve_arguments_are_refused_in_one_line_in_this_process(tmp_path_factory, capsys, monkeypatch):
    """The refusals of test_serve_refuses_bad_arguments_in_one_line, whose `lm serve` processes mutation
    testing cannot see (this test's name must not contain that one's, which -k leaves out): a
    --step-sizes check read the wrong way round survived. Also a host that Python refuses before any
    lookup (no IDNA name: a UnicodeError, which has no strerror)."""
    import lm.cli.serve
    from lm.cli import main

    run, model, _ = saved_run(tmp_path_factory)

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # an argument let through fails the test, rather than serving for ever
        monkeypatch.setattr(lm.cli.serve, "draining_server", raising(AssertionError("the server was started")))
        for args, message in (
                (["--port", "65536"], "--port: must be in [0, 65535], got 65536"),
                (["--port", "-1"], "--port: must be in [0, 65535], got -1"),
                (["--host", "999.999.1.1"], "--host: cannot resolve '999.999.1.1' ("),
                (["--host", "é" * 64], f"--host: cannot resolve {'é' * 64!r} (encoding with 'idna' codec failed "
                                        "(UnicodeError: label empty or too long))"),
                (["--port", str(port)], f"--port: cannot listen on 127.0.0.1:{port} (Address already in use)"),
                (["--max-batch", "0"], "--max-batch: must be >= 1, got 0"),
                (["--max-queue", "0"], "--max-queue: must be >= 1, got 0"),
                (["--max-body", "0"], "--max-body: must be >= 1, got 0"),
                (["--step-sizes", "1,x"], "argument --step-sizes: need whole numbers separated by commas, got '1,x'"),
                (["--max-batch", "4", "--step-sizes", "2,8"], "--step-sizes: each must be in [1, --max-batch=4], "
                                                               "got 8"),
                (["--step-sizes", "0,2"], "--step-sizes: each must be in [1, --max-batch=16], got 0"),
                (["--api-key", " "], "--api-key: must not be empty")):
            argv = ["serve", "--checkpoint", str(run), "--port", "0", *args, "--quiet"]
            try:
                status, usage = main(argv), False
            except SystemExit as e:  # argparse's own (a --step-sizes that is not numbers), after the usage
                status, usage = e.code, True
            assert status == 2, args
            err = capsys.readouterr().err.splitlines()
            assert (len(err) > 1) == usage and err[-1].startswith("lm serve: error: ") and message in err[-1], (
                args, err)
    finally:
        taken.close()
    from helpers.serving import lm_serve_in_process

    for args in (["--step-sizes", "1,16"], ["--max-batch", "4", "--step-sizes", "4"]):  # the bounds are taken
        with pytest.MonkeyPatch.context() as mp:
            status, made = lm_serve_in_process(mp, ["--checkpoint", str(run), "--port", "0", *args, "--quiet"])
        assert status == 0 and set(made["engine"].step_sizes) | set(made["engine"].dropped_sizes) == {
            int(s) for s in args[-1].split(",")}, args
        capsys.readouterr()
    checked = []  # and the last port (whether it is free here is another matter: the check is a stand-in)
    monkeypatch.setattr(lm.cli.serve, "check_listen_address", lambda host, port: checked.append((host, port)))
    status, made = lm_serve_in_process(monkeypatch, ["--checkpoint", str(run), "--port", "65535", "--quiet"])
    assert status == 0 and checked == [("127.0.0.1", 65535)] and made["server_kwargs"]["port"] == 65535


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", [], True), ("0.0.0.0", ["--api-key", "k"], False),
                                               ("localhost", [], False), ("127.0.0.1", [], False)])
def test_a_server_open_beyond_this_machine_without_a_key_is_warned_about(tmp_path_factory, monkeypatch, capsys, host,
                                                                        key, warned):
    """Listening on an address others can reach, with no --api-key, lets anyone use the model: one
    warning line, even with --quiet. Not on the loopback names, nor with a key."""
    from helpers.serving import lm_serve_in_process

    run, model, _ = saved_run(tmp_path_factory)
    status, made = lm_serve_in_process(monkeypatch, ["--checkpoint", str(run), "--host", host, "--port", "0",
                                                     "--quiet", *key])
    assert status == 0 and made["server_kwargs"]["host"] == host
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ([f"lm serve: warning: --host {host} without --api-key (or $LM_API_KEY): anyone who can reach "
                         "this address can use the model"] if warned else [])


@pytest.mark.parametrize("bucketed", [False, True])
def test_lm_serve_says_which_decode_steps_it_uses_and_over_what(tmp_path_factory, monkeypatch, capsys, bucketed):
    """Without --quiet, one line: the steps' sizes and whether rows attend over the positions in use
    or the whole context (both, by the engine's answer; which one a device gets is its own)."""
    from helpers.serving import lm_serve_in_process

    run, model, _ = saved_run(tmp_path_factory)
    monkeypatch.setattr(Engine, "bucketed", property(lambda self: bucketed))
    status, made = lm_serve_in_process(monkeypatch, ["--checkpoint", str(run), "--port", "0", "--max-batch", "4"])
    assert status == 0
    engine = made["engine"]
    spans = "the positions in use (power-of-two spans)" if bucketed else "the whole context"
    dropped = (f" ({', '.join(map(str, engine.dropped_sizes))}: a row's logits differ from the 4-row step's here, "
               "so not used)" if engine.dropped_sizes else "")
    line = f"lm serve: decode steps of {', '.join(map(str, engine.step_sizes))} rows{dropped}, attending over {spans}"
    assert line in capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)])
def test_a_second_signal_says_it_exits_at_once_and_exits_with_its_status(tmp_path_factory, monkeypatch, capfd, first,
                                                                         second):
    """The second signal's line (written with os.write: the handler may have interrupted a print) and
    its status, 128 + the signal, were seen only by the process tests."""
    from lm.cli.serve import draining_server

    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=2, eos_id=tok.eot_id)
    server = draining_server(create_app(engine, tok, "tiny"), host="127.0.0.1", port=0, quiet=True)

    monkeypatch.setattr(os, "_exit", exit_now)
    server.handle_exit(first, None)
    with pytest.raises(Exited) as e:
        server.handle_exit(second, None)
    assert e.value.args == (128 + second,)
    assert capfd.readouterr().err == (f"lm serve: {signal.Signals(second).name} again: exiting, the requests in "
                                      "flight cut off\n")

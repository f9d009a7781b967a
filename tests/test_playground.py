"""The playground at ``/`` in a real browser: headless Chromium (Debian's package) driven by
Playwright types a prompt, presses Generate, and sees the text grow in, step by step."""

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers.serving import ServerThread, model_and_tokenizer
from helpers.tokenizers import pair_tokenizer

from lm.model import Seq2SeqConfig, build_model
from lm.serve import Engine, create_app
from lm.serve.translation import TranslationEngine

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FINISHED = "document.getElementById('stats').textContent.includes('finished')"  # the page says how a generation ended


def _need_chromium():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI") == "true":  # .ci/run installs it: its absence there is a failure
            pytest.fail(f"no chromium at {CHROMIUM}; apt-get install chromium")
        pytest.skip("chromium is not installed (apt-get install chromium)")


@contextlib.contextmanager
def _page(url: str):
    """The page at ``url`` in headless Chromium, and the list its script errors go to."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            yield page, errors
        finally:
            browser.close()


def _fill(page, prompt: str, **settings: str) -> None:
    """Type the prompt, and each setting into the input of that id, as a user would."""
    page.fill("#prompt", prompt)
    for name, value in settings.items():
        page.fill(f"#{name}", value)


def _paced(engine, seconds: float):
    """Slow the engine's steps to ``seconds`` each (the tiny model is too fast to watch; 20 ms a token is
    a real model's pace), so a generation lasts long enough to see and to act during it."""
    step = engine.step

    def paced_step():
        did = step()
        if did:
            time.sleep(seconds)
        return did

    engine.step = paced_step
    return engine


def test_the_playground_streams_a_completion_into_the_page(tmp_path_factory):
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = _paced(Engine(model, max_batch=4, eos_id=None), 0.02)  # no end of text: exactly max_tokens
    server = ServerThread(create_app(engine, tok, "tiny"))
    try:
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            _fill(page, "Lily had", temperature="0.8", top_p="0.95", max_tokens="40", seed="7")
            page.click("#generate")
            grown = "document.getElementById('generated').textContent.length > "
            page.wait_for_function(grown + "0")
            first = page.text_content("#generated")
            page.wait_for_function(grown + str(len(first)))
            second = page.text_content("#generated")
            assert page.is_disabled("#generate")  # still generating: the text arrived in steps
            page.wait_for_function("!document.getElementById('generate').disabled", timeout=30_000)
            final = page.text_content("#generated")
            stats = page.text_content("#stats")
            page.reload()  # the defaults fit the model's context (64 here): they must just work
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            default_tokens = int(page.input_value("#max_tokens"))
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            default_error = page.text_content("#error")
        assert not errors
        assert 0 < len(first) < len(second) < len(final) and final.startswith(second) and second.startswith(first)
        same = httpx.post(server.url + "/v1/completions", json={"prompt": "Lily had", "temperature": 0.8,
                                                                "top_p": 0.95, "max_tokens": 40, "seed": 7})
        assert final == same.json()["choices"][0]["text"]  # the page shows exactly what the API returns
        assert "40 tokens" in stats and "tokens/s" in stats and "finished: length" in stats
        assert default_tokens == 32 and default_error == ""  # half the context of 64, not 128
    finally:
        server.close()


def test_show_probabilities_shades_each_piece_and_names_its_tokens(tmp_path_factory):
    """With 'show probabilities' the page asks for logprobs: the same text as without (asking
    changes no token), each piece a span whose title lists its tokens with their probability and
    the likeliest alternatives, as the API's logprobs give them."""
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(Engine(model, max_batch=2, eos_id=None), tok, "tiny"))
    try:
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            _fill(page, "Tom saw", max_tokens="8", seed="3")
            page.check("#show_probs")
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            text = page.text_content("#generated")
            titles = page.eval_on_selector_all("#generated span.tok", "spans => spans.map(s => s.title)")
        assert not errors
        body = {"prompt": "Tom saw", "max_tokens": 8, "seed": 3, "temperature": 0.8, "top_p": 0.95}
        plain = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        lp = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 5}).json()["choices"][0]["logprobs"]
        assert text == plain and titles
        lines = "\n".join(titles).split("\n")
        assert len(lines) <= len(lp["tokens"]) and all("%" in line for line in lines)
        first, chance = json.dumps(lp["tokens"][0], ensure_ascii=False), 100 * math.exp(lp["token_logprobs"][0])
        assert lines[0].startswith(f"{first} {chance:.1f}%")
    finally:
        server.close()


def test_with_an_api_key_the_page_asks_for_it_and_then_streams(tmp_path_factory):
    """lm serve --api-key: the page loads without it (and /health, /metrics answer), the API does
    not (401, OpenAI's shape); the page shows its key box, and with the right key it streams."""
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(Engine(model, max_batch=2, eos_id=None), tok, "tiny", api_key="s3cret"))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Lily", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["message"] == "this server needs an API key: Authorization: Bearer <key>"
        assert r.headers["www-authenticate"] == "Bearer"
        bad = httpx.post(server.url + "/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401  # a wrong key is not told to give one (serve22)
        assert bad.json()["error"]["message"] == "the API key given is not this server's (Authorization: Bearer <key>)"
        assert httpx.get(server.url + "/health").status_code == 200
        assert 'route="/v1/completions",status="401"' in httpx.get(server.url + "/metrics").text
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Lily", "max_tokens": 2, "seed": 1},
                        headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === '(needs the API key)'")
            assert page.is_visible("#api_key")
            page.fill("#max_tokens", "40")  # typed before the key: kept when the key is taken (serve22)
            page.fill("#api_key", "wrong")
            page.press("#api_key", "Enter")  # a refused key is said so, the box stays
            page.wait_for_function("document.getElementById('model').textContent === '(the key given was refused)'")
            assert page.is_visible("#api_key")
            page.fill("#api_key", "s3cret")
            page.press("#api_key", "Enter")
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            assert not page.is_visible("#api_key") and page.input_value("#max_tokens") == "40"  # not half of 64
            _fill(page, "Lily", max_tokens="6", seed="1")
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            text, error = page.text_content("#generated"), page.text_content("#error")
            # the server's key changed (a restart with another): the 401 brings the key box back
            page.evaluate("apiKey = 'an old key'")
            page.click("#generate")
            page.wait_for_function("!document.getElementById('generate').disabled")
            assert page.is_visible("#api_key") and page.text_content("#stats") == ""
            assert page.text_content("#model") == "(the key given was refused)"
            assert page.text_content("#error") == ("the API key given is not this server's "
                                                   "(Authorization: Bearer <key>)")
        assert not errors and error == ""
        same = httpx.post(server.url + "/v1/completions", json={"prompt": "Lily", "max_tokens": 6, "seed": 1,
                                                                "temperature": 0.8, "top_p": 0.95},
                          headers={"Authorization": "Bearer s3cret"})
        assert text == same.json()["choices"][0]["text"]
    finally:
        server.close()


def test_one_generation_at_a_time_and_stop_stops_the_one_shown(tmp_path_factory):
    """Ctrl+Enter while a generation runs starts no second one (the page once sent another request,
    hid the first one's text while it kept its server row, and the first one's end then disabled
    Stop while the second still streamed)."""
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(_paced(Engine(model, max_batch=4, eos_id=None), 0.03), tok, "tiny"))
    try:
        with _page(server.url + "/") as (page, errors):
            sent = []
            page.on("request", lambda r: sent.append(r.url) if r.url.endswith("/v1/completions") else None)
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            _fill(page, "Lily had", max_tokens="60", seed="1")
            page.click("#generate")
            page.wait_for_function("document.getElementById('generated').textContent.length > 0")
            page.press("#prompt", "Control+Enter")
            page.wait_for_timeout(300)
            assert len(sent) == 1 and page.is_enabled("#stop") and page.is_disabled("#generate")
            page.click("#stop")
            page.wait_for_function("!document.getElementById('generate').disabled")
            assert page.is_disabled("#stop")
            deadline = time.monotonic() + 10
            while 'lm_batch_size 0' not in httpx.get(server.url + "/metrics").text:  # the row is freed
                assert time.monotonic() < deadline
                time.sleep(0.05)
            page.press("#prompt", "Control+Enter")  # when idle the shortcut does generate
            page.wait_for_function(FINISHED, timeout=30_000)
        assert not errors and len(sent) == 2
    finally:
        server.close()


def test_a_request_waiting_for_a_slot_says_so_and_stop_says_it_stopped(tmp_path_factory):
    """With every slot busy the page showed nothing until the first token, and Stop pressed while the
    request waited cancelled it on the server but left no trace on the page (serve22): it says it is
    waiting, and then that it stopped before the first token."""
    import threading

    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(_paced(Engine(model, max_batch=1, eos_id=None), 0.05), tok, "tiny"))
    holding = threading.Event()

    def hold_the_slot():
        body = {"prompt": "Tom", "max_tokens": 60, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                holding.set()

    holder = threading.Thread(target=hold_the_slot)
    try:
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            holder.start()
            assert holding.wait(30)
            _fill(page, "Lily had", max_tokens="5", seed="1")
            page.click("#generate")
            page.wait_for_function("document.getElementById('stats').textContent === 'waiting for the server…'")
            deadline = time.monotonic() + 10
            while "lm_queue_depth 1" not in httpx.get(server.url + "/metrics").text:  # queued behind the holder
                assert time.monotonic() < deadline
                time.sleep(0.05)
            page.click("#stop")
            page.wait_for_function("!document.getElementById('generate').disabled")
            stats, generated, error = (page.text_content(s) for s in ("#stats", "#generated", "#error"))
            deadline = time.monotonic() + 10
            while "lm_queue_depth 0" not in httpx.get(server.url + "/metrics").text:  # the request left the queue
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert not errors and (stats, generated, error) == ("stopped before the first token", "", "")
    finally:
        holder.join(60)
        server.close()


def test_unreadable_settings_are_errors_and_a_failed_request_clears_the_old_stats(tmp_path_factory):
    """A number box the browser cannot read ("0.8e") once became a hidden default (temperature 1, a
    random seed); now the page names the box and sends nothing. A refused request no longer shows the
    previous run's 'N tokens ... finished' beside its error. An empty box leaves the field out (the
    server's default), and a seed past 2**53 goes out digit for digit (Number() rounded it)."""
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(Engine(model, max_batch=2, eos_id=None), tok, "tiny"))
    bodies = []
    try:
        with _page(server.url + "/") as (page, errors):
            page.on("request", lambda r: bodies.append(r.post_data) if r.url.endswith("/v1/completions") else None)
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            _fill(page, "Tom saw", max_tokens="5", seed="12345678901234567891")
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            big_seed_text = page.text_content("#generated")
            for box, typed, message in [("temperature", "0.8e", "temperature: not a number, or too large"),
                                        ("max_tokens", "1-2", "max_tokens: not a number, or too large")]:
                page.fill(f"#{box}", "")
                page.focus(f"#{box}")
                page.keyboard.type(typed)  # as a user types it: the browser lets 'e' and '-' in
                page.click("#generate")
                page.wait_for_function("document.getElementById('error').textContent !== ''")
                assert page.text_content("#error") == message and page.text_content("#stats") == ""
                page.fill(f"#{box}", "0.8" if box == "temperature" else "5")
            _fill(page, "Tom saw", seed="1e")
            page.click("#generate")
            page.wait_for_function("document.getElementById('error').textContent !== ''")
            assert page.text_content("#error") == "seed: must be an integer, got 1e"
            assert len(bodies) == 1  # none of the three was sent
            _fill(page, "Tom saw", max_tokens="2", seed="007")  # as 7: "007" is no JSON number
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            assert page.text_content("#error") == "" and '"seed":7}' in bodies[-1]
            _fill(page, "Tom saw", max_tokens="-3", seed="2")
            page.click("#generate")
            page.wait_for_function("document.getElementById('error').textContent !== ''")
            refused = page.text_content("#error"), page.text_content("#stats")
            _fill(page, "Tom saw", temperature="", top_p="", max_tokens="", seed="")
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            defaults = page.text_content("#stats")
        assert not errors
        assert '"seed":12345678901234567891}' in bodies[0]
        body = {"prompt": "Tom saw", "max_tokens": 5, "temperature": 0.8, "top_p": 0.95, "seed": 12345678901234567891}
        same = httpx.post(server.url + "/v1/completions", json=body)
        assert big_seed_text == same.json()["choices"][0]["text"]
        assert refused[0].startswith("max_tokens:") and "-3" in refused[0] and refused[1] == ""
        empty_boxes = {"prompt": "Tom saw", "stream": True, "stream_options": {"include_usage": True}}
        assert json.loads(bodies[-1]) == empty_boxes
        assert defaults.startswith("16 tokens")  # the server's default max_tokens, as OpenAI's
    finally:
        server.close()


def test_the_rate_shown_is_bounded_by_the_time_the_request_took(tmp_path_factory):
    """tokens/s from the pieces' arrival times once showed 170000 tokens/s when the whole answer came
    in one read (a 0.1 ms span), and 0.0 for one token; now a span under 50 ms falls back to the
    whole request's time."""
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(Engine(model, max_batch=2, eos_id=None), tok, "tiny"))
    try:
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            # rate(tokens, first, last, started), times in ms as performance.now() gives them
            assert page.evaluate("rate(35, 1000, 1000.1, 958)") == f"{35 / 0.0421:.1f}"  # one read: whole request
            assert page.evaluate("rate(35, 1000, 1200, 958)") == f"{34 / 0.2:.1f}"  # streamed: between pieces
            assert page.evaluate("rate(1, 1000, 1000, 990)") == "100.0"
            assert page.evaluate("rate(0, null, 1000, 990)") == "–"
        assert not errors
    finally:
        server.close()


STATS_LOG = """() => {  // every text #stats shows, in order, in window.statsLog
    window.statsLog = [];
    const stats = document.getElementById('stats');
    new MutationObserver(() => window.statsLog.push(stats.textContent))
        .observe(stats, { childList: true, characterData: true, subtree: true });
}"""


def test_while_streaming_the_stats_count_pieces_until_the_usage_gives_the_tokens(tmp_path_factory):
    """A piece (a chunk of text) may hold several tokens (the server holds back a token that ends
    mid-character), so the page once showed a pieces rate as 'tokens/s', about 20% under the final one, and
    kept it after Stop. Now it says pieces/s until the usage chunk's token count, and after Stop; with
    'show probabilities' each chunk's logprobs name its tokens, so it counts them exactly as they come."""
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    server = ServerThread(create_app(_paced(Engine(model, max_batch=2, eos_id=None), 0.03), tok, "tiny"))
    try:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["architecture"] == "decoder_lm"
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            page.evaluate(STATS_LOG)
            runs = []
            for probs in (False, True):
                page.evaluate("window.statsLog = []")
                page.set_checked("#show_probs", probs)
                _fill(page, "Lily had", max_tokens="12", seed="5")
                page.click("#generate")
                page.wait_for_function(FINISHED, timeout=30_000)
                runs.append(page.evaluate("window.statsLog"))
            page.set_checked("#show_probs", False)
            _fill(page, "Lily had", max_tokens="60", seed="5")
            page.click("#generate")
            page.wait_for_function("document.getElementById('generated').textContent.length > 0")
            page.click("#stop")
            page.wait_for_function("!document.getElementById('generate').disabled")
            stopped, stop_title = page.text_content("#stats"), page.get_attribute("#stats", "title")
        assert not errors
        # "": cleared as a run starts; then "waiting for the server…" until the first chunk
        runs = [[s for s in run if s] for run in runs]
        assert all(run[0] == "waiting for the server…" for run in runs), runs
        plain, probs = (run[1:] for run in runs)
        during = [s for s in plain if not s.startswith("12 tokens · ")]  # before the usage chunk's count
        assert during and all(re.match(r"\d+ pieces? · [\d.–]+ pieces/s · first token", s) for s in during), plain
        assert "tokens" not in "".join(during) and "finished: length" in plain[-1]
        counts = [int(s.split(" ")[0]) for s in probs]  # exact from the first piece on, and never a pieces rate
        assert all("tokens/s" in s and "pieces" not in s for s in probs) and counts == sorted(counts)
        assert len(counts) > 2 and counts[-1] == 12 and probs[-1].startswith("12 tokens · ")
        assert re.match(r"\d+ pieces? · [\d.–]+ pieces/s .*· stopped$", stopped) and "tokens" not in stopped
        assert "piece" in stop_title  # the hover says what a piece is
    finally:
        server.close()


PAGE = "http://playground.test/"


@contextlib.contextmanager
def _routed_page(completions):
    """The playground (this checkout's file) at PAGE, with no server: ``/v1/models`` names a model and
    ``completions(body)`` answers each ``POST /v1/completions`` (its request body, as JSON) with
    ``(status, content_type, body)``, as a proxy or another server might."""
    html = (Path(__file__).parents[1] / "lm/serve/static/playground.html").read_text(encoding="utf-8")
    models = {"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": 64}]}

    def handle(route):
        path = route.request.url[len(PAGE) - 1:]
        if path == "/":
            return route.fulfill(status=200, content_type="text/html; charset=utf-8", body=html)
        if path == "/v1/models":
            return route.fulfill(status=200, content_type="application/json", body=json.dumps(models))
        status, kind, body = completions(json.loads(route.request.post_data))
        route.fulfill(status=status, content_type=kind, body=body)

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route(PAGE + "**", handle)
            page.goto(PAGE)
            page.wait_for_function("document.getElementById('model').textContent === 'fake'")
            yield page, errors
        finally:
            browser.close()


def _events(*payloads, end: str = "\n") -> str:
    """Server-sent events of these payloads (dicts as JSON), each line ended by ``end``."""
    return "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}{end}{end}" for p in payloads)


def _chunk(text: str, reason: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                      "finish_reason": reason}]}


def test_errors_and_streams_in_other_shapes_than_lm_serve_s(tmp_path):
    """What a proxy or gateway may send instead: an error that is not in OpenAI's shape once showed an
    empty error box (a 502 with no JSON, over HTTP/2 with no reason phrase) or a TypeError's text ({"detail":
    ...}); now it names the HTTP status. A stream framed with CRLF or CR (both the standard's) showed
    nothing; a stream cut off cleanly before [DONE] showed no error; one piece read '1 pieces'."""
    _need_chromium()
    usage = {"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3,
                                                                   "total_tokens": 5}}
    whole = [_chunk("Hel"), _chunk("lo"), _chunk(" you", "stop"), usage, "[DONE]"]
    answers = {
        "empty": (502, "text/html", ""),
        "html": (502, "text/html", "<html><body><h1>502 Bad Gateway</h1></body></html>"),
        "detail": (500, "application/json", json.dumps({"detail": "boom"})),
        "lf": (200, "text/event-stream", _events(*whole)),
        "crlf": (200, "text/event-stream", _events(*whole, end="\r\n")),
        "cr": (200, "text/event-stream", ": a comment\r" + _events(*whole, end="\r")),
        "cut": (200, "text/event-stream", _events(_chunk("Hel"), _chunk("lo"))),
        "failed": (200, "text/event-stream", _events(_chunk("Hel"), {"error": {"message": "the model failed"}},
                                                     "[DONE]")),
    }
    seen = {}
    with _routed_page(lambda body: answers[body["prompt"]]) as (page, errors):
        for prompt in answers:
            _fill(page, prompt)
            page.click("#generate")
            page.wait_for_function("!document.getElementById('generate').disabled")
            seen[prompt] = [page.text_content(s) for s in ("#error", "#stats", "#generated")]
        split = page.evaluate("""() => {  // a CRLF cut between two reads is one line end, not two
            if (typeof serverSentEvents !== "function") return null;
            const feed = serverSentEvents();
            return [feed("data: a\\r"), feed("\\n\\r\\ndata: b\\r\\rdata:c\\ndata: d\\n\\nda"), feed("ta: e\\n\\n")];
        }""")
    assert not errors
    assert seen["empty"][0] in ("HTTP 502", "HTTP 502 Bad Gateway") and seen["html"][0] == seen["empty"][0]
    assert seen["detail"][0] in ("HTTP 500", "HTTP 500 Internal Server Error")
    for framing in ("lf", "crlf", "cr"):
        error, stats, text = seen[framing]
        assert error == "" and text == "Hello you", (framing, seen[framing])
        assert stats.startswith("3 tokens · ") and stats.endswith("finished: stop"), stats
    error, stats, text = seen["cut"]
    assert "ended early" in error and text == "Hello" and stats.startswith("2 pieces · ") and "finished" not in stats
    error, stats, text = seen["failed"]
    assert error == "the model failed" and text == "Hel" and stats.startswith("1 piece · ") and "pieces/s" in stats
    assert split == [[], ["a", "b", "c\nd"], ["e"]]


def test_a_translation_model_s_output_is_on_its_own_line_below_its_source():
    """With an encoder-decoder checkpoint (/v1/models says so) the translation once ran on right after the
    source ('A dog.Ein Hund.') as if it continued it; now it has a line of its own."""
    _need_chromium()
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=259, context_length=32, d_model=32, encoder_layers=1, decoder_layers=1,
                        num_heads=4, d_ff=64, dropout=0.0)
    model = build_model(cfg).eval()
    tok = pair_tokenizer()
    server = ServerThread(create_app(TranslationEngine(model, max_batch=1), tok, "mt"))
    try:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["architecture"] == "encoder_decoder"
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === 'mt'")
            _fill(page, "A dog.", temperature="0", max_tokens="6")
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            shown, text = page.inner_text("#output"), page.text_content("#generated")
            kind = page.evaluate("document.getElementById('kind')?.textContent")  # the subtitle's word
        assert not errors
        want = httpx.post(server.url + "/v1/completions", json={"prompt": "A dog.", "temperature": 0, "max_tokens": 6})
        assert text == want.json()["choices"][0]["text"] and text
        assert shown == f"A dog.\n→ {text}" and kind == "translations"
    finally:
        server.close()


SCRIPT = Path(__file__).parents[1] / "scripts/playground_screenshot.py"


def test_the_screenshot_script_refuses_a_directory_and_leaves_no_temporary_file(tmp_path):
    """--out a directory once started the server, took the screenshot and then failed on the rename with
    a traceback, leaving the temporary PNG; now it is a one-line error before anything starts (and a
    failed write or rename removes the temporary file)."""
    outdir = tmp_path / "shots"
    outdir.mkdir()
    r = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint", str(tmp_path / "none"), "--out", str(outdir),
                        "--overwrite"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "is a directory" in r.stderr, r.stderr
    spec = importlib.util.spec_from_file_location("playground_screenshot", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    class Page:  # writes the screenshot where it is told, as Playwright's page does
        def screenshot(self, path, full_page):
            Path(path).write_bytes(b"\x89PNG")

    with pytest.raises(IsADirectoryError):
        script.save_screenshot(Page(), outdir)  # the rename fails
    assert os.listdir(tmp_path) == ["shots"] and os.listdir(outdir) == []
    script.save_screenshot(Page(), tmp_path / "shot.png")
    assert sorted(os.listdir(tmp_path)) == ["shot.png", "shots"]


CALL_FROM_PAGE = """async ([url, key]) => {  // what a web app on another origin does: fetch the API, with the key
    try {
        const r = await fetch(url + "/v1/completions", {method: "POST", headers: {"Content-Type": "application/json",
            Authorization: "Bearer " + key}, body: JSON.stringify({prompt: "Lily", max_tokens: 3, seed: 1})});
        return `${r.status} ${(await r.json()).usage.completion_tokens}`;
    } catch (e) { return `refused: ${e.name}`; }
}"""


def test_a_page_from_an_allowed_origin_may_call_the_api_and_others_may_not(tmp_path_factory):
    """CORS in a real browser: a page served from another origin (http://localhost:PORT, a plain HTTP
    server on this machine) calls the API (a preflight, for the JSON body and the key) of a server
    that allows that origin; a server that allows none, the default, is refused by the browser."""
    from helpers.serving import one_page_server

    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    results = {}
    with one_page_server(b"<!doctype html><title>another app</title>", "text/html") as port:  # another web app
        origin = f"http://localhost:{port}"
        for allowed in ((), (origin,)):
            server = ServerThread(create_app(Engine(model, max_batch=1, eos_id=None), tok, "tiny", api_key="k",
                                             allowed_origins=allowed))
            try:
                with _page(origin + "/") as (page, errors):
                    results[allowed] = page.evaluate(CALL_FROM_PAGE, [server.url, "k"])
                    assert not errors
            finally:
                server.close()
    assert results == {(): "refused: TypeError", (origin,): "200 3"}, results

"""The playground at ``/`` in a real browser: headless Chromium (Debian's package) driven by
Playwright types a prompt, presses Generate, and sees the text grow in, step by step."""

import contextlib
import json
import math
import os
import shutil
import time

import httpx
import pytest
from helpers.serving import ServerThread, model_and_tokenizer

from lm.serve import Engine, create_app

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
        assert r.headers["www-authenticate"] == "Bearer"
        bad = httpx.post(server.url + "/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        assert 'route="/v1/completions",status="401"' in httpx.get(server.url + "/metrics").text
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Lily", "max_tokens": 2, "seed": 1},
                        headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        with _page(server.url + "/") as (page, errors):
            page.wait_for_function("document.getElementById('model').textContent === '(needs the API key)'")
            assert page.is_visible("#api_key")
            page.fill("#api_key", "s3cret")
            page.press("#api_key", "Enter")
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
            assert not page.is_visible("#api_key")
            _fill(page, "Lily", max_tokens="6", seed="1")
            page.click("#generate")
            page.wait_for_function(FINISHED, timeout=30_000)
            text, error = page.text_content("#generated"), page.text_content("#error")
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
            for box, typed, message in [("temperature", "0.8e", "temperature: not a number"),
                                        ("max_tokens", "1-2", "max_tokens: not a number")]:
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

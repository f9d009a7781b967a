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


def test_the_playground_streams_a_completion_into_the_page(tmp_path_factory):
    _need_chromium()
    _, model, tok = model_and_tokenizer(tmp_path_factory)
    engine = Engine(model, max_batch=4, eos_id=None)  # no end of text: exactly max_tokens
    step = engine.step

    def paced_step():  # the tiny model is too fast to watch; 20 ms a token is a real model's pace
        did = step()
        if did:
            time.sleep(0.02)
        return did

    engine.step = paced_step
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
            page.wait_for_function("document.getElementById('stats').textContent.includes('finished')",
                                   timeout=30_000)
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
            page.wait_for_function("document.getElementById('stats').textContent.includes('finished')",
                                   timeout=30_000)
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
            page.wait_for_function("document.getElementById('stats').textContent.includes('finished')",
                                   timeout=30_000)
            text, error = page.text_content("#generated"), page.text_content("#error")
        assert not errors and error == ""
        same = httpx.post(server.url + "/v1/completions", json={"prompt": "Lily", "max_tokens": 6, "seed": 1,
                                                                "temperature": 0.8, "top_p": 0.95},
                          headers={"Authorization": "Bearer s3cret"})
        assert text == same.json()["choices"][0]["text"]
    finally:
        server.close()

"""`lm serve` with an encoder–decoder checkpoint: the source in ``prompt``, its translation back,
through the same engine queue, HTTP API and errors as the language model."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
from helpers.serving import ServerThread

from lm.checkpoint import export_safetensors
from lm.generate import greedy_decode
from lm.model import Seq2SeqConfig, build_model
from lm.serve import SamplingParams, create_app
from lm.serve.engine import Request
from lm.serve.translation import TranslationEngine
from lm.tokenizer import Tokenizer, save_tokenizer_dir

openai = pytest.importorskip("openai")
SPECIALS = ["<pad>", "<bos>", "<eos>"]


def _model():
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=259, context_length=32, d_model=32, encoder_layers=2, decoder_layers=2,
                        num_heads=4, d_ff=64, dropout=0.0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # sharper distributions than the init's, so that decoding paths differ
        model.embeddings.weight.mul_(6.0)
    return model


TOK = Tokenizer({i: bytes([i]) for i in range(256)}, [], SPECIALS)


def _run(engine, prompt, params, n=1):
    tokens, reasons = [[] for _ in range(n)], [None] * n
    engine.submit(Request(prompt, params, n, on_token=lambda i, t: tokens[i].append(t),
                          on_finish=lambda i, r: reasons.__setitem__(i, r)))
    while engine.step():
        pass
    return tokens, reasons


def test_the_engine_translates_as_greedy_decode_does_and_samples_each_choice_from_its_own_seed():
    model = _model()
    engine = TranslationEngine(model, max_batch=4)
    for src in ([5, 9, 12, 7], [30, 4], [8, 8, 8, 21, 22, 3, 17]):
        want = greedy_decode(model, [src])[0]
        tokens, reasons = _run(engine, src, SamplingParams(max_tokens=31, temperature=0.0))
        assert tokens == [want] and len(want) > 0
        assert reasons == ["length" if len(want) == min(len(src) + 50, 31) else "stop"]  # the model's limit
        short, reasons = _run(engine, src, SamplingParams(max_tokens=2, temperature=0.0))
        assert short == [want[:2]] and reasons == ["length" if len(want) >= 2 else "stop"]
    eager = _model()
    with torch.no_grad():  # <eos> (id 2) first: an empty translation, ended by the model
        eager.embeddings.weight[2] = eager.embeddings.weight.sum(0)
    assert greedy_decode(eager, [[5, 9]])[0] == []
    assert _run(TranslationEngine(eager), [5, 9], SamplingParams(max_tokens=5, temperature=0.0)) == ([[]], ["stop"])
    params = SamplingParams(max_tokens=31, temperature=1.0, top_p=0.9, seed=5)
    a, _ = _run(engine, [5, 9, 12], params, n=2)
    b, _ = _run(engine, [5, 9, 12], params, n=2)
    assert a == b and a[0] != a[1]  # repeatable, and each choice its own stream
    for index in range(2):
        g = torch.Generator().manual_seed(5 << 8 | index)
        assert a[index] == greedy_decode(model, [[5, 9, 12]], temperature=1.0, top_p=0.9, generator=g)[0]
    assert engine.stats.requests["finished"] == 10 and not engine.busy
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(Request([5], SamplingParams(max_tokens=32)))
    with pytest.raises(ValueError, match="prompt"):
        engine.submit(Request(list(range(3, 35)), SamplingParams(max_tokens=3)))
    with pytest.raises(ValueError, match="compile"):
        TranslationEngine(model, compile=True)


def test_the_server_answers_with_the_translation_streaming_and_not():
    model = _model()
    server = ServerThread(create_app(TranslationEngine(model, max_batch=2), TOK, "mt"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        for source in ("abc", "hello"):
            want = TOK.decode(greedy_decode(model, [TOK.encode(source)])[0])
            r = client.completions.create(model="mt", prompt=source, temperature=0.0)  # max_tokens: the model's
            assert r.choices[0].text == want and r.usage.prompt_tokens == len(source)
            pieces = [c.choices[0].text for c in client.completions.create(model="mt", prompt=source,
                                                                            temperature=0.0, stream=True)]
            assert "".join(pieces) == want
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 40})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 40})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        info = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert info["id"] == "mt" and info["max_model_len"] == 32
    finally:
        server.close()


def test_lm_serve_refuses_compile_for_a_translation_checkpoint(tmp_path):
    export_safetensors(_model(), tmp_path / "model.safetensors")
    save_tokenizer_dir(TOK, tmp_path / "tokenizer")
    p = subprocess.run([sys.executable, "-m", "lm", "serve", "--checkpoint", str(tmp_path), "--compile"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--compile:" in p.stderr and "translation model" in p.stderr
    assert "Traceback" not in p.stderr

"""`lm serve` with an encoder–decoder checkpoint: the source in ``prompt``, its translation back,
through the same engine (slots, continuous batching, batch invariance), HTTP API and errors as
the language model."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import torch
from helpers.serving import ServerThread, logits_beside
from helpers.tokenizers import pair_tokenizer

import lm.serve.engine as engine_module
from lm.checkpoint import export_safetensors
from lm.device import autocast
from lm.generate import greedy_decode
from lm.generate.seq2seq import line_break_ids
from lm.model import Seq2SeqConfig, build_model
from lm.serve import SamplingParams, create_app
from lm.serve.engine import Request, choice_seed
from lm.serve.process import free_port, start_server
from lm.serve.translation import TranslationEngine
from lm.tokenizer import Tokenizer, save_tokenizer_dir

openai = pytest.importorskip("openai")
SPECIALS = ["<pad>", "<bos>", "<eos>"]


def _model(**kw):
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=259, context_length=32, d_model=32, encoder_layers=2, decoder_layers=2,
                        num_heads=4, d_ff=64, dropout=0.0, **kw)
    model = build_model(cfg).eval()
    with torch.no_grad():  # sharper distributions than the init's, so that decoding paths differ
        model.embeddings.weight.mul_(6.0)
    return model


TOK = pair_tokenizer()


def _model_that_ends_at_once(src: list[int]):
    """An untied model whose <eos> (id 2) is the first target token for ``src``: an empty
    translation, ended by the model. Its output row lies along the first step's hidden state, scaled
    above every other logit, whatever weights the seed drew (it had been the tied embedding's sum of
    rows, which made <eos> first for torch 2.13's draws and not for 2.11's)."""
    from lm.generate.seq2seq import source_batch

    torch.manual_seed(0)
    model = build_model(Seq2SeqConfig(vocab_size=259, context_length=32, d_model=32, encoder_layers=2,
                                      decoder_layers=2, num_heads=4, d_ff=64, dropout=0.0,
                                      tie_embeddings=False)).eval()
    cfg = model.config
    with torch.no_grad():  # the output row touches nothing before the logits: h is the same after
        ids, mask = source_batch([src], cfg.eos_id, cfg.pad_id, model.device)
        h = model.decode(torch.tensor([[cfg.bos_id]]), model.encode(ids, mask), mask)[0, -1]
        model.lm_head.weight[cfg.eos_id] = h * (2 * model.logits(h).abs().max() + 1) / h.pow(2).sum()
    return model


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
    eager = _model_that_ends_at_once([5, 9])
    assert greedy_decode(eager, [[5, 9]])[0] == []
    assert _run(TranslationEngine(eager), [5, 9], SamplingParams(max_tokens=5, temperature=0.0)) == ([[]], ["stop"])
    params = SamplingParams(max_tokens=31, temperature=1.0, top_p=0.9, seed=5)
    a, _ = _run(engine, [5, 9, 12], params, n=2)
    b, _ = _run(engine, [5, 9, 12], params, n=2)
    assert a == b and a[0] != a[1]  # repeatable, and each choice its own stream
    for index in range(2):
        g = torch.Generator().manual_seed(choice_seed(5, index))
        assert a[index] == greedy_decode(model, [[5, 9, 12]], temperature=1.0, top_p=0.9, generator=g)[0]
    assert engine.stats.requests["finished"] == 10 and not engine.busy
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(Request([5], SamplingParams(max_tokens=32)))
    with pytest.raises(ValueError, match="prompt_logprobs: only a language model"):
        engine.submit(Request([5], SamplingParams(prompt_logprobs=1)))
    with pytest.raises(ValueError, match="prompt"):
        engine.submit(Request(list(range(3, 35)), SamplingParams(max_tokens=3)))
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.submit(Request([5], SamplingParams(max_tokens=3, ignore_eos=True)))


@pytest.mark.parametrize("positions, dtype", [("sinusoidal", None), ("rope", None), ("learned", None),
                                             ("sinusoidal", torch.bfloat16)])
def test_every_row_gets_the_logits_of_the_model_without_a_cache(positions, dtype):
    """Rows of sources of different lengths, each at its own target position in one step, against
    a plain teacher-forced forward of its source and its target so far (under bfloat16 autocast:
    the same forward under the same autocast, to bfloat16's rounding)."""
    model = _model(positions=positions)
    engine = TranslationEngine(model, max_batch=4, dtype=dtype)
    sources = [[5, 9, 12, 7], [30, 4], [8, 8, 8, 21, 22, 3, 17, 40, 41, 42, 43], [60]]
    seen = {}
    real = engine_module.next_token_and_finite

    def spy(logits, **kw):
        seen.setdefault(id(kw["generator"]), []).append(logits[0].clone())
        return real(logits, **kw)

    runs = []
    engine_module.next_token_and_finite = spy
    try:
        for k, src in enumerate(sources):  # one joins at each step: rows at different target positions
            tokens = []
            engine.submit(Request(src, SamplingParams(max_tokens=8 + k, temperature=1.0, seed=k), 1,
                                  on_token=lambda i, t, tokens=tokens: tokens.append(t)))
            runs.append(tokens)
            engine.step()
        while engine.step():
            pass
    finally:
        engine_module.next_token_and_finite = real
    assert max(engine.stats.steps) == 4 and len(seen) == len(sources)
    cfg = model.config
    for src, tokens, logits in zip(sources, runs, seen.values()):
        tgt = [cfg.bos_id, *tokens]
        with torch.no_grad(), autocast(torch.device("cpu"), dtype):
            full = model(torch.tensor([src + [cfg.eos_id]]), torch.tensor([tgt]))[0]
        full[:, [cfg.pad_id, cfg.bos_id]] = float("-inf")
        assert len(logits) == len(tokens) + (len(tokens) < 8)  # an <eos> sampled is not a token
        # within a few units in the last place of the largest logit: two in bfloat16 (its rounding of
        # the output dominates), 16 in float32 (the plain float32 forward itself is up to 13 from a
        # float64 one here: the sum orders differ, and the logits reach 30)
        ulps = 16 if dtype is None else 2
        tol = ulps * torch.finfo(dtype or torch.float32).eps * full[full.isfinite()].abs().max().item()
        for j, got in enumerate(logits):  # token j was chosen from the logits at target position j
            torch.testing.assert_close(got.float(), full[j].float(), rtol=0, atol=tol)


def test_the_step_size_probe_fills_all_n_positions_of_its_cache():
    """_invariant_sizes steps each probe cache on from position n. A target one position short (a
    mutation survivor) left a hole at n - 1 that every step size read alike, so the probe still agreed
    with itself while no longer running the reduction over n positions that a request's rows run."""
    engine = TranslationEngine(_model(), max_batch=2)
    for n in (1, 5, 12):
        one = engine._probe_cache(torch.Generator().manual_seed(n), n)
        assert (one.length, one.max_len) == (n, n)


def test_a_finished_row_no_longer_widens_the_source_span():
    engine = TranslationEngine(_model(), max_batch=4)
    for step in engine.steps.values():
        step.bucketed = True  # as compiled steps do (eager ones read the whole cache)
    engine.submit(Request(list(range(3, 23)), SamplingParams(max_tokens=2, temperature=0.0)))  # 20 tokens + <eos>
    engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=False)))
    spans = []
    while engine.step():
        size = max(engine.stats.steps)
        spans.append(engine.steps[size].cache.source_span)
    assert spans[0] == 32 and spans[-1] == 16, spans  # the long source's row left: 4 positions need 16


def _seeded_translation(engine, companions: int, join_at: int, fill=False):
    """Tokens and logits (bytes) of one seeded translation (up to the end of the context), run with
    ``companions`` other requests of other sources and settings, which arrive ``join_at`` steps
    after it (-1: just before it, so that it takes a slot after theirs); with ``fill`` they may
    translate up to the end of the context too."""
    tokens = []
    req = Request([11, 12, 13, 14, 15], SamplingParams(max_tokens=31, temperature=1.0, top_p=0.9, seed=1234), 1,
                  on_token=lambda i, t: tokens.append(t))
    g = torch.Generator().manual_seed(companions)
    others = []
    for k in range(companions):
        src = torch.randint(3, 259, (int(torch.randint(1, 25, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(max_tokens=31 if fill else int(torch.randint(1, 25, (1,), generator=g)),
                                temperature=[0.0, 0.7, 1.3][k % 3], top_p=[1.0, 0.5][k % 2], seed=k)
        others.append(Request(src, params))
    logits = logits_beside(engine, req, others, join_at, steps=40)
    return tokens, logits


def test_a_seeded_translation_is_the_same_alone_or_beside_fifteen_others():
    model = _model()
    alone = TranslationEngine(model, max_batch=16)
    alone_tokens, alone_logits = _seeded_translation(alone, 0, 0)
    assert len(alone_tokens) >= 5 and set(alone.stats.steps) == {alone.step_sizes[0]}
    for companions, join_at in ((15, 0), (15, 3), (7, 1), (15, -1)):
        engine = TranslationEngine(model, max_batch=16)
        tokens, logits = _seeded_translation(engine, companions, join_at)
        assert tokens == alone_tokens, (companions, join_at)
        assert logits == alone_logits, (companions, join_at)  # bit for bit, every step
        if companions == 15:
            assert 16 in engine.stats.steps  # continuous batching: all sixteen decoded in one step


@pytest.mark.slow
def test_the_compiled_translation_step_keeps_every_size_and_the_eager_tokens():
    model = _model()
    engine = TranslationEngine(model, max_batch=16, compile=True)
    # the batch-invariant matmuls, the output projection too (one row: see test_serve.py)
    assert engine.step_sizes[-4:] == [2, 4, 8, 16] and engine.bucketed  # spans of the targets and the sources
    alone_tokens, alone_logits = _seeded_translation(engine, 0, 0)
    assert set(engine.stats.steps) == {engine.step_sizes[0]}
    tokens, logits = _seeded_translation(engine, 15, 0, fill=True)
    assert tokens == alone_tokens and logits == alone_logits
    eager_tokens, eager_logits = _seeded_translation(TranslationEngine(model, max_batch=16), 0, 0)
    assert alone_tokens == eager_tokens
    for got, want in zip(alone_logits, eager_logits):  # compiled kernels: the same logits to rounding
        got, want = (torch.frombuffer(bytearray(b), dtype=torch.float32) for b in (got, want))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for src in ([5, 9, 12, 7], [30, 4]):
        tokens, _ = _run(engine, src, SamplingParams(max_tokens=31, temperature=0.0))
        assert tokens == [greedy_decode(model, [src])[0]]


def test_the_server_answers_with_the_translation_streaming_and_not():
    model = _model()
    server = ServerThread(create_app(TranslationEngine(model, max_batch=2), TOK, "mt"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        for source in ("abc", "hello"):
            want = TOK.decode(greedy_decode(model, [TOK.encode(source)])[0]).strip()  # as lm translate writes it
            r = client.completions.create(model="mt", prompt=source, temperature=0.0)  # max_tokens: the model's
            assert r.choices[0].text == want and r.usage.prompt_tokens == len(source)
            pieces = [c.choices[0].text for c in client.completions.create(model="mt", prompt=source,
                                                                            temperature=0.0, stream=True)]
            assert "".join(pieces) == want
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 40})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "abc", "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        # logprobs of a translation: of its target tokens (<pad> and <bos> excluded, as greedy_decode does)
        r = client.completions.create(model="mt", prompt="abc", temperature=0.0, logprobs=1)
        src, tgt = TOK.encode("abc"), greedy_decode(model, [TOK.encode("abc")])[0]
        cfg = model.config
        with torch.no_grad():
            logits = model(torch.tensor([src + [cfg.eos_id]]), torch.tensor([[cfg.bos_id, *tgt]]))[0]
        logits[:, [cfg.pad_id, cfg.bos_id]] = float("-inf")
        want = torch.log_softmax(logits.float(), dim=-1)
        got = r.choices[0].logprobs.token_logprobs
        assert len(got) == len(tgt) == r.usage.completion_tokens  # <eos> is not a token of the text
        assert all(abs(g - want[j, t].item()) < 1e-5 for j, (g, t) in enumerate(zip(got, tgt)))
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 40})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        # a sentence is read as `lm translate` reads a line: surrounding whitespace dropped (it gave
        # another translation), and nothing left is not a language model's "no end-of-text token"
        r = client.completions.create(model="mt", prompt=" \t hello \n", temperature=0.0)
        assert r.choices[0].text == TOK.decode(greedy_decode(model, [TOK.encode("hello")])[0]).strip()
        assert r.usage.prompt_tokens == len("hello")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "  \n"})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "prompt: empty (surrounding whitespace is dropped, as `lm translate` drops it): nothing to "
                       "translate", "type": "invalid_request_error", "param": "prompt", "code": None}
        info = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert info["id"] == "mt" and info["max_model_len"] == 32
        # vLLM's /tokenize counts the prompt as the completion reads it (seq2seq20: its whitespace had
        # been counted, and a line break taken), so a client's count is the usage it will be charged
        r = httpx.post(server.url + "/tokenize", json={"prompt": " \t hello \n"})
        assert r.status_code == 200 and r.json()["count"] == len("hello") == len(r.json()["tokens"])
        for prompt in ("  \n", "one\ntwo"):
            r = httpx.post(server.url + "/tokenize", json={"prompt": prompt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    finally:
        server.close()


def test_tokenizer_info_names_the_translation_models_special_tokens():
    """vLLM's /tokenizer_info had said null for a translation tokenizer's <eos> and <bos> (it looked
    for <|endoftext|> only): the engine's end token and the model's <bos> and <pad>, with their ids
    where `lm tokenizer train` puts the special tokens, first."""
    tok = Tokenizer({0: b"<pad>", 1: b"<bos>", 2: b"<eos>", **{i + 3: bytes([i]) for i in range(256)}}, [], SPECIALS)
    server = ServerThread(create_app(TranslationEngine(_model(), max_batch=1), tok, "mt"))
    try:
        info = httpx.get(server.url + "/tokenizer_info").json()
    finally:
        server.close()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<eos>", "<bos>", "<pad>")


def test_lm_serve_serves_a_translation_checkpoint_with_step_sizes(tmp_path):
    model = _model()
    export_safetensors(model, tmp_path / "model.safetensors")
    save_tokenizer_dir(TOK, tmp_path / "tokenizer")
    proc, url = start_server(["--checkpoint", str(tmp_path), "--max-batch", "4", "--step-sizes", "2,4",
                              "--device", "cpu"], free_port(), stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        r = client.completions.create(model=tmp_path.name, prompt=["abc", "hello"], temperature=0.0)
        want = [TOK.decode(ids).strip() for ids in greedy_decode(model, [TOK.encode("abc"), TOK.encode("hello")])]
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "ignore_eos": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    err = proc.stderr.read()
    assert "decode steps of 4 rows (2: a row's logits differ" in err and "attending over the whole context" in err
    assert "Traceback" not in err


def test_lm_serve_in_this_process_makes_a_translation_engine_for_a_translation_checkpoint(tmp_path, monkeypatch,
                                                                                          capsys):
    """The test above starts `lm serve` as a process, which mutation testing cannot see: serving a
    translation checkpoint with the language model's engine, or with none, survived. In this process
    (the server a stand-in): a TranslationEngine, line breaks barred as in `lm translate`, the step
    sizes given, and the line that says which steps it uses."""
    from helpers.serving import lm_serve_in_process

    model = _model()
    export_safetensors(model, tmp_path / "model.safetensors")
    save_tokenizer_dir(TOK, tmp_path / "tokenizer")
    status, made = lm_serve_in_process(monkeypatch, ["--checkpoint", str(tmp_path), "--max-batch", "4",
                                                     "--step-sizes", "2,4", "--port", "0", "--device", "cpu"])
    assert status == 0
    engine = made["engine"]
    assert type(engine) is TranslationEngine and engine.max_batch == 4
    cfg = model.config
    assert engine.banned.tolist() == sorted({cfg.pad_id, cfg.bos_id, *line_break_ids(TOK)})
    assert line_break_ids(TOK)  # (the tokenizer has some)
    steps = ", ".join(map(str, engine.step_sizes))
    assert capsys.readouterr().err.startswith(f"lm serve: decode steps of {steps} rows")
    assert set(engine.step_sizes) | set(engine.dropped_sizes) == {2, 4}


def test_banned_ids_are_never_chosen_as_in_greedy_decode():
    """``lm serve`` bans the tokens holding a line break, as ``lm translate`` does (one translation
    a line): the engine's ``banned_ids`` give greedy_decode's tokens with the same ban."""
    model = _model()
    src = [5, 9, 12, 7]
    free = greedy_decode(model, [src])[0]
    banned = sorted(set(free[:2]) - {model.config.eos_id})
    want = greedy_decode(model, [src], banned_ids=banned)[0]
    assert want != free and not set(want) & set(banned)
    tokens, _ = _run(TranslationEngine(model, max_batch=4, banned_ids=banned), src,
                     SamplingParams(max_tokens=31, temperature=0.0))
    assert tokens == [want]
    with pytest.raises(ValueError, match="banned_ids: holds <eos>"):
        TranslationEngine(model, banned_ids=[model.config.eos_id])
    assert line_break_ids(TOK) == [10 + 3]  # b"\n" (after the 3 special tokens), banned by lm serve


def test_a_translation_is_stripped_as_lm_translate_writes_it_and_a_prompt_is_one_line(monkeypatch):
    """``lm translate`` writes ``decode(ids).strip()``, one sentence a line; the server had sent the
    decoded text as it was (a leading space: " die ..."), and translated a prompt holding a line break
    as one sentence, which ``lm translate --input`` reads as two. Now the completion is the stripped
    text, streamed too (leading whitespace never sent, trailing whitespace held and dropped at the
    end, offsets into the text sent), and a line break inside a prompt is a 400 naming it."""
    model = _model()
    engine = TranslationEngine(model, max_batch=2)
    server = ServerThread(create_app(engine, TOK, "mt"))
    target = [TOK.encode(c)[0] for c in "  die \t"]  # then <eos>

    def scripted(logits, **kw):  # the model "translates" every source as "  die \t"
        row = next(r for r in engine.rows if r is not None and r.generator is kw["generator"])
        token = target[row.generated] if row.generated < len(target) else model.config.eos_id
        return torch.tensor([token]), torch.tensor([True])

    monkeypatch.setattr(engine_module, "next_token_and_finite", scripted)
    try:
        body = {"prompt": "A man in a hat.", "temperature": 0.0, "logprobs": 0}
        choice = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
        assert choice["text"] == TOK.decode(target).strip() == "die" and choice["finish_reason"] == "stop"
        lp = choice["logprobs"]
        assert lp["tokens"] == [" ", " ", "d", "i", "e", " ", "\t"] and lp["text_offset"] == [0, 0, 0, 1, 2, 3, 4]
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
        pieces = [e["choices"][0]["text"] for e in events]
        assert "".join(pieces) == "die" and pieces[0] == "d" and events[-1]["choices"][0]["finish_reason"] == "stop"
        for prompt in ("A dog.\nA cat.", ["A dog.", "A cat.\r\nA bird."]):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt})
            assert r.status_code == 400 and r.json()["error"] == {
                "message": "prompt: holds a line break, and a translation model translates one line (a sentence, "
                           "as `lm translate` reads it); send each line as a prompt of its own (prompt may be a "
                           "list)", "type": "invalid_request_error", "param": "prompt", "code": None}
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "A dog.\r\n"})  # around it: dropped
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "die"
    finally:
        server.close()


def test_bucketed_translation_rows_each_attend_over_their_whole_source():
    """TranslationEngine with bucketed steps (what --compile runs): the source span must hold the
    longest source of *any* row, in any slot, and follow a row that moves down when the row below
    it finishes. Each row's logits at every step against the model's plain teacher-forced forward
    of its source and its target so far (no cache)."""
    model = _model()
    engine = TranslationEngine(model, max_batch=4)
    for step in engine.steps.values():
        step.bucketed = True
    engine.step_sizes = sorted(engine.steps)  # every size: rows move down as the ones below finish
    # slot 0: a short source that finishes first; slot 1: a source of 11 positions (a span of 16);
    # slot 2: one of 25 (a span of 32), which moves down to slot 0 when the first finishes
    srcs = [[5, 9], [30, 4, 8, 8, 21, 22, 3, 17, 40, 41], list(range(3, 27))]
    limits = [3, 12, 12]
    seen, runs = {}, []
    real = engine_module.next_token_and_finite

    def spy(logits, **kw):
        seen.setdefault(id(kw["generator"]), []).append(logits[0].clone())
        return real(logits, **kw)

    engine_module.next_token_and_finite = spy
    try:
        for k, (src, m) in enumerate(zip(srcs, limits)):
            tokens = []
            engine.submit(Request(src, SamplingParams(max_tokens=m, temperature=1.0, seed=k), 1,
                                  on_token=lambda i, t, tokens=tokens: tokens.append(t)))
            runs.append(tokens)
        while engine.step():
            pass
    finally:
        engine_module.next_token_and_finite = real
    cfg = model.config
    assert len(seen) == 3 and len(runs[2]) > 5
    for k, (src, tokens, logits) in enumerate(zip(srcs, runs, seen.values())):
        with torch.no_grad():
            full = model(torch.tensor([src + [cfg.eos_id]]), torch.tensor([[cfg.bos_id, *tokens]]))[0]
        full[:, [cfg.pad_id, cfg.bos_id]] = float("-inf")
        for j, got in enumerate(logits):
            torch.testing.assert_close(got, full[j], rtol=1e-4, atol=1e-4, msg=f"source {k}, target position {j}")


def test_a_translation_engine_checks_lengths_itself_keeps_engines_defaults_and_the_global_generator():
    """For a library caller submitting a Request (no HTTP parser before it): a source that fills the
    context less its <eos> is taken, one token more is refused, as are more target tokens than the
    context less <bos> (mutation: `+ 2` for `+ 1`, survived). The defaults are Engine's (mutation: a
    queue of 257, survived). And the start-up probe draws from its own generator: starting an engine
    leaves torch's global one where it was, so a caller's seeded work after it is unchanged (mutation:
    the probe's target drawn from the global generator, survived)."""
    model = _model()
    state = torch.get_rng_state()
    engine = TranslationEngine(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert (engine.max_batch, engine.max_queue) == (16, 256)
    ctx = model.config.context_length
    engine.check(Request([5] * (ctx - 1), SamplingParams(max_tokens=ctx - 1)))
    with pytest.raises(ValueError) as refused:
        engine.check(Request([5] * ctx, SamplingParams(max_tokens=1)))
    assert str(refused.value) == f"prompt: {ctx} tokens, and the model reads at most {ctx - 1}"
    with pytest.raises(ValueError) as refused:
        engine.check(Request([5], SamplingParams(max_tokens=ctx)))
    assert str(refused.value) == f"max_tokens: this model writes at most {ctx - 1} tokens, got {ctx}"

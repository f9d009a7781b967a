"""The serving engine: continuous batching over a slot cache, checked against the model run
without a cache, and batch invariance (a seeded request's tokens and logits, bit for bit, do
not depend on what else is in the batch)."""

import gc
import threading
import time
import traceback
import weakref

import pytest
import torch
from helpers.collector import collector_off
from helpers.serving import logits_beside

import lm.serve.engine as engine_module
from lm.device import autocast
from lm.generate import generate
from lm.model import TransformerLM
from lm.serve import Engine, QueueFull, Request, SamplingParams
from lm.serve.engine import _widths, choice_seed, default_step_sizes


def tiny_model(positions="rope", **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, context_length=48, d_model=32, num_layers=2, num_heads=4, d_ff=64,
               positions=positions)
    cfg.update(kw)
    return TransformerLM(**cfg).eval()


class Recorder:
    """Collects a request's tokens and finish reasons as the engine sends them."""

    def __init__(self, n=1):
        self.tokens = [[] for _ in range(n)]
        self.reasons = [None] * n

    def request(self, prompt, params, n=1):
        return Request(list(prompt), params, n, on_token=lambda i, t: self.tokens[i].append(t),
                       on_finish=lambda i, r: self.reasons.__setitem__(i, r))


def run_until_idle(engine, limit=10_000):
    for _ in range(limit):
        if not engine.step():
            return
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("positions, dtype", [("rope", None), ("learned", None), ("rope", torch.bfloat16)])
def test_slot_decoding_equals_the_model_without_a_cache(positions, dtype):
    """Every row, at its own length, gets the logits of a plain forward over its whole sequence
    (under bfloat16 autocast, ``lm serve --dtype bfloat16`` and the default on CUDA: the same
    forward under the same autocast, to bfloat16's rounding)."""
    model = tiny_model(positions)
    engine = Engine(model, max_batch=4, dtype=dtype)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [3, 1, 4, 1, 5]]
    seen = {}
    real = engine_module.next_token_and_finite

    def spy(logits, **kw):
        token = real(logits, **kw)
        seen.setdefault(id(kw["generator"]), []).append(logits[0].clone())
        return token

    recs = [Recorder() for _ in prompts]
    engine_module.next_token_and_finite = spy
    try:
        for rec, p in zip(recs, prompts):
            engine.submit(rec.request(p, SamplingParams(max_tokens=6, temperature=0.0)))
        run_until_idle(engine)
    finally:
        engine_module.next_token_and_finite = real
    assert len(seen) == len(prompts)
    for rec, p, logits in zip(recs, prompts, seen.values()):
        seq = p + rec.tokens[0]
        with torch.no_grad(), autocast(torch.device("cpu"), dtype):
            full = model(torch.tensor([seq]))[0]
        # bfloat16: within two units in the last place of the largest logit (measured: one at most)
        tol = 1e-5 if dtype is None else 2 * torch.finfo(dtype).eps * full.abs().max().item()
        for j, got in enumerate(logits):  # token j was chosen from the logits at position len(p) - 1 + j
            assert got.dtype == full.dtype == (dtype or torch.float32)
            torch.testing.assert_close(got, full[len(p) - 1 + j], rtol=1e-5 if dtype is None else 0, atol=tol)


def test_greedy_tokens_equal_generate():
    model = tiny_model()
    engine = Engine(model, max_batch=3)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]]
    recs = [Recorder() for _ in prompts]
    for rec, p in zip(recs, prompts):
        engine.submit(rec.request(p, SamplingParams(max_tokens=12, temperature=0.0)))
    run_until_idle(engine)
    for rec, p in zip(recs, prompts):
        assert rec.tokens[0] == generate(model, p, 12, temperature=0.0)
        assert rec.reasons == ["length"]


def _seeded_run(model, companions: int, join_at: int, max_batch=16, engine=None, max_tokens=20, fill=False):
    """Tokens and logits (bytes) of one seeded request of ``max_tokens``, run with ``companions``
    other requests of other lengths and settings, which arrive ``join_at`` steps after it (-1: just
    before it, so that it takes a slot after theirs); with ``fill`` the companions generate up to
    the end of the context."""
    engine = engine or Engine(model, max_batch=max_batch)
    target = Recorder()
    req = target.request([11, 12, 13, 14], SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9,
                                                          seed=1234))
    g = torch.Generator().manual_seed(companions)
    others = []
    for k in range(companions):
        length = int(torch.randint(1, 20, (1,), generator=g))
        prompt = torch.randint(0, 97, (length,), generator=g).tolist()
        most = model.config.context_length - length if fill else int(torch.randint(1, 25, (1,), generator=g))
        params = SamplingParams(max_tokens=most, temperature=[0.0, 0.7, 1.3][k % 3], top_p=[1.0, 0.5][k % 2], seed=k)
        others.append(Recorder().request(prompt, params))
    logits = logits_beside(engine, req, others, join_at)
    return target.tokens[0], logits


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_seeded_request_is_the_same_alone_or_beside_fifteen_others(dtype):
    model = tiny_model()
    alone = Engine(model, max_batch=16, dtype=dtype)
    alone_tokens, alone_logits = _seeded_run(model, companions=0, join_at=0, engine=alone)
    assert len(alone_tokens) == 20 and set(alone.stats.steps) == {alone.step_sizes[0]}  # the smallest step
    for companions, join_at in ((15, 0), (15, 3), (7, 1), (3, 5), (15, -1), (9, -1)):
        engine = Engine(model, max_batch=16, dtype=dtype)
        tokens, logits = _seeded_run(model, companions, join_at, engine=engine)
        assert tokens == alone_tokens, (companions, join_at)
        assert logits == alone_logits, (companions, join_at)  # bit for bit, every step
        if companions == 15:
            assert 16 in engine.stats.steps  # beside fifteen others: the full step, then smaller ones


def test_each_seed_and_choice_has_its_own_stream():
    """Choice j of seed s was seeded (s << 8 | j) mod 2**63: seeds 2**55 apart (0 and 2**55, -1 and
    2**55 - 1) gave the same text, and choice 256 of a request (n up to --max-batch) repeated its
    choice 0. Now a 64-bit hash of (seed, choice): every pair its own generator seed."""
    pairs = [(s, j) for s in (0, 1, 4, 5, -1, 2**55, 2**55 - 1, 2**63, 2**64 - 1, -(2**63), 10**30)
             for j in (0, 1, 255, 256, 257)]
    seeds = [choice_seed(s, j) for s, j in pairs]
    assert len(set(seeds)) == len(pairs) and all(0 <= x < 2**64 for x in seeds)
    assert choice_seed(5, 0) == choice_seed(5, 0)  # a function of the pair only
    model = tiny_model()
    engine = Engine(model, max_batch=4)
    texts = {}
    for seed in (0, 2**55, -1, 2**55 - 1):
        engine.submit((rec := Recorder(2)).request([3, 4], SamplingParams(max_tokens=12, seed=seed), n=2))
        run_until_idle(engine)
        texts[seed] = rec.tokens
    assert texts[0] != texts[2**55] and texts[-1] != texts[2**55 - 1]
    assert all(t[0] != t[1] for t in texts.values())
    again = Recorder(2)
    engine.submit(again.request([3, 4], SamplingParams(max_tokens=12, seed=0), n=2))
    run_until_idle(engine)
    assert again.tokens == texts[0]


def test_logprobs_are_the_models_own_beside_others_and_leave_the_tokens_alone():
    """Each generated token's log-probability and top alternatives are log_softmax of the model's
    logits without a cache at its position (not of what temperature and top-p sample from); the
    prompt's, from the second token, too; asking for them changes no token, and beside seven other
    requests they are the same bit for bit."""
    model = tiny_model()
    prompt = [11, 12, 13, 14, 15]
    kw = dict(max_tokens=12, temperature=1.3, top_p=0.5, seed=21)
    plain, with_lp, beside = Recorder(), Recorder(), Recorder()
    engine = Engine(model, max_batch=8)
    engine.submit(plain.request(prompt, SamplingParams(**kw)))
    engine.submit(r := with_lp.request(prompt, SamplingParams(**kw, logprobs=3, prompt_logprobs=2)))
    run_until_idle(engine)
    assert r.logprobs is not None and with_lp.tokens == plain.tokens and len(r.logprobs[0]) == 12
    seq = prompt + with_lp.tokens[0]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([seq]))[0].float(), dim=-1)
    for j, (token, (own, top)) in enumerate(zip(with_lp.tokens[0], r.logprobs[0])):
        row = want[len(prompt) - 1 + j]
        assert abs(own - row[token].item()) < 1e-5
        values, ids = row.topk(3)
        assert [i for i, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, rtol=0, atol=1e-5)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        own, top = r.prompt_logprobs[t]
        assert abs(own - want[t - 1, prompt[t]].item()) < 1e-5
        assert [i for i, _ in top] == want[t - 1].topk(2)[1].tolist()
    companions = [Recorder().request([k + 1] * (k + 2), SamplingParams(max_tokens=20, seed=k, logprobs=k % 3))
                  for k in range(7)]
    engine.submit(again := beside.request(prompt, SamplingParams(**kw, logprobs=3)))
    for c in companions:
        engine.submit(c)
    run_until_idle(engine)
    assert beside.tokens == plain.tokens and again.logprobs == r.logprobs and 8 in engine.stats.steps
    # a tokenizer smaller than the model's vocabulary: over its tokens, the ids the engine samples from
    small = Engine(model, max_batch=4, vocab_size=90)
    small.submit(r := Recorder().request(prompt, SamplingParams(max_tokens=1, logprobs=2, seed=3)))
    run_until_idle(small)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt]))[0, -1, :90].float(), dim=-1)
    own, top = r.logprobs[0][0]
    assert [i for i, _ in top] == want.topk(2)[1].tolist() and abs(top[0][1] - want.max().item()) < 1e-5
    with pytest.raises(ValueError, match=r"logprobs must be None or a whole number in \[0, 20\], got 21"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("max_batch", [6, 11])
def test_a_seeded_request_in_the_last_slot_gets_the_bits_it_gets_alone(max_batch):
    """A seeded request in the last slot, behind max_batch - 1 others, gets the bits it gets alone,
    whatever this CPU's BLAS does with 6 or 11 rows: here it computes the last rows of a 5-7 or 9-11-row
    matmul apart (other bits), and the largest step gets idle rows beyond the slots (8, 12); a CPU
    whose kernels keep the rows alike (the GPU machine's, under torch 2.11) serves with 6 or 11."""
    model = tiny_model()
    engine = Engine(model, max_batch=max_batch)
    assert engine.slot_invariant and len(engine.rows) == max_batch
    assert max(engine.steps) == engine.cache.rows in _widths(max_batch)
    if engine.cache.rows > max_batch:  # a wider step serves, so the max_batch step's rows differed
        assert max_batch not in engine.step_sizes
    alone = _seeded_run(model, 0, 0, engine=Engine(model, max_batch=max_batch))
    for join_at in (-1, 0):
        assert _seeded_run(model, max_batch - 1, join_at, engine=Engine(model, max_batch=max_batch)) == alone


def _by_slot(made: list[int], only: int | None = None) -> type:
    """A DecodeStep that records the rows of each step made in ``made`` and adds 1e-3 times its slot
    to each row's logits (so that a row's bits depend on its slot), at ``only`` rows or (None) at all."""

    class BySlot(engine_module.DecodeStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.rows)

        def __call__(self, ids, lengths, full_span=False):
            out = super().__call__(ids, lengths, full_span=full_span)
            skewed = only is None or self.rows == only
            return out + torch.arange(out.shape[0], dtype=out.dtype)[:, None] * 1e-3 if skewed else out

    return BySlot


def test_a_max_batch_whose_step_is_not_slot_invariant_gets_a_wider_step(monkeypatch):
    """Rows that differ by slot in the 6-row step only (as this CPU's BLAS does, but on any machine):
    the largest step takes the next width, 8 rows, the 6-row step is dropped, and a seeded request
    in the last slot behind five others gets the bits it gets alone."""
    made = []
    monkeypatch.setattr(engine_module, "DecodeStep", _by_slot(made, only=6))
    model = tiny_model()
    engine = Engine(model, max_batch=6)
    assert made == [1, 2, 4, 6, 1, 2, 4, 6, 8]  # width 6, then 8
    assert engine.slot_invariant and engine.cache.rows == 8 and max(engine.steps) == 8 and len(engine.rows) == 6
    assert 6 not in engine.step_sizes and 6 in engine.dropped_sizes
    alone = _seeded_run(model, 0, 0, engine=Engine(model, max_batch=6))
    for join_at in (-1, 0):
        assert _seeded_run(model, 5, join_at, engine=Engine(model, max_batch=6)) == alone


def test_when_no_width_is_slot_invariant_the_max_batch_step_serves_alone(monkeypatch):
    """Steps whose rows differ by slot at every width (as a device's kernels might): the engine
    tries the wider ones, then serves with the max_batch step alone and says so (slot_invariant
    False); with one width to try it makes its steps once (compiled: one compilation, not two)."""
    made = []
    monkeypatch.setattr(engine_module, "DecodeStep", _by_slot(made))
    engine = Engine(tiny_model(), max_batch=6)
    assert not engine.slot_invariant and engine.step_sizes == [6] and engine.cache.rows == 6
    assert made == [1, 2, 4, 6, 1, 2, 4, 6, 8, 1, 2, 4, 6]  # widths 6, then 8, then 6 again to serve
    made.clear()
    engine = Engine(tiny_model(), max_batch=8)
    assert not engine.slot_invariant and engine.step_sizes == [8] and made == [1, 2, 4, 8]


def test_default_step_sizes_are_the_powers_of_two_below_max_batch_and_max_batch():
    assert default_step_sizes(16) == [1, 2, 4, 8, 16]
    assert default_step_sizes(12) == [1, 2, 4, 8, 12]
    assert default_step_sizes(1) == [1]
    with pytest.raises(ValueError, match=r"step_sizes: each must be a whole number in \[1, max_batch=4\], got 5"):
        Engine(tiny_model(), max_batch=4, step_sizes=[2, 5])


def test_the_kept_step_sizes_give_a_row_the_largest_steps_bits_in_every_slot_and_the_dropped_ones_do_not():
    """The start-up probe's verdict, checked on other content: a prefilled sequence in every slot."""
    model = tiny_model()
    engine = Engine(model, max_batch=16)
    assert engine.step_sizes[-1] == 16 and sorted(engine.step_sizes + engine.dropped_sizes) == [1, 2, 4, 8, 16]
    one = model.new_cache(1, max_len=5)
    with torch.inference_mode():
        model(torch.tensor([[3, 1, 4, 1, 5]]), kv_cache=one)
    for slot in range(16):
        engine.cache.fill_from(slot, one)
    out = {b: step([9] * b, [5] * b).clone() for b, step in engine.steps.items()}
    want = out[16][0]
    for b in engine.step_sizes:
        assert all(torch.equal(row, want) for row in out[b]), b
    for b in engine.dropped_sizes:
        assert not all(torch.equal(row, want) for row in out[b]), b
        torch.testing.assert_close(out[b][0], want, rtol=1e-5, atol=1e-5)  # the last bits only


class Skewed:
    """A decode step whose logits ``skew(logits, full_span)`` changes (in the last bits)."""

    def __init__(self, step, skew):
        self.step, self.skew, self.bucketed = step, skew, step.bucketed

    def __call__(self, ids, lengths, full_span=False):
        self.step.bucketed = self.bucketed
        return self.skew(self.step(ids, lengths, full_span=full_span), full_span)


def test_a_step_size_whose_rows_differ_is_dropped():
    engine = Engine(tiny_model(), max_batch=8, step_sizes=[4])
    assert engine.step_sizes == [4, 8], engine.dropped_sizes  # 4+ rows: one BLAS kernel on this CPU
    assert not engine.bucketed  # eager steps attend over the whole cache
    real4, real8 = engine.steps[4], engine.steps[8]
    engine.steps[4] = Skewed(real4, lambda out, full: out * (1 + 1e-6))
    assert engine._invariant_sizes() == ([8], [4])
    engine.steps[4] = real4  # the largest step's own rows disagree: its slots are not interchangeable
    engine.steps[8] = Skewed(real8, lambda out, full: out + torch.arange(8.0)[:, None] * 1e-6)
    assert engine._invariant_sizes() == ([8], [4]) and not engine.slot_invariant
    # (as compiled steps do) over a short span, where the logits differ from those over the whole
    # cache: every step goes back to the whole cache
    real4.bucketed = real8.bucketed = True
    engine.steps[8] = skewed = Skewed(real8, lambda out, full: out if full or not skewed.bucketed else out * (1 + 1e-6))
    assert engine._invariant_sizes() == ([4, 8], []) and engine.slot_invariant
    assert not engine.bucketed and not skewed.bucketed and not real4.bucketed


def test_a_step_size_that_differs_at_the_last_position_only_is_dropped():
    """The probes run up to the context's last position, "one that fills it" (seed 14: the long
    probe one token shorter survived). A step whose logits differ there only, where every
    reduction over the key positions runs in full, is dropped as one that differs anywhere."""
    engine = Engine(tiny_model(), max_batch=8, step_sizes=[4])
    assert engine.step_sizes == [4, 8]
    last = engine.context_length - 1
    real4 = engine.steps[4]
    seen = []

    def at_last(ids, lengths, full_span=False):
        seen.extend(lengths)
        out = real4(ids, lengths, full_span=full_span)
        return out * (1 + 1e-6) if max(lengths) == last else out

    at_last.bucketed = real4.bucketed
    engine.steps[4] = at_last
    assert engine._invariant_sizes() == ([8], [4])
    assert max(seen) == last


def test_rows_move_down_as_others_finish_and_the_smallest_step_that_holds_them_runs():
    model = tiny_model()
    engine = Engine(model, max_batch=16)
    if len(engine.step_sizes) == 1:
        pytest.skip(f"only the {engine.max_batch}-row step is batch-invariant here")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(14)]
    recs = [Recorder() for _ in prompts]
    for k, (rec, p) in enumerate(zip(recs, prompts)):
        engine.submit(rec.request(p, SamplingParams(max_tokens=2 + 3 * k % 25, temperature=0.0)))
    moves, sizes = [], []
    real_move = engine.cache.move
    engine.cache.move = lambda source, row, length: (moves.append((source, row)), real_move(source, row, length))

    def watched(size, step):
        def run(ids, lengths):
            active = [i for i, r in enumerate(engine.rows) if r is not None]
            assert active == list(range(len(active)))  # the lowest slots
            assert size == min(b for b in engine.step_sizes if b >= len(active))  # the smallest step
            sizes.append(size)
            return step(ids, lengths)
        return run

    engine.steps = {b: watched(b, step) for b, step in engine.steps.items()}
    run_until_idle(engine)
    assert moves and len(set(sizes)) > 1 and sizes == sorted(sizes, reverse=True)
    for k, (rec, p) in enumerate(zip(recs, prompts)):
        assert rec.tokens[0] == generate(model, p, 2 + 3 * k % 25, temperature=0.0), k


@pytest.mark.slow
def test_the_compiled_step_is_batch_invariant_too_and_matches_eager_logits():
    """--compile: torch.compile'd fixed-shape step (one compilation for the sizes above one row,
    reused by every run), over a whole context: 4 prompt tokens + 44 generated = 48."""
    model = tiny_model()
    engine = Engine(model, max_batch=16, compile=True)
    # 2..16 rows: one compiled graph with the rows symbolic, and the batch-invariant matmuls. One row
    # gets a graph of its own (torch.compile specializes a dimension of size 1). When the steps read
    # the whole cache, its attention summed the keys in another order (other last bits past ~24
    # positions here, which the start-up probe, with a sequence that fills the context, saw and
    # dropped); compiled for any span, it agrees (kept here, but a probe's call).
    assert engine.step_sizes[-4:] == [2, 4, 8, 16]
    assert engine.bucketed  # and over the positions in use: the seeded runs below go through spans of 16 to 48
    assert len({id(step._fn) for step in engine.steps.values()}) == 1  # one compiled function for every size
    alone_tokens, alone_logits = _seeded_run(model, 0, 0, engine=engine, max_tokens=44)
    assert set(engine.stats.steps) == {engine.step_sizes[0]}  # alone: the smallest step kept
    for companions, join_at in ((15, 0), (7, 1)):  # beside others to the end of the context
        tokens, logits = _seeded_run(model, companions, join_at, engine=engine, max_tokens=44, fill=True)
        assert tokens == alone_tokens and logits == alone_logits, (companions, join_at)
    assert set(engine.stats.steps) >= {2, 4, 8, 16}
    eager_tokens, eager_logits = _seeded_run(model, 0, 0, max_tokens=44)
    for got, want in zip(alone_logits, eager_logits):  # compiled kernels: the same logits to rounding
        got, want = (torch.frombuffer(bytearray(b), dtype=torch.float32) for b in (got, want))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert alone_tokens == eager_tokens


def test_continuous_batching_joins_the_running_batch_and_frees_rows_at_once():
    model = tiny_model()
    engine = Engine(model, max_batch=2)
    a, b, c = Recorder(), Recorder(), Recorder()
    engine.submit(a.request([1, 2], SamplingParams(max_tokens=10, temperature=0.0)))
    engine.step()
    engine.step()
    engine.submit(b.request([3, 4], SamplingParams(max_tokens=3, temperature=0.0)))
    engine.submit(c.request([5], SamplingParams(max_tokens=2, temperature=0.0)))
    engine.step()  # b joins the running batch at once: a is not finished
    assert len(a.tokens[0]) == 4 and len(b.tokens[0]) == 2 and c.tokens[0] == []  # a prefill emits one too
    engine.step()  # b finishes (3 tokens) and leaves its row
    assert b.reasons == ["length"] and engine.rows.count(None) == 1
    engine.step()  # c takes b's row at the next step, while a is still decoding
    assert len(c.tokens[0]) == 2 and c.reasons == ["length"] and a.reasons == [None]
    run_until_idle(engine)
    assert a.reasons == ["length"] and len(a.tokens[0]) == 10
    assert engine.stats.generated_tokens == 15 and engine.stats.requests["finished"] == 3


def test_vocab_size_limits_the_ids_every_row_samples():
    model = tiny_model()
    engine = Engine(model, max_batch=3, vocab_size=30)
    greedy, hot = Recorder(), Recorder(n=2)
    engine.submit(greedy.request([5, 6], SamplingParams(max_tokens=12, temperature=0.0)))
    engine.submit(hot.request([5], SamplingParams(max_tokens=40, temperature=2.0, seed=1), n=2))
    run_until_idle(engine)
    assert greedy.tokens[0] == generate(model, [5, 6], 12, temperature=0.0, vocab_size=30)
    assert all(max(t) < 30 for t in hot.tokens) and len(set(hot.tokens[0] + hot.tokens[1])) > 10
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(model, vocab_size=98)


def test_cancel_end_of_text_choices_and_a_full_queue():
    model = tiny_model()
    eos = generate(model, [7, 8], 1, temperature=0.0)[0]  # the greedy next token: make it the end of text
    engine = Engine(model, max_batch=2, max_queue=1, eos_id=eos)
    stop, cancel, many = Recorder(), Recorder(), Recorder(n=2)
    engine.submit(stop.request([7, 8], SamplingParams(max_tokens=10, temperature=0.0)))
    run_until_idle(engine)
    assert stop.tokens[0] == [eos] and stop.reasons == ["stop"]
    past = Recorder()  # ignore_eos: the end-of-text token is just another token, as in the plain forward
    engine.submit(past.request([7, 8], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)))
    run_until_idle(engine)
    assert past.tokens[0] == generate(model, [7, 8], 10, temperature=0.0) and past.reasons == ["length"]

    engine = Engine(model, max_batch=2, max_queue=1)
    r = cancel.request([1], SamplingParams(max_tokens=30, temperature=0.0))
    engine.submit(r)
    engine.step()
    engine.step()
    r.cancel()
    engine.step()
    assert cancel.reasons == ["cancelled"] and len(cancel.tokens[0]) == 3 and not engine.busy  # 2 steps, 3 tokens

    r = many.request([1, 2], SamplingParams(max_tokens=5, temperature=1.0, seed=3), n=2)
    engine.submit(r)
    engine.step()  # its two choices take both rows
    waiting = Recorder(n=2)
    engine.submit(w := waiting.request([1], SamplingParams(max_tokens=5), n=2))  # waits
    with pytest.raises(QueueFull):
        engine.submit(Recorder().request([1], SamplingParams(max_tokens=5), n=2))
    w.cancel()  # ends while waiting
    run_until_idle(engine)
    assert many.reasons == ["length", "length"] and many.tokens[0] != many.tokens[1]  # own generator each
    assert waiting.reasons == ["cancelled", "cancelled"]
    # counted by choice, whether they ran or not (/metrics' lm_requests_total)
    assert engine.stats.requests == {"finished": 2, "cancelled": 3, "rejected": 2, "failed": 0}


def test_a_request_cancelled_while_waiting_leaves_the_queue_at_once():
    """A request cancelled whole while it waits (its client gone) frees its place in the queue at
    once: ``max_queue`` and the queue depth count live requests only. Dead ones had stayed until
    they reached the head, so that live requests got QueueFull (503) with the queue full of them.
    The engine's thread ends its choices ("cancelled") at its next step. Several requests (the
    prompts of one call) queue all or none: refused, none of them waits, all counted rejected."""
    engine = Engine(tiny_model(), max_batch=1, max_queue=2)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    running, gone, live, late = Recorder(), Recorder(), Recorder(), Recorder()
    engine.submit(running.request([1], params))
    engine.step()  # it holds the only row: the others wait
    engine.submit(dead := gone.request([2], params))
    engine.submit(live.request([3], params))
    with pytest.raises(QueueFull):
        engine.submit(Recorder().request([4], params))
    dead.cancel()
    assert len(engine.waiting) == 1 and engine.stats.queue_depth == 1 and engine.busy
    engine.submit(late.request([4], params))  # the place it left
    with pytest.raises(QueueFull, match="this request has 2 prompts"):
        engine.submit_all([Recorder().request([5], params), Recorder().request([6], params)])
    assert len(engine.waiting) == 2
    engine.step()
    assert gone.reasons == ["cancelled"] and gone.tokens == [[]]  # told at the next step, the head still waiting
    run_until_idle(engine)
    assert running.reasons == live.reasons == late.reasons == ["length"] and engine.stats.queue_depth == 0
    assert engine.stats.requests == {"finished": 3, "cancelled": 1, "rejected": 3, "failed": 0}


def test_a_choice_the_server_stops_ends_finished_and_frees_its_row_at_once():
    """``Request.stop(index)`` (the server saw a stop string in that choice's text) ends the choice
    at the next step as "stop", counted finished (it had been ended with cancel and counted as an
    abandoned request); the other choice goes on, and a waiting request takes the freed row."""
    engine = Engine(tiny_model(), max_batch=2)
    both, waiting = Recorder(n=2), Recorder()
    engine.submit(r := both.request([1, 2], SamplingParams(max_tokens=10, seed=1), n=2))
    engine.submit(waiting.request([3], SamplingParams(max_tokens=3, seed=2)))
    engine.step()
    engine.step()
    r.stop(0)
    engine.step()
    assert both.reasons == ["stop", None] and len(both.tokens[0]) == 3 and waiting.tokens[0]  # in the freed row
    run_until_idle(engine)
    assert both.reasons == ["stop", "length"] and waiting.reasons == ["length"]
    assert engine.stats.requests == {"finished": 3, "cancelled": 0, "rejected": 0, "failed": 0}


def test_max_tokens_0_scores_the_prompt_without_a_slot_or_a_token():
    """``max_tokens`` 0 (echo without generation, as OpenAI's and vLLM's): the prompt's
    log-probabilities, computed on the engine's thread, and every choice ended "length" with no
    token; it needs no row, so it does not wait behind the requests that hold them."""
    model = tiny_model()
    engine = Engine(model, max_batch=2)
    busy, scored = Recorder(n=2), Recorder(n=2)
    engine.submit(busy.request([1], SamplingParams(max_tokens=20), n=2))
    engine.step()
    prompt = [11, 12, 13, 14]
    engine.submit(r := scored.request(prompt, SamplingParams(max_tokens=0, logprobs=1, prompt_logprobs=2), n=2))
    engine.step()
    assert scored.reasons == ["length", "length"] and scored.tokens == [[], []] and busy.reasons == [None, None]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        own, top = r.prompt_logprobs[t]
        assert abs(own - want[t - 1, prompt[t]].item()) < 1e-5
        assert [i for i, _ in top] == want[t - 1].topk(2)[1].tolist()
    assert engine.stats.generated_tokens == sum(map(len, busy.tokens)) and engine.stats.requests["finished"] == 2
    with pytest.raises(ValueError, match="max_tokens must be a whole number >= 0, got -1"):
        SamplingParams(max_tokens=-1)


def test_a_one_token_context_probes_nothing_and_scores_prompts_only():
    """With a context of one token no request can generate (a prompt and a token do not fit), so there
    is nothing to probe: the max_batch step alone is kept, the smaller ones dropped (mutation: the
    max_batch step dropped instead survived); a one-token prompt is still scored (max_tokens 0)."""
    engine = Engine(tiny_model(context_length=1), max_batch=4)
    assert (engine.step_sizes, engine.dropped_sizes, engine.slot_invariant) == ([4], [1, 2], False)
    scored = Recorder()
    engine.submit(scored.request([5], SamplingParams(max_tokens=0, prompt_logprobs=1)))
    run_until_idle(engine)
    assert scored.reasons == ["length"] and scored.tokens == [[]]
    with pytest.raises(ValueError, match=r"^max_tokens: the context is 1 tokens, and this request asks for 2 "):
        engine.submit(Request([5], SamplingParams(max_tokens=1)))


def test_a_two_token_context_is_probed_and_generates_its_one_token():
    """A context of two tokens holds a prompt and a token, so its steps are probed (one prompt token,
    one step: rows found slot-invariant), and a request generates its token, greedy as generate()'s;
    the probe had been skipped there too in a mutant (``ctx <= 2``), serving as if rows were not
    slot-invariant."""
    model = tiny_model(context_length=2)
    engine = Engine(model, max_batch=4)
    assert engine.slot_invariant and 4 in engine.step_sizes
    got = Recorder()
    engine.submit(got.request([5], SamplingParams(max_tokens=1, temperature=0.0)))
    run_until_idle(engine)
    assert got.reasons == ["length"] and got.tokens == [generate(model, [5], 1, temperature=0.0)]


@pytest.mark.parametrize("bad, message", [
    (dict(prompt_ids=[]), "prompt: empty"),
    (dict(prompt_ids=[1, 97]), "prompt: token id 97"),
    (dict(n=5), "n: must be"),
    (dict(params=SamplingParams(max_tokens=48)), "max_tokens: the context is 48 tokens"),
])
def test_requests_that_can_never_run_are_refused_naming_the_field(bad, message):
    engine = Engine(tiny_model(), max_batch=4)
    fields = dict(prompt_ids=[1, 2], params=SamplingParams(max_tokens=4), n=1)
    fields.update(bad)
    with pytest.raises(ValueError, match=message):
        engine.submit(Request(**fields))


@pytest.mark.parametrize("eos", [97, -1, [1, 2], True, 2.0, "5"])
def test_eos_id_is_checked_as_generate_checks_it(eos):
    """Engine stored any eos_id: 97 (past the vocabulary), -1 and [1, 2] could never match a token,
    so a request never stopped at the end of text."""
    model = tiny_model()
    with pytest.raises(ValueError, match=r"^eos_id must be None or one token id in \[0, vocab_size=97\), got eos_id="):
        Engine(model, max_batch=2, eos_id=eos)
    with pytest.raises(ValueError, match=r"^eos_id must be None or one token id in \[0, vocab_size=97\), got eos_id="):
        generate(model, [1, 2], 1, eos_id=eos)


def test_an_eos_id_past_the_sampling_limit_is_refused_and_n_may_be_a_numpy_integer():
    """generate20: an eos_id at or past vocab_size (the tokenizer's size, below which ids are drawn) could
    never be drawn, so generation never stopped at it: taken without a word by generate and Engine.
    And Request(n=np.int64(2)) was refused where every other count of the engine takes numpy's."""
    import numpy as np

    model = tiny_model()
    for eos in (90, 95):
        with pytest.raises(ValueError) as e:
            Engine(model, max_batch=2, eos_id=eos, vocab_size=90)
        assert str(e.value) == f"eos_id must be None or one token id in [0, vocab_size=90), got eos_id={eos}"
        with pytest.raises(ValueError) as e:
            generate(model, [1, 2], 3, eos_id=eos, vocab_size=90)
        assert str(e.value) == f"eos_id must be None or one token id in [0, vocab_size=90), got eos_id={eos}"
    Engine(model, max_batch=2, eos_id=89, vocab_size=90)
    engine = Engine(model, max_batch=4)
    rec = Recorder(2)
    request = Request([1, 2], SamplingParams(max_tokens=3, seed=1), n=np.int64(2),
                      on_token=lambda i, t: rec.tokens[i].append(t))
    engine.submit(request)
    while engine.step():
        pass
    assert request.n == 2 and type(request.n) is int and [len(rec.tokens[i]) for i in range(2)] == [3, 3]


def test_prompts_as_arrays_tensors_and_numpy_ids_are_taken_as_generate_takes_them():
    """An array or tensor prompt failed with "truth value ... ambiguous", a numpy id was "outside [0, 97)"
    though inside, a float id was said to be out of range, and a dict for params an AttributeError."""
    import numpy as np

    model = tiny_model()
    engine = Engine(model, max_batch=4, eos_id=np.int64(5))
    assert engine.eos_id == 5 and type(engine.eos_id) is int
    params = SamplingParams(max_tokens=3, temperature=0.0)
    want = generate(model, [1, 2, 3], 3, temperature=0.0, eos_id=5)
    for prompt in (np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), np.int32(2), 3]):
        rec = Recorder()
        req = Request(prompt, params, on_token=lambda i, t, rec=rec: rec.tokens[i].append(t))
        assert req.prompt_ids == [1, 2, 3] and all(type(t) is int for t in req.prompt_ids)
        engine.submit(req)
        run_until_idle(engine)
        assert rec.tokens[0] == want
    for prompt, message in (([1.0, 2.0], "prompt_ids: token ids must be integers, got 1.0"),
                            ([1, True], "prompt_ids: token ids must be integers, got True"),
                            (torch.tensor([1.0, 2.0]), "prompt_ids: token ids must be integers, got a tensor of "
                                                       "torch.float32"),
                            (np.array([[1, 2]]), "prompt_ids: a prompt must be 1-D, got an array of shape (1, 2)"),
                            (None, "prompt_ids must be a list of token ids, a 1-D tensor or array, got None"),
                            ("1 2", "prompt_ids must be a list of token ids, a 1-D tensor or array, got '1 2'")):
        with pytest.raises(ValueError) as e:
            Request(prompt, params)
        assert str(e.value) == message
    with pytest.raises(ValueError, match=r"^params must be a SamplingParams, got params=\{'max_tokens': 4\}$"):
        Request([1, 2], {"max_tokens": 4})
    with pytest.raises(ValueError, match=r"^prompt: token id 97 is outside \[0, 97\)$"):
        engine.submit(Request(np.array([1, 97]), params))


def test_the_engine_thread_serves_and_stops():
    model = tiny_model()
    engine = Engine(model, max_batch=4)
    engine.start()
    done = threading.Event()
    rec = Recorder()
    req = rec.request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    req.on_finish = lambda i, r: (rec.reasons.__setitem__(i, r), done.set())
    engine.submit(req)
    assert done.wait(30)
    assert rec.tokens[0] == generate(model, [1, 2, 3], 8, temperature=0.0)
    engine.stop()


def test_finished_requests_kept_to_read_their_logprobs_do_not_keep_the_engine():
    """A request held on to its engine (for cancel) after it ended: a caller who kept requests to
    read their logprobs kept the stopped engine's model, cache and decode steps with them (cyc25).
    The engine is freed when dropped, with the collector off; cancelling such a request does nothing."""
    engine = Engine(tiny_model(), max_batch=2)
    recs = [Recorder(), Recorder()]
    kept = [r.request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, logprobs=1)) for r in recs]
    engine.submit_all(kept)
    run_until_idle(engine)
    refs = [weakref.ref(engine), weakref.ref(engine.model), weakref.ref(engine.cache.k[0])]
    with collector_off():
        del engine
        assert [r() is None for r in refs] == [True] * 3
    assert [len(r.logprobs[0]) for r in kept] == [3, 3] and recs[0].reasons == ["length"]
    kept[0].cancel()
    assert recs[0].reasons == ["length"]


def _engine_with_a_nan_token():
    """A tiny model whose token 13 has a NaN embedding (its logits are not finite), an engine of two
    rows serving it, and the list its ``on_row_error`` appends ``(request, message)`` to."""
    model = tiny_model()
    with torch.no_grad():
        model.token_embeddings.weight[13] = float("nan")
    engine = Engine(model, max_batch=2)
    failed = []
    engine.on_row_error = lambda request, error: failed.append((request, str(error)))
    return model, engine, failed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_logits_are_not_finite_fails_alone(temperature):
    """A prompt that makes the model's logits NaN (here: a token whose embedding is NaN) ends its
    own choice with "error" (a 500 for its request, the log told through ``on_row_error``); the
    rows beside it go on, and the engine takes new requests. Greedy had sent tokens picked from
    NaN logits as text; sampled, torch's multinomial had raised and the whole server had exited."""
    model, engine, failed = _engine_with_a_nan_token()
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3)
    bad, good, later = Recorder(), Recorder(), Recorder()
    bad_request = bad.request([5, 13, 7], params)
    engine.submit(bad_request)
    engine.submit(good.request([5, 6, 7], params))
    run_until_idle(engine)
    assert bad.reasons == ["error"] and bad.tokens == [[]]
    assert failed == [(bad_request, "the model's logits are not finite (NaN or inf) at new token 1")]
    assert good.reasons == ["length"] and len(good.tokens[0]) == 6
    engine.submit(later.request([5, 6, 7], params))
    run_until_idle(engine)
    assert later.tokens == good.tokens and engine.error is None
    if temperature == 0.0:
        assert good.tokens[0] == generate(model, [5, 6, 7], 6, temperature=0.0)


def test_a_choice_seed_is_the_32_bits_torch_keeps_so_the_streams_are_those_of_before():
    """choice_seed returned a 64-bit hash, and said that a (seed, choice) 'never' got another's stream;
    torch's CPU generator keeps the low 32 bits of a seed, so two pairs can meet (each pair with
    probability 2**-32). It now returns those 32 bits, which give the streams the 64-bit hash gave."""
    import hashlib

    for seed, index in ((0, 0), (5, 1), (2**63, 3), (-1, 256), (10**30, 7)):
        digest = hashlib.blake2b(f"{seed},{index}".encode(), digest_size=8, person=b"lm-choice").digest()
        before = int.from_bytes(digest, "little")
        now = choice_seed(seed, index)
        assert 0 <= now < 2**32 and now == before % 2**32
        draws = [torch.randint(0, 2**31, (16,), generator=torch.Generator().manual_seed(s)) for s in (before, now)]
        assert torch.equal(*draws)
    generators = SamplingParams(seed=5).choice_generators(3)
    assert [g.initial_seed() for g in generators] == [choice_seed(5, j) for j in range(3)]


def test_a_request_ended_whole_is_counted_before_its_client_hears():
    """A request ended as a whole (failed scoring, a prompt scored with max_tokens 0, cancelled while
    waiting) told its client first and counted it after, so /metrics read right after the answer
    could miss it (a test saw this under load); a row that ends was already counted first."""
    _, engine, _ = _engine_with_a_nan_token()
    seen = []

    def request(prompt, params):
        return Request(list(prompt), params, 1, on_finish=lambda i, r: seen.append((r, dict(engine.stats.requests))))

    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    engine.submit(request([5, 13, 7], params))  # fails: a NaN token
    engine.submit(request([5, 6, 7], params))  # scored, nothing to sample
    run_until_idle(engine)
    engine.submit(waiting := request([5, 6, 7], SamplingParams(max_tokens=4)))
    waiting.cancel()
    run_until_idle(engine)
    assert seen == [("error", {"finished": 0, "cancelled": 0, "rejected": 0, "failed": 1}),
                    ("length", {"finished": 1, "cancelled": 0, "rejected": 0, "failed": 1}),
                    ("cancelled", {"finished": 1, "cancelled": 1, "rejected": 0, "failed": 1})]


def test_a_scored_prompt_whose_logits_are_not_finite_fails_its_request_alone():
    """``max_tokens`` 0 (echo: the prompt scored, nothing sampled) never reached ``_emit``'s check:
    NaN log-probabilities went out (a 500 "internal error" and a traceback, or bare ``NaN`` in a
    stream), counted finished. Now the request ends with "error" on every choice, the log told
    through ``on_row_error``, counted failed; the request beside it is scored."""
    _, engine, failed = _engine_with_a_nan_token()
    bad, good = Recorder(n=2), Recorder()
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    engine.submit(bad_request := bad.request([5, 13, 7], params, n=2))
    engine.submit(good_request := good.request([5, 6, 7], params))
    run_until_idle(engine)
    assert bad.reasons == ["error", "error"] and bad_request.prompt_logprobs is None
    assert failed == [(bad_request, "the model's logits are not finite (NaN or inf)")]
    assert good.reasons == ["length"] and len(good_request.prompt_logprobs) == 3
    assert engine.stats.requests == {"finished": 1, "cancelled": 0, "rejected": 0, "failed": 2}
    # with tokens to generate the prompt is scored first, and fails the same way, before taking a row
    engine.submit(again := bad.request([5, 13, 7], SamplingParams(max_tokens=4, prompt_logprobs=1)))
    run_until_idle(engine)
    assert failed[-1] == (again, "the model's logits are not finite (NaN or inf)") and not engine.busy


def test_sampling_params_take_numpy_integers_as_ints():
    """`SamplingParams(max_tokens=np.int64(3))` was refused as "must be a whole number >= 0, got
    np.int64(3)", a message that contradicts itself, while top_k took the same value (apifuzz19 #20)."""
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(3), seed=np.uint32(7), logprobs=np.int8(2), prompt_logprobs=np.int16(1),
                            top_k=np.int64(5))
    assert (params.max_tokens, params.seed, params.logprobs, params.prompt_logprobs, params.top_k) == (3, 7, 2, 1, 5)
    assert all(type(v) is int for v in (params.max_tokens, params.seed, params.logprobs, params.top_k))
    assert params == SamplingParams(max_tokens=3, seed=7, logprobs=2, prompt_logprobs=1, top_k=5)
    for bad, message in ((dict(max_tokens=1.0), "max_tokens must be a whole number >= 0, got 1.0"),
                         (dict(seed=1.5), "seed must be an integer, got 1.5"),
                         (dict(logprobs=np.bool_(True)), r"logprobs must be None or a whole number in \[0, 20\]")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)


def test_engine_takes_an_autocast_dtype_only():
    """Engine(dtype='bfloat16') failed inside torch, and Engine(dtype=torch.int64) only warned that
    autocast was disabled (apifuzz19 #21): the dtype is autocast's, float32, bfloat16 or float16, or None."""
    model = tiny_model().train()
    for bad, hint in (("bfloat16", " (pass torch.bfloat16, not its name)"), (torch.int64, ""), (torch.float64, ""),
                      ("float64", ""), (16, "")):
        with pytest.raises(ValueError) as e:
            Engine(model, max_batch=2, dtype=bad)
        assert str(e.value) == ("dtype must be one of torch.float32, torch.bfloat16, torch.float16 or None, "
                                f"got dtype={bad!r}{hint}")
        assert model.training  # refused before the engine took the model
    assert Engine(model, max_batch=2, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_request_callbacks_and_engine_sizes_are_checked_when_given():
    """review19: `Request(..., on_token=5)` was taken and failed every request of the engine's next step;
    Engine(max_batch=np.int64(2)) and numpy step sizes were refused while SamplingParams took numpy ints."""
    import numpy as np

    for name in ("on_token", "on_finish"):
        with pytest.raises(ValueError, match=rf"^{name} must be a callable or None, got {name}=5$"):
            Request([1, 2], SamplingParams(max_tokens=2), **{name: 5})
    engine = Engine(tiny_model(), max_batch=np.int64(4), max_queue=np.int64(8), step_sizes=[np.int64(4)])
    assert (engine.max_batch, engine.max_queue, engine.step_sizes) == (4, 8, [4])
    assert type(engine.max_batch) is int


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.7, 1.0, None), (1.6, 1.0, None), (1.0, 0.6, None),
                                                       (0.8, 0.9, 5)])
def test_the_engine_samples_as_generate_does_with_the_choices_seed(temperature, top_p, top_k):
    """Each choice of a seeded request is lm.generate.generate's sample (itself checked against a
    re-run sampler) with a generator seeded choice_seed(seed, index). testq22: an engine that sampled
    at temperature 1 whatever the client sent passed every serving test."""
    model = tiny_model()
    engine = Engine(model, max_batch=4)
    prompt, seed = [11, 12, 13, 14], 5
    tokens = [[], []]
    params = SamplingParams(max_tokens=20, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    engine.submit(Request(prompt, params, 2, on_token=lambda i, t: tokens[i].append(t)))
    while engine.step():
        pass
    for index in range(2):
        g = torch.Generator().manual_seed(choice_seed(seed, index))
        want = generate(model, prompt, 20, temperature=temperature, top_p=top_p, top_k=top_k, generator=g)
        assert tokens[index] == want, (index, tokens[index], want)


def greedy_eos_at(model, prompt, m):
    """An eos id that greedy decoding of ``prompt`` emits first as its m-th token, or None."""
    toks = generate(model, prompt, m, temperature=0.0)
    return toks[m - 1] if toks[m - 1] not in toks[:m - 1] else None


def test_metrics_counters_count_what_the_clients_got():
    """/metrics' counters, recounted from the requests: prompt tokens prefilled (one per prompt
    token, each request once), tokens generated (the end-of-text token too: sends_eos, "counted"),
    rows decoded (every token but a choice's first, which the prefill emits, is one row of one
    step), time to first token (one observation per request), and the batch-size gauge back at 0."""
    model = tiny_model()
    prompt = [7, 8, 9]
    m = next(m for m in range(2, 12) if greedy_eos_at(model, prompt, m) is not None)
    eos = greedy_eos_at(model, prompt, m)
    engine = Engine(model, max_batch=4, eos_id=eos)
    recs, prompts = [], [prompt, [1, 2], [3, 4, 5, 6], [11], [5, 5, 5, 5, 5]]
    started = time.perf_counter()
    for k, p in enumerate(prompts):
        rec = Recorder(2 if k == 1 else 1)
        engine.submit(rec.request(p, SamplingParams(max_tokens=10, temperature=0.0 if k == 0 else 1.0, seed=k,
                                                    ignore_eos=k > 0), n=2 if k == 1 else 1))
        recs.append(rec)
    run_until_idle(engine)
    took = time.perf_counter() - started
    tokens = [t for rec in recs for t in rec.tokens]
    assert recs[0].tokens[0][-1] == eos and recs[0].reasons == ["stop"]  # ended by the end of text, sent
    s = engine.stats
    assert s.prompt_tokens == sum(map(len, prompts))
    assert s.generated_tokens == sum(map(len, tokens))
    assert s.step_rows == sum(len(t) - 1 for t in tokens)  # each choice's first token came from its prefill
    assert sum(s.steps.values()) >= max(map(len, tokens)) - 1
    assert sum(s.ttft_counts) == len(prompts)  # once per request (TTFT is a request's)
    # each from its arrival (mutation: the first token's time plus the arrival's survived)
    assert 0 < s.ttft_sum <= len(prompts) * took
    assert s.batch_size == 0 and s.queue_depth == 0


def test_the_batch_size_gauge_counts_the_rows_left_when_a_client_hears_its_end():
    """The batch-size gauge is updated as a row leaves, before its client is told: a client that
    reads /metrics on hearing its end sees the rows still decoding, not the free slots."""
    engine = Engine(tiny_model(), max_batch=4)
    seen = []
    for max_tokens in (2, 5, 8):
        engine.submit(Request([5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), 1,
                              on_finish=lambda i, r: seen.append((r, engine.stats.batch_size))))
    run_until_idle(engine)
    assert seen == [("length", 2), ("length", 1), ("length", 0)]


def test_an_engine_leaves_the_global_random_state_alone():
    """Its start-up probe (which step sizes give a row the same bits) draws its random sequences from
    a generator of its own: a user's torch.manual_seed sequence is the same with or without one."""
    model = tiny_model()
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    engine = Engine(model, max_batch=4)
    assert len(engine.steps) > 1  # the probe ran over several step sizes
    assert torch.equal(torch.rand(4), expected)
    assert Engine(model).max_batch == 16  # the default, as lm serve's --max-batch


def test_end_of_text_as_the_last_allowed_token_finishes_with_stop():
    """OpenAI: finish_reason "stop" when the model hit a natural stop point, "length" when
    max_tokens was reached; vLLM checks the end of text before the length. A choice whose
    max_tokens-th token is the end of text ended naturally: "stop"."""
    model = tiny_model()
    prompt = [7, 8, 9]
    m = next(m for m in range(2, 12) if greedy_eos_at(model, prompt, m) is not None)
    eos = greedy_eos_at(model, prompt, m)
    engine = Engine(model, max_batch=4, eos_id=eos)
    for max_tokens, reason in ((m, "stop"), (m + 3, "stop"), (m - 1, "length")):
        rec = Recorder()
        engine.submit(rec.request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
        run_until_idle(engine)
        assert rec.tokens[0] == generate(model, prompt, m, temperature=0.0)[:max_tokens]
        assert rec.reasons == [reason], max_tokens
    assert engine.stats.requests["finished"] == 3


def test_unseeded_requests_draw_fresh_samples():
    """OpenAI/vLLM: without a seed, sampling is not repeatable; two unseeded requests of the same
    prompt at temperature 1 over 30 tokens of a 97-token vocabulary differ (a shared stream would
    give them the same text)."""
    model = tiny_model()
    engine = Engine(model, max_batch=4)
    texts = []
    for _ in range(3):
        rec = Recorder()
        engine.submit(rec.request([3, 4], SamplingParams(max_tokens=30, temperature=1.0)))
        run_until_idle(engine)
        texts.append(tuple(rec.tokens[0]))
    assert len(set(texts)) == 3


def test_a_choice_ended_before_its_prefill_gets_no_token():
    """Request.cancel(index)/stop(index) end a choice "at the next step": a choice ended before the
    request was admitted gets no token at all (its prefill must not sample one for it), the other
    choice runs to max_tokens."""
    model = tiny_model()
    engine = Engine(model, max_batch=4)
    for end, reason in (("cancel", "cancelled"), ("stop", "stop")):
        rec = Recorder(2)
        r = rec.request([3, 4], SamplingParams(max_tokens=5, seed=1), n=2)
        getattr(r, end)(1)
        engine.submit(r)
        run_until_idle(engine)
        assert rec.reasons == ["length", reason] and rec.tokens[1] == [] and len(rec.tokens[0]) == 5, end


def test_a_request_cancelled_in_the_queue_of_an_idle_engine_is_told():
    """busy is documented to include requests "cancelled and not yet told": a request submitted and
    cancelled before the engine's thread ran is still told "cancelled" (and counted) by the thread."""
    engine = Engine(tiny_model(), max_batch=2)
    told = threading.Event()
    reasons = []
    r = Request([1, 2], SamplingParams(max_tokens=3), on_finish=lambda i, why: (reasons.append(why), told.set()))
    engine.submit(r)
    r.cancel()
    assert engine.busy
    engine.start()
    try:
        assert told.wait(20), "the cancelled request was never told"
    finally:
        engine.stop()
    assert reasons == ["cancelled"] and engine.stats.requests["cancelled"] == 1


def _failed_engine(*prompts: list[int]):
    """An engine whose every step raises, run on its thread until it fails with ``prompts`` in (the
    first running, the others waiting): (the engine, each prompt's Recorder, what on_error was told)."""
    engine = Engine(tiny_model(), max_batch=1)

    def broken(ids, lengths):
        raise RuntimeError("the device fell over")

    engine.steps = {b: broken for b in engine.steps}
    recs = [Recorder() for _ in prompts]
    done, told = threading.Event(), []
    engine.on_error = lambda e: told.append(e) or done.set()
    for rec, prompt in zip(recs, prompts):
        engine.submit(rec.request(prompt, SamplingParams(max_tokens=4)))
    engine.start()
    assert done.wait(20)
    engine.stop()
    return engine, recs, told


def test_a_failing_step_fails_every_request_in_and_takes_no_new_one():
    """Engine.on_error's contract: when a step fails, every request in has been failed ("error", a
    500) by then, the running ones and those waiting in the queue alike, counted failed; and no new
    one is taken (EngineStopped), where it would wait for ever for a thread that is gone."""
    from lm.serve import EngineStopped

    engine, recs, told = _failed_engine([1, 2], [3])
    assert recs[0].reasons == ["error"] and recs[1].reasons[0] == "error"
    assert engine.stats.requests["failed"] == 2 and isinstance(engine.error, RuntimeError)
    assert told == [engine.error]  # on_error is told which (mutation: None survived)
    with pytest.raises(EngineStopped):
        engine.submit(Recorder().request([1], SamplingParams(max_tokens=2)))
    assert "the device fell over" in "".join(traceback.format_exception(engine.error))


def test_a_failed_engine_is_freed_without_the_collector():
    """The error a failed engine keeps does not keep it (its traceback's frames had held the engine:
    a cycle), and still prints where it came from. (Apart from the test above, which mutation runs:
    mutmut's trampolines hold frames, so this one is left out there.)"""
    engine, (rec,), _ = _failed_engine([1, 2])
    assert rec.reasons == ["error"]
    assert "the device fell over" in "".join(traceback.format_exception(engine.error))
    alive, cache = weakref.ref(engine), weakref.ref(engine.cache.k[0])
    gc.collect()
    with collector_off():
        del engine
        assert alive() is None and cache() is None


def test_a_stopped_engine_refuses_requests_and_a_second_start():
    """Engine.stop is final: a request submitted after it had been queued and never answered (no
    thread ran it, its client waited for ever), and start() had started a thread that left at once.
    Both raise EngineStopped now, naming why."""
    from lm.serve import EngineStopped

    engine = Engine(tiny_model(), max_batch=1)
    engine.start()
    engine.stop()
    rec = Recorder()
    with pytest.raises(EngineStopped, match="the engine is stopped"):
        engine.submit(rec.request([1, 2], SamplingParams(max_tokens=2)))
    with pytest.raises(EngineStopped) as stopped:
        engine.start()
    assert str(stopped.value) == "the engine is stopped: make a new Engine to serve again"
    assert rec.reasons == [None] and not engine.waiting and engine._thread is None


def test_stop_cancels_the_running_and_the_waiting_and_empties_the_queue_gauge():
    """stop() ends every choice still in, running or waiting, as cancelled, and /metrics' queue depth
    goes back to 0 (mutation: the gauge left as None survived; no test stopped an engine with a queue)."""
    engine = Engine(tiny_model(), max_batch=1, max_queue=4)
    recs = [Recorder() for _ in range(3)]
    for rec in recs:
        engine.submit(rec.request([1, 2], SamplingParams(max_tokens=20)))
    engine.step()
    assert engine.stats.queue_depth == 2 and len(recs[0].tokens[0]) >= 1
    engine.stop()
    assert [rec.reasons for rec in recs] == [["cancelled"]] * 3
    assert engine.stats.queue_depth == 0 and engine.stats.requests["cancelled"] == 3 and not engine.waiting


@pytest.mark.parametrize("name, bad", [("max_batch", 0), ("max_batch", 2.0), ("max_queue", 0), ("max_queue", True)])
def test_an_engine_refuses_a_batch_or_queue_size_that_is_not_a_count(name, bad):
    """(mutation: the check made of the constant 1, which always passes, survived: only `lm serve`'s own
    check of --max-batch had been tested)"""
    with pytest.raises(ValueError) as e:
        Engine(tiny_model(), **{name: bad})
    assert str(e.value) == f"{name} must be a whole number >= 1, got {bad!r}"


def test_an_engine_as_a_context_manager_runs_for_the_block_and_is_freed_after():
    """``with Engine(model) as engine:`` starts the thread and stops it at the end of the block: the
    request is answered (the tokens greedy generate gives), the thread is gone, and the engine, its
    model and cache are freed when dropped, with the collector off. An engine started and never
    stopped had lived as long as its thread (cyc25 L2); the block is how not to forget stop()."""
    model = tiny_model()
    rec, done = Recorder(), threading.Event()
    with Engine(model, max_batch=2) as engine:
        request = rec.request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0))
        request.on_finish = lambda i, r: (rec.reasons.__setitem__(i, r), done.set())
        engine.submit(request)
        assert done.wait(30)
        thread = engine._thread
        assert thread.is_alive()
    assert not thread.is_alive() and engine._thread is None
    assert rec.tokens[0] == generate(model, [1, 2, 3], 5, temperature=0.0) and rec.reasons == ["length"]
    refs = [weakref.ref(engine), weakref.ref(engine.cache.k[0])]
    with collector_off():
        del engine, request
        assert [r() is None for r in refs] == [True, True]


def test_stop_tells_a_request_cancelled_in_the_queue():
    """Engine.stop: "requests still in are finished with cancelled", one cancelled while it waited
    (not yet told by the thread) too."""
    engine = Engine(tiny_model(), max_batch=1)
    rec = Recorder()
    engine.submit(rec.request([1, 2], SamplingParams(max_tokens=3)))
    engine.submit(Recorder().request([3], SamplingParams(max_tokens=3)))
    gone = Recorder()
    engine.submit(g := gone.request([4], SamplingParams(max_tokens=3)))
    g.cancel()
    engine.stop()
    assert rec.reasons == ["cancelled"] and gone.reasons == ["cancelled"]
    assert engine.stats.requests["cancelled"] == 3 and not engine.busy

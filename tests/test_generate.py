"""Generation: KV cache vs full re-runs, batching, sliding window, sampling filters, errors."""

from __future__ import annotations

import copy
import gc
import itertools
import math
import re
import weakref

import pytest
import torch
from helpers.collector import collector_off
from hypothesis import given, settings
from hypothesis import strategies as st

from lm.generate import KVCache, generate, sample_next_token, top_k_filter, top_p_filter
from lm.generate.sampling import NonFiniteLogitsError, generator_seed, next_token_and_finite
from lm.model import TransformerLM

SMALL = dict(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def greedy_by_rerun(model, prompt, n):
    """Greedy decoding the slow way: re-run the last ``context_length`` tokens every step."""
    ids = list(prompt)
    ctx = model.config.context_length
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids[-ctx:]]))[0, -1].argmax()))
    return ids[len(prompt) :]


def sampled_by_rerun(model, prompt, n, generator, vocab_size=None, **sampling):
    """Sampling the slow way: re-run the last ``context_length`` tokens every step and draw with
    sample_next_token (checked against the filtered softmax below), over the ids below ``vocab_size``."""
    ids = list(prompt)
    ctx = model.config.context_length
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids[-ctx:]]))[0, -1][:vocab_size]
            ids.append(int(sample_next_token(logits[None], generator=generator, **sampling)[0]))
    return ids[len(prompt) :]


@pytest.mark.parametrize("sampling", [dict(temperature=0.5), dict(temperature=2.0), dict(top_p=0.6),
                                      dict(top_k=3), dict(temperature=0.8, top_p=0.9, top_k=5)])
def test_sampled_generate_is_the_rerun_sampler(sampling):
    """testq22: generate ignoring temperature, top_p and top_k (sampling at 1 from the whole
    vocabulary) passed every generation test: sampling was only compared with itself. Past the
    context (12 new tokens after 5, context 16) too."""
    torch.manual_seed(0)
    model = TransformerLM(**SMALL).eval()
    with torch.no_grad():  # sharper than the init, so that the filters and the temperature matter
        model.token_embeddings.weight.mul_(4.0)
    for seed in range(3):
        got = generate(model, [3, 1, 4, 1, 5], 12, generator=torch.Generator().manual_seed(seed), **sampling)
        want = sampled_by_rerun(model, [3, 1, 4, 1, 5], 12, torch.Generator().manual_seed(seed), **sampling)
        assert got == want, (seed, got, want)


@pytest.mark.parametrize(
    "variant",
    [
        {"attn_impl": "einsum"},
        {"positions": "learned"},
        {"positions": "sinusoidal", "norm_placement": "post", "attn_impl": "einsum"},
        {"attn_impl": "sdpa"},
    ],
)
def test_cached_logits_equal_full_forward(variant):
    model = TransformerLM(**SMALL, **variant)
    ids = torch.randint(0, 50, (3, 12))
    full = model(ids)
    cache = KVCache.for_model(model, 3)
    steps = [model(ids[:, :5], kv_cache=cache)]
    for t in range(5, 12):
        steps.append(model(ids[:, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 12


@pytest.mark.parametrize(
    "variant", [{"attn_impl": "einsum"}, {"positions": "learned", "attn_impl": "einsum"}, {"attn_impl": "sdpa"}]
)
def test_greedy_with_cache_equals_rerunning_prefix(variant):
    model = TransformerLM(**SMALL, **variant)
    prompt = [3, 1, 4, 1, 5]
    # 30 new tokens: the window slides past context_length=16 as well.
    assert generate(model, prompt, 30, temperature=0) == greedy_by_rerun(model, prompt, 30)


def test_prompt_longer_than_context_is_cropped():
    model = TransformerLM(**SMALL)
    prompt = torch.randint(0, 50, (40,)).tolist()
    assert generate(model, prompt, 5, temperature=0) == greedy_by_rerun(model, prompt, 5)


def window_reference(model, prompt, n, shift):
    """Greedy decoding over the window that lm.generate's docstring promises, re-running the model
    on the whole window for every token: the window starts as the last ``context_length`` prompt
    tokens and grows by one token per step; a token that arrives when it already holds
    ``context_length`` tokens makes it the last ``context_length - shift + 1`` tokens instead.
    Returns the tokens, the logits each was chosen from, and the window sizes."""
    ctx = model.config.context_length
    ids = list(prompt)
    begin = max(0, len(ids) - ctx)
    tokens, logits, sizes = [], [], []
    with torch.no_grad():
        for _ in range(n):
            sizes.append(len(ids) - begin)
            out = model(torch.tensor([ids[begin:]]))[0, -1]
            logits.append(out)
            ids.append(int(out.argmax()))
            tokens.append(ids[-1])
            if len(ids) - 1 - begin == ctx:
                begin = len(ids) - (ctx - shift + 1)
    return tokens, torch.stack(logits), sizes


@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
@pytest.mark.parametrize("shift", [1, 5, 8, 15, 16])  # 16: the whole context, the rebuild keeps one token
def test_window_shift_equals_rerunning_the_documented_window(attn_impl, shift):
    model = TransformerLM(**SMALL, attn_impl=attn_impl)
    logits, prefills = [], []

    def record(module, args, output):
        logits.append(output[:, -1].clone())
        prefills.append(args[0].shape[1] > 1)  # a prefill (the first, or a rebuild) feeds several tokens

    hook = model.register_forward_hook(record)
    try:
        out = generate(model, [1, 2, 3], 40, temperature=0, window_shift=shift)
    finally:
        hook.remove()
    tokens, ref_logits, sizes = window_reference(model, [1, 2, 3], 40, shift)
    rebuilds = sum(n == 16 for n in sizes[:-1])  # a token that arrives when the window is full rebuilds it
    assert rebuilds >= 2 and all(16 - shift <= n <= 16 for n in sizes[14:])  # past several rebuilds
    assert out == tokens
    # measured at most 1.4e-6 (KV cache vs a full forward) over 6 seeds, both kernels, these shifts
    torch.testing.assert_close(torch.cat(logits), ref_logits, atol=7e-6, rtol=0)
    # a larger shift rebuilds less often (with 16 a rebuild feeds one token, as a step does)
    assert sum(prefills) == 1 + (rebuilds if shift < 16 else 0)


def batch_window_reference(model, prompts, n, shift):
    """Greedy decoding of a batch over the windows that lm.generate's docstring describes, re-running
    the model on each row's window: as :func:`window_reference`, except that every row's window is
    rebuilt (to its last ``context_length - shift + 1`` tokens) when the longest one is full."""
    ctx = model.config.context_length
    ids = [list(p) for p in prompts]
    begin = [max(0, len(row) - ctx) for row in ids]
    with torch.no_grad():
        for _ in range(n):
            for row, b in zip(ids, begin):
                row.append(int(model(torch.tensor([row[b:]]))[0, -1].argmax()))
            if max(len(row) - 1 - b for row, b in zip(ids, begin)) == ctx:
                begin = [max(0, len(row) - (ctx - shift + 1)) for row in ids]
    return [row[len(p):] for row, p in zip(ids, prompts)]


def test_a_batch_slides_its_window_when_its_longest_row_fills_the_cache():
    """The README had said that a row of a batch generates what it would alone, with any window_shift.
    The whole batch slides when its longest row fills the cache: with window_shift=1 no row can tell,
    with a larger shift the shorter rows slide at other tokens than alone (the docs now say so)."""
    model = TransformerLM(**SMALL).eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 3], list(range(20, 40))]
    for shift in (1, 3):
        batched = generate(model, prompts, 30, temperature=0, window_shift=shift)
        assert batched == batch_window_reference(model, prompts, 30, shift)
        alone = [generate(model, p, 30, temperature=0, window_shift=shift) for p in prompts]
        assert [b == a for b, a in zip(batched, alone)] == ([True] * 3 if shift == 1 else [False, False, True])


def test_batch_of_different_lengths_equals_one_by_one():
    model = TransformerLM(**SMALL, positions="learned")
    prompts = [[1, 2, 3], [7], [9, 8, 7, 6, 5, 4, 3], list(range(20))]
    batched = generate(model, prompts, 25, temperature=0)
    assert batched == [generate(model, p, 25, temperature=0) for p in prompts]
    assert batched[1] == greedy_by_rerun(model, [7], 25)


def test_tensor_prompts():
    model = TransformerLM(**SMALL)
    one = generate(model, torch.tensor([1, 2, 3]), 4, temperature=0)
    assert one == generate(model, [1, 2, 3], 4, temperature=0)
    two = generate(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), 4, temperature=0)
    assert two[0] == one and len(two) == 2


@pytest.mark.parametrize("prompt", [torch.tensor([1.7, 2.9]), [1.7, 2], [[1, 2], [3, 4.0]], [True, 2],
                                    torch.tensor([True, False]), [torch.tensor(1.0)], "12"])
def test_prompt_ids_that_are_not_integers_are_refused(prompt):
    """A float tensor or list had been truncated to ids (1.7 and 2.9 generated as 1 and 2), as
    transformers' generate refuses float input_ids. Bools and strings are refused too."""
    model = TransformerLM(**SMALL)
    with pytest.raises(ValueError, match=r"^prompt_ids: token ids must be integers, got "):
        generate(model, prompt, 3, temperature=0)


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt_ids: prompt 0 is empty; generation needs at least one token"),  # one prompt, of no ids
    (torch.zeros(0, 3, dtype=torch.long), "prompt_ids: got an empty batch of prompts"),
    ([[1, 2], []], "prompt_ids: prompt 1 is empty; generation needs at least one token"),
    ([[1, 2], [3, 50]], "prompt_ids: id 50 is outside [0, vocab_size=50)"),
    ([-1], "prompt_ids: id -1 is outside [0, vocab_size=50)"),
])
def test_an_empty_batch_an_empty_prompt_or_an_id_out_of_range_is_one_line_naming_it(prompt, message):
    model = TransformerLM(**SMALL)
    with pytest.raises(ValueError) as e:
        generate(model, prompt, 3, temperature=0)
    assert str(e.value) == message


def test_no_new_tokens_is_an_empty_list_for_each_prompt():
    model = TransformerLM(**SMALL)
    assert generate(model, [1, 2], 0) == []
    assert generate(model, [[1, 2], [3]], 0) == [[], []]
    assert generate(model, torch.tensor([[1, 2]]), 0, compile=True) == [[]]  # nothing compiled: no step runs


def test_integer_prompt_ids_of_any_type_are_taken():
    import numpy as np

    model = TransformerLM(**SMALL)
    want = generate(model, [1, 2], 3, temperature=0)
    for prompt in ([np.int64(1), torch.tensor(2)], torch.tensor([1, 2], dtype=torch.int32), np.array([1, 2])):
        assert generate(model, prompt, 3, temperature=0) == want
    assert generate(model, [torch.tensor([1, 2]), [1, 2]], 3, temperature=0) == [want, want]


@pytest.mark.parametrize("shift", [2.5, 2.0, True])
def test_window_shift_must_be_an_integer_before_any_token(shift):
    """A float passed the range check, streamed tokens, then failed with an unnamed TypeError
    ("slice indices must be integers") when the window first slid."""
    model = TransformerLM(**SMALL)
    streamed = []
    with pytest.raises(ValueError, match=r"window_shift must be an integer in \[1, context_length=16\], got "):
        generate(model, [1, 2], 30, window_shift=shift, on_token=lambda row, t: streamed.append(t))
    assert streamed == []


@pytest.mark.parametrize("compile", [False, True])
def test_a_model_of_context_length_1_generates_as_a_loop_without_a_cache(compile):
    """window_shift had to be in [1, context_length), empty for context_length 1: such a model (which
    ModelConfig and lm train accept) could not be sampled at all, not even with the default shift.
    window_shift may now be context_length: the rebuild keeps the last token, and every token is
    predicted from the one before it, as a plain loop over ``ids[-1:]`` predicts it."""
    model = TransformerLM(vocab_size=50, context_length=1, d_model=32, num_layers=1, num_heads=4, d_ff=48).eval()
    prompts = [[1, 2, 3], [9], list(range(10, 30))]
    assert generate(model, prompts, 12, temperature=0, compile=compile) == [
        greedy_by_rerun(model, p, 12) for p in prompts]
    assert generate(model, [4, 5], 12, temperature=0, window_shift=1) == greedy_by_rerun(model, [4, 5], 12)
    with pytest.raises(ValueError, match=r"in \[1, context_length=1\], got window_shift=2"):
        generate(model, [4], 3, window_shift=2)


def test_positions_run_per_token_are_one_until_the_context_is_full_then_the_window():
    """What the docstrings say a token costs: after the prompt's prefill, one position per token until
    the context is full; past it, with window_shift 1, a forward over the last context_length tokens for
    every token, and with a larger shift one forward over context_length - shift + 1 tokens per shift
    tokens (the rest one position each). Counted here from the model's inputs."""
    model = TransformerLM(**SMALL).eval()
    for shift in (1, 4, 16):
        seen = []
        hook = model.register_forward_pre_hook(lambda module, args, seen=seen: seen.append(args[0].shape[-1]))
        try:
            generate(model, [1, 2, 3], 40, temperature=0, window_shift=shift)
        finally:
            hook.remove()
        # a reference: the window as the module's docstring describes it, grown one token at a time
        want, held = [3], 3
        for _ in range(39):  # the 40th token is sampled from the last forward
            if held == 16:
                held = 16 - shift + 1
                want.append(held)
            else:
                held += 1
                want.append(1)
        assert seen == want, shift
        assert seen[1:14] == [1] * 13 and (shift > 1 or seen[14:] == [16] * 26)


def test_a_batched_row_computes_the_logits_it_would_alone_and_greedy_its_tokens_but_not_its_samples():
    """The docs had said that a row of a batch generates what it would alone. Its logits are those it
    would get alone, so greedy decoding gives it the same tokens; sampled, every row draws from the one
    generator, so a row's tokens depend on the others (lm serve gives each row a generator)."""
    model = TransformerLM(**SMALL).eval()
    logits = []
    hook = model.register_forward_hook(lambda module, args, output: logits.append(output[:, -1].clone()))
    try:
        alone = generate(model, [1, 2, 3], 30, temperature=0)
        alone_logits, logits[:] = torch.stack(logits)[:, 0], []
        batched = generate(model, [[1, 2, 3], [7]], 30, temperature=0)
        batched_logits = torch.stack(logits)[:, 0]
    finally:
        hook.remove()
    assert batched[0] == alone == greedy_by_rerun(model, [1, 2, 3], 30)
    torch.testing.assert_close(batched_logits, alone_logits, atol=7e-6, rtol=0)
    sampled_alone = generate(model, [1, 2, 3], 10, generator=torch.Generator().manual_seed(0))
    sampled_batched = generate(model, [[1, 2, 3], [7]], 10, generator=torch.Generator().manual_seed(0))
    assert sampled_batched[0] != sampled_alone  # the second row's draws come from the same generator


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": None}, "temperature must be a finite number >= 0, got temperature=None"),
        ({"temperature": "1"}, "temperature must be a finite number >= 0, got temperature='1'"),
        ({"temperature": True}, "temperature must be a finite number >= 0, got temperature=True"),
        ({"top_p": None}, r"top_p must be in \(0, 1\], got top_p=None"),
        ({"top_p": True}, r"top_p must be in \(0, 1\], got top_p=True"),
        ({"top_k": 2.0}, "top_k must be a positive integer or None, got top_k=2.0"),
        ({"generator": 0}, "generator must be a torch.Generator or None, got generator=0"),
        ({"max_new_tokens": 3.0}, "max_new_tokens must be a non-negative integer, got max_new_tokens=3.0"),
    ],
)
def test_arguments_of_the_wrong_type_are_one_value_error_naming_them(kwargs, match):
    """None or a string for temperature or top_p had raised a TypeError from a comparison, and an int
    generator an AttributeError ('int' object has no attribute 'device'), naming no argument; True
    was taken as temperature 1."""
    model = TransformerLM(**SMALL)
    args = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, [1, 2], args.pop("max_new_tokens"), **args)
    if "max_new_tokens" not in kwargs:
        with pytest.raises(ValueError, match=match):
            sample_next_token(torch.randn(2, 5), **kwargs)
        with pytest.raises(ValueError, match=match):
            next_token_and_finite(torch.randn(2, 5), **kwargs)


def test_numpy_integers_and_a_2d_numpy_batch_are_taken_as_python_ints_and_lists():
    """numpy integers were taken as prompt ids but refused as top_k, max_new_tokens and window_shift
    ("must be a positive integer"); a 2-D numpy array was refused ("token ids must be integers, got
    array([1, 2])") where a 2-D tensor is a batch. Each now gives what the plain Python value gives."""
    import numpy as np

    model = TransformerLM(**SMALL).eval()

    def run(prompt, n, **kw):
        return generate(model, prompt, n, generator=torch.Generator().manual_seed(3), **kw)

    want = run([1, 2], 20, top_k=5, temperature=0.8, top_p=0.9, window_shift=3)
    assert want == run([1, 2], np.int64(20), top_k=np.int64(5), temperature=np.float32(0.8), top_p=np.float64(0.9),
                       window_shift=np.int32(3))
    batch = [[1, 2, 3], [4, 5, 6]]
    want = run(batch, 5)
    assert run(np.array(batch), 5) == run(torch.tensor(batch), 5) == want
    assert run(list(np.array(batch)), 5) == want  # a list of 1-D arrays: a batch, as a list of tensors is
    assert run(np.array([1, 2, 3]), 5) == run([1, 2, 3], 5)
    with pytest.raises(ValueError, match=r"prompt_ids must be 1-D or 2-D, got shape \(1, 2, 3\)"):
        generate(model, np.array([batch]), 3)
    with pytest.raises(ValueError, match="token ids must be integers"):
        generate(model, np.array([[1.0, 2.0]]), 3)
    # a batch as a list whose prompts are not each 1-D (mutation: the message replaced survived)
    for prompts, message in (([torch.tensor([[1, 2]]), torch.tensor([3])],
                              "prompt_ids: a prompt must be 1-D, got a tensor of shape (1, 2)"),
                             ([np.array([3]), np.array([[1, 2]])],
                              "prompt_ids: a prompt must be 1-D, got an array of shape (1, 2)")):
        with pytest.raises(ValueError) as e:
            generate(model, prompts, 3)
        assert str(e.value) == message
    probs = torch.softmax(torch.randn(3, 50), -1)
    assert torch.equal(sample_next_token(probs.log(), top_k=np.int64(4), generator=torch.Generator().manual_seed(0)),
                       sample_next_token(probs.log(), top_k=4, generator=torch.Generator().manual_seed(0)))


def test_a_seed_is_folded_into_the_32_bits_torchs_generator_keeps():
    """torch's CPU generator keeps the low 32 bits of a seed, so seeds 2**32 apart drew the same
    tokens (lm sample --seed 5 and --seed 4294967301 printed the same text). generator_seed keeps
    every seed below 2**32 (and its samples) and gives seeds that differ in their high bits their own."""
    def draws(seed):
        return torch.randint(0, 2**31, (8,), generator=torch.Generator().manual_seed(seed)).tolist()

    assert draws(5) == draws(2**32 + 5) == draws(2**63 + 5)  # torch's own behaviour: why folding is needed
    for s in (0, 1, 5, 12345, 2**31, 2**32 - 1):
        assert generator_seed(s) == s
    high = [5, 2**32 + 5, 2**33 + 5, 2**62 + 5, 2**63 + 5, 2**64 - 1, 2**32, 2**32 + 1]
    folded = [generator_seed(s) for s in high]
    assert all(0 <= f < 2**32 for f in folded) and generator_seed(2**40 + 7) == generator_seed(2**40 + 7)
    # pinned, so that a seed keeps its stream from one release to the next: the low 4 bytes of
    # blake2b(the seed as 8 little-endian bytes, person "lm-seed"), read little-endian
    assert (generator_seed(2**32), generator_seed(2**40 + 7), generator_seed(2**64 - 1)) == (
        719957679, 518184794, 2128872632)
    assert len({tuple(draws(f)) for f in folded}) == len(high)
    for bad in (-1, 2**64, True, 1.0, "5", None):
        with pytest.raises(ValueError, match=r"seed must be a whole number in \[0, 2\*\*64-1\]"):
            generator_seed(bad)


def nan_logits_from(model, call: int, row: int = 0):
    """Make the model's logits NaN (one token's, for one batch row) from its ``call``-th forward on."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) >= call:
            output[row, :, 7] = float("nan")
        return output

    return model.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [False, True])
def test_logits_that_are_not_finite_raise_before_their_token(temperature, batch):
    """A model whose logits overflow: sampled, multinomial had raised torch's "probability tensor
    contains either inf, nan or element < 0" (a traceback from `lm sample`); greedy, argmax had
    picked a token, and the text meant nothing. Both raise, naming the token, before it is passed on."""
    model = TransformerLM(**SMALL).eval()
    hook = nan_logits_from(model, 3, row=1 if batch else 0)  # the prefill, one step, then NaN
    streamed = []
    prompts = [[1, 2], [3, 4, 5]] if batch else [1, 2]
    message = "the model's logits are not finite (NaN or inf) at new token 3" + (" of prompt 1" if batch else "")
    with pytest.raises(NonFiniteLogitsError, match=r"^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        generate(model, prompts, 10, temperature=temperature, generator=torch.Generator().manual_seed(0),
                 on_token=lambda row, t: streamed.append(row))
    hook.remove()
    assert streamed == ([0, 1] * 2 if batch else [0, 0])
    assert issubclass(NonFiniteLogitsError, ValueError)  # the command line prints it as one line


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_finiteness_check_reads_nothing_but_the_tokens(temperature):
    """The flags come back with the tokens, in one read a step (on a GPU a read is a sync)."""
    from helpers.host_reads import HostReads

    model = TransformerLM(**SMALL).eval()
    with HostReads() as reads:
        generate(model, [[1, 2, 3], [4]], 20, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert reads.reads == ["tolist"] * 20


def test_next_token_and_finite_flags_the_rows_it_cannot_choose_from():
    """NaN, +inf, or every token at -inf: no token to choose (sampled, the row is drawn from a uniform
    distribution instead, so that multinomial takes the batch). A -inf for some tokens (top-k, a
    decoder that never emits padding) is fine. sample_next_token itself is unchanged."""
    inf = float("inf")
    good = torch.tensor([0.5, -inf, 1.0, -inf])
    for temperature in (0.0, 1.0):
        for bad in ([0.5, float("nan"), 1.0, 0.0], [0.5, inf, 1.0, 0.0], [-inf] * 4):
            logits = torch.stack([good, torch.tensor(bad), good])
            tokens, finite = next_token_and_finite(logits, temperature=temperature, top_k=1,
                                                   generator=torch.Generator().manual_seed(0))
            assert finite.tolist() == [True, False, True] and tokens[[0, 2]].tolist() == [2, 2]
    g, h = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    logits = torch.randn(3, 20)
    assert torch.equal(next_token_and_finite(logits, top_p=0.9, generator=g)[0],
                       sample_next_token(logits, top_p=0.9, generator=h))  # the same draws
    _, finite = next_token_and_finite(torch.tensor([3e38, 0.0]), temperature=1e-3)  # the temperature overflows
    assert not finite


def test_vocab_size_samples_only_ids_below_it():
    """A tokenizer smaller than the model's (padded) vocabulary: only its ids are drawn; greedy is the
    argmax over them, as a full re-run computes it."""
    model = TransformerLM(**SMALL).eval()
    drawn = generate(model, [1, 2], 300, temperature=2.0, generator=torch.Generator().manual_seed(0),
                     window_shift=4, vocab_size=20)
    assert max(drawn) < 20 and len(set(drawn)) > 10
    ids = [1, 2]
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1, :20].argmax()))
    assert generate(model, [1, 2], 12, temperature=0.0, vocab_size=20) == ids[2:]
    for bad in (0, 51, True, 2.0):
        with pytest.raises(ValueError, match="vocab_size"):
            generate(model, [1], 1, vocab_size=bad)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_static_step_gives_every_row_the_logits_of_a_plain_forward(rows):
    """DecodeStep, eager: rows at different lengths (and idle rows) in one fixed shape."""
    from lm.generate import DecodeStep

    model = TransformerLM(**SMALL).eval()
    step = DecodeStep(model, 4)
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13]][:rows]
    for b, s in enumerate(seqs):  # prefill all but the last token of each
        one = KVCache.for_model(model, 1, max_len=len(s) - 1) if len(s) > 1 else None
        if one is not None:
            model(torch.tensor([s[:-1]]), kv_cache=one)
            step.cache.fill_from(b, one)
    lengths = [len(s) - 1 for s in seqs] + [0] * (4 - rows)  # idle rows: length 0, token 0
    logits = step([s[-1] for s in seqs] + [0] * (4 - rows), lengths)
    with torch.no_grad():
        for b, s in enumerate(seqs):
            torch.testing.assert_close(logits[b], model(torch.tensor([s]))[0, -1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lengths"):
        step([0] * 4, [0, 0, 0, 16])
    with pytest.raises(ValueError, match="share: needs a compiled DecodeStep of the same model"):
        DecodeStep(model, 2, compile=True, share=step)  # step is not compiled
    compiled = DecodeStep(model, 2, compile=True)  # torch.compile is lazy: nothing is compiled here
    assert DecodeStep(model, 4, compile=True, share=compiled)._fn is compiled._fn
    for other, kw in ((model, {"compile": False}), (model, {"compile": True, "dtype": torch.bfloat16}),
                      (TransformerLM(**SMALL).eval(), {"compile": True})):
        with pytest.raises(ValueError, match=r"^share: needs a compiled DecodeStep of the same model and dtype, and "
                                             r"compile=True$"):
            DecodeStep(other, 4, share=compiled, **kw)


def test_an_eager_step_on_two_threads_gives_one_sequence_the_same_bits_in_every_slot():
    """On a CPU the step runs within batch_invariant: torch's fused attention kernel, which it
    would take otherwise, gives the rows its second thread computes other last bits (measured: 8
    of 16 rows, 1 of 2). conftest restores the thread count."""
    from lm.generate import DecodeStep

    torch.set_num_threads(2)
    model = TransformerLM(**{**SMALL, "d_model": 64, "d_ff": 128}).eval()
    one = KVCache.for_model(model, 1, max_len=9)
    with torch.inference_mode():
        model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5]]), kv_cache=one)
    for rows in (2, 16):
        step = DecodeStep(model, rows)
        assert step.batch_invariant
        for b in range(rows):
            step.cache.fill_from(b, one)
        out = step([7] * rows, [9] * rows)
        assert all(torch.equal(row, out[0]) for row in out), rows


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_compiled_step_attends_over_the_span_in_use_with_the_bits_of_the_whole_cache(compile):
    """Compiled, a step over rows of at most n positions reads the power-of-two span that holds
    them, and its logits equal, bit for bit, those of the same step over the whole cache. Eager
    steps read the whole cache (BLAS sums a row's keys in an order that depends on their number)."""
    from lm.generate import DecodeStep
    from lm.generate.static import span_for

    model = TransformerLM(**{**SMALL, "context_length": 64}).eval()
    step = DecodeStep(model, 3, compile=compile)
    assert step.bucketed == compile
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, SMALL["vocab_size"], (3, 63), generator=g).tolist()
    offsets = [0, 5, 20]  # rows at different lengths (prefilled): the span is the longest's
    for b, n in enumerate(offsets[1:], 1):
        one = KVCache.for_model(model, 1, max_len=n)
        with torch.no_grad():
            model(torch.tensor([seqs[b][:n]]), kv_cache=one)
        step.cache.fill_from(b, one)
    spans = set()
    for t in range(43):
        lengths = [t + o for o in offsets]
        ids = [s[n] for s, n in zip(seqs, lengths)]
        whole = step(ids, lengths, full_span=True).clone()
        assert step.cache.span == 64
        got = step(ids, lengths)
        assert step.cache.span == (span_for(max(lengths) + 1, 64) if compile else 64)
        assert torch.equal(got, whole), t
        spans.add(step.cache.span)
    assert spans == ({32, 64} if compile else {64})
    assert span_for(1, 64) == 16 and span_for(17, 64) == 32 and span_for(65, 64) == 64
    with torch.no_grad():  # and they are the model's logits
        for b, (s, n) in enumerate(zip(seqs, lengths)):
            torch.testing.assert_close(got[b], model(torch.tensor([s[: n + 1]]))[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, {"positions": "learned", "attn_impl": "sdpa"}])
def test_compiled_generation_gives_the_eager_tokens(variant):
    """generate(compile=True): prompts of different lengths, past the context (the window slides)."""
    model = TransformerLM(**{**SMALL, **variant}).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    for shift in (1, 4):
        assert generate(model, prompts, 30, temperature=0, window_shift=shift, compile=True) == \
            generate(model, prompts, 30, temperature=0, window_shift=shift)
    draw = lambda **kw: generate(model, [5, 6], 20, temperature=1.0, top_p=0.9,  # noqa: E731
                                 generator=torch.Generator().manual_seed(3), **kw)
    assert draw(compile=True) == draw()
    if not variant:  # the compiled steps live on the model: not copied with it, and gone with it
        copied = copy.deepcopy(model)
        assert copied.__dict__["_decode_steps"] == {} and model.__dict__["_decode_steps"]
        alive = weakref.ref(model)
        with collector_off():  # freed at once: the steps hold it weakly (a weak-keyed table had kept it forever)
            del model
            assert alive() is None


def test_compiled_calls_at_once_each_get_their_own_cache():
    """generate20: the compiled step kept with the model held one call's cache, and a call made while
    another used it (from on_token, or another thread) cleared and refilled its rows under the other:
    11 of 15 greedy calls in each of two threads returned other tokens than the model's. A call
    that finds the kept step in use gets a cache of its own, with the same compiled code."""
    import threading

    model = TransformerLM(**SMALL).eval()
    p1, p2 = [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]
    want1, want2 = generate(model, p1, 12, temperature=0), generate(model, p2, 12, temperature=0)
    assert generate(model, p1, 12, temperature=0, compile=True) == want1
    inner = []

    def nested(row, token):
        if not inner:
            inner.append(generate(model, p2, 12, temperature=0, compile=True))

    assert generate(model, p1, 12, temperature=0, compile=True, on_token=nested) == want1 and inner == [want2]
    got = {}

    def work(name, prompt):
        got[name] = [generate(model, prompt, 12, temperature=0, compile=True) for _ in range(6)]

    threads = [threading.Thread(target=work, args=(name, p)) for name, p in (("a", p1), ("b", p2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"a": [want1] * 6, "b": [want2] * 6}
    from lm.nn import functional

    assert functional._batch_invariant == (False, False)  # the threads' steps left the switch off (CI found it on)
    kept, = model.__dict__["_decode_steps"].values()
    assert kept.in_use is False  # given back after every call, an error's too
    def fails(row, token):
        raise ValueError("the callback failed")

    with pytest.raises(ValueError, match="the callback failed"):
        generate(model, p1, 12, temperature=0, compile=True, on_token=fails)
    assert kept.in_use is False


@pytest.mark.parametrize("as_tensor", [False, True])
def test_one_padding_slot_is_masked_given_as_a_list_or_a_tensor(as_tensor):
    """A cache whose only padding is one slot is a padded cache (a mutant that took a tensor's pad
    lengths for padding only past 1 went unnoticed): each row's logits, prefilled and stepped, are
    its own alone, in float64 to 1e-12."""
    torch.manual_seed(0)
    model = TransformerLM(**SMALL).double().eval()
    pad = [1, 0]
    cache = KVCache.for_model(model, 2, pad_lengths=torch.tensor(pad) if as_tensor else pad)
    with torch.no_grad():
        got = model(torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]]), kv_cache=cache)
        step = model(torch.tensor([[10], [11]]), kv_cache=cache)[:, -1]
        for row, (prompt, nxt) in enumerate((([3, 4, 5], 10), ([6, 7, 8, 9], 11))):
            alone = model(torch.tensor([prompt + [nxt]]))[0]
            torch.testing.assert_close(got[row, pad[row]:], alone[:-1], rtol=0, atol=1e-12)
            torch.testing.assert_close(step[row], alone[-1], rtol=0, atol=1e-12)
        # select() (beam search's reshuffle) keeps each row's padding: the padded row twice, then one more
        # step (mutation: the cache taken for unpadded after select, its pad slot attended to, survived)
        cache.select(torch.tensor([0, 0]))
        again = model(torch.tensor([[12], [13]]), kv_cache=cache)[:, -1]
        for row, nxt in enumerate((12, 13)):
            torch.testing.assert_close(again[row], model(torch.tensor([[3, 4, 5, 10, nxt]]))[0, -1], rtol=0, atol=1e-12)


def test_generates_static_rows_run_eagerly_give_the_tokens_of_its_padded_rows(monkeypatch):
    """generate(compile=True)'s own bookkeeping, run eagerly (torch.compile replaced by the identity)
    so that it is checked in seconds and under mutation testing, where the compiled tests do
    not run: prompts of equal lengths (each row filled from its own row of the length's cache) and
    of others, past the context (the window slides), a call made while the kept step is in use
    (a cache of its own), and the kept cache's size, 64 positions for a call that needs 64 or fewer
    rather than the whole context. Float64, so that the bucketed spans' other summation order
    cannot turn a greedy choice."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    torch.manual_seed(0)
    model = TransformerLM(**{**SMALL, "context_length": 96}).double().eval()
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11], [12], [13, 14, 15]]
    for shift in (1, 7):  # 110 tokens in the longest row: past the 96 of the context
        assert generate(model, prompts, 105, temperature=0, window_shift=shift, compile=True) == \
            generate(model, prompts, 105, temperature=0, window_shift=shift)
    short = [[1, 2, 3], [3, 2, 1], [5, 5, 5], [7], [8, 9]]  # five rows again, 3 + 20 < 64 positions
    want, inner_want = generate(model, prompts, 20, temperature=0), generate(model, short, 20, temperature=0)
    inner = []

    def nested(row, token):
        if not inner:  # the kept five-row step of 64 positions is in use: this call gets its own cache
            inner.append(generate(model, short, 20, temperature=0, compile=True))

    assert generate(model, prompts, 20, temperature=0, compile=True, on_token=nested) == want
    assert inner == [inner_want]
    steps = model.__dict__["_decode_steps"]
    assert sorted((key[0], key[1]) for key in steps) == [(5, 64), (5, 96)]
    assert all(step.cache.max_len == key[1] and not step.in_use for key, step in steps.items())
    with torch.inference_mode():  # what an earlier call that overflowed leaves past a row's length (decode8)
        for step in steps.values():
            for t in (*step.cache.k, *step.cache.v):
                t.fill_(float("nan"))
    assert generate(model, short, 20, temperature=0, compile=True) == inner_want
    kept, = (step for key, step in steps.items() if key[:2] == (5, 64))  # a lone call uses the kept cache
    assert all(torch.isfinite(t).all() for t in (*kept.cache.k, *kept.cache.v))


def test_the_compiled_step_kept_on_a_model_does_not_keep_it():
    """The compiled step generate(compile=True) keeps on its model holds the model weakly: the model,
    its weights and the step's static cache are freed when it is dropped, with the collector off; it
    had been in a cycle with its steps (model -> steps -> model) until a collection (cyc25 F2). A
    step that outlives its model says so."""
    model = TransformerLM(**SMALL).eval()
    assert generate(model, [1, 2, 3], 6, temperature=0, compile=True) == generate(model, [1, 2, 3], 6, temperature=0)
    kept, = model.__dict__["_decode_steps"].values()
    alive, weight, cache = weakref.ref(model), weakref.ref(model.output_weight), weakref.ref(kept.cache.k[0])
    gc.collect()  # torch.compile's tracing leaves garbage cycles that hold the cache while it traced
    with collector_off():
        del model
        assert alive() is None and weight() is None
        try:  # not pytest.raises: its record of the error keeps the step (in its traceback) alive
            kept([1], [0])
            said = None
        except RuntimeError as e:
            said = str(e)
        assert said == "this DecodeStep's model is gone (a step kept on a model holds it weakly)"
        del kept
        assert cache() is None


def test_compiled_generation_prefills_the_prompts_of_one_length_together():
    """Sixteen prompts were sixteen eager forwards before the first compiled step (about 5 ms each on
    an H200, a quarter of a 16-stream call there): the rows of one length now share one forward,
    with no padding; each row's tokens are still the eager loop's, and those it gets alone."""
    model = TransformerLM(**SMALL).eval()
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14]]
    prefills = []  # (rows, positions) of each prefill's cache (the compiled steps have their own)
    new_cache = model.new_cache
    model.new_cache = lambda rows, **kw: prefills.append((rows, kw.get("max_len"))) or new_cache(rows, **kw)
    got = generate(model, prompts, 8, temperature=0, compile=True)
    assert prefills == [(3, 3), (1, 5)]  # by length: three rows of 3 tokens, one of 5
    prefills.clear()
    slid = generate(model, prompts, 20, temperature=0, compile=True)  # the longest row fills the 16 positions
    # each slide prefills every row once, by length: once all rows fill the window, in one forward
    assert prefills[:2] == [(3, 3), (1, 5)] and (4, 16) in prefills and sum(r for r, _ in prefills) % 4 == 0
    del model.new_cache
    assert got == generate(model, prompts, 8, temperature=0) and slid == generate(model, prompts, 20, temperature=0)
    assert [generate(model, p, 8, temperature=0, compile=True) for p in prompts] == got


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_prompt_that_overflowed_leaves_nothing_for_the_next_compiled_call(compiled, monkeypatch):
    """decode8: the static cache kept with the model held the NaN keys and values an overflowing
    prompt wrote, past the next prompt's length; masked, but 0 x NaN is NaN, so a prompt that is fine
    failed with NonFiniteLogitsError until the model was rebuilt. Each row is cleared before its prefill.
    The path of ``compile=True`` without compiling too (torch.compile made the identity): a mutant
    that skips the clearing fails that in 3 s, where it had been caught only by the slow test (mut23a)."""
    import lm.generate.static as static_module
    from lm.generate import NonFiniteLogitsError

    if not compiled:
        monkeypatch.setattr(static_module.torch, "compile", lambda fn, **kw: fn)
    model = TransformerLM(**SMALL).eval()
    good = generate(model, [1, 2, 3], 5, temperature=0)
    bad = next(t for t in range(10, SMALL["vocab_size"]) if t not in good)
    with torch.no_grad():
        model.token_embeddings.weight[bad] = float("inf")  # a prompt holding it overflows
    assert generate(model, [1, 2, 3], 5, temperature=0) == good
    with pytest.raises(NonFiniteLogitsError):
        generate(model, [1, 2, 3, bad, 4, 5, 6, 7, 8, 9], 5, temperature=0, compile=True)
    assert generate(model, [1, 2, 3], 5, temperature=0, compile=True) == good  # the same compiled step


def test_eos_id_is_one_id_of_the_vocabulary():
    """decode8: eos_id was never checked: a list (transformers' eos_token_id=[...]), a string or an id
    outside the vocabulary never stopped generation, and True stopped at id 1."""
    model = TransformerLM(**SMALL)
    free = generate(model, [1, 2], 10, temperature=0)
    vocab = SMALL["vocab_size"]
    for bad, extra in (([free[3]], " (one id, not a list of them)"), ((free[3],), " (one id, not a list of them)"),
                       (str(free[3]), ""), (vocab, ""), (-1, ""), (True, ""), (2.0, "")):
        with pytest.raises(ValueError) as e:
            generate(model, [1, 2], 10, temperature=0, eos_id=bad)
        assert str(e.value) == (f"eos_id must be None or one token id in [0, vocab_size={vocab}), got "
                                f"eos_id={bad!r}{extra}")
    import numpy as np

    for same in (free[3], np.int64(free[3]), torch.tensor(free[3])):
        assert generate(model, [1, 2], 10, temperature=0, eos_id=same) == free[:4]
    # the first and last ids are ids too (mutation: `0 < eos_id` survived)
    for edge in (0, vocab - 1):
        out = generate(model, [1, 2], 10, temperature=0, eos_id=edge)
        assert out == (free[:free.index(edge) + 1] if edge in free else free)


def test_stops_after_eos():
    model = TransformerLM(**SMALL)
    free = generate(model, [1, 2], 10, temperature=0)
    eos = free[3]
    out = generate(model, [1, 2], 10, temperature=0, eos_id=eos)
    assert out == free[: free.index(eos) + 1]
    # in a batch, finished rows stop while the others go on
    batch = generate(model, [[1, 2], [5]], 10, temperature=0, eos_id=eos)
    assert batch[0] == out and batch[1] == generate(model, [5], 10, temperature=0, eos_id=eos)


def test_seeded_sampling_is_reproducible():
    model = TransformerLM(**SMALL)

    def run(seed, **kw):
        return generate(model, [1, 2, 3], 20, generator=torch.Generator().manual_seed(seed), **kw)

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(3, top_k=5, top_p=0.9, temperature=0.7) == run(3, top_k=5, top_p=0.9, temperature=0.7)
    assert generate(model, [1], 0) == []


def test_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    g = torch.Generator().manual_seed(0)
    draws = sample_next_token(logits.expand(40000, 5), temperature=2.0, generator=g)
    freq = torch.bincount(draws, minlength=5).float() / 40000
    torch.testing.assert_close(freq, torch.softmax(logits / 2.0, -1), atol=0.01, rtol=0)


def filtered_distribution(logits, temperature, top_k, top_p):
    """The distribution sample_next_token should draw from, by brute force in float64: divide by the
    temperature, keep the top_k largest (and any tied with the k-th), softmax, then keep the most
    likely tokens until their mass reaches top_p, and renormalise."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if top_k is not None and top_k < len(order):
        order = [i for i in order if scaled[i] >= scaled[order[top_k - 1]]]
    z = sum(math.exp(scaled[i]) for i in order)
    nucleus, mass = [], 0.0
    for i in order:
        nucleus.append(i)
        mass += math.exp(scaled[i]) / z
        assert top_p == 1.0 or abs(mass - top_p) > 0.01, "top_p on a cumulative mass: rounding would decide"
        if mass >= top_p:
            break
    total = sum(math.exp(scaled[i]) for i in nucleus)
    probs = torch.zeros(len(logits), dtype=torch.float64)
    for i in nucleus:
        probs[i] = math.exp(scaled[i]) / total
    return probs


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(3.0, None, 0.8), (0.7, None, 0.9), (1.5, 5, 0.75), (3.0, 6, 0.95), (2.0, 3, 1.0)],
)
def test_temperature_top_k_and_top_p_together_follow_the_filtered_distribution(temperature, top_k, top_p):
    logits = [3.0, 2.2, 1.5, 1.0, 0.3, -0.5, -1.0, -2.0]
    expected = filtered_distribution(logits, temperature, top_k, top_p)
    n = 200_000
    g = torch.Generator().manual_seed(0)
    draws = sample_next_token(torch.tensor(logits).expand(n, 8), temperature=temperature, top_k=top_k, top_p=top_p,
                              generator=g)  # fmt: skip
    freq = torch.bincount(draws, minlength=8).double() / n
    assert torch.equal(freq > 0, expected > 0)  # exactly the tokens the filters keep
    # one frequency's standard deviation is at most 0.0011 at n = 200,000: 0.006 is over 5 sigma
    torch.testing.assert_close(freq, expected, atol=0.006, rtol=0)


def test_sampling_shapes_and_defaults():
    """One token per row for any number of leading dimensions (here batch x beam, and a single
    row), rows filtered and renormalised independently, and temperature 1 by default."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 3.0, 0.0, 0.0]])
    n = 20_000
    g = torch.Generator().manual_seed(0)
    draws = sample_next_token(logits.repeat(n, 2, 1).reshape(n, 4, 5), generator=g)  # default temperature
    assert draws.shape == (n, 4)
    for col in range(4):
        freq = torch.bincount(draws[:, col], minlength=5).float() / n
        torch.testing.assert_close(freq, torch.softmax(logits[col % 2], -1), atol=0.015, rtol=0)  # 4.5 sigma
    one = sample_next_token(logits[0], generator=torch.Generator().manual_seed(1))
    assert one.shape == () and 0 <= int(one) < 5
    # top_p_filter renormalises each row on its own
    probs = torch.softmax(logits, -1)
    filtered = top_p_filter(probs, 0.7)
    torch.testing.assert_close(filtered.sum(-1), torch.ones(2))
    assert filtered[0].nonzero().flatten().tolist() == [0, 1] and filtered[1].nonzero().flatten().tolist() == [2]


def test_filters_and_greedy_work_on_the_last_dimension_of_3d_logits():
    logits = torch.randn(3, 4, 10)
    assert torch.equal(sample_next_token(logits, temperature=0), logits.argmax(-1))
    kept = torch.isfinite(top_k_filter(logits, 3))
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(3, dim=-1).indices, True))
    probs = torch.softmax(logits, -1)
    filtered = top_p_filter(probs, 0.6)
    for b in range(3):
        for r in range(4):
            torch.testing.assert_close(filtered[b, r], top_p_filter(probs[b, r], 0.6))
    per_row = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) * 0.9 + 0.1  # one per (b, r) row
    for top_p in (per_row, per_row[..., None]):  # (3, 4): the rows are probs' shape without the vocabulary
        filtered = top_p_filter(probs, top_p)
        for b in range(3):
            for r in range(4):
                torch.testing.assert_close(filtered[b, r], top_p_filter(probs[b, r], per_row[b, r].item()))
    draws = sample_next_token(logits, top_k=2, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (3, 4) and torch.isin(draws[..., None], logits.topk(2, dim=-1).indices).all()


def test_top_p_mass_exactly_p_is_enough():
    """The smallest set whose mass is >= top_p: a first token of mass exactly p is the whole set
    (binary fractions, so no rounding decides it)."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    assert top_p_filter(probs, 0.5).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert top_p_filter(probs, 0.75).nonzero().flatten().tolist() == [0, 1]


def test_sample_next_token_checks_its_arguments():
    bad = [({"top_k": 0}, "top_k=0"), ({"top_p": 0.0}, "top_p=0.0"), ({"temperature": -1.0}, "temperature"),
           ({"temperature": float("inf")}, "temperature=inf"), ({"temperature": float("nan")}, "temperature=nan")]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            sample_next_token(torch.randn(2, 5), **kwargs)


def test_greedy_and_top_k_1_are_argmax():
    logits = torch.randn(7, 30)
    assert torch.equal(sample_next_token(logits, temperature=0), logits.argmax(-1))
    assert torch.equal(sample_next_token(logits, top_k=1), logits.argmax(-1))


def test_top_k_keeps_every_logit_tied_with_the_kth_as_hugging_face_does():
    """top_k kept exactly the k entries torch.topk returned: among tied logits an arbitrary subset,
    always the same one (top_k=1 drew index 2 of three tied maxima, never 0 or 3). Hugging Face's
    TopKLogitsWarper and vLLM keep every logit not below the k-th; so does top_k_filter now, in
    bfloat16 (where ties are common) as in float32."""
    transformers = pytest.importorskip("transformers")
    logits = torch.tensor([[2.0, 1.0, 2.0, 2.0, 0.5], [3.0, 1.0, 1.0, 1.0, 0.0]])
    assert torch.isfinite(top_k_filter(logits, 1)).tolist() == [[True, False, True, True, False],
                                                                [True, False, False, False, False]]
    assert torch.isfinite(top_k_filter(logits, 2))[1].tolist() == [True, True, True, True, False]
    draws = sample_next_token(logits[:1].expand(3000, 5), top_k=1, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 2, 3}  # each of the tied maxima, as HF samples them
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        rows = (torch.randn(64, 200, generator=g) * 3).to(dtype)
        for k in (1, 5, 20, 199, 200, 500):
            theirs = transformers.TopKLogitsWarper(top_k=k)(None, rows.clone())
            assert torch.equal(top_k_filter(rows, k), theirs), (dtype, k)


def test_vanishing_temperature_and_top_p_are_greedy_not_nan():
    """A temperature that overflows the logits in float32 (1e-300 is 0 there; 100 / 1e-37 is inf)
    or a top_p below float32's least (0 there, which had kept no token: 0/0) gave NaN and a
    RuntimeError from multinomial, which killed `lm serve`'s engine. Below 1e-5 (vLLM's threshold)
    sampling is greedy; top_p keeps the likeliest token however small it is."""
    logits = torch.randn(5, 40) * 30
    g = torch.Generator().manual_seed(0)
    for t in (1e-300, 1e-37, 9.9e-6):
        assert torch.equal(sample_next_token(logits, temperature=t, generator=g), logits.argmax(-1))
    for p in (1e-300, 1e-46):
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
        assert torch.equal(top_p_filter(logits.softmax(-1), p), one_hot)
        assert torch.equal(sample_next_token(logits, top_p=p, generator=g), logits.argmax(-1))
    # at 1e-5 it samples: two logits 1e-5 apart are e^-1 as likely, so both come up
    close = torch.tensor([[0.0, 1e-5, -1.0]]).expand(200, 3)
    assert set(sample_next_token(close, temperature=1e-5, generator=g).tolist()) == {0, 1}


def test_top_k_keeps_exactly_k_when_nothing_ties():
    logits = torch.randn(4, 20)
    kept = torch.isfinite(top_k_filter(logits, 6))
    assert (kept.sum(-1) == 6).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(6).indices, True))


@pytest.mark.parametrize("top_p", [float("nan"), -1, 0.0, 1.5, True, None, "0.5"])
def test_top_p_filter_checks_top_p_as_sample_next_token_does(top_p):
    """top_p_filter and top_k_filter are public, but only sample_next_token checked their arguments:
    top_p NaN, 0 or -1 kept the likeliest token alone (greedy, silently) and 1.5 kept them all."""
    probs = torch.softmax(torch.randn(2, 10), -1)
    with pytest.raises(ValueError, match=rf"^top_p must be in \(0, 1\], got top_p={re.escape(repr(top_p))}$"):
        top_p_filter(probs, top_p)


@pytest.mark.parametrize("top_k", [0, -1, 2.0, None, True, "3"])
def test_top_k_filter_checks_top_k_as_sample_next_token_does(top_k):
    """top_k 0 and -1 had failed inside torch (a size mismatch, "selected index k out of range"),
    2.0 with topk's TypeError and None with a comparison's."""
    with pytest.raises(ValueError, match=rf"^top_k must be a positive integer, got top_k={re.escape(repr(top_k))}$"):
        top_k_filter(torch.randn(2, 10), top_k)


def test_the_filters_take_numpy_numbers_and_keep_their_results():
    import numpy as np

    logits = torch.randn(3, 10)
    assert torch.equal(top_k_filter(logits, np.int64(3)), top_k_filter(logits, 3))
    probs = logits.softmax(-1)
    assert torch.equal(top_p_filter(probs, np.float32(0.5)), top_p_filter(probs, 0.5))
    assert torch.equal(top_p_filter(probs, 1), probs / probs.sum(-1, keepdim=True))


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=8, unique=True),
    p=st.floats(min_value=0.01, max_value=1.0),
)
def test_top_p_keeps_the_smallest_set_with_mass_p(weights, p):
    probs = torch.tensor(weights, dtype=torch.float64)
    probs = probs / probs.sum()
    n = len(weights)
    # brute force over every subset: the smallest size reaching mass ≥ p, and among those the heaviest
    best = None
    for size in range(1, n + 1):
        sets = [s for s in itertools.combinations(range(n), size) if probs[list(s)].sum() >= p - 1e-12]
        if sets:
            best = max(sets, key=lambda s: probs[list(s)].sum())
            break
    cumulative = probs.sort(descending=True).values.cumsum(0)
    if (cumulative - p).abs().min() < 1e-9:
        return  # p exactly on a cumulative mass: float rounding decides, nothing to pin
    filtered = top_p_filter(probs, p)
    kept = set(torch.nonzero(filtered).flatten().tolist())
    assert kept == set(best)
    torch.testing.assert_close(filtered.sum(), torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": 0}, "top_k=0"),
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"prompt_ids": []}, "prompt_ids"),
        ({"prompt_ids": [[1, 2], []]}, "prompt 1 is empty"),
        ({"prompt_ids": [1, 50]}, "prompt_ids: id 50"),
        ({"window_shift": 17}, "window_shift=17"),
        ({"window_shift": 0}, "window_shift=0"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    model = TransformerLM(**SMALL)
    args = {"prompt_ids": [1, 2], "max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, args.pop("prompt_ids"), args.pop("max_new_tokens"), **args)


def test_cache_overflow_raises():
    model = TransformerLM(**SMALL)
    cache = KVCache.for_model(model, 1, max_len=4)
    model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.tensor([[1, 2]]), kv_cache=cache)


def test_bfloat16_model_generates():
    model = TransformerLM(**SMALL, dtype=torch.bfloat16)
    out = generate(model, [[1, 2, 3], [4]], 25, temperature=0)
    assert [len(o) for o in out] == [25, 25]
    assert out[1] == generate(model, [4], 25, temperature=0)


def test_switches_must_be_bools_not_truthy_strings(tmp_path):
    """A string is truthy: generate(compile="no") compiled, greedy_decode(use_cache="no") used the cache,
    AdamW(fused="no") fused, Engine(compile="no") compiled every step, TokenDataset(check_ids="no")
    checked (apifuzz19 #22). numpy's bools are bools."""
    import numpy as np

    from lm.data import TokenDataset, write_token_file
    from lm.generate import DecodeStep, greedy_decode
    from lm.model import EncoderDecoder, Seq2SeqConfig
    from lm.optim import AdamW
    from lm.serve import Engine

    model = TransformerLM(100, 16, 16, 1, 2, 32).eval()
    seq2seq = EncoderDecoder(Seq2SeqConfig(vocab_size=50, context_length=16, d_model=16, encoder_layers=1,
                                           decoder_layers=1, num_heads=2, dropout=0.0)).eval()
    write_token_file(tmp_path / "t.bin", np.arange(100) % 50, vocab_size=100)
    for name, call in [
        ("compile", lambda: generate(model, [1, 2], 2, compile="no")),
        ("compile", lambda: DecodeStep(model, 2, compile=1)),
        ("compile", lambda: Engine(model, max_batch=2, compile="no")),
        ("use_cache", lambda: greedy_decode(seq2seq, [[5, 6]], use_cache="no")),
        ("fused", lambda: AdamW(model.parameters(), fused="no")),
        ("check_ids", lambda: TokenDataset(tmp_path / "t.bin", 8, check_ids="no")),
    ]:
        with pytest.raises(ValueError, match=rf"^{name} must be True or False( or None)?, got {name}="):
            call()
    assert generate(model, [1, 2], 3, temperature=0.0, compile=np.bool_(False)) == generate(model, [1, 2], 3,
                                                                                           temperature=0.0)
    AdamW(model.parameters(), fused=None)


def test_a_callback_that_cannot_be_called_is_refused_before_any_token():
    """generate(on_token=5) failed with "'int' object is not callable" only once the first token was
    chosen, after the prefill (apifuzz19 #21); greedy_decode's on_token and beam_search's on_sentence
    the same. Each is now checked up front, naming the argument."""
    from lm.generate import beam_search, greedy_decode
    from lm.model import EncoderDecoder, Seq2SeqConfig

    model = TransformerLM(**SMALL)
    seq2seq = EncoderDecoder(Seq2SeqConfig(vocab_size=50, context_length=16, d_model=16, encoder_layers=1,
                                           decoder_layers=1, num_heads=2, dropout=0.0)).eval()
    for name, call in [("on_token", lambda bad: generate(model, [1, 2], 2, on_token=bad)),
                       ("on_token", lambda bad: greedy_decode(seq2seq, [[5, 6]], on_token=bad)),
                       ("on_sentence", lambda bad: beam_search(seq2seq, [[5, 6]], beam_size=2, on_sentence=bad))]:
        for bad in (5, "print"):
            with pytest.raises(ValueError, match=rf"^{name} must be a callable or None, got {name}={bad!r}$"):
                call(bad)
    seen = []
    assert generate(model, [1, 2], 3, temperature=0.0, on_token=lambda row, tok: seen.append(tok)) == seen


def test_static_and_padded_caches_and_the_decode_step_check_their_rows_and_sizes():
    """DecodeStep(model, 0) was taken, DecodeStep(model, 2)([1], [0, 0]) failed in a reshape, and rows or
    sizes of -1 or 2.0 in StaticKVCache, KVCache and DecodeStep failed inside torch.zeros (apifuzz19 #21)."""
    from lm.generate import DecodeStep
    from lm.generate.static import StaticKVCache

    model = TransformerLM(**SMALL).eval()
    for rows in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"^rows must be a positive integer, got rows={re.escape(repr(rows))}$"):
            DecodeStep(model, rows)
        with pytest.raises(ValueError, match=rf"^rows must be a positive integer, got rows={re.escape(repr(rows))}$"):
            StaticKVCache(2, rows, 4, 16, 8)
        with pytest.raises(ValueError, match=r"^batch_size must be a positive integer, got batch_size="):
            KVCache(2, rows, 4, 16, 8)
    for i, name in enumerate(("num_layers", "batch_size", "num_heads", "max_len", "head_dim")):
        sizes = [2, 1, 4, 16, 8]
        sizes[i] = -1
        with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got {name}=-1$"):
            KVCache(*sizes)
        sizes[i] = 2.0
        with pytest.raises(ValueError, match=rf"^{'rows' if name == 'batch_size' else name} must be a positive"):
            StaticKVCache(*sizes)
    with pytest.raises(ValueError, match=r"^rows: the cache holds 3 rows, got rows=2$"):
        DecodeStep(model, 2, cache=StaticKVCache.for_model(model, 3))
    step = DecodeStep(model, 2)
    for ids in ([1], [1, 2, 3], torch.tensor([1])):
        with pytest.raises(ValueError, match=r"^ids: need 2 token ids \(one per row\), got [13]$"):
            step(ids, [0, 0])
    with pytest.raises(ValueError, match=r"^lengths: need 2 values"):
        step([1, 2], [0])
    assert step(torch.tensor([1, 2]), [0, 0]).shape == (2, SMALL["vocab_size"])
    assert step([1, 2], [1, 1]).shape == (2, SMALL["vocab_size"])


def test_decode_step_takes_an_autocast_dtype_only():
    """DecodeStep's dtype runs the step under autocast: a name or torch.int64 had only warned (or failed
    at the first call), as Engine's (apifuzz19 #21)."""
    from lm.generate import DecodeStep

    model = TransformerLM(**SMALL).eval()
    with pytest.raises(ValueError, match=r"^dtype must be one of torch.float32, torch.bfloat16, torch.float16 or "
                                         r"None, got dtype='bfloat16' \(pass torch.bfloat16, not its name\)$"):
        DecodeStep(model, 2, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"got dtype=torch.int64$"):
        DecodeStep(model, 2, dtype=torch.int64)
    logits = DecodeStep(model, 2, dtype=torch.bfloat16)([1, 2], [0, 0])
    assert logits.shape == (2, SMALL["vocab_size"])
    # under autocast: the model's own bfloat16 autocast forward, exactly (mutation: the dtype not kept, so the
    # step ran in float32, survived)
    with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
        expected = model(torch.tensor([[1], [2]]))[:, -1]
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected)


def test_top_p_filter_takes_a_top_p_for_each_row():
    """review19: a per-row tensor top_p had worked, and the checks added for apifuzz19 refused it in a
    message of two lines; each value must be in (0, 1]."""
    probs = torch.softmax(torch.randn(2, 10, generator=torch.Generator().manual_seed(0)), -1)
    kept = top_p_filter(probs, torch.tensor([[0.9], [0.5]]))
    assert torch.equal(kept[0], top_p_filter(probs[:1], 0.9)[0])
    assert torch.equal(kept[1], top_p_filter(probs[1:], 0.5)[0])
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got a tensor of top_p values of dtype "
                                         r"torch\.float32 with some outside it: \[0\.5, 1\.5\]$"):
        top_p_filter(probs, torch.tensor([[0.5], [1.5]]))
    assert torch.equal(top_p_filter(probs, torch.tensor(0.9)), top_p_filter(probs, 0.9))


def test_top_p_filter_lines_a_top_p_of_each_row_up_with_the_rows():
    """numerics20: a (rows,) top_p had been broadcast against the vocabulary, so with as many rows as
    tokens row 0's 0.99 cut column 0..., and otherwise a bare torch error; it is (rows, 1)'s equal,
    and another shape is refused naming top_p."""
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.35, 0.25]])
    per_row = torch.tensor([0.99, 0.5, 0.5])
    alone = torch.stack([top_p_filter(probs[i:i + 1], float(t))[0] for i, t in enumerate(per_row)])
    assert torch.equal(top_p_filter(probs, per_row), alone)
    assert torch.equal(top_p_filter(probs, per_row[:, None]), alone)
    assert torch.equal(alone[0], probs[0])  # 0.99 keeps every token of row 0
    wide = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(top_p_filter(wide, per_row), top_p_filter(wide, per_row[:, None]))
    for bad in (torch.tensor([0.9, 0.5]), torch.full((1, 3), 0.5), torch.full((3, 10), 0.5)):
        with pytest.raises(ValueError, match=r"^top_p: one per row needs shape \(3,\) or \(3, 1\) for probs of "
                                             r"shape \(3, (3|10)\), got "):
            top_p_filter(probs if bad.shape[-1] != 10 else wide, bad)


@pytest.mark.parametrize("vocab_size", [20, 49])
def test_sampling_with_vocab_size_is_the_rerun_sampler_over_those_ids(vocab_size):
    torch.manual_seed(0)
    model = TransformerLM(**SMALL).eval()
    got = generate(model, [1, 2], 40, temperature=1.5, vocab_size=vocab_size,
                   generator=torch.Generator().manual_seed(4))
    want = sampled_by_rerun(model, [1, 2], 40, torch.Generator().manual_seed(4), vocab_size=vocab_size,
                            temperature=1.5)
    assert got == want


def test_on_token_streams_exactly_the_returned_tokens_of_every_row():
    """on_token is called with (row, token) for every new token: what a streaming caller joins must
    be what generate returns, a row that met eos_id early included (nothing streamed after it)."""
    torch.manual_seed(0)
    model = TransformerLM(**SMALL).eval()
    prompts = [[1, 2, 3], [7], [9, 8, 7, 6]]
    first = generate(model, prompts, 1, temperature=0.0)
    eos = first[1][0]  # row 1 ends at its first token
    streamed = [[] for _ in prompts]
    got = generate(model, prompts, 12, temperature=0.0, eos_id=eos, on_token=lambda r, t: streamed[r].append(t))
    assert got[1] == [eos] and streamed == got


def test_generate_leaves_the_model_in_the_mode_it_found():
    torch.manual_seed(0)
    model = TransformerLM(**SMALL).eval()
    generate(model, [1, 2], 3)
    assert not model.training
    model.train()
    generate(model, [1, 2], 3)
    assert model.training


def test_a_row_that_has_ended_does_not_fail_the_batch_when_its_logits_overflow():
    """A batch row that met eos_id is done: its further logits are computed (the batch steps
    together) but never used, so their turning NaN must not raise for the rows still going; the
    others get the tokens they get alone."""
    torch.manual_seed(0)
    model = TransformerLM(**SMALL).eval()
    prompts = [[1, 2], [3, 4, 5]]
    eos = generate(model, prompts[1], 1, temperature=0.0)[0]
    alone = generate(model, prompts[0], 8, temperature=0.0, eos_id=eos)
    assert eos not in alone[:4]
    calls = []

    def hook(module, args, output):  # row 1's logits NaN from the third forward on (it ended at the first)
        calls.append(1)
        if len(calls) >= 3:
            output[1, :, 7] = float("nan")
        return output

    h = model.lm_head.register_forward_hook(hook)
    try:
        got = generate(model, prompts, 8, temperature=0.0, eos_id=eos)
    finally:
        h.remove()
    assert got == [alone, [eos]]


def test_a_bucketed_step_attends_to_the_new_token_at_every_span_boundary():
    """A bucketed step (what --compile / generate(compile=True) run) attends over the power of two
    that holds its longest row *and its new token*: a row at length 16, 32 (its token written at
    position 16, 32) must still see that token. Here an eager DecodeStep made to bucket (so no
    compilation is needed), against the model's full forward, at every length up to 63."""
    from lm.generate import DecodeStep, KVCache

    torch.manual_seed(0)
    model = TransformerLM(**{**SMALL, "context_length": 64}).eval()
    step = DecodeStep(model, 2)
    step.bucketed = True
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, SMALL["vocab_size"], (2, 64), generator=g).tolist()
    one = KVCache.for_model(model, 1, max_len=3)
    with torch.no_grad():
        model(torch.tensor([seqs[1][:3]]), kv_cache=one)
    step.cache.fill_from(1, one)
    for t in range(60):
        lengths = [t, t + 3]
        whole = step([seqs[0][t], seqs[1][t + 3]], lengths, full_span=True).clone()
        assert step.cache.span == 64  # full_span: over the whole cache, the probe's reference
        got = step([seqs[0][t], seqs[1][t + 3]], lengths).clone()
        assert step.cache.span == min(64, max(16, 1 << (t + 3).bit_length()))  # the span holding the new token
        torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            for b, n in enumerate(lengths):
                want = model(torch.tensor([seqs[b][: n + 1]]))[0, -1]
                torch.testing.assert_close(got[b], want, rtol=1e-4, atol=1e-4, msg=f"row {b} at length {n}")


@pytest.mark.parametrize("lengths", [(3, 70), (70, 3)])
def test_compiled_generation_of_a_short_and_a_long_prompt_past_64_positions(lengths):
    """generate(compile=True) sizes its static cache for the longest prompt and the new tokens
    (rounded up to 64): a batch of a 3-token and a 70-token prompt on a 128-position model gives
    the eager tokens."""
    torch.manual_seed(0)
    model = TransformerLM(**{**SMALL, "context_length": 128}).eval()
    prompts = [[(7 * i + k) % 50 for i in range(n)] for k, n in enumerate(lengths)]
    assert generate(model, prompts, 10, temperature=0.0, compile=True) == generate(model, prompts, 10, temperature=0.0)


def test_a_static_caches_span_is_the_whole_cache_unless_bucketed():
    """set_lengths attends over all max_len positions by default and over the power of two that holds
    the longest row and its new token (16 at least) when asked; an encoder-decoder's cache does the same
    for its sources. The decode step always says which it wants, so a default of True went unseen."""
    from lm.generate.static import StaticKVCache, StaticSeq2SeqCache, span_for

    cache = StaticKVCache(2, 3, 4, 100, 8)
    cache.set_lengths([3, 40, 0])
    assert (cache.length, cache.span, cache.lengths.tolist()) == (40, 100, [3, 40, 0])
    cache.set_lengths([3, 40, 0], bucketed=True)
    assert cache.span == span_for(41, 100) == 64
    cache.set_lengths([3, 5, 0], bucketed=True)
    assert cache.span == 16  # the least span
    cache.set_lengths([3, 98, 0], bucketed=True)
    assert cache.span == 100  # past the last power of two: all of it
    pairs = StaticSeq2SeqCache(2, 2, 4, 100, 8)
    pairs.source_lengths[:] = [20, 7]
    pairs.set_lengths([1, 2])
    assert (pairs.span, pairs.source_span) == (100, 100)
    pairs.set_lengths([1, 2], bucketed=True)
    assert (pairs.span, pairs.source_span) == (16, 32)


def test_the_eager_loop_projects_only_the_last_position_of_a_prefill():
    """generate()'s eager loop asks the model for the last position's logits alone, at the prefill
    (prompts of two lengths, left-padded) as at every step: the logits of a whole prompt are
    prompt length x vocabulary floats, which a long prompt and a large vocabulary make gigabytes. The
    tokens are the same either way, so a mutant that prefilled with last_only=False survived."""
    model = TransformerLM(**SMALL).eval()
    calls = []
    forward = model.forward

    def spy(ids, *args, **kwargs):
        out = forward(ids, *args, **kwargs)
        calls.append((tuple(ids.shape), kwargs.get("last_only"), tuple(out.shape)))
        return out

    model.forward = spy
    generate(model, [[1, 2, 3, 4, 5], [6, 7]], max_new_tokens=3, temperature=0.0)
    vocab = SMALL["vocab_size"]
    assert calls[0] == ((2, 5), True, (2, 1, vocab)), calls[0]  # the prefill
    assert all(c == ((2, 1), True, (2, 1, vocab)) for c in calls[1:]) and len(calls) == 3, calls


def test_a_top_p_tensor_of_one_value_is_checked_as_a_number():
    """top_p as a 0-d or one-element tensor is one value for every row, checked as a float is: 0 and
    1.5 refused, 1 and 0.5 taken (the check had not been reached by any test)."""
    probs = torch.softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0]]), dim=-1)
    for bad in (torch.tensor(0.0), torch.tensor(1.5), torch.tensor([1.5]), torch.tensor(float("nan"))):
        with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got top_p=tensor"):
            top_p_filter(probs, bad)
    for good, kept in ((torch.tensor(1.0), 4), (torch.tensor([0.5]), 1), (torch.tensor(0.8), 2)):
        assert int((top_p_filter(probs, good) > 0).sum()) == kept, good


def test_a_vocab_limit_of_one_token_is_taken_and_zero_is_not():
    """check_vocab_limit's bounds: [1, the model's vocabulary]."""
    from lm.generate.sampling import check_vocab_limit

    check_vocab_limit(1, 10)
    check_vocab_limit(10, 10)
    check_vocab_limit(None, 10)
    for bad in (0, 11, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"^vocab_size must be in \[1, 10\] \(the model's\), got vocab_size="):
            check_vocab_limit(bad, 10)


def test_sampling_is_greedy_below_the_bound_and_samples_at_it():
    """GREEDY_BELOW: a temperature below it takes the argmax (dividing by it would overflow), one of
    exactly it still samples: two logits 1e-6 apart are then e^-0.1 apart in probability, and a seeded
    generator draws the second token among 200 draws."""
    from lm.generate.sampling import GREEDY_BELOW

    logits = torch.tensor([[1.0 + 1e-6, 1.0, -5.0]]).expand(200, 3)
    below, _ = next_token_and_finite(logits, temperature=GREEDY_BELOW / 2, generator=torch.Generator().manual_seed(0))
    at, finite = next_token_and_finite(logits, temperature=GREEDY_BELOW, generator=torch.Generator().manual_seed(0))
    assert below.tolist() == [0] * 200
    assert set(at.tolist()) == {0, 1} and bool(finite.all())
    draws = []
    for global_seed in (1, 2):  # drawn from the generator given, whatever torch's global state
        torch.manual_seed(global_seed)
        draws.append(next_token_and_finite(logits, temperature=GREEDY_BELOW,
                                           generator=torch.Generator().manual_seed(0))[0].tolist())
    assert draws[0] == draws[1] == at.tolist()

"""The encoder–decoder against torch.nn.Transformer, an independent formula and a stored fixture."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.model_reference import encoder_decoder_ref, load_into_torch_transformer

from lm.model import EncoderDecoder, Seq2SeqConfig, build_model, model_config_from_dict
from lm.nn import cross_entropy, linear_cross_entropy

FIXTURE = Path(__file__).parent / "fixtures" / "seq2seq_small.safetensors"
TIGHT = 1e-12  # float64 against float64: the same function, other rounding


def _config(**kw) -> Seq2SeqConfig:
    base = dict(vocab_size=53, context_length=24, d_model=32, encoder_layers=2, decoder_layers=2, num_heads=4,
                d_ff=64, dropout=0.0)
    return Seq2SeqConfig(**{**base, **kw})


def _ragged(batch_lengths, width, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(batch_lengths), width), generator=g)
    mask = torch.arange(width)[None] < torch.tensor(batch_lengths)[:, None]
    return ids.masked_fill(~mask, 0), mask


def _copy_into_torch(model: EncoderDecoder, pre: bool) -> torch.nn.Transformer:
    """A torch.nn.Transformer holding ``model``'s weights (its biases zero: lm's layers have none),
    in the model's dtype."""
    c = model.config
    ref = torch.nn.Transformer(c.d_model, c.num_heads, c.encoder_layers, c.decoder_layers, c.d_ff, dropout=0.0,
                               activation="relu", batch_first=True, norm_first=pre,
                               dtype=model.embeddings.weight.dtype)
    ref.encoder.enable_nested_tensor = False
    load_into_torch_transformer(model, ref)
    return ref.train()  # training mode: the plain path (eval may take the nested-tensor fast path)


def _grads_by_torch_name(model: EncoderDecoder) -> dict[str, torch.Tensor]:
    """Our parameter gradients under the names of the torch.nn.Transformer parameters they map to."""
    out = {}

    def attn(prefix, a):
        out[prefix + "in_proj_weight"] = torch.cat([a.q_proj.weight.grad, a.k_proj.weight.grad, a.v_proj.weight.grad])
        out[prefix + "out_proj.weight"] = a.output_proj.weight.grad

    for i, layer in enumerate(model.encoder):
        p = f"encoder.layers.{i}."
        attn(p + "self_attn.", layer.attn)
        out[p + "linear1.weight"], out[p + "linear2.weight"] = layer.ffn.w1.weight.grad, layer.ffn.w2.weight.grad
        for j in (1, 2):
            ln = getattr(layer, f"ln{j}")
            out[p + f"norm{j}.weight"], out[p + f"norm{j}.bias"] = ln.weight.grad, ln.bias.grad
    for i, layer in enumerate(model.decoder):
        p = f"decoder.layers.{i}."
        attn(p + "self_attn.", layer.self_attn)
        attn(p + "multihead_attn.", layer.cross_attn)
        out[p + "linear1.weight"], out[p + "linear2.weight"] = layer.ffn.w1.weight.grad, layer.ffn.w2.weight.grad
        for j in (1, 2, 3):
            ln = getattr(layer, f"ln{j}")
            out[p + f"norm{j}.weight"], out[p + f"norm{j}.bias"] = ln.weight.grad, ln.bias.grad
    for name in ("encoder", "decoder"):
        ln = getattr(model, f"{name}_norm")
        out[f"{name}.norm.weight"], out[f"{name}.norm.bias"] = ln.weight.grad, ln.bias.grad
    return out


@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
@pytest.mark.parametrize("pre", [False, True], ids=["post-norm", "pre-norm"])
def test_matches_torch_nn_transformer_on_ragged_padded_batches(pre, attn_impl):
    """Both in float64, where the same function gives the same numbers to rounding whatever the
    weights drawn (in float32, at 1e-5, a draw of torch 2.11's init exceeded the bound by rounding
    alone): the memory, the decoder's output and every gradient."""
    torch.manual_seed(0)
    model = build_model(_config(norm_placement="pre" if pre else "post", attn_impl=attn_impl)).double()
    with torch.no_grad():  # non-trivial norms, so a swapped weight and bias would show
        for n, p in model.named_parameters():
            if ".ln" in n or "_norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    ref = _copy_into_torch(model, pre)
    src, src_mask = _ragged([9, 4, 7], 9, 53, seed=1)
    tgt, tgt_mask = _ragged([6, 6, 2], 6, 53, seed=2)
    d = model.config.d_model
    # the embedded inputs (their formula is checked in test_embedding_formula): torch's model starts there
    x_src = model.embed(src, "src", torch.arange(9)).detach().requires_grad_()
    x_tgt = model.embed(tgt, "tgt", torch.arange(6)).detach().requires_grad_()
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # torch's convention: True = may not attend
    memory_ref = ref.encoder(x_src, src_key_padding_mask=~src_mask)
    hidden_ref = ref.decoder(x_tgt, memory_ref, tgt_mask=causal, tgt_is_causal=True,
                             tgt_key_padding_mask=~tgt_mask, memory_key_padding_mask=~src_mask)
    memory = model.encode(src, src_mask)
    hidden = model.decode(tgt, memory, src_mask, tgt_mask)
    torch.testing.assert_close(memory, memory_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(hidden, hidden_ref, atol=TIGHT, rtol=0)
    # gradients of every weight, through a loss on the real target positions only
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3)) * tgt_mask[..., None]
    (hidden * weights).sum().backward()
    (hidden_ref * weights).sum().backward()
    ours = _grads_by_torch_name(model)
    theirs = dict(ref.named_parameters())
    assert set(ours) == {n for n in theirs if not n.endswith("bias") or "norm" in n}
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name].grad, atol=TIGHT, rtol=0, msg=name)
    # the embedding gradient: the inputs' gradients, scaled by √d, summed into the rows of their ids
    expected = torch.zeros_like(model.embeddings.weight)
    expected.index_add_(0, src.reshape(-1), x_src.grad.reshape(-1, d) * math.sqrt(d))
    expected.index_add_(0, tgt.reshape(-1), x_tgt.grad.reshape(-1, d) * math.sqrt(d))
    # the tied matrix got no gradient through the output projection here (the loss is on hidden states)
    torch.testing.assert_close(model.embeddings.weight.grad, expected, atol=TIGHT, rtol=0)


def test_embedding_formula():
    model = build_model(_config())
    ids = torch.tensor([[5, 9, 3, 0]])
    table = model.embeddings.weight
    pos = torch.arange(4)[:, None] / 10000 ** (torch.arange(0, 32, 2)[None] / 32)
    pe = torch.stack([pos.sin(), pos.cos()], dim=-1).flatten(-2)
    torch.testing.assert_close(model.embed(ids, "src", torch.arange(4)), table[ids] * math.sqrt(32) + pe,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
def test_a_sentence_is_unchanged_by_longer_neighbours(attn_impl):
    torch.manual_seed(0)
    model = build_model(_config(attn_impl=attn_impl)).eval()
    src, src_mask = _ragged([5, 11, 8], 11, 53, seed=4)
    tgt, tgt_mask = _ragged([4, 9, 7], 9, 53, seed=5)
    batched = model(src, tgt, src_mask, tgt_mask)
    alone = model(src[:1, :5], tgt[:1, :4])
    # Only the shapes of the matmuls differ: measured max difference 5e-7
    torch.testing.assert_close(batched[0, :4], alone[0], atol=2e-6, rtol=0)


def test_matches_the_stored_fixture():
    from safetensors import safe_open
    from safetensors.torch import load_file

    t = load_file(str(FIXTURE))
    with safe_open(str(FIXTURE), "pt") as f:
        cfg = Seq2SeqConfig(**json.loads(f.metadata()["config"]))
    for attn_impl in ("einsum", "sdpa"):
        cfg.attn_impl = attn_impl
        model = EncoderDecoder(cfg).eval()
        model.load_state_dict({k.removeprefix("weights."): v for k, v in t.items() if k.startswith("weights.")})
        memory = model.encode(t["src"], t["src_mask"])
        hidden = model.decode(t["tgt_in"], memory, t["src_mask"], t["tgt_mask"])
        # the reference ran in float64; measured differences in float32: 1e-6
        torch.testing.assert_close(memory, t["memory"], atol=1e-5, rtol=0)
        torch.testing.assert_close(model.logits(hidden), t["logits"], atol=1e-5, rtol=0)
        batch = SimpleNamespace(**{k: t[k] for k in ("src", "src_mask", "tgt_in", "tgt_out", "tgt_mask")})
        torch.testing.assert_close(model.loss(batch), t["loss"], atol=1e-6, rtol=0)


# Each variant on its own (so a fault in one path is named by its test id), plus two mixtures.
VARIANTS = {
    "learned-positions": dict(positions="learned"),
    "rope": dict(positions="rope", rope_theta=100.0),  # a small theta: every pair turns by a visible angle
    "no-positions": dict(positions="none"),
    "swiglu": dict(ffn="swiglu"),
    "gelu": dict(ffn="gelu"),
    "silu": dict(ffn="silu"),
    "untied": dict(tie_embeddings=False),
    "pre-rmsnorm": dict(norm="rmsnorm", norm_placement="pre"),
    # an epsilon that moves the norms (mutation: the layers given their default, not the config's, survived)
    "layernorm-eps": dict(norm_eps=0.25),
    "pre-rmsnorm-eps": dict(norm="rmsnorm", norm_placement="pre", norm_eps=0.25),
    "no-norm-no-embed-scale": dict(norm="none", embed_scale=False),
    "rope-swiglu-rmsnorm-pre-untied-einsum": dict(positions="rope", ffn="swiglu", norm="rmsnorm", norm_placement="pre",
                                                  tie_embeddings=False, attn_impl="einsum"),
    "learned-gelu-pre-untied-einsum": dict(positions="learned", ffn="gelu", norm_placement="pre",
                                           tie_embeddings=False, attn_impl="einsum"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_the_independent_reference(variant):
    """Every position, feed-forward, norm and embedding option against encoder_decoder_ref (float64,
    no lm code) on a ragged padded batch: the memory, the logits and the training loss, of the
    model in float64 to rounding, and in float32 within float32's rounding at the values' scale."""
    torch.manual_seed(0)
    model = build_model(_config(**VARIANTS[variant])).eval()
    c = model.config
    with torch.no_grad():  # non-trivial norms, so a swapped weight and bias would show
        for n, p in model.named_parameters():
            if ".ln" in n or "_norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    src, src_mask = _ragged([9, 4, 7], 9, 53, seed=1)
    tgt, tgt_mask = _ragged([6, 6, 2], 6, 53, seed=2)
    tgt_out, _ = _ragged([6, 6, 2], 6, 53, seed=3)
    sd = {k: t.double() for k, t in model.state_dict().items()}
    memory_ref, _, logits_ref = encoder_decoder_ref(
        sd, src, src_mask, tgt, tgt_mask, num_heads=c.num_heads, encoder_layers=c.encoder_layers,
        decoder_layers=c.decoder_layers, eps=c.norm_eps, norm_first=c.norm_placement == "pre", norm=c.norm,
        positions=c.positions, ffn=c.ffn, theta=c.rope_theta, embed_scale=c.embed_scale)
    loss_ref = F.cross_entropy(logits_ref[tgt_mask], tgt_out[tgt_mask], label_smoothing=c.label_smoothing)
    batch = SimpleNamespace(src=src, src_mask=src_mask, tgt_in=tgt, tgt_out=tgt_out, tgt_mask=tgt_mask)
    with torch.no_grad():
        memory, logits, loss = model.encode(src, src_mask), model(src, tgt, src_mask, tgt_mask), model.loss(batch)
        model.double()
        memory64, logits64, loss64 = model.encode(src, src_mask), model(src, tgt, src_mask, tgt_mask), model.loss(batch)
    # float64: at most 3e-15 over the variants (torch 2.13 and 2.11's draws). The smallest fault
    # tried, GELU's tanh approximation for the exact erf one, moves them by 4e-4.
    torch.testing.assert_close(memory64, memory_ref, atol=TIGHT, rtol=0)
    torch.testing.assert_close(logits64, logits_ref, atol=TIGHT, rtol=0)
    assert loss64.item() == pytest.approx(loss_ref.item(), abs=TIGHT)
    # float32: measured at most 2.2e-7 of the largest value (memory up to 6, logits up to 24 without
    # norms, losses up to 22), about 2 float32 epsilons; the bound is 8 at that scale
    for ours, ref in ((memory, memory_ref), (logits, logits_ref), (loss, loss_ref)):
        scale = 8 * torch.finfo(torch.float32).eps * ref.abs().max().item()
        torch.testing.assert_close(ours.double(), ref, atol=scale, rtol=0)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("ignore", [None, 7])
def test_cross_entropy_smoothing_and_ignore_match_torch(eps, ignore):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (6, 5), generator=g)
    if ignore is not None:
        t[0, :3] = ignore
        t[4, 1] = ignore
    ref = F.cross_entropy((x @ w.T).reshape(-1, 11), t.reshape(-1), label_smoothing=eps,
                          ignore_index=-100 if ignore is None else ignore)
    ref_grads = torch.autograd.grad(ref, (x, w))
    for fn in (lambda: cross_entropy(x @ w.T, t, label_smoothing=eps, ignore_index=ignore),
               lambda: linear_cross_entropy(x, w, t, 4, label_smoothing=eps, ignore_index=ignore)):
        loss = fn()
        # lm computes in float32: the float64 reference agrees to float32 rounding (measured 8e-7)
        assert loss.item() == pytest.approx(ref.item(), abs=2e-6)
        for a, b in zip(torch.autograd.grad(loss, (x, w)), ref_grads):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_config_round_trip_and_the_architecture_key():
    cfg = _config(positions="rope", ffn="gelu", tie_embeddings=False)
    assert model_config_from_dict(cfg.to_dict()) == cfg
    assert Seq2SeqConfig.from_toml(cfg.to_toml()) == cfg
    model = build_model(cfg)
    assert {"src_embeddings.weight", "tgt_embeddings.weight", "lm_head.weight"} <= set(model.state_dict())
    with pytest.raises(ValueError, match="architecture must be one of"):
        model_config_from_dict({**cfg.to_dict(), "architecture": "rnn"})
    with pytest.raises(ValueError, match="pad_id must be an id"):
        _config(pad_id=99)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pad_id": 2}, r"pad_id, bos_id and eos_id must be distinct, got pad_id=2, bos_id=1, eos_id=2"),
    ({"bos_id": 2}, "must be distinct"),
    ({"pad_id": 1}, "must be distinct"),
    ({"eos_id": -1}, r"eos_id must be an id in \[0, vocab_size=53\), got -1"),
    ({"bos_id": True}, "bos_id must be an id"),
    ({"norm_eps": -1.0}, "norm_eps must be a finite number > 0"),
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"embed_scale": "no"}, r"^embed_scale must be a bool, got 'no'$"),  # truthy: it scaled
    ({"embed_scale": 0}, r"^embed_scale must be a bool, got 0$"),
    ({"embed_scale": None}, r"^embed_scale must be a bool, got None$"),
])
def test_bad_config_raises(kwargs, match):
    """An <eos> sharing an id with <pad> or <bos> would never end a target (their logits are -inf);
    a norm_eps <= 0 makes every logit NaN."""
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope", "none"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_every_tensor_of_the_model_is_made_on_the_device_and_dtype_it_is_given(positions, norm):
    """build_model(..., device=, dtype=): each parameter and buffer (RoPE's tables, the sinusoid table)
    is made there, not on the default device and moved; a model built on "meta" allocates nothing (a
    layer given no device had been made on the CPU)."""
    for tie in (True, False):
        for config in (_config(positions=positions, norm=norm, tie_embeddings=tie),
                       model_config_from_dict({"vocab_size": 53, "context_length": 24, "d_model": 32, "num_layers": 2,
                                               "num_heads": 4, "d_ff": 64, "positions": positions, "norm": norm,
                                               "tie_embeddings": tie})):
            meta = build_model(config, device="meta")
            assert {t.device.type for t in [*meta.parameters(), *meta.buffers()]} == {"meta"}
            for dtype in (torch.float64, torch.bfloat16):
                assert {p.dtype for p in build_model(config, dtype=dtype).parameters()} == {dtype}


@pytest.mark.parametrize("rows", [1, 3])
def test_the_static_step_gives_every_row_the_logits_of_decoding_it_alone(rows):
    """DecodeStep over an encoder-decoder, eager, in float64: rows whose sources and targets differ in
    length (and an idle row) in one fixed shape. Each row's next-token logits are those of decoding
    its target over its own source, uncached: a row's unused source positions are masked (without the
    step's memory mask, zero keys took part in every row's cross-attention)."""
    from lm.generate import DecodeStep, StaticSeq2SeqCache

    torch.manual_seed(0)
    model = build_model(_config()).double().eval()
    bos = model.config.bos_id
    sources = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]][:rows]
    targets = [[bos, 20, 21], [bos], [bos, 22, 23, 24, 25]][:rows]  # decoded into the cache first
    nexts = [30, 31, 32][:rows]  # the tokens the step decodes
    step = DecodeStep(model, 4)
    assert isinstance(step.cache, StaticSeq2SeqCache)
    with torch.no_grad():
        for b, (src, tgt) in enumerate(zip(sources, targets)):
            one = model.new_cache(1, max_len=len(tgt))
            model.decode(torch.tensor([tgt]), model.encode(torch.tensor([src])), cache=one)
            step.cache.fill_from(b, one)
        logits = step(nexts + [0] * (4 - rows), [len(t) for t in targets] + [0] * (4 - rows))
        for b, (src, tgt, nxt) in enumerate(zip(sources, targets, nexts)):
            alone = model.logits(model.decode(torch.tensor([tgt + [nxt]]), model.encode(torch.tensor([src])))[0, -1])
            torch.testing.assert_close(logits[b], alone, atol=1e-12, rtol=1e-12)


def test_the_static_cache_takes_any_row_of_a_batched_cache_and_a_source_as_long_as_it_holds():
    """StaticSeq2SeqCache.fill_from(row, cache, source_row) copies that row of a batched cache (its
    decoder and cross-attention keys and values), swapped here; a source of exactly the cache's
    positions fits, one more is refused naming both counts."""
    from lm.generate import DecodeStep, StaticSeq2SeqCache

    torch.manual_seed(0)
    model = build_model(_config()).double().eval()
    bos, ctx = model.config.bos_id, model.config.context_length
    sources = [[5, 6, 7, 8], [9, 10, 11, 12]]  # of one length: a batched cache holds no padding
    targets, nexts = [[bos, 20], [bos, 21]], [30, 31]
    with torch.no_grad():
        two = model.new_cache(2, max_len=2)
        model.decode(torch.tensor(targets), model.encode(torch.tensor(sources)), cache=two)
        step = DecodeStep(model, 2)
        step.cache.fill_from(0, two, source_row=1)
        step.cache.fill_from(1, two, source_row=0)
        logits = step(nexts[::-1], [2, 2])
        for b, k in enumerate((1, 0)):
            alone = model.logits(model.decode(torch.tensor([targets[k] + [nexts[k]]]),
                                              model.encode(torch.tensor([sources[k]])))[0, -1])
            torch.testing.assert_close(logits[b], alone, atol=1e-12, rtol=1e-12)
        whole = list(range(3, 3 + ctx))  # a source of the whole context
        one = model.new_cache(1, max_len=1)
        model.decode(torch.tensor([[bos]]), model.encode(torch.tensor([whole])), cache=one)
        step.cache.fill_from(0, one)
        assert int(step.cache.source_lengths[0]) == ctx
        small = StaticSeq2SeqCache.for_model(model, 1, max_len=ctx - 1)
        with pytest.raises(ValueError, match=rf"^source: {ctx} positions, the cache holds {ctx - 1}$"):
            small.fill_from(0, one)


def test_ids_are_checked_like_the_decoder_only_model():
    """encode, decode and forward refuse ids outside the vocabulary as TransformerLM does (before,
    -1 read the last embedding row and 53 raised a bare IndexError), by two reads from the device
    that trusted_ids() skips: decoding checks the sources on the host and reads only its choices."""
    from helpers.host_reads import HostReads

    from lm.generate import DecodeStep, greedy_decode
    from lm.generate.seq2seq import max_target_length

    torch.manual_seed(0)
    model = build_model(_config()).eval()
    good = torch.tensor([[5, 52]])
    for bad, got in (([[-1, 5]], -1), ([[5, 53]], 53)):
        with pytest.raises(ValueError, match=rf"src must be in \[0, vocab_size=53\), got id {got}$"):
            model.encode(torch.tensor(bad))
        with pytest.raises(ValueError, match=rf"tgt must be in \[0, vocab_size=53\), got id {got}$"):
            model.decode(torch.tensor(bad), model.encode(good))
        with pytest.raises(ValueError, match="src must be in"):
            model(torch.tensor(bad), good)
        with pytest.raises(ValueError, match="tgt must be in"):
            model(good, torch.tensor(bad))
    with pytest.raises(ValueError, match="src must be an integer tensor, got dtype torch.float32"):
        model.encode(torch.zeros(1, 2))
    with HostReads() as plain:
        memory = model.encode(good)
    assert plain.reads == ["__int__", "__int__"] and model.validate_ids
    with model.trusted_ids(), HostReads() as trusted:
        again = model.encode(good)
    torch.testing.assert_close(again, memory, atol=0, rtol=0)
    assert trusted.reads == [] and model.validate_ids
    with HostReads() as decoding:
        out = greedy_decode(model, [[5, 6, 7]], max_extra=2)
        DecodeStep(model, 2)([4, 5], [0, 0])
    # the chosen ids, a list a step: a step for each target token, and one for its <eos> unless the
    # target reached its limit (the count had taken the limit for granted: a model drawn after other
    # tests, from another state of torch's generator, ended a target early and failed the test)
    steps = min(len(out[0]) + 1, max_target_length(model, 3, 2))
    assert decoding.reads == ["tolist"] * steps
    with pytest.raises(ValueError, match=r"source 0: id 53 is outside \[0, vocab_size=53\)"):
        greedy_decode(model, [[5, 53]])


def test_decoders_refuse_sources_and_banned_ids_that_are_not_integers():
    """greedy_decode, beam_search and translate took a source through int(): 5.7 ran as 5, "5" and True as
    5 and 1, and banned_ids=[3.9] banned 3 (apifuzz19); generate() refuses the same ids. A flat list (one
    source, not a batch) was "'int' object is not iterable"."""
    import numpy as np

    from lm.generate import beam_search, greedy_decode, translate

    model = build_model(_config()).eval()
    for call, message in [
        (lambda: greedy_decode(model, [[5.7, 6, 7]]), r"^source 0: token ids must be integers, got 5\.7$"),
        (lambda: greedy_decode(model, [[5, 6], ["5", 6]]), r"^source 1: token ids must be integers, got '5'$"),
        (lambda: greedy_decode(model, [[5, True]]), r"^source 0: token ids must be integers, got True$"),
        (lambda: greedy_decode(model, torch.tensor([[5.5, 6.0]])), r"^source 0: token ids must be integers, got a "
                                                                   r"tensor of torch\.float32$"),
        (lambda: beam_search(model, [[5.9, 6]], beam_size=2), r"^source 0: token ids must be integers, got 5\.9$"),
        (lambda: translate(model, [[5.9, 6]]), r"^source 0: token ids must be integers, got 5\.9$"),
        (lambda: greedy_decode(model, [[5, 6]], banned_ids=[3.9]), r"^banned_ids: ids must be integers, got 3\.9$"),
        (lambda: greedy_decode(model, [5, 6, 7]), r"^src_ids must be a batch of sources \(a list of lists of ids\), "
                                                  r"got a list holding 5 \(one source\? pass \[ids\]\)$"),
        (lambda: greedy_decode(model, torch.tensor([5, 6])), r"^src_ids must be a batch of sources \(2-D\), got "
                                                             r"shape \(2,\)$"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    want = greedy_decode(model, [[5, 6, 7]], max_extra=3, banned_ids=[3])
    for src in (torch.tensor([[5, 6, 7]]), np.array([[5, 6, 7]]), [np.array([5, 6, 7])], [[np.int64(5), 6, 7]]):
        assert greedy_decode(model, src, max_extra=3, banned_ids=[np.int64(3)]) == want
    assert greedy_decode(model, [[5, 6, 7]], max_extra=3, banned_ids=[torch.tensor(3)]) == want


def test_decode_without_memory_or_a_cache_holding_it_raises():
    """decode(tgt, None) ran every cross-attention as non-causal self-attention over the target
    (position 0 saw target token 2); with a fresh cache it failed deep in einops. Once a cache
    holds the memory's keys and values, None is what incremental decoding passes."""
    model = build_model(_config()).eval()
    src, tgt = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]])
    with pytest.raises(ValueError, match=r"^memory is required unless cache already holds the memory's keys and "
                                         r"values$"):
        model.decode(tgt, None)
    with pytest.raises(ValueError, match=r"^context \(the memory\) is required: cross_cache holds no keys"):
        model.decode(tgt, None, cache=model.new_cache(1))
    memory = model.encode(src)
    full = model.decode(tgt, memory)
    cache = model.new_cache(1)
    steps = [model.decode(tgt[:, :1], memory, cache=cache), model.decode(tgt[:, 1:], None, cache=cache)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_id_dtypes_and_out_of_range_positions():
    """int8 ids are read (they were refused as "not an integer tensor"); uint16 is refused by name.
    The sinusoidal table is gathered by index_select: position -1 raises instead of reading the
    last row, as the learned table does."""
    model = build_model(_config()).eval()
    src, tgt = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]])
    expected = model(src, tgt)
    torch.testing.assert_close(model(src.to(torch.int8), tgt.to(torch.int8)), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"^src: dtype torch.uint16 is not supported; use int64 \(long\) or int32$"):
        model.encode(src.to(torch.uint16))
    with pytest.raises(ValueError, match=r"^tgt: dtype torch.uint32 is not supported"):
        model.decode(tgt.to(torch.uint32), model.encode(src))
    for positions in ("sinusoidal", "learned"):
        model = build_model(_config(positions=positions)).eval()
        torch.testing.assert_close(model.embed(tgt, "tgt", torch.tensor([21, 22, 23])),
                                   model.embed(tgt, "tgt", torch.arange(24)[-3:]), atol=0, rtol=0)
        bound = "context_length" if positions == "sinusoidal" else "num_embeddings"
        with pytest.raises(IndexError, match=rf"^positions must be in \[0, {bound}=24\), got -1$"):
            model.embed(tgt, "tgt", torch.tensor([0, 1, -1]))


def test_non_embedding_parameters_keep_the_output_projection():
    """As TransformerLM's (and nanoGPT's get_num_params): lookups (untied embeddings, learned
    positions) are left out, the output projection counts, a tied matrix once as that."""
    d, v, s = 32, 53, 24
    for tie in (True, False):
        for positions in ("sinusoidal", "learned"):
            model = build_model(_config(tie_embeddings=tie, positions=positions))
            lookups = (0 if tie else 2 * v * d) + (2 * s * d if positions == "learned" else 0)
            assert model.num_parameters(include_embeddings=False) == model.num_parameters() - lookups
            assert model.num_parameters() == sum(p.numel() for p in model.parameters())
            if tie:
                assert model.num_parameters(include_embeddings=False) >= v * d


@pytest.mark.parametrize("positions", ["learned", "rope", "none"])
def test_variants_train(positions):
    torch.manual_seed(0)
    model = build_model(_config(positions=positions, ffn="swiglu" if positions == "rope" else "relu"))
    src, src_mask = _ragged([6, 3], 6, 53, seed=6)
    tgt, tgt_mask = _ragged([5, 2], 5, 53, seed=7)
    batch = SimpleNamespace(src=src, src_mask=src_mask, tgt_in=tgt, tgt_out=tgt, tgt_mask=tgt_mask)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(batch=batch)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_the_readmes_encoder_decoder_snippet_runs_as_written():
    """readme8: the README's snippet used src, src_mask, tgt_in, tgt_mask and batch without making them
    (a NameError when pasted). It runs as written now; its shapes and loss are the model's own."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    [snippet] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "model.encode(src" in b]
    names: dict = {}
    torch.manual_seed(0)
    exec(compile(snippet, "README.md", "exec"), names)
    model, batch = names["model"], names["batch"]
    assert names["memory"].shape == (*batch.src.shape, model.config.d_model)
    assert names["hidden"].shape == (*batch.tgt_in.shape, model.config.d_model)
    assert names["loss"].ndim == 0 and 0 < float(names["loss"]) < 2 * math.log(8000)  # dropout on: train mode


def test_decoders_take_iterables_of_ids_and_numpy_counts():
    """review19: a source given as any iterable of ids (a map, an iterator) had worked before the
    sources were checked, and beam_size/max_extra refused numpy's integers that generate() takes."""
    import numpy as np

    from lm.generate import beam_search, greedy_decode, translate

    model = build_model(_config()).eval()
    want = greedy_decode(model, [[5, 6, 7]], max_extra=2)
    assert greedy_decode(model, [iter([5, 6, 7])], max_extra=np.int64(2)) == want
    assert beam_search(model, [map(int, "567")], beam_size=np.int64(2), max_extra=2) == \
        beam_search(model, [[5, 6, 7]], beam_size=2, max_extra=2)
    assert translate(model, [(5, 6, 7)], beam_size=np.int32(1), max_extra=2) == want


@pytest.mark.parametrize("ffn", ["relu", "swiglu"])
def test_seq2seq_flops_per_token_is_torchs_count(ffn):
    """The encoder–decoder's flops_per_token (a translation run's MFU) had no test (testq22): torch's
    FlopCounterMode over a forward with hand-written attention, a source as long as the target."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = Seq2SeqConfig(vocab_size=100, context_length=32, d_model=64, encoder_layers=2, decoder_layers=3, num_heads=4,
                        d_ff=128, dropout=0.0, ffn=ffn, attn_impl="einsum")
    model = EncoderDecoder(cfg).eval()
    for s in (32, 9):
        src, tgt = torch.randint(3, 100, (1, s)), torch.randint(3, 100, (1, s))
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            model(src, tgt)
        assert fc.get_total_flops() == model.flops_per_token(seq_len=s) * s


def test_embeddings_plus_positions_are_dropped_out_in_training_on_both_sides():
    """Vaswani et al. 5.4: dropout on the sums of the embeddings and the positional encodings, in both
    stacks (mut22b: removing it passed every test, which all run without dropout)."""
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=53, context_length=24, d_model=32, encoder_layers=1, decoder_layers=1,
                        num_heads=4, d_ff=64, dropout=0.5)
    model = build_model(cfg)
    ids, pos = torch.randint(3, 53, (8, 24)), torch.arange(24)
    for side in ("src", "tgt"):
        model.eval()
        plain = model.embed(ids, side, pos)
        model.train()
        dropped = model.embed(ids, side, pos)
        zero = dropped == 0
        assert 0.45 < zero.float().mean().item() < 0.55, side  # 6,144 draws: 0.5 +- 0.02 (3 sigma)
        torch.testing.assert_close(dropped[~zero], 2 * plain[~zero])  # inverted dropout: kept ones / (1 - p)


def _sites(layer, kind: str, pre: bool):
    """(module, "input"|"output") pairs naming, for each residual branch of ``layer``, the stream
    before the branch, the branch's output and the stream after it (before any post-norm)."""
    branches = [layer.attn, layer.ffn] if kind == "encoder" else [layer.self_attn, layer.cross_attn, layer.ffn]
    norms = [layer.ln1, layer.ln2] if kind == "encoder" else [layer.ln1, layer.ln2, layer.ln3]
    sites = []
    for i, (branch, norm) in enumerate(zip(branches, norms)):
        if pre:  # x + branch(norm(x)): before is this norm's input, after the next norm's (or the layer's output)
            before = (norm, "input")
            after = (norms[i + 1], "input") if i + 1 < len(norms) else (layer, "output")
        else:  # norm(x + branch(x)): before is the previous norm's output (or the layer's input), after its input
            before = (norms[i - 1], "output") if i else (layer, "input")
            after = (norm, "input")
        sites.append((before, (branch, "output"), after))
    return sites


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_every_residual_branch_is_dropped_out_in_training_in_both_stacks(placement):
    """Vaswani et al. 5.4: "we apply dropout to the output of each sub-layer, before it is added to the
    sub-layer input". Seen from forward hooks, in every encoder and decoder layer each stream after a
    branch is the stream before it plus the branch's output with about p of its elements zeroed and
    the others scaled by 1/(1-p); the tests had only checked the embeddings' dropout, so removing the
    dropout of the decoder's feed-forward, of its self-attention or of the encoder's feed-forward
    (mut24a B11, B12, B15) passed them all."""
    torch.manual_seed(0)
    p = 0.3
    model = build_model(_config(encoder_layers=1, decoder_layers=1, dropout=p, norm_placement=placement))
    model.train()
    seen, handles, wanted = {}, [], []
    for kind, layer in (("encoder", model.encoder[0]), ("decoder", model.decoder[0])):
        for triple in _sites(layer, kind, placement == "pre"):
            wanted.append(triple)
            for module, what in triple:
                key = (id(module), what)
                if key in seen:
                    continue
                seen[key] = None

                def hook(mod, args, output, key=key, what=what):
                    seen[key] = (args[0] if what == "input" else output).detach()
                handles.append(module.register_forward_hook(hook))
    src, tgt = torch.randint(3, 53, (8, 24)), torch.randint(3, 53, (8, 24))
    model(src, tgt)
    for h in handles:
        h.remove()
    assert len(wanted) == 5
    for before, branch, after in wanted:
        before, branch, after = (seen[(id(m), w)] for m, w in (before, branch, after))
        added, big = after - before, branch.abs() > 1e-2
        dropped = added.abs() <= 1e-5 * branch.abs().clamp(min=1)
        assert 0.2 < dropped[big].float().mean() < 0.4  # p = 0.3 over about 6,000 elements
        torch.testing.assert_close(added[big & ~dropped], branch[big & ~dropped] / (1 - p), rtol=1e-4, atol=1e-5)
    model.eval()  # and none in evaluation: the same weights with dropout 0
    plain = build_model(_config(encoder_layers=1, decoder_layers=1, dropout=0.0, norm_placement=placement))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(src, tgt), plain(src, tgt), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_embeddings_start_at_fairseqs_scale(tied):
    """The embedding tables (tied or not) start with σ = d_model^-0.5, as fairseq's, so that the √d
    scale makes the embedded tokens unit-sized; the untied tables had kept Embedding's σ = 1 with the
    init removed (mut24a S3), and the model's first logits were √d times too large."""
    torch.manual_seed(0)
    d = 64
    model = build_model(_config(vocab_size=2000, d_model=d, tie_embeddings=tied))
    tables = [model.embeddings] if tied else [model.src_embeddings, model.tgt_embeddings]
    for table in tables:
        std = table.weight.std().item()  # 128,000 draws: within 1% of the target
        assert abs(std - d**-0.5) < 0.02 * d**-0.5, std


def test_loss_takes_the_label_smoothing_it_is_given_over_the_configs():
    """loss(batch, label_smoothing=0.0) is what the trainer's evaluation and lm eval report (the plain
    loss, the paper's perplexity); with the argument ignored (mut24a S8) they reported the
    label-smoothed loss of the config, about 0.1 × the logits' spread higher, and no test saw it."""
    torch.manual_seed(0)
    model = build_model(_config(label_smoothing=0.1)).eval()
    src, src_mask = _ragged([9, 4, 7], 9, 53, seed=1)
    tgt, tgt_mask = _ragged([6, 6, 2], 6, 53, seed=2)
    tgt_out, _ = _ragged([6, 6, 2], 6, 53, seed=3)
    batch = SimpleNamespace(src=src, src_mask=src_mask, tgt_in=tgt, tgt_out=tgt_out, tgt_mask=tgt_mask)
    with torch.no_grad():
        logits = model(src, tgt, src_mask, tgt_mask)
        for eps in (0.0, 0.1, 0.25):
            want = F.cross_entropy(logits[tgt_mask], tgt_out[tgt_mask], label_smoothing=eps)
            torch.testing.assert_close(model.loss(batch, label_smoothing=eps), want)
        torch.testing.assert_close(model.loss(batch), F.cross_entropy(logits[tgt_mask], tgt_out[tgt_mask],
                                                                      label_smoothing=0.1))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"eos_id": 53}, r"^eos_id must be an id in \[0, vocab_size=53\), got 53$"),  # one past the last embedding row
    ({"pad_id": 53, "bos_id": 1}, r"^pad_id must be an id in \[0, vocab_size=53\), got 53$"),
    ({"dropout": 1.0}, r"^dropout must be a number in \[0, 1\), got 1.0$"),  # every activation zeroed, 1/(1-p) = inf
    ({"label_smoothing": 1.0}, r"^label_smoothing must be a number in \[0, 1\), got 1.0$"),
    ({"dropout": False}, r"^dropout must be a number in \[0, 1\), got False$"),  # a bool is no rate, False too
    ({"label_smoothing": False}, r"^label_smoothing must be a number in \[0, 1\), got False$"),
    ({"architecture": "decoder_lm"}, r"^architecture must be 'encoder_decoder' for this config, got 'decoder_lm'$"),
])
def test_boundary_values_of_the_config_are_refused(kwargs, match):
    """The upper bounds of the config's checks, at the boundary (mut24a S13, S14, S16): an <eos> id equal
    to vocab_size indexes past the embedding, dropout 1 zeroes everything and divides by 0, and a
    Seq2SeqConfig saying it is a decoder_lm is built as a TransformerLM when its checkpoint is read."""
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


def test_an_unbatched_source_and_target_are_one_row_of_a_batch():
    """1-D ids (one sentence, as TransformerLM takes one sequence) give the batch's one row (to float32
    rounding: the matrix products take other kernels at other shapes), and are length-checked alike
    (mutation: the length read as shape[1] survived; it fails on 1-D ids)."""
    model = build_model(_config()).eval()
    src, tgt = torch.tensor([5, 6, 7, 2]), torch.tensor([1, 8, 9])
    with torch.no_grad():
        torch.testing.assert_close(model.encode(src), model.encode(src[None])[0])  # float32's tolerances
        torch.testing.assert_close(model(src, tgt), model(src[None], tgt[None])[0])
    with pytest.raises(ValueError, match=r"^source length 30 exceeds context_length=24$"):
        model.encode(torch.arange(30) % 50 + 3)
    with pytest.raises(ValueError, match=r"^target length 25 exceeds context_length=24$"):
        model(src, torch.arange(25) % 50 + 3)


def test_a_cached_decode_past_context_length_is_refused_counting_the_cache():
    """decode with a cache counts the cached positions against context_length, as TransformerLM does:
    with the offset dropped (mut24a S20), 20 cached + 10 new positions of a 24-position model went
    through the length check, to fail (or not) wherever the cache or the position table ran out."""
    model = build_model(_config()).eval()
    src = torch.tensor([[5, 6, 7, 2]])
    memory = model.encode(src)
    cache = model.new_cache(1, max_len=40)
    model.decode(torch.randint(3, 53, (1, 20)), memory, cache=cache)
    with pytest.raises(ValueError, match=r"^target length 30 exceeds context_length=24$"):
        model.decode(torch.randint(3, 53, (1, 10)), None, cache=cache)


def test_a_seq2seq_cache_keeps_its_rows_padding_as_a_kv_cache_does():
    """Seq2SeqCache takes ``pad_lengths`` as the KVCache it extends does (KVCache.for_model passes them;
    mutation: dropped on the way to KVCache, survived): a row's positions start at its first real token,
    and its padding slots are masked."""
    from lm.generate.kv_cache import KVCache
    from lm.generate.seq2seq import Seq2SeqCache

    for cls in (KVCache, Seq2SeqCache):
        cache = cls(1, 2, 2, 4, 8, pad_lengths=[2, 0])
        assert cache.start_step(3).tolist() == [[0, 0, 0], [0, 1, 2]], cls
        assert cache.step_mask is not None and cache.step_mask[0, 0, 2].tolist() == [False, False, True], cls


def test_the_encoder_decoders_argument_errors_name_the_argument_and_list_the_special_tokens():
    """A dtype that is no floating dtype, an embed side that is neither stack's, and special ids that
    are not the tokenizer's special tokens (which are listed, or "none")."""
    cfg = Seq2SeqConfig(vocab_size=20, context_length=8, d_model=8, encoder_layers=1, decoder_layers=1, num_heads=2,
                        d_ff=16)
    for build in (build_model, EncoderDecoder):  # the class itself too, not only build_model
        with pytest.raises(ValueError) as e:
            build(cfg, dtype=torch.int64)
        assert str(e.value) == ("dtype must be a torch floating dtype such as torch.bfloat16 or None, got "
                                "dtype=torch.int64")
    model = build_model(cfg)
    with pytest.raises(ValueError) as e:
        model.embed(torch.tensor([[1]]), "source", torch.arange(1))
    assert str(e.value) == "side must be one of ('src', 'tgt'), got 'source'"
    assert cfg.special_ids_problem({"<s>": 5, "</s>": 6}) == (
        "pad_id 0 is not a special token of the tokenizer (its special tokens: <s> 5, </s> 6)")
    assert cfg.special_ids_problem({}, "model.", "'tok'") == (
        "model.pad_id 0 is not a special token of 'tok' (its special tokens: none)")
    assert cfg.special_ids_problem({"<pad>": 0, "<bos>": 1, "<eos>": 2}) is None

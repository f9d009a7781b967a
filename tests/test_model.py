"""TransformerLM: state-dict contract, variants, config round-trip, reference parity
(stored fixtures, independent formulas, Hugging Face Llama), causality, accounting, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.host_reads import HostReads
from helpers.model_reference import half_to_interleaved, transformer_lm_ref

from lm.export import to_llama_state_dict, to_transformers
from lm.export.hf import interleaved_to_half as lm_interleaved_to_half
from lm.model import ModelConfig, TransformerLM, sinusoidal_table
from lm.nn import cross_entropy

FIXTURE = Path(__file__).parent / "fixtures" / "model_small.safetensors"
SMALL = dict(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48, rope_theta=10000.0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def small_model(**variant) -> TransformerLM:
    return TransformerLM(**SMALL, **variant)


def randomise_norms(model: TransformerLM) -> None:
    """Norm weights start at 1 (and biases at 0); perturb them so parity tests see them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))


def expected_keys(num_layers: int) -> list[str]:
    keys = ["token_embeddings.weight"]
    for i in range(num_layers):
        keys += [
            f"layers.{i}.ln1.weight",
            f"layers.{i}.attn.q_proj.weight",
            f"layers.{i}.attn.k_proj.weight",
            f"layers.{i}.attn.v_proj.weight",
            f"layers.{i}.attn.output_proj.weight",
            f"layers.{i}.ln2.weight",
            f"layers.{i}.ffn.w1.weight",
            f"layers.{i}.ffn.w2.weight",
            f"layers.{i}.ffn.w3.weight",
        ]
    return keys + ["ln_final.weight", "lm_head.weight"]


def test_state_dict_keys_and_shapes_exactly():
    model = TransformerLM(100, 32, 64, 3, 4, 128, 10000.0)
    sd = model.state_dict()
    assert list(sd) == expected_keys(3)
    assert sd["layers.0.ffn.w1.weight"].shape == (128, 64)
    assert sd["layers.0.ffn.w2.weight"].shape == (64, 128)
    assert sd["lm_head.weight"].shape == (100, 64)
    assert sd["token_embeddings.weight"].shape == (100, 64)
    assert model(torch.randint(0, 100, (2, 32))).shape == (2, 32, 100)


def test_matches_stored_fixture():
    from safetensors.torch import load_file

    t = load_file(str(FIXTURE))
    cfg = ModelConfig(**SMALL)
    model = TransformerLM.from_config(cfg)
    model.load_state_dict({k.removeprefix("weights."): v for k, v in t.items() if k.startswith("weights.")})
    logits = model(t["input_ids"])
    torch.testing.assert_close(logits, t["logits"], atol=1e-5, rtol=1e-5)
    loss = cross_entropy(logits[:, :-1], t["input_ids"][:, 1:])
    torch.testing.assert_close(loss, t["loss"], atol=1e-6, rtol=1e-6)
    from lm.generate import generate

    for impl in ("einsum", "sdpa"):  # the default is sdpa: build each one by name
        other = TransformerLM.from_config(ModelConfig(**SMALL, attn_impl=impl))
        other.load_state_dict(model.state_dict())
        assert other.layers[0].attn.attn_impl == impl
        torch.testing.assert_close(other(t["input_ids"]), t["logits"], atol=1e-5, rtol=1e-5)
        tokens = generate(other, t["greedy_prompt"].tolist(), len(t["greedy_tokens"]), temperature=0)
        assert tokens == t["greedy_tokens"].tolist(), impl


VARIANTS = [
    {},
    {
        "norm": "layernorm",
        "norm_placement": "post",
        "positions": "sinusoidal",
        "ffn": "relu",
    },  # Vaswani et al.
    {"norm": "layernorm", "positions": "learned", "ffn": "gelu"},
    {"norm": "none", "positions": "none", "ffn": "silu"},
    {"norm_placement": "post", "positions": "learned", "ffn": "swiglu"},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())) or "default")
@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
def test_variants_match_independent_formula(variant, attn_impl):
    model = small_model(attn_impl=attn_impl, **variant)
    randomise_norms(model)
    ids = torch.randint(0, 64, (3, 16))
    expected = transformer_lm_ref(dict(model.state_dict()), ids, 2, 4, 10000.0, **{k: v for k, v in variant.items()})
    torch.testing.assert_close(model(ids), expected, atol=2e-5, rtol=2e-5)


def test_variant_state_dicts():
    assert "ln_final.weight" not in small_model(norm_placement="post").state_dict()
    sd = small_model(norm="layernorm", positions="learned").state_dict()
    assert "layers.0.ln1.bias" in sd and sd["position_embeddings.weight"].shape == (16, 32)
    assert not any("ln" in k for k in small_model(norm="none").state_dict())
    assert list(small_model(positions="sinusoidal").state_dict()) == expected_keys(2)


def test_tied_embeddings_share_one_matrix():
    model = small_model(tie_embeddings=True)
    assert model.lm_head.weight is model.token_embeddings.weight
    untied = small_model()
    assert model.num_parameters() == untied.num_parameters() - 64 * 32
    ids = torch.randint(0, 64, (2, 8))
    model(ids).sum().backward()
    assert model.lm_head.weight.grad is not None


def test_config_round_trips_json_and_toml(tmp_path):
    cfg = ModelConfig(1000, 128, 64, 2, 4, norm="layernorm", positions="learned", ffn="gelu", tie_embeddings=True)
    assert cfg.d_ff == 256
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig.from_toml(cfg.to_toml()) == cfg
    for suffix in (".json", ".toml"):
        cfg.save(tmp_path / f"model{suffix}")
        assert ModelConfig.load(tmp_path / f"model{suffix}") == cfg
    assert ModelConfig(1000, 128, 256, 2, 4).d_ff == 704  # swiglu: 8/3·d rounded up to 64
    model = TransformerLM.from_config(cfg)
    assert model.config == cfg
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    assert json.loads(cfg.to_json())["norm"] == "layernorm"
    # config.json is for people too (Hugging Face's config.json is as readable): one field a line, indented
    # (mutation: indent=None, one long line, survived)
    lines = (tmp_path / "model.json").read_text().splitlines()
    assert lines[0] == "{" and lines[1] == '  "vocab_size": 1000,' and len(lines) == len(cfg.to_dict()) + 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_heads": 5}, "num_heads=5"),
        ({"d_model": 36, "num_heads": 4}, "RoPE.*9"),
        ({"norm": "batchnorm"}, "'batchnorm'"),
        ({"norm_placement": "sandwich"}, "'sandwich'"),
        ({"positions": "alibi"}, "'alibi'"),
        ({"ffn": "geglu"}, "'geglu'"),
        ({"attn_impl": "flash"}, "'flash'"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"norm_eps": -1.0}, r"norm_eps must be a finite number > 0, got -1.0"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"norm_eps": float("inf")}, "norm_eps"),
        ({"norm_eps": "1e-5"}, "norm_eps"),
        # NaN and inf passed `rope_theta <= 0`; a string raised a TypeError; "no" tied the weights
        ({"rope_theta": float("nan")}, r"^rope_theta must be a positive finite number, got nan$"),
        ({"rope_theta": float("inf")}, r"^rope_theta must be a positive finite number, got inf$"),
        ({"rope_theta": 0.0}, r"^rope_theta must be a positive finite number, got 0.0$"),
        ({"rope_theta": -1}, "rope_theta.*-1"),
        ({"rope_theta": "1e4"}, "rope_theta.*'1e4'"),
        ({"rope_theta": True}, "rope_theta.*True"),
        ({"tie_embeddings": "no"}, r"^tie_embeddings must be a bool, got 'no'$"),
        ({"tie_embeddings": 1}, "tie_embeddings.*1"),
        ({"tie_embeddings": None}, "tie_embeddings.*None"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**SMALL, **kwargs})


@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
def test_odd_head_dim_without_rope_matches_the_formula(attn_impl):
    """head dim 36 / 4 = 9 (odd): no RoPE pairs needed, and the model is still the formula (the test
    had only built it: testq22)."""
    torch.manual_seed(0)
    model = TransformerLM(64, 16, 36, 1, 4, 48, positions="none", attn_impl=attn_impl).eval()
    ids = torch.randint(0, 64, (3, 16))
    expected = transformer_lm_ref({k: v.double() for k, v in model.state_dict().items()}, ids, 1, 4,
                                  positions="none").float()
    torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)  # 9.5e-7 measured


def test_bad_ids_raise():
    model = small_model()
    for ids, bad in (([[1, 64]], 64), ([[0, 64]], 64), ([[-1, 3]], -1), ([[-1, 64]], -1)):  # the id out of range
        with pytest.raises(ValueError, match=rf"^ids must be in \[0, vocab_size=64\), got id {bad}$"):
            model(torch.tensor(ids))
    with pytest.raises(ValueError, match="17.*context_length=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="float"):
        model(torch.zeros(1, 4))


def test_loss_checks_targets_like_ids():
    """An out-of-range target raised the gather's "index 64 is out of bounds for dimension 1 with size
    64"; -100 (transformers' "ignore") the same. Now a ValueError naming targets, from the same host
    check as the ids (two reads more), skipped under trusted_ids and by the trainer."""
    model = small_model()
    ids = torch.randint(0, 64, (2, 8))
    for bad in (64, -1, -100):
        targets = ids.clone()
        targets[1, 3] = bad
        message = rf"^targets must be in \[0, vocab_size=64\), got target {bad}$"
        with pytest.raises(ValueError, match=message):
            model.loss(ids, targets)
        with pytest.raises(ValueError, match=message):
            model(ids, targets=targets)
    with HostReads() as reads:
        loss = model.loss(ids, ids)
    assert reads.reads == ["__int__"] * 4  # the targets' min and max, the ids'
    with model.trusted_ids(), HostReads() as trusted:
        again = model.loss(ids, ids)
    assert trusted.reads == []
    torch.testing.assert_close(again, loss, atol=0, rtol=0)


@pytest.mark.parametrize("positions", ["rope", "learned", "sinusoidal"])
def test_token_positions_are_checked_like_ids(positions):
    """Out-of-range positions were read from the end of the tables (-1 gave the logits of 15) or
    raised a bare IndexError; now a ValueError naming token_positions, on the host check of the ids
    (skipped under trusted_ids). In-range positions give the independent formula's logits."""
    model = small_model(positions=positions)
    ids = torch.tensor([[5, 9]])
    for bad, got in (([[-1, 0]], -1), ([[16, 17]], 17), ([3, 16], 16)):
        message = rf"token_positions must be in \[0, context_length=16\), got position {got}$"
        with pytest.raises(ValueError, match=message):
            model(ids, torch.tensor(bad))
        with pytest.raises(ValueError, match="token_positions"):
            model.loss(ids, ids, torch.tensor(bad))
    for kind in (ValueError, TypeError):  # a wrong dtype is both, whether the model or a layer finds it
        with pytest.raises(kind, match="token_positions must be an integer tensor, got dtype torch.float32"):
            model(ids, torch.tensor([0.0, 1.0]))
        with pytest.raises(kind, match="ids must be an integer tensor, got dtype torch.float32"):
            model(torch.tensor([[5.0, 9.0]]))
        with pytest.raises(kind, match="targets must be an integer tensor, got dtype torch.float32"):
            model.loss(ids, torch.tensor([[5.0, 9.0]]))
    with pytest.raises(ValueError, match=r"token_positions must end in the sequence dimension of ids \(2\)"):
        model(ids, torch.tensor([0, 1, 2]))
    with HostReads() as reads:
        logits = model(ids, torch.tensor([[0, 1]]))
    assert reads.reads == ["__int__"] * 4  # the ids' min and max, the positions'
    expected = transformer_lm_ref(dict(model.state_dict()), ids, 2, 4, positions=positions)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(model(ids, torch.arange(2)), logits, atol=0, rtol=0)
    with model.trusted_ids(), HostReads() as trusted:
        model(ids, torch.tensor([[0, 1]]))
    assert trusted.reads == []


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope"])
def test_out_of_range_positions_raise_under_trusted_ids(positions):
    """Unchecked (trusted_ids), position -1 must not read the table's last row: the sinusoidal
    table was indexed with [] (the logits of position 15); every table now gathers by
    index_select, which raises, as the learned and RoPE tables did, with no host read. The error
    names token_positions, the table's bound and the position (the kernel's "index out of range in
    self" had named none), read only after the kernel failed."""
    model = small_model(positions=positions).eval()
    ids = torch.tensor([[5, 9]])
    bound = {"sinusoidal": "context_length", "learned": "num_embeddings", "rope": "max_seq_len"}[positions]
    with model.trusted_ids():
        for bad in (-1, 16):
            with pytest.raises(IndexError, match=rf"^token_positions must be in \[0, {bound}=16\), got {bad}$"):
                model(ids, torch.tensor([[0, bad]]))
        with HostReads() as reads:
            model(ids, torch.tensor([[0, 15]]))
    assert reads.reads == []


def test_id_dtypes_are_read_or_refused_by_name():
    """int8 is an integer dtype (it was refused as "not an integer tensor") and gives the int64
    logits; uint16, uint32 and uint64 have no min/max in torch (uint16 targets raised a bare
    NotImplementedError): refused, naming the argument and the dtype."""
    model = small_model(positions="learned")
    ids = torch.tensor([[5, 9, 3]])
    logits = model(ids)
    torch.testing.assert_close(model(ids.to(torch.int8), torch.arange(3, dtype=torch.int8)), logits, atol=0, rtol=0)
    torch.testing.assert_close(model.loss(ids.to(torch.int8), ids.to(torch.int8)), model.loss(ids, ids), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"^ids must be in \[0, vocab_size=64\), got id -1$"):
        model(torch.tensor([[5, -1]], dtype=torch.int8))
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        message = rf"dtype {dtype} is not supported; use int64 \(long\) or int32$"
        for kind in (ValueError, TypeError):
            with pytest.raises(kind, match=f"^ids: {message}"):
                model(ids.to(dtype))
            with pytest.raises(kind, match=f"^token_positions: {message}"):
                model(ids, torch.arange(3).to(dtype))
            with pytest.raises(kind, match=f"^targets: {message}"):
                model.loss(ids, ids.to(dtype))


def test_an_empty_sequence_gives_empty_logits_on_both_attention_impls():
    """attn_impl changes no result: the einsum path raised IndexError on zero keys, sdpa gave (1, 0, vocab)."""
    for impl in ("einsum", "sdpa"):
        assert small_model(attn_impl=impl)(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 64)


def test_a_float64_model_has_a_float64_position_table_as_ropes_tables():
    """numerics20: model.double() widened the float32 table (off by up to 3e-8 from the float64
    formula) where RoPE rebuilds its tables from the angles; now both are float64-exact, a bfloat16
    model keeps a float32 table (as RoPE's), and a move back to float32 gives the float32 table again."""
    from lm.model import Seq2SeqConfig, build_model

    pos = torch.arange(512, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    reference = torch.stack([pos.sin(), pos.cos()], -1).flatten(-2)  # float64 to its rounding (angles up to 511)
    exact = sinusoidal_table(512, 64, dtype=torch.float64)
    assert exact.dtype == torch.float64 and (exact - reference).abs().max() < 1e-12
    assert (exact.float().double() - reference).abs().max() > 1e-8  # what widening the float32 table gave
    lm_model = TransformerLM(vocab_size=30, context_length=512, d_model=64, num_layers=1, num_heads=2, d_ff=64,
                             positions="sinusoidal")
    seq2seq = build_model(Seq2SeqConfig(vocab_size=30, context_length=512, d_model=64, encoder_layers=1,
                                        decoder_layers=1, num_heads=2, dropout=0.0))
    # built in float64 (the CS336 constructor's dtype): its tables so too, RoPE's as well
    built = [TransformerLM(vocab_size=30, context_length=512, d_model=64, num_layers=1, num_heads=2, d_ff=64,
                           positions=positions, dtype=torch.float64) for positions in ("sinusoidal", "rope")]
    built.append(build_model(Seq2SeqConfig(vocab_size=30, context_length=512, d_model=64, encoder_layers=1,
                                           decoder_layers=1, num_heads=2, dropout=0.0), dtype=torch.float64))
    assert torch.equal(built[0].position_table, exact) and torch.equal(built[2].position_table, exact)
    rope = built[1].layers[0].attn.rope
    assert rope.cos.dtype == torch.float64
    assert torch.equal(rope.cos, TransformerLM(vocab_size=30, context_length=512, d_model=64, num_layers=1, num_heads=2,
                                               d_ff=64).double().layers[0].attn.rope.cos)
    for model in (lm_model, seq2seq):
        assert torch.equal(model.position_table, exact.float())
        assert torch.equal(model.double().position_table, exact)  # rebuilt from the angles, not widened
        assert torch.equal(model.float().position_table, exact.float())
        assert model.to(torch.bfloat16).position_table.dtype == torch.float32
        assert torch.equal(model.position_table, exact.float())


def test_trusted_id_blocks_of_two_threads_leave_the_check_on():
    """Each trusted_ids() block restored what it found: thread A in, thread B in (finding the check off),
    A out (on), B out (off) left a model that never checked its ids again (on a GPU, an id past the
    vocabulary then reads out of bounds instead of raising). The last block to end turns it back on."""
    import threading

    from lm.model import Seq2SeqConfig, build_model

    for model in (TransformerLM(vocab_size=30, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32),
                  build_model(Seq2SeqConfig(vocab_size=30, context_length=8, d_model=16, encoder_layers=1,
                                            decoder_layers=1, num_heads=2, dropout=0.0))):
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        seen = []

        def a(model=model, a_in=a_in, b_in=b_in, a_out=a_out):
            with model.trusted_ids():
                a_in.set()
                b_in.wait(10)
            a_out.set()

        def b(model=model, a_in=a_in, b_in=b_in, a_out=a_out, seen=seen):
            a_in.wait(10)
            with model.trusted_ids():
                b_in.set()
                a_out.wait(10)
                seen.append(model.validate_ids)  # B's block still runs: off
        threads = [threading.Thread(target=f) for f in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert seen == [False] and model.validate_ids is True
        model.validate_ids = False  # the trainer's setting for good: kept through a block
        with model.trusted_ids(), model.trusted_ids():
            pass
        assert model.validate_ids is False


def test_sinusoidal_table_refuses_an_odd_width():
    """An odd d_model gave d_model + 1 columns (the configs refuse it; the public function did not)."""
    assert sinusoidal_table(4, 8).shape == (4, 8)
    with pytest.raises(ValueError, match=r"^d_model must be even for sinusoidal positions, got d_model=7$"):
        sinusoidal_table(4, 7)
    with pytest.raises(ValueError, match=r"^num_positions must be >= 0, got num_positions=-1$"):
        sinusoidal_table(-1, 4)
    assert sinusoidal_table(0, 4).shape == (0, 4)


@pytest.mark.parametrize("variant", [{}, {"positions": "learned"}, {"norm_placement": "post"}])
def test_causality(variant):
    model = small_model(**variant)
    ids = torch.randint(0, 64, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = torch.randint(0, 64, (2, 6))
    torch.testing.assert_close(model(ids)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(ids)[:, 10:], model(changed)[:, 10:])


def test_parameter_counts_and_flops():
    model = TransformerLM(1000, 128, 64, 2, 4, 192)
    emb = 1000 * 64
    per_layer = 4 * 64 * 64 + 3 * 64 * 192 + 2 * 64
    head = 1000 * 64 + 64
    assert model.num_parameters(include_embeddings=False) == 2 * per_layer + head
    assert model.num_parameters() == emb + 2 * per_layer + head
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    matmul = 2 * (4 * 64 * 64 + 3 * 64 * 192) + 64 * 1000
    assert model.flops_per_token() == 2 * matmul + 4 * 2 * 128 * 64
    assert model.flops_per_token(seq_len=1) == 2 * matmul + 4 * 2 * 64
    tied = TransformerLM(1000, 128, 64, 2, 4, 192, tie_embeddings=True, positions="learned")
    assert tied.num_parameters() == emb + 2 * per_layer + 64 + 128 * 64
    # The tied matrix counts once, as the output projection flops_per_token counts (nanoGPT's
    # get_num_params, and EncoderDecoder's): only the learned position table is left out.
    assert tied.num_parameters(include_embeddings=False) == 2 * per_layer + head
    assert model.estimate_mfu(1000.0, 1e12) == pytest.approx(3 * model.flops_per_token() * 1000 / 1e12)


def test_bfloat16_model_close_to_float32():
    model = small_model()
    ids = torch.randint(0, 64, (2, 16))
    ref = model(ids)
    model_bf16 = small_model(dtype=torch.bfloat16)
    model_bf16.load_state_dict(model.state_dict())
    out = model_bf16(ids)
    assert out.dtype == torch.bfloat16
    # measured at most 0.0115 of the largest logit over 8 seeds
    assert (out.float() - ref).abs().max() < 0.03 * ref.abs().max()


def test_einsum_and_sdpa_gradients_agree():
    a, b = small_model(attn_impl="einsum"), small_model(attn_impl="sdpa")
    assert a.layers[0].attn.attn_impl == "einsum" and b.layers[0].attn.attn_impl == "sdpa"
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    for m in (a, b):
        cross_entropy(m(ids)[:, :-1], ids[:, 1:]).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        # measured at most 5.2e-8 over 8 seeds (gradients up to about 0.05)
        torch.testing.assert_close(pa.grad, pb.grad, atol=3e-7, rtol=0, msg=name)


def test_torch_compile_matches_eager():
    model = small_model(attn_impl="sdpa")
    ids = torch.randint(0, 64, (2, 16))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(ids), model(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
def test_torch_compile_inductor_matches_eager(attn_impl):
    model = small_model(attn_impl=attn_impl)
    ids = torch.randint(0, 64, (2, 16))
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(ids), model(ids), atol=1e-5, rtol=1e-5)
    cross_entropy(compiled(ids)[:, :-1], ids[:, 1:]).backward()
    assert all(p.grad is not None for p in model.parameters())


# -- Hugging Face Llama parity ------------------------------------------------------------


def llama_from(model: TransformerLM):
    pytest.importorskip("transformers")
    return to_transformers(model)


@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
def test_logits_and_gradients_match_hf_llama(attn_impl):
    model = TransformerLM(256, 64, 64, 2, 4, 160, 10000.0, attn_impl=attn_impl)
    randomise_norms(model)
    hf = llama_from(model)
    ids = torch.randint(0, 256, (2, 64))
    ours = model(ids)
    theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=6e-6, rtol=0)  # measured at most 1.2e-6 over 8 seeds

    cross_entropy(ours[:, :-1], ids[:, 1:]).backward()
    F.cross_entropy(theirs[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    sd_grads = {k: p.grad for k, p in model.named_parameters()}
    mapped = to_llama_state_dict(sd_grads, 2, 4)
    for name, g in mapped.items():
        expected = hf_grads[name]
        torch.testing.assert_close(g, expected, atol=1e-7, rtol=0, msg=name)  # measured at most 1.9e-8, 8 seeds
    # lm's q/k row permutation, row by row: in each head of d rows, Llama's row i is our row 2i and
    # its row i + d/2 our row 2i + 1 (the RoPE pairs (2i, 2i+1) become (i, i + d/2))
    hd = 64 // 4
    for proj in ("q_proj", "k_proj"):
        ours_w = getattr(model.layers[1].attn, proj).weight
        theirs_w = getattr(hf.model.layers[1].self_attn, proj).weight
        for h in range(4):
            for i in range(hd // 2):
                assert torch.equal(theirs_w[h * hd + i], ours_w[h * hd + 2 * i]), (proj, h, i)
                assert torch.equal(theirs_w[h * hd + i + hd // 2], ours_w[h * hd + 2 * i + 1]), (proj, h, i)
    q = model.layers[0].attn.q_proj.weight
    assert torch.equal(half_to_interleaved(lm_interleaved_to_half(q, 4), 4), q)  # the reference inverse undoes lm's


@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
def test_greedy_generation_equals_transformers_generate(attn_impl):
    """The README's claim for bench_model.py: lm's generate (KV cache, greedy) gives the tokens of
    transformers' generate on the exported Llama. A near-tie between the two best logits could let
    float rounding pick either, so the test also shows that none occurs (the smallest gap measured
    on this path is 0.016; the two models' logits differ by about 1e-6)."""
    from lm.generate import generate

    model = TransformerLM(256, 96, 64, 2, 4, 160, 10000.0, attn_impl=attn_impl)
    randomise_norms(model)
    # the prompt from its own generator: drawn after llama_from, it would depend on how the installed
    # transformers initialises a model (another version drew another prompt, with a near-tie in it)
    prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(3))
    hf = llama_from(model).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    n = 88  # prompt + new tokens fill the 96-token context
    gaps = []
    hook = model.register_forward_hook(lambda m, a, out: gaps.append(out[0, -1].topk(2).values.diff().abs().item()))
    try:
        ours = generate(model, prompt.tolist(), n, temperature=0)
    finally:
        hook.remove()
    with torch.no_grad():
        theirs = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # id 0 is
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(prompt) :]  # no pad
    assert min(gaps) > 1e-4, min(gaps)
    assert ours == theirs.tolist()


@pytest.mark.parametrize("variant", [{}, {"tie_embeddings": True}, {"attn_impl": "einsum", "positions": "learned"}])
def test_fused_loss_equals_logits_loss(variant):
    a = small_model(**variant)
    b = small_model(**variant)
    b.load_state_dict(a.state_dict())
    ids, targets = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    loss_a = cross_entropy(a(ids), targets)
    loss_b = b.loss(ids, targets)
    torch.testing.assert_close(loss_b, loss_a)
    loss_a.backward()
    loss_b.backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="targets"):
        a.loss(ids, targets[:, :5])


@pytest.mark.slow
def test_torch_compile_fused_loss_matches_eager():
    model = small_model()
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    eager = model.loss(ids, targets)
    compiled = torch.compile(model.loss)(ids, targets)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


def _accelerators() -> list[str]:
    devices = []
    if torch.cuda.is_available():
        devices.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


@pytest.mark.parametrize("device", _accelerators() or [pytest.param("cuda", marks=pytest.mark.skip("no cuda/mps"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accelerator_matches_cpu(device, dtype):
    from lm.generate import generate

    cpu = small_model()
    model = small_model(device=device, dtype=dtype)
    model.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    out = model(ids.to(device)).float().cpu()
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.15, "rtol": 0.05}
    torch.testing.assert_close(out, cpu(ids), **tol)
    assert len(generate(model, [1, 2, 3], 20, temperature=0.8, top_p=0.9)) == 20
    model.loss(ids.to(device), ids.to(device)).backward()


def test_bfloat16_autocast_fused_and_plain_loss_agree():
    model = small_model()
    ids, targets = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = cross_entropy(model(ids), targets)
        fused = model.loss(ids, targets)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, atol=1e-3, rtol=1e-3)
    plain.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    fused.backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, atol=2e-2 * g.abs().max().item(), rtol=0)


def test_forward_with_targets_is_the_fused_loss():
    model = small_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    y = torch.randint(0, model.config.vocab_size, (2, 16))
    torch.testing.assert_close(model(ids, targets=y), F.cross_entropy(model(ids).flatten(0, 1), y.flatten()))
    # with its positions too (mutation: forward's loss at the default positions, survived)
    ids, y = ids[:, :8], y[:, :8]
    pos = 2 * torch.arange(8).repeat(2, 1)  # RoPE sees the distances: a shift alone would change nothing
    shifted = model(ids, pos, targets=y)
    torch.testing.assert_close(shifted, F.cross_entropy(model(ids, pos).flatten(0, 1), y.flatten()))
    assert not torch.allclose(shifted, model(ids, targets=y))


def test_dropout_only_in_training_and_where_nanogpt_puts_it():
    """Dropout on the embeddings and on each branch's output, in training mode only: seen from
    forward hooks, each residual stream is the previous one plus the branch's output with about
    30% of its elements zeroed and the others scaled by 1/0.7 (inverted dropout), and the first
    stream is the embeddings so treated; in eval mode the same weights with dropout 0 give the
    same logits."""
    cfg = ModelConfig(**{**SMALL, "dropout": 0.3})
    model = TransformerLM.from_config(cfg)
    plain = TransformerLM.from_config(ModelConfig(**SMALL))
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, SMALL["vocab_size"], (4, 16))
    model.eval()
    assert torch.equal(model(ids), plain(ids))
    model.train()
    seen = {}

    def keep(name, what):
        def hook(module, args, output):
            seen[name] = (args[0] if what == "input" else output).detach()
        return hook

    modules = [("embeddings", model.token_embeddings, "output")]
    for i, layer in enumerate(model.layers):
        modules += [(f"{i}.stream", layer.ln1, "input"), (f"{i}.attn", layer.attn, "output"),
                    (f"{i}.mid", layer.ln2, "input"), (f"{i}.ffn", layer.ffn, "output")]  # fmt: skip
    modules.append(("final", model.ln_final, "input"))
    handles = [m.register_forward_hook(keep(name, what)) for name, m, what in modules]
    got = model(ids)
    for h in handles:
        h.remove()
    assert not torch.allclose(got, plain(ids))
    layers = len(model.layers)
    # (stream before, branch output, stream after) at every place nanoGPT drops out
    sites = [(torch.zeros_like(seen["embeddings"]), seen["embeddings"], seen["0.stream"])]
    for i in range(layers):
        after = seen[f"{i + 1}.stream"] if i + 1 < layers else seen["final"]
        sites.append((seen[f"{i}.stream"], seen[f"{i}.attn"], seen[f"{i}.mid"]))
        sites.append((seen[f"{i}.mid"], seen[f"{i}.ffn"], after))
    for before, branch, after in sites:
        added, big = after - before, branch.abs() > 1e-2
        dropped = added.abs() <= 1e-5 * branch.abs().clamp(min=1)
        assert 0.2 < dropped[big].float().mean() < 0.4  # p = 0.3 over 2,048 elements
        torch.testing.assert_close(added[big & ~dropped], branch[big & ~dropped] / 0.7, rtol=1e-4, atol=1e-5)
    assert ModelConfig.from_json(cfg.to_json()).dropout == 0.3
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match=f"dropout must be a number in \\[0, 1\\), got {bad!r}"):
            ModelConfig(**{**SMALL, "dropout": bad})


def test_generate_turns_dropout_off():
    from lm.generate import generate

    model = TransformerLM.from_config(ModelConfig(**{**SMALL, "dropout": 0.5})).train()
    runs = [generate(model, [1, 2, 3], 6, temperature=0.0) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] and model.training


def test_the_compiled_loss_graph_does_not_grow_with_the_batch():
    """Compiled, the fused loss makes the logits in one chunk (within a memory budget), so the
    traced graph is the same size at batch 32 and 128 (with 256-token chunks it unrolled a loop
    that grew with the batch: 367 and 1,015 nodes here)."""
    import torch.fx as fx

    sizes = []

    def backend(gm, inputs):
        sizes.append(sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, fx.GraphModule)))
        return gm.forward

    torch.manual_seed(0)
    model = TransformerLM(256, 64, 32, 1, 2, 64)
    loss = torch.compile(model.loss, backend=backend, dynamic=False)
    for batch in (32, 128):
        ids = torch.randint(0, 256, (batch, 64))
        loss(ids, ids).backward()
    assert len(sizes) == 2 and sizes[0] == sizes[1]


def test_new_cache_is_shaped_for_the_model():
    """generate and the serving engine ask the model for its cache: every layer's keys and values,
    in the model's dtype and on its device, ``context_length`` positions unless told."""
    from lm.generate import KVCache

    model = TransformerLM(**SMALL, dtype=torch.bfloat16)
    cache = model.new_cache(3, pad_lengths=torch.tensor([0, 2, 1]))
    cfg = model.config
    assert isinstance(cache, KVCache) and cache.max_len == cfg.context_length
    assert cache.k.shape == (cfg.num_layers, 3, cfg.num_heads, cfg.context_length, cfg.head_dim)
    assert cache.k.dtype == torch.bfloat16 and cache.v.device == model.device
    assert cache.pad_lengths.tolist() == [0, 2, 1] and model.new_cache(1, max_len=5).max_len == 5


def test_generation_and_evaluation_check_ids_on_the_host_not_per_forward():
    """A forward checks its ids against the vocabulary by reading their min and max back from the
    device; generate (prompt checked as a list), the decode step and evaluate_tokens (each batch
    checked as numpy) skip it: greedy decoding reads back only the sampled ids (a list a step),
    evaluation only its loss. A bad id is still refused, with the argument named;
    outside these blocks the forward still checks."""
    from lm.evaluate import evaluate_tokens
    from lm.generate import DecodeStep, generate

    model = small_model().eval()
    tokens = np.arange(100) % SMALL["vocab_size"]
    with HostReads() as decoding:
        generate(model, [1, 2, 3], 8, temperature=0.0)
        DecodeStep(model, 2)([4, 5], [0, 0])
    assert decoding.reads == ["tolist"] * 8  # the sampled ids, a list a step
    with HostReads() as evaluating:
        evaluate_tokens(model, tokens, batch_size=2)
    assert evaluating.reads == ["__float__"] * 4  # 7 windows of 16 in 4 batches: one loss read each
    with HostReads() as plain:
        model(torch.tensor([[1, 2]]))
    assert plain.reads == ["__int__", "__int__"] and model.validate_ids
    with pytest.raises(ValueError, match=r"data: id 64 is outside the model's vocabulary \[0, vocab_size=64\)"):
        evaluate_tokens(model, np.r_[tokens, 64])
    with pytest.raises(ValueError, match=r"prompt_ids: id 64 is outside"):
        generate(model, [1, 64], 2)
    with pytest.raises(ValueError, match="ids must be in"):
        model(torch.tensor([[1, 64]]))


def test_model_config_takes_numpy_integers_as_ints():
    """`ModelConfig(vocab_size=np.int64(100), ...)` was refused as "vocab_size must be a positive integer,
    got np.int64(100)" (apifuzz19 #20); kept as ints, the config is written as TOML and JSON as before."""
    import numpy as np

    from lm.model import ModelConfig

    cfg = ModelConfig(vocab_size=np.int64(100), context_length=np.int32(16), d_model=np.int16(16), num_layers=1,
                      num_heads=np.uint8(2), d_ff=np.int64(32))
    assert cfg == ModelConfig(vocab_size=100, context_length=16, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    assert all(type(getattr(cfg, k)) is int for k in ("vocab_size", "context_length", "d_model", "num_heads", "d_ff"))
    for bad in (100.0, True, "100"):
        with pytest.raises(ValueError, match=f"^vocab_size must be a positive integer, got {bad!r}$"):
            ModelConfig(vocab_size=bad, context_length=16, d_model=16, num_layers=1, num_heads=2)



@pytest.mark.parametrize("kind", ["decoder_lm", "encoder_decoder"])
def test_model_configs_take_every_numpy_scalar_as_the_python_value(kind, tmp_path):
    """Only the sizes had been converted: `dropout=np.float32(0.1)` was kept as numpy, and the model's
    first `to_json`, or `export_safetensors`, failed with "Object of type float32 is not JSON
    serializable"; `pad_id=np.int64(0)` was refused as "must be an id in [0, 53), got np.int64(0)"
    and `tie_embeddings=np.bool_(True)` as "must be a bool" (mut24a). Each field now holds the
    Python value numpy's `item()` gives, and the config round-trips through JSON and TOML."""
    from lm.checkpoint import export_safetensors, load_model
    from lm.model import Seq2SeqConfig, build_model

    values = dict(rope_theta=np.float32(5e3), norm_eps=np.float64(1e-6), dropout=np.float32(0.1),
                  tie_embeddings=np.bool_(True), norm=np.str_("layernorm"))
    plain = {k: v.item() for k, v in values.items()}
    if kind == "decoder_lm":
        make = lambda **kw: ModelConfig(vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=4, **kw)
    else:
        values.update(label_smoothing=np.float32(0.1), embed_scale=np.bool_(False), pad_id=np.int64(0),
                      bos_id=np.uint8(1), eos_id=np.int32(2))
        plain = {k: v.item() for k, v in values.items()}
        make = lambda **kw: Seq2SeqConfig(vocab_size=64, context_length=16, d_model=32, encoder_layers=1,
                                          decoder_layers=1, num_heads=4, **kw)
    cfg = make(**values)
    assert cfg == make(**plain)
    assert {k: type(getattr(cfg, k)) for k in values} == {k: type(v) for k, v in plain.items()}
    assert type(cfg).from_json(cfg.to_json()) == cfg == type(cfg).from_toml(cfg.to_toml())
    export_safetensors(build_model(cfg), tmp_path / "model.safetensors")
    assert load_model(tmp_path / "model.safetensors")[0].config == cfg
    with pytest.raises(ValueError, match=r"^tie_embeddings must be a bool, got 1$"):  # a number is still no flag
        make(tie_embeddings=np.int64(1))

def test_the_models_refuse_a_dtype_that_is_not_a_torch_floating_dtype():
    """TransformerLM(..., dtype='float16') and build_model(cfg, dtype='bfloat16') failed inside torch
    ("Only Tensors of floating point ... can require gradients", apifuzz19 #21): the message names the
    argument and, for a name, says to pass the torch.dtype."""
    from lm.model import EncoderDecoder, Seq2SeqConfig, build_model

    lm_cfg = ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2)
    mt_cfg = Seq2SeqConfig(vocab_size=50, context_length=8, d_model=16, encoder_layers=1, decoder_layers=1,
                           num_heads=2)
    makers = [lambda dtype: TransformerLM(50, 8, 16, 1, 2, None, dtype=dtype),
              lambda dtype: TransformerLM.from_config(lm_cfg, dtype=dtype),
              lambda dtype: EncoderDecoder(mt_cfg, dtype=dtype),
              lambda dtype: build_model(lm_cfg, dtype=dtype),
              lambda dtype: build_model(mt_cfg, dtype=dtype)]
    for make in makers:
        for bad, hint in (("float16", " (pass torch.float16, not its name)"),
                          ("bfloat16", " (pass torch.bfloat16, not its name)"), (torch.int64, ""), ("fp16", "")):
            with pytest.raises(ValueError) as e:
                make(bad)
            assert str(e.value) == ("dtype must be a torch floating dtype such as torch.bfloat16 or None, "
                                    f"got dtype={bad!r}{hint}")
        assert make(torch.bfloat16).output_weight.dtype == torch.bfloat16
        assert make(None).output_weight.dtype == torch.float32


def test_lm_flops_per_token_is_torchs_count():
    """flops_per_token (the MFU's numerator) against torch's FlopCounterMode over a forward with
    hand-written attention (so that the score matmuls are counted), not a formula re-typed (testq22)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = TransformerLM(100, 32, 64, 2, 4, 128, attn_impl="einsum").eval()
    for s in (32, 7):
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            model(torch.randint(0, 100, (1, s)))
        assert fc.get_total_flops() == model.flops_per_token(seq_len=s) * s


def test_tied_weights_keep_the_output_projections_init():
    """With tie_embeddings the one matrix is lm_head's, with Linear's σ² = 2/(vocab + d_model), and
    token_embeddings reads that same tensor. Tied the other way round (lm_head.weight =
    token_embeddings.weight, mut24a M5) it kept Embedding's σ = 1, and the first logits were
    about √(vocab + d_model)/√2 ≈ 23 times too large here: nothing checked the tied matrix's scale."""
    torch.manual_seed(0)
    vocab, d = 1000, 64
    model = TransformerLM(vocab, 32, d, 1, 4, 128, tie_embeddings=True)
    assert model.token_embeddings.weight is model.lm_head.weight
    want = math.sqrt(2.0 / (vocab + d))  # Linear's documented init (truncated at 3σ: the std ≈ 0.986 σ)
    std = model.lm_head.weight.std().item()
    assert 0.95 * want < std < 1.02 * want, (std, want)
    assert [n for n, _ in model.named_parameters()].count("token_embeddings.weight") == 1


@pytest.mark.parametrize("ffn", ["relu", "gelu", "silu", "swiglu"])
def test_lm_flops_per_token_is_torchs_count_for_every_ffn(ffn):
    """flops_per_token against torch's FlopCounterMode for each feed-forward type: the existing test
    ran only SwiGLU, so counting three FFN matrices for every type (relu's two, mut24a M18) passed,
    and a ReLU model's MFU was overstated."""
    from torch.utils.flop_counter import FlopCounterMode

    model = TransformerLM(100, 32, 64, 2, 4, 128, attn_impl="einsum", ffn=ffn).eval()
    s = 9
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(torch.randint(0, 100, (1, s)))
    assert fc.get_total_flops() == model.flops_per_token(seq_len=s) * s


@pytest.mark.parametrize("name", ["vocab_size", "context_length", "d_model", "num_layers", "num_heads"])
def test_a_size_one_past_the_largest_is_refused_and_the_largest_is_not(name):
    """MAX_SIZE is 2**31 - 1: 2**31 is refused naming the key (the tests had tried only 10**20, so a
    bound twice as large, mut24a C1, passed). Checked on the config alone: nothing is built."""
    cfg = {**SMALL, name: 2**31}
    with pytest.raises(ValueError, match=rf"^{name} must be at most 2\*\*31 - 1, got 2,147,483,648$"):
        ModelConfig(**cfg)


def test_a_d_ff_one_past_the_largest_is_refused():
    """d_ff has its own bound (mut24a C14: dropped, 2**31 and 10**20 were accepted and left to torch)."""
    for bad in (2**31, 10**20):
        with pytest.raises(ValueError, match=rf"^d_ff must be a positive integer of at most 2\*\*31 - 1, got {bad}$"):
            ModelConfig(**{**SMALL, "d_ff": bad})


def test_the_config_refuses_an_odd_width_for_sinusoidal_positions():
    """ModelConfig itself refuses an odd d_model with sinusoidal positions, before any model is built
    (mut24a C4: without the check the config, and a run's config.toml, were accepted and the error came
    from sinusoidal_table when the model was built)."""
    with pytest.raises(ValueError, match=r"^d_model must be even for sinusoidal positions, got d_model=33$"):
        ModelConfig(**{**SMALL, "d_model": 33, "num_heads": 3, "positions": "sinusoidal"})
    ModelConfig(**{**SMALL, "d_model": 33, "num_heads": 3, "positions": "learned"})  # any width with learned ones


@pytest.mark.parametrize("positions", ["rope", "learned", "sinusoidal"])
def test_a_cached_forward_past_context_length_is_refused_counting_the_cache(positions):
    """With a cache longer than the context (new_cache's max_len), the cached positions count against
    context_length: "(cached 10 + new 10)". With only the new ones counted (mut24a M13) the forward
    went on to positions 16-19 of a 16-position model: RoPE and learned tables fail deep in
    index_select, and the sinusoidal table's rows past the end were read as zeros or an IndexError."""
    torch.manual_seed(0)
    model = TransformerLM(**SMALL, positions=positions).eval()
    cache = model.new_cache(1, max_len=32)
    model(torch.randint(0, 64, (1, 10)), kv_cache=cache)
    with pytest.raises(ValueError, match=r"^sequence length 20 exceeds context_length=16 \(cached 10 \+ new 10\)$"):
        model(torch.randint(0, 64, (1, 10)), kv_cache=cache)
    with pytest.raises(ValueError, match=r"^sequence length 17 exceeds context_length=16$"):  # no cache
        model(torch.randint(0, 64, (1, 17)))


@pytest.mark.parametrize("attn_impl", ["einsum", "sdpa"])
def test_a_model_without_positions_takes_any_token_positions_and_ignores_them(attn_impl):
    """positions="none" reads no position table, so token_positions past the context (or negative)
    are not refused: the logits are those without them. The other models refuse such positions."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 5))
    far = torch.tensor([[100, 200, -3, 16, 7], [0, 1, 2, 3, 4]])
    model = TransformerLM(**SMALL, positions="none", attn_impl=attn_impl).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, token_positions=far), model(ids), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"token_positions must be in \[0, context_length=16\)"):
        TransformerLM(**SMALL, positions="learned").eval()(ids, token_positions=far)


def test_last_only_is_the_last_positions_logits():
    """``forward(ids, last_only=True)``: only the last position's logits, as ``forward(ids)[..., -1:, :]``
    (the projection to the vocabulary is then made for one position). Every caller in lm takes ``[:, -1]``
    of it, so a result of two positions (mutation: ``h[..., -2:, :]``) survived them."""
    model = small_model().eval()
    ids = torch.randint(0, 64, (3, 7))
    with torch.no_grad():
        last, full = model(ids, last_only=True), model(ids)
    assert last.shape == (3, 1, 64)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        assert model(ids[0], last_only=True).shape == (1, 64)  # unbatched: (seq, vocab) with seq = 1


def test_compile_puts_each_einops_call_in_the_graph_and_importing_the_model_leaves_dynamo_out():
    """torch 2.13 with einops 0.8.2 traced into einops and re-parsed every pattern under the tracer
    (95% of the bytecodes traced for a decode step, seconds of each compilation). The layers call
    einops through lm.nn.functional.rearrange and einsum, which dynamo puts in the graph as single
    calls; the graph's output is the eager model's. Marking them imports torch._dynamo (2.4 s on 2
    cores); done at lm.nn.functional's import, it had made every command that loads a model that
    much slower, compiled or not. So, in a fresh interpreter: the model (and generation, serving,
    evaluation) imports without dynamo, and a torch.compile after that finds the calls marked."""
    code = """if True:
        import sys
        import torch
        import lm.evaluate, lm.export, lm.generate, lm.model, lm.serve
        from lm.model import TransformerLM
        from lm.nn import functional as lmf
        print("torch._dynamo" in sys.modules)
        import torch._dynamo.symbolic_convert as sc
        torch.manual_seed(0)
        model = TransformerLM(vocab_size=50, context_length=16, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                              attn_impl="einsum").eval()
        ids = torch.randint(0, 50, (2, 8))
        graphs, traced = [], []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        step = sc.InstructionTranslatorBase.step

        def counting_step(self):
            traced.append(self.f_code.co_filename)
            return step(self)

        sc.InstructionTranslatorBase.step = counting_step
        with torch.no_grad():
            same = torch.equal(torch.compile(model, backend=backend)(ids), model(ids))
        sc.InstructionTranslatorBase.step = step
        targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
        # q, k, v, out; lm_head...; and not one bytecode of einops traced
        print(targets.count(lmf.rearrange), targets.count(lmf.einsum), len([f for f in traced if "einops" in f]),
              len(traced) > 0, same)
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    imported, rearranges, einsums, einops_traced, counted, same = p.stdout.split()
    assert imported == "False" and int(rearranges) >= 4 and int(einsums) >= 3, p.stdout
    assert einops_traced == "0" and counted == "True" and same == "True", p.stdout

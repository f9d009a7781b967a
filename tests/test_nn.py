"""Every layer of lm.nn against an independent formula (torch.nn.functional or a plain loop)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.model_reference import attention_ref, rope_loop, swiglu_ref
from helpers.tensor_bytes import LiveTensorBytes

import lm.nn
from lm.nn import (
    MLP,
    Embedding,
    LayerNorm,
    Linear,
    MultiHeadSelfAttention,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    TransformerBlock,
    cross_entropy,
    ffn_hidden_dim,
    gelu,
    linear_cross_entropy,
    scaled_dot_product_attention,
    silu,
    softmax,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _torch_nn_uses(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The ``torch.nn.<name>`` attributes a module uses, and what it imports from ``torch.nn...``."""
    attributes, imported = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.nn":
            attributes.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.nn"):
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("torch.nn")}
    return attributes, imported


def test_no_torch_nn_layers_or_functional():
    """The layers are hand-written: from torch.nn only the module machinery (Module, Parameter,
    ModuleList, init), and from torch.nn.functional only the optional fused attention kernel."""
    for path in Path(lm.nn.__file__).parent.glob("*.py"):
        attributes, imported = _torch_nn_uses(ast.parse(path.read_text(encoding="utf-8")))
        assert attributes <= {"Module", "Parameter", "ModuleList", "init"}, (path.name, attributes)
        assert imported <= {"torch.nn.functional.scaled_dot_product_attention"}, (path.name, imported)


def test_linear_matches_matmul_with_batch_dims():
    layer = Linear(7, 5)
    assert layer.weight.shape == (5, 7)
    x = torch.randn(2, 3, 4, 7)
    torch.testing.assert_close(layer(x), x @ layer.weight.T)


def test_batch_invariant_linear_compiled_gives_a_row_the_same_bits_at_any_number_of_rows():
    """The compiled product-sum form: a row's bits the same for 1, 3 and 16 rows (a BLAS matmul's
    change with the number of rows), equal to the matmul to rounding; eager code is unchanged."""
    from lm.nn.functional import batch_invariant

    torch.manual_seed(0)
    layer = Linear(96, 40)
    x = torch.randn(16, 1, 96)

    def f(x):
        return layer(x)

    with torch.inference_mode(), batch_invariant():
        assert torch.equal(layer(x), torch.einsum("...i,oi->...o", x, layer.weight))  # eager: the einsum
        compiled = torch.compile(f, dynamic=False)
        outs = {rows: compiled(x[:rows].clone()) for rows in (1, 3, 16)}
    for rows, out in outs.items():
        assert torch.equal(out, outs[16][:rows]), rows
    torch.testing.assert_close(outs[16], x @ layer.weight.T, rtol=1e-5, atol=1e-5)


def test_linear_init_is_truncated_normal():
    layer = Linear(300, 500)
    std = math.sqrt(2 / 800)
    w = layer.weight.detach()
    assert w.abs().max() <= 3 * std + 1e-6
    # a normal truncated at ±3σ has standard deviation 0.9866σ
    assert abs(w.std().item() / std - 0.9866) < 0.02


def test_embedding_lookup_and_init():
    emb = Embedding(1000, 64)
    ids = torch.randint(0, 1000, (3, 5, 7))
    out = emb(ids)
    assert out.shape == (3, 5, 7, 64)
    torch.testing.assert_close(out, emb.weight[ids])
    w = emb.weight.detach()
    assert w.abs().max() <= 3.0 and abs(w.std().item() - 0.9866) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_torch(dtype):
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = (torch.randn(2, 3, 5, 16) * 10).to(dtype)
    expected = F.rms_norm(x.float(), (16,), norm.weight, 1e-5).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    # Computed in float32 and rounded once: bitwise equal to torch's float32 RMSNorm rounded to the
    # input dtype (measured over 50 seeds, float32 too). bfloat16 is tested exactly, so a norm that
    # computed in bfloat16 fails; float32 keeps torch's default tolerance against kernel differences.
    tol = {} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(out, expected, **tol)


def test_rmsnorm_bfloat16_params_compute_in_float32():
    norm = RMSNorm(64, dtype=torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 1000
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.rms_norm(x.float(), (64,), eps=1e-5).bfloat16(), atol=0, rtol=0)


def test_layernorm_matches_torch():
    norm = LayerNorm(16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
        norm.bias.copy_(torch.randn(16))
    x = torch.randn(2, 3, 16) * 3 + 1
    torch.testing.assert_close(norm(x), F.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_matches_torch(dim):
    x = torch.randn(4, 5, 6)
    torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim))


def test_softmax_large_logits_and_masked():
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [1000.0, -float("inf"), 999.0]])
    out = softmax(x, -1)
    torch.testing.assert_close(out, torch.softmax(x, -1))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("ours", "theirs"), [(silu, F.silu), (gelu, F.gelu), (lm.nn.relu, F.relu)])
def test_activations_match_torch(ours, theirs):
    x = torch.randn(3, 4, 50) * 5
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_matches_torch_with_mask_and_batch_dims(impl, dtype):
    q = torch.randn(2, 3, 4, 5, 8, dtype=dtype)
    k = torch.randn(2, 3, 4, 7, 8, dtype=dtype)
    v = torch.randn(2, 3, 4, 7, 6, dtype=dtype)
    mask = torch.rand(2, 3, 4, 5, 7) > 0.4
    mask[..., 0] = True  # every query may attend something
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    out = scaled_dot_product_attention(q, k, v, mask, impl=impl)
    assert out.dtype == dtype and out.shape == (2, 3, 4, 5, 6)
    tol = {} if dtype == torch.float32 else {"atol": 0.03, "rtol": 0.02}
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
def test_sdpa_causal_aligned_to_end_of_keys(impl):
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    mask = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True, impl=impl), expected)


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
def test_sdpa_with_no_keys_gives_torchs_zeros(impl):
    """Zero keys (an empty source or prompt): the einsum path's softmax took the max of an empty
    row (IndexError); torch's kernel gives zeros, and so must both impls."""
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 6)
    expected = F.scaled_dot_product_attention(q, k, v)
    assert expected.shape == (1, 2, 3, 6) and not expected.any()
    for mask, causal in ((None, False), (None, True), (torch.ones(3, 0, dtype=torch.bool), False)):
        out = scaled_dot_product_attention(q, k, v, mask, is_causal=causal, impl=impl)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert not grad.any()
    assert softmax(torch.randn(3, 0), -1).shape == torch.softmax(torch.randn(3, 0), -1).shape == (3, 0)


def test_attention_with_a_kv_cache_needs_token_positions_for_rope():
    """Without token_positions a cached layer rotated the second chunk as positions 0, 1, ...
    (0.83 off the full forward); now it must be told them, and with them chunks equal the full
    forward. Without RoPE positions do not matter."""

    class Cat:  # the smallest LayerKVCache: every key and value so far
        def __init__(self):
            self.k = self.v = None

        def update(self, k, v):
            self.k = k if self.k is None else torch.cat((self.k, k), -2)
            self.v = v if self.v is None else torch.cat((self.v, v), -2)
            return self.k, self.v, None

    x = torch.randn(1, 6, 16)
    for rope in (RotaryEmbedding(10000.0, 8, 32), None):
        attn = MultiHeadSelfAttention(16, 2, rope)
        full, cache = attn(x), Cat()
        chunks = [attn(x[:, :4], torch.arange(4), kv_cache=cache), attn(x[:, 4:], torch.arange(4, 6), kv_cache=cache)]
        torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-6, rtol=1e-6)
        if rope is None:
            cache = Cat()
            chunks = [attn(x[:, :4], kv_cache=cache), attn(x[:, 4:], kv_cache=cache)]
            torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-6, rtol=1e-6)
        else:
            message = ("token_positions is required with kv_cache and RoPE: the positions of the new tokens, "
                       "after the cached ones")
            with pytest.raises(ValueError, match=f"^{message}$"):
                attn(x[:, 4:], kv_cache=Cat())


def test_cross_attention_without_context_or_cached_keys_raises():
    """A cross_cache with nothing under the layer and no context: self.k_proj(None) failed deep in
    einops ("Tensor type unknown to einops")."""

    class Cross:
        def __init__(self):
            self.kv = {}

        def get(self, layer):
            return self.kv.get(layer)

        def put(self, layer, k, v):
            self.kv[layer] = (k, v)

    attn, x, memory = lm.nn.MultiHeadAttention(16, 2, causal=False), torch.randn(1, 3, 16), torch.randn(1, 5, 16)
    cache = Cross()
    with pytest.raises(ValueError, match=r"^context \(the memory\) is required: cross_cache holds no keys and "
                                         r"values for layer 1 yet$"):
        attn(x, cross_cache=cache, layer=1)
    first = attn(x, context=memory, cross_cache=cache, layer=1)
    torch.testing.assert_close(attn(x, cross_cache=cache, layer=1), first, atol=0, rtol=0)  # then it may be None
    torch.testing.assert_close(attn(x, context=memory), first, atol=0, rtol=0)


def test_decoder_block_without_memory_or_a_cross_cache_raises():
    """memory=None and no cross_cache ran cross-attention over the target itself, with no error."""
    block = lm.nn.DecoderBlock(16, 2, 32)
    x, memory = torch.randn(1, 3, 16), torch.randn(1, 5, 16)
    with pytest.raises(ValueError, match=r"^memory is required unless cross_cache holds the memory's keys and values$"):
        block(x, None)
    assert block(x, memory).shape == x.shape


def test_sdpa_large_scores_are_stable():
    q = torch.randn(1, 4, 16) * 100
    k = torch.randn(1, 4, 16) * 100
    v = torch.randn(1, 4, 16)
    out = scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float())


def test_cross_entropy_matches_torch():
    logits = torch.randn(2, 3, 11)
    targets = torch.randint(0, 11, (2, 3))
    torch.testing.assert_close(
        cross_entropy(logits, targets), F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    )


def test_cross_entropy_large_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4], [5e3, 5e3 + 2.0, 0.0]])
    targets = torch.tensor([1, 0])
    out = cross_entropy(logits, targets)
    assert torch.isfinite(out)
    torch.testing.assert_close(out, F.cross_entropy(logits.double(), targets).float())


def test_cross_entropy_gradient_matches_torch():
    logits = torch.randn(6, 9, requires_grad=True)
    targets = torch.randint(0, 9, (6,))
    (g,) = torch.autograd.grad(cross_entropy(logits, targets), logits)
    (g_ref,) = torch.autograd.grad(F.cross_entropy(logits, targets), logits)
    torch.testing.assert_close(g, g_ref)


# -- the hand-written backward passes against autograd of the plain formula -------------------------
# Each of softmax, cross_entropy and linear_cross_entropy has its backward written out by hand. The
# references below are the forward formula in float64 with nothing hand-written, differentiated by
# autograd; the upstream gradient is random (softmax) or 2.5 (the losses), so a backward that drops
# a term, a sign or the incoming gradient is caught. Tolerances are about 5x the largest difference
# measured over 20 seeds (softmax 1.8e-7, cross_entropy 3.0e-8, linear_cross_entropy 2.1e-7).


def _plain_softmax(x, dim):
    e = (x - x.amax(dim=dim, keepdim=True)).exp()
    return e / e.sum(dim=dim, keepdim=True)


def _plain_cross_entropy(logits, targets):
    logits = logits.double()
    return (logits.logsumexp(-1) - logits.gather(-1, targets[..., None])[..., 0]).mean()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_backward_matches_autograd_of_the_formula(dim):
    x = torch.randn(4, 5, 6, requires_grad=True)
    upstream = torch.randn(4, 5, 6)
    (ours,) = torch.autograd.grad(softmax(x, dim), x, upstream)
    (ref,) = torch.autograd.grad(_plain_softmax(x.double(), dim), x, upstream.double())
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    # and against finite differences, in float64 where they are exact enough
    x64 = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: softmax(t, dim), (x64,))


@pytest.mark.parametrize("masked", [False, True])
def test_einsum_attention_keeps_one_buffer_of_probabilities_for_its_backward(masked):
    """The einsum attention's softmax is an autograd function of its own (_Softmax): its backward needs
    the probabilities alone, which the product with V saves anyway, so the pass keeps one buffer of the
    scores' size; the same softmax in differentiable operations keeps three (mutation: the formula
    outside torch.func too, survived: values and gradients agree)."""
    from lm.nn.functional import scaled_dot_product_attention

    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool).tril() if masked else None
    buffers = set()

    def pack(t):
        if t.dim() >= 3 and t.shape[-2:] == (8, 8):  # (the mask is saved too: 2-D, and bool)
            buffers.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = scaled_dot_product_attention(q, k, v, mask=mask, impl="einsum")
    assert len(buffers) == 1
    out.square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_cross_entropy_backward_matches_autograd_of_the_formula():
    logits = (torch.randn(3, 7, 11) * 3).requires_grad_()
    targets = torch.randint(0, 11, (3, 7))
    (ours,) = torch.autograd.grad(cross_entropy(logits, targets), logits, torch.tensor(2.5))
    (ref,) = torch.autograd.grad(_plain_cross_entropy(logits, targets), logits, torch.tensor(2.5, dtype=torch.float64))
    torch.testing.assert_close(ours, ref, atol=2e-7, rtol=0)
    # bfloat16 logits: the float32 gradient rounded once (measured bitwise equal)
    lb = (torch.randn(6, 30) * 5).bfloat16().requires_grad_()
    t = torch.randint(0, 30, (6,))
    (ours,) = torch.autograd.grad(cross_entropy(lb, t), lb)
    (ref,) = torch.autograd.grad(_plain_cross_entropy(lb.float(), t), lb)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref)


@pytest.mark.parametrize("wanted", ["both", "x", "weight"])
def test_linear_cross_entropy_backward_matches_autograd_of_the_formula(wanted):
    x = torch.randn(3, 10, 16, requires_grad=wanted in ("both", "x"))
    w = torch.randn(50, 16, requires_grad=wanted in ("both", "weight"))
    t = torch.randint(0, 50, (3, 10))
    inputs = [v for v in (x, w) if v.requires_grad]
    ours = torch.autograd.grad(linear_cross_entropy(x, w, t, chunk_size=7), inputs, torch.tensor(2.5))
    ref = torch.autograd.grad(_plain_cross_entropy(x @ w.T, t), inputs, torch.tensor(2.5, dtype=torch.float64))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_plain_loop(dtype):
    rope = RotaryEmbedding(10000.0, 16, 64)
    x = torch.randn(2, 3, 10, 16).to(dtype)
    positions = torch.randint(0, 64, (2, 3, 10))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.03, "rtol": 0.02}
    torch.testing.assert_close(rope(x, positions).float(), rope_loop(x.double(), positions, 10000.0).float(), **tol)


def test_rope_broadcasts_positions_and_has_no_state():
    rope = RotaryEmbedding(500.0, 8, 32)
    assert rope.state_dict() == {} and list(rope.parameters()) == []
    x = torch.randn(4, 2, 6, 8)
    positions = torch.arange(6)
    torch.testing.assert_close(rope(x, positions), rope_loop(x, positions, 500.0), atol=1e-5, rtol=1e-5)


def test_rope_relative_property():
    """q·k after RoPE depends only on the position offset."""
    rope = RotaryEmbedding(10000.0, 32, 200)
    q, k = torch.randn(32), torch.randn(32)

    def score(m, n):
        return rope(q[None], torch.tensor([m])) @ rope(k[None], torch.tensor([n])).T

    for m, n, shift in [(5, 2, 40), (0, 7, 100), (30, 30, 9)]:
        torch.testing.assert_close(score(m, n), score(m + shift, n + shift), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-3)


def test_rope_odd_dim_rejected():
    with pytest.raises(ValueError, match="d_k"):
        RotaryEmbedding(10000.0, 7, 16)


def test_ffn_hidden_dim_rule():
    assert ffn_hidden_dim(256) == 704 and ffn_hidden_dim(512) == 1408 and ffn_hidden_dim(64) == 192
    assert ffn_hidden_dim(256, "relu") == 1024
    with pytest.raises(ValueError, match="'geglu'"):
        ffn_hidden_dim(256, "geglu")


def test_swiglu_matches_formula():
    ffn = SwiGLU(16, 40)
    assert ffn.w1.weight.shape == (40, 16) and ffn.w2.weight.shape == (16, 40) and ffn.w3.weight.shape == (40, 16)
    x = torch.randn(2, 3, 5, 16)
    torch.testing.assert_close(ffn(x), swiglu_ref(x, ffn.w1.weight, ffn.w2.weight, ffn.w3.weight))


@pytest.mark.parametrize("act", ["silu", "relu", "gelu"])
def test_mlp_matches_formula(act):
    ffn = MLP(16, 64, act)
    x = torch.randn(3, 16)
    expected = getattr(F, act)(x @ ffn.w1.weight.T) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), expected)


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
@pytest.mark.parametrize("use_rope", [True, False])
def test_attention_matches_per_head_reference(impl, use_rope):
    rope = RotaryEmbedding(10000.0, 8, 32) if use_rope else None
    attn = MultiHeadSelfAttention(32, 4, rope, attn_impl=impl)
    x = torch.randn(2, 3, 12, 32)
    w = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.output_proj.weight]
    expected = attention_ref(x, *w, 4, 10000.0 if use_rope else None)
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


def test_attention_token_positions():
    rope = RotaryEmbedding(10000.0, 8, 64)
    attn = MultiHeadSelfAttention(16, 2, rope)
    x = torch.randn(2, 5, 16)
    positions = torch.tensor([[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]])
    w = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.output_proj.weight]
    for b in range(2):
        expected = attention_ref(x[b], *w, 2, 10000.0, positions[b])
        torch.testing.assert_close(attn(x, positions)[b], expected, atol=1e-5, rtol=1e-5)


def test_attention_is_causal():
    attn = MultiHeadSelfAttention(16, 2, RotaryEmbedding(10000.0, 8, 16))
    x = torch.randn(1, 10, 16)
    y = x.clone()
    y[:, 6:] = torch.randn(1, 4, 16)
    torch.testing.assert_close(attn(x)[:, :6], attn(y)[:, :6])


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
def test_every_attention_path_runs_the_chosen_kernel(monkeypatch, impl):
    """Self-attention, cross-attention to a memory, and cross-attention from a cache of its keys and
    values each call the kernel ``attn_impl`` names: the results of the two agree up to rounding, so
    a path that fell back to the default (mutation: the cached cross-attention without ``impl``,
    survived) is seen only in the call. ``sdpa`` is the one that saves the memory."""
    import lm.nn.attention as attention
    from lm.generate.seq2seq import Seq2SeqCache

    used, kernel = [], attention.scaled_dot_product_attention
    monkeypatch.setattr(attention, "scaled_dot_product_attention",
                        lambda *a, **kw: (used.append(kw.get("impl")), kernel(*a, **kw))[1])
    self_attn = attention.MultiHeadAttention(16, 2, attn_impl=impl)
    cross = attention.MultiHeadAttention(16, 2, attn_impl=impl, causal=False)
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    cache = Seq2SeqCache(1, 2, 2, 3, 8)  # the decoder's cache: its cross-attention keys and values by layer

    self_attn(x)
    direct = cross(x, context=memory)
    first = cross(x, context=memory, cross_cache=cache)
    cached = cross(x, cross_cache=cache)
    assert used == [impl] * 4
    torch.testing.assert_close(first, direct)
    torch.testing.assert_close(cached, direct)


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
def test_every_attention_of_a_block_takes_its_attn_impl(impl):
    """A block's ``attn_impl`` reaches each of its attentions: the encoder-decoder's decoder layer has
    two (mutation: the self-attention left at the default, survived: the results agree up to rounding)."""
    from lm.nn.block import DecoderBlock

    decoder = DecoderBlock(16, 2, 32, attn_impl=impl)
    assert (decoder.self_attn.attn_impl, decoder.cross_attn.attn_impl) == (impl, impl)
    assert TransformerBlock(16, 2, 32, 8, attn_impl=impl).attn.attn_impl == impl


def test_attention_bad_shapes():
    with pytest.raises(ValueError, match="num_heads=3"):
        MultiHeadSelfAttention(32, 3)
    with pytest.raises(ValueError, match="'flash'"):
        MultiHeadSelfAttention(32, 4, attn_impl="flash")


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_matches_formula(placement):
    block = TransformerBlock(32, 4, 48, 16, 10000.0, norm_placement=placement)
    with torch.no_grad():
        block.ln1.weight.copy_(torch.rand(32) + 0.5)
        block.ln2.weight.copy_(torch.rand(32) + 0.5)
    x = torch.randn(2, 9, 32)
    a = block.attn
    w = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.output_proj.weight]
    f = block.ffn

    def ln1(t):
        return F.rms_norm(t, (32,), block.ln1.weight, 1e-5)

    def ln2(t):
        return F.rms_norm(t, (32,), block.ln2.weight, 1e-5)

    if placement == "pre":
        h = x + attention_ref(ln1(x), *w, 4, 10000.0)
        expected = h + swiglu_ref(ln2(h), f.w1.weight, f.w2.weight, f.w3.weight)
    else:
        h = ln1(x + attention_ref(x, *w, 4, 10000.0))
        expected = ln2(h + swiglu_ref(h, f.w1.weight, f.w2.weight, f.w3.weight))
    torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


def test_block_submodules_and_errors():
    block = TransformerBlock(32, 4, 48, 16, 10000.0)
    assert {n for n, _ in block.named_children()} == {"ln1", "attn", "ln2", "ffn"}
    with pytest.raises(ValueError, match="even"):
        TransformerBlock(36, 4, 48, 16, 10000.0)  # head dim 9 with RoPE
    TransformerBlock(36, 4, 48, 16, None)  # fine without RoPE
    with pytest.raises(ValueError, match="'batchnorm'"):
        TransformerBlock(32, 4, 48, 16, norm="batchnorm")
    with pytest.raises(ValueError, match="'middle'"):
        TransformerBlock(32, 4, 48, 16, norm_placement="middle")
    with pytest.raises(ValueError, match="'tanh'"):
        TransformerBlock(32, 4, 48, 16, ffn="tanh")


@pytest.mark.parametrize("chunk_size", [1, 7, 256])
def test_linear_cross_entropy_matches_unfused(chunk_size):
    x = torch.randn(3, 10, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (3, 10))
    loss = linear_cross_entropy(x, w, t, chunk_size=chunk_size)
    gx, gw = torch.autograd.grad(loss * 3.0, (x, w))
    ref = F.cross_entropy((x @ w.T).reshape(-1, 50), t.reshape(-1))
    rgx, rgw = torch.autograd.grad(ref * 3.0, (x, w))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(gx, rgx)
    torch.testing.assert_close(gw, rgw)


@pytest.mark.parametrize("eps, ignore", [(0.0, None), (0.1, -100)])
def test_linear_cross_entropy_under_bfloat16_autocast_is_as_exact_as_unfused(eps, ignore):
    """Under autocast the fused loss does its three matmuls in bfloat16, as autocast does for the
    unfused ``x @ w.T``; its loss and gradients must be as close to the float64 truth as the
    unfused autocast ones (the worst of 20 seeds measured 1.35x the unfused error; 1.5x is allowed)."""
    torch.manual_seed(0)
    x = torch.randn(300, 64, requires_grad=True)
    w = (torch.randn(500, 64) * 0.2).requires_grad_()
    t = torch.randint(0, 500, (300,))
    if ignore is not None:
        t[::5] = ignore
    kw = dict(label_smoothing=eps, ignore_index=ignore if ignore is not None else -100)

    def unfused(x, w):
        return F.cross_entropy((x @ w.T).float(), t, **kw)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exact = unfused(x64, w64)
    exact_grads = torch.autograd.grad(exact, (x64, w64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_loss = linear_cross_entropy(x, w, t, chunk_size=64, **kw)
        ref_loss = unfused(x, w)
    fused_grads = torch.autograd.grad(fused_loss, (x, w))
    ref_grads = torch.autograd.grad(ref_loss, (x, w))
    assert fused_grads[1].dtype == torch.float32
    err = lambda a, b: float((a.double() - b).abs().max())  # noqa: E731
    assert err(fused_loss, exact) <= 1.5 * err(ref_loss, exact) + 1e-6
    for fused, ref, truth in zip(fused_grads, ref_grads, exact_grads):
        assert err(ref, truth) > 0  # autocast did round: the comparison means something
        assert err(fused, truth) <= 1.5 * err(ref, truth), (err(fused, truth), err(ref, truth))


def test_linear_cross_entropy_without_grad_and_large_logits():
    x = torch.randn(4, 8) * 1e3
    w = torch.randn(20, 8)
    t = torch.randint(0, 20, (4,))
    with torch.no_grad():
        out = linear_cross_entropy(x, w, t)
    assert torch.isfinite(out)
    torch.testing.assert_close(out, F.cross_entropy((x @ w.T).double(), t).float())


def test_linear_cross_entropy_never_holds_the_logits():
    """The docstring's claim, measured: forward and backward of the fused loss peak well below the
    size of the (tokens x vocab) float32 logits, which the unfused loss does allocate."""
    n, d, vocab, chunk = 2048, 32, 2048, 128
    x = torch.randn(n, d, requires_grad=True)
    w = torch.randn(vocab, d, requires_grad=True)
    t = torch.randint(0, vocab, (n,))
    logits_bytes = n * vocab * 4  # 16 MiB
    with LiveTensorBytes() as fused:
        linear_cross_entropy(x, w, t, chunk_size=chunk).backward()
    with LiveTensorBytes() as unfused:
        F.cross_entropy(x @ w.T, t).backward()
    assert unfused.peak >= logits_bytes  # the meter does see the logits when they are made
    # measured 4.0 MiB: four 1 MiB chunks (two chunks of logits and probabilities overlap) and the gradients
    assert fused.peak < logits_bytes / 2, (fused.peak, logits_bytes)
    assert fused.peak < 5 * chunk * vocab * 4 + 4 * (n * d + vocab * d) * 4


def test_cross_entropy_bfloat16_logits():
    logits = (torch.randn(6, 30) * 5).bfloat16().requires_grad_()
    t = torch.randint(0, 30, (6,))
    loss = cross_entropy(logits, t)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), t))
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def test_rope_tables_stay_float32_when_the_model_is_cast():
    block = TransformerBlock(32, 4, 48, 64, 10000.0)
    block.to(torch.bfloat16)
    assert block.attn.rope.cos.dtype == torch.float32 and block.attn.rope.sin.dtype == torch.float32
    torch.testing.assert_close(block.attn.rope.cos, RotaryEmbedding(10000.0, 8, 64).cos)
    assert block(torch.randn(2, 5, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_dropout_statistics():
    from lm.nn import dropout

    torch.manual_seed(0)
    x = torch.randn(200_000)
    y = dropout(x, 0.25)
    zeroed = (y == 0).float().mean().item()
    assert abs(zeroed - 0.25) < 0.005  # 5 sigma is about 0.005 at n = 200,000
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    assert abs(y.mean().item() - x.mean().item()) < 0.01  # expectation kept
    assert dropout(x, 0.25, training=False) is x and dropout(x, 0.0) is x


# -- argument checks: what torch refuses, these layers refuse too (no host sync on the hot path) ----


def test_cross_entropy_losses_refuse_float_targets():
    """``.long()`` truncated float targets (1.7 → class 1) into a plausible loss; torch refuses them."""
    from lm.model import TransformerLM

    logits, targets = torch.randn(4, 7), torch.full((4,), 1.7)
    with pytest.raises(RuntimeError):
        F.cross_entropy(logits, targets)
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        cross_entropy(logits, targets)
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(7, 8), targets)
    model = TransformerLM(16, 8, 16, 1, 2, 32)
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        model.loss(torch.randint(0, 16, (2, 5)), torch.full((2, 5), 1.7))
    # integer targets of any integer dtype still give torch's loss
    t = torch.randint(0, 7, (4,))
    for dtype in (torch.int64, torch.int32, torch.uint8):
        torch.testing.assert_close(cross_entropy(logits, t.to(dtype)), F.cross_entropy(logits, t))


def test_the_loss_chunk_is_256_eager_on_a_cpu_and_otherwise_what_a_gib_of_logits_holds():
    """loss_chunk_size, by its formula: eager on a CPU 256 tokens; compiled, as many as a GiB holds of
    their float32 logits, probabilities and gradient (12 bytes a vocabulary entry), but no more than
    there are and no fewer than 256 (mutations: the vocabulary divided instead of multiplied, and the
    floor 257, survived: the chunk changes the memory, not the loss)."""
    from lm.nn.functional import loss_chunk_size

    cpu = torch.device("cpu")
    assert loss_chunk_size(10**6, 50257, cpu) == 256
    assert loss_chunk_size(10**6, 50257, cpu, compiling=True) == 2**30 // (12 * 50257) == 1780
    assert loss_chunk_size(1000, 50257, cpu, compiling=True) == 1000  # every token, when they fit
    assert loss_chunk_size(100, 50257, cpu, compiling=True) == 256
    assert loss_chunk_size(10**6, 10**6, cpu, compiling=True) == 256  # a GiB holds 89 of these


def test_linear_cross_entropy_checks_target_shape_and_chunk_size():
    x, w = torch.randn(2, 5, 8), torch.randn(7, 8)
    t = torch.randint(0, 7, (2, 5))
    with pytest.raises(ValueError, match=r"^targets must have shape \(2, 5\) \(that of x without its last "
                                         r"dimension\), got \(5, 2\)$"):
        linear_cross_entropy(x, w, t.T.contiguous())  # as many targets, beside the wrong rows
    with pytest.raises(ValueError, match=r"^targets must have shape \(4,\) \(that of logits without its last "
                                         r"dimension\), got \(3,\)$"):
        cross_entropy(torch.randn(4, 7), torch.randint(0, 7, (3,)))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            linear_cross_entropy(x, w, t, chunk_size=bad)
    expected = F.cross_entropy((x @ w.T).reshape(-1, 7), t.reshape(-1))
    torch.testing.assert_close(linear_cross_entropy(x, w, t, chunk_size=3), expected)


@pytest.mark.parametrize("ignore_index", [None, -100, 3])
def test_cross_entropy_losses_name_out_of_range_targets(ignore_index):
    """A target outside the vocabulary raised the gather's "index 7 is out of bounds for dimension 1
    with size 7" (torch: "Target 7 is out of bounds"); now a ValueError naming targets and the value,
    read back only once the loss has failed (no host read when the targets are good)."""
    from helpers.host_reads import HostReads

    x, w = torch.randn(4, 8), torch.randn(7, 8)
    kw = {} if ignore_index is None else {"ignore_index": ignore_index}
    also = "" if ignore_index is None else rf" or ignore_index={ignore_index}"
    for bad in (7, -1, -100, 1000):
        if bad == ignore_index:
            continue
        t = torch.tensor([0, bad, 2, bad])
        message = rf"^targets must be in \[0, vocab_size=7\){also}, got target {bad}$"
        with pytest.raises(ValueError, match=message):
            cross_entropy(x @ w.T, t, **kw)
        for chunk_size in (1, 3, None):
            with pytest.raises(ValueError, match=message):
                linear_cross_entropy(x, w, t, chunk_size, **kw)
    t = torch.tensor([0, 6, 2, 3 if ignore_index is None else ignore_index])
    with HostReads() as reads:
        loss = cross_entropy(x @ w.T, t, **kw)
        fused = linear_cross_entropy(x, w, t, **kw)
    assert reads.reads == []
    expected = F.cross_entropy(x @ w.T, t, ignore_index=-100 if ignore_index is None else ignore_index)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(fused, expected)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("fused", [False, True])
def test_ignored_positions_do_not_contribute_at_all(eps, fused):
    """Ignored positions were multiplied by 0, so a NaN or inf logit there made the loss NaN, and an
    all-ignored batch had NaN gradients (0 · g / 0); torch leaves them out: a finite loss, and zero
    gradients when every position is ignored (its loss NaN, as torch's). Unlike torch, the ignored
    rows of the logits get a zero gradient even where they are NaN."""
    torch.manual_seed(0)
    kw = dict(label_smoothing=eps, ignore_index=-100)
    w = torch.randn(11, 8, requires_grad=True)

    def losses(x, t):  # ours and torch's; x is the logits, or with fused the rows that make them
        if fused:
            return linear_cross_entropy(x, w, t, 2, **kw), F.cross_entropy(x @ w.T, t, **kw)
        return cross_entropy(x, t, **kw), F.cross_entropy(x, t, **kw)

    x = torch.randn(5, 8 if fused else 11)
    x[1], x[3] = float("nan"), float("inf")  # NaN and ±inf logits at the ignored positions
    x.requires_grad_()
    t = torch.tensor([1, -100, 4, -100, 10])
    ours, ref = losses(x, t)
    assert torch.isfinite(ref)
    torch.testing.assert_close(ours, ref)
    # torch's gradient where counted, zero where ignored (torch's is NaN there: its log-softmax
    # backward multiplies the zero upstream gradient by exp(NaN))
    (g,), (g_ref,) = torch.autograd.grad(ours, x), torch.autograd.grad(ref, x)
    kept = t != -100
    torch.testing.assert_close(g[kept], g_ref[kept])
    assert torch.equal(g[~kept], torch.zeros_like(g[~kept]))
    # every position ignored: loss NaN and gradients 0, as torch
    x = torch.randn_like(x, requires_grad=True)
    ours, ref = losses(x, torch.full_like(t, -100))
    assert ours.isnan() and ref.isnan()
    inputs = (x, w) if fused else (x,)
    for a, b in zip(torch.autograd.grad(ours, inputs), torch.autograd.grad(ref, inputs)):
        assert torch.equal(b, torch.zeros_like(b)) and torch.equal(a, b)


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
def test_sdpa_query_that_attends_nothing_gets_zeros_as_in_torch(impl):
    """A fully masked row is 0 in torch's kernel; the einsum path gave NaN. Its fix (clamping the
    softmax's max and sum) must leave every other row's bits as the plain formula gives them."""
    q, k, v = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 5)
    mask = torch.rand(2, 3, 6, 9) > 0.5
    mask[..., 0] = True
    mask[:, :, 2] = False  # query 2 may attend nothing
    mask[1, 0, 4] = False
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product_attention(*inputs, mask, impl=impl)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(expected[:, :, 2], torch.zeros(2, 3, 5))  # torch's contract
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[:, :, 2], torch.zeros(2, 3, 5)) and torch.equal(out[1, 0, 4], torch.zeros(5))
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), inputs))
    if impl == "einsum":  # the rows that attend something: the bits of the formula before the fix
        scores = torch.einsum("...qd,...kd->...qk", q * (1.0 / math.sqrt(8)), k).masked_fill(~mask, float("-inf"))
        plain = torch.einsum("...qk,...kd->...qd", softmax(scores, -1), v)
        attends = mask.any(-1)
        assert torch.equal(out.detach()[attends], plain[attends])
    # causal with more queries than keys: the first queries come before every key
    q5 = torch.randn(2, 5, 8)
    out = scaled_dot_product_attention(q5, k[0, :1, :3], v[0, :1, :3], is_causal=True, impl=impl)
    expected = F.scaled_dot_product_attention(q5, k[0, :1, :3], v[0, :1, :3], attn_mask=lm.nn.causal_mask(5, 3))
    assert torch.equal(out[:, :2], torch.zeros(2, 2, 5))
    torch.testing.assert_close(out, expected)


def test_causal_mask_against_tril_and_its_bad_lengths():
    """The mask is torch.tril shifted so the queries are the last q_len keys' positions; a
    negative, fractional or boolean length is named (arange had raised about its bounds, or
    given an empty mask of another shape than asked for)."""
    for q_len, k_len in [(3, 3), (1, 4), (2, 5), (5, 3), (0, 2), (2, 0)]:
        expected = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        assert torch.equal(lm.nn.causal_mask(q_len, k_len), expected)
    for args, message in [
        ((-1, 3), "q_len must be a whole number >= 0, got q_len=-1"),
        ((2.5, 3), "q_len must be a whole number >= 0, got q_len=2.5"),
        ((True, 3), "q_len must be a whole number >= 0, got q_len=True"),
        ((2, -1), "k_len must be a whole number >= 0, got k_len=-1"),
    ]:
        with pytest.raises(ValueError) as info:
            lm.nn.causal_mask(*args)
        assert str(info.value) == message


@pytest.mark.parametrize("impl", ["einsum", "sdpa"])
def test_sdpa_refuses_a_non_boolean_mask(impl):
    """The contract is a boolean mask: torch's kernel would add a float one as a bias, einsum failed."""
    q = torch.randn(2, 4, 8)
    for mask in (torch.zeros(4, 4), torch.ones(4, 4, dtype=torch.long)):
        with pytest.raises(TypeError, match="mask must be a boolean tensor"):
            scaled_dot_product_attention(q, q, q, mask, impl=impl)


def test_sdpa_einsum_float64_stays_float64():
    """The softmax is upcast to float32 for half inputs, never downcast from float64."""
    q, k, v = (torch.randn(2, 5, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 5, 5) > 0.3
    mask[..., 0] = True
    out = scaled_dot_product_attention(q, k, v, mask, impl="einsum")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, atol=1e-13, rtol=1e-13)


@pytest.mark.parametrize("grad", [True, False])
def test_embedding_refuses_float_and_out_of_range_ids(grad):
    """With or without autograd, as F.embedding: integer ids only, and -1 does not wrap to the last row.
    An id out of range is an IndexError as F.embedding's, naming the argument, the bound and the id
    (it was the kernel's "index out of range in self")."""
    emb = Embedding(10, 3)
    with torch.set_grad_enabled(grad):
        ids = torch.tensor([[0, 9, 3], [3, 3, 1]])
        for dtype in (torch.int64, torch.int32, torch.uint8):
            assert torch.equal(emb(ids.to(dtype)), F.embedding(ids, emb.weight))
        for bad in (torch.tensor([-1]), torch.tensor([10])):
            with pytest.raises(IndexError):
                F.embedding(bad, emb.weight)
            with pytest.raises(IndexError, match=rf"^token_ids must be in \[0, num_embeddings=10\), got {int(bad)}$"):
                emb(bad)
        for bad in (torch.tensor([1.7]), torch.tensor([True])):
            with pytest.raises(TypeError, match="token_ids must be an integer tensor"):
                emb(bad)


def test_rope_checks_arguments_and_positions():
    """theta = 0 built NaN tables; position -1 read max_seq_len - 1's angles."""
    for theta in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="theta must be a positive finite number"):
            RotaryEmbedding(theta, 8, 4)
    with pytest.raises(ValueError, match="d_k"):
        RotaryEmbedding(10000.0, 0, 4)
    for n in (0, -3):
        with pytest.raises(ValueError, match="max_seq_len"):
            RotaryEmbedding(10000.0, 8, n)
    rope = RotaryEmbedding(10000.0, 8, 4)
    x = torch.randn(2, 8)
    for bad, shown in (([-1, 0], -1), ([0, 4], 4)):
        with pytest.raises(IndexError, match=rf"^token_positions must be in \[0, max_seq_len=4\), got {shown}$"):
            rope(x, torch.tensor(bad))
    with pytest.raises(TypeError, match="token_positions must be an integer tensor"):
        rope(x, torch.tensor([0.0, 1.7]))
    positions = torch.tensor([3, 0])
    for dtype in (torch.int64, torch.int32, torch.uint8):
        torch.testing.assert_close(rope(x, positions.to(dtype)), rope_loop(x, positions, 10000.0), atol=1e-6, rtol=0)


def test_dropout_checks_p_and_drops_everything_at_one():
    from lm.nn import dropout

    x = torch.randn(1000)
    assert torch.equal(dropout(x, 1.0), F.dropout(x, 1.0))  # zeros (torch's x * 0), not 0 / 0
    for p in (-0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout p must be in"):
            dropout(x, p)
        with pytest.raises(ValueError, match="dropout p must be in"):
            dropout(x, p, training=False)  # as torch: checked whatever the mode


def test_block_num_heads_zero_is_the_attention_value_error():
    with pytest.raises(ValueError, match="num_heads=0"):
        TransformerBlock(32, 0, 48, 16, 10000.0)
    with pytest.raises(ValueError, match="num_heads=-4"):
        TransformerBlock(32, -4, 48, 16, 10000.0)


@pytest.mark.parametrize("build, message", [
    (lambda: lm.nn.MultiHeadAttention(16, 2.0), "num_heads must be a positive integer, got num_heads=2.0"),
    (lambda: lm.nn.MultiHeadAttention(16, True), "num_heads must be a positive integer, got num_heads=True"),
    (lambda: lm.nn.MultiHeadAttention(0, 2), "d_model must be a positive integer, got d_model=0"),
    (lambda: lm.nn.RMSNorm(4, eps=-1), "eps must be a positive finite number, got eps=-1"),
    (lambda: lm.nn.RMSNorm(4, eps=float("nan")), "eps must be a positive finite number, got eps=nan"),
    (lambda: lm.nn.LayerNorm(4, eps=0.0), "eps must be a positive finite number, got eps=0.0"),
    (lambda: lm.nn.RMSNorm(4.0), "d_model must be a positive integer, got d_model=4.0"),
    (lambda: lm.nn.Linear(8, 0), "out_features must be a positive integer, got out_features=0"),
    (lambda: lm.nn.Linear(-3, 8), "in_features must be a positive integer, got in_features=-3"),
    (lambda: lm.nn.Embedding(10, 8.5), "embedding_dim must be a positive integer, got embedding_dim=8.5"),
    (lambda: lm.nn.SwiGLU(16, 0), "d_ff must be a positive integer, got d_ff=0"),
    (lambda: lm.nn.RotaryEmbedding(10000.0, 8, 0), "max_seq_len must be a positive integer, got max_seq_len=0"),
    # each layer names its own argument (mutation: LayerNorm's and MLP's "d_model" in capitals, ffn_hidden_dim's
    # "ffn" dropped, the rope-width message emptied, survived)
    (lambda: lm.nn.LayerNorm(0), "d_model must be a positive integer, got d_model=0"),
    (lambda: lm.nn.MLP(0, 16), "d_model must be a positive integer, got d_model=0"),
    (lambda: lm.nn.ffn.ffn_hidden_dim(16, "geglu"),
     "ffn must be one of ('swiglu', 'silu', 'relu', 'gelu'), got 'geglu'"),
    (lambda: lm.nn.MultiHeadAttention(32, 4, lm.nn.RotaryEmbedding(10000.0, 16, 8)),
     "rope.d_k must equal the head dimension 8, got 16"),
])
def test_layers_refuse_sizes_and_eps_when_built(build, message):
    """The layers checked less than the configs: MultiHeadAttention(16, 2.0) failed only at its first
    forward (a reshape TypeError), RMSNorm(4, eps=-1) computed NaN, Linear(8, 0) built an empty layer."""
    with pytest.raises(ValueError) as e:
        build()
    assert str(e.value) == message


def test_norms_rope_and_losses_compute_float64_inputs_in_float64():
    """They computed in float32 even for float64 inputs (the attention already kept float64), so
    torch.autograd.gradcheck, the usual way to check a hand-written layer, failed on every one of
    them and their float64 outputs were float32-accurate. Checked against float64 formulas here."""
    from torch.autograd import gradcheck

    from lm.nn.functional import cross_entropy, linear_cross_entropy

    torch.manual_seed(0)
    f64 = torch.float64
    x = torch.randn(2, 3, 8, dtype=f64, requires_grad=True)
    rms, ln = RMSNorm(8, dtype=f64), LayerNorm(8, dtype=f64)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5), ln.weight.uniform_(0.5, 1.5), ln.bias.uniform_(-0.5, 0.5)
    rope = lm.nn.RotaryEmbedding(10000.0, 8, 16).double()
    pos = torch.tensor([[0, 5, 15], [1, 2, 3]])
    assert rope.cos.dtype == f64  # built from the angles in float64, not float32 tables widened
    angles = pos[..., None].double() * 10000.0 ** (-torch.arange(0, 8, 2, dtype=f64) / 8)
    xe, xo = x[..., 0::2], x[..., 1::2]
    rope_ref = torch.stack((xe * angles.cos() - xo * angles.sin(), xe * angles.sin() + xo * angles.cos()), -1)
    mean = x.mean(-1, keepdim=True)
    cases = [
        (rms, x * (x.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * rms.weight),
        (ln, (x - mean) / ((x - mean).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * ln.weight + ln.bias),
        (lambda t: rope(t, pos), rope_ref.flatten(-2)),
    ]
    for layer, expected in cases:
        out = layer(x)
        assert out.dtype == f64
        torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)
        assert gradcheck(layer, (x,))
    logits = torch.randn(6, 11, dtype=f64, requires_grad=True)
    w = torch.randn(11, 8, dtype=f64, requires_grad=True)
    h = torch.randn(6, 8, dtype=f64, requires_grad=True)
    t = torch.tensor([0, 6, 2, 3, 10, 1])
    expected = -torch.log_softmax(logits, -1)[torch.arange(6), t].mean()
    assert cross_entropy(logits, t).dtype == f64
    torch.testing.assert_close(cross_entropy(logits, t), expected, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk_size=4),
                               -torch.log_softmax(h @ w.T, -1)[torch.arange(6), t].mean(), rtol=1e-13, atol=1e-13)
    assert gradcheck(lambda z: cross_entropy(z, t, label_smoothing=0.1), (logits,))
    assert gradcheck(lambda a, b: linear_cross_entropy(a, b, t, chunk_size=4, label_smoothing=0.1), (h, w))


def test_batch_invariant_blocks_of_two_threads_leave_the_switch_off():
    """Each block restored what it found: thread A in, thread B in (finding it on), A out (off), B out
    (restoring on) left the process batch-invariant for good, and every later model took the einsum
    attention instead of sdpa (a fresh-clone CI run found it after two threads' compiled generate calls)."""
    import threading

    from lm.nn import functional

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with functional.batch_invariant(matmuls=True):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with functional.batch_invariant(matmuls=False):
            b_in.set()
            a_out.wait(10)
            seen["b alone"] = functional._batch_invariant  # A has left: B's own setting
    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"b alone": (True, False)} and functional._batch_invariant == (False, False)
    with functional.batch_invariant(), functional.batch_invariant(matmuls=False):  # nested, one thread
        assert functional._batch_invariant == (True, True)
    assert functional._batch_invariant == (False, False)


def test_the_layers_default_to_the_hand_written_attention_and_the_models_to_sdpa(monkeypatch):
    """API.md: lm.nn is hand-written, no torch.nn.functional; the attention layers defaulted to torch's
    fused kernel all the same. Now they default to the einsum; the model configs choose sdpa."""
    from lm.model import TransformerLM

    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    x = torch.randn(2, 5, 16)
    MultiHeadSelfAttention(16, 2)(x)
    lm.nn.MultiHeadAttention(16, 2, causal=False)(x, context=torch.randn(2, 3, 16))
    lm.nn.TransformerBlock(16, 2, 32, 8)(x)
    lm.nn.DecoderBlock(16, 2, 32)(x, torch.randn(2, 3, 16))
    assert calls == []
    TransformerLM(50, 8, 16, 2, 2, 32)(torch.randint(0, 50, (2, 5)))
    assert len(calls) == 2  # one a layer


def test_blocks_check_dropout_and_ffn_hidden_dim_checks_its_sizes():
    """TransformerBlock(dropout=1.5) was built and failed only in training mode (an eval-mode model
    carried it silently); ffn_hidden_dim(16, "swiglu", 0) divided by zero and (16.5) gave a width of 44.0
    (apifuzz19 #17, #18). The messages are ModelConfig's."""
    from lm.nn import TransformerBlock
    from lm.nn.block import DecoderBlock
    from lm.nn.ffn import ffn_hidden_dim

    for bad in (1.0, 1.5, -0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"^dropout must be a number in \[0, 1\), got "):
            TransformerBlock(16, 2, 32, 16, dropout=bad)
        with pytest.raises(ValueError, match=r"^dropout must be a number in \[0, 1\), got "):
            DecoderBlock(16, 2, 32, dropout=bad)
    assert TransformerBlock(16, 2, 32, 16, dropout=0.1).dropout == 0.1
    for args, message in (((16, "swiglu", 0), "multiple_of must be a positive integer, got multiple_of=0"),
                          ((16.5,), "d_model must be a positive integer, got d_model=16.5"),
                          ((0, "gelu"), "d_model must be a positive integer, got d_model=0")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            ffn_hidden_dim(*args)
    assert (ffn_hidden_dim(256), ffn_hidden_dim(256, "gelu"), ffn_hidden_dim(100, "swiglu", 8)) == (704, 1024, 272)


def test_a_dtype_that_is_not_a_torch_floating_dtype_is_refused_by_name():
    """Linear(4, 3, dtype='float32') and dtype=torch.int64 failed inside torch ("Only Tensors of floating
    point ... can require gradients", apifuzz19 #21); every layer that takes a dtype now says what it needs,
    and for a name, to pass the torch.dtype."""
    from lm.nn import DecoderBlock
    from lm.nn.attention import MultiHeadAttention

    layers = {
        "Linear": lambda dtype: Linear(4, 3, dtype=dtype),
        "Embedding": lambda dtype: Embedding(10, 4, dtype=dtype),
        "RMSNorm": lambda dtype: RMSNorm(4, dtype=dtype),
        "LayerNorm": lambda dtype: LayerNorm(4, dtype=dtype),
        "SwiGLU": lambda dtype: SwiGLU(4, 8, dtype=dtype),
        "MLP": lambda dtype: MLP(4, 8, dtype=dtype),
        "MultiHeadAttention": lambda dtype: MultiHeadAttention(8, 2, dtype=dtype),
        "MultiHeadSelfAttention": lambda dtype: MultiHeadSelfAttention(8, 2, dtype=dtype),
        "TransformerBlock": lambda dtype: TransformerBlock(8, 2, 16, 16, 10000.0, dtype=dtype),
        "DecoderBlock": lambda dtype: DecoderBlock(8, 2, 16, dtype=dtype),
    }
    for name, make in layers.items():
        for bad, hint in (("float32", " (pass torch.float32, not its name)"), ("bfloat16", " (pass torch.bfloat16, "
                          "not its name)"), (torch.int64, ""), (torch.bool, ""), ("int64", ""), (32, "")):
            with pytest.raises(ValueError) as e:
                make(bad)
            assert str(e.value) == (f"dtype must be a torch floating dtype such as torch.bfloat16 or None, "
                                    f"got dtype={bad!r}{hint}"), name
        for good in (None, torch.float64, torch.bfloat16):
            layer = make(good)
            assert all(p.dtype == (good or torch.float32) for p in layer.parameters()), name


def test_norms_and_rope_refuse_integer_activations():
    """RMSNorm(4)(an int64 tensor) computed in float32 and rounded the result back to integers: all zeros;
    RoPE truncated its rotation the same way (apifuzz19 #25). Activations are floating-point."""
    from lm.nn import LayerNorm, RMSNorm, RotaryEmbedding

    ints = torch.ones(1, 2, 4, dtype=torch.long)
    for name, call in (("RMSNorm", lambda x: RMSNorm(4)(x)), ("LayerNorm", lambda x: LayerNorm(4)(x)),
                       ("RoPE", lambda x: RotaryEmbedding(10000.0, 4, 8)(x, torch.arange(2)))):
        with pytest.raises(ValueError, match=r"^x must be a floating-point tensor \(activations\), got dtype "
                                             r"torch\.int64$"):
            call(ints)
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            assert call(ints.to(dtype)).dtype == dtype, (name, dtype)


def test_layers_name_an_input_of_the_wrong_width():
    """A Linear, a norm or RoPE given an input of another width than it was built for raised einsum's
    "subscript a has size 4 for operand 1 which does not broadcast with previously seen size 5" or a
    broadcast error, naming neither the argument nor the layer's size (apifuzz19); RoPE's positions of
    another length than x's seq raised a broadcast error. The right widths still give torch's results."""
    from lm.nn import LayerNorm, Linear, MultiHeadSelfAttention, RMSNorm, RotaryEmbedding, SwiGLU

    wrong = torch.randn(2, 3, 5)
    for layer, what in ((Linear(4, 3), "in_features=4"), (SwiGLU(4, 8), "in_features=4"),
                        (MultiHeadSelfAttention(4, 2), "in_features=4"), (RMSNorm(4), "d_model=4"),
                        (LayerNorm(4), "d_model=4")):
        with pytest.raises(ValueError) as info:
            layer(wrong)
        assert str(info.value) == f"x must have the last dimension {what}, got shape (2, 3, 5)", type(layer).__name__
    linear = Linear(4, 3)
    with pytest.raises(ValueError, match=r"^x must have the last dimension in_features=4, got shape \(\)$"):
        linear(torch.tensor(1.0))
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(linear(x), x @ linear.weight.T)
    torch.testing.assert_close(LayerNorm(4)(x), torch.nn.functional.layer_norm(x, (4,)))
    rope = RotaryEmbedding(10000.0, 4, 8)
    with pytest.raises(ValueError, match=r"^x must have the last dimension d_k=4, got shape \(2, 3, 6\)$"):
        rope(torch.randn(2, 3, 6), torch.arange(3))
    with pytest.raises(ValueError, match=r"^token_positions must hold one position for each of x's seq rows "
                                         r"\(x: \(\.\.\., seq, d_k\)\), got shape \(4,\) for x of shape \(2, 3, 4\)$"):
        rope(x, torch.arange(4))
    assert torch.equal(rope(x, torch.arange(3)), rope(x, torch.arange(3).expand(2, 3)))


def test_second_derivatives_through_the_losses_and_the_embedding_are_torchs():
    """api22: the hand-written backward passes of cross_entropy, linear_cross_entropy and Embedding were
    once_differentiable, so a gradient penalty through the loss (create_graph=True, then a second
    backward) got a plausible wrong number: 9.88e-2 where F.cross_entropy gives 1.10e-1. Now they are
    differentiated again: gradgradcheck passes, and the penalty's gradient is torch's."""
    from lm.data.batch import LMBatch
    from lm.model import TransformerLM
    from lm.nn.embedding import _EmbeddingLookup

    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 3, 6, 2])
    assert torch.autograd.gradgradcheck(lambda lg: cross_entropy(lg, t, label_smoothing=0.1, ignore_index=3), (logits,))
    assert torch.autograd.gradgradcheck(lambda lg: cross_entropy(lg, t), (logits,))
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    tt = torch.tensor([1, 2, 6, 0, 4])
    assert torch.autograd.gradgradcheck(
        lambda a, b: linear_cross_entropy(a, b, tt, label_smoothing=0.2, ignore_index=2, chunk_size=2), (x, w))
    table = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda wt: _EmbeddingLookup.apply(wt, torch.tensor([1, 1, 4])) ** 2, (table,))

    torch.manual_seed(0)
    model = TransformerLM(50, 16, 16, 1, 2, 32, 10000.0, attn_impl="einsum").double()
    ids = torch.randint(0, 50, (2, 9))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def penalty_grad(loss):  # d/dw1 of the squared norm of the output and embedding gradients
        gs = torch.autograd.grad(loss, [model.lm_head.weight, model.token_embeddings.weight], create_graph=True)
        return torch.autograd.grad(sum(g.pow(2).sum() for g in gs), model.layers[0].ffn.w1.weight)[0]

    want = penalty_grad(F.cross_entropy(model(inputs).reshape(-1, 50), targets.reshape(-1)))
    torch.testing.assert_close(penalty_grad(cross_entropy(model(inputs), targets)), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(penalty_grad(model(batch=LMBatch(inputs, targets))), want, rtol=1e-10, atol=1e-12)


def test_a_scaled_loss_backward_with_create_graph_gives_torchs_scaled_gradients():
    """With create_graph=True the backward passes of cross_entropy and linear_cross_entropy recompute
    the gradient with differentiable operations; the incoming gradient (3 for 3 * loss, or the weight
    of a sum of losses) must scale it there too. gradgradcheck does not see it: it checks the second
    derivatives of whatever the first-order pass computes."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([1, 2, 6, 0, 4])
    for smoothing in (0.0, 0.2):
        want = torch.autograd.grad(3 * F.cross_entropy(x @ w.T, t, label_smoothing=smoothing), (x, w))
        got = torch.autograd.grad(3 * linear_cross_entropy(x, w, t, label_smoothing=smoothing, chunk_size=2), (x, w),
                                  create_graph=True)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
        logits = (x @ w.T).detach().requires_grad_()
        (want,) = torch.autograd.grad(3 * F.cross_entropy(logits, t, label_smoothing=smoothing), logits)
        (got,) = torch.autograd.grad(3 * cross_entropy(logits, t, label_smoothing=smoothing), logits, create_graph=True)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_attention_with_rope_on_more_positions_than_its_tables_names_them():
    """api22: MultiHeadSelfAttention with a RoPE of max_seq_len 4 on 6 tokens (default positions) had
    raised a bare 'IndexError: index out of range in self'; the length is a shape, checked for free."""
    rope = lm.nn.RotaryEmbedding(10000.0, 4, max_seq_len=4)
    attn = lm.nn.MultiHeadSelfAttention(8, 2, rope=rope)
    assert attn(torch.randn(1, 4, 8)).shape == (1, 4, 8)
    with pytest.raises(ValueError, match=r"^x has 6 positions, more than the rope's max_seq_len=4$"):
        attn(torch.randn(1, 6, 8))


def test_the_layers_argument_errors_name_the_argument_and_a_decoders_cross_attention_says_it_is_not_causal():
    """Each constructor's refusal in full; the decoder block's cross-attention is built non-causal, as
    its printed form says (its forward never masks the memory causally either way)."""
    from lm.nn.attention import MultiHeadAttention
    from lm.nn.block import DecoderBlock, make_norm
    from lm.nn.ffn import MLP

    for make, message in (
            (lambda: MultiHeadAttention(8, 2, attn_impl="flash"), "attn_impl must be one of ('einsum', 'sdpa'), got "
                                                                  "'flash'"),
            (lambda: MultiHeadAttention(8, 2, dtype=torch.int64),
             "dtype must be a torch floating dtype such as torch.bfloat16 or None, got dtype=torch.int64"),
            (lambda: MLP(8, 16, activation="tanh"), "activation must be one of ('silu', 'relu', 'gelu'), got 'tanh'"),
            (lambda: make_norm("batchnorm", 8), "norm must be one of ('rmsnorm', 'layernorm', 'none'), got "
                                                "'batchnorm'")):
        with pytest.raises(ValueError) as e:
            make()
        assert str(e.value) == message
    block = DecoderBlock(8, 2, 16)
    assert (block.self_attn.causal, block.cross_attn.causal) == (True, False)
    assert "attn_impl='einsum', causal=False" in repr(block.cross_attn)


def test_after_import_runs_its_callback_once_when_the_module_is_imported_and_leaves_no_finder(tmp_path,
                                                                                              monkeypatch):
    """lm.nn.functional marks its einops wrappers for torch.compile when torch._dynamo is imported,
    not at its own import (which had imported dynamo: 2.4 s). The hook, on a package made here: not
    called before the import, called once after the package has run (its names are there), at once
    for a module already imported, and the finder is gone from sys.meta_path afterwards."""
    import sys

    from lm.nn.functional import _after_import

    (tmp_path / "lm_probe_pkg").mkdir()
    (tmp_path / "lm_probe_pkg" / "__init__.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # restored whatever happens
    seen = []
    _after_import("lm_probe_pkg", lambda: seen.append(sys.modules["lm_probe_pkg"].VALUE))
    before = list(sys.meta_path)
    assert seen == [] and type(before[0]).__name__ == "Finder"
    import lm_probe_pkg

    try:
        assert seen == [42] and lm_probe_pkg.VALUE == 42
        assert sys.meta_path == before[1:]  # this hook's finder gone, nothing else changed
        _after_import("lm_probe_pkg", lambda: seen.append("again"))
        assert seen == [42, "again"]
    finally:
        del sys.modules["lm_probe_pkg"]


def test_a_failure_to_mark_einops_for_compile_is_a_warning_not_a_failed_dynamo_import(monkeypatch):
    from lm.nn import functional as lmf

    def refuse(fn):
        raise RuntimeError("no such rule")

    monkeypatch.setattr(torch.compiler, "allow_in_graph", refuse)
    with pytest.warns(RuntimeWarning, match=r"^lm: rearrange and einsum not marked for torch.compile "
                                            r"\(RuntimeError\('no such rule'\)\): compiling traces into einops"):
        lmf._mark_for_compile()

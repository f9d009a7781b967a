"""Independent reference formulas for the tests and for scripts/make_fixtures.py.

Written with ``torch.nn.functional`` and plain Python loops, deliberately *not* with any
code from ``lm``, so that agreement means something.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rope_loop(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE one pair at a time: rotate ``(x[2i], x[2i+1])`` by ``pos · theta^(-2i/d)`` (float64)."""
    d = x.shape[-1]
    out = x.double().clone()
    pos = positions.double().expand(x.shape[:-1])
    for i in range(d // 2):
        angle = pos * theta ** (-2 * i / d)
        a, b = x[..., 2 * i].double(), x[..., 2 * i + 1].double()
        out[..., 2 * i] = a * torch.cos(angle) - b * torch.sin(angle)
        out[..., 2 * i + 1] = a * torch.sin(angle) + b * torch.cos(angle)
    return out.to(x.dtype)


def attention_ref(x, wq, wk, wv, wo, num_heads, theta=None, positions=None):
    """Causal multi-head attention, one head at a time, with torch's sdpa."""
    seq = x.shape[-2]
    if positions is None:
        positions = torch.arange(seq)
    hd = wq.shape[0] // num_heads
    outs = []
    for h in range(num_heads):
        rows = slice(h * hd, (h + 1) * hd)
        q, k, v = x @ wq[rows].T, x @ wk[rows].T, x @ wv[rows].T
        if theta is not None:
            q, k = rope_loop(q, positions, theta), rope_loop(k, positions, theta)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return torch.cat(outs, dim=-1) @ wo.T


def swiglu_ref(x, w1, w2, w3):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def transformer_lm_ref(
    sd: dict[str, torch.Tensor],
    ids: torch.Tensor,
    num_layers: int,
    num_heads: int,
    theta: float = 10000.0,
    eps: float = 1e-5,
    *,
    norm: str = "rmsnorm",
    norm_placement: str = "pre",
    positions: str = "rope",
    ffn: str = "swiglu",
):
    """The Transformer LM from its state dict (defaults: the CS336 pre-norm model)."""
    x = sd["token_embeddings.weight"][ids]
    seq, d = x.shape[-2], x.shape[-1]
    if positions == "learned":
        x = x + sd["position_embeddings.weight"][:seq]
    elif positions == "sinusoidal":
        x = x + sinusoid_ref(seq, d).to(x.dtype)

    def ln(t, name):
        if norm == "rmsnorm":
            return F.rms_norm(t, (d,), sd[name + ".weight"], eps)
        if norm == "layernorm":
            return F.layer_norm(t, (d,), sd[name + ".weight"], sd[name + ".bias"], eps)
        return t

    def attn(t, p):
        w = [sd[p + f"attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "output_proj")]
        return attention_ref(t, *w, num_heads, theta if positions == "rope" else None)

    def mlp(t, p):
        if ffn == "swiglu":
            return swiglu_ref(t, sd[p + "ffn.w1.weight"], sd[p + "ffn.w2.weight"], sd[p + "ffn.w3.weight"])
        act = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}[ffn]
        return act(t @ sd[p + "ffn.w1.weight"].T) @ sd[p + "ffn.w2.weight"].T

    for i in range(num_layers):
        p = f"layers.{i}."
        if norm_placement == "pre":
            x = x + attn(ln(x, p + "ln1"), p)
            x = x + mlp(ln(x, p + "ln2"), p)
        else:
            x = ln(x + attn(x, p), p + "ln1")
            x = ln(x + mlp(x, p), p + "ln2")
    if norm_placement == "pre":
        x = ln(x, "ln_final")
    return x @ sd["lm_head.weight"].T


def interleaved_to_half(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows per head from interleaved RoPE pairs (2i, 2i+1) to the
    rotate-half layout (i, i + d/2) that Hugging Face Llama uses."""
    hd = w.shape[0] // num_heads
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    return w.reshape(num_heads, hd, -1)[:, perm].reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    hd = w.shape[0] // num_heads
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(hd)
    return w.reshape(num_heads, hd, -1)[:, inv].reshape(w.shape)


def sinusoid_ref(num_positions: int, d: int) -> torch.Tensor:
    pe = torch.zeros(num_positions, d, dtype=torch.float64)
    for p in range(num_positions):
        for i in range(0, d, 2):
            pe[p, i] = math.sin(p / 10000 ** (i / d))
            pe[p, i + 1] = math.cos(p / 10000 ** (i / d))
    return pe  # float64: the callers cast it to their inputs' dtype


def encoder_decoder_ref(sd, src, src_mask, tgt, tgt_mask, *, num_heads, encoder_layers, decoder_layers,
                        eps=1e-5, norm_first=False, norm="layernorm", positions="sinusoidal", ffn="relu",
                        theta=10000.0, embed_scale=True):
    """The post-norm (or pre-norm) encoder–decoder of Vaswani et al. from a state dict, no biases in
    the projections. One head at a time with torch's sdpa; masks are True at real tokens.

    The defaults are the paper's: sinusoidal positions, ReLU, LayerNorm blocks and final norms, and
    a tied ``embeddings.weight`` (without that key: ``src_embeddings``, ``tgt_embeddings`` and
    ``lm_head``). The variants: ``positions`` learned (``src_positions``/``tgt_positions`` added to
    each side's embeddings), rope (each head's queries and keys rotated by :func:`rope_loop` at
    positions 0.. in the encoder's and the decoder's self-attention, never in cross-attention) or
    none; ``ffn`` relu | gelu (exact, erf) | silu | swiglu; ``norm`` layernorm | rmsnorm | none
    (for the block norms and the two final norms alike); ``embed_scale=False`` leaves out √d_model."""
    tied = "embeddings.weight" in sd
    src_emb = sd["embeddings.weight" if tied else "src_embeddings.weight"]
    tgt_emb = sd["embeddings.weight" if tied else "tgt_embeddings.weight"]
    out_w = sd["embeddings.weight" if tied else "lm_head.weight"]
    d = src_emb.shape[1]

    def embed(ids, side):
        x = (src_emb if side == "src" else tgt_emb)[ids]
        if embed_scale:
            x = x * math.sqrt(d)
        if positions == "sinusoidal":
            x = x + sinusoid_ref(ids.shape[-1], d).to(x.dtype)
        elif positions == "learned":
            x = x + sd[f"{side}_positions.weight"][: ids.shape[-1]]
        return x

    def ln(t, name):
        if norm == "layernorm":
            return F.layer_norm(t, (d,), sd[name + ".weight"], sd[name + ".bias"], eps)
        if norm == "rmsnorm":
            return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * sd[name + ".weight"]
        return t

    def mha(x, ctx, p, mask, rotate=False):
        hd = d // num_heads
        outs = []
        for h in range(num_heads):
            rows = slice(h * hd, (h + 1) * hd)
            q = x @ sd[p + "q_proj.weight"][rows].T
            k, v = ctx @ sd[p + "k_proj.weight"][rows].T, ctx @ sd[p + "v_proj.weight"][rows].T
            if rotate and positions == "rope":
                q = rope_loop(q, torch.arange(q.shape[-2]), theta)
                k = rope_loop(k, torch.arange(k.shape[-2]), theta)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return torch.cat(outs, dim=-1) @ sd[p + "output_proj.weight"].T

    def mlp(x, p):
        if ffn == "swiglu":
            return swiglu_ref(x, sd[p + "ffn.w1.weight"], sd[p + "ffn.w2.weight"], sd[p + "ffn.w3.weight"])
        act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[ffn]
        return act(x @ sd[p + "ffn.w1.weight"].T) @ sd[p + "ffn.w2.weight"].T

    def residual(x, f, name):
        return x + f(ln(x, name)) if norm_first else ln(x + f(x), name)

    s, t = src.shape[-1], tgt.shape[-1]
    enc_mask = src_mask[:, None, :].expand(-1, s, s)  # (batch, queries, keys): one head at a time
    x = embed(src, "src")
    for i in range(encoder_layers):
        p = f"encoder.{i}."
        x = residual(x, lambda h, p=p: mha(h, h, p + "attn.", enc_mask, rotate=True), p + "ln1")
        x = residual(x, lambda h, p=p: mlp(h, p), p + "ln2")
    memory = ln(x, "encoder_norm")
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    self_mask = causal[None] & tgt_mask[:, None, :]
    cross_mask = src_mask[:, None, :].expand(-1, t, s)
    y = embed(tgt, "tgt")
    for i in range(decoder_layers):
        p = f"decoder.{i}."
        y = residual(y, lambda h, p=p: mha(h, h, p + "self_attn.", self_mask, rotate=True), p + "ln1")
        y = residual(y, lambda h, p=p: mha(h, memory, p + "cross_attn.", cross_mask), p + "ln2")
        y = residual(y, lambda h, p=p: mlp(h, p), p + "ln3")
    hidden = ln(y, "decoder_norm")
    return memory, hidden, hidden @ out_w.T


@torch.no_grad()
def load_into_torch_transformer(model, ref: torch.nn.Transformer) -> None:
    """An lm encoder–decoder's layer weights into a ``torch.nn.Transformer`` (relu, batch-first) of
    the same shape, every bias of which is zeroed (lm's layers have none): both stacks then compute
    the same function. The embeddings and the generator are the caller's."""
    for p in ref.parameters():
        p.zero_()

    def attn(dst, src):
        dst.in_proj_weight.copy_(torch.cat([src.q_proj.weight, src.k_proj.weight, src.v_proj.weight]))
        dst.out_proj.weight.copy_(src.output_proj.weight)

    def norm(dst, src):
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)

    for theirs, ours in zip(ref.encoder.layers, model.encoder):
        attn(theirs.self_attn, ours.attn)
        theirs.linear1.weight.copy_(ours.ffn.w1.weight)
        theirs.linear2.weight.copy_(ours.ffn.w2.weight)
        norm(theirs.norm1, ours.ln1)
        norm(theirs.norm2, ours.ln2)
    for theirs, ours in zip(ref.decoder.layers, model.decoder):
        attn(theirs.self_attn, ours.self_attn)
        attn(theirs.multihead_attn, ours.cross_attn)
        theirs.linear1.weight.copy_(ours.ffn.w1.weight)
        theirs.linear2.weight.copy_(ours.ffn.w2.weight)
        for j in (1, 2, 3):
            norm(getattr(theirs, f"norm{j}"), getattr(ours, f"ln{j}"))
    norm(ref.encoder.norm, model.encoder_norm)
    norm(ref.decoder.norm, model.decoder_norm)

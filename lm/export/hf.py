"""Export to a Hugging Face folder that ``transformers.AutoModelForCausalLM`` loads as Llama.

The default ``TransformerLM`` is Llama's architecture (pre-norm RMSNorm, RoPE, SwiGLU, no
biases) with one difference in layout: lm rotates *interleaved* pairs ``(x[2i], x[2i+1])``
while Llama rotates halves ``(x[i], x[i + d/2])``. Permuting the rows of each head of the q
and k projections (evens first, then odds) turns one into the other; the attention scores,
and so the logits, are unchanged.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from lm.checkpoint.io import unwrap
from lm.checks import check_size, is_count
from lm.io import atomic_write, replace_dir
from lm.tokenizer import EOT, Tokenizer


def interleaved_to_half(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the rows of each head from RoPE pairs (2i, 2i+1) to rotate-half pairs (i, i + d/2)."""
    hd = w.shape[0] // num_heads
    perm = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    return w.reshape(num_heads, hd, -1)[:, perm].reshape(w.shape)


def to_llama_state_dict(sd: dict[str, torch.Tensor], num_layers: int, num_heads: int) -> dict[str, torch.Tensor]:
    """Our state-dict keys (the CS336 names) to ``LlamaForCausalLM``'s, q/k rows permuted.

    ``num_layers`` must be the number of ``layers.{i}`` in ``sd`` (a smaller one had dropped the
    others), and ``num_heads`` split the q rows into heads of an even size (RoPE's pairs). A
    ``num_heads`` that does so but is not the model's permutes the rows wrongly, with no error:
    take both from the model's config."""
    check_size("num_layers", num_layers)
    check_size("num_heads", num_heads)
    held = sorted({int(m[1]) for k in sd if (m := re.match(r"layers\.(\d+)\.", k))})
    if held != list(range(len(held))):
        raise ValueError(f"sd: its layers must be numbered from 0 without a gap, got layers {held}")
    if num_layers != len(held):
        raise ValueError(f"num_layers must be the state dict's number of layers, {len(held)}, "
                         f"got num_layers={num_layers!r}")
    rows = sd["layers.0.attn.q_proj.weight"].shape[0]
    if rows % num_heads or rows // num_heads % 2:
        raise ValueError(f"num_heads must split the {rows} q rows into heads of an even size (RoPE rotates "
                         f"pairs), got num_heads={num_heads!r}")
    out = {
        "model.embed_tokens.weight": sd["token_embeddings.weight"],
        "model.norm.weight": sd["ln_final.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(num_layers):
        a, b = f"layers.{i}.", f"model.layers.{i}."
        out[b + "self_attn.q_proj.weight"] = interleaved_to_half(sd[a + "attn.q_proj.weight"], num_heads)
        out[b + "self_attn.k_proj.weight"] = interleaved_to_half(sd[a + "attn.k_proj.weight"], num_heads)
        out[b + "self_attn.v_proj.weight"] = sd[a + "attn.v_proj.weight"]
        out[b + "self_attn.o_proj.weight"] = sd[a + "attn.output_proj.weight"]
        out[b + "mlp.gate_proj.weight"] = sd[a + "ffn.w1.weight"]
        out[b + "mlp.up_proj.weight"] = sd[a + "ffn.w3.weight"]
        out[b + "mlp.down_proj.weight"] = sd[a + "ffn.w2.weight"]
        out[b + "input_layernorm.weight"] = sd[a + "ln1.weight"]
        out[b + "post_attention_layernorm.weight"] = sd[a + "ln2.weight"]
    return out


def check_llama_compatible(cfg) -> None:
    """Refuse a model that Llama's architecture cannot hold, in one line naming the reason.

    The architecture comes first: an encoder–decoder has the same norm, position and FFN choices
    as the decoder-only LM, so naming one of those would suggest a change that cannot make a
    translation model exportable."""
    architecture = cfg.architecture  # every config class has one (build_model reads it too)
    if architecture != "decoder_lm":
        raise ValueError(f"model: architecture={architecture!r} is a translation model with no Llama equivalent; "
                         "Llama export writes decoder-only models (architecture='decoder_lm')")
    wanted = {"norm": "rmsnorm", "norm_placement": "pre", "positions": "rope", "ffn": "swiglu"}
    for key, value in wanted.items():
        got = getattr(cfg, key)
        if got != value:
            raise ValueError(f"model: {key}={got!r} has no Llama equivalent (Llama needs {key}={value!r})")


def llama_config(cfg, eos_token_id: int | None = None) -> dict:
    """The ``config.json`` of ``LlamaForCausalLM`` for a :class:`lm.model.ModelConfig`.

    A model Llama cannot hold is refused as :func:`check_llama_compatible` refuses it, and
    ``eos_token_id`` (also the ``bos_token_id``) is None or a token id of the model's vocabulary."""
    check_llama_compatible(cfg)
    if eos_token_id is not None and not (is_count(eos_token_id) and eos_token_id < cfg.vocab_size):
        raise ValueError(f"eos_token_id must be None or a token id in [0, vocab_size={cfg.vocab_size}), "
                         f"got eos_token_id={eos_token_id!r}")
    eos_token_id = None if eos_token_id is None else int(eos_token_id)  # a numpy integer is no JSON
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "head_dim": cfg.d_model // cfg.num_heads,
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def to_transformers(model: torch.nn.Module, **config_overrides):
    """A ``transformers.LlamaForCausalLM`` in memory with ``model``'s weights (needs transformers).

    The config carries θ both ways, as ``config.json`` does: transformers 5 reads ``rope_parameters``,
    4.x only ``rope_theta`` (without it, 4.x ignores ``rope_parameters`` and rotates with its default
    θ = 10000: other logits, and no error).
    """
    import transformers

    model = unwrap(model)  # torch.compile and DDP prefix the state-dict keys
    cfg = model.config
    check_llama_compatible(cfg)
    fields = llama_config(cfg)
    for key in ("architectures", "model_type", "torch_dtype"):
        fields.pop(key)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config_overrides}))
    sd = to_llama_state_dict(model.state_dict(), cfg.num_layers, cfg.num_heads)
    if cfg.tie_embeddings:
        del sd["lm_head.weight"]
    hf.load_state_dict(sd, strict=not cfg.tie_embeddings)
    return hf.eval()


HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def export_hf(model: torch.nn.Module, out_dir: str | os.PathLike, tokenizer: Tokenizer | None = None,
              *, overwrite: bool = False, inputs: Iterable[tuple[str, str | os.PathLike]] = ()) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir``, and with a ``tokenizer``
    ``tokenizer.json`` and ``tokenizer_config.json`` (without them ``AutoTokenizer`` cannot load the folder).

    The folder is built beside ``out_dir`` and renamed into place when complete
    (:func:`lm.io.replace_dir`): ``overwrite`` replaces only an earlier export, never a folder
    that holds anything else, the ``inputs`` or a folder that contains them. A folder already at
    ``out_dir`` (an empty one the user made, say private) passes its group and mode on to the new one.

    The checks come before anything is written: a model Llama cannot hold (``model: ...``), and a
    tokenizer with more tokens than the model's ``vocab_size`` (its ids would index past the
    embedding in transformers) or with a special token that ``tokenizer.json`` cannot hold
    (``tokenizer: ...``).
    """
    from safetensors.torch import save

    from lm.tokenizer.files import write_hf_json

    model = unwrap(model)  # torch.compile and DDP prefix the state-dict keys
    cfg = model.config
    check_llama_compatible(cfg)
    tokenizer_json = None
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer: {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                             f"{cfg.vocab_size}")
        try:  # a special token that tokenizer.json cannot hold, refused before the folder is made
            tokenizer_json = tokenizer.to_hf_json()
        except ValueError as e:
            raise ValueError(f"tokenizer: {str(e).removeprefix('special_tokens: ')}") from None
    eos = None
    if tokenizer is not None and EOT in tokenizer.special_tokens:
        eos = tokenizer.eot_id
    config = llama_config(cfg, eos_token_id=eos)
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    tensors = to_llama_state_dict(sd, cfg.num_layers, cfg.num_heads)
    if cfg.tie_embeddings:
        del tensors["lm_head.weight"]
    tensors = {k: v.clone().contiguous() for k, v in tensors.items()}

    out = Path(out_dir)
    with replace_dir(out, command="lm export hf", overwrite=overwrite, inputs=inputs, files=HF_FILES) as tmp:
        with atomic_write(tmp / "config.json") as f:
            f.write(json.dumps(config, indent=2) + "\n")
        with atomic_write(tmp / "model.safetensors", "wb") as f:
            f.write(save(tensors, metadata={"format": "pt"}))
        if tokenizer is not None:
            write_hf_json(tokenizer, tmp / "tokenizer.json", tokenizer_json)
            # transformers 4.44 and older default clean_up_tokenization_spaces to True, which deletes
            # the space before "." or "n't": decode would differ from lm's tokenizer
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.context_length,
                       "clean_up_tokenization_spaces": False}
            if eos is not None:
                tok_cfg.update(eos_token=EOT, bos_token=EOT)
            with atomic_write(tmp / "tokenizer_config.json") as f:
                f.write(json.dumps(tok_cfg, indent=2) + "\n")
    return out

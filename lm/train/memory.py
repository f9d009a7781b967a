"""How much memory a training step needs, estimated before anything is allocated.

A batch size that cannot fit should be refused in a second with the numbers, not found out by a
MemoryError minutes later. The estimate counts what a step must hold at its peak: the weights,
their gradients and AdamW's two moments (float32), the activations the backward pass keeps per
token (under bfloat16 autocast the matrix products keep their inputs in bfloat16: half the bytes),
and one chunk of the fused loss's logits. It leaves out allocator slack and temporary buffers, so
it errs low: it refuses only steps that certainly do not fit.
"""

from __future__ import annotations

import os

import torch

from lm.model import ModelConfig


def parameter_count(m: ModelConfig) -> int:
    """The number of parameters of the model ``m`` describes, without building it: models of one
    and two layers (of each stack) are built on the meta device, and every further layer adds what
    the second did. Building all of them took 0.5 ms and 32 kB per layer, so
    ``model.num_layers=1000000`` hung for minutes before its refusal (clifuzz9 #2)."""
    import dataclasses

    from lm.model import build_model

    def count(**layers: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in build_model(dataclasses.replace(m, **layers)).parameters())

    stacks = ("encoder_layers", "decoder_layers") if m.architecture == "encoder_decoder" else ("num_layers",)
    one = dict.fromkeys(stacks, 1)
    base = count(**one)
    return base + sum((getattr(m, key) - 1) * (count(**{**one, key: 2}) - base) for key in stacks)


def step_bytes(m: ModelConfig, batch_size: int, *, train: bool = True, tokens: int | None = None,
               params: int | None = None, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes a step of ``batch_size`` sequences (or ``tokens`` tokens) needs: ``weights`` (and
    optimizer state), ``activations``, ``total``. For an encoder–decoder ``tokens`` is the batch's
    padded target tokens; the source is counted as long, and a decoder layer as two. ``params``:
    :func:`parameter_count` of ``m``, when the caller has it (it builds small models: 0.1 s).
    ``dtype``: the autocast dtype (None: float32); under bfloat16 the tensors the matrix products
    keep for the backward pass are counted at 2 bytes (at 4 they made the estimate up to 16% above
    what a step allocates, bench21), the norms' inputs and the residual stream at 4."""
    d, f, h, ctx = m.d_model, m.d_ff, m.num_heads, m.context_length  # (the config resolves d_ff's default)
    if m.architecture == "encoder_decoder":
        n_layers = m.encoder_layers + 2 * m.decoder_layers
        tokens = 2 * (tokens if tokens is not None else batch_size * ctx)
    else:
        n_layers = m.num_layers
        tokens = batch_size * ctx
    # kept per token and layer for the backward pass: the norms' inputs, q, k, v, the attention
    # output and its projection, the residual stream, and the feed-forward's hidden activations;
    # the einsum attention also keeps the seq x seq probabilities of every head
    scores = 2 * h * ctx if m.attn_impl == "einsum" else 2 * h
    if dtype == torch.bfloat16 and train:  # norms' inputs and residual in float32, matmul inputs in bfloat16
        per_layer_bytes = 4 * 3 * d + 2 * (7 * d + 3 * f) + 3 * scores  # the probabilities: float32 and bfloat16
    else:
        per_layer_bytes = 4 * (10 * d + 3 * f + scores)
    per_token_bytes = (n_layers * per_layer_bytes + 4 * 4 * d) if train else \
        4 * (2 * d + (h * ctx if m.attn_impl == "einsum" else 0))
    activations = tokens * per_token_bytes + 2 * 8 * tokens  # plus the int64 inputs and targets
    activations += 4 * min(tokens, 256) * m.vocab_size * (2 if train else 1)  # a chunk of logits (and its grad)
    params = parameter_count(m) if params is None else params
    weights = 4 * params * (4 if train else 1)  # weights, gradients, exp_avg, exp_avg_sq
    return {"weights": weights, "activations": activations, "total": weights + activations}


def available_bytes(device: torch.device) -> int | None:
    """Memory a step can use on ``device``: free GPU memory, or the OS's MemAvailable; None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.0f} MB"


# what a fixed evaluation batch of token windows holds besides its int64 starts: two numpy array
# headers (the batch is a view of the drawn global batch), see lm.data.TokenDataset.fixed_batches
FIXED_BATCH_BYTES = 224


def check_step_memory(cfg, device: torch.device) -> None:
    """Raise a one-line ValueError when a training or evaluation step of ``cfg``, or its fixed
    evaluation batches, cannot fit on ``device``."""
    t, m = cfg.train, cfg.model
    have = available_bytes(device)
    if have is not None:
        _check_steps(cfg, device, have)
    host = available_bytes(torch.device("cpu"))  # the starts are numpy arrays, whatever the device
    if host is not None and cfg.data.val and m.architecture != "encoder_decoder":  # pairs: a plan, no larger
        rows = cfg.eval.batch_size or t.batch_size
        held = cfg.eval.batches * (FIXED_BATCH_BYTES + 8 * rows)
        if held > host:
            raise ValueError(
                f"eval.batches: {cfg.eval.batches:,} fixed evaluation batches of {rows:,} windows hold "
                f"{_gb(held)} of start positions from the start, but the host has {_gb(host)} free; lower "
                "eval.batches" + (" or eval.batch_size" if cfg.eval.batch_size else "")
            )


def _check_steps(cfg, device: torch.device, have: int) -> None:
    t, m = cfg.train, cfg.model
    if m.architecture == "encoder_decoder":
        checks = [("train.batch_tokens", t.batch_tokens, True)]
    else:
        checks = [("train.batch_size", t.batch_size, True)]
        if cfg.data.val and cfg.eval.batch_size:
            checks.append(("eval.batch_size", cfg.eval.batch_size, False))
    # a lower train batch lowers the evaluation's too where eval's is unset: other, fewer windows (train20)
    eval_key = "eval.batch_tokens" if m.architecture == "encoder_decoder" else "eval.batch_size"
    unset_eval = bool(cfg.data.val) and getattr(cfg.eval, eval_key.split(".")[1]) is None
    from lm.device import resolve_dtype

    dtype = resolve_dtype(t.dtype, device, "train.dtype")  # the autocast dtype, as the Trainer resolves it
    params = parameter_count(m)  # once for every check below
    weights = step_bytes(m, 1, train=True, tokens=1, params=params)["weights"]
    if weights > have:  # no batch size helps: the model is too large for the device
        layers = ("model.encoder_layers, model.decoder_layers" if m.architecture == "encoder_decoder"
                  else "model.num_layers")
        raise ValueError(
            f"model: {params:,} parameters need {_gb(weights)} for the weights, their gradients and "
            f"AdamW's two moments (float32) but {device} has {_gb(have)} free; make the model smaller "
            f"(model.vocab_size, model.d_model, {layers}, ...)"
        )
    for key, batch, train in checks:
        pairs = m.architecture == "encoder_decoder"
        need = step_bytes(m, 1 if pairs else batch, train=train, tokens=batch if pairs else None, params=params,
                          dtype=dtype)
        size = f"{batch:,} tokens" if pairs else f"{batch:,} x {m.context_length} tokens"
        if need["total"] > have:
            raise ValueError(
                f"{key}: {'a training' if train else 'an evaluation'} step of {size} "
                f"needs at least {_gb(need['total'])} (weights and optimizer {_gb(need['weights'])}, activations "
                f"{_gb(need['activations'])}) but {device} has {_gb(have)} free; lower {key}"
                + (" and raise train.grad_accum_steps" if train else "")
                + (f" ({eval_key}, unset, follows {key}: the evaluation then draws other, fewer windows, whose "
                   "losses do not compare with this run's)" if train and unset_eval else "")
            )

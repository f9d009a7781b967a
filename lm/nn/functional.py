"""Stateless building blocks: softmax, activations, attention and the loss.

Everything here is written with plain tensor ops and einops; nothing comes from
``torch.nn.functional``. The single exception is the optional fused attention kernel
behind ``scaled_dot_product_attention(..., impl="sdpa")``, which must agree with the
hand-written einsum path (the tests check that it does).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import math
import numbers
import sys
import threading
import warnings
from collections.abc import Callable

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lm.checks import is_count
from lm.nn.choices import check_choice


# einops, as torch.compile sees it: one call in the graph. torch >= 2.8 with einops >= 0.8.2 traces
# into einops instead, and every call re-parses its pattern under the tracer (the parser's lru_cache
# is bypassed there): 95% of the 137,000 bytecodes traced for a 2-layer model's decode step, 13-16 s
# of compiling it on a 2-core CPU. Put in the graph, a call is traced by AOTAutograd into the same
# reshapes, permutes and matmuls, with the pattern parsed (and cached) by einops itself.
def rearrange(tensor: Tensor, pattern: str, **axes_lengths: int) -> Tensor:
    """``einops.rearrange``; compiled as one call (see above)."""
    return einops.rearrange(tensor, pattern, **axes_lengths)


def einsum(*tensors_and_pattern) -> Tensor:
    """``einops.einsum(*tensors, pattern)``; compiled as one call (see above)."""
    return einops.einsum(*tensors_and_pattern)


def _after_import(name: str, then: Callable[[], object]) -> None:
    """``then()`` once the module ``name`` is imported: at once if it is, else right after its import,
    by a finder at the head of ``sys.meta_path`` that takes itself off at that import, finds the
    module's spec as Python would without it, and has its loader call ``then`` once the module is run."""
    if name in sys.modules:
        then()
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            with contextlib.suppress(ValueError):  # (another thread's import of it took it off)
                sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None and not isinstance(spec.loader, type):
                run = spec.loader.exec_module  # this module's own loader (a class is shared: left alone)

                def exec_module(module):
                    run(module)
                    then()

                spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _mark_for_compile() -> None:
    try:
        torch.compiler.allow_in_graph(rearrange)
        torch.compiler.allow_in_graph(einsum)
    except Exception as e:  # (within dynamo's import: a failure here must not fail it)
        warnings.warn(f"lm: rearrange and einsum not marked for torch.compile ({e!r}): compiling traces into "
                      "einops instead, which takes longer", RuntimeWarning, stacklevel=2)


# torch.compiler.allow_in_graph imports torch._dynamo, which takes 2.4 s (2 cores): done here, it had
# made importing lm.model and every command that loads a model that much slower, compiled or not.
# Marked when dynamo is imported instead, as torch.compile does before it traces anything.
_after_import("torch._dynamo", _mark_for_compile)

_batch_invariant: tuple[bool, bool] = (False, False)  # (attention, matmuls): set by batch_invariant()


@contextlib.contextmanager
def batch_invariant(matmuls: bool = True):
    """Within: kernels that give a row of a batch the same bits wherever it sits in the batch and
    (compiled, with ``matmuls``) however many rows there are.

    * :func:`scaled_dot_product_attention` takes the einsum path whatever ``impl`` says: torch's
      fused CPU kernel gives the rows its second thread computes other last bits than the first's.
    * With ``matmuls``, :func:`linear`, when torch.compile traces it, is a product summed over
      ``d_in`` instead of a matmul. A BLAS matmul picks its kernel by shape (on a CPU, one row,
      two or three rows and four or more give a row different last bits); inductor compiles the
      product-sum (on a CPU) into a kernel that reduces each output in one fixed order whatever
      the number of rows, about as fast as the matmul for a few rows (faster for one) and never
      materialised. Eager code keeps the matmul, where the form would materialise
      ``rows × d_out × d_in`` products.

    The decode step (:class:`lm.generate.DecodeStep`) runs within it on a CPU, which lets a
    server decode a lone request in a small step and sixteen in a sixteen-row one with the
    same bits. The switch is process-wide, not per thread (torch.compile guards on it as a
    global): meant for the one thread that decodes. Blocks of several threads at once count, so
    the switch is off again once the last one ends (each restoring what it found, two threads'
    overlapping blocks had left it on for the rest of the process; the matmuls form is on while
    any block asks for it).
    """
    global _batch_invariant
    with _INVARIANT_LOCK:
        _invariant_blocks[bool(matmuls)] += 1
        _batch_invariant = (True, _invariant_blocks[True] > 0)
    try:
        yield
    finally:
        with _INVARIANT_LOCK:
            _invariant_blocks[bool(matmuls)] -= 1
            _batch_invariant = (sum(_invariant_blocks.values()) > 0, _invariant_blocks[True] > 0)


_INVARIANT_LOCK = threading.Lock()
_invariant_blocks = {False: 0, True: 0}  # the batch_invariant() blocks running, by their matmuls


def linear(x: Float[Tensor, "... d_in"], weight: Float[Tensor, "d_out d_in"]) -> Float[Tensor, "... d_out"]:
    """``x Wᵀ`` with ``W`` stored ``(d_out, d_in)`` (see :func:`batch_invariant` for the compiled form)."""
    if _batch_invariant[1] and is_compiling():
        return (rearrange(x, "... d_in -> ... 1 d_in") * weight).sum(-1)
    return einsum(x, weight, "... d_in, d_out d_in -> ... d_out")


def softmax(x: Float[Tensor, "*shape"], dim: int) -> Float[Tensor, "*shape"]:
    """Softmax along ``dim``; subtracting the max first keeps ``exp`` from overflowing.

    A slice that is entirely ``-inf`` (every position masked) gives NaN, as in torch.
    The backward pass is written out (:class:`_Softmax`): ``p ⊙ (g - Σ g ⊙ p)``; under a
    ``torch.func`` transform the same formula runs with autograd's derivative (:func:`transformed`).
    """
    if transformed():
        return _softmax_by_formula(x, dim, False)
    return _Softmax.apply(x, dim, False)


def transformed() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ``jvp``...) runs the caller.

    The hand-written backward passes (:class:`_Softmax`, the losses, the embedding's lookup) are
    autograd Functions written for autograd, without the ``setup_context`` and vmap rule that
    ``torch.func`` needs (the fused loss computes its gradients in its forward pass, which a
    transform cannot ask for). Under a transform the same formulas run as plain differentiable
    operations instead, and the transform differentiates or batches them as any other: the same
    values, the gradients autograd's. ``torch.compile`` over a transform (``compile(vmap(grad(f)))``)
    traces the formulas too; outside one, torch.compile reads the check as a constant, so that
    the compiled decode and training steps hold neither the check nor a graph break."""
    return torch._C._are_functorch_transforms_active()


def _softmax_by_formula(x: Tensor, dim: int, empty_is_zero: bool, in_place: bool = False) -> Tensor:
    """The softmax of :class:`_Softmax` (see there for ``empty_is_zero``). ``in_place``: its forward
    pass, where no graph is kept, writes the exps and their quotients over one buffer; without it the
    operations are differentiable (under a ``torch.func`` transform), the max held constant (the
    softmax does not depend on the shift)."""
    if x.shape[dim] == 0:  # no keys: amax would raise; an empty softmax (attention then gives zeros)
        return x.clone()
    row_max = x.amax(dim=dim, keepdim=True).detach()
    if empty_is_zero:
        row_max = row_max.clamp_min(torch.finfo(x.dtype).min)
    p = torch.sub(x, row_max)
    p = p.exp_() if in_place else p.exp()
    total = p.sum(dim=dim, keepdim=True)
    if empty_is_zero:
        total = total.clamp_min(torch.finfo(x.dtype).tiny)
    return p.div_(total) if in_place else p / total


class _Softmax(torch.autograd.Function):
    """With ``empty_is_zero`` (attention's softmax) an all ``-inf`` slice gives zeros instead of NaN.

    Such a slice's max is ``-inf`` and ``x - max`` NaN; clamping the max to the dtype's lowest
    finite value makes its exps 0, and clamping the sum to the smallest normal number makes
    ``0 / sum`` 0. Neither clamp changes any other slice by a bit: its max is finite, and its sum
    is at least 1 (the max's own ``exp(0)``). Two ops on the (…, 1) max and sum, no host sync.
    """

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, empty_is_zero: bool) -> Tensor:
        ctx.dim = dim
        p = _softmax_by_formula(x, dim, empty_is_zero, in_place=True)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (p,) = ctx.saved_tensors
        gp = grad * p
        return gp.sub_(p * gp.sum(dim=ctx.dim, keepdim=True)), None, None


def silu(x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``x * sigmoid(x)`` (a.k.a. swish)."""
    return x * torch.sigmoid(x)


def relu(x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """``max(x, 0)``."""
    return torch.clamp_min(x, 0.0)


def gelu(x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """Exact (erf) GELU: ``x * Φ(x)``."""
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Bool[Tensor, "q k"]:
    """``True`` where query ``i`` may attend key ``j``; queries are the *last* ``q_len`` of ``k_len``.

    Both lengths are whole numbers >= 0; with ``q_len > k_len`` the first ``q_len - k_len`` queries
    come before the first key and their rows are all ``False``.
    """
    for name, value in (("q_len", q_len), ("k_len", k_len)):
        if not is_count(value):
            raise ValueError(f"{name} must be a whole number >= 0, got {name}={value!r}")
    return _causal_mask(q_len, k_len, device)


def _causal_mask(q_len: int, k_len: int, device: torch.device | None) -> Bool[Tensor, "q k"]:
    """:func:`causal_mask` unchecked, for the attention code (whose lengths may be symbolic when traced)."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    k_pos = torch.arange(k_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def scaled_dot_product_attention(
    Q: Float[Tensor, "... q d_k"],
    K: Float[Tensor, "... k d_k"],
    V: Float[Tensor, "... k d_v"],
    mask: Bool[Tensor, "... q k"] | None = None,
    *,
    is_causal: bool = False,
    impl: str = "einsum",
) -> Float[Tensor, "... q d_v"]:
    """``softmax(Q Kᵀ / sqrt(d_k)) V`` with a boolean mask (``True`` = may attend).

    ``is_causal=True`` applies the causal mask (queries aligned to the end of the keys)
    in addition to ``mask``. ``impl="sdpa"`` uses torch's fused kernel, which never
    materialises the (q, k) score matrix; ``"einsum"`` is the readable reference.

    A query that may attend no key (its mask row all ``False``, or a causal query before the
    first key when ``q > k``) gets zeros, not NaN, from both impls, as from
    ``torch.nn.functional.scaled_dot_product_attention``. The mask must be boolean: torch's
    kernel would take a float mask as an additive bias, which the einsum path does not implement.
    """
    check_choice("impl", impl, ("einsum", "sdpa"))
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a boolean tensor (True = may attend), got dtype {mask.dtype}")
    functional = transformed()  # torch's fused kernel has no forward-mode derivative (jvp, jacfwd, hessian)
    if impl == "sdpa" and not _batch_invariant[0] and not functional:
        return _fused_sdpa(Q, K, V, mask, is_causal)
    # Scaling Q (q × d) is cheaper than scaling the scores (q × k).
    scores = einsum(Q * (1.0 / math.sqrt(Q.shape[-1])), K, "... q d, ... k d -> ... q k")
    if is_causal:
        causal = _causal_mask(Q.shape[-2], K.shape[-2], Q.device)
        mask = causal if mask is None else mask & causal
    if mask is not None:
        # in place: nothing else reads the raw scores (not under vmap, where a batched mask cannot be
        # written into scores that are not)
        scores = scores.masked_fill(~mask, float("-inf")) if functional else scores.masked_fill_(~mask, float("-inf"))
    # Softmax in float32 (or float64 for float64 inputs) so bfloat16 inputs keep their precision in
    # the normaliser; a fully masked row gives zeros (see _Softmax).
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    probs = (_softmax_by_formula(scores, -1, True) if functional else _Softmax.apply(scores, -1, True)).to(V.dtype)
    return einsum(probs, V, "... q k, ... k d -> ... q d")


def _fused_sdpa(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    from torch.nn.functional import scaled_dot_product_attention as sdpa  # the one allowed exception

    if is_causal and mask is not None:
        mask = mask & _causal_mask(Q.shape[-2], K.shape[-2], Q.device)
        is_causal = False
    if is_causal and Q.shape[-2] == 1:
        is_causal = False  # one query at the end of the keys sees them all
    elif is_causal and Q.shape[-2] != K.shape[-2]:
        # torch aligns its causal mask to the top-left; ours is aligned to the end of the keys.
        mask, is_causal = _causal_mask(Q.shape[-2], K.shape[-2], Q.device), False
    return sdpa(Q, K, V, attn_mask=mask, is_causal=is_causal)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the others by ``1 / (1 - p)``, so the
    expectation is unchanged (inverted dropout); the identity when not ``training`` or ``p == 0``.

    ``p`` must be in [0, 1] (checked even when not ``training``, as torch does); ``p == 1`` gives
    ``x * 0``, as ``torch.nn.functional.dropout`` does, where the scaling would give ``0 / 0``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout p must be in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = torch.rand(x.shape, device=x.device) >= p
    return x * keep / (1.0 - p)


def cross_entropy(
    logits: Float[Tensor, "... vocab"],
    targets: Int[Tensor, "*batch"],
    *,
    label_smoothing: float = 0.0,
    ignore_index: int | None = None,
) -> Float[Tensor, ""]:
    """Mean of ``-log softmax(logits)[target]`` over every position, computed in float32 (float64
    for float64 logits).

    Stable for large logits: ``log Σ exp`` is taken after subtracting the row max. The
    gradient is the textbook ``(softmax(logits) - onehot(target)) / N``, written out by hand
    (:class:`_CrossEntropy`) because autograd through ``logsumexp`` and ``gather`` makes about
    twice as many passes over the (tokens × vocab) logits, the largest tensor of a training step.

    ``label_smoothing`` ε mixes the one-hot target with the uniform distribution:
    ``(1 - ε) · nll + ε · mean_j(-log p_j)``; positions whose target is ``ignore_index`` (the
    padding of a batch of sentences) are left out of the loss and of the mean, whatever their
    logits (NaN included), and get a zero gradient. Both as in ``torch.nn.functional.cross_entropy``.
    A target outside ``[0, vocab)`` (other than ``ignore_index``) raises a ``ValueError`` naming it
    on a CPU, and asserts in the kernel on a GPU (the range is not read back before the loss).
    """
    _check_smoothing(label_smoothing)
    _check_targets(targets, logits.shape[:-1], "logits")
    if transformed():
        return _loss_of_targets(logits, targets, float(label_smoothing), ignore_index)
    return _naming_bad_targets(_CrossEntropy, (logits, targets, float(label_smoothing), ignore_index),
                               targets, logits.shape[-1], ignore_index)


def _check_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")


class IntegerDtypeError(TypeError, ValueError):
    """Ids, targets or positions that are not integers: a ``TypeError`` (a wrong type) and, as the
    models raised it for their inputs before the layers checked theirs, a ``ValueError``."""


def check_integer_dtype(name: str, t: Tensor) -> None:
    """Raise :class:`IntegerDtypeError` unless ``t`` holds integers: ids, targets and positions index
    tables, and ``.long()`` would truncate a float (1.7 → 1) and a bool would index as a mask."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise IntegerDtypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")


def check_float_dtype(name: str, t: Tensor) -> None:
    """Raise a ValueError unless ``t`` holds floating-point numbers: a norm or a rotation of an
    integer tensor computes in float32 and rounds its result back to integers (RMSNorm gave zeros)."""
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (activations), got dtype {t.dtype}")


def last_dim_error(name: str, t: Tensor, what: str, size: int) -> ValueError:
    """``"{name} must have the last dimension {what}={size}, got shape (…)"``: the layers raise it for
    an input of the wrong width, where the einsum's or broadcast's own message named neither (called
    only once the check ``t.shape[-1:] != (size,)``, cheap enough for every forward, has failed)."""
    return ValueError(f"{name} must have the last dimension {what}={size}, got shape {tuple(t.shape)}")


def index_rows(table: Float[Tensor, "n d"], ids: Int[Tensor, "*shape"], name: str | None = None,
               bound_name: str = "n", by_gather: bool = False) -> Float[Tensor, "*shape d"]:
    """``table[ids]`` by ``index_select``, which checks the range of the ids in its kernel (on a CPU
    it raises; on a GPU it asserts) where ``table[-1]`` would read the last row: no read back to the
    host. Integer ids of any width (``index_select`` takes int32 or int64 only).

    With ``name``, an id out of range raises an ``IndexError`` naming the argument, the bound and the
    id (``"token_ids must be in [0, num_embeddings=10), got 12"``) where the kernel said "index
    out of range in self" (or, under ``vmap``, a ``RuntimeError``): the ids are read only after the
    kernel has failed, on a CPU and not while compiling.

    ``by_gather``: ``gather`` along dim 0 with the ids expanded over the row (the same rows and a
    range check in the kernel; its backward a ``scatter_add``, as :class:`lm.nn.embedding.Embedding`'s
    written one) instead, for a table differentiated under a ``torch.func`` transform: compiled by
    inductor (torch 2.13, CPU), ``vmap(grad(...))`` over ``index_select`` with an index shared by
    the samples (positions) gave every sample's gradient wrong (as in pytorch#188084, an
    accumulating ``index_put`` into an expanded view); ``gather``'s is right."""
    flat = ids.reshape(-1)
    if flat.dtype not in (torch.int64, torch.int32):
        flat = flat.long()
    if name is None or is_compiling():
        return _lookup(table, flat, by_gather).view(*ids.shape, table.shape[1])
    try:
        rows = _lookup(table, flat, by_gather)
    except (IndexError, RuntimeError):
        _name_bad_ids(ids, table.shape[0], name, bound_name)
        raise
    return rows.view(*ids.shape, table.shape[1])


def _lookup(table: Tensor, flat: Tensor, by_gather: bool) -> Tensor:
    if by_gather:  # int64: an int32 index, expanded, gathered the first id's row for every id (torch 2.13)
        return table.gather(0, flat.long()[:, None].expand(-1, table.shape[1]))
    return table.index_select(0, flat)


def _name_bad_ids(ids: Tensor, bound: int, name: str, bound_name: str) -> None:
    """After a lookup failed: raise an ``IndexError`` naming the first id outside ``[0, bound)``, if
    there is one (a vmapped batch is read whole, :func:`unbatched`)."""
    if ids.device.type != "cpu":
        return  # after a device-side assert, reading the ids would only raise again
    every = unbatched(ids)
    bad = every[(every < 0) | (every >= bound)]
    if bad.numel():
        raise IndexError(f"{name} must be in [0, {bound_name}={bound}), got {int(bad[0])}") from None


def _check_targets(targets: Tensor, shape: torch.Size, of: str) -> None:
    """Integer targets, one per position: a target tensor of another shape with as many elements
    would be flattened beside the wrong rows (a transposed batch) and give a plausible loss."""
    check_integer_dtype("targets", targets)
    if targets.shape != shape:
        raise ValueError(f"targets must have shape {tuple(shape)} (that of {of} without its last dimension), "
                         f"got {tuple(targets.shape)}")


def _naming_bad_targets(loss: type[torch.autograd.Function], args: tuple, targets: Tensor, vocab_size: int,
                        ignore_index: int | None) -> Tensor:
    """``loss.apply(*args)``; when it fails (not compiling), a target out of range is named
    (:func:`_name_bad_targets`), else the error is raised as it was."""
    if is_compiling():
        return loss.apply(*args)
    try:
        return loss.apply(*args)
    except RuntimeError:
        _name_bad_targets(targets, vocab_size, ignore_index)
        raise


def _name_bad_targets(targets: Tensor, vocab_size: int, ignore_index: int | None) -> None:
    """After the loss failed: raise a ``ValueError`` naming the first target outside
    ``[0, vocab_size)`` (other than ``ignore_index``), if there is one.

    The losses do not check the range up front, which would read the targets back from the
    device (a sync per training step on a GPU). On a CPU the ``gather`` raises a ``RuntimeError``
    ("index 97 is out of bounds for dimension 1") and this names the argument instead; on a GPU
    the kernel asserts. The models check their targets under ``validate_ids``."""
    if targets.device.type != "cpu":
        return  # after a device-side assert, reading the targets would only raise again
    kept = targets if ignore_index is None else targets[targets != ignore_index]
    bad = kept[(kept < 0) | (kept >= vocab_size)]
    if bad.numel():
        ignored = "" if ignore_index is None else f" or ignore_index={ignore_index}"
        raise ValueError(f"targets must be in [0, vocab_size={vocab_size}){ignored}, got target {int(bad[0])}") \
            from None


def _nll_terms(logits: Tensor, row_max: Tensor, sums: Tensor, targets: Tensor, eps: float) -> Tensor:
    """Per-position ``(1 - ε)(log Z - x_t) + ε(log Z - mean_j x_j)``."""
    log_z = sums.log() + row_max
    per = log_z - logits.gather(-1, targets.unsqueeze(-1))
    if eps:
        per = (1.0 - eps) * per + eps * (log_z - logits.mean(dim=-1, keepdim=True))
    return per.squeeze(-1)


def _dlogits(probs: Tensor, targets: Tensor, eps: float, valid: Tensor | None, scale: Tensor | None = None) -> Tensor:
    """``scale · (softmax - (1 - ε) onehot - ε / V)``, zero on ignored positions (filled, not
    multiplied: their probabilities may be NaN): in place in ``probs`` without ``scale``, else a
    new tensor (one pass over the logits when ε = 0 and nothing is ignored, so ``probs`` can be
    used again)."""
    grad = probs if scale is None else probs * scale
    one = 1.0 if scale is None else scale
    grad.scatter_add_(-1, targets.unsqueeze(-1), (-(1.0 - eps) * one) * grad.new_ones((*targets.shape, 1)))
    if eps:
        grad.sub_(eps / probs.shape[-1] * one)
    if valid is not None:
        grad.masked_fill_(~valid.unsqueeze(-1), 0.0)
    return grad


def _loss_by_formula(logits: Tensor, targets: Tensor, eps: float, valid: Tensor | None) -> Tensor:
    """The loss of :func:`cross_entropy` written with differentiable torch operations: what the
    hand-written backward passes differentiate when a second derivative is asked for
    (``create_graph=True``: a gradient penalty, a Hessian-vector product). ``targets`` hold no
    ignored index (see ``valid``)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    per = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if eps:
        per = (1.0 - eps) * per - eps * logp.mean(dim=-1)
    if valid is None:
        return per.mean()
    return torch.where(valid, per, 0.0).sum() / valid.sum().clamp_min(1)


def _counted_targets(targets: Tensor, ignore_index: int | None) -> tuple[Tensor, Tensor | None]:
    """``targets`` as int64 with ``ignore_index`` replaced by 0 (a row :func:`_nll_terms` may gather),
    and where they are counted (None: all of them)."""
    targets = targets.long()
    if ignore_index is None:
        return targets, None
    valid = targets != ignore_index
    return targets.masked_fill(~valid, 0), valid


def _loss_of_targets(logits: Tensor, targets: Tensor, eps: float, ignore_index: int | None) -> Tensor:
    """:func:`_loss_by_formula` of targets that may hold ``ignore_index`` (under a ``torch.func``
    transform: :func:`transformed`): NaN when every target is ignored, as the losses and torch give
    (with a zero gradient), and a target out of range named as they name it."""
    counted, valid = _counted_targets(targets, ignore_index)
    try:
        loss = _loss_by_formula(logits, counted, eps, valid)
    except RuntimeError:  # gather's "index out of bounds": read the targets, all samples at once under vmap
        _name_bad_targets(unbatched(targets), logits.shape[-1], ignore_index)
        raise
    return loss if valid is None else torch.where(valid.any(), loss, torch.nan)


def unbatched(t: Tensor) -> Tensor:
    """``t`` itself where a ``torch.func`` transform (``vmap``'s batching, ``grad``'s wrapping) holds
    it: every sample's values at once, which can be read (a vmapped tensor's ``.item()`` raises)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def _second_order(loss_of: Callable[[], Tensor], inputs: tuple[Tensor | None, ...], grad_loss: Tensor
                  ) -> tuple[Tensor | None, ...]:
    """The gradients of ``loss_of()`` (recomputed with differentiable operations) with respect to
    ``inputs``, with their own graph: a backward pass run under ``create_graph=True`` returns these,
    so that a second derivative through the loss is right. The hand-written pass had been marked
    ``once_differentiable``, which gives a constant here without a word when the incoming gradient
    needs none (a loss's): a gradient penalty through ``cross_entropy`` got a plausible wrong number (api22)."""
    with torch.enable_grad():
        wanted = [t for t in inputs if t is not None]
        grads = iter(torch.autograd.grad(loss_of(), wanted, grad_loss, create_graph=True, allow_unused=True))
        return tuple(None if t is None else next(grads) for t in inputs)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, eps: float, ignore_index: int | None) -> Tensor:
        given = logits
        in_dtype = logits.dtype
        targets, valid = _counted_targets(targets, ignore_index)
        logits = logits.to(torch.promote_types(in_dtype, torch.float32))
        row_max = logits.amax(dim=-1, keepdim=True)
        probs = torch.sub(logits, row_max).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        per = _nll_terms(logits, row_max, total, targets, eps)
        if valid is None:
            count = torch.tensor(float(targets.numel()), device=logits.device)
            loss = per.mean()
        else:
            count = valid.sum().float()
            loss = torch.where(valid, per, 0.0).sum() / count  # where: a NaN row times 0 is NaN
        probs.div_(total)  # softmax, kept for the backward pass
        # the logits given: only read by a backward with create_graph=True (no copy: the caller's tensor)
        ctx.save_for_backward(probs, targets, count, valid if valid is not None else count, given)
        ctx.in_dtype, ctx.eps, ctx.has_valid = in_dtype, eps, valid is not None
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None, None]:
        probs, targets, count, valid, given = ctx.saved_tensors
        valid = valid if ctx.has_valid else None
        if torch.is_grad_enabled():  # create_graph=True: a second derivative will be taken through this
            (grad,) = _second_order(lambda: _loss_by_formula(given, targets, ctx.eps, valid), (given,), grad_loss)
            return grad, None, None, None
        # nothing counted (every target ignored): a zero gradient, as torch, not 0 · (g / 0) = NaN
        grad = _dlogits(probs, targets, ctx.eps, valid, grad_loss / count.clamp_min(1))
        return grad.to(ctx.in_dtype), None, None, None


def is_compiling() -> bool:
    """Whether torch.compile is tracing the caller (``torch.compiler.is_compiling``, torch >= 2.3)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def loss_chunk_size(tokens: int, vocab_size: int, device: torch.device, compiling: bool = False) -> int:
    """How many tokens :func:`linear_cross_entropy` makes logits for at a time.

    Eager on a CPU: 256, so that a chunk's logits stay in cache. Compiled, or on a GPU: as many as
    a budget of logits memory allows (an eighth of a GPU's memory, 1 GiB elsewhere), usually all
    of them: a compiled graph unrolls the chunk loop, and with fixed-size chunks it would grow
    with the batch (and take longer to compile) for no gain on a GPU.
    """
    if device.type == "cpu" and not compiling:
        return 256
    budget = 1 << 30
    if device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory // 8
    per_token = 3 * 4 * vocab_size  # float32 logits, probabilities and their gradient
    return max(256, min(tokens, budget // per_token))


def linear_cross_entropy(
    x: Float[Tensor, "... d"],
    weight: Float[Tensor, "vocab d"],
    targets: Int[Tensor, "*batch"],
    chunk_size: int | None = None,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int | None = None,
) -> Float[Tensor, ""]:
    """``cross_entropy(linear(x, weight), targets, ...)`` with the logits made a chunk of tokens at a time.

    The (tokens × vocab) logits are the largest tensor of a training step (80 MB for 2,048
    tokens and a 10k vocabulary). Here they are made ``chunk_size`` tokens at a time, and the
    gradients of ``x`` and ``weight`` are computed in the same pass while the chunk is still in
    cache, as in Liger-Kernel's fused linear cross-entropy. By default (:func:`loss_chunk_size`)
    a chunk is 256 tokens eager on a CPU, so all the logits are never held at once there;
    compiled or on a GPU it is as many tokens as a memory budget allows, usually all of them.
    The result and gradients equal the unfused ones up to float rounding; in ``no_grad`` mode no
    gradient work is done.
    ``label_smoothing``, ``ignore_index`` and out-of-range targets are as in :func:`cross_entropy`. ``chunk_size``
    defaults to :func:`loss_chunk_size` for the device (and whether it is being compiled).
    ``targets`` must be integers of the shape of ``x`` without its last dimension.
    """
    _check_smoothing(label_smoothing)
    _check_targets(targets, x.shape[:-1], "x")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if transformed():  # the logits at once: the fused pass computes gradients no transform can ask for
        return _loss_of_targets(einsum(x, weight, "... d, v d -> ... v"), targets, float(label_smoothing),
                                ignore_index)
    if chunk_size is None:
        chunk_size = loss_chunk_size(targets.numel(), weight.shape[0], x.device, is_compiling())
    return _naming_bad_targets(_LinearCrossEntropy, (x, weight, targets, chunk_size, float(label_smoothing),
                                                     ignore_index), targets, weight.shape[0], ignore_index)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, chunk_size: int, eps: float,
                ignore_index: int | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        t, valid = _counted_targets(targets.reshape(-1), ignore_index)
        n = x2.shape[0]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x2) if want_x else None
        acc = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)  # float64 stays
        grad_w = torch.zeros_like(weight, dtype=acc) if want_w else None
        total = torch.zeros((), dtype=acc, device=x.device)
        low_precision = torch.is_autocast_enabled(x.device.type)
        # one chunk without a range over n: compiled with dynamic shapes (sentence-pair batches),
        # iterating a range would make the graph guard on the exact token count (a compile per batch)
        for start in range(0, n, chunk_size) if n > chunk_size else (0,):
            xc, tc = x2[start : start + chunk_size], t[start : start + chunk_size]
            vc = None if valid is None else valid[start : start + chunk_size]
            logits = einsum(xc, weight, "n d, v d -> n v").to(acc)
            row_max = logits.amax(dim=-1, keepdim=True)
            probs = torch.sub(logits, row_max).exp_()
            sums = probs.sum(dim=-1, keepdim=True)
            per = _nll_terms(logits, row_max, sums, tc, eps)
            total += (per if vc is None else torch.where(vc, per, 0.0)).sum()
            if want_x or want_w:
                # d loss_i / d logits_i = softmax_i - (1 - ε) onehot(target_i) - ε / V  (1 / n in backward)
                dlogits = _dlogits(probs.div_(sums), tc, eps, vc)
                if want_x:
                    grad_x[start : start + chunk_size] = einsum(dlogits.to(weight.dtype), weight, "n v, v d -> n d")
                if want_w:
                    if low_precision:  # the weight gradient's matmul in autocast's dtype, as unfused
                        grad_w += einsum(dlogits, xc, "n v, n d -> v d")
                    else:
                        grad_w.addmm_(dlogits.mT, xc.to(acc))
        count = torch.tensor(float(n), device=x.device) if valid is None else valid.sum().float()
        # x and weight as given (no copies): only read by a backward with create_graph=True
        ctx.save_for_backward(grad_x if want_x else None, grad_w if want_w else None, count, x, weight, t,
                              valid if valid is not None else count)
        ctx.x_shape, ctx.w_dtype, ctx.eps, ctx.has_valid = x.shape, weight.dtype, eps, valid is not None
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_x, grad_w, count, x, weight, t, valid = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the logits made at once, with a graph
            valid = valid if ctx.has_valid else None
            wanted = (x if ctx.needs_input_grad[0] else None, weight if ctx.needs_input_grad[1] else None)

            def loss_of() -> Tensor:
                logits = einsum(x.reshape(-1, x.shape[-1]), weight, "n d, v d -> n v")
                return _loss_by_formula(logits, t, ctx.eps, valid)

            gx, gw = _second_order(loss_of, wanted, grad_loss)
            return gx, gw, None, None, None, None
        scale = grad_loss / count.clamp_min(1)  # every target ignored: zero gradients, as torch
        gx = None if grad_x is None else (grad_x * scale).reshape(ctx.x_shape)
        gw = None if grad_w is None else (grad_w * scale).to(ctx.w_dtype)
        return gx, gw, None, None, None, None

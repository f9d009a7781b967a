"""Token (or position) embedding: a lookup into a ``(num_embeddings, embedding_dim)`` table.

The lookup has its own backward pass (:class:`_EmbeddingLookup`). Autograd's backward of
``weight[ids]`` is ``index_put_(..., accumulate=True)``, which on CPU adds the rows of a
repeated id from several threads in whatever order they finish, so the gradient of a token
seen twice in a batch changed in its last bits from run to run (and a resumed run could not
match an uninterrupted one). Here every row of the gradient is the sum of its tokens'
gradients taken in the order of the tokens, the same bits on every run and at any thread count.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lm.checks import check_size
from lm.device import check_dtype
from lm.nn.functional import check_integer_dtype, index_rows, transformed


class Embedding(torch.nn.Module):
    """A lookup table ``weight`` of shape ``(num_embeddings, embedding_dim)``: ``forward(ids)`` returns
    the rows ``weight[ids]``, of shape ``ids.shape + (embedding_dim,)``.

    ``ids_name`` (``"token_ids"``; a model's learned position table sets ``"token_positions"``) is
    the argument an id out of range is reported as."""

    ids_name = "token_ids"

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        check_size("num_embeddings", num_embeddings)
        check_size("embedding_dim", embedding_dim)
        check_dtype("dtype", dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: Int[Tensor, "*shape"]) -> Float[Tensor, "... d"]:
        """The rows of integer ``token_ids``; an id outside ``[0, num_embeddings)`` raises an
        ``IndexError`` naming it (on a CPU; on a GPU the kernel asserts), where ``weight[ids]`` would
        read ``-1`` as the last row. Checked by the lookup's kernel: no read back to the host."""
        check_integer_dtype(self.ids_name, token_ids)
        if transformed():  # a torch.func transform's own derivative, of a gather (see index_rows)
            return index_rows(self.weight, token_ids, self.ids_name, "num_embeddings", by_gather=True)
        if not (self.weight.requires_grad and torch.is_grad_enabled()):
            # no backward to make deterministic (generation, evaluation)
            return index_rows(self.weight, token_ids, self.ids_name, "num_embeddings")
        return _EmbeddingLookup.apply(self.weight, token_ids, self.ids_name)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class _EmbeddingLookup(torch.autograd.Function):
    """``weight[ids]`` whose weight gradient is summed in a fixed order.

    ``scatter_add_`` along dim 0 with the ids expanded over the embedding dimension adds each
    token's gradient into its row in token order (on CPU; with ``train.deterministic`` on CUDA,
    torch's deterministic mode gives it a sorted, deterministic kernel). It is also faster than
    autograd's ``index_put_``, and ``index_select`` than ``weight[ids]`` (docs/benchmarks.md).
    """

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, name: str = "token_ids") -> Tensor:
        ctx.save_for_backward(ids.reshape(-1))
        ctx.num_embeddings = weight.shape[0]
        return index_rows(weight, ids, name, "num_embeddings")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        # linear in ``grad`` and built of differentiable operations: under create_graph=True a second
        # derivative through it is right (it had been once_differentiable, which refused one: api22)
        (flat,) = ctx.saved_tensors
        d = grad.shape[-1]
        grad = grad.reshape(-1, d)
        index = flat.long()[:, None].expand(-1, d)
        return grad.new_zeros(ctx.num_embeddings, d).scatter_add_(0, index, grad), None, None

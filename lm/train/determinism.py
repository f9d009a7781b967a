"""``train.deterministic``: the same config and seed give the same bits, run after run.

On CPU nothing global is switched: every kernel on lm's training path is deterministic at a
fixed thread count. The one that was not, autograd's backward of the embedding lookup
(``index_put_`` with ``accumulate=True``, which adds a repeated token's rows from several
threads in any order), is replaced in :class:`lm.nn.Embedding` by its own backward that sums
in token order. The rest was checked op by op (``tests/test_determinism.py`` repeats the
backward of the whole model at two threads and compares the gradients bitwise): the fused
lm_head + cross-entropy (``addmm_`` per chunk, one ``scatter_add_`` per row, no collisions),
both attention paths (einsum's batched matmuls; the CPU flash-attention backward of ``sdpa``),
dropout (``torch.rand`` from the seeded generator), float32 and bfloat16 autocast, AdamW
(elementwise), gradient clipping (one norm per tensor, then their norm) and DDP's all-reduce
over two processes (the sum of two numbers does not depend on their order). With three or more
processes the all-reduce's order of summation for a gradient depends on where it sits in its
bucket, and DDP re-packs its buckets after the first step of every process, so a resumed run
summed in another order than the uninterrupted one: :func:`deterministic_ddp` makes DDP sum the
ranks' gradients in rank order instead, whatever the layout. The number of threads
matters: matmuls split their work by thread count, so a run resumed with another thread count
can differ in the last bits (measured here: 1, 2 and 4 threads agreed, 3 did not).

On CUDA many kernels use atomic adds, so the switch is needed there:
``torch.use_deterministic_algorithms(True)`` (sorted, atomic-free kernels for ``scatter_add_``,
``index_add_``, ``index_put_``; the deterministic flash / memory-efficient attention backward;
cuDNN attention off), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (the cuBLAS setting deterministic
mode requires; it is read when cuBLAS makes its first handle, so it is set before the model is
built), and cuDNN's deterministic flags. It is the strict mode, not ``warn_only``: in warn-only
mode PyTorch keeps the non-deterministic flash-attention backward and only warns. An op with no
deterministic CUDA kernel then stops the run with torch's error naming it; none is on lm's
training path (:data:`NO_DETERMINISTIC_CUDA_KERNEL` lists those near it).
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")  # the two settings torch's deterministic mode accepts

# Ops near lm's code that torch documents as having no deterministic CUDA kernel (they raise in
# deterministic mode), and where lm meets them. None of them runs in a training step.
NO_DETERMINISTIC_CUDA_KERNEL = {
    "torch.cumsum (floating point)": "top-p sampling in lm.generate, not training",
    "torch.nn.NLLLoss / F.cross_entropy": "not used: lm.nn.cross_entropy is hand-written",
    "torch.Tensor.put_": "not used",
    "torch.bincount with weights, torch.histc": "not used",
}


def deterministic_ddp(ddp: torch.nn.parallel.DistributedDataParallel, world_size: int) -> None:
    """With three or more processes, have ``ddp`` average gradients with :func:`rank_ordered_mean`
    (two processes need nothing: ``a + b == b + a``). It moves ``world_size / 2`` times the bytes
    of an all-reduce, the price of a sum whose order never changes."""
    if world_size > 2:
        ddp.register_comm_hook(None, rank_ordered_mean)


def rank_ordered_mean(process_group, bucket):  # no annotations: DDP checks them, as objects
    """DDP communication hook: gather every rank's bucket, then ``(g0 + g1 + ...) / world``
    summed in rank order, the same bits on every rank and whatever the bucket layout."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    grads = bucket.buffer()
    gathered = grads.new_empty(world * grads.numel())  # concatenated: gloo takes no stacked form
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name: torch 2.13
    future = gather(gathered, grads.reshape(-1), group=group, async_op=True).get_future()

    def mean(_) -> torch.Tensor:
        parts = gathered.view(world, *grads.shape)
        total = parts[0].clone()
        for rank in range(1, world):
            total += parts[rank]
        return total.div_(world)

    return future.then(mean)


def configure_determinism(enabled: bool, device: torch.device) -> str:
    """Set up ``device`` for bitwise-reproducible training (see the module docstring) when
    ``enabled``; returns one line saying what holds, for the run's log."""
    threads = torch.get_num_threads()
    if not enabled:
        cpu = f"; the CPU kernels are deterministic at {threads} threads anyway" if device.type == "cpu" else ""
        return f"deterministic: off (train.deterministic = false){cpu}"
    if device.type == "cuda":
        workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        if workspace not in _DETERMINISTIC_CUBLAS:
            raise ValueError(
                f"train.deterministic: CUBLAS_WORKSPACE_CONFIG is {workspace!r} in the environment; "
                f"deterministic cuBLAS needs {' or '.join(_DETERMINISTIC_CUBLAS)} (or unset it)"
            )
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        return (
            f"deterministic: torch deterministic algorithms on, CUBLAS_WORKSPACE_CONFIG={workspace}; an op with "
            "no deterministic CUDA kernel stops the run naming it (none on the training path; "
            "train.deterministic = false allows them)"
        )
    if device.type == "cpu":
        return f"deterministic: yes at {threads} CPU threads (another thread count may change the last bits)"
    return f"deterministic: not guaranteed on {device.type}"

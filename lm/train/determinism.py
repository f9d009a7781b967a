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

No kernel setting makes ``train.max_time`` reproducible: with it the learning-rate schedule, and
the step a run ends at, may follow the clock; the log line then says so
(:func:`clock_schedule_note`).
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


def clock_schedule_note(max_time: float | None, max_steps: int | None, schedule: str = "cosine") -> str | None:
    """What ``train.max_time`` does to reproducibility (a clause for the log line), or None without it.

    With ``max_time`` the trainer's schedule position is ``max(step, elapsed / max_time x length)``
    (``inverse_sqrt`` alone runs by step): once the steps fall behind the pace of the schedule's
    length in ``max_time``, the learning rates follow the clock, so two runs of one config, or a
    run and its ``--resume``, take other learning rates and end with other weights. And a run stops
    where the time runs out, at a step that depends on the clock. The steps themselves, at given
    learning rates, stay deterministic."""
    if max_time is None:
        return None
    if schedule == "inverse_sqrt":
        return "train.max_time may end a run, or its --resume, at another step (the learning rates follow the steps)"
    if max_steps is None:
        return "the schedule follows the clock (train.max_time): runs and --resume are not bitwise the same"
    return ("the schedule follows the clock (train.max_time): runs and --resume are bitwise the same only while the "
            f"steps keep up with train.max_steps {max_steps} in {max_time:g} s ({max_time / max_steps:.3g} s a "
            "step on average)")


def configure_determinism(enabled: bool, device: torch.device, *, max_time: float | None = None,
                          max_steps: int | None = None, schedule: str = "cosine") -> str:
    """Set up ``device`` for bitwise-reproducible training (see the module docstring) when
    ``enabled``; returns one line saying what holds, for the run's log. ``max_time``,
    ``max_steps`` and ``schedule`` (the run's) say whether the learning-rate schedule may follow
    the clock (:func:`clock_schedule_note`), which no kernel setting makes reproducible."""
    n = torch.get_num_threads()
    threads = f"{n} CPU thread{'' if n == 1 else 's'}"
    if not enabled:
        cpu = f"; the CPU kernels are deterministic at {threads} anyway" if device.type == "cpu" else ""
        return f"deterministic: off (train.deterministic = false){cpu}"
    clock = clock_schedule_note(max_time, max_steps, schedule)
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
        line = (
            f"deterministic: torch deterministic algorithms on, CUBLAS_WORKSPACE_CONFIG={workspace}; an op with "
            "no deterministic CUDA kernel stops the run naming it (none on the training path; "
            "train.deterministic = false allows them)"
        )
        return line if clock is None else f"{line}; but {clock}"
    if device.type == "cpu":
        if clock is not None:
            return (f"deterministic: the steps yes at {threads} (another thread count may change the "
                    f"last bits), but {clock}")
        return f"deterministic: yes at {threads} (another thread count may change the last bits)"
    return f"deterministic: not guaranteed on {device.type}"

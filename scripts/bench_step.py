"""The host-side costs of a training step that a GPU would expose, measured on any device.

For the model of a config (default ``configs/tinystories-17m.toml``):

- ``AdamW.step``: lm's AdamW (fused, the default on CPU and CUDA, and the foreach kernels) against
  ``torch.optim.AdamW`` (fused and foreach), aten ops per step and milliseconds per step, the four
  interleaved round by round, medians, and lm against torch of the same kind as torch's time
  divided by lm's (above 1 means lm is faster);
- a checkpoint of the model and AdamW state: written synchronously, against the time the
  training thread spends on a background write (the copy to the host) and the time until it is
  on disk.

    python scripts/bench_step.py                          # 17M config, CPU
    python scripts/bench_step.py --device cuda --rounds 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from copy import deepcopy
from pathlib import Path

import torch

from lm.checkpoint import CheckpointManager
from lm.checkpoint.background import BackgroundWriter
from lm.cli.common import WrittenHelpParser
from lm.device import resolve_device
from lm.model import TransformerLM
from lm.optim import AdamW, param_groups
from lm.train import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.aten_ops import AtenOps  # noqa: E402

MAX_UPDATE_DIFFERENCE = 1e-3  # of the largest update: a last bit of a parameter, not another formula


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizers(model: torch.nn.Module) -> dict[str, torch.optim.Optimizer]:
    def groups():
        return param_groups(model, 0.1)

    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    return {
        "lm AdamW (fused, default)": AdamW(groups(), **kwargs, fused=True),
        "torch AdamW(fused=True)": torch.optim.AdamW(groups(), **kwargs, fused=True),
        "lm AdamW (fused=False: foreach)": AdamW(groups(), **kwargs, fused=False),
        "torch AdamW(foreach=True)": torch.optim.AdamW(groups(), **kwargs, foreach=True),
    }


def update_difference(model: torch.nn.Module, steps: int = 3) -> float:
    """The largest difference between the parameters that lm's AdamW and torch's of the same kind (the
    pairs of :func:`optimizers`, which the ratio column compares) give copies of ``model`` after
    ``steps`` steps from the same gradients, relative to the largest update: the rows time the same
    work only if it is small. (On a CPU each pair agrees to the bit; fused against foreach kernels
    differ by a last bit of a parameter.)"""
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=g).to(p.device) * 1e-3 for p in model.parameters()] for _ in range(steps)]
    after = {}
    for name in optimizers(model):
        copy = deepcopy(model)
        opt = optimizers(copy)[name]
        for step_grads in grads:
            for p, grad in zip(copy.parameters(), step_grads):
                p.grad = grad.clone()
            opt.step()
        after[name] = [q.detach().double() for q in copy.parameters()]
    start = [p.detach().double() for p in model.parameters()]
    scale = max((a - b).abs().max().item() for a, b in zip(next(iter(after.values())), start))
    names = list(after)
    return max((a - b).abs().max().item() / scale for lm_row, torch_row in zip(names[::2], names[1::2])
               for a, b in zip(after[lm_row], after[torch_row]))


def bench_optimizers(model: torch.nn.Module, device: torch.device, rounds: int) -> None:
    difference = update_difference(model)
    if not difference <= MAX_UPDATE_DIFFERENCE:
        sys.exit(f"bench_step.py: lm's and torch's AdamW of the same kind differ by {difference:.2e} of the largest "
                 f"update (more than {MAX_UPDATE_DIFFERENCE:g}): the rows would not time the same work")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = optimizers(model)
    ops = {}
    for name, opt in opts.items():
        opt.step()  # the moments exist: the steady state is measured
        with AtenOps() as count:
            opt.step()
        ops[name] = count.ops
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(rounds):
        for name, opt in opts.items():
            _sync(device)
            start = time.perf_counter()
            opt.step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    n = len(list(model.parameters()))
    print(f"\nAdamW.step over {n} parameter tensors ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters), {device}, median of {rounds} interleaved rounds\n")
    print(f"(lm's and torch's of the same kind make the same updates: after three steps from the same gradients "
          f"the parameters differ by at most {difference:.1e} of the largest update)\n")
    print("| optimizer | aten ops per step | ms per step | lm vs torch, same kind |")
    print("|---|---:|---:|---:|")
    names = list(opts)
    for i, name in enumerate(names):
        ratio = f"{ms[names[i + 1]] / ms[name]:.2f}×" if i % 2 == 0 else ""
        print(f"| {name} | {ops[name]} | {ms[name]:.2f} | {ratio} |")


def bench_checkpoint(model: torch.nn.Module, rounds: int) -> None:
    opt = AdamW(param_groups(model, 0.1), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": 1}
    with tempfile.TemporaryDirectory() as folder:
        manager = CheckpointManager(folder, keep_last=2)
        writer = BackgroundWriter(manager)
        sync, blocking, done = [], [], []
        for i in range(rounds):
            start = time.perf_counter()
            path = manager.save(state, 2 * i + 1)
            sync.append(time.perf_counter() - start)
            start = time.perf_counter()
            writer.save(state, 2 * i + 2)
            blocking.append(time.perf_counter() - start)
            writer.wait()
            done.append(time.perf_counter() - start)
        size = Path(path).stat().st_size / 1e6
    print(f"\nA checkpoint of the model and AdamW state ({size:.0f} MB), median of {rounds}\n")
    print("| write | seconds on the training thread | seconds until on disk |")
    print("|---|---:|---:|")
    print(f"| synchronous (before) | {statistics.median(sync):.3f} | {statistics.median(sync):.3f} |")
    print(f"| BackgroundWriter (the trainer's) | {statistics.median(blocking):.3f} | {statistics.median(done):.3f} |")


def main() -> None:
    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = lambda message: ap.exit(2, f"{ap.prog}: error: {message}\n")  # one line, no usage
    ap.add_argument("--config", default="configs/tinystories-17m.toml")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--checkpoint-rounds", type=int, default=3)
    args = ap.parse_args()
    for flag, value in (("--rounds", args.rounds), ("--checkpoint-rounds", args.checkpoint_rounds)):
        if value < 1:
            ap.error(f"{flag}: must be >= 1, got {value}")
    try:  # a missing config or a device this machine lacks: one line, before any work
        device = resolve_device(args.device, "--device")
        cfg = load_config(args.config, ["data.train=unused", f"train.device={device}"])
    except ValueError as e:
        ap.error(str(e))
    torch.manual_seed(0)
    model = TransformerLM.from_config(cfg.model).to(device)
    bench_optimizers(model, device, args.rounds)
    bench_checkpoint(model, args.checkpoint_rounds)


if __name__ == "__main__":
    main()

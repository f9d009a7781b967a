"""How fast sixteen decode rows could be on this machine, against one: the bound behind the
"16 streams ≥ 8× one" target of ``scripts/bench_model.py`` (see docs/benchmarks.md, "Sixteen
streams against one").

    python scripts/bench_step_bound.py              # about two minutes on a 2-core CPU (compilation)

Two tables for the model of ``bench_model.py``'s generation rows, at 1 and at 16 rows:

* the model's linear layers alone (each block's q, k, v, o, w1, w3, w2 and the output
  projection), as plain ``F.linear`` and through oneDNN with its weights prepacked for that
  number of rows (the form inductor's ``freezing`` gives CPU inference), in float32 and
  bfloat16: the matmuls a step cannot do without;
* the compiled decode step ``lm serve --compile`` runs (``lm.generate.DecodeStep``), every row at
  position 160: in float32, under bfloat16 autocast, and with the weights stored in bfloat16.

It prints each one's milliseconds (median of ``--rounds`` runs of ``--steps`` calls, the 1-row and
16-row forms taking turns within each round) and what sixteen rows give against one in tokens/s.
Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lm.cli.common import WrittenHelpParser
from lm.generate.static import DecodeStep
from lm.model import TransformerLM

SHAPE = dict(vocab_size=10_000, context_length=512, d_model=256, num_layers=4, num_heads=8, d_ff=688)


def median_ms(fns: dict[int, Callable[[], object]], rounds: int, steps: int) -> dict[int, float]:
    """Milliseconds per call of each of ``fns`` (by rows): the median of ``rounds`` rounds of ``steps``
    calls, the forms taking turns within each round so that they see the same machine state."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[int, list[float]] = {rows: [] for rows in fns}
    for _ in range(rounds):
        for rows, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[rows].append((time.perf_counter() - t0) / steps * 1e3)
    return {rows: statistics.median(t) for rows, t in times.items()}


def linear_weights(model: TransformerLM) -> list[torch.Tensor]:
    return [p.detach() for name, p in model.named_parameters() if p.ndim == 2 and "embedding" not in name]


@torch.inference_mode()
def bench_linears(model: TransformerLM, args) -> None:
    print(f"{'the linear layers alone':<34}{'1 row':>10}{'16 rows':>10}{'16 vs 1':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [w.to(dtype) for w in linear_weights(model)]
        for form in ("F.linear", "oneDNN prepacked"):
            runs = {}
            for rows in (1, 16):
                xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in weights}
                if form == "F.linear":
                    def run(xs=xs, weights=weights):
                        for w in weights:
                            F.linear(xs[w.shape[1]], w)
                else:
                    packed = [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w, rows)) for w in weights]

                    def run(xs=xs, packed=packed):
                        for d_in, p in packed:
                            torch.ops.mkldnn._linear_pointwise(xs[d_in], p, None, "none", [], "")
                runs[rows] = run
            ms = median_ms(runs, args.rounds, args.steps)
            label = f"{form}, {str(dtype).removeprefix('torch.')}"
            print(f"{label:<34}{ms[1]:>8.3f}ms{ms[16]:>8.3f}ms{16 * ms[1] / ms[16]:>9.2f}×")


def bench_steps(model: TransformerLM, args) -> None:
    print(f"\n{'the compiled decode step':<34}{'1 row':>10}{'16 rows':>10}{'16 vs 1':>10}")
    bf16_weights = copy.deepcopy(model).to(torch.bfloat16)
    for label, m, dtype in (("float32", model, None), ("bfloat16 autocast", model, torch.bfloat16),
                            ("bfloat16 weights", bf16_weights, None)):
        steps = {rows: DecodeStep(m, rows, compile=True, dtype=dtype) for rows in (1, 16)}
        ms = median_ms({rows: lambda step=step, rows=rows: step([5] * rows, [160] * rows)
                        for rows, step in steps.items()}, args.rounds, args.steps)
        print(f"{label:<34}{ms[1]:>8.3f}ms{ms[16]:>8.3f}ms{16 * ms[1] / ms[16]:>9.2f}×")


def main() -> None:
    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = lambda message: ap.exit(2, f"{ap.prog}: error: {message}\n")  # one line, no usage
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--skip-steps", action="store_true", help="only the linear layers (no compilation)")
    args = ap.parse_args()
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps)):
        if value < 1:
            ap.error(f"{flag}: must be >= 1, got {value}")
    torch.manual_seed(0)
    model = TransformerLM(**SHAPE, attn_impl="einsum").eval()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    bench_linears(model, args)
    if not args.skip_steps:
        bench_steps(model, args)


if __name__ == "__main__":
    main()

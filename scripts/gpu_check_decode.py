"""Decoding on a GPU (called by scripts/gpu_check.sh): the compiled fixed-shape step (CUDA graphs
through torch.compile's reduce-overhead mode) against eager, one stream and 16, float32 and
bfloat16; tokens must be identical to the eager loop's in float32.

    PYTHONPATH=. python scripts/gpu_check_decode.py
"""

from __future__ import annotations

import time

import torch

from lm.generate import generate
from lm.model import TransformerLM

SHAPE = dict(vocab_size=10_000, context_length=512, d_model=256, num_layers=4, num_heads=8, d_ff=688)


def rate(fn, tokens: int, rounds: int = 3) -> float:
    fn()  # warm-up (and compilation)
    best = 0.0
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def main() -> int:
    assert torch.cuda.is_available(), "no CUDA device"
    torch.manual_seed(0)
    model = TransformerLM(**SHAPE).cuda().eval()
    prompts = torch.randint(0, SHAPE["vocab_size"], (16, 32)).tolist()
    n, ok = 256, True
    eager_one = generate(model, prompts[0], n, temperature=0)
    compiled_one = generate(model, prompts[0], n, temperature=0, compile=True)
    same = eager_one == compiled_one
    ok &= same
    print(f"float32 one stream, compiled tokens == eager tokens: {same}")
    many = generate(model, prompts, n, temperature=0, compile=True)
    same = many[0] == eager_one
    ok &= same
    print(f"float32 16 streams, compiled, row 0 == one eager stream: {same}")
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            r = {
                "eager, 1 stream": rate(lambda: generate(model, prompts[0], n, temperature=0), n),
                "compiled, 1 stream": rate(lambda: generate(model, prompts[0], n, temperature=0, compile=True), n),
                "eager, 16 streams": rate(lambda: generate(model, prompts, n, temperature=0), 16 * n),
                "compiled, 16 streams": rate(lambda: generate(model, prompts, n, temperature=0, compile=True), 16 * n),
            }
        for k, v in r.items():
            print(f"{str(dtype):15s} {k:22s} {v:10,.0f} new tokens/s")
        print(f"{str(dtype):15s} compiled 16 streams / compiled 1 stream: "
              f"{r['compiled, 16 streams'] / r['compiled, 1 stream']:.2f}x (target >= 8x); "
              f"compiled 1 stream / eager 1 stream: {r['compiled, 1 stream'] / r['eager, 1 stream']:.2f}x")
    print("decode check:", "pass" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env bash
# The GPU checks in one call, from a checkout (no install needed): CUDA tests, float32/bfloat16/compile
# parity, the compiled decode steps (the language model's and the translation engine's; 16 streams
# against one), one stream against transformers' generate, a timed tinystories-17m run (ms/step,
# tokens/s, MFU, syncs per step, held-out loss) and torchrun over every visible GPU. Everything is in
# scripts/gpu_check.py; `--parts decoding,tests` runs some parts only; `scripts/gpu_check.sh --device
# cpu` runs its short CPU version; $PYTHON picks the interpreter.
set -euo pipefail
# --json FILE is the caller's: relative to the folder it was called from, not to the checkout
export GPU_CHECK_CWD="$PWD"
cd "$(dirname "$0")/.."
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python}" scripts/gpu_check.py "$@"

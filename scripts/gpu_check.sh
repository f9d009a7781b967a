#!/usr/bin/env bash
# Everything that needs a GPU, in one short call (about 8 minutes on one H200), from the checkout:
#
#     bash scripts/gpu_check.sh            # PYTHONPATH=. is set here; wandb is not needed
#
# 1. the tests that run on CUDA when it is there (model on cuda, bf16, compile), and the
#    decoding tests; 2. decoding: the compiled fixed-shape step as a CUDA graph, 1 and 16 streams,
#    float32 and bfloat16, tokens against eager; 3. a timed training run of the TinyStories 17M
#    configuration (bfloat16, torch.compile) on a synthetic corpus made here (the machine is
#    offline): tokens/s and MFU from the run's own log. (A dry run of part 3 on a CPU:
#    GPU_CHECK_DEVICE=cpu GPU_CHECK_BYTES=2000000 GPU_CHECK_SECONDS=20.) Each part runs even if one before failed;
#    the last line sums up.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=.
status=0
part() { echo; echo "=== $1"; }

part "environment"
python -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0))" || status=1

part "1. tests (CUDA paths, generation, serving engine)"
timeout 900 python -m pytest -q -x tests/test_model.py tests/test_generate.py tests/test_serve.py \
    -p no:cacheprovider || status=1

part "2. decoding: compiled step (CUDA graphs) against eager"
timeout 600 python scripts/gpu_check_decode.py || status=1

part "3. training: TinyStories 17M config, bfloat16 + compile, 180 s"
work=$(mktemp -d)
timeout 900 python - "$work" <<'PY' || status=1
import subprocess, sys, json, pathlib
w = pathlib.Path(sys.argv[1])
from lm.demo.stories import write_corpus
import os
device, size = os.environ.get("GPU_CHECK_DEVICE", "cuda"), int(os.environ.get("GPU_CHECK_BYTES", 40_000_000))
seconds = os.environ.get("GPU_CHECK_SECONDS", "180")
write_corpus(w / "stories.txt", size, seed=0)
run = lambda *a: subprocess.run([sys.executable, "-m", "lm", *a, "--quiet"], check=True)
run("tokenizer", "train", "--input", str(w / "stories.txt"), "--vocab-size", "1536",
    "--special-token", "<|endoftext|>", "--out", str(w / "tok"))
run("tokenize", "--tokenizer", str(w / "tok"), "--input", str(w / "stories.txt"), "--out", str(w / "train.bin"))
run("train", "--config", "configs/tinystories-17m.toml", "--device", device, "--dtype", "bfloat16",
    "--set", f"data.train={w / 'train.bin'}",
    "--set", f"data.val={w / 'train.bin'}", "--set", f"data.tokenizer={w / 'tok'}",
    "--set", f"train.out_dir={w / 'run'}", "--set", f"train.max_time={seconds}", "--set", "optim.cosine_cycle_iters=20000",
    "--set", "checkpoint.interval=100000", "--set", "eval.interval=500")
records = [json.loads(line) for line in (w / "run" / "metrics.jsonl").read_text().splitlines()]
train = [r for r in records if r.get("split") == "train"]
val = [r for r in records if r.get("split") == "val"]
last = train[-1]
print(f"training: {last['step']} steps in {last['time']:.0f} s, {last['tok_per_s']:,.0f} tokens/s, "
      f"MFU {100 * last['mfu']:.1f}%, train loss {last['loss']:.3f}, "
      f"val loss {val[-1]['loss'] if val else float('nan'):.3f} (synthetic stories, a 1,536-token BPE; the model keeps the 10K vocabulary)")
PY
rm -rf "$work"

echo
echo "gpu_check: $([ $status -eq 0 ] && echo 'all parts passed' || echo 'SOME PARTS FAILED')"
exit $status

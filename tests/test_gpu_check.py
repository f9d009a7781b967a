"""scripts/gpu_check.sh (scripts/gpu_check.py), the script for the first session with a GPU, runs its
short CPU version here so that it does not rot: every part must pass and the table must name them all."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_every_part_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    # through the wrapper a GPU session runs (scripts/gpu_check.sh), with this interpreter
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--seconds", "8",
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    parts = " ".join(row["part"] for row in rows)
    for name in ("float32 logits", "bfloat16", "torch.compile", "decoding", "serving engine, bfloat16",
                 "translation engine", "training", "DDP"):
        assert name in parts
    assert all(row["ok"] is not False for row in rows)
    training = next(row for row in rows if row["part"].startswith("training"))
    assert "tokens/s" in training["detail"] and "MFU" in training["detail"] and "val loss" in training["detail"]
    assert "all parts passed" in r.stdout

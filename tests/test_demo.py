"""`lm demo` end to end on tiny settings: every stage runs and the report holds what it promises."""

import json

import pytest

from lm.demo.pipeline import DemoSettings, run_demo, unigram_bits_per_byte


def test_unigram_baseline_formula():
    import math

    import numpy as np

    train = np.array([0, 0, 0, 1])  # counts +1: [4, 2, 1] of 7
    val = np.array([0, 1, 2])
    expected = -(math.log(4 / 7) + math.log(2 / 7) + math.log(1 / 7)) / math.log(2) / 6
    assert unigram_bits_per_byte(train, val, 3, val_bytes=6) == pytest.approx(expected)


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no TinyStories in ./data: the synthetic corpus is used
    # bound by steps, not by the clock (300 steps take about 8 s here), so a busy machine only makes it slower
    settings = DemoSettings(out_dir=str(tmp_path / "demo"), corpus_bytes=400_000, vocab_size=600,
                            train_seconds=300, max_steps=300, d_model=64, num_layers=2, num_heads=2, context_length=64,
                            num_samples=2, sample_tokens=40, progress=False)
    report = run_demo(settings)
    assert report.synthetic
    assert report.val["bits_per_byte"] < 0.75 * report.unigram_bpb
    assert len(report.samples) == 2 and all(s.strip() for s in report.samples)
    assert (tmp_path / "demo" / "loss.png").stat().st_size > 1000
    text = report.to_text()
    assert "SYNTHETIC" in text and "unigram baseline" in text and "sample 2" in text
    saved = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert saved["val"]["loss"] == pytest.approx(report.val["loss"])

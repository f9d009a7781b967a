"""scripts/gpu_check.sh (scripts/gpu_check.py), the script for the first session with a GPU, runs its
short CPU version here so that it does not rot: every part must pass and the table must name them all.
Its --json FILE is the caller's: relative to the caller's folder, never an earlier session's rows
written over without --overwrite, and a folder that is not there is found before any part runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[1]


def _wrapper(*argv, cwd: Path) -> subprocess.CompletedProcess:
    """scripts/gpu_check.sh ARGV from ``cwd``, with a budget so short that a run that is not refused
    ends in seconds (its parity part only)."""
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--budget", "0.01",
                           *map(str, argv)], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})


def _gpu_check():
    return load_script("gpu_check.py")


def test_json_is_relative_to_the_callers_folder_and_not_written_over(tmp_path):
    """The wrapper changed to the checkout first: `--json rows.json` wrote into the checkout, and an
    existing file (a paid session's rows) was replaced at the first row, without --overwrite."""
    (tmp_path / "rows.json").write_text("precious rows of the last GPU session")
    r = _wrapper("--json", "rows.json", cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr == (f"gpu_check.py: --json: {str(tmp_path / 'rows.json')!r} exists (an earlier run's rows?); "
                        "pass --overwrite to replace it, or name a new file\n")
    assert r.stdout == ""  # refused before any part
    assert (tmp_path / "rows.json").read_text() == "precious rows of the last GPU session"


def test_json_in_a_missing_folder_is_refused_before_any_part(tmp_path):
    """It was a FileNotFoundError traceback after the parity part had run."""
    r = _wrapper("--json", "nodir/rows.json", cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr == f"gpu_check.py: --json: the folder {str(tmp_path / 'nodir')!r} does not exist; make it first\n"
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_json_overwrite_replaces_the_file_at_the_first_row(tmp_path, monkeypatch, capsys):
    gpu_check = _gpu_check()
    monkeypatch.setenv("GPU_CHECK_CWD", str(tmp_path))
    old = tmp_path / "old.json"
    old.write_text("an earlier run")
    assert gpu_check.json_output("old.json", overwrite=False) is None
    assert gpu_check.json_output("old.json", overwrite=True) == str(old)
    assert old.read_text() == "an earlier run"  # kept until there is a row to replace it with
    report = gpu_check.Report(str(old))
    report.add("parity", True, "max abs diff 0")
    assert json.loads(old.read_text()) == [{"part": "parity", "ok": True, "detail": "max abs diff 0"}]
    new = gpu_check.json_output("new.json", overwrite=False)  # made at once: the folder is writable
    assert new == str(tmp_path / "new.json") and json.loads(Path(new).read_text()) == []
    assert gpu_check.json_output(str(tmp_path), overwrite=True) is None  # a folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "old.json"]  # no temporary file left
    err = capsys.readouterr().err.splitlines()
    assert err == [f"gpu_check.py: --json: {str(old)!r} exists (an earlier run's rows?); pass --overwrite to "
                   "replace it, or name a new file",
                   f"gpu_check.py: --json: {str(tmp_path)!r} is a folder; name a file in it"]


def test_parts_runs_the_named_parts_only_and_refuses_an_unknown_one(tmp_path):
    """A second call on a warm machine (a few minutes of device time left) reruns one part, not all."""
    r = _wrapper("--parts", "parity,decodng", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("gpu_check.py: --parts: 'decodng' is not a part; name some of parity, decoding, "
                        "transformers, training, determinism, tests, translation, ddp\n")
    r = _wrapper("--parts", "translation", "--json", "rows.json", cwd=tmp_path)
    rows = json.loads((tmp_path / "rows.json").read_text())  # its one part, not run: 0.01 s is too short for it
    assert r.returncode == 0 and [(row["part"], row["ok"]) for row in rows] == [("translation engine", None)], r.stdout


def test_a_failed_json_write_is_one_line_and_the_run_goes_on(tmp_path, capsys):
    """A write that failed (the folder gone) raised from inside `guarded`'s handler: a traceback."""
    gpu_check = _gpu_check()
    report = gpu_check.Report(str(tmp_path / "gone" / "rows.json"))
    report.add("parity", True, "ok")
    report.add("decoding", True, "ok")
    assert len(report.rows) == 2
    err = capsys.readouterr().err.splitlines()
    gone = str(tmp_path / "gone" / "rows.json")
    assert len(err) == 1 and err[0].startswith(f"gpu_check.py: --json: cannot write {gone!r} (No such file")


@pytest.mark.slow
def test_the_gpu_check_runs_every_part_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    # through the wrapper a GPU session runs (scripts/gpu_check.sh), with this interpreter
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu", "--seconds", "3",
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    parts = " ".join(row["part"] for row in rows)
    for name in ("float32 logits", "bfloat16", "torch.compile", "per-sample gradients", "per-sample gradients compiled",
                 "decoding",
                 "16 compiled streams", "time goes",
                 "serving engine, bfloat16", "one stream vs transformers", "translation engine", "training", "DDP",
                 "deterministic training"):
        assert name in parts
    assert all(row["ok"] is not False for row in rows)
    training = next(row for row in rows if row["part"].startswith("training"))
    assert "tokens/s" in training["detail"] and "MFU" in training["detail"] and "val loss" in training["detail"]
    assert "all parts passed" in r.stdout


def test_split_corpus_holds_out_the_last_twentieth_of_documents_and_refuses_one_document(tmp_path):
    """The validation text held out of a corpus without one: a corpus of one line had trained on
    nothing (its one line was the validation text), and an end-of-text marker at a cut was lost."""
    split_corpus = _gpu_check().split_corpus
    eot = "<|endoftext|>"
    docs = [f"story {i} about a cat.\n" for i in range(40)]
    (tmp_path / "marked.txt").write_text("".join(d + eot + "\n" for d in docs))
    train, val = split_corpus(tmp_path / "marked.txt", tmp_path)
    assert train.read_text().count(eot) == 38 and val.read_text().count(eot) == 2
    assert train.read_text().endswith(eot)
    assert val.read_text().startswith("\nstory 38") and val.read_text().endswith(eot)
    assert "story 37" in train.read_text() and "story 37" not in val.read_text()
    (tmp_path / "lines.txt").write_text("first line\n\n  \nsecond line\nthird line\n")  # blank lines are no documents
    train, val = split_corpus(tmp_path / "lines.txt", tmp_path)
    assert (train.read_text(), val.read_text()) == ("first line\nsecond line\n", "third line\n")
    for text in ("", "one line only\n", "one line\n\n\n"):
        (tmp_path / "short.txt").write_text(text)
        with pytest.raises(ValueError, match=r"^corpus: .*short\.txt' holds [01] document\(s\) .*need at least 2"):
            split_corpus(tmp_path / "short.txt", tmp_path)


@pytest.mark.parametrize("status, word", [(130, "interrupted"), (143, "terminated")])
def test_a_signal_during_training_stops_the_check(tmp_path, monkeypatch, capsys, status, word):
    """A Ctrl-C (or a machine's SIGTERM at its time limit) during the training part was a FAIL row that
    read like a measured failure, and the later parts ran on (demo21). The row says it was interrupted,
    the table so far is printed, the later parts do not run, and the check exits 128 + the signal."""
    import lm.train

    gpu_check = _gpu_check()

    class Stopped:  # the trainer, stopped by the signal at once: run() returns 128 + the signal
        def __init__(self, cfg, print_fn=None):
            pass

        def run(self):
            return status

    monkeypatch.setattr(lm.train, "Trainer", Stopped)
    monkeypatch.setattr(gpu_check, "prepare_data", lambda work, cpu, report: None)
    monkeypatch.setenv("GPU_CHECK_CWD", str(tmp_path))
    assert gpu_check.main(["--device", "cpu", "--parts", "training,translation", "--seconds", "5", "--budget", "300",
                           "--json", "rows.json"]) == status
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(row["part"], row["ok"]) for row in rows] == [("training", None)]
    assert rows[0]["detail"].startswith(f"interrupted (status {status}) after ")
    out, err = capsys.readouterr()
    assert "| training |" in out and "translation" not in out
    assert err.strip().startswith(f"gpu_check: {word} (")

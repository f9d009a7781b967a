"""The scripts that are not benchmarks refuse a bad option in one line naming it, with exit status 2,
before they spend minutes or write anything; none of these needs the data or mutmut."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, *argv, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _refused(r: subprocess.CompletedProcess, script: str, why: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"{script}: error: {why}"), lines[0]


@pytest.mark.parametrize("argv, why", [
    (["--rev", "nosuchrev"], "--rev: 'nosuchrev' is not a revision of this repository"),
    (["--tests-rev", "nosuchrev"], "--tests-rev: 'nosuchrev' is not a revision of this repository"),
    (["--targets", "bpe", "--functions", "nosuchfn"], "--functions: 'nosuchfn' is defined in none of the files"),
    (["--workdir", "afile"], "--workdir: 'afile' is a file, not a folder"),
    (["--out", "afile/x.json"], "--out: 'afile' is a file, not a folder"),
    (["--out", "precious.json"], "--out: 'precious.json' exists and is not a summary of this script"),
    (["--out", "precious.json", "--overwrite"], "--out: 'precious.json' exists and is not a summary"),
    (["--sample", "-1"], "--sample: must be >= 0"),
])
def test_mutation_refuses_bad_options_before_any_copy(tmp_path, argv, why):
    """A bad --rev and a file --workdir were tracebacks; an existing --out (results of an earlier
    campaign) was written over without --overwrite, in place; a misspelt --functions ran, found no
    mutants and exited 0."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "precious.json").write_text('{"results": "of an hour"}')
    _refused(_run("mutation.py", *argv, cwd=tmp_path), "mutation.py", why)
    assert (tmp_path / "precious.json").read_text() == '{"results": "of an hour"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "precious.json"]


def _mutation():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import mutation
    finally:
        sys.path.pop(0)
    return mutation


def test_mutation_finds_methods_and_functions_at_a_revision():
    mutation = _mutation()
    names = mutation.functions_in("HEAD", ["lm/optim/adamw.py", "lm/optim/clip.py"])
    assert {"AdamW.step", "AdamW.__init__", "clip_grad_norm_", "param_groups"} <= names
    assert "step" not in names  # a method is Class.method


def test_mutation_targets_name_files_tests_and_decorators_that_exist():
    """Each target's files and test files exist, and each decorator it takes off is still where it
    looks for it: else a run stops at that target (a SetupError) after the hours of those before."""
    mutation = _mutation()
    for name, target in mutation.TARGETS.items():
        assert all((REPO / f).is_file() for f in target.files), name
        for arg in (a for a in target.tests if a.startswith("tests/")):
            file, _, test = arg.partition("::")  # a file, or one test of it
            assert (REPO / file).is_file(), (name, arg)
            assert not test or f"def {test}(" in (REPO / file).read_text(encoding="utf-8"), (name, arg)
        for file, old, _ in target.prepare:
            assert old is None or old in (REPO / file).read_text(), (name, old)
        assert set(target.functions) <= mutation.functions_in("WORKTREE", target.files), name


def test_mutation_says_why_mutmut_stopped(tmp_path):
    """mutmut stops before any mutant when the tests fail on the unmutated copy; its log's last line
    (not its spinner) and any failed test are what the summary shows instead of N "not checked"."""
    mutation = _mutation()
    log = tmp_path / "target.log"
    log.write_text("\u280b Generating mutants\u2819 Generating mutants\n    done in 44ms\n"
                   "\u2838 Running stats\u283c Running stats\nfailed to collect stats. runner returned 1\n\n")
    assert mutation.mutmut_failure(log) == "failed to collect stats. runner returned 1"
    log.write_text("FAILED tests/test_x.py::test_y - AssertionError\r\nfailed to collect stats. runner returned 1\n")
    assert mutation.mutmut_failure(log) == ("failed to collect stats. runner returned 1; "
                                            "FAILED tests/test_x.py::test_y - AssertionError")


@pytest.mark.parametrize("argv, why", [
    (["--dir", "nonexistent"], "--dir: 'nonexistent' is not a folder"),
    (["--gb", "0"], "--gb: must hold a few batches"),
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
    # clifuzz7: inf was an OverflowError traceback; 1e30 wrote until the disk was full (--steps 0, which
    # the code before refused before writing, keeps this test from filling the disk there)
    (["--gb", "inf"], "--gb: must be a finite number of GB, got inf"),
    (["--gb", "1e30", "--dir", ".", "--steps", "0"], "--gb: a 1e+30 GB token file does not fit in the "),
])
def test_check_train_memory_refuses_bad_options(tmp_path, argv, why):
    """Each was a traceback (a missing --dir from TemporaryDirectory, --gb 0 and --steps 0 from the trainer)."""
    _refused(_run("check_train_memory.py", *argv, cwd=tmp_path), "check_train_memory.py", why)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("chromium", ["nonexist/chromium", "afolder"])
def test_playground_screenshot_checks_chromium_before_serving(tmp_path, chromium):
    """clifuzz7: a --chromium that is not there started the server, then failed in a Playwright
    traceback. Refused first, as --out is (the checkpoint given here would be refused by the server)."""
    (tmp_path / "afolder").mkdir()
    r = _run("playground_screenshot.py", "--checkpoint", "nonexist-run", "--chromium", chromium, "--out", "x.png",
             cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr == (f"playground_screenshot.py: --chromium: {chromium!r} is not an executable file; install "
                        "Debian's chromium or pass --chromium PATH\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afolder"]


@pytest.mark.parametrize("argv, why", [
    (["--budget", "0"], "--budget: must be > 0 seconds, got 0"),
    (["--warmup", "0"], "--warmup: must be >= 1, got 0"),
    (["--out", "afile/r.json"], "--out: 'afile' is a file, not a folder, so 'afile/r.json' cannot be made"),
    (["--out", "other.json"], "--out: 'other.json' exists and is not a result of this script"),
])
def test_multi30k_reference_refuses_bad_options_before_it_runs(tmp_path, argv, why):
    """--out was written at the end of the run, in place: a missing folder was a traceback after
    minutes of training and decoding, and the result was lost."""
    (tmp_path / "multi30k").mkdir()
    (tmp_path / "multi30k" / "train.en.gz").write_bytes(b"")  # only its presence is checked up front
    (tmp_path / "afile").write_text("x")
    (tmp_path / "other.json").write_text(json.dumps({"mine": 1}))
    r = _run("multi30k_reference.py", "--data", tmp_path, *argv, cwd=tmp_path)
    _refused(r, "multi30k_reference.py", why)
    assert json.loads((tmp_path / "other.json").read_text()) == {"mine": 1}


SCRIPTS_WITH_HELP = ["shakespeare.py", "multi30k.py", "bench_tokenizer.py", "bench_model.py", "bench_train.py",
                     "bench_step.py", "bench_step_bound.py", "bench_seq2seq.py", "bench_serve.py",
                     "bench_decode_steps.py", "check_train_memory.py", "gpu_check.py", "playground_screenshot.py"]


@pytest.mark.parametrize("script", SCRIPTS_WITH_HELP)
def test_a_scripts_help_that_cannot_be_written_is_an_error(tmp_path, script):
    """`scripts/X.py --help > /dev/full` exited 0 with nothing written (argparse drops the failed
    write), where `lm --help > /dev/full` is one error line and exit 2: the scripts' parsers are
    lm's WrittenHelpParser now. A help that is written still exits 0."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], cwd=tmp_path, env=env,
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip() == f"{script}: error: standard output cannot be written: No space left on device"
    ok = _run(script, "--help", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: ") and not ok.stderr, ok.stderr

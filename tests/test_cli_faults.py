"""Bad inputs and faults against the real command line, one row a case, each in a subprocess.

Each row is something a new user did that used to destroy a file, print a plausible wrong
number with exit 0, or end in a traceback. Every row checks the exit status, that stderr is one
line (or the lines it should be) naming the argument, and that nothing it must not touch changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lm.data.token_file import read_token_file, sidecar_path
from lm.tomlio import dump_tables

REPO = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
STORY = "Tom had a red ball. He liked to throw it high. One day the ball went over the fence!\n"


def lm(*args, cwd: Path, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [a if isinstance(a, bytes) else str(a) for a in args]  # bytes go through as they are (not UTF-8)
    return subprocess.run([sys.executable, "-m", "lm", *argv], cwd=cwd, capture_output=True,
                          env=env, timeout=timeout, **kwargs)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` (dotfiles too) with its SHA-256: what must not change."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def err_of(r: subprocess.CompletedProcess) -> str:
    return r.stderr.decode(errors="replace").strip()


def one_line_error(r: subprocess.CompletedProcess, *needles: str, rc: int = 2) -> None:
    err = err_of(r)
    assert r.returncode == rc, (r.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A corpus, a tokenizer, token files and a trained run, made through the CLI once."""
    from lm.train import Trainer, config_from_dict

    w = tmp_path_factory.mktemp("faults")
    (w / "corpus.txt").write_text("".join(f"{STORY}Story {i}.\n{EOT}\n" for i in range(400)), encoding="utf-8")
    for args in (
        ["tokenizer", "train", "--input", "corpus.txt", "--vocab-size", "300", "--special-token", EOT, "--out", "tok",
         "--quiet", "--holdout-bytes", "0"],
        ["tokenize", "--tokenizer", "tok", "--input", "corpus.txt", "--out", "corpus.bin", "--quiet"],
        ["tokenizer", "train", "--input", "corpus.txt", "--vocab-size", "290", "--special-token", EOT, "--out",
         "tok-other", "--quiet", "--holdout-bytes", "0"],
    ):
        r = lm(*args, cwd=w)
        assert r.returncode == 0, err_of(r)
    cfg = config_from_dict(run_config(w, "run", max_steps=4))
    assert Trainer(cfg, print_fn=lambda *a: None).run() == 0
    return w


def run_config(w: Path, out: str, **train) -> dict:
    return {
        "model": dict(vocab_size=300, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64),
        "data": dict(train=str(w / "corpus.bin"), val=str(w / "corpus.bin"), tokenizer=str(w / "tok")),
        "train": dict(out_dir=str(w / out), batch_size=4, device="cpu", dtype="float32", **train),
        "optim": dict(max_lr=1e-2, min_lr=1e-3, warmup_iters=2),
        "eval": dict(interval=2, batches=1),
        "checkpoint": dict(interval=2, keep_last=2),
        "log": dict(interval=1),
    }


def write_toml(path: Path, raw: dict) -> Path:
    path.write_text(dump_tables(raw))
    return path


# -- data loss -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_export_never_replaces_the_input_a_parent_or_a_foreign_folder(work, tmp_path):
    here = tmp_path / "cwd"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    before, run_before = snapshot(here), snapshot(work / "run")
    for out, message in [
        (here, "contains the current directory"),  # `--out .`
        (work / "run", "contains the input --checkpoint"),
        (work, "contains the input --checkpoint"),  # the run's parent
        (work / "tok", "holds files that `lm export hf` did not write"),
    ]:
        r = lm("export", "hf", "--checkpoint", work / "run", "--out", out, "--overwrite", cwd=here)
        one_line_error(r, "--out: ", message)
    assert snapshot(here) == before and snapshot(work / "run") == run_before
    # an earlier export is replaced only with --overwrite, and then completely
    out = tmp_path / "hf"
    assert lm("export", "hf", "--checkpoint", work / "run", "--out", out, cwd=here).returncode == 0
    one_line_error(lm("export", "hf", "--checkpoint", work / "run", "--out", out, cwd=here),
                   "exists; pass --overwrite")
    (out / "config.json").write_text("{}")
    assert lm("export", "hf", "--checkpoint", work / "run", "--out", out, "--overwrite", cwd=here).returncode == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no temporary left beside
    # the modes every other output has (item 16): the umask's, not mkdtemp's 0700 / 0600
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask


def test_no_command_writes_over_its_input(work, tmp_path):
    src = tmp_path / "text.txt"
    src.write_text(STORY * 50)
    os.link(src, tmp_path / "hardlink.bin")
    before = snapshot(tmp_path)
    for out, message in [(src, "is the input --input itself"),
                         (tmp_path / "hardlink.bin", f"is the input --input {str(src)!r} (the same file); choose")]:
        r = lm("tokenize", "--tokenizer", work / "tok", "--input", src, "--out", out, "--overwrite", cwd=tmp_path)
        one_line_error(r, "--out: ", message)
    r = lm("tokenizer", "train", "--input", src, "--vocab-size", "260", "--out", tmp_path, "--overwrite",
           cwd=work)
    one_line_error(r, "--out: ", "contains the input --input")
    r = lm("plot", work / "run", "--out", work / "run" / "metrics.jsonl", "--overwrite", cwd=tmp_path)
    one_line_error(r, "--out: ", "must end in .png")
    assert snapshot(tmp_path) == before


def test_existing_outputs_need_overwrite_and_must_be_ours(work, tmp_path):
    tok_before = snapshot(work / "tok")
    r = lm("tokenizer", "train", "--input", "corpus.txt", "--vocab-size", "280", "--out", "tok", cwd=work)
    one_line_error(r, "--out: 'tok' exists; pass --overwrite")
    assert snapshot(work / "tok") == tok_before
    (tmp_path / "other.bin").write_bytes(b"not ours")
    r = lm("tokenize", "--tokenizer", work / "tok", "--input", work / "corpus.txt", "--out", tmp_path / "other.bin",
           "--overwrite", cwd=tmp_path)
    one_line_error(r, "is not a token file written by `lm tokenize`")
    out = tmp_path / "c.bin"
    assert lm("tokenize", "--tokenizer", work / "tok", "--input", work / "corpus.txt", "--out", out, "--quiet",
              cwd=tmp_path).returncode == 0
    one_line_error(lm("tokenize", "--tokenizer", work / "tok", "--input", work / "corpus.txt", "--out", out,
                      cwd=tmp_path), "exists; pass --overwrite")
    assert lm("tokenize", "--tokenizer", work / "tok", "--input", work / "corpus.txt", "--out", out, "--quiet",
              "--overwrite", cwd=tmp_path).returncode == 0
    assert (tmp_path / "other.bin").read_bytes() == b"not ours"


def test_overwrite_never_replaces_a_tokenizer_folder_the_user_added_to(work, tmp_path):
    """The marker says `lm tokenizer train` made the folder, but NOTES.txt (or a subfolder) is the
    user's: --overwrite refuses, naming it, and changes nothing; a temporary file a killed run left
    is the command's own and goes with the rest."""
    train = ["tokenizer", "train", "--input", work / "corpus.txt", "--vocab-size", "260", "--out", "tok",
             "--quiet", "--holdout-bytes", "0"]
    assert lm(*train, cwd=tmp_path).returncode == 0
    for extra in ("NOTES.txt", "sub/a.txt"):
        (tmp_path / "tok" / extra).parent.mkdir(exist_ok=True)
        (tmp_path / "tok" / extra).write_text("mine")
        before = snapshot(tmp_path)
        one_line_error(lm(*train, "--overwrite", cwd=tmp_path),
                       f"--out: 'tok' holds files that `lm tokenizer train` did not write ({extra.split('/')[0]!r})")
        assert snapshot(tmp_path) == before
        (tmp_path / "tok" / extra).unlink()
    (tmp_path / "tok" / "sub").rmdir()
    (tmp_path / "tok" / ".vocab.json.k3j9x.tmp").write_text("half")  # atomic_write's name, from a killed run
    assert lm(*train, "--overwrite", cwd=tmp_path).returncode == 0
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(
        [".lm-output.json", "merges.txt", "summary.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"])


KILLED_WRITER = """
import os, sys
from lm.io import atomic_write, replace_dir
if sys.argv[1] == "file":
    with atomic_write(sys.argv[2], "wb") as f:
        f.write(b"x" * 1000)
        f.flush()
        os.kill(os.getpid(), 9)
with replace_dir(sys.argv[2], command="lm tokenizer train") as tmp:
    (tmp / "vocab.json").write_bytes(b"x" * 500)
    os.kill(os.getpid(), 9)
"""


def test_what_a_killed_writer_left_is_named_and_kept(work, tmp_path):
    """A writer killed mid-write (SIGKILL: no clean-up runs) leaves its temporary file or folder beside the
    output. The next run says so in one warning line (what, how large, the command to remove it) and
    removes nothing: the temporary copy may be another run's, writing the same output now."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for kind, out in (("file", "x.bin"), ("folder", "tok")):
        r = subprocess.run([sys.executable, "-c", KILLED_WRITER, kind, out], cwd=tmp_path, env=env)
        assert r.returncode == -signal.SIGKILL
    temps = {p.name: p for p in tmp_path.iterdir()}
    assert sorted(temps) == sorted(n for n in temps if n.startswith((".x.bin.", ".tok.")) and n.endswith(".tmp")), temps
    (tmp_path / ".x.bin.json.abcd1234.tmp").write_text("the sidecar's, named when the sidecar is checked")
    before = snapshot(tmp_path)
    r = lm("tokenize", "--tokenizer", work / "tok", "--input", work / "corpus.txt", "--out", "x.bin", "--quiet",
           cwd=tmp_path)
    assert r.returncode == 0, err_of(r)
    [file_temp] = [n for n in temps if n.startswith(".x.bin.")]
    assert err_of(r).splitlines() == [
        f"lm tokenize: warning: --out: {file_temp!r} (1,000 bytes), beside 'x.bin', is the temporary copy of a run "
        f"killed while writing it (or writing it now); once none is running: rm -r {file_temp}",
        "lm tokenize: warning: --out: '.x.bin.json.abcd1234.tmp' (48 bytes), beside 'x.bin.json', is the temporary "
        "copy of a run killed while writing it (or writing it now); once none is running: "
        "rm -r .x.bin.json.abcd1234.tmp",
    ]
    r = lm("tokenizer", "train", "--input", work / "corpus.txt", "--vocab-size", "260", "--out", "tok", "--quiet",
           "--holdout-bytes", "0", cwd=tmp_path)
    assert r.returncode == 0, err_of(r)
    [folder_temp] = [n for n in temps if n.startswith(".tok.")]
    assert err_of(r) == (  # once, though the folder is checked twice (before the work, and by replace_dir)
        f"lm tokenizer train: warning: --out: {folder_temp!r} (500 bytes), beside 'tok', is the temporary copy of "
        f"a run killed while writing it (or writing it now); once none is running: rm -r {folder_temp}")
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith(".")} == before
    for p in temps.values():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (tmp_path / ".x.bin.json.abcd1234.tmp").unlink()
    r = lm("tokenize", "--tokenizer", work / "tok", "--input", work / "corpus.txt", "--out", "x.bin", "--quiet",
           "--overwrite", cwd=tmp_path)
    assert r.returncode == 0 and err_of(r) == "", err_of(r)


def test_a_refused_demo_writes_nothing(work, tmp_path):
    earlier = tmp_path / "demo"
    earlier.mkdir()
    (earlier / ".lm-output.json").write_text(json.dumps({"command": "lm demo", "complete": True}))
    (earlier / "report.json").write_text("{}")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    before = snapshot(tmp_path)
    one_line_error(lm("demo", "--out", earlier, "--train-seconds", "1", cwd=tmp_path), "exists; pass --overwrite")
    one_line_error(lm("demo", "--out", foreign, "--train-seconds", "1", "--overwrite", cwd=tmp_path),
                   "holds files that `lm demo` did not write")
    r = lm("demo", "--out-dir", earlier, "--train-seconds", "1", cwd=tmp_path)  # the old spelling
    assert r.returncode == 2 and "--out-dir is deprecated" in err_of(r) and "--resume" not in err_of(r)
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_one_process_per_run_folder_and_stale_locks(work, tmp_path):
    toml = write_toml(tmp_path / "c.toml", run_config(work, "locked", max_steps=100_000))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "lm", "train", "--config", toml, "--quiet"], cwd=tmp_path,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ckpt = work / "locked" / "checkpoints"
        deadline = time.time() + 120
        while not (ckpt.is_dir() and any(ckpt.glob("step_*.pt"))) and time.time() < deadline:
            time.sleep(0.2)
        assert (work / "locked" / ".lock").read_text().strip() == str(first.pid)
        r = lm("train", "--config", toml, "--resume", cwd=tmp_path)
        one_line_error(r, "train.out_dir: ", "is in use by another `lm train`", f"pid {first.pid}")
    finally:
        first.kill()
        first.wait()
    assert (work / "locked" / ".lock").exists()  # SIGKILL left it behind
    reached = max(int(p.stem.removeprefix("step_")) for p in ckpt.glob("step_*.pt"))  # nothing left to train there
    r = lm("train", "--config", toml, "--resume", "--set", f"train.max_steps={reached}", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, err_of(r)
    assert f"took over the lock of {str(work / 'locked')!r} from pid {first.pid}" in r.stdout.decode()
    assert not (work / "locked" / ".lock").exists()


@pytest.mark.slow
def test_a_run_that_diverged_before_its_first_checkpoint_can_start_over(work, tmp_path):
    raw = run_config(work, "diverged", max_steps=20)
    raw["optim"].update(max_lr=1e30, warmup_iters=0)
    raw["checkpoint"]["interval"] = 10
    toml = write_toml(tmp_path / "c.toml", raw)
    r = lm("train", "--config", toml, cwd=tmp_path)
    assert r.returncode == 3 and "no checkpoint was written" in err_of(r), err_of(r)
    one_line_error(lm("train", "--config", toml, cwd=tmp_path), "stopped before its first checkpoint",
                   "pass --resume to start it again")
    r = lm("train", "--config", toml, "--resume", "--set", "optim.max_lr=1e-2", "--set", "train.max_steps=2",
           cwd=tmp_path)
    assert r.returncode == 0, err_of(r)
    assert "starting again from step 0 (the earlier metrics are in metrics.jsonl.1)" in r.stdout.decode()
    assert (work / "diverged" / "metrics.jsonl.1").exists()


# -- wrong numbers with exit 0 --------------------------------------------------------------------

def test_eval_refuses_what_it_cannot_tell_apart(work, tmp_path):
    ids = np.fromfile(work / "corpus.bin", dtype=np.uint16)
    ids.tofile(tmp_path / "nosidecar.bin")
    (tmp_path / "text.bin").write_text(STORY)  # text named like a token file, no sidecar
    # each refused for what it is: the text had been "not UTF-8 text" (docs19)
    for data, why in (("nosidecar.bin", "and is not UTF-8 text;"), ("text.bin", "and is named .bin (a token "
                                                                              "file's name);")):
        r = lm("eval", "--checkpoint", work / "run", "--data", tmp_path / data, cwd=tmp_path)
        one_line_error(r, "--data: ", "has no sidecar")
        assert why in err_of(r), err_of(r)


def test_a_tokenizer_that_is_not_the_models_is_refused(work, tmp_path):
    (tmp_path / "v.txt").write_text(STORY * 4)
    for cmd in (["eval", "--data", tmp_path / "v.txt"], ["sample", "--prompt", "Tom"]):
        r = lm(*cmd, "--checkpoint", work / "run", "--tokenizer", work / "tok-other", cwd=tmp_path)
        one_line_error(r, "--tokenizer: ", "is not the tokenizer of the model")


def test_text_that_is_not_utf8_warns_in_one_line_and_counts(work, tmp_path):
    (tmp_path / "bad.txt").write_bytes((STORY.encode() + b"\xff\xfe\n") * 20)
    r = lm("eval", "--checkpoint", work / "run", "--data", tmp_path / "bad.txt", "--quiet", cwd=tmp_path)
    err = err_of(r)
    assert r.returncode == 0 and len(err.splitlines()) == 1, err
    assert err.startswith("lm eval: warning: --data: 40 bytes of") and "not valid UTF-8" in err
    r = lm("tokenize", "--tokenizer", work / "tok", "--input", tmp_path / "bad.txt", "--out", tmp_path / "b.bin",
           "--quiet", cwd=tmp_path)
    err = err_of(r)
    assert r.returncode == 0 and len(err.splitlines()) == 1, err  # no Python warning format, no source line
    assert err.startswith("lm tokenize: warning: --input: 40 bytes of") and "not valid UTF-8" in err


@pytest.mark.parametrize("setting, message", [
    ("optim.max_lr=nan", "optim.max_lr must be a finite number, got nan"),
    ("optim.max_lr=inf", "optim.max_lr must be a finite number, got inf"),
    ("optim.max_lr=0", "optim.max_lr must be > 0, got 0"),
    ("optim.eps=0", "optim.eps must be > 0, got 0"),
    ("optim.eps=nan", "optim.eps must be a finite number"),
    ("optim.min_lr=0.5", "optim.min_lr (0.5) must not exceed optim.max_lr (0.01)"),
    ("optim.beta1=1.0", "optim.beta1 must be in [0, 1), got 1.0"),
    ("optim.beta2=-0.1", "optim.beta2 must be in [0, 1), got -0.1"),
    ("train.device=mps", "train.device: 'mps' is not available on this machine (available: cpu"),
    ("train.device=tpu", "train.device: unknown device 'tpu'"),
    ("train.batch_size=100000000", "train.batch_size: a training step of 100,000,000 x 16 tokens needs at least"),
    ("train.dist_timeout=0", "train.dist_timeout must be > 0, got 0"),
    ("train.dist_timeout=inf", "train.dist_timeout must be a finite number, got inf"),
    ("train.dist_timeout=1e300", "train.dist_timeout must be at most 2,592,000 seconds (30 days), got 1e+300"),
])
def test_config_values_that_cannot_train(work, tmp_path, setting, message):
    toml = write_toml(tmp_path / "c.toml", run_config(work, "never", max_steps=2))
    r = lm("train", "--config", toml, "--set", setting, cwd=tmp_path, timeout=60)
    one_line_error(r, message)
    assert not (work / "never").exists()


def test_vocab_size_beyond_the_corpus_says_what_it_got(work, tmp_path):
    r = lm("tokenizer", "train", "--input", work / "corpus.txt", "--vocab-size", "100000", "--out", tmp_path / "t",
           cwd=tmp_path)
    one_line_error(r, "--vocab-size: the ", " training bytes (", " held out, see --holdout-bytes) give at most",
                   "not 100,000")
    assert not (tmp_path / "t").exists()


# -- one line instead of a traceback ------------------------------------------------------------

@pytest.mark.parametrize("device, message", [
    ("cuda", "--device: 'cuda' is not available on this machine (available: cpu"),
    ("mps", "--device: 'mps' is not available"),
    ("tpu", "--device: unknown device 'tpu'"),
    ("cuda:01", "--device: unknown device 'cuda:01'; use auto, cpu"),  # torch.device's RuntimeError: a traceback
])
def test_missing_devices_are_one_line(work, tmp_path, device, message):
    if device in ("cuda", "mps"):
        import torch

        if device == "cuda" and torch.cuda.is_available() or device == "mps" and torch.backends.mps.is_available():
            pytest.skip(f"{device} is available here")
    (tmp_path / "v.txt").write_text(STORY)
    for cmd in (["sample", "--prompt", "Tom"], ["eval", "--data", tmp_path / "v.txt"]):
        one_line_error(lm(*cmd, "--checkpoint", work / "run", "--device", device, cwd=tmp_path), message)


def test_bad_files_and_values_name_themselves(work, tmp_path):
    bad_tok = tmp_path / "badtok"
    bad_tok.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (bad_tok / name).write_bytes((work / "tok" / name).read_bytes())
    (bad_tok / "tokenizer_config.json").write_text("")
    r = lm("tokenize", "--tokenizer", bad_tok, "--input", work / "corpus.txt", "--out", tmp_path / "x.bin",
           cwd=tmp_path)
    one_line_error(r, "--tokenizer: ", "tokenizer_config.json", "is not valid JSON")
    r = lm("sample", "--checkpoint", work / "run", "--prompt", b"Tom \xff", cwd=tmp_path)
    one_line_error(r, "--prompt: not valid UTF-8")
    r = lm("eval", "--checkpoint", work / "run", "--data", work / "corpus.bin", "--max-tokens", "0", cwd=tmp_path)
    one_line_error(r, "--max-tokens: must be >= 1, got 0")


@pytest.mark.slow
def test_prompt_file_stdin_threads_and_dtype(work, tmp_path):
    (tmp_path / "p.txt").write_text("Tom had")
    outs = []
    for args, stdin in ((["--prompt-file", tmp_path / "p.txt"], None), (["--prompt-file", "-"], b"Tom had"),
                        (["--prompt", "Tom had", "--threads", "1", "--dtype", "float32"], None)):
        r = lm("sample", "--checkpoint", work / "run", *args, "--seed", "3", "--max-new-tokens", "8", "--quiet",
               cwd=tmp_path, input=stdin)
        assert r.returncode == 0 and err_of(r) == "", err_of(r)
        outs.append(r.stdout)
    assert outs[0] == outs[1] == outs[2] and outs[0].startswith(b"Tom had")
    one_line_error(lm("sample", "--checkpoint", work / "run", "--prompt", "x", "--threads", "0", cwd=tmp_path),
                   "--threads: must be a whole number >= 1, got 0")
    # torch took any count and crashed at the first parallel op (SIGSEGV, exit 139, from about 32,768 here)
    for cmd in (["sample", "--checkpoint", work / "run", "--prompt", "x"], ["demo", "--out", tmp_path / "d"]):
        one_line_error(lm(*cmd, "--threads", "100000", cwd=tmp_path), "--threads: must be at most ", "got 100000")
    assert not (tmp_path / "d").exists()


def test_closed_or_write_only_standard_streams(work, tmp_path):
    """clifuzz9 #4 and #7. `--prompt-file -` / `--input -` with standard input closed (`<&-`) was a
    20-line traceback (Python's sys.stdin is None), and opened for writing only (`0>file`) an error
    naming no option. With standard error closed (`2>&-`) every command exited 1 after a clean run
    and printed its status lines into stdout, the data."""
    def closing(fd):
        return lambda: os.close(fd)

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as for most users: a failed write is retried at the last flush
    sample = [sys.executable, "-m", "lm", "sample", "--checkpoint", str(work / "run"), "--max-new-tokens", "3",
              "--seed", "1"]
    r = subprocess.run([*sample, "--prompt-file", "-"], preexec_fn=closing(0), capture_output=True, env=env,
                       cwd=tmp_path, timeout=120)
    one_line_error(r, "lm sample: error: --prompt-file: - reads standard input, which is closed")
    with open(tmp_path / "w", "wb") as write_only:
        r = subprocess.run([*sample, "--prompt-file", "-"], stdin=write_only, capture_output=True, env=env,
                           cwd=tmp_path, timeout=120)
    one_line_error(r, "lm sample: error: --prompt-file: - reads standard input, which cannot be read: Bad file "
                      "descriptor")
    with_stderr = subprocess.run([*sample, "--prompt", "Tom"], capture_output=True, env=env, cwd=tmp_path,
                                 timeout=120)
    assert with_stderr.returncode == 0 and with_stderr.stderr.startswith(b"["), err_of(with_stderr)
    for closed in (closing(2), None):
        kw = dict(preexec_fn=closed, stdout=subprocess.PIPE) if closed else dict(stdout=subprocess.PIPE,
                                                                                stderr=subprocess.DEVNULL)
        r = subprocess.run([*sample, "--prompt", "Tom"], env=env, cwd=tmp_path, timeout=120, **kw)
        assert (r.returncode, r.stdout) == (0, with_stderr.stdout)  # the sample alone
        r = subprocess.run([*sample, "--prompt", "Tom", "--max-new-tokens", "0"], env=env, cwd=tmp_path,
                           timeout=120, **kw)
        assert (r.returncode, r.stdout) == (2, b"")  # the usage error's status; its line went nowhere
    if os.path.exists("/dev/full"):  # a full disk: "error: [Errno 28] No space left on device" named nothing
        with open("/dev/full", "w") as full:
            r = subprocess.run([*sample, "--prompt", "Tom"], stdout=full, stderr=subprocess.PIPE, env=env,
                               cwd=tmp_path, timeout=120)
        one_line_error(r, "lm sample: error: standard output cannot be written: No space left on device")
    # closed or read-only, standard output is that error too: the sample had been dropped with exit 0
    r = subprocess.run([*sample, "--prompt", "Tom"], preexec_fn=closing(1), stderr=subprocess.PIPE, env=env,
                       cwd=tmp_path, timeout=120)
    one_line_error(r, "lm sample: error: standard output cannot be written: Bad file descriptor")
    with open(tmp_path / "w", "rb") as read_only:
        r = subprocess.run([*sample, "--prompt", "Tom"], stdout=read_only, stderr=subprocess.PIPE, env=env,
                           cwd=tmp_path, timeout=120)
    one_line_error(r, "lm sample: error: standard output cannot be written: Bad file descriptor")


def test_an_empty_resume_is_refused_not_taken_for_not_given(work, tmp_path):
    """`--resume ''` (a script's `--resume "$CKPT"` with the variable unset) was taken for no
    --resume: a fresh run from step 0 in an empty train.out_dir, exit 0, and for a run folder
    "already holds a run; pass --resume", though --resume was passed (clifuzz7 #7)."""
    want = ("lm train: error: --resume: must not be empty; pass --resume alone to continue the run in "
            "train.out_dir, or --resume PATH")
    before = snapshot(work / "run")
    for out in ("run", "fresh"):
        toml = write_toml(tmp_path / f"{out}.toml", run_config(work, out, max_steps=1))
        r = lm("train", "--config", toml, "--resume", "", "--quiet", cwd=tmp_path)
        one_line_error(r)
        assert err_of(r) == want
    assert not (work / "fresh").exists() and snapshot(work / "run") == before


def test_resume_from_a_named_checkpoint(work, tmp_path):
    from lm.train import Trainer, config_from_dict

    steps = sorted((work / "run" / "checkpoints").glob("step_*.pt"))
    assert steps
    raw = run_config(work, "branch", max_steps=5)
    # a checkpoint of another run continues in a new folder; into a folder that holds a run it is refused
    trainer = Trainer(config_from_dict(raw), resume=str(steps[0]), print_fn=lambda *a: None)
    assert trainer.step == int(steps[0].stem.split("_")[1]) and trainer.run() == 0
    raw["train"]["max_steps"] = 6
    with pytest.raises(ValueError, match="is not a checkpoint of the run in"):
        Trainer(config_from_dict(raw), resume=str(steps[0]), print_fn=lambda *a: None)
    toml = write_toml(tmp_path / "c.toml", raw)
    r = lm("train", "--config", toml, "--resume", work / "branch" / "checkpoints" / "step_00000005.pt", "--quiet",
           cwd=tmp_path)
    assert r.returncode == 0 and "resumed from" in r.stdout.decode(), err_of(r)


def test_ctrl_c_during_tokenize_ends_quietly_at_once(work, tmp_path):
    """SIGINT at a random moment, up to and past the end of the work: exit 130 within a second
    with no traceback and no partial output, or a whole output (exit 0, or 130 when the signal
    came during the final renames and waited for them); never death by the signal itself."""
    big = tmp_path / "big.txt"
    big.write_text("".join(f"{STORY}Story number {i} is here.\n{EOT}\n" for i in range(120_000)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def start(out):
        return subprocess.Popen([sys.executable, "-m", "lm", "tokenize", "--tokenizer", work / "tok", "--input", big,
                                 "--out", out, "--num-workers", "2", "--quiet"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    t0 = time.time()
    ref = tmp_path / "ref.bin"
    assert start(ref).wait(timeout=300) == 0
    full = time.time() - t0  # one whole run, start-up included; the signals land in its second half and just after
    reference = ref.read_bytes()
    rng = np.random.default_rng(0)
    for attempt in range(8):
        out = tmp_path / f"out{attempt}.bin"
        p = start(out)
        time.sleep(rng.uniform(0.5, 1.05) * full)
        p.send_signal(signal.SIGINT)
        t1 = time.time()
        try:
            _, err = p.communicate(timeout=10)
        finally:
            p.kill()
        waited = time.time() - t1
        err = err.decode()
        leftovers = [q for q in tmp_path.iterdir() if q.name.startswith(f".out{attempt}")]
        assert not leftovers, leftovers  # no temporary file survives, whatever the outcome
        assert p.returncode in (0, 130), (attempt, p.returncode, err)  # -2 would be death by the signal
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
        if p.returncode == 130:
            assert waited < 1.5, (attempt, waited)
        if p.returncode == 0 or out.exists() or sidecar_path(out).exists():
            # finished, or the signal came while the ids and the sidecar were being renamed and waited
            # for both: the output is whole (its sidecar matches the ids) and the same as a full run's
            ids, meta = read_token_file(out)
            assert meta["num_tokens"] == len(ids) and out.read_bytes() == reference


# -- one grammar ------------------------------------------------------------------------------------

def test_top_level_help_version_and_examples(tmp_path):
    r = lm("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.decode().startswith("lm ")
    for cmd in ([], ["tokenizer"], ["data"], ["export"]):
        r = lm(*cmd, "--help", cwd=tmp_path)
        assert r.returncode == 0 and "examples:" in r.stdout.decode(), cmd


def test_export_into_the_runs_checkpoints_folder_is_refused_so_the_run_still_resumes(work, tmp_path):
    """faults20: `lm export hf --out RUN/checkpoints/hf` was taken, and `lm train --resume` then refused
    the run ("checkpoints/ holds 'hf', which is not a checkpoint of lm train"). An export beside the
    checkpoints folder (RUN/hf) does not stop a resume, and is still taken."""
    checkpoint = sorted((work / "run" / "checkpoints").glob("step_*.pt"))[-1]
    before = snapshot(work / "run")
    folder = (work / "run" / "checkpoints").resolve()
    # whichever checkpoint is exported: the run folder itself (its model.safetensors: review20), a step's
    for source in (checkpoint, "run"):
        for out in ("run/checkpoints/hf", "run/checkpoints", "run/checkpoints/a/b"):
            r = lm("export", "hf", "--checkpoint", source, "--out", out, cwd=work)
            one_line_error(r, f"--out: '{out}' is inside {str(folder)!r}, the checkpoints folder of the run "
                              f"{str(folder.parent)!r}, which `lm train` keeps for its checkpoints alone")
    assert snapshot(work / "run") == before
    r = lm("export", "hf", "--checkpoint", checkpoint, "--out", tmp_path / "hf", cwd=work)
    assert r.returncode == 0, err_of(r)

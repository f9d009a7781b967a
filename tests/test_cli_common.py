"""The grammar every subcommand shares (lm.cli.common): its errors name the command that was run,
a thing given in two spellings is refused, and an output that cannot be written is named as --out."""

import argparse
import io
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers.cli import main_in_one_interpreter
from helpers.faults import Exited, FullDisk, exit_now

from lm.cli import build_parser, main
from lm.cli.common import commands


def _usage(*command: str) -> str:
    """The usage line(s) argparse prints for ``lm COMMAND...``."""
    parser = build_parser()
    for name in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser.format_usage()


@pytest.mark.parametrize("argv, command", [
    (["export", "hf", "--checkpoint", "run", "--out", "x", "--bogus"], ["export", "hf"]),
    (["export", "hf", "a", "b", "c"], ["export", "hf"]),  # a third positional
    (["train", "--config", "c.toml", "--bogus"], ["train"]),
    (["eval", "--checkpoint", "x", "--data", "y", "--bogus"], ["eval"]),
    (["tokenizer", "train", "--input", "a", "--vocab-size", "300", "--out", "t", "--bogus", "1"],
     ["tokenizer", "train"]),
])
def test_an_unknown_argument_is_the_error_of_the_command_that_was_run(argv, command, capsys, tmp_path, monkeypatch):
    """argparse hands a subcommand's leftovers up to `lm`: "usage: lm [-h] [--version] COMMAND ...
    / lm: error: unrecognized arguments: --bogus", where every other argument error names the command."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    extra = " ".join(argv[argv.index("--bogus"):] if "--bogus" in argv else argv[-1:])
    prog = "lm " + " ".join(command)
    assert capsys.readouterr().err == f"{_usage(*command)}{prog}: error: unrecognized arguments: {extra}\n"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["--out-dir", "dA", "--out", "dB"], ["--out", "dB", "--out-dir", "dA"]])
def test_a_deprecated_spelling_beside_the_new_one_is_refused(argv, capsys, tmp_path, monkeypatch):
    """`--out-dir dA --out dB` wrote dB (and the other order dA) after a deprecation line: the last one won,
    silently. As `lm export hf` refuses a positional given beside its option, one line names both."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LM_MULTI30K_URL", (tmp_path / "nowhere").as_uri())
    for prog, command in (("lm data download", ["data", "download", "multi30k"]), ("lm demo", ["demo"])):
        with pytest.raises(SystemExit) as stop:
            main([*command, *argv, "--quiet"])
        assert stop.value.code == 2
        assert capsys.readouterr().err == (f"{prog}: error: --out-dir: given both as --out-dir "
                                           "('dA') and as --out ('dB'); use --out alone\n")
    assert not any(tmp_path.iterdir())


def test_resume_given_twice_is_refused_with_or_without_its_path(capsys, tmp_path, monkeypatch):
    """`--resume` alone resumes from the run's latest checkpoint, `--resume PATH` from PATH: given twice,
    the last had won without a word."""
    monkeypatch.chdir(tmp_path)
    for argv, shown in ((["--resume", "--resume", "r"], "with no value and 'r'"),
                        (["--resume", "r", "--resume"], "'r' and with no value")):
        with pytest.raises(SystemExit) as stop:
            main(["train", "--config", "a.toml", *argv])
        assert stop.value.code == 2
        assert capsys.readouterr().err == (f"lm train: error: --resume: given twice ({shown}); it takes one, so "
                                           "pass it once\n")
    assert build_parser().parse_args(["train", "--config", "a.toml", "--resume"]).resume is True


@pytest.mark.parametrize("argv, option, first, second", [
    (["tokenize", "--tokenizer", "t", "--input", "a.txt", "--input", "b.txt", "--out", "o.bin"], "--input", "a.txt",
     "b.txt"),
    (["eval", "--checkpoint", "A", "--checkpoint", "B", "--data", "v.bin"], "--checkpoint", "A", "B"),
    (["eval", "--checkpoint", "A", "--data", "v.bin", "--data", "w.bin"], "--data", "v.bin", "w.bin"),
    (["translate", "--checkpoint", "A", "--input", "a", "--input", "b"], "--input", "a", "b"),
    (["sample", "--checkpoint", "A", "--prompt-file", "p", "--prompt-file", "q"], "--prompt-file", "p", "q"),
    (["train", "--config", "a.toml", "--config", "b.toml"], "--config", "a.toml", "b.toml"),
    (["demo", "--out", "dA", "--out", "dB"], "--out", "dA", "dB"),  # an --out with an old spelling (Spelled)
    (["demo", "--out-dir", "dA", "--out-dir", "dB"], "--out-dir", "dA", "dB"),  # the old spelling (Deprecated)
    (["data", "download", "multi30k", "--out-dir", "dA", "--out-dir", "dB"], "--out-dir", "dA", "dB"),
    (["train", "--config", "a.toml", "--resume", "r1", "--resume", "r2"], "--resume", "r1", "r2"),
])
def test_an_option_that_names_one_file_given_twice_is_refused(argv, option, first, second, capsys, tmp_path,
                                                              monkeypatch):
    """`lm tokenize --input a --input b` tokenized b alone, and `lm eval --data A --data B` scored B,
    without a word (clifuzz9): the last one given had won. `lm tokenizer train` reads every --input."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    prog = " ".join(["lm", *argv[:2 if argv[0] == "data" else 1]])  # lm data download
    assert capsys.readouterr().err == (f"{prog}: error: {option}: given twice ({first!r} and {second!r}); it "
                                       "takes one, so pass it once\n")
    assert not any(tmp_path.iterdir())
    args = build_parser().parse_args(["tokenizer", "train", "--input", "a", "--input", "b", "--vocab-size", "300",
                                      "--out", "t"])
    assert args.input == ["a", "b"] and not hasattr(args, "_once")
    # every such option of every command, but those that take several (tokenizer train --input)
    from lm.cli.common import ONCE_OPTIONS, Once

    checked = 0
    for command, sub in commands(build_parser()):
        for action in sub._actions:
            if action.option_strings and action.option_strings[0] in ONCE_OPTIONS and action.nargs is None:
                assert isinstance(action, Once) or action.dest == "out" and action.default is not None \
                    or type(action).__name__ == "Spelled", (command, action.option_strings)
                checked += isinstance(action, Once)
    assert checked >= 15


def test_the_deprecated_spelling_alone_still_works_with_its_line(capsys):
    args = build_parser().parse_args(["data", "download", "multi30k", "--out-dir", "dA"])
    assert args.out == "dA" and not hasattr(args, "_spellings")
    err = capsys.readouterr().err
    assert err == "lm data download: warning: --out-dir is deprecated and will be removed; use --out\n"
    args = build_parser().parse_args(["data", "download", "multi30k", "--out", "dB"])
    assert args.out == "dB" and capsys.readouterr().err == ""
    assert build_parser().parse_args(["demo"]).out == "runs/demo"  # --out's default, when neither is given


def test_an_out_that_cannot_be_made_names_out_and_the_users_path(tmp_path, capsys):
    """"[Errno 36] File name too long: 'aaa…'" (or, below /sys, "[Errno 1] Operation not permitted:
    '/sys/.tok.hzy8iri8.tmp'", the hidden temporary folder) named no --out."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 50)
    out = tmp_path / ("a" * 300)
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "260", "--out", str(out),
                 "--holdout-bytes", "0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"lm tokenizer train: error: --out: {str(out)!r} cannot be written: File name too long\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def test_as_flags_names_the_flag_in_errors_and_warnings():
    """A library warning named its parameter ("input: ... not valid UTF-8") where the user typed
    --input; lm tokenizer kept its own warnings-only copy of as_flags for that."""
    import warnings

    from lm.cli.common import as_flags

    with pytest.raises(ValueError, match=r"^--vocab-size: 100 is below 257$"), as_flags(vocab_size="--vocab-size"):
        raise ValueError("vocab_size: 100 is below 257")
    with pytest.raises(ValueError, match=r"^--alpha: must be >= 0$"), as_flags(alpha="--alpha"):
        raise ValueError("alpha must be >= 0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shown = []
        warnings.showwarning = lambda message, category, *rest, **kw: shown.append((str(message), category))
        with as_flags(input="--input"):
            warnings.warn("input: 3 bytes of 'x.txt' are not valid UTF-8", UserWarning, stacklevel=1)
            warnings.warn("other: untouched", RuntimeWarning, stacklevel=1)
        warnings.warn("input: after the block", UserWarning, stacklevel=1)
    assert shown == [("--input: 3 bytes of 'x.txt' are not valid UTF-8", UserWarning),
                     ("other: untouched", RuntimeWarning), ("input: after the block", UserWarning)]
    assert seen == []


def test_a_broken_pipe_that_is_not_stdout_is_an_error(tmp_path, monkeypatch):
    """Every command became quiet on a closed pipe, and took any BrokenPipeError for one: a worker's
    pipe or a socket breaking ended the command with status 141 and no message."""
    import os
    import sys

    from lm.cli.common import CLOSED_PIPE_STATUS, quiet_on_closed_pipe, stdout_reader_gone

    def worker_pipe_broke(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", io.StringIO())  # no descriptor (captured, replaced): no pipe to lose
    assert not stdout_reader_gone()
    with pytest.raises(BrokenPipeError):
        quiet_on_closed_pipe(worker_pipe_broke)(argparse.Namespace())
    with open(tmp_path / "out.txt", "w") as f:  # stdout a file: the pipe that broke is another
        monkeypatch.setattr(sys, "stdout", f)
        assert not stdout_reader_gone()
        with pytest.raises(BrokenPipeError):
            quiet_on_closed_pipe(worker_pipe_broke)(argparse.Namespace())
    read, write = os.pipe()
    os.close(read)  # stdout a pipe whose reader is gone
    with os.fdopen(write, "w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        assert stdout_reader_gone()
        assert quiet_on_closed_pipe(worker_pipe_broke)(argparse.Namespace()) == CLOSED_PIPE_STATUS
        monkeypatch.undo()


def test_every_command_is_wrapped_for_a_closed_pipe_once():
    """Every command's function is wrapped by its parser's set_defaults, and `lm sample`'s is wrapped
    already where it is defined: a wrapped command is not wrapped again (one try, one flush), and
    every command the parser runs carries the mark."""
    from lm.cli import build_parser
    from lm.cli.common import quiet_on_closed_pipe
    from lm.cli.sample import cmd_sample

    def command(args):
        return 0

    once = quiet_on_closed_pipe(command)
    assert once is not command and once.__wrapped__ is command and once.quiet_on_closed_pipe is True
    assert quiet_on_closed_pipe(once) is once
    assert cmd_sample.__wrapped__.__name__ == "cmd_sample" and not hasattr(cmd_sample.__wrapped__, "__wrapped__")
    funcs = [p.get_default("func") for _, p in commands(build_parser())]
    assert funcs and all(getattr(f, "quiet_on_closed_pipe", False) for f in funcs if f is not None)
    sample = next(f for f in funcs if f is not None and f.__name__ == "cmd_sample")
    assert sample is cmd_sample  # not wrapped a second time by set_defaults


@pytest.mark.parametrize("argv, prog", [(["--version"], "lm"), (["tokenize", "--help"], "lm tokenize"),
                                        (["tokenizer", "train", "--help"], "lm tokenizer train")])
def test_help_and_version_that_cannot_be_written_are_an_error(argv, prog, tmp_path):
    """argparse drops a failed write of its help or version: `lm --version > /dev/full` and `lm
    tokenizer train --help >&-` exited 0 with nothing written (cli21 F1), where a command's own
    output that cannot be written is an error, exit 2. A closed pipe still ends quietly (141)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from lm.cli.common import CLOSED_PIPE_STATUS

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as for most users: the write itself succeeds, the flush fails

    def run(**streams) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lm", *argv], env=env, cwd=tmp_path, timeout=60, **streams)

    written = run(capture_output=True)
    assert written.returncode == 0 and written.stdout and written.stderr == b""
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            r = run(stdout=full, stderr=subprocess.PIPE)
        assert (r.returncode, r.stderr.decode()) == (
            2, f"{prog}: error: standard output cannot be written: No space left on device\n")
    r = run(stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=lambda: os.close(1))
    assert (r.returncode, r.stderr.decode()) == (2, f"{prog}: error: standard output cannot be written: Bad file "
                                                    "descriptor\n")
    read, write = os.pipe()
    os.close(read)  # a reader gone before anything was written (`| head -0`)
    try:
        r = run(stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (CLOSED_PIPE_STATUS, b"")


def test_interruptible_script_says_what_it_keeps_on_ctrl_c_and_sigterm(capsys):
    """A recipe script's main: Ctrl-C and SIGTERM each one line and 128 + the signal, and what the
    script keeps (multi30k.py: the trained run) said on both; SIGTERM had said only "terminated"
    (review21). A training run stopped by a signal (TrainingInterrupted) exits with its status."""
    import signal

    from lm.cli.common import interruptible_script
    from lm.train import TrainingInterrupted

    def killed(signum):
        def run():
            signal.raise_signal(signum)
            raise AssertionError("the signal did not stop the run")
        return run

    def stopped(status):
        def run():
            raise TrainingInterrupted(status)
        return run

    before = signal.getsignal(signal.SIGTERM)
    for run, kept, status, line in (
            (killed(signal.SIGINT), "", 130, "x.py: interrupted"),
            (killed(signal.SIGTERM), "", 143, "x.py: terminated"),
            (killed(signal.SIGINT), "the run is kept", 130, "x.py: interrupted; the run is kept"),
            (killed(signal.SIGTERM), "the run is kept", 143, "x.py: terminated; the run is kept"),
            (stopped(143), "", 143, "x.py: terminated"),
            (stopped(130), "", 130, "x.py: interrupted")):
        assert interruptible_script("x.py", run, kept=lambda kept=kept: kept) == status
        assert capsys.readouterr().err == line + "\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the script's own handler is put back


def test_check_fits_refuses_a_batch_one_byte_past_the_free_memory_and_takes_one_that_fits(monkeypatch):
    """A mutation (`need <= have` read as `need <= 2 * have`): the tests size absurd batches only
    (10**9 rows, beam 10**10), which any factor still refuses."""
    import lm.train.memory
    from lm.cli.common import check_fits

    have = 3 << 30
    monkeypatch.setattr(lm.train.memory, "available_bytes", lambda device: have)
    check_fits("--max-batch: a batch of 4 rows", have, "their cache needs at least", "cpu", "lower --max-batch")
    with pytest.raises(ValueError) as e:
        check_fits("--max-batch: a batch of 4 rows", have + 1, "their cache needs at least", "cpu", "lower --max-batch")
    assert str(e.value) == ("--max-batch: a batch of 4 rows does not fit in memory (their cache needs at least "
                            "3.00 GiB, cpu has 3.00 GiB free); lower --max-batch")


@pytest.mark.parametrize("argv", [["--version"], ["plot", "--help"]])
def test_help_or_version_that_cannot_be_written_is_exit_2_in_process(argv, monkeypatch, capsys):
    """A mutation (WrittenHelpParser exits 0 after the failed write): only a subprocess test with
    cwd=tmp_path checks it, which runs the installed tree, not a changed one. Standard output fails
    every write as /dev/full's does, and has no descriptor (silence_stdout leaves the test's own alone)."""
    monkeypatch.setattr(sys, "stdout", FullDisk(io.StringIO()))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    prog = "lm" if argv == ["--version"] else "lm plot"
    assert capsys.readouterr().err == f"{prog}: error: standard output cannot be written: No space left on device\n"


@pytest.mark.parametrize("arch, want, hint", [
    ("encoder_decoder", "decoder_lm", "a translation model (encoder_decoder); use `lm translate`"),
    ("decoder_lm", "encoder_decoder", "a language model (decoder_lm); use `lm sample`"),
])
def test_a_checkpoint_of_the_other_kind_points_to_the_command_for_it(arch, want, hint):
    """A mutation (the two hints swapped): only a slow subprocess test after a training run
    (test_seq2seq_train) checks one direction; nothing checks `lm translate` given a language model."""
    from types import SimpleNamespace

    from lm.cli.common import require_architecture

    model = SimpleNamespace(config=SimpleNamespace(architecture=arch))
    with pytest.raises(ValueError) as e:
        require_architecture(model, want, "runs/x")
    assert str(e.value) == f"--checkpoint: 'runs/x' is {hint}"


def test_a_ctrl_c_that_lands_outside_mains_handler_exits_130_saying_interrupted():
    """A mutation (entry's own KeyboardInterrupt, the one that lands between main's handler and the
    finally, exits 1 instead of 130) survived. 130 is 128 + SIGINT, what a shell and every other
    `lm` command report for Ctrl-C (run_as_command). The subprocess inherits the working folder and
    PYTHONPATH, so it runs the lm under test."""
    code = ("import lm.cli as cli\n"
            "def interrupted():\n"
            "    raise KeyboardInterrupt\n"
            "cli.main = interrupted\n"
            "cli.entry()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "lm: interrupted\n")


def test_run_as_command_puts_back_the_warning_printer_it_found(capsys):
    """Within it each warning is one "PROG: warning: ..." line; after it, warnings are shown as before,
    whatever the command did (a mutant left None there: the next warning was a TypeError)."""
    import warnings

    from lm.cli.common import run_as_command

    def warns():
        warnings.warn("mind the gap", UserWarning, stacklevel=1)
        raise ValueError("--x: bad")

    before = warnings.showwarning
    assert run_as_command("lm x", warns) == 2
    assert warnings.showwarning is before
    assert capsys.readouterr().err == "lm x: warning: mind the gap\nlm x: error: --x: bad\n"


def test_standard_input_closed_or_unreadable_is_one_line_naming_the_argument(monkeypatch):
    """`lm tokenize --input - <&-`: Python's sys.stdin is None, and reading it had been a traceback;
    opened for writing only (`0>file`), the error named no option (clifuzz9 #4)."""
    import errno

    from lm.cli.common import read_stdin

    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(ValueError) as e:
        read_stdin("--input")
    assert str(e.value) == "--input: - reads standard input, which is closed"

    class Unreadable:
        def read(self, *args):
            raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=Unreadable()))
    with pytest.raises(ValueError) as e:
        read_stdin("--target")
    assert str(e.value) == "--target: - reads standard input, which cannot be read: Bad file descriptor"
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(b"Hallo\n")))
    assert read_stdin("--input") == b"Hallo\n"


def test_run_as_command_turns_ctrl_c_into_130_and_one_line(capsys):
    """A mutation (run_as_command's Ctrl-C status 130 read as 1) survived test_cli_common,
    test_sample and test_stories: only subprocess signal tests of other files see it. Its docstring
    says "a Ctrl-C ``PROG: interrupted`` and 130" (128 + SIGINT, as a shell reports it)."""
    from lm.cli.common import run_as_command

    def interrupted():
        raise KeyboardInterrupt

    assert run_as_command("lm x", interrupted) == 130
    assert capsys.readouterr() == ("", "lm x: interrupted\n")


def test_a_socket_stdout_whose_reader_left_is_a_reader_gone(monkeypatch):
    """A mutation (stdout_reader_gone reading POLLERR only, not POLLHUP) survived: on Linux a pipe
    whose reader closed reports POLLERR, but a socket whose peer closed reports POLLHUP alone
    (checked: POLLOUT|POLLHUP), and the docstring promises "a pipe (or socket)". With the mutation,
    `lm ... | ` over a socket (ssh, a supervisor's socket) that went away was a real error."""
    import io
    import os
    import socket

    from lm.cli.common import stdout_reader_gone

    class Fd(io.StringIO):
        def __init__(self, fd):
            super().__init__()
            self.fd = fd

        def fileno(self):
            return self.fd

    ours, theirs = socket.socketpair()
    try:
        monkeypatch.setattr(sys, "stdout", Fd(ours.fileno()))
        assert not stdout_reader_gone()  # the reader is there
        theirs.close()
        assert stdout_reader_gone()
        r, w = os.pipe()  # and a pipe, the common case
        try:
            monkeypatch.setattr(sys, "stdout", Fd(w))
            assert not stdout_reader_gone()
            os.close(r)
            assert stdout_reader_gone()
        finally:
            os.close(w)
    finally:
        ours.close()


def _parsers():
    """Every parser of the command line (``lm``, ``lm sample``, ``lm tokenizer train``...), by its name."""
    return {" ".join(path): sub for path, sub in commands(build_parser())}


def test_every_option_of_every_command_says_what_it_is_for():
    """`lm COMMAND --help` is the reference of the options (the README sends users there): each option
    of each command has its help text (mut31: `lm sample --top-k`'s and `lm translate --tokenizer`'s
    dropped survived; nothing read them)."""
    parsers = _parsers()
    assert {"lm", "lm sample", "lm translate", "lm eval", "lm export hf", "lm tokenizer train", "lm tokenize",
            "lm train", "lm data download", "lm serve", "lm demo", "lm plot"} <= set(parsers)
    bare = [f"{name} {action.option_strings[-1] if action.option_strings else action.dest}"
            for name, parser in parsers.items() for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
            and action.help != argparse.SUPPRESS and not (action.help or "").strip()]
    # and each command in its parent's list (`lm --help`, `lm export --help`)
    bare += [f"{name} {choice.dest}" for name, parser in parsers.items()
             for action in parser._actions if isinstance(action, argparse._SubParsersAction)
             for choice in action._choices_actions if not (choice.help or "").strip()]
    # a command given no help at all is left out of its parent's list (argparse lists only those with one)
    bare += [f"{name} {command}" for name, parser in parsers.items()
             for action in parser._actions if isinstance(action, argparse._SubParsersAction)
             for command in set(action.choices) - {choice.dest for choice in action._choices_actions}]
    assert bare == []


def test_check_utf8_names_the_option_and_what_is_not_utf8():
    """The value's own words ("the key (or $LM_API_KEY) is not valid UTF-8") when ``what`` is given;
    UTF-8, or text Python holds without lone surrogates, passes."""
    from lm.cli.common import check_utf8

    with pytest.raises(ValueError) as e:
        check_utf8("--api-key", "ab\udcffc", "the key (or $LM_API_KEY)")
    assert str(e.value) == ("--api-key: the key (or $LM_API_KEY) is not valid UTF-8 (at character 3); pass --api-key "
                            "in UTF-8")
    with pytest.raises(ValueError) as e:
        check_utf8("--out", "\udce9", remedy="rename it")
    assert str(e.value) == "--out: not valid UTF-8 (at character 1); rename it"
    check_utf8("--prompt", "café ✓ 𝄞")


MODEL_COMMANDS = {"sample", "eval", "train", "demo", "translate"}
OUTPUT_COMMANDS = {"tokenizer train", "tokenize", "export hf", "demo", "data download", "plot"}


def test_every_command_follows_the_grammar():
    """Each command (a leaf: `lm tokenize`, `lm export hf`) has --quiet, help ending in its examples,
    every default shown, no old spelling in sight; each output command --out and --overwrite; each
    model command --device DEVICE, --dtype, --threads; --checkpoint is PATH everywhere. (Moved here
    from test_cli_faults, whose other tests start `lm` in folders of their own; the parsers are
    built in the test, so a changed copy of the code is the one read.)"""
    leaves = {" ".join(path[1:]): sub for path, sub in commands(build_parser())
              if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)}
    assert MODEL_COMMANDS | OUTPUT_COMMANDS | {"serve"} <= set(leaves)
    for name, parser in leaves.items():
        options = {s for a in parser._actions for s in a.option_strings}
        helps = {s: a for a in parser._actions for s in a.option_strings}
        assert "--quiet" in options, name
        assert parser.epilog and parser.epilog.startswith("examples:\n  ") and f"lm {name}" in parser.epilog, name
        text = parser.format_help()
        formatter = parser._get_formatter()
        for a in parser._actions:
            if a.option_strings and a.help != "==SUPPRESS==" and a.default not in (None, False, [], "==SUPPRESS=="):
                # the default is shown (argparse shows it only for an option with a help text: five had none)
                assert a.help and "%(default)s" in formatter._get_help_string(a), (name, a.dest)
        assert "--out-dir" not in text and "OUT_DIR" not in text, name  # old spellings are hidden
        if name in OUTPUT_COMMANDS:
            assert "--out" in options and "--overwrite" in options, name
        # the help ends with its examples (readme8: lm train's ended with a paragraph after them)
        assert text.rstrip("\n").endswith(parser.epilog.rstrip("\n")), name
        assert all(line.startswith("  ") for line in parser.epilog.splitlines()[1:] if line.strip()), name
        if name in MODEL_COMMANDS:
            assert {"--device", "--dtype", "--threads"} <= options, name
            assert (helps["--device"].metavar, helps["--threads"].metavar) == ("DEVICE", "N"), name
            for option in ("--device", "--dtype"):  # lm train's come from its config: the help says so (readme8)
                assert "default" in formatter._get_help_string(helps[option]), (name, option)
        if "--checkpoint" in options:
            assert helps["--checkpoint"].metavar == "PATH", name
            assert "--checkpoint PATH" in text, name


def test_the_sampling_and_decoding_defaults_of_the_commands_are_the_librarys():
    """`lm sample` samples as generate() does and `lm translate` decodes as translate() does when no
    option is given: the defaults are the same numbers (mut31: --temperature's default made 2.0
    survived)."""
    import inspect

    from lm.generate import generate
    from lm.generate.seq2seq import beam_search

    sample = build_parser().parse_args(["sample", "--checkpoint", "run", "--prompt", "x"])
    defaults = inspect.signature(generate).parameters
    assert (sample.temperature, sample.top_p, sample.top_k) == tuple(
        defaults[name].default for name in ("temperature", "top_p", "top_k"))
    translate = build_parser().parse_args(["translate", "--checkpoint", "run", "--input", "x"])
    defaults = inspect.signature(beam_search).parameters
    assert (translate.beam, translate.alpha) == (defaults["beam_size"].default, defaults["alpha"].default)


def test_a_command_group_alone_asks_for_its_command(capsys):
    """`lm data`, `lm tokenizer` and `lm export` alone (mut31: a group's subcommand made optional
    survived; the run then had no command to call) are usage errors naming what is missing, as is
    `lm tokenize` without its required --input."""
    groups = {name: parser for name, parser in _parsers().items()
              if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)}
    assert set(groups) == {"lm", "lm data", "lm tokenizer", "lm export"}
    for name, parser in groups.items():
        metavar = next(a.metavar for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        with pytest.raises(SystemExit) as stopped:
            main(name.split()[1:])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.endswith(f"{name}: error: the following arguments are required: "
                                                        f"{metavar}\n"), err
    with pytest.raises(SystemExit) as stopped:
        main(["tokenize", "--tokenizer", "tok", "--out", "x.bin"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.endswith("lm tokenize: error: the following arguments are required: "
                                                    "--input\n"), err


# -- lm's standard streams, in this process (they had subprocess tests only, run from folders of their own) --

def test_stdout_that_cannot_be_written_is_named_once_then_silenced(monkeypatch):
    """`lm sample > /dev/full` said "error: [Errno 28] No space left on device", naming nothing
    (clifuzz9). A write or flush error of standard output is a StdoutError naming it, once: descriptor
    1 is then /dev/null, so the lines still buffered are no second error. A closed pipe is left to
    quiet_on_closed_pipe, as it is."""
    import errno

    import lm.io
    from lm.cli import StdoutError, _Stdout

    silenced = []
    monkeypatch.setattr(lm.io, "silence_stdout", lambda: silenced.append(1))
    with pytest.raises(StdoutError) as e:
        _Stdout(FullDisk(io.StringIO())).write("x")
    assert (e.value.errno, str(e.value)) == (errno.ENOSPC, "standard output cannot be written: No space left on "
                                                           "device")
    assert silenced == [1]

    class FailingFlush(io.StringIO):
        def flush(self):
            raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(StdoutError, match=r"^standard output cannot be written: Input/output error$"):
        _Stdout(FailingFlush()).flush()
    assert silenced == [1, 1]

    class ReaderGone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        _Stdout(ReaderGone()).write("x")
    assert silenced == [1, 1]  # not silenced here: quiet_on_closed_pipe decides

    stream = io.StringIO()  # a stream that works: its writes, their counts and its other attributes
    out = _Stdout(stream)
    assert out.write("abc") == 3
    out.flush()
    assert out.getvalue() == "abc"
    broken = _Stdout(stream, broken=True)  # closed or read-only at start: the first write is the error
    with pytest.raises(StdoutError, match=r"^standard output cannot be written: Bad file descriptor$"):
        broken.write("lost")
    assert silenced == [1, 1, 1]
    assert broken.write("def") == 3 and stream.getvalue() == "abcdef"  # then descriptor 1 is /dev/null's
    with pytest.raises(StdoutError, match="Bad file descriptor"):
        _Stdout(io.StringIO(), broken=True).flush()


def test_writable_tells_a_stream_open_for_writing(tmp_path):
    """Closed (None, or a descriptor that is not open) or open for reading only: not writable. A
    stream without a descriptor (pytest's capture, io.StringIO) is taken as it is."""
    import os

    from lm.cli import _writable

    assert not _writable(None)
    assert _writable(io.StringIO())
    (tmp_path / "f").write_text("")
    for mode, writable in (("r", False), ("w", True), ("a", True), ("r+", True)):
        with open(tmp_path / "f", mode) as f:
            assert _writable(f) is writable, mode
    read, write = os.pipe()
    with os.fdopen(read) as r, os.fdopen(write, "w") as w:
        assert (_writable(r), _writable(w)) == (False, True)
    free = os.open(os.devnull, os.O_RDONLY)
    os.close(free)

    class Closed:
        def fileno(self):
            return free

    assert not _writable(Closed())


def test_devnull_at_points_a_descriptor_at_dev_null_without_leaking_one(tmp_path):
    """A closed descriptor 1 or 2 would be taken by the next file opened, and what a library writes
    to it would land in that file."""
    import os

    from lm.cli import _devnull_at

    def lowest_free() -> int:  # the number the next file opened gets
        fd = os.open(os.devnull, os.O_RDONLY)
        os.close(fd)
        return fd

    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    free = lowest_free()
    try:
        _devnull_at(fd)
        assert lowest_free() == free  # /dev/null's own descriptor closed again
        assert os.path.samestat(os.fstat(fd), os.stat(os.devnull))
        os.write(fd, b"discarded")
        assert (tmp_path / "f").read_bytes() == b""
    finally:
        os.close(fd)
    free = lowest_free()  # a closed descriptor: /dev/null is opened at that number and kept
    _devnull_at(free)
    try:
        assert lowest_free() != free
        assert os.path.samestat(os.fstat(free), os.stat(os.devnull))
        os.write(free, b"discarded")  # open for writing
    finally:
        os.close(free)


def test_standard_streams_discard_what_cannot_be_written_and_name_stdout(monkeypatch, tmp_path):
    """Closed standard error: its lines go to /dev/null, not into standard output's data. Closed
    standard output: descriptor 1 is /dev/null's and the first write is the error naming it. Either
    way stdout is wrapped, and a name that is not UTF-8 is written as its bytes."""
    import lm.cli
    import lm.io
    from lm.cli import StdoutError, _standard_streams, _Stdout

    pointed, silenced = [], []
    monkeypatch.setattr(lm.cli, "_devnull_at", pointed.append)  # descriptors 1 and 2 are pytest's
    monkeypatch.setattr(lm.io, "silence_stdout", lambda: silenced.append(1))
    monkeypatch.setattr(sys, "stderr", None)
    monkeypatch.setattr(sys, "stdout", None)
    _standard_streams()
    assert pointed == [2, 1]
    assert (sys.stderr.fileno(), sys.stderr.errors, sys.stderr.buffer.raw.closefd) == (2, "backslashreplace", False)
    assert isinstance(sys.stdout, _Stdout) and sys.stdout.fileno() == 1 and not sys.stdout.buffer.raw.closefd
    assert sys.stdout.errors == "surrogateescape"
    with pytest.raises(StdoutError, match="Bad file descriptor"):
        sys.stdout.write("x")
    assert silenced == [1]
    assert sys.stdout.write("\n") == 1  # then descriptor 1 is /dev/null's, opened for writing (here pytest's)
    sys.stdout.flush()

    pointed.clear()
    with open(tmp_path / "out", "w", encoding="utf-8") as out:
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        monkeypatch.setattr(sys, "stdout", out)
        _standard_streams()
        assert pointed == [] and sys.stderr is err
        assert isinstance(sys.stdout, _Stdout) and not sys.stdout._broken
        sys.stdout.write("caf\udce9\n")
        sys.stdout.flush()
    assert (tmp_path / "out").read_bytes() == b"caf\xe9\n"


@pytest.mark.parametrize("outcome", [0, 2, 130, 143, "ctrl-c"])
def test_entry_exits_with_mains_status_at_once_after_a_signal(outcome, monkeypatch, capsys):
    """entry() exits with main's status; after Ctrl-C or SIGTERM (130, 143) at once (os._exit), without
    the interpreter's teardown. From the moment main returns, Ctrl-C is ignored; one that lands
    outside main's own handler is "lm: interrupted", 130."""
    import os
    import signal

    import lm.cli

    def run_main():
        if outcome == "ctrl-c":
            raise KeyboardInterrupt
        return outcome

    monkeypatch.setattr(lm.cli, "_standard_streams", lambda: None)
    monkeypatch.setattr(lm.cli, "main", run_main)
    monkeypatch.setattr(os, "_exit", exit_now)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises((SystemExit, Exited)) as e:
            lm.cli.entry()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    status = 130 if outcome == "ctrl-c" else outcome
    if status in (130, 143):
        assert type(e.value) is Exited and e.value.args == (status,)
    else:
        assert type(e.value) is SystemExit and e.value.code == status
    assert capsys.readouterr().err == ("lm: interrupted\n" if outcome == "ctrl-c" else "")


def test_a_batch_out_of_memory_says_what_torch_tried_to_allocate_when_torch_says_it():
    """model_fits' line carries torch's "tried to allocate N" where the allocator's message has it (a
    GPU's "Tried to allocate 2.00 GiB", the CPU's "you tried to allocate 1024 bytes"), and nothing in
    its place where it has none, as a GPU's "CUDA error: out of memory" (seed 14: a stray text
    there survived)."""
    import torch

    from lm.cli.common import model_fits

    cases = ((torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."),
              " (torch tried to allocate 2.00 GiB)"),
             (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1024 bytes. Error code 12 (Cannot allocate memory)"),
              " (torch tried to allocate 1024 bytes)"),
             (torch.OutOfMemoryError("CUDA error: out of memory"), ""))
    for error, tried in cases:
        with pytest.raises(ValueError) as refused, model_fits("--batch-size 8", "lower --batch-size"):
            raise error
        assert str(refused.value) == f"--batch-size 8 does not fit in memory{tried}; lower --batch-size"
    with pytest.raises(RuntimeError, match="^not memory$"), model_fits("--batch-size 8", "lower it"):
        raise RuntimeError("not memory")  # another error is not hidden


@pytest.mark.parametrize("argv, prog", [(["data", "download", "tinystories", "--out", ""], "lm data download"),
                                        (["export", "hf", "--checkpoint", "", "--out", "x"], "lm export hf"),
                                        (["tokenizer", "train", "--input", "", "--vocab-size", "300", "--out", "x"],
                                         "lm tokenizer train")])
def test_an_error_of_a_command_under_a_group_names_the_whole_command(argv, prog, capsys):
    """A command of a group (`lm data download`, `lm export hf`, `lm tokenizer train`) names itself
    whole in its error line, as its usage does (seed 14: the data group's word dropped survived here,
    where `lm data download`'s own tests were not in the selection)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err


def test_a_flag_that_needs_no_model_is_refused_before_torch_is_imported(tmp_path):
    """`lm sample --temperature -1`, `lm translate --alpha 11`, `--threads 0` and the like were said
    only after torch was imported (2.5-3.5 s on a 2-core machine): each command checks the flags that
    need no model (and reads its prompt or input) first, and torch stays unimported; only the last
    case, whose flags are fine, goes on to the checkpoint and imports torch."""
    (tmp_path / "c.toml").write_text("")
    cases = [
        (["sample", "--prompt", "x", "--temperature", "-1"], "--temperature: must be a finite number >= 0, got -1.0"),
        (["sample", "--prompt", "x", "--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
        (["sample", "--prompt", "x", "--top-k", "0"], "--top-k: must be a positive integer, got 0"),
        (["sample", "--prompt", "x", "--num-samples", "0"], "--num-samples: must be >= 1, got 0"),
        (["sample", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
        (["sample", "--prompt", "x", "--seed", "-1"], "--seed: must be a whole number in [0, 2**64-1], got -1"),
        (["sample", "--prompt", "x", "--threads", "0"], "--threads: must be a whole number >= 1, got 0"),
        (["sample", "--prompt-file", "missing.txt"], "--prompt-file: file not found: 'missing.txt'"),
        (["translate", "Hallo", "--beam", "0"], "--beam: must be >= 1, got 0"),
        (["translate", "Hallo", "--alpha", "11"], "--alpha: must be at most 10, got 11.0"),
        (["translate", "Hallo", "--alpha", "nan"], "--alpha: must be a finite number >= 0, got nan"),
        (["translate", "Hallo", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
        (["translate", "Hallo", "--threads", "100000"], "--threads: must be at most "),
        (["translate", "--input", "missing.txt"], "--input: file not found: 'missing.txt'"),
        (["eval", "--data", "x.bin", "--max-tokens", "0"], "--max-tokens: must be >= 1, got 0"),
        (["eval", "--data", "x.bin", "--alpha", "-1"], "--alpha: must be a finite number >= 0, got -1.0"),
        (["eval", "--data", "x.bin", "--threads", "0"], "--threads: must be a whole number >= 1, got 0"),
        (["serve", "--threads", "0"], "--threads: must be a whole number >= 1, got 0"),
        (["serve", "--allowed-origins", "localhost:3000"], "--allowed-origins: 'localhost:3000' is not an origin"),
        (["demo", "--threads", "0", "--out", "d"], "--threads: must be a whole number >= 1, got 0"),
        (["train", "--config", "c.toml", "--threads", "0"], "--threads: must be a whole number >= 1, got 0"),
        (["sample", "--prompt", "x"], "--checkpoint: file not found: 'nowhere'"),
    ]
    argvs = [[cmd, *(["--checkpoint", "nowhere"] if cmd in ("sample", "translate", "eval", "serve") else []), *rest]
             for (cmd, *rest), _ in cases]
    statuses, errors = main_in_one_interpreter(argvs, cwd=tmp_path)
    assert statuses == ["2 False"] * (len(cases) - 1) + ["2 True"], (statuses, errors)
    assert len(errors) == len(cases), errors
    for ((cmd, *_), want), line in zip(cases, errors):
        assert line.startswith(f"lm {cmd}: error: {want}"), (line, want)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["c.toml"]  # nothing made (no demo folder)

"""`lm sample`: streamed text equals the decoded tokens of `generate` with the same seed."""

import copy
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers.pipes import fifo_holding
from helpers.run_dir import make_run_dir, save_model

from lm.cli import main
from lm.generate import generate
from lm.model import TransformerLM

REPO = Path(__file__).resolve().parents[1]
TEXT = "Lily had a red ball. She threw it to Tom. Tom said, \"Thank you!\" Café. 😀\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d, model, tok = make_run_dir(tmp_path_factory.mktemp("run"), (TEXT + "<|endoftext|>") * 40, 300,
                                 context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    save_model(d, model)
    return d, model.eval(), tok


@pytest.mark.parametrize("prompt", ["Lily had", "", "Tom said " * 20])  # empty, and longer than the context
def test_streamed_text_equals_generate(run, capsys, prompt):
    d, model, tok = run
    argv = ["sample", "--checkpoint", str(d), "--prompt", prompt, "--max-new-tokens", "30", "--seed", "7",
            "--temperature", "0.9", "--top-k", "50"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    eos = tok.token_to_id[b"<|endoftext|>"]
    ids = tok.encode(prompt) or [eos]
    gen = torch.Generator().manual_seed(7)
    new = generate(model, ids, 30, temperature=0.9, top_k=50, eos_id=eos, generator=gen, vocab_size=tok.vocab_size)
    expected = prompt + tok.decode([t for t in new if t != eos]) + "\n"
    assert out == expected


def test_a_model_vocabulary_larger_than_the_tokenizers_samples_only_the_tokenizers_ids(tmp_path, capsys):
    d, _, tok = make_run_dir(tmp_path, (TEXT + "<|endoftext|>") * 40, 300, context_length=16, d_model=32,
                             num_layers=2, num_heads=2, d_ff=64)
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=tok.vocab_size + 64, context_length=16, d_model=32, num_layers=2,
                          num_heads=2, d_ff=64).eval()  # a padded vocabulary, as nanoGPT's 50,304
    save_model(d, model)
    argv = ["sample", "--checkpoint", str(d), "--prompt", "Lily", "--max-new-tokens", "200", "--seed", "1",
            "--temperature", "2.0"]  # flat enough that the model's extra ids would come up
    eos = tok.token_to_id[b"<|endoftext|>"]
    free = generate(model, tok.encode("Lily"), 200, temperature=2.0, generator=torch.Generator().manual_seed(1),
                    eos_id=eos)
    assert max(free) >= tok.vocab_size  # without the limit, ids with no text are drawn
    assert main(argv) == 0
    new = generate(model, tok.encode("Lily"), 200, temperature=2.0, generator=torch.Generator().manual_seed(1),
                   eos_id=eos, vocab_size=tok.vocab_size)
    assert capsys.readouterr().out == "Lily" + tok.decode([t for t in new if t != eos]) + "\n"


def test_greedy_is_repeatable_and_samples_are_separated(run, capsys):
    d, _, _ = run
    argv = ["sample", "--checkpoint", str(d), "--prompt", "Lily", "--temperature", "0", "--max-new-tokens", "10",
            "--num-samples", "2"]
    assert main(argv) == 0
    a, b = capsys.readouterr().out.split("\n" + "-" * 40 + "\n")
    assert a.strip() == b.strip() and a.startswith("Lily")


@pytest.mark.parametrize(
    "extra, message",
    [
        # the flags (they had said temperature, top_p, top_k), and the value as given: no "top_k=0", no "or
        # None", which a command line does not have (generate20)
        (["--temperature", "-1"], "--temperature: must be a finite number >= 0, got -1.0"),
        (["--temperature", "inf"], "--temperature: must be a finite number >= 0, got inf"),
        (["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
        (["--top-k", "0"], "--top-k: must be a positive integer, got 0"),
        (["--num-samples", "0"], "--num-samples: must be >= 1, got 0"),
        # torch's `Overflow when unpacking long long`, naming nothing
        (["--seed", str(2**64)], f"--seed: must be a whole number in [0, 2**64-1], got {2**64}"),
        (["--seed", "-1"], "--seed: must be a whole number in [0, 2**64-1], got -1"),
    ],
)
def test_bad_arguments(run, capsys, extra, message):
    d, _, _ = run
    assert main(["sample", "--checkpoint", str(d), "--prompt", "x", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lm sample: error: {message}" if message.startswith("--t") else message in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_with_non_finite_weights_is_refused_in_one_line(run, tmp_path, capsys, bad):
    """A diverged checkpoint had sampled: greedy, argmax over NaN logits is a plausible token id
    (garbage text); sampled, multinomial raised (and killed `lm serve`'s engine). Loading it is now
    a one-line error naming the file and the weight."""
    d, model, tok = run
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.layers[1].ffn.w2.weight[3, 5] = bad
    (tmp_path / "tokenizer").symlink_to(d / "tokenizer", target_is_directory=True)
    save_model(tmp_path, broken)
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "x", "--temperature", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'layers.1.ffn.w2.weight' holds NaN or infinity" in err
    assert "model.safetensors" in err and "earlier checkpoint" in err


def test_a_run_folder_resolves_to_its_newest_weights(run, tmp_path):
    """A run resumed and stopped early keeps the model.safetensors of its first end and a newer
    checkpoint: `lm eval --checkpoint RUN` had scored the old export, silently (step 50 against
    step 170 in the audit). The folder now resolves to whichever is newer. An export that cannot be
    read (a cut copy) gives way to the checkpoint with a warning naming both; it had done so silently."""
    from safetensors import safe_open

    from lm.checkpoint import export_safetensors
    from lm.generate.load import resolve_checkpoint

    _, model, _ = run
    (tmp_path / "checkpoints").mkdir()
    checkpoint = tmp_path / "checkpoints" / "step_00000170.pt"
    checkpoint.write_bytes(b"")  # resolving reads only its name
    exported = tmp_path / "model.safetensors"
    for meta, want in (({"step": "50"}, checkpoint), ({"step": "170"}, exported), ({"step": "200"}, exported),
                       ({}, exported)):  # no step recorded: an export put there by hand
        export_safetensors(model, exported, meta)
        assert resolve_checkpoint(tmp_path) == want, meta
    exported.write_bytes(b"not a safetensors file")  # a cut copy: the checkpoint, and a warning saying why
    with pytest.raises(Exception) as opening:  # noqa: B017, PT011 - safetensors' own error type
        safe_open(str(exported), "pt")
    with pytest.warns(UserWarning) as caught:
        assert resolve_checkpoint(tmp_path) == checkpoint
    assert [str(w.message) for w in caught] == [
        f"--checkpoint: {str(exported)!r} is not a readable safetensors file: {opening.value}; "
        f"loading {str(checkpoint)!r} instead"]
    export_safetensors(model, exported, {"step": "50"})  # readable and older: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_checkpoint(tmp_path) == checkpoint
    exported.write_bytes(b"not a safetensors file")
    checkpoint.unlink()
    with warnings.catch_warnings():  # no "loading ... instead": there is nothing else to load
        warnings.simplefilter("error")
        assert resolve_checkpoint(tmp_path) == exported  # the only weights: loading it says what is wrong


def test_a_corrupt_or_foreign_checkpoint_is_one_line_naming_the_argument(run, tmp_path, capsys):
    """safetensors' own error type (a cut file) and whatever torch's weights-only unpickler raises on
    a text file (KeyError) had escaped as tracebacks; torch's advice to load with weights_only=False
    (a file that may run code) is not passed on."""
    d, _, _ = run
    data = (d / "model.safetensors").read_bytes()
    torch.save({"format": "lm-checkpoint", "version": 1, "model": {}, "evil": torch.nn.Linear(2, 2)},
               tmp_path / "pickled.pt")
    for name, content, message in (("cut.safetensors", data[:100], "is not a readable safetensors file"),
                                   ("header.safetensors", data[:8] + b"{" * 50, "is not a readable safetensors file"),
                                   ("text.pt", b"hello\n", "is not an lm checkpoint: not a file torch.save writes"),
                                   ("pickled.pt", None, "holds objects other than tensors and plain data")):
        if content is not None:
            (tmp_path / name).write_bytes(content)
        argv = ["sample", "--checkpoint", str(tmp_path / name), "--tokenizer", str(d / "tokenizer"), "--prompt", "x"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("lm sample: error: --checkpoint: ") and name in err, err
        assert message in err and "weights_only=False" not in err, err


def test_weights_picked_from_a_run_folder_that_cannot_be_loaded_name_the_run_s_next_newest(run, tmp_path, capsys):
    """A run folder's newest weights that cannot be loaded (a cut copy, a diverged step) had been an
    error naming that file alone, though the run held older weights that load. The error now names
    the weights the folder would give without it, by the rule resolving a folder follows (the export
    unless a later checkpoint is there); a file named by hand, or a run with nothing else, gets no
    such line."""
    from lm.checkpoint import export_safetensors
    from lm.generate.load import load_model_and_tokenizer

    d, model, _ = run
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    newest = ckpts / "step_20.pt"
    newest.write_bytes(b"cut")
    hint = "; the run's next newest weights are "

    def error(path) -> str:
        with pytest.raises(ValueError) as caught:
            load_model_and_tokenizer(path, need_tokenizer=False)
        return str(caught.value)

    assert hint not in error(tmp_path)  # nothing else in the run
    assert error(tmp_path).startswith(f"--checkpoint: {str(newest)!r} is not a readable checkpoint")
    exported = tmp_path / "model.safetensors"
    exported.write_bytes(b"cut too")
    with pytest.warns(UserWarning, match="is not a readable safetensors file"):
        assert hint not in error(tmp_path)  # an export that cannot be read is no way out either
    export_safetensors(model, exported, {"step": "0"})  # older than step 20, but weights all the same
    assert error(tmp_path).endswith(f"{hint}{str(exported)!r}")
    (ckpts / "step_10.pt").write_bytes(b"")  # only named: a hint reads no file but the export's header
    for meta, want in (({}, None),  # no step recorded: the export itself is what the folder gives
                       ({"step": "15"}, exported),  # newer than step 10
                       ({"step": "10"}, exported),  # a tie: the export, as resolving a run folder picks it
                       ({"step": "5"}, ckpts / "step_10.pt")):
        export_safetensors(model, exported, meta)
        if want is None:
            assert load_model_and_tokenizer(tmp_path, need_tokenizer=False).path == exported
            continue
        assert error(tmp_path).endswith(f"{hint}{str(want)!r}"), meta
        assert error(ckpts).endswith(f"{hint}{str(want)!r}"), meta  # the run's checkpoints/ folder too
        assert hint not in error(newest)  # named by hand: what else to load is the user's choice
    newest.unlink()
    broken = copy.deepcopy(model)  # a diverged export, newer than every checkpoint
    with torch.no_grad():
        broken.layers[0].attn.q_proj.weight[0, 0] = float("nan")
    export_safetensors(broken, exported, {"step": "30"})
    assert error(tmp_path).endswith(f"use an earlier checkpoint{hint}{str(ckpts / 'step_10.pt')!r}")
    assert main(["sample", "--checkpoint", str(tmp_path), "--tokenizer", str(d / "tokenizer"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(f"{hint}{str(ckpts / 'step_10.pt')!r}"), err


def test_sampling_into_a_closed_pipe_stops_quietly(run):
    """`lm sample ... | head -c 20` printed "lm sample: error: [Errno 32] Broken pipe" and exited 2:
    only the last flush had been guarded, not the tokens streamed as they come. It now stops as a
    Unix tool cut short by `head` does: nothing on stderr, status 141 (128 + SIGPIPE)."""
    d, _, _ = run
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lm", "sample", "--checkpoint", str(d), "--prompt", "Lily had",
                             "--max-new-tokens", "200", "--num-samples", "50", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.read(8) == b"Lily had"  # `| head -c 8`: the prompt, then the reader is gone
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_a_model_whose_logits_overflow_is_one_line_naming_the_checkpoint(run, tmp_path, capsys, temperature):
    """Finite weights whose logits overflow to inf (a model that diverged has the same effect): sampled,
    a 20-line traceback from multinomial with exit 1; greedy, argmax over the infinities printed
    text that meant nothing, with exit 0."""
    d, model, tok = run
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.ln_final.weight.mul_(100)
        broken.lm_head.weight[7], broken.lm_head.weight[8] = 3e38, -3e38  # so one of them is +inf
        assert not torch.isfinite(broken(torch.tensor([tok.encode("x")]))[0, -1].max())
    (tmp_path / "tokenizer").symlink_to(d / "tokenizer", target_is_directory=True)
    save_model(tmp_path, broken)
    argv = ["sample", "--checkpoint", str(tmp_path), "--prompt", "x", "--temperature", temperature, "--seed", "1"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "x\n"  # the prompt, and the error line below it
    assert captured.err == ("lm sample: error: --checkpoint: the model's logits are not finite (NaN or inf) at "
                            "new token 1\n")


def test_the_seeded_generator_is_on_the_cpu_whatever_the_models_device(run, capsys, monkeypatch):
    """`lm sample` had made its generator on the model's device, so on a GPU `--seed` drew other tokens
    than on the CPU; lm serve draws with a CPU generator, which sample_next_token uses with logits on
    any device. A model on the meta device stands for a GPU here (its generator could not even be made)."""
    import lm.cli.common
    import lm.generate
    from lm.generate import Loaded

    d, model, tok = run
    used = []

    def load(*args, **kwargs):
        return Loaded(copy.deepcopy(model).to("meta"), tok, {}, d / "model.safetensors")

    def fake_generate(model, prompt_ids, max_new_tokens, *, generator, **kwargs):
        used.append(generator)
        return []

    monkeypatch.setattr(lm.cli.common, "load_model_and_tokenizer", load)
    monkeypatch.setattr(lm.generate, "generate", fake_generate)
    assert main(["sample", "--checkpoint", str(d), "--prompt", "x", "--seed", "5", "--quiet"]) == 0
    assert [(g.device.type, g.initial_seed()) for g in used] == [("cpu", 5)]


def test_the_prompt_file_may_be_a_pipe_dev_stdin_or_a_process_substitution(run, tmp_path, capsys):
    """`--prompt-file /dev/stdin`, `<(cmd)` and a named pipe had been refused ("not a regular file"),
    though the file is only read once from its start. A directory or a missing path is still one line."""
    d, _, _ = run
    common = ["sample", "--checkpoint", str(d), "--max-new-tokens", "6", "--temperature", "0", "--quiet"]
    assert main([*common, "--prompt", "Lily had"]) == 0
    want = capsys.readouterr().out
    assert want.startswith("Lily had")

    with fifo_holding(tmp_path / "prompt", b"Lily had") as fifo:
        status = main([*common, "--prompt-file", str(fifo)])
    captured = capsys.readouterr()
    assert (status, captured.out, captured.err) == (0, want, "")

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    lm = shlex.join([sys.executable, "-m", "lm", *common])
    for command, stdin in ((f"{lm} --prompt-file /dev/stdin", b"Lily had"),
                           (f"{lm} --prompt-file <(printf 'Lily had')", None),
                           (f"echo 'Lily had' | {lm} --prompt-file -", None)):  # echo's line end: dropped
        r = subprocess.run(["bash", "-c", command], input=stdin, capture_output=True, env=env, timeout=120)
        assert (r.returncode, r.stdout.decode(), r.stderr.decode()) == (0, want, ""), command

    for text in ("Lily had\n", "Lily had\r\n"):  # a text file's line end is no part of the prompt
        (tmp_path / "p.txt").write_bytes(text.encode())
        assert main([*common, "--prompt-file", str(tmp_path / "p.txt")]) == 0
        assert capsys.readouterr().out == want
    (tmp_path / "p.txt").write_bytes(b"Lily had\n\n")  # one is: the model starts on a new line
    assert main([*common, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    assert capsys.readouterr().out.startswith("Lily had\n")
    for path, message in ((tmp_path, "is a directory"), (tmp_path / "missing.txt", "file not found")):
        assert main([*common, "--prompt-file", str(path)]) == 2
        assert capsys.readouterr().err == f"lm sample: error: --prompt-file: {message}: {str(path)!r}\n"
    # the file named, as every other --prompt-file error names it, and the place counted from 1, as lm translate
    # --input counts it (it said "byte 18", from 0 and without a line: cli21)
    for body, place in ((b"Lily\xff", "line 1: not valid UTF-8 (byte 0xff at column 5)"),
                        (b"line one\nline two \xfe end\n", "line 2: not valid UTF-8 (byte 0xfe at column 10)")):
        (tmp_path / "bad.txt").write_bytes(body)
        assert main([*common, "--prompt-file", str(tmp_path / "bad.txt")]) == 2
        assert capsys.readouterr().err == f"lm sample: error: --prompt-file: {str(tmp_path / 'bad.txt')!r} {place}\n"


def test_the_stats_line_names_the_weights_sampled(run, tmp_path, capsys):
    """`--checkpoint RUN` is its model.safetensors or a later step_N.pt (audit "ckpt" #5): the line
    on stderr says which file, and its step when it records one."""
    from lm.checkpoint import export_safetensors

    d, model, _ = run
    (tmp_path / "tokenizer").symlink_to(d / "tokenizer", target_is_directory=True)
    export_safetensors(model, tmp_path / "model.safetensors", {"step": "40"})
    for folder, step in ((tmp_path, ", step 40"), (d, "")):
        assert main(["sample", "--checkpoint", str(folder), "--prompt", "Lily", "--max-new-tokens", "3",
                     "--temperature", "0"]) == 0
        err = capsys.readouterr().err
        assert err.startswith("[") and err.endswith(f" tokens/s; {folder / 'model.safetensors'}{step}]\n"), err


def test_a_model_of_context_length_1_samples_each_token_from_the_one_before(tmp_path, capsys):
    """`lm train` makes a context_length=1 model, but `lm sample` refused it after echoing the prompt:
    "Once" then, on the same line, "lm sample: error: window_shift must be an integer in [1,
    context_length=1), got window_shift=1", an option lm sample does not have. It now generates what
    a loop predicting each token from the one before it generates."""
    d, model, tok = make_run_dir(tmp_path, (TEXT + "<|endoftext|>") * 40, 300, context_length=1, d_model=32,
                                 num_layers=1, num_heads=2, d_ff=64)
    save_model(d, model)
    model.eval()
    assert main(["sample", "--checkpoint", str(d), "--prompt", "Lily had", "--max-new-tokens", "12",
                 "--temperature", "0", "--quiet"]) == 0
    ids = tok.encode("Lily had")
    eos = tok.token_to_id[b"<|endoftext|>"]
    new = []
    with torch.no_grad():
        while len(new) < 12 and (not new or new[-1] != eos):
            new.append(int(model(torch.tensor([(ids + new)[-1:]]))[0, -1, :tok.vocab_size].argmax()))
    captured = capsys.readouterr()
    assert captured == ("Lily had" + tok.decode([t for t in new if t != eos]) + "\n", "")


def test_an_error_after_the_prompt_was_echoed_starts_on_a_line_of_its_own(run, capsys, monkeypatch):
    """An error raised by generate (the window_shift one above, say) came straight after the echoed
    prompt and the text streamed so far, "Lily hadlm sample: error: ..." on a terminal. stdout now
    ends its line first; an error whose text ended a line already gets no empty line."""
    import lm.generate

    d, _, tok = run
    piece = tok.encode(" the")

    def failing_generate(model, prompt_ids, max_new_tokens, *, on_token, **kwargs):
        for t in piece:
            on_token(0, t)
        raise ValueError("something went wrong")

    monkeypatch.setattr(lm.generate, "generate", failing_generate)
    for prompt, out in (("Lily had", "Lily had the\n"), ("", " the\n")):
        assert main(["sample", "--checkpoint", str(d), "--prompt", prompt, "--temperature", "0", "--quiet"]) == 2
        assert capsys.readouterr() == (out, "lm sample: error: something went wrong\n")
    piece = []
    assert main(["sample", "--checkpoint", str(d), "--prompt", "Lily\n", "--temperature", "0", "--quiet"]) == 2
    assert capsys.readouterr() == ("Lily\n", "lm sample: error: something went wrong\n")


def test_seeds_that_differ_only_above_32_bits_sample_differently(run, capsys):
    """torch's CPU generator keeps the low 32 bits of a seed: --seed 5 and --seed 4294967301 printed
    the same text, though --seed takes [0, 2**64-1]. A seed below 2**32 still draws what
    torch.Generator().manual_seed(seed) draws (existing samples are kept)."""
    d, model, tok = run
    texts = {}
    for seed in (5, 2**32 + 5, 2**63 + 5):
        assert main(["sample", "--checkpoint", str(d), "--prompt", "Lily", "--max-new-tokens", "30", "--seed",
                     str(seed), "--temperature", "1.5", "--quiet"]) == 0
        texts[seed] = capsys.readouterr().out
    assert len(set(texts.values())) == 3
    eos = tok.token_to_id[b"<|endoftext|>"]
    new = generate(model, tok.encode("Lily"), 30, temperature=1.5, eos_id=eos, vocab_size=tok.vocab_size,
                   generator=torch.Generator().manual_seed(5))
    assert texts[5] == "Lily" + tok.decode([t for t in new if t != eos]) + "\n"


def test_tokenizer_errors_name_the_option_once_and_point_to_a_runs_tokenizer(run, tmp_path, capsys):
    """`--tokenizer /nonexistent` said "--tokenizer: tokenizer: not a directory: ..." and `--tokenizer RUN`
    (the run folder, not its tokenizer/) "--tokenizer: vocab_path: file not found: 'RUN/vocab.json'",
    naming a parameter of the library. One prefix now, and the run's tokenizer/ is suggested."""
    d, _, _ = run
    (tmp_path / "empty").mkdir()
    for given, message in ((tmp_path / "nowhere", f"not found: {str(tmp_path / 'nowhere')!r}"),
                           (d, f"no vocab.json in {str(d)!r}; pass {str(d / 'tokenizer')!r}, which has one"),
                           (tmp_path / "empty", f"no vocab.json in {str(tmp_path / 'empty')!r}")):
        assert main(["sample", "--checkpoint", str(d), "--prompt", "x", "--tokenizer", str(given)]) == 2
        assert capsys.readouterr() == ("", f"lm sample: error: --tokenizer: {message}\n")


def test_an_empty_tokenizer_is_refused_not_taken_for_the_runs(run, tmp_path, capsys, monkeypatch):
    """`--tokenizer ''` (a script's unset variable) was taken for "not given": every command used the
    run's tokenizer, exit 0, where `--model-name ''` or `--device ''` are refused (clifuzz7 #7). It
    is refused before any model is loaded, in every command that takes it."""
    import lm.checkpoint

    d, _, _ = run
    (tmp_path / "v.txt").write_text(TEXT)

    def load_model(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(lm.checkpoint, "load_model", load_model)
    for argv in (["sample", "--checkpoint", d, "--prompt", "x"],
                 ["eval", "--checkpoint", d, "--data", tmp_path / "v.txt"],
                 ["translate", "--checkpoint", d, "abc"],
                 ["export", "hf", "--checkpoint", d, "--out", tmp_path / "hf"],
                 ["serve", "--checkpoint", d, "--port", "0"]):
        assert main([*map(str, argv), "--tokenizer", ""]) == 2, argv
        command = " ".join(argv[: 2 if argv[0] == "export" else 1])
        assert capsys.readouterr() == ("", f"lm {command}: error: --tokenizer: must not be empty; omit it to use the "
                                           "run's tokenizer/\n")
    assert sorted(os.listdir(tmp_path)) == ["v.txt"]


def test_an_empty_path_is_refused_not_taken_for_the_working_folder(run, tmp_path, capsys, monkeypatch):
    """`--checkpoint ''` (a script's unset variable) is Path('.'): from inside a run folder, sample,
    eval, translate and serve used that run, exit 0; `lm tokenize --tokenizer ''` tokenized with the
    working folder's tokenizer and `lm plot ''` plotted it; elsewhere the errors named '.', which was
    never typed (clifuzz9 #3). Every such path is now one line saying it must not be empty."""
    import shutil

    d, _, _ = run
    here = tmp_path / "here"
    shutil.copytree(d, here)  # a run folder, its tokenizer/ and metrics.jsonl: what '' would have found
    shutil.copytree(Path(d) / "tokenizer", here / "tok")
    (here / "v.txt").write_text(TEXT)
    monkeypatch.chdir(here)
    before = sorted(os.listdir(here))
    cases = [
        (["sample", "--checkpoint", "", "--prompt", "x"], "--checkpoint"),
        (["eval", "--checkpoint", "", "--data", "v.txt"], "--checkpoint"),
        (["translate", "--checkpoint", "", "abc"], "--checkpoint"),
        (["serve", "--checkpoint", "", "--port", "0"], "--checkpoint"),
        (["tokenize", "--tokenizer", "", "--input", "v.txt", "--out", "o.bin"], "--tokenizer"),
        (["tokenize", "--tokenizer", "tok", "--input", "", "--out", "o.bin"], "--input"),
        (["tokenize", "--tokenizer", "tok", "--input", "v.txt", "--out", ""], "--out"),
        (["tokenizer", "train", "--input", "v.txt", "--vocab-size", "300", "--out", ""], "--out"),
        (["eval", "--checkpoint", ".", "--data", ""], "--data"),
        (["sample", "--checkpoint", ".", "--prompt-file", ""], "--prompt-file"),
        (["plot", ""], "RUN_DIR"),
        (["train", "--config", ""], "--config"),
    ]
    for argv, option in cases:
        assert main(argv) == 2, argv
        command = " ".join(argv[: 2 if argv[0] in ("tokenizer", "export") else 1])
        assert capsys.readouterr() == ("", f"lm {command}: error: {option}: must not be empty\n"), argv
    assert main(["translate", "--checkpoint", ".", "--input", ""]) == 2  # not "no sentences given"
    assert capsys.readouterr().err == ("lm translate: error: --input: must not be empty; pass a file, or - for "
                                       "standard input\n")
    assert sorted(os.listdir(here)) == before


def test_a_token_file_is_refused_as_a_prompt_file(run, tmp_path, capsys):
    """`lm sample --prompt-file train.bin` sampled after a prompt of NULs and control characters, where
    `lm translate --input` and `lm demo --data` refuse a token file (clifuzz9)."""
    d, _, _ = run
    (tmp_path / "v.txt").write_text(TEXT)
    assert main(["tokenize", "--tokenizer", str(Path(d) / "tokenizer"), "--input", str(tmp_path / "v.txt"), "--out",
                 str(tmp_path / "v.bin"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(d), "--prompt-file", str(tmp_path / "v.bin")]) == 2
    assert capsys.readouterr() == ("", f"lm sample: error: --prompt-file: {str(tmp_path / 'v.bin')!r} is a token file "
                                       "(`lm tokenize`); give the prompt as text\n")


def test_an_empty_prompt_without_end_of_text_names_the_option_given(tmp_path, capsys, monkeypatch):
    """decode8: an empty --prompt-file (or standard input) with a tokenizer that has no <|endoftext|>
    was refused as `--prompt: empty`, an option the user had not given."""
    import io

    from lm.tokenizer import Tokenizer, save_tokenizer_dir, train_bpe

    (tmp_path / "corpus.txt").write_text(TEXT * 40, encoding="utf-8")
    vocab, merges = train_bpe(tmp_path / "corpus.txt", 270, [])
    save_tokenizer_dir(Tokenizer(vocab, merges, []), tmp_path / "tok")
    torch.manual_seed(0)
    save_model(tmp_path, TransformerLM(vocab_size=270, context_length=16, d_model=32, num_layers=1, num_heads=2,
                                       d_ff=64))
    (tmp_path / "empty.txt").write_text("\n")  # its one line end goes: nothing is left
    common = ["sample", "--checkpoint", str(tmp_path), "--tokenizer", str(tmp_path / "tok"), "--max-new-tokens", "3"]
    rest = ", and the tokenizer has no <|endoftext|> to start a document with\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    for given, said in ((["--prompt", ""], "--prompt: empty"),
                        (["--prompt-file", str(tmp_path / "empty.txt")],
                         f"--prompt-file: {str(tmp_path / 'empty.txt')!r} is empty"),
                        (["--prompt-file", "-"], "--prompt-file: standard input is empty")):
        assert main([*common, *given]) == 2
        assert capsys.readouterr().err == f"lm sample: error: {said}{rest}"


def test_sample_refuses_max_new_tokens_0_before_loading_anything(tmp_path, capsys):
    """A mutation (`< 1` read as `< 0`): --max-new-tokens 0 echoed the prompt and exited 0, where
    --num-samples 0 is refused. The check comes before the model loads: the checkpoint need not exist."""
    assert main(["sample", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x",
                 "--max-new-tokens", "0"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "lm sample: error: --max-new-tokens: must be >= 1, got 0\n")


def test_an_empty_prompt_starts_at_end_of_text_when_it_is_not_id_0(tmp_path, capsys):
    """A mutation (an empty prompt starts from id 0, not <|endoftext|>): every test tokenizer lists
    <|endoftext|> first, so it is id 0 and the mutant equals the code. With `--special-token '<pad>'
    --special-token '<|endoftext|>'` it is id 1, and a sample of '' must start where generate()
    starts from [eot]."""
    import torch
    from helpers.run_dir import save_model

    from lm.generate import generate
    from lm.model import TransformerLM
    from lm.tokenizer import Tokenizer, save_tokenizer_dir, train_bpe

    text = "Lily had a red ball. She threw it to Tom. Tom said, \"Thank you!\"\n<|endoftext|>" * 40
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(tmp_path / "corpus.txt", 300, ["<pad>", "<|endoftext|>"])
    tok = Tokenizer(vocab, merges, ["<pad>", "<|endoftext|>"])
    save_tokenizer_dir(tok, tmp_path / "tokenizer")
    eot = tok.token_to_id[b"<|endoftext|>"]
    assert eot != 0
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=300, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64).eval()
    save_model(tmp_path, model)
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "", "--temperature", "0",
                 "--max-new-tokens", "12", "--quiet"]) == 0
    new = generate(model, [eot], 12, temperature=0.0, eos_id=eot, vocab_size=tok.vocab_size)
    from_zero = generate(model, [0], 12, temperature=0.0, eos_id=eot, vocab_size=tok.vocab_size)
    assert new != from_zero  # the test tells the two starts apart
    assert capsys.readouterr().out == tok.decode([t for t in new if t != eot]) + "\n"


def test_a_sample_that_ends_at_end_of_text_prints_no_end_of_text(tmp_path, capsys):
    """A mutation (the streamer no longer skips <|endoftext|>): generate() hands the end token to
    on_token, and no CLI test drew one (temperature 0.9, 30 tokens of 300 ids). The text printed
    must be generate()'s tokens up to the end token, decoded without it, as the help says
    ("Generation stops at <|endoftext|>")."""
    import torch
    from helpers.run_dir import make_run_dir, save_model

    from lm.generate import generate

    text = "Lily had a red ball. She threw it to Tom. Tom said, \"Thank you!\"\n<|endoftext|>" * 40
    d, model, tok = make_run_dir(tmp_path, text, 300, context_length=16, d_model=32, num_layers=2, num_heads=2,
                                 d_ff=64)
    model.eval()
    save_model(d, model)
    eot = tok.token_to_id[b"<|endoftext|>"]
    for seed in range(200):  # a seed whose sample ends at <|endoftext|>
        new = generate(model, tok.encode("Lily"), 60, temperature=3.0, eos_id=eot, vocab_size=tok.vocab_size,
                       generator=torch.Generator().manual_seed(seed))
        if new[-1] == eot:
            break
    else:
        pytest.skip("no seed below 200 ends at <|endoftext|>")
    assert main(["sample", "--checkpoint", str(d), "--prompt", "Lily", "--temperature", "3", "--max-new-tokens",
                 "60", "--seed", str(seed), "--quiet"]) == 0
    assert capsys.readouterr().out == "Lily" + tok.decode(new[:-1]) + "\n"


@pytest.mark.parametrize("quiet", [False, True])
def test_bfloat16_on_a_cpu_that_multiplies_it_slowly_is_a_warning_unless_quiet(run, capsys, monkeypatch, quiet):
    """`--dtype bfloat16` on a CPU without bfloat16 units (85-125x float32's time here) had sampled
    that slowly without a word; the same holds for lm translate, eval and serve (compute_dtype)."""
    import lm.device

    d, _, _ = run
    monkeypatch.setattr(lm.device, "cpu_has_bfloat16", lambda: False)
    monkeypatch.setattr(lm.device, "bfloat16_matmul_slowdown", lambda: 85.4)
    argv = ["sample", "--checkpoint", str(d), "--prompt", "x", "--max-new-tokens", "2", "--device", "cpu",
            "--dtype", "bfloat16", "--seed", "1"]
    assert main(argv + ["--quiet"] * quiet) == 0
    err = capsys.readouterr().err
    warning = ("lm sample: warning: --dtype: a bfloat16 matrix product takes 85x the time of a float32 one on this "
               "CPU (no bfloat16 units): float32 is faster here\n")
    assert err == "" if quiet else err.startswith(warning), err

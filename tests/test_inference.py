"""The inference layer: loading a run once, streaming text, the end-of-text id."""

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.run_dir import make_run_dir, save_model
from helpers.tokenizers import pair_tokenizer

from lm.checkpoint import export_safetensors
from lm.generate import Loaded, TextStreamer, load_model_and_tokenizer
from lm.model import Seq2SeqConfig, build_model
from lm.tokenizer import EOT, Tokenizer, save_tokenizer_dir


def _tokenizer_with_split_characters():
    """Byte tokens, plus multi-byte tokens that start or end inside a UTF-8 character."""
    vocab = {i: bytes([i]) for i in range(256)}
    pieces = ["é".encode(), "🙂".encode()[:2], "🙂".encode()[2:], "a🙂".encode()[:3], " 漢".encode()[:2]]
    for p in pieces:
        vocab[len(vocab)] = p
    return Tokenizer(vocab, [], [EOT])


def test_streamer_pieces_join_to_decode_and_never_split_a_character():
    tok = _tokenizer_with_split_characters()
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 30))).tolist()
        s = TextStreamer(tok, skip=[tok.eot_id])
        pieces = [s.push(i) for i in ids] + [s.flush()]
        kept = [i for i in ids if i != tok.eot_id]
        assert "".join(pieces) == tok.decode(kept)  # the reference: decode all at once
        for p in pieces[:-1]:  # no piece but the last ends in a held-back, half-made character
            assert p.encode("utf-8").decode("utf-8") == p


def test_streamer_start_is_where_each_tokens_text_lies_in_the_decoded_text():
    """A token of whole characters: its text is at ``start`` of the text decoded all at once, and
    decoding the ids up to it ends with it (brute force); a piece of a character: ``start`` is the
    end of the text returned before it."""
    tok = _tokenizer_with_split_characters()
    rng = np.random.default_rng(1)
    for _ in range(300):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 30))).tolist()
        s = TextStreamer(tok)
        text = tok.decode(ids)
        for k, i in enumerate(ids):
            before = s.length
            s.push(i)
            try:
                own = tok.vocab[i].decode("utf-8")
            except UnicodeDecodeError:
                own = None
            if own is not None:  # the text of the ids after it starts right after its own
                assert text[s.start: s.start + len(own)] == own
                assert len(tok.decode(ids[: k + 1])) == s.start + len(own)
            else:
                assert s.start == before


def test_streamer_holds_back_an_unfinished_character():
    tok = _tokenizer_with_split_characters()
    smile = list("🙂".encode())
    s = TextStreamer(tok)
    assert [s.push(b) for b in smile[:3]] == ["", "", ""] and s.pending()
    assert s.push(smile[3]) == "🙂" and not s.pending()
    assert s.push(smile[0]) == "" and s.flush() == "\ufffd"  # a character never finished: U+FFFD, as decode
    assert tok.decode([smile[0]]) == "\ufffd"


def test_eot_id():
    tok = _tokenizer_with_split_characters()
    assert tok.eot_id == tok.token_to_id[EOT.encode()] and tok.decode([tok.eot_id]) == EOT
    assert Tokenizer({i: bytes([i]) for i in range(256)}, []).eot_id is None


def test_load_model_and_tokenizer_once(tmp_path):
    run, model, _ = make_run_dir(tmp_path, ("Lily had a red ball. " + EOT) * 40, 300, context_length=16,
                                 d_model=32, num_layers=2, num_heads=2, d_ff=64)
    save_model(run, model)
    loaded = load_model_and_tokenizer(run)
    assert isinstance(loaded, Loaded) and loaded.architecture == "decoder_lm" and not loaded.model.training
    model, tok, info = loaded  # unpacks like the CLI's triple
    assert tok is loaded.tokenizer and info is loaded.info and tok.eot_id is not None
    assert loaded.path.name == "model.safetensors"
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).shape[-1] == model.config.vocab_size


def test_a_tokenizer_that_is_not_the_models_is_refused_naming_both(tmp_path):
    """``tokenizer=`` another tokenizer than the one the model was trained with: the error names the
    folder given and the model's file (mutation: the folder's name as None, survived; only a process
    test, outside the selection, read the message's start)."""
    run, model, tok = make_run_dir(tmp_path, ("Lily had a red ball. " + EOT) * 40, 300, context_length=16,
                                   d_model=32, num_layers=2, num_heads=2, d_ff=64)
    export_safetensors(model, run / "model.safetensors", {"tokenizer_sha256": tok.checksum()})  # as lm train does
    assert load_model_and_tokenizer(run).tokenizer.checksum() == tok.checksum()
    other = tmp_path / "other"
    save_tokenizer_dir(Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT]), other)
    with pytest.raises(ValueError, match=rf"^--tokenizer: {re.escape(repr(str(other)))} is not the tokenizer of "
                                         rf"the model {re.escape(repr(str(run / 'model.safetensors')))} "
                                         r"\(tokenizer checksum [0-9a-f]{12}… instead of [0-9a-f]{12}…\)$"):
        load_model_and_tokenizer(run, other)


@pytest.mark.parametrize("where, message", [("nowhere", "^--checkpoint: file not found: '.*nowhere'$"),
                                            ("empty", "holds no model.safetensors"),
                                            # it had said "file not found" of /dev/null and pipes (clifuzz9)
                                            ("fifo", "^--checkpoint: not a regular file: '.*fifo'$"),
                                            ("", "^--checkpoint: must not be empty$")])
def test_load_errors_name_the_argument(tmp_path, where, message, monkeypatch):
    (tmp_path / "empty").mkdir()
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.chdir(tmp_path)
    if where == "":
        with pytest.raises(ValueError, match=message):
            load_model_and_tokenizer("")
        return
    with pytest.raises(ValueError, match=message):
        load_model_and_tokenizer(tmp_path / where)
    with pytest.raises(ValueError, match="^model: file not found"):
        load_model_and_tokenizer(tmp_path / "nowhere", argument="model")


def test_a_run_folder_whose_name_is_not_utf8_loads_its_export(tmp_path):
    """The safetensors library refuses a path that is not UTF-8 ("Path ... is not valid UTF-8"): a
    run folder named with a Latin-1 byte could not be sampled from its export, and beside a
    checkpoint the export's step read as unknown, so the older checkpoint was loaded (clifuzz9)."""
    from lm.checkpoint import write_checkpoint
    from lm.checkpoint.export import exported_step
    from lm.generate.load import resolve_checkpoint

    run = tmp_path / "r\udcff"
    run.mkdir()
    _, model, _ = make_run_dir(run, ("Lily had a red ball. " + EOT) * 40, 300, context_length=16, d_model=32,
                               num_layers=1, num_heads=2, d_ff=64)
    save_model(run, model)
    loaded = load_model_and_tokenizer(run)
    assert loaded.path == run / "model.safetensors" and loaded.source == str(tmp_path / "r\\xff" / "model.safetensors")
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], p), name
    assert exported_step(run / "model.safetensors") is None  # readable: no step recorded by save_model
    (run / "checkpoints").mkdir()
    write_checkpoint({"model": model.state_dict(), "iteration": 3}, run / "checkpoints" / "step_00000003.pt")
    assert resolve_checkpoint(run) == run / "model.safetensors"  # the export, recorded or not, is not older


def _project(tmp_path):
    """proj/run: a run's model.safetensors and a checkpoint, trained without data.tokenizer (no
    run/tokenizer/), in proj/, which has a tokenizer/ of its own (another model's)."""
    from lm.checkpoint import write_checkpoint

    tiny = dict(context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=64)
    for d in ("other", "model"):
        (tmp_path / d).mkdir()
    make_run_dir(tmp_path / "other", ("The cat sat. " + EOT) * 40, 280, **tiny)  # another model's tokenizer
    _, model, _ = make_run_dir(tmp_path / "model", ("Lily had a red ball. " + EOT) * 40, 300, **tiny)
    run = tmp_path / "proj" / "run"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "other" / "tokenizer").rename(tmp_path / "proj" / "tokenizer")
    save_model(run, model)
    write_checkpoint({"iteration": 30, "model": model.state_dict(), "config": {"model": model.config.to_dict()}},
                     run / "checkpoints" / "step_00000030.pt")
    return run, tmp_path / "model" / "tokenizer"


def test_the_tokenizer_of_a_run_is_its_own_never_the_one_of_the_folder_above(tmp_path):
    """`--checkpoint proj/run` (its model.safetensors) looked for a tokenizer in proj/run, then in
    proj/: a run trained without data.tokenizer was scored and sampled with proj/tokenizer, whatever
    model that belonged to (audit "ckpt" #1). The folder above is the run only for a file in its
    checkpoints/."""
    from lm.generate.load import find_run_tokenizer
    from lm.tokenizer import load_tokenizer_dir

    run, own = _project(tmp_path)
    assert find_run_tokenizer(run / "model.safetensors") is None
    assert find_run_tokenizer(run / "checkpoints" / "step_00000030.pt") is None  # proj/run has none either
    alone = load_model_and_tokenizer(run, need_tokenizer=False)
    assert alone.tokenizer is None and alone.model.config.vocab_size == 300 and not alone.model.training
    beside = re.escape(repr(str(run / "model.safetensors")))
    with pytest.raises(ValueError, match=rf"^--tokenizer: no tokenizer/ beside {beside}; pass --tokenizer DIR$"):
        load_model_and_tokenizer(run)
    (run / "tokenizer").symlink_to(own, target_is_directory=True)  # the run's own: found from either file
    assert find_run_tokenizer(run / "model.safetensors") == run / "tokenizer"
    assert find_run_tokenizer(run / "checkpoints" / "step_00000030.pt") == run / "tokenizer"
    loaded = load_model_and_tokenizer(run / "checkpoints" / "step_00000030.pt")
    assert loaded.tokenizer.checksum() == load_tokenizer_dir(own).checksum()


def test_a_runs_checkpoints_folder_gives_its_latest_step_file(tmp_path):
    """`--checkpoint RUN/checkpoints` (what a shell completes) was refused: "run directory
    'RUN/checkpoints' holds no model.safetensors and no checkpoints/", beside its step files. It
    takes the latest step_N.pt now, as `lm train --resume RUN/checkpoints` does; a folder without
    weights says what it holds."""
    from lm.generate.load import resolve_checkpoint

    run, _ = _project(tmp_path)
    ckpts = run / "checkpoints"
    (ckpts / "step_00000010.pt").write_bytes(b"")  # resolving reads only the names
    (ckpts / "best.pt").write_bytes(b"")
    assert resolve_checkpoint(ckpts) == ckpts / "step_00000030.pt"
    assert load_model_and_tokenizer(ckpts, need_tokenizer=False).info["iteration"] == 30
    named = tmp_path / "checkpoints"  # a run folder that is itself named checkpoints: its own checkpoints/
    (named / "checkpoints").mkdir(parents=True)
    (named / "checkpoints" / "step_5.pt").write_bytes(b"")
    assert resolve_checkpoint(named) == named / "checkpoints" / "step_5.pt"
    for step in (10, 30):
        (ckpts / f"step_{step:08d}.pt").unlink()
    with pytest.raises(ValueError) as e:
        resolve_checkpoint(ckpts)
    assert str(e.value) == (f"--checkpoint: {str(ckpts)!r} holds no step_*.pt (it holds 'best.pt'); pass a "
                            "checkpoint file or the run folder")
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):  # three names, then how many more (mutation: 3 more)
        (ckpts / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"\(it holds 'a\.txt', 'b\.txt', 'best\.pt' and 2 more\); pass a "):
        resolve_checkpoint(ckpts)
    (run / "model.safetensors").unlink()
    with pytest.raises(ValueError) as e:
        resolve_checkpoint(run)
    assert str(e.value) == (f"--checkpoint: run directory {str(run)!r} holds no model.safetensors and no "
                            "checkpoints/step_*.pt (it holds 'checkpoints/'); pass a checkpoint file or a run folder")


def test_tokenizer_errors_have_one_prefix_the_argument(tmp_path):
    """The library's own parameter names had followed the argument's ("--tokenizer: tokenizer: not a
    directory", "--tokenizer: vocab_path: file not found", "--tokenizer: merges_path: line 4 ..."); a run
    folder given for its tokenizer/ now gets that folder suggested."""
    import re
    import shutil

    run, model, _ = make_run_dir(tmp_path, ("Lily had a red ball. " + EOT) * 40, 300, context_length=16,
                                 d_model=32, num_layers=2, num_heads=2, d_ff=64)
    save_model(run, model)
    bad = tmp_path / "bad"
    shutil.copytree(run / "tokenizer", bad)
    lines = (bad / "merges.txt").read_bytes().splitlines(keepends=True)
    (bad / "merges.txt").write_bytes(b"".join(lines[:3]) + b"a \xff\n" + b"".join(lines[3:]))
    (tmp_path / "half").mkdir()
    shutil.copy(run / "tokenizer" / "vocab.json", tmp_path / "half")
    (tmp_path / "afile").write_text("x")
    cases = [(tmp_path / "nowhere", f"not found: {str(tmp_path / 'nowhere')!r}"),
             (tmp_path / "afile", f"not a directory: {str(tmp_path / 'afile')!r}"),
             (run, f"no vocab.json in {str(run)!r}; pass {str(run / 'tokenizer')!r}, which has one"),
             (tmp_path / "half", f"no merges.txt in {str(tmp_path / 'half')!r}"),
             (bad, f"line 4 of {str(bad / 'merges.txt')!r} is not UTF-8 (byte 0xff)")]
    for given, message in cases:
        for argument in ("--tokenizer", "tok"):
            with pytest.raises(ValueError, match=f"^{re.escape(f'{argument}: {message}')}$"):
                load_model_and_tokenizer(run, given, tokenizer_argument=argument)


def test_a_checkpoint_deleted_between_its_pick_and_its_read_is_picked_again(tmp_path, monkeypatch):
    """`lm sample/eval/export hf --checkpoint RUN` on a run that is training failed now and then with
    "checkpoint not found" for the file it had picked itself: the trainer's keep_last deleted the
    newest step_N.pt between the pick and the read (ckpt21). A run folder is resolved again; a file
    given by name is not (it is gone: the error says so)."""
    import lm.checkpoint
    from lm.checkpoint import write_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    _, model, _ = make_run_dir(run, ("Lily had a red ball. " + EOT) * 40, 300, context_length=16, d_model=32,
                               num_layers=1, num_heads=2, d_ff=64)
    (run / "checkpoints").mkdir()
    state = {"iteration": 2, "model": model.state_dict(), "config": {"model": model.config.to_dict()}}
    write_checkpoint(state, run / "checkpoints" / "step_00000002.pt")
    real, opened = lm.checkpoint.load_model, []

    def trainer_saves_first(file, **kwargs):  # step 3 written, step 2 deleted, just before the read
        opened.append(Path(file).name)
        if len(opened) == 1:
            write_checkpoint({**state, "iteration": 3}, run / "checkpoints" / "step_00000003.pt")
            (run / "checkpoints" / "step_00000002.pt").unlink()
        return real(file, **kwargs)

    monkeypatch.setattr(lm.checkpoint, "load_model", trainer_saves_first)
    for path in (run, run / "checkpoints"):
        opened.clear()
        loaded = load_model_and_tokenizer(path)
        assert loaded.path == run / "checkpoints" / "step_00000003.pt"
        assert opened == ["step_00000002.pt", "step_00000003.pt"]
        (run / "checkpoints" / "step_00000003.pt").rename(run / "checkpoints" / "step_00000002.pt")
    opened.clear()
    with pytest.raises(ValueError, match=r"^--checkpoint: checkpoint not found: .*step_00000002\.pt'$"):
        load_model_and_tokenizer(run / "checkpoints" / "step_00000002.pt")
    assert opened == ["step_00000002.pt"]


def test_a_translation_model_whose_special_ids_are_not_its_tokenizers_is_refused(tmp_path):
    """The module's rule (and lm translate's): the model's pad/bos/eos ids must be the tokenizer's
    <pad>/<bos>/<eos>. A model whose bos and eos ids are swapped against the tokenizer (a
    checkpoint that recorded no tokenizer checksum, so the checksum cannot tell) would start every
    translation with <eos> and stop at <bos>: refused, naming --tokenizer."""
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=259, context_length=32, d_model=32, encoder_layers=1, decoder_layers=1,
                        num_heads=4, d_ff=64, dropout=0.0, bos_id=2, eos_id=1)
    export_safetensors(build_model(cfg).eval(), tmp_path / "model.safetensors")
    save_tokenizer_dir(pair_tokenizer(), tmp_path / "tokenizer")
    with pytest.raises(ValueError) as refused:
        load_model_and_tokenizer(tmp_path)
    # the folder named (seed 14: named as 'None' survived)
    assert str(refused.value) == ("--tokenizer: the model's bos_id is 2, but <bos> is id 1 in "
                                  f"{str(tmp_path / 'tokenizer')!r}")
    ok = Seq2SeqConfig(vocab_size=259, context_length=32, d_model=32, encoder_layers=1, decoder_layers=1,
                       num_heads=4, d_ff=64, dropout=0.0)
    export_safetensors(build_model(ok).eval(), tmp_path / "model.safetensors")
    assert load_model_and_tokenizer(tmp_path).architecture == "encoder_decoder"


def test_a_checkpoint_that_vanishes_at_every_pick_is_an_error_after_a_few_picks(tmp_path, monkeypatch):
    """A run folder is resolved again when its pick is deleted before the read, but not for ever: a
    trainer that deletes each newest checkpoint before it is read (a loop had never ended) gets
    RESOLVE_ATTEMPTS picks, then the error naming the last one."""
    import lm.checkpoint
    from lm.generate.load import RESOLVE_ATTEMPTS

    run, _ = _project(tmp_path)
    (run / "model.safetensors").unlink()
    real, opened = lm.checkpoint.load_model, []

    def always_too_late(file, **kwargs):  # the next step written and this one deleted, just before each read
        step = int(Path(file).stem.split("_")[1])
        opened.append(step)
        Path(file).rename(Path(file).with_name(f"step_{step + 1:08d}.pt"))
        return real(file, **kwargs)

    monkeypatch.setattr(lm.checkpoint, "load_model", always_too_late)
    with pytest.raises(ValueError) as e:
        load_model_and_tokenizer(run, need_tokenizer=False)
    assert opened == list(range(30, 30 + RESOLVE_ATTEMPTS)) and RESOLVE_ATTEMPTS > 1
    last = run / "checkpoints" / f"step_{30 + RESOLVE_ATTEMPTS - 1:08d}.pt"
    assert str(e.value).startswith(f"--checkpoint: checkpoint not found: {str(last)!r}"), e.value


def test_a_tokenizer_larger_than_the_model_and_an_unknown_device_are_refused_by_name(tmp_path):
    """A tokenizer with more tokens than the model's vocabulary would give ids past its embedding; an
    unknown device name is the --device argument's error, as on the command line."""
    from lm.model import TransformerLM

    run, _, tok = make_run_dir(tmp_path, ("Lily had a red ball. " + EOT) * 40, 300, context_length=16,
                               d_model=32, num_layers=1, num_heads=2, d_ff=64)
    save_model(run, TransformerLM(vocab_size=260, context_length=16, d_model=32, num_layers=1, num_heads=2,
                                  d_ff=64))
    assert tok.vocab_size > 260  # the text gives that many merges
    with pytest.raises(ValueError) as e:
        load_model_and_tokenizer(run)
    assert str(e.value) == (f"--tokenizer: {str(run / 'tokenizer')!r} has {tok.vocab_size} tokens, more than the "
                            "model's vocab_size 260")
    with pytest.raises(ValueError, match=r"^--device: unknown device 'gpu0'"):
        load_model_and_tokenizer(run, device="gpu0")
